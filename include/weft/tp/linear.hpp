#pragma once
/// \file
/// Reference CPU column- and row-parallel linear layers (Megatron's split of y = x Wᵀ + b over
/// the tp group), forward and backward, with or without sequence parallelism: what tests, the
/// example trainer and users start from. The arithmetic is plain loops in a fixed order, chosen
/// to be obviously correct, not fast; a trainer should call its BLAS (or cuBLAS on device
/// memory) where these call `reference::matmul_*`, and keep the communication as it is here.
///
/// Shapes (row-major; `tokens` is the flattened sequence x batch, `p` the tp group's size):
///
/// | layer  | weight shard   | bias shard | x                                 | y                                |
/// |--------|----------------|------------|-----------------------------------|----------------------------------|
/// | column | [out/p, in]    | [out/p]    | [tokens, in]; SP: [tokens/p, in]  | [tokens, out/p]; gather_output: [tokens, out] |
/// | row    | [out, in/p]    | [out]      | [tokens, in/p]; not input_is_parallel: [tokens, in] | [tokens, out]; SP: [tokens/p, out] |
///
/// Column: x -> copy_to (SP: all_gather_sequence) -> x Wᵢᵀ + bᵢ [-> gather along the last dim].
/// Row: [scatter along the last dim ->] xᵢ Wᵢᵀ -> reduce_from (SP: reduce_scatter_sequence) -> + b.
/// Backward applies the conjugate mappings; weight and bias gradients are this rank's shards,
/// complete (no further tp reduction needed, also under SP, where the row layer's bias gradient
/// is summed over the gathered output gradient).
///
/// Host memory only (the MPI backend): a layer on a device-memory backend is refused at compile
/// time. The layer keeps its (gathered) input from forward for backward, like an autograd node.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/error.hpp>
#include <weft/tp/mappings.hpp>
#include <weft/tp/tensor_view.hpp>

namespace weft::tp {

namespace reference {

/// c[m, n] = a[m, k] · b[n, k]ᵀ (overwrites c). Each c[i, j] sums over k in increasing order, so a
/// row's result does not depend on how many rows are computed together.
template <class T>
void matmul_nt(const T* a, const T* b, T* c, std::size_t m, std::size_t n, std::size_t k) {
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      T sum{};
      for (std::size_t q = 0; q < k; ++q) sum += a[i * k + q] * b[j * k + q];
      c[i * n + j] = sum;
    }
}

/// c[m, n] = a[m, k] · b[k, n] (overwrites c).
template <class T>
void matmul_nn(const T* a, const T* b, T* c, std::size_t m, std::size_t n, std::size_t k) {
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      T sum{};
      for (std::size_t q = 0; q < k; ++q) sum += a[i * k + q] * b[q * n + j];
      c[i * n + j] = sum;
    }
}

/// c[m, n] = a[k, m]ᵀ · b[k, n] (overwrites c): a weight gradient dyᵀ x.
template <class T>
void matmul_tn(const T* a, const T* b, T* c, std::size_t m, std::size_t n, std::size_t k) {
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      T sum{};
      for (std::size_t q = 0; q < k; ++q) sum += a[q * m + i] * b[q * n + j];
      c[i * n + j] = sum;
    }
}

/// y[rows, n] += bias[n] on every row.
template <class T>
void add_bias(T* y, const T* bias, std::size_t rows, std::size_t n) {
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < n; ++j) y[i * n + j] += bias[j];
}

/// db[n] = the sum over rows of dy[rows, n].
template <class T>
void sum_rows(const T* dy, T* db, std::size_t rows, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) db[j] = T{};
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < n; ++j) db[j] += dy[i * n + j];
}

}  // namespace reference

struct column_parallel_options {
  bool sequence_parallel = false;  ///< x arrives as this rank's sequence shard; all-gathered first
  bool gather_output = false;      ///< y is gathered along its last dimension into [tokens, out]
  bool has_bias = true;
};

struct row_parallel_options {
  bool sequence_parallel = false;  ///< y leaves as this rank's sequence shard (reduce-scatter)
  bool input_is_parallel = true;   ///< x is already this rank's shard of the features
  bool has_bias = true;
};

