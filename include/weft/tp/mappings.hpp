#pragma once
/// \file
/// The communication around tensor-parallel layers, on the tp group, as plain functions of
/// (communicator, input, output). Each mapping has a forward and a backward function, and the
/// backward of each is the forward of its conjugate:
///
/// | mapping                    | forward                         | backward                        |
/// |----------------------------|---------------------------------|---------------------------------|
/// | copy_to_tp_region     (f)  | identity                        | all-reduce (sum)                |
/// | reduce_from_tp_region (g)  | all-reduce (sum)                | identity                        |
/// | scatter_to_tp_region       | keep this rank's slice of a dim | all-gather along that dim       |
/// | gather_from_tp_region      | all-gather along a dim          | keep this rank's slice          |
/// | all_gather_sequence (SP)   | all-gather along the sequence   | reduce-scatter along it         |
/// | reduce_scatter_sequence    | reduce-scatter along the seq.   | all-gather along it             |
///
/// A column-parallel layer starts with copy_to (or all_gather_sequence under sequence
/// parallelism); a row-parallel layer ends with reduce_from (or reduce_scatter_sequence).
///
/// Tensors are row-major `tensor_view`s (weft/tp/tensor_view.hpp); "along dimension d" splits
/// dimension d into group-size equal parts, rank i holding part i. Along dimension 0 every
/// collective works on the caller's buffers directly; along another dimension the pieces are
/// strided, so a gather or reduce-scatter goes through a workspace of the full tensor's size
/// (allocated per call on host memory when the caller passes none; on device memory the caller
/// passes it, since these headers do not allocate device memory behind a call).
///
/// Backends: every mapping works on any `communicator<B>`: host spans on MPI, device spans on
/// NCCL, where the collectives and the local strided copies (cudaMemcpy2DAsync) are enqueued on
/// the communicator's stream (the caller's, after `use_stream`), so they are ordered after the
/// work that produced their input. The calls are blocking: they return when the result is in
/// place (on NCCL, after waiting for the stream to reach it).
///
/// Errors (shapes that do not divide by the group size, outputs of the wrong size, a dimension
/// the tensor lacks) throw weft::error naming the mapping, the group and the rank before anything
/// is sent, so the group stays usable; every rank of a group with the same shapes throws alike.

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/config.hpp>
#include <weft/core/error.hpp>
#include <weft/tp/tensor_view.hpp>

#if WEFT_HAS_CUDA
#include <cuda_runtime_api.h>

#include <weft/backend/cuda/check.hpp>
#endif

