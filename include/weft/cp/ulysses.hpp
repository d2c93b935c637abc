#pragma once
/// \file
/// All-to-all context parallelism (the DeepSpeed-Ulysses scheme): attention needs every token but
/// each head is independent, so instead of moving K/V around a ring, one all-to-all turns the
/// sequence-sharded tensors [local tokens, heads, head_dim] into head-sharded ones
/// [all tokens, heads/cp, head_dim]; each rank attends over the whole sequence for its heads, and
/// the inverse all-to-all brings the output back to the sequence-sharded layout. The backward pass
/// is the same exchanges the other way: the gradient of `to_heads` is `to_sequence` and vice versa.
///
/// The rows of a head-sharded tensor are in rank order (rank 0's tokens, then rank 1's, ...), not
/// sorted by position: attention does not care about the order of tokens as long as the causal
/// mask uses their positions, which `positions()` gives (the identity for the contiguous split).
///
/// The exchanges are templated on the backend and work on host (MPI) and device (NCCL) memory; on
/// NCCL the packing runs as strided device copies on the communicator's stream, in order with the
/// all-to-all. `forward` / `backward` add the local attention kernel (the CPU reference by
/// default; a device kernel with NCCL).
///
/// Collective: every rank of the cp group calls the same members in the same order.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/config.hpp>
#include <weft/core/error.hpp>
#include <weft/cp/attention_reference.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ring_attention.hpp>

#if WEFT_HAS_NCCL
#include <cuda_runtime_api.h>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/nccl/detail/stream_buffer.hpp>
#endif

namespace weft::cp {

/// The divisors of `heads` nearest to `cp`: the largest below it and the smallest above it (0 when
/// there is none).
inline std::pair<std::size_t, std::size_t> nearest_head_divisors(std::size_t heads, std::size_t cp) {
  std::size_t below = 0, above = 0;
  for (std::size_t d = 1; d <= heads; ++d) {
    if (heads % d != 0) continue;
    if (d < cp) below = d;
    if (d > cp && above == 0) above = d;
  }
  return {below, above};
}

namespace detail {

template <class T>
std::span<T> as_span(std::vector<T>& v, std::size_t) {
  return std::span<T>(v);
}
#if WEFT_HAS_NCCL
template <class T>
std::span<T> as_span(weft::detail::nccl::stream_buffer& b, std::size_t n) {
  return std::span<T>(reinterpret_cast<T*>(b.data()), n);
}
#endif

/// Scratch of n elements in the memory of B's buffers, usable in order with B's operations.
template <backend B, class T>
auto staging(communicator<B>& group, std::size_t n) {
  if constexpr (buffer_memory_v<B> == memory_space::host) {
    (void)group;
    return std::vector<T>(n);
  } else {
#if WEFT_HAS_NCCL
    return weft::detail::nccl::stream_buffer(n * sizeof(T), group.native().stream());
#else
    static_assert(buffer_memory_v<B> == memory_space::host, "weft::cp: device buffers need a build with CUDA");
#endif
  }
}

/// `height` rows of `width` elements from src (rows `src_pitch` apart) to dst (`dst_pitch` apart).
template <backend B, class T>
void copy_rows(communicator<B>& group, T* dst, std::size_t dst_pitch, const T* src, std::size_t src_pitch,
               std::size_t width, std::size_t height) {
  if constexpr (buffer_memory_v<B> == memory_space::host) {
    (void)group;
    for (std::size_t r = 0; r < height; ++r)
      for (std::size_t c = 0; c < width; ++c) dst[r * dst_pitch + c] = src[r * src_pitch + c];
  } else {
#if WEFT_HAS_NCCL
    WEFT_CHECK_CUDA(cudaMemcpy2DAsync(dst, dst_pitch * sizeof(T), src, src_pitch * sizeof(T), width * sizeof(T),
                                      height, cudaMemcpyDeviceToDevice, group.native().stream()));
#else
    static_assert(buffer_memory_v<B> == memory_space::host, "weft::cp: device buffers need a build with CUDA");
#endif
  }
}

}  // namespace detail

template <backend B>
class ulysses {
 public:
  using backend_type = B;

