#pragma once
/// \file
/// Element loops the synchronizer runs on gradient slices: scaling in place and converting between
/// the buffer's type and the type on the wire (with the scale folded into the conversion, so a
/// scaled, converted bucket costs one pass over memory, not two).

#include <cstddef>
#include <span>
#include <type_traits>

#include <weft/core/dtype.hpp>

namespace weft::grad::detail {

template <class T>
constexpr bool is_16bit_float_v = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

/// The element type that arithmetic on T is done in (float for the 16-bit types).
template <class T>
using compute_t = std::conditional_t<is_16bit_float_v<T>, float, T>;

template <class To, class From>
To convert(From value) noexcept {
  if constexpr (std::is_same_v<To, From>) {
    return value;
  } else if constexpr (is_16bit_float_v<From> || is_16bit_float_v<To>) {
    return To(static_cast<float>(value));
  } else {
    return static_cast<To>(value);
  }
}

/// data[i] *= factor.
template <class T>
void scale_in_place(std::span<T> data, double factor) noexcept {
  using C = compute_t<T>;
  const C f = static_cast<C>(factor);
  for (T& x : data) x = convert<T>(static_cast<C>(convert<C>(x) * f));
}

/// to[i] = from[i] * factor, converting element types.
template <class To, class From>
void convert_scaled(std::span<const From> from, std::span<To> to, double factor) noexcept {
  using C = std::conditional_t<std::is_same_v<compute_t<From>, double> || std::is_same_v<compute_t<To>, double>,
                               double, float>;
  const C f = static_cast<C>(factor);
  if (factor == 1.0) {
    for (std::size_t i = 0; i < from.size(); ++i) to[i] = convert<To>(from[i]);
  } else {
    for (std::size_t i = 0; i < from.size(); ++i) to[i] = convert<To>(static_cast<C>(convert<C>(from[i]) * f));
  }
}

/// data[i] += add[i].
template <class T>
void add_in_place(std::span<T> data, std::span<const T> add) noexcept {
  using C = compute_t<T>;
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = convert<T>(static_cast<C>(convert<C>(data[i]) + convert<C>(add[i])));
}

}  // namespace weft::grad::detail
