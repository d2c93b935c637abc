#pragma once
/// \file
/// A sharded model's per-unit memory on a CUDA device (the NCCL backend). Allocation and release
/// are stream-ordered on the stream that first uses the memory (cuda::device_memory), with no host
/// wait: a unit's gathered parameters are allocated in the shard group's stream's order, its
/// gradients in the compute stream's, and each is given back once the compute kernels that read
/// them and the collective that reads or writes them have run. Copies between host and device are ordered on the
/// compute stream, so they follow the optimizer's kernels and precede the next forward's.

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/device_memory.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/cuda/stream.hpp>
#include <weft/core/dtype.hpp>

namespace weft::fsdp::detail {

template <memory_space M>
struct streams;
template <memory_space M>
struct compute_stream;
template <element T, memory_space M>
class unit_buffer;

template <>
struct compute_stream<memory_space::device> {
  cudaStream_t stream = nullptr;  ///< the default stream unless set
};

template <>
struct streams<memory_space::device> {
  int device = -1;                 ///< the shard group's device
  cudaStream_t compute = nullptr;  ///< where forward, backward and the optimizer run
  cudaStream_t communication = nullptr;  ///< the shard group's stream
  cudaStream_t replication = nullptr;    ///< HSDP: the replicate group's stream (its all-reduce writes the gradient shards)
};

template <element T>
class unit_buffer<T, memory_space::device> {
 public:
  using context = streams<memory_space::device>;

  std::size_t size() const noexcept { return size_; }
  std::span<T> span() noexcept { return {static_cast<T*>(memory_.data()), size_}; }
  std::span<const T> span() const noexcept { return {static_cast<const T*>(memory_.data()), size_}; }
  std::size_t bytes() const noexcept { return memory_.bytes(); }

  /// `n` zeroed elements: allocated and zeroed in the compute stream's order, and the shard
  /// group's stream ordered after that, without the host waiting. Always fresh memory: the old
  /// buffer may still be written by kernels queued on the compute stream (a backward that threw);
  /// it goes back to the pool after them.
  void assign_zeros(std::size_t n, const context& c) {
    release(c);
    memory_ = cuda::device_memory(n * sizeof(T), c.device, c.compute);
    size_ = n;
    if (n == 0) return;
    cuda::device_guard on(c.device);
    WEFT_CHECK_CUDA(cudaMemsetAsync(memory_.data(), 0, memory_.bytes(), c.compute));
    cuda::wait_for_stream(c.communication, c.compute);
  }
  /// `n` elements the caller overwrites before anything reads them: allocated in the shard
  /// group's stream's order (the gather that fills them runs there), without the host waiting.
  void allocate(std::size_t n, const context& c) {
    if (size_ == n && memory_.data() != nullptr) return;
    release(c);
    memory_ = cuda::device_memory(n * sizeof(T), c.device, c.communication);
    size_ = n;
  }
  /// Zeroes in the compute stream's order (after the optimizer's kernels, before the next forward's).
  void zero(const context& c) { memory_.zero_async(c.compute); }
  /// Gives the memory back once the work queued so far on the model's streams has run.
  void release(const context& c) {
    if (memory_.data() == nullptr) return;
    memory_.release_after(c.compute);
    memory_.release_after(c.communication);
    if (c.replication != nullptr) memory_.release_after(c.replication);
    memory_ = cuda::device_memory();
    size_ = 0;
  }

 private:
  cuda::device_memory memory_;
  std::size_t size_ = 0;
};

/// dst (device) = src (host), in the compute stream's order. From pageable memory the call
/// returns once the values are staged, so `src` may go at once.
template <element T>
void copy_from_host(std::span<T> dst, std::span<const T> src, const streams<memory_space::device>& c) {
  if (src.empty()) return;
  cuda::device_guard on(c.device);
  WEFT_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyHostToDevice, c.compute));
}
/// The values of `src` (device memory whose writers have completed: the caller waited for them),
/// copied on a private stream so the host waits for this copy alone.
template <element T>
std::vector<T> copy_to_host(std::span<const T> src, const streams<memory_space::device>& c) {
  std::vector<T> out(src.size());
  if (src.empty()) return out;
  cuda::device_guard on(c.device);
  cuda::stream own = cuda::stream::create();
  WEFT_CHECK_CUDA(cudaMemcpyAsync(out.data(), src.data(), src.size_bytes(), cudaMemcpyDeviceToHost, own.native()));
  own.synchronize();
  return out;
}
/// dst = src, both on the device, in the compute stream's order.
template <element T>
void copy_in_compute_order(std::span<T> dst, std::span<const T> src, const streams<memory_space::device>& c) {
  if (src.empty()) return;
  cuda::device_guard on(c.device);
  WEFT_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyDeviceToDevice, c.compute));
}
/// Makes the communication issued from now on (on the shard group's stream) wait for the compute
/// queued so far: the optimizer's update before a gather, backward's gradients before a reduction.
inline void order_communication_after_compute(const streams<memory_space::device>& c) {
  cuda::device_guard on(c.device);
  cuda::wait_for_stream(c.communication, c.compute);
}

}  // namespace weft::fsdp::detail

#endif  // WEFT_HAS_CUDA