  /// `shape` is the full attention shape (all heads). Collective over `group` (one small
  /// all-gather that checks every rank passed the same split and shape). Refuses, on every rank
  /// and before any tensor data is sent: a split whose cp is not the group's size, a sequence the
  /// split cannot cut, and heads not divisible by cp (naming the nearest cp that would work).
  ulysses(communicator<B>& group, sequence_split split, attention_shape shape)
      : group_(group.ref()), split_(split), shape_(shape) {
    group.expect_same_on_all_ranks("the Ulysses configuration (sequence length, split, heads, head_dim)",
                                   detail::configuration_fingerprint(split, shape, {}));
    const std::string where = "Ulysses all-to-all on group '" + group.name() + "' (rank " +
                              std::to_string(group.rank()) + " of " + std::to_string(group.size()) + ")";
    if (split.cp != group.size())
      fail(where + ": the sequence split is for cp=" + std::to_string(split.cp) + " but the group has " +
           std::to_string(group.size()) + " ranks; build the split with cp = the cp group's size");
    validate(split_);
    const auto cp = static_cast<std::size_t>(group.size());
    if (shape.heads == 0 || shape.heads % cp != 0) {
      auto [below, above] = nearest_head_divisors(shape.heads, cp);
      std::string nearest;
      if (below != 0) nearest = "cp=" + std::to_string(below);
      if (above != 0) nearest += (nearest.empty() ? "cp=" : " or cp=") + std::to_string(above);
      fail(where + ": " + std::to_string(shape.heads) + " attention heads do not divide over cp=" +
           std::to_string(cp) + " ranks (each rank takes heads/cp whole heads); the nearest cp that divide " +
           std::to_string(shape.heads) + " heads: " + (nearest.empty() ? std::string("none") : nearest) +
           " (or use ring attention, which has no such limit)");
    }
    for (int r = 0; r < split.cp; ++r)
      for (std::int64_t p : cp::positions(split_, r)) positions_.push_back(p);
  }

  const sequence_split& split() const noexcept { return split_; }
  std::size_t local_tokens() const noexcept { return static_cast<std::size_t>(cp::local_tokens(split_)); }
  std::size_t heads_per_rank() const noexcept { return shape_.heads / static_cast<std::size_t>(split_.cp); }
  /// The shape of a head-sharded tensor's rows: heads/cp heads of head_dim.
  attention_shape local_shape() const noexcept { return {heads_per_rank(), shape_.head_dim}; }
  /// Elements of a sequence-sharded tensor [local tokens, heads, head_dim].
  std::size_t sequence_sharded_size() const noexcept { return local_tokens() * shape_.row(); }
  /// Elements of a head-sharded tensor [seq, heads/cp, head_dim].
  std::size_t head_sharded_size() const noexcept { return static_cast<std::size_t>(split_.seq) * local_shape().row(); }
  /// The global position of each row of a head-sharded tensor (rank order).
  std::span<const std::int64_t> positions() const noexcept { return positions_; }

  /// [local tokens, heads, head_dim] → [seq, heads/cp, head_dim] (this rank's heads of every token).
  template <class T>
  void to_heads(std::type_identity_t<std::span<const T>> sequence_sharded,
                std::type_identity_t<std::span<T>> head_sharded) {
    communicator<B>& group = group_.get();
    expect(group, "to_heads", "the sequence-sharded input", sequence_sharded.size(), sequence_sharded_size());
    expect(group, "to_heads", "the head-sharded output", head_sharded.size(), head_sharded_size());
    const std::size_t cp = static_cast<std::size_t>(group.size()), s = local_tokens();
    const std::size_t block = local_shape().row(), row = shape_.row();
    auto scratch = detail::staging<B, T>(group, sequence_sharded.size());
    std::span<T> packed = detail::as_span<T>(scratch, sequence_sharded.size());
    // Block j of the send buffer: heads [j·hp, (j+1)·hp) of every local token, for rank j.
    for (std::size_t j = 0; j < cp; ++j)
      detail::copy_rows<B, T>(group, packed.data() + j * s * block, block, sequence_sharded.data() + j * block, row,
                              block, s);
    group.all_to_all(std::span<const T>(packed), head_sharded);
  }

  /// [seq, heads/cp, head_dim] → [local tokens, heads, head_dim]: the inverse of to_heads.
  template <class T>
  void to_sequence(std::type_identity_t<std::span<const T>> head_sharded,
                   std::type_identity_t<std::span<T>> sequence_sharded) {
    communicator<B>& group = group_.get();
    expect(group, "to_sequence", "the head-sharded input", head_sharded.size(), head_sharded_size());
    expect(group, "to_sequence", "the sequence-sharded output", sequence_sharded.size(), sequence_sharded_size());
    const std::size_t cp = static_cast<std::size_t>(group.size()), s = local_tokens();
    const std::size_t block = local_shape().row(), row = shape_.row();
    auto scratch = detail::staging<B, T>(group, sequence_sharded.size());
    std::span<T> packed = detail::as_span<T>(scratch, sequence_sharded.size());
    // Block i of the receive buffer: rank i's heads of this rank's tokens.
    group.all_to_all(head_sharded, packed);
    for (std::size_t i = 0; i < cp; ++i)
      detail::copy_rows<B, T>(group, sequence_sharded.data() + i * block, row, packed.data() + i * s * block, block,
                              block, s);
  }

