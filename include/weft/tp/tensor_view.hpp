#pragma once
/// \file
/// `weft::tp::tensor_view<T>`: a row-major tensor as tensor parallelism sees it, a shape and a
/// span over its elements (host memory on MPI, device memory on NCCL). Nothing more: no strides,
/// no ownership. What "along dimension d" means for the mappings: the tensor is read as
/// [outer, extent, inner], with outer the product of the dimensions before d and inner the product
/// of those after it; rank i of a group of p holds rows [i·extent/p, (i+1)·extent/p) of the middle
/// one. Dimension 0 of a [sequence, batch, hidden] activation splits into contiguous blocks (one
/// copy-free collective); any other dimension into `outer` strided pieces per rank.

#include <cstddef>
#include <initializer_list>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace weft::tp {

/// Product of `shape` (1 for a scalar's empty shape).
inline std::size_t element_count(std::span<const std::size_t> shape) noexcept {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}

/// "[a, b, c]", for messages.
inline std::string shape_text(std::span<const std::size_t> shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

/// A tensor read as [outer, extent, inner] around one dimension.
struct split_shape {
  std::size_t outer = 1;
  std::size_t extent = 1;
  std::size_t inner = 1;
};

/// A row-major tensor: `shape` (outermost first) over `data`, which holds exactly
/// element_count(shape) elements (the mappings check it).
template <class T>
struct tensor_view {
  std::span<T> data;
  std::vector<std::size_t> shape;

  tensor_view() = default;
  tensor_view(std::span<T> d, std::vector<std::size_t> s) : data(d), shape(std::move(s)) {}
  tensor_view(std::span<T> d, std::initializer_list<std::size_t> s) : data(d), shape(s) {}
  /// A read-only view of a mutable one.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  tensor_view(const tensor_view<U>& other) : data(other.data), shape(other.shape) {}

  std::size_t rank() const noexcept { return shape.size(); }
  std::size_t size() const noexcept { return data.size(); }

  /// [outer, extent, inner] around `dim` (which must be < rank(); the mappings check it).
  split_shape around(std::size_t dim) const noexcept {
    split_shape s;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i < dim) s.outer *= shape[i];
      else if (i == dim) s.extent = shape[i];
      else s.inner *= shape[i];
    }
    return s;
  }

  /// The shape with dimension `dim` multiplied by `factor` / divided by `divisor` (what a gather
  /// or a scatter along `dim` produces).
  std::vector<std::size_t> scaled(std::size_t dim, std::size_t factor, std::size_t divisor = 1) const {
    std::vector<std::size_t> s = shape;
    if (dim < s.size()) s[dim] = s[dim] * factor / divisor;
    return s;
  }
};

template <class T>
tensor_view(std::span<T>, std::vector<std::size_t>) -> tensor_view<T>;

}  // namespace weft::tp