namespace detail {

template <backend B>
void expect_divides(communicator<B>& tp, std::string_view layer, std::string_view what, std::size_t value) {
  if (value % static_cast<std::size_t>(tp.size()) != 0)
    fail(where(tp, layer) + ": " + std::string(what) + " = " + std::to_string(value) +
         " does not divide by the tp size " + std::to_string(tp.size()) +
         "; choose a tp degree that divides it or pad the layer");
}

template <backend B>
void expect_size(communicator<B>& tp, std::string_view layer, std::string_view what, std::size_t got,
                 std::size_t want, std::string_view shape) {
  if (got != want)
    fail(where(tp, layer) + ": " + std::string(what) + " has " + std::to_string(got) + " elements but must have " +
         std::to_string(want) + " (" + std::string(shape) + "); pass buffers of this rank's shard sizes");
}

template <backend B>
std::size_t rows_of(communicator<B>& tp, std::string_view layer, std::string_view what, std::size_t elements,
                    std::size_t row) {
  if (row == 0 || elements % row != 0 || elements == 0)
    fail(where(tp, layer) + ": " + std::string(what) + " has " + std::to_string(elements) +
         " elements, not a positive multiple of its row length " + std::to_string(row));
  return elements / row;
}

}  // namespace detail

/// A linear layer whose output features are split over the tp group (Megatron's column-parallel
/// layer): rank i holds rows [i·out/p, (i+1)·out/p) of W and of b.
template <backend B, class T>
class column_parallel_linear {
  static_assert(buffer_memory_v<B> == memory_space::host,
                "weft::tp::column_parallel_linear is a CPU reference on host memory (the MPI backend); on device "
                "memory use the mappings of weft/tp/mappings.hpp around your own GEMMs");

 public:
  /// Checks that out_features divides by the group size.
  column_parallel_linear(communicator<B>& tp, std::size_t in_features, std::size_t out_features,
                         column_parallel_options options = {})
      : tp_(tp.ref()), in_(in_features), out_(out_features), options_(options) {
    detail::expect_divides(tp, name, "out_features", out_);
    local_out_ = out_ / static_cast<std::size_t>(tp.size());
  }

  std::size_t in_features() const noexcept { return in_; }
  std::size_t out_features() const noexcept { return out_; }
  /// This rank's output features: out_features / tp size.
  std::size_t local_out_features() const noexcept { return local_out_; }

  /// y = x Wᵢᵀ + bᵢ (see the file's table for the shapes). Keeps the (gathered) input for backward.
  void forward(std::span<const T> x, std::span<const T> weight, std::span<const T> bias, std::span<T> y) {
    communicator<B>& tp = tp_.get();
    const auto p = static_cast<std::size_t>(tp.size());
    const std::size_t local_rows = detail::rows_of(tp, name, "x", x.size(), in_);
    tokens_ = options_.sequence_parallel ? local_rows * p : local_rows;
    detail::expect_size(tp, name, "weight", weight.size(), local_out_ * in_, "[out/p, in]");
    if (options_.has_bias) detail::expect_size(tp, name, "bias", bias.size(), local_out_, "[out/p]");
    detail::expect_size(tp, name, "y", y.size(), tokens_ * (options_.gather_output ? out_ : local_out_),
                        options_.gather_output ? "[tokens, out]" : "[tokens, out/p]");
    input_.resize(tokens_ * in_);
    if (options_.sequence_parallel)
      all_gather_sequence(tp, tensor_view<const T>(x, {local_rows, in_}), std::span<T>(input_), 0);
    else
      std::copy(x.begin(), x.end(), input_.begin());  // copy_to_tp_region: identity
    std::span<T> local_y = y;
    if (options_.gather_output) {
      staged_.resize(tokens_ * local_out_);
      local_y = staged_;
    }
    reference::matmul_nt(input_.data(), weight.data(), local_y.data(), tokens_, local_out_, in_);
    if (options_.has_bias) reference::add_bias(local_y.data(), bias.data(), tokens_, local_out_);
    if (options_.gather_output)
      gather_from_tp_region(tp, tensor_view<const T>(std::span<const T>(staged_), {tokens_, local_out_}), y, 1);
  }