  /// out ([local tokens, heads, head_dim]) and lse: the attention of this rank's tokens over the
  /// whole sequence. lse is head-sharded, [seq, heads/cp] in the rows of positions(); keep it for
  /// backward.
  template <class T, class Kernel = reference_attention>
    requires attention_kernel<Kernel, T>
  void forward(std::type_identity_t<std::span<const T>> q, std::type_identity_t<std::span<const T>> k,
               std::type_identity_t<std::span<const T>> v, std::type_identity_t<std::span<T>> out,
               std::type_identity_t<std::span<T>> lse, attention_options options = {}, const Kernel& kernel = {}) {
    static_assert(kernel_runs_on<Kernel, B>,
                  "weft::cp::ulysses: the attention kernel must work on the memory this backend's buffers live in; the CPU "
                  "reference (reference_attention) works on host memory only, so with the NCCL backend pass a device "
                  "kernel whose `memory` is memory_space::device");
    communicator<B>& group = group_.get();
    expect(group, "forward", "lse", lse.size(), static_cast<std::size_t>(split_.seq) * heads_per_rank());
    options.scale = softmax_scale(shape_, options);
    const std::size_t n = head_sharded_size();
    auto qh = kernel.template allocate<T>(n), kh = kernel.template allocate<T>(n);
    auto vh = kernel.template allocate<T>(n), oh = kernel.template allocate<T>(n);
    to_heads<T>(q, std::span<T>(qh));
    to_heads<T>(k, std::span<T>(kh));
    to_heads<T>(v, std::span<T>(vh));
    kernel.forward(std::span<const T>(qh), positions(), std::span<const T>(kh), std::span<const T>(vh), positions(),
                   local_shape(), options, std::span<T>(oh), lse);
    to_sequence<T>(std::span<const T>(oh), out);
  }

  /// dq, dk, dv (sequence-sharded) from the forward's out and lse and dout. It exchanges q, k, v,
  /// out and dout to heads again; a trainer that kept the head-sharded tensors of the forward pass
  /// can call to_heads / to_sequence and its kernel itself and skip those exchanges.
  template <class T, class Kernel = reference_attention>
    requires attention_kernel<Kernel, T>
  void backward(std::type_identity_t<std::span<const T>> q, std::type_identity_t<std::span<const T>> k,
                std::type_identity_t<std::span<const T>> v, std::type_identity_t<std::span<const T>> out,
                std::type_identity_t<std::span<const T>> lse, std::type_identity_t<std::span<const T>> dout,
                std::type_identity_t<std::span<T>> dq, std::type_identity_t<std::span<T>> dk,
                std::type_identity_t<std::span<T>> dv, attention_options options = {}, const Kernel& kernel = {}) {
    static_assert(kernel_runs_on<Kernel, B>,
                  "weft::cp::ulysses: the attention kernel must work on the memory this backend's buffers live in; the CPU "
                  "reference (reference_attention) works on host memory only, so with the NCCL backend pass a device "
                  "kernel whose `memory` is memory_space::device");
    communicator<B>& group = group_.get();
    expect(group, "backward", "lse", lse.size(), static_cast<std::size_t>(split_.seq) * heads_per_rank());
    options.scale = softmax_scale(shape_, options);
    const std::size_t n = head_sharded_size();
    auto qh = kernel.template allocate<T>(n), kh = kernel.template allocate<T>(n);
    auto vh = kernel.template allocate<T>(n), oh = kernel.template allocate<T>(n);
    auto doh = kernel.template allocate<T>(n), dqh = kernel.template allocate<T>(n);
    auto dkh = kernel.template allocate<T>(n), dvh = kernel.template allocate<T>(n);
    to_heads<T>(q, std::span<T>(qh));
    to_heads<T>(k, std::span<T>(kh));
    to_heads<T>(v, std::span<T>(vh));
    to_heads<T>(out, std::span<T>(oh));
    to_heads<T>(dout, std::span<T>(doh));
    kernel.fill(std::span<T>(dqh), T(0));
    kernel.fill(std::span<T>(dkh), T(0));
    kernel.fill(std::span<T>(dvh), T(0));
    kernel.backward(std::span<const T>(qh), positions(), std::span<const T>(kh), std::span<const T>(vh), positions(),
                    local_shape(), options, std::span<const T>(oh), lse, std::span<const T>(doh), std::span<T>(dqh),
                    std::span<T>(dkh), std::span<T>(dvh));
    to_sequence<T>(std::span<const T>(dqh), dq);
    to_sequence<T>(std::span<const T>(dkh), dk);
    to_sequence<T>(std::span<const T>(dvh), dv);
  }

 private:
  void expect(const communicator<B>& group, const char* call, const char* what, std::size_t got,
              std::size_t want) const {
    if (got != want)
      fail("Ulysses all-to-all on group '" + group.name() + "' (rank " + std::to_string(group.rank()) + " of " +
           std::to_string(group.size()) + "), " + call + ": " + what + " has " + std::to_string(got) +
           " elements; expected " + std::to_string(want) + " (sequence " + std::to_string(split_.seq) + ", " +
           std::to_string(local_tokens()) + " local tokens, " + std::to_string(shape_.heads) + " heads, " +
           std::to_string(heads_per_rank()) + " per rank, head_dim " + std::to_string(shape_.head_dim) +
           "); nothing was sent");
  }

  communicator_ref<B> group_;
  sequence_split split_;
  attention_shape shape_;
  std::vector<std::int64_t> positions_;
};

}  // namespace weft::cp
