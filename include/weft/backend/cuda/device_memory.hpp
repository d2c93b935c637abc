#pragma once
/// \file
/// `weft::cuda::device_memory`: an owned allocation of device memory, move-only, for long-lived
/// buffers (a model's gradient buffer); scratch that lives for one operation is stream-ordered on
/// the communicator's stream instead (see backend/nccl/detail/stream_buffer.hpp).
///
/// The memory comes from CUDA's stream-ordered allocator on a private stream of the buffer's own,
/// and its blocking copies and its release go through that stream. So nothing here waits on the
/// whole device: cudaFree and cudaDeviceSynchronize would wait for every kernel of the GPU,
/// including an NCCL kernel stuck on a lost peer, forever and without a deadline.
///
/// Work the buffer queues on another stream itself (`zero_async`) is remembered, and the release
/// is ordered after it: released in the private stream's order alone, the memory could go back
/// to CUDA's pool (and be unmapped, or handed to another allocation) before that work ran, which
/// then writes to freed memory (an illegal address on an H200 when two ranks time-share the GPU).

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>
#include <vector>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/cuda/stream.hpp>

namespace weft::cuda {

class device_memory {
 public:
  device_memory() noexcept = default;

  /// `bytes` of memory (none for 0) on `device` (negative: the current device), usable by work
  /// on any stream queued after the constructor returns.
  explicit device_memory(std::size_t bytes, int device = -1) : bytes_(bytes) {
    if (bytes_ == 0) return;
    device_guard on(device);
    device_ = current_device();
    stream_ = stream::create();
    WEFT_CHECK_CUDA(cudaMallocAsync(&data_, bytes_, stream_.native()));
    synchronize_own();
  }

  device_memory(device_memory&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(std::exchange(other.device_, -1)),
        stream_(std::move(other.stream_)),
        uses_(std::move(other.uses_)) {}
  device_memory& operator=(device_memory&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      device_ = std::exchange(other.device_, -1);
      stream_ = std::move(other.stream_);
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

  /// Sets every byte to zero; complete when it returns.
  void zero() {
    if (bytes_ == 0) return;
    device_guard on(device_);
    WEFT_CHECK_CUDA(cudaMemsetAsync(data_, 0, bytes_, stream_.native()));
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
    WEFT_CHECK_CUDA(cudaMemcpyAsync(data_, host, bytes, cudaMemcpyHostToDevice, stream_.native()));
    synchronize_own();
  }

  /// Copies `bytes` of the memory to the host; complete when it returns (not ordered after work
  /// on other streams, as copy_from_host).
  void copy_to_host(void* host, std::size_t bytes) const {
    if (bytes == 0) return;
    device_guard on(device_);
    WEFT_CHECK_CUDA(cudaMemcpyAsync(host, data_, bytes, cudaMemcpyDeviceToHost, stream_.native()));
    synchronize_own();
  }

 private:
  /// Waits for the private stream only: it holds nothing but this buffer's own copies.
  void synchronize_own() const { stream_.synchronize(); }

  void reset() noexcept {
    if (data_ != nullptr) {
      for (const use& u : uses_) cudaStreamWaitEvent(stream_.native(), u.queued.native(), 0);
      cudaFreeAsync(data_, stream_.native());
    }
    uses_.clear();  // an event waited on is kept by CUDA until the wait is over
    stream_ = stream();  // destroying a stream does not wait for it
    data_ = nullptr;
    bytes_ = 0;
    device_ = -1;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
  stream stream_;
  /// Other streams that queued work on the memory through this object, each with an event after it.
  struct use {
    cudaStream_t stream = nullptr;
    event queued;
  };
  std::vector<use> uses_;
};

}  // namespace weft::cuda

#endif  // WEFT_HAS_CUDA