  /// From dy (y's shape): dx (x's shape), dW (this rank's [out/p, in]) and db ([out/p]), all
  /// overwritten. Uses the input kept by the last forward.
  void backward(std::span<const T> dy, std::span<const T> weight, std::span<T> dx, std::span<T> dweight,
                std::span<T> dbias) {
    communicator<B>& tp = tp_.get();
    const auto p = static_cast<std::size_t>(tp.size());
    if (input_.empty()) fail(detail::where(tp, name) + ": backward before forward; run forward first");
    detail::expect_size(tp, name, "dy", dy.size(), tokens_ * (options_.gather_output ? out_ : local_out_),
                        options_.gather_output ? "[tokens, out]" : "[tokens, out/p]");
    detail::expect_size(tp, name, "dx", dx.size(), (options_.sequence_parallel ? tokens_ / p : tokens_) * in_,
                        options_.sequence_parallel ? "[tokens/p, in]" : "[tokens, in]");
    detail::expect_size(tp, name, "weight", weight.size(), local_out_ * in_, "[out/p, in]");
    detail::expect_size(tp, name, "dweight", dweight.size(), local_out_ * in_, "[out/p, in]");
    if (options_.has_bias) detail::expect_size(tp, name, "dbias", dbias.size(), local_out_, "[out/p]");
    std::span<const T> local_dy = dy;
    if (options_.gather_output) {
      staged_.resize(tokens_ * local_out_);
      gather_from_tp_region_backward(tp, tensor_view<const T>(dy, {tokens_, out_}), std::span<T>(staged_), 1);
      local_dy = staged_;
    }
    reference::matmul_tn(local_dy.data(), input_.data(), dweight.data(), local_out_, in_, tokens_);
    if (options_.has_bias) reference::sum_rows(local_dy.data(), dbias.data(), tokens_, local_out_);
    if (options_.sequence_parallel) {
      grad_input_.resize(tokens_ * in_);
      reference::matmul_nn(local_dy.data(), weight.data(), grad_input_.data(), tokens_, in_, local_out_);
      all_gather_sequence_backward(tp, tensor_view<const T>(std::span<const T>(grad_input_), {tokens_, in_}), dx, 0);
    } else {
      reference::matmul_nn(local_dy.data(), weight.data(), dx.data(), tokens_, in_, local_out_);
      copy_to_tp_region_backward(tp, dx);
    }
  }

 private:
  static constexpr std::string_view name = "column_parallel_linear";
  communicator_ref<B> tp_;
  std::size_t in_, out_, local_out_ = 0, tokens_ = 0;
  column_parallel_options options_;
  std::vector<T> input_, staged_, grad_input_;
};

/// A linear layer whose input features are split over the tp group (Megatron's row-parallel
/// layer): rank i holds columns [i·in/p, (i+1)·in/p) of W; the bias is whole on every rank and
/// added once, after the reduction.
template <backend B, class T>
class row_parallel_linear {
  static_assert(buffer_memory_v<B> == memory_space::host,
                "weft::tp::row_parallel_linear is a CPU reference on host memory (the MPI backend); on device "
                "memory use the mappings of weft/tp/mappings.hpp around your own GEMMs");

 public:
  /// Checks that in_features divides by the group size.
  row_parallel_linear(communicator<B>& tp, std::size_t in_features, std::size_t out_features,
                      row_parallel_options options = {})
      : tp_(tp.ref()), in_(in_features), out_(out_features), options_(options) {
    detail::expect_divides(tp, name, "in_features", in_);
    local_in_ = in_ / static_cast<std::size_t>(tp.size());
  }

  std::size_t in_features() const noexcept { return in_; }
  std::size_t out_features() const noexcept { return out_; }
  /// This rank's input features: in_features / tp size.
  std::size_t local_in_features() const noexcept { return local_in_; }

