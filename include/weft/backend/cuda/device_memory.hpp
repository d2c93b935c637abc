#pragma once
/// \file
/// `weft::cuda::device_memory`: an owned allocation of device memory, move-only, for long-lived
/// buffers (a model's gradient buffer); scratch that lives for one operation is stream-ordered on
/// the communicator's stream instead (see backend/nccl/detail/stream_buffer.hpp).
///
/// The memory comes from CUDA's stream-ordered allocator. Given the stream that first uses it
/// (`device_memory(bytes, device, stream)`), the allocation and the release are queued in that
/// stream's order and the host never waits: what a sharded model does for every gather and every
/// backward. Without one, it comes on a private stream of the buffer's own, whose blocking copies
/// and release go through that stream (the constructor waits once, so the memory is usable from
/// any stream: for long-lived buffers). Either way nothing here waits on the whole device:
/// cudaFree and cudaDeviceSynchronize would wait for every kernel of the GPU, including an NCCL
/// kernel stuck on a lost peer, forever and without a deadline. The device's default pool keeps
/// freed memory (its release threshold is set to the maximum on first use), so a step's
/// allocations are served from the pool instead of being trimmed back to the driver each time.
///
/// Work the buffer queues on another stream itself (`zero_async`) is remembered, and the release
/// is ordered after it: released in one stream's order alone, the memory could go back
/// to CUDA's pool (and be unmapped, or handed to another allocation) before that work ran, which
/// then writes to freed memory (an illegal address on an H200 when two ranks time-share the GPU).

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/cuda/stream.hpp>

namespace weft::cuda {

namespace detail {

/// Sets the release threshold of `device`'s default memory pool to the maximum, once per device:
/// with CUDA's default of 0 the pool may return freed memory to the driver at every
/// synchronization, and the next allocation maps it again.
inline void keep_freed_memory_in_pool(int device) {
  static std::mutex guard;
  static std::vector<int> done;
  const std::lock_guard lock(guard);
  for (int d : done)
    if (d == device) return;
  cudaMemPool_t pool = nullptr;
  WEFT_CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
  std::uint64_t threshold = UINT64_MAX;
  WEFT_CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  done.push_back(device);
}

}  // namespace detail

class device_memory {
 public:
  device_memory() noexcept = default;

  /// `bytes` of memory (none for 0) on `device` (negative: the current device), usable by work
  /// on any stream queued after the constructor returns.
  explicit device_memory(std::size_t bytes, int device = -1) : bytes_(bytes) {
    if (bytes_ == 0) return;
    device_guard on(device);
    device_ = current_device();
    detail::keep_freed_memory_in_pool(device_);
    stream_ = stream::create();
    home_ = stream_.native();
    WEFT_CHECK_CUDA(cudaMallocAsync(&data_, bytes_, home_));
    synchronize_own();
  }

  /// `bytes` of memory on `device` (negative: the current one), allocated in `first_use`'s order
  /// without waiting: usable by work queued on `first_use` after this, and on other streams once
  /// they are ordered after it (an event). Released in `first_use`'s order too, after the work
  /// `release_after` names; `first_use` must outlive the release.
  device_memory(std::size_t bytes, int device, cudaStream_t first_use) : bytes_(bytes) {
    if (bytes_ == 0) return;
    device_guard on(device);
    device_ = current_device();
    detail::keep_freed_memory_in_pool(device_);
    home_ = first_use;
    WEFT_CHECK_CUDA(cudaMallocAsync(&data_, bytes_, home_));
  }

  device_memory(device_memory&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(std::exchange(other.device_, -1)),
        stream_(std::move(other.stream_)),
        home_(std::exchange(other.home_, nullptr)),
        uses_(std::move(other.uses_)) {}
  device_memory& operator=(device_memory&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      device_ = std::exchange(other.device_, -1);
      stream_ = std::move(other.stream_);
      home_ = std::exchange(other.home_, nullptr);
      uses_ = std::move(other.uses_);
    }
    return *this;
  }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  /// Released in stream order without waiting: work that uses the memory must be finished, or
  /// stopped (an aborted communicator's), by then; its owner's requests see to that.
  ~device_memory() { reset(); }

  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  /// The device the memory is on (-1 when empty).
  int device() const noexcept { return device_; }

  /// Sets every byte to zero; complete when it returns (a host wait: for long-lived buffers).
  void zero() {
    if (bytes_ == 0) return;
    device_guard on(device_);
    WEFT_CHECK_CUDA(cudaMemsetAsync(data_, 0, bytes_, own_stream()));
    synchronize_own();
  }

  /// Sets every byte to zero in `stream`'s order, without waiting; the release waits for it.
  void zero_async(cudaStream_t stream) {
    if (bytes_ == 0) return;
    device_guard on(device_);
    WEFT_CHECK_CUDA(cudaMemsetAsync(data_, 0, bytes_, stream));
    release_after(stream);
  }

  /// Orders the release after the work queued on `stream` so far (one event per stream, moved
  /// along by later calls). The blocking copies do not wait for it.
  void release_after(cudaStream_t stream) {
    if (bytes_ == 0) return;
    device_guard on(device_);
    for (use& u : uses_)
      if (u.stream == stream) {
        u.queued.record(stream);
        return;
      }
    use u{stream, event::create()};
    u.queued.record(stream);
    uses_.push_back(std::move(u));
  }

  /// Copies `bytes` from the host into the memory; complete when it returns. Not ordered after
  /// work on other streams: the caller makes sure none uses the memory meanwhile.
  void copy_from_host(const void* host, std::size_t bytes) {
    if (bytes == 0) return;
    device_guard on(device_);
    WEFT_CHECK_CUDA(cudaMemcpyAsync(data_, host, bytes, cudaMemcpyHostToDevice, own_stream()));
    synchronize_own();
  }

  /// Copies `bytes` of the memory to the host; complete when it returns (not ordered after work
  /// on other streams, as copy_from_host).
  void copy_to_host(void* host, std::size_t bytes) const {
    if (bytes == 0) return;
    device_guard on(device_);
    WEFT_CHECK_CUDA(cudaMemcpyAsync(host, data_, bytes, cudaMemcpyDeviceToHost, own_stream()));
    synchronize_own();
  }

 private:
  /// The private stream of the blocking copies (made on first use for stream-ordered memory).
  cudaStream_t own_stream() const {
    if (!stream_.native()) stream_ = stream::create();
    return stream_.native();
  }
  /// Waits for the private stream only: it holds nothing but this buffer's own copies.
  void synchronize_own() const { stream_.synchronize(); }

  void reset() noexcept {
    if (data_ != nullptr) {
      // After the work other streams queued on it (the blocking copies are over already).
      for (const use& u : uses_) cudaStreamWaitEvent(home_, u.queued.native(), 0);
      cudaFreeAsync(data_, home_);
    }
    uses_.clear();  // an event waited on is kept by CUDA until the wait is over
    stream_ = stream();  // destroying a stream does not wait for it
    home_ = nullptr;
    data_ = nullptr;
    bytes_ = 0;
    device_ = -1;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
  mutable stream stream_;  ///< private: the blocking copies (and the allocation without a first-use stream)
  cudaStream_t home_ = nullptr;  ///< where the memory was allocated and is released
  /// Other streams that queued work on the memory through this object, each with an event after it.
  struct use {
    cudaStream_t stream = nullptr;
    event queued;
  };
  std::vector<use> uses_;
};

}  // namespace weft::cuda

#endif  // WEFT_HAS_CUDA