namespace weft::tp {

namespace detail {

template <backend B>
std::string where(communicator<B>& comm, std::string_view mapping) {
  return std::string(mapping) + " on group '" + comm.name() + "' (rank " + std::to_string(comm.rank()) + " of " +
         std::to_string(comm.size()) + ")";
}

/// The checks every mapping along a dimension makes: the dimension exists, the data matches the
/// shape, and the split dimension divides by the group size (or, for gathers, nothing to divide).
template <backend B, class T>
split_shape check_view(communicator<B>& comm, std::string_view mapping, const tensor_view<T>& view, std::size_t dim,
                       bool must_divide) {
  if (dim >= view.rank())
    fail(where(comm, mapping) + ": dimension " + std::to_string(dim) + " does not exist in a tensor of shape " +
         shape_text(view.shape) + "; pass a dimension from 0 to " + std::to_string(view.rank() - 1));
  if (view.data.size() != element_count(view.shape))
    fail(where(comm, mapping) + ": the tensor's span has " + std::to_string(view.data.size()) +
         " elements but its shape " + shape_text(view.shape) + " has " + std::to_string(element_count(view.shape)) +
         "; describe the buffer with its true shape");
  const split_shape s = view.around(dim);
  if (must_divide && s.extent % static_cast<std::size_t>(comm.size()) != 0)
    fail(where(comm, mapping) + ": dimension " + std::to_string(dim) + " of shape " + shape_text(view.shape) +
         " has " + std::to_string(s.extent) + " rows, not a multiple of the group size " +
         std::to_string(comm.size()) + "; pad that dimension or choose a tp degree that divides it");
  return s;
}

template <backend B>
void check_output(communicator<B>& comm, std::string_view mapping, std::string_view what, std::size_t got,
                  const std::vector<std::size_t>& shape) {
  if (got != element_count(shape))
    fail(where(comm, mapping) + ": the " + std::string(what) + " has " + std::to_string(got) +
         " elements but must have " + std::to_string(element_count(shape)) + " (shape " + shape_text(shape) +
         "); pass an output of that size");
}

/// Copies `height` rows of `width` elements from `src` (rows `src_pitch` apart) to `dst` (rows
/// `dst_pitch` apart), in elements: std::copy on host memory, cudaMemcpy2DAsync on the
/// communicator's stream on device memory.
template <backend B, class T>
void copy_rows(communicator<B>& comm, T* dst, std::size_t dst_pitch, const T* src, std::size_t src_pitch,
               std::size_t width, std::size_t height) {
  if (width == 0 || height == 0) return;
  if constexpr (buffer_memory_v<B> == memory_space::host) {
    (void)comm;
    for (std::size_t row = 0; row < height; ++row) std::copy_n(src + row * src_pitch, width, dst + row * dst_pitch);
  } else {
#if WEFT_HAS_CUDA
    static_assert(requires { comm.native().stream(); },
                  "weft::tp: a backend with device buffers must give its stream (comm.native().stream())");
    WEFT_CHECK_CUDA(cudaMemcpy2DAsync(dst, dst_pitch * sizeof(T), src, src_pitch * sizeof(T), width * sizeof(T), height,
                                      cudaMemcpyDeviceToDevice, comm.native().stream()));
#else
    static_assert(buffer_memory_v<B> == memory_space::host,
                  "weft::tp: device-memory tensors need a build with CUDA (weft::nccl)");
#endif
  }
}

/// The mappings are blocking (see the file comment): on device memory, waits until the stream has
/// carried out the local copies that end a mapping, watching NCCL's error state and the deadline
/// as the collectives' waits do.
template <backend B>
void wait_for_local_copies(communicator<B>& comm) {
  if constexpr (buffer_memory_v<B> == memory_space::device) comm.native().wait_all();
}

/// The workspace a strided gather or reduce-scatter goes through: the caller's, or a host vector.
template <backend B, class T>
std::span<T> workspace_for(communicator<B>& comm, std::string_view mapping, std::span<T> given, std::size_t needed,
                           std::vector<T>& own) {
  if (given.size() >= needed) return given.first(needed);
  if (!given.empty())
    fail(where(comm, mapping) + ": the workspace has " + std::to_string(given.size()) + " elements but needs " +
         std::to_string(needed) + " (the full tensor's size); pass a larger one, or none on host memory");
  if constexpr (buffer_memory_v<B> == memory_space::host) {
    own.resize(needed);
    return own;
  } else {
    fail(where(comm, mapping) + ": a gather or reduce-scatter along a dimension other than 0 of device memory needs a "
         "workspace of " + std::to_string(needed) + " elements of device memory; pass one (weft does not allocate "
         "device memory inside a mapping)");
  }
}

}  // namespace detail

// ---- f and g: identity one way, all-reduce the other ---------------------------------------

/// copy_to_tp_region, forward: identity (every rank of the group already holds the whole input).
/// Returns its input, so call sites read the same as the other mappings.
template <backend B, class T>
tensor_view<T> copy_to_tp_region(communicator<B>&, tensor_view<T> input) {
  return input;
}
/// copy_to_tp_region, backward: the input's gradient is the sum of every rank's, in place.
template <backend B, class T>
void copy_to_tp_region_backward(communicator<B>& tp, std::span<T> grad) {
  tp.all_reduce(grad, reduce_op::sum);
}

/// reduce_from_tp_region, forward: the sum over the group of every rank's partial output, in place.
template <backend B, class T>
void reduce_from_tp_region(communicator<B>& tp, std::span<T> partial) {
  tp.all_reduce(partial, reduce_op::sum);
}
/// reduce_from_tp_region, backward: identity (every rank needs the whole output gradient).
template <backend B, class T>
tensor_view<T> reduce_from_tp_region_backward(communicator<B>&, tensor_view<T> grad) {
  return grad;
}

// ---- scatter / gather along a dimension -------------------------------------------------------

/// scatter_to_tp_region, forward: `shard` receives this rank's part of `full` along `dim` (no
/// communication). `shard` has full's shape with dimension `dim` divided by the group size.
template <backend B, class T>
void scatter_to_tp_region(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> full, std::span<T> shard, std::size_t dim) {
  constexpr std::string_view name = "scatter_to_tp_region";
  const split_shape s = detail::check_view(tp, name, full, dim, true);
  const auto p = static_cast<std::size_t>(tp.size());
  detail::check_output(tp, name, "shard", shard.size(), full.scaled(dim, 1, p));
  const std::size_t width = s.extent / p * s.inner;
  detail::copy_rows(tp, shard.data(), width, full.data.data() + static_cast<std::size_t>(tp.rank()) * width,
                    s.extent * s.inner, width, s.outer);
  detail::wait_for_local_copies(tp);
}

/// gather_from_tp_region, forward: `full` receives every rank's `shard`, concatenated along `dim`
/// in rank order. `workspace` (full's size) is needed for dim > 0 on device memory only.
template <backend B, class T>
void gather_from_tp_region(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> shard, std::span<T> full, std::size_t dim,
                           std::span<T> workspace = {}) {
  constexpr std::string_view name = "gather_from_tp_region";
  const split_shape s = detail::check_view(tp, name, shard, dim, false);
  const auto p = static_cast<std::size_t>(tp.size());
  detail::check_output(tp, name, "output", full.size(), shard.scaled(dim, p));
  if (s.outer == 1) {
    tp.all_gather(shard.data, full);
    return;
  }
  std::vector<T> own;
  std::span<T> staged = detail::workspace_for(tp, name, workspace, full.size(), own);
  tp.all_gather(shard.data, staged);
  const std::size_t width = s.extent * s.inner;  // one rank's piece of one outer row
  for (std::size_t r = 0; r < p; ++r)
    detail::copy_rows(tp, full.data() + r * width, p * width, staged.data() + r * shard.size(), width, width, s.outer);
  detail::wait_for_local_copies(tp);
}

/// scatter_to_tp_region, backward: the gradient of the whole tensor is every rank's shard
/// gradient gathered along `dim`.
template <backend B, class T>
void scatter_to_tp_region_backward(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> grad_shard, std::span<T> grad_full,
                                   std::size_t dim, std::span<T> workspace = {}) {
  gather_from_tp_region(tp, grad_shard, grad_full, dim, workspace);
}

/// gather_from_tp_region, backward: this rank keeps its part of the whole gradient along `dim`.
template <backend B, class T>
void gather_from_tp_region_backward(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> grad_full, std::span<T> grad_shard,
                                    std::size_t dim) {
  scatter_to_tp_region(tp, grad_full, grad_shard, dim);
}

// ---- sequence parallelism (Megatron): all-gather / reduce-scatter along the sequence ----------

/// reduce-scatter along `dim`: `shard` receives the sum over the group of this rank's part of
/// every rank's `full`. The building block of reduce_scatter_sequence and of all_gather_sequence's
/// backward.
template <backend B, class T>
void reduce_scatter_along(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> full, std::span<T> shard, std::size_t dim,
                          std::span<T> workspace = {}) {
  constexpr std::string_view name = "reduce_scatter_along";
  const split_shape s = detail::check_view(tp, name, full, dim, true);
  const auto p = static_cast<std::size_t>(tp.size());
  detail::check_output(tp, name, "shard", shard.size(), full.scaled(dim, 1, p));
  if (s.outer == 1) {
    tp.reduce_scatter(full.data, shard, reduce_op::sum);
    return;
  }
  std::vector<T> own;
  std::span<T> staged = detail::workspace_for(tp, name, workspace, full.size(), own);
  const std::size_t width = s.extent / p * s.inner;
  for (std::size_t r = 0; r < p; ++r)  // rank-major blocks, as reduce_scatter wants them
    detail::copy_rows(tp, staged.data() + r * shard.size(), width, full.data.data() + r * width, s.extent * s.inner,
                      width, s.outer);
  tp.reduce_scatter(std::span<const T>(staged), shard, reduce_op::sum);
}

/// Sequence parallelism, before a column-parallel layer: every rank's sequence shard `local`
/// (sequence dimension `seq_dim`, 0 in Megatron's [s, b, h]) gathered into the whole sequence.
template <backend B, class T>
void all_gather_sequence(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> local, std::span<T> full, std::size_t seq_dim = 0,
                         std::span<T> workspace = {}) {
  gather_from_tp_region(tp, local, full, seq_dim, workspace);
}
/// Its backward: the whole sequence's gradient, summed over the group (each rank's column-parallel
/// shard contributed a part) and scattered back along the sequence.
template <backend B, class T>
void all_gather_sequence_backward(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> grad_full, std::span<T> grad_local,
                                  std::size_t seq_dim = 0, std::span<T> workspace = {}) {
  reduce_scatter_along(tp, grad_full, grad_local, seq_dim, workspace);
}

/// Sequence parallelism, after a row-parallel layer: the partial outputs summed over the group,
/// each rank keeping its sequence shard.
template <backend B, class T>
void reduce_scatter_sequence(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> partial_full, std::span<T> local,
                             std::size_t seq_dim = 0, std::span<T> workspace = {}) {
  reduce_scatter_along(tp, partial_full, local, seq_dim, workspace);
}
/// Its backward: every rank's sequence shard of the gradient gathered into the whole sequence.
template <backend B, class T>
void reduce_scatter_sequence_backward(communicator<B>& tp, std::type_identity_t<tensor_view<const T>> grad_local, std::span<T> grad_full,
                                      std::size_t seq_dim = 0, std::span<T> workspace = {}) {
  gather_from_tp_region(tp, grad_local, grad_full, seq_dim, workspace);
}

}  // namespace weft::tp
