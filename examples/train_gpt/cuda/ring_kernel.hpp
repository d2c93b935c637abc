#pragma once
// Context parallelism on GPUs: train_gpt's CUDA attention as the local computation of
// weft::cp::ring_attention (its attention_kernel concept on device memory). The ring hands the
// kernel host spans of global positions, one load-balanced chunk at a time, so each is a run of
// consecutive positions: the kernel passes the device array 0, 1, ..., seq - 1 from the chunk's
// first position. Every launch, the scratch memory included, is on the compute stream; the ring's
// sends and receives run on the cp communicator's own stream, ordered with the computation by
// events (weft::cp::orders_transfers: each transfer after the work queued before it, the work
// after it waiting for it), so the next block travels while this one is attended, and the host
// waits for neither.
//
// Plain C++ (g++ compiles it); the kernels are kernels.hpp's.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include <weft/backend/backend.hpp>
#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/cp/attention_reference.hpp>
#include <weft/cp/ring_attention.hpp>

#include "kernels.hpp"

namespace train_gpt::cuda {

/// Device memory of n elements, allocated and freed in the order of `stream`'s work.
template <class T>
class stream_scratch {
 public:
  stream_scratch(std::size_t n, cudaStream_t stream) : n_(n), stream_(stream) {
    void* p = nullptr;
    WEFT_CHECK_CUDA(cudaMallocAsync(&p, (n == 0 ? 1 : n) * sizeof(T), stream));
    data_ = static_cast<T*>(p);
  }
  stream_scratch(stream_scratch&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), n_(other.n_), stream_(other.stream_) {}
  stream_scratch& operator=(stream_scratch&&) = delete;
  stream_scratch(const stream_scratch&) = delete;
  stream_scratch& operator=(const stream_scratch&) = delete;
  ~stream_scratch() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return n_; }
  T* begin() const noexcept { return data_; }
  T* end() const noexcept { return data_ + n_; }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
  cudaStream_t stream_ = nullptr;
};

/// weft::cp::attention_kernel for float on the GPU (the attention of kernels.hpp).
struct ring_kernel {
  static constexpr weft::memory_space memory = weft::memory_space::device;
  kernels* k = nullptr;
  const std::int64_t* positions = nullptr;  ///< device: 0, 1, ..., seq - 1

  template <class T>
  stream_scratch<T> allocate(std::size_t n) const {
    return stream_scratch<T>(n, k->stream());
  }
  void fill(std::span<float> data, float value) const { k->fill(data.data(), data.size(), value); }

  void forward(std::span<const float> q, std::span<const std::int64_t> q_pos, std::span<const float> key,
               std::span<const float> value, std::span<const std::int64_t> k_pos, weft::cp::attention_shape shape,
               weft::cp::attention_options options, std::span<float> out, std::span<float> lse) const {
    k->attention_forward(q.data(), key.data(), value.data(), on_device(q_pos), on_device(k_pos), q_pos.size(),
                         k_pos.size(), shape.heads, shape.head_dim,
                         static_cast<float>(weft::cp::softmax_scale(shape, options)), options.causal, out.data(),
                         lse.data());
  }
  /// weft::cp::orders_transfers: the cp communicator's stream waits for the compute stream's queued
  /// work (what a transfer sends is written, the slots it receives into are read), and the compute
  /// stream's later work waits for the transfer.
  void before_transfer(weft::communicator<weft::nccl_backend>& group) const {
    weft::cuda::wait_for_stream(group.native().stream(), k->stream());
  }
  void after_transfer(const weft::nccl::request& r) const { r.make_stream_wait(k->stream()); }

  /// Rows x heads fold together: the merge needs only each (row, head)'s vector length.
  void merge(std::span<float> out, std::span<float> lse, std::span<const float> block_out,
             std::span<const float> block_lse) const {
    if (lse.empty()) return;
    k->attention_merge(out.data(), lse.data(), block_out.data(), block_lse.data(), lse.size(), 1,
                       out.size() / lse.size());
  }
  void backward(std::span<const float> q, std::span<const std::int64_t> q_pos, std::span<const float> key,
                std::span<const float> value, std::span<const std::int64_t> k_pos, weft::cp::attention_shape shape,
                weft::cp::attention_options options, std::span<const float> out, std::span<const float> lse,
                std::span<const float> dout, std::span<float> dq, std::span<float> dk, std::span<float> dv) const {
    k->attention_backward(q.data(), key.data(), value.data(), on_device(q_pos), on_device(k_pos), q_pos.size(),
                          k_pos.size(), shape.heads, shape.head_dim,
                          static_cast<float>(weft::cp::softmax_scale(shape, options)), options.causal, out.data(),
                          lse.data(), dout.data(), dq.data(), dk.data(), dv.data());
  }

 private:
  /// The device copy of a chunk's positions (consecutive, as the ring's chunks are).
  const std::int64_t* on_device(std::span<const std::int64_t> pos) const {
    if (pos.empty()) return positions;
    if (pos.back() - pos.front() + 1 != static_cast<std::int64_t>(pos.size()))
      throw std::logic_error("train_gpt: ring attention passed positions " + std::to_string(pos.front()) + ".." +
                             std::to_string(pos.back()) + " for " + std::to_string(pos.size()) +
                             " tokens, not one run of consecutive positions");
    return positions + pos.front();
  }
};

static_assert(weft::cp::attention_kernel<ring_kernel, float>);
static_assert(weft::cp::orders_transfers<ring_kernel, weft::nccl_backend>);

}  // namespace train_gpt::cuda