  /// y = reduce(xᵢ Wᵢᵀ) + b (see the file's table for the shapes). Keeps its input shard.
  void forward(std::span<const T> x, std::span<const T> weight, std::span<const T> bias, std::span<T> y) {
    communicator<B>& tp = tp_.get();
    const auto p = static_cast<std::size_t>(tp.size());
    tokens_ = detail::rows_of(tp, name, "x", x.size(), options_.input_is_parallel ? local_in_ : in_);
    if (options_.sequence_parallel) detail::expect_divides(tp, name, "tokens (sequence parallel)", tokens_);
    detail::expect_size(tp, name, "weight", weight.size(), out_ * local_in_, "[out, in/p]");
    if (options_.has_bias) detail::expect_size(tp, name, "bias", bias.size(), out_, "[out]");
    detail::expect_size(tp, name, "y", y.size(), (options_.sequence_parallel ? tokens_ / p : tokens_) * out_,
                        options_.sequence_parallel ? "[tokens/p, out]" : "[tokens, out]");
    input_.resize(tokens_ * local_in_);
    if (options_.input_is_parallel)
      std::copy(x.begin(), x.end(), input_.begin());
    else
      scatter_to_tp_region(tp, tensor_view<const T>(x, {tokens_, in_}), std::span<T>(input_), 1);
    if (options_.sequence_parallel) {
      partial_.resize(tokens_ * out_);
      reference::matmul_nt(input_.data(), weight.data(), partial_.data(), tokens_, out_, local_in_);
      reduce_scatter_sequence(tp, tensor_view<const T>(std::span<const T>(partial_), {tokens_, out_}), y, 0);
      if (options_.has_bias) reference::add_bias(y.data(), bias.data(), tokens_ / p, out_);
    } else {
      reference::matmul_nt(input_.data(), weight.data(), y.data(), tokens_, out_, local_in_);
      reduce_from_tp_region(tp, y);
      if (options_.has_bias) reference::add_bias(y.data(), bias.data(), tokens_, out_);
    }
  }

  /// From dy (y's shape): dx (x's shape), dW (this rank's [out, in/p]) and db ([out], complete on
  /// every rank), all overwritten. Uses the input kept by the last forward.
  void backward(std::span<const T> dy, std::span<const T> weight, std::span<T> dx, std::span<T> dweight,
                std::span<T> dbias) {
    communicator<B>& tp = tp_.get();
    const auto p = static_cast<std::size_t>(tp.size());
    if (input_.empty()) fail(detail::where(tp, name) + ": backward before forward; run forward first");
    detail::expect_size(tp, name, "dy", dy.size(), (options_.sequence_parallel ? tokens_ / p : tokens_) * out_,
                        options_.sequence_parallel ? "[tokens/p, out]" : "[tokens, out]");
    detail::expect_size(tp, name, "dx", dx.size(), tokens_ * (options_.input_is_parallel ? local_in_ : in_),
                        options_.input_is_parallel ? "[tokens, in/p]" : "[tokens, in]");
    detail::expect_size(tp, name, "weight", weight.size(), out_ * local_in_, "[out, in/p]");
    detail::expect_size(tp, name, "dweight", dweight.size(), out_ * local_in_, "[out, in/p]");
    if (options_.has_bias) detail::expect_size(tp, name, "dbias", dbias.size(), out_, "[out]");
    std::span<const T> full_dy = dy;
    if (options_.sequence_parallel) {
      gathered_dy_.resize(tokens_ * out_);
      reduce_scatter_sequence_backward(tp, tensor_view<const T>(dy, {tokens_ / p, out_}), std::span<T>(gathered_dy_),
                                       0);
      full_dy = gathered_dy_;
    }
    // reduce_from_tp_region's backward: identity.
    reference::matmul_tn(full_dy.data(), input_.data(), dweight.data(), out_, local_in_, tokens_);
    if (options_.has_bias) reference::sum_rows(full_dy.data(), dbias.data(), tokens_, out_);
    if (options_.input_is_parallel) {
      reference::matmul_nn(full_dy.data(), weight.data(), dx.data(), tokens_, local_in_, out_);
    } else {
      partial_.resize(tokens_ * local_in_);
      reference::matmul_nn(full_dy.data(), weight.data(), partial_.data(), tokens_, local_in_, out_);
      scatter_to_tp_region_backward(tp, tensor_view<const T>(std::span<const T>(partial_), {tokens_, local_in_}), dx,
                                    1);
    }
  }

 private:
  static constexpr std::string_view name = "row_parallel_linear";
  communicator_ref<B> tp_;
  std::size_t in_, out_, local_in_ = 0, tokens_ = 0;
  row_parallel_options options_;
  std::vector<T> input_, partial_, gathered_dy_;
};

}  // namespace weft::tp
