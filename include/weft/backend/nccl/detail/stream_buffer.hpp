#pragma once
/// \file
/// A temporary device buffer ordered on a stream (cudaMallocAsync / cudaFreeAsync): freeing it
/// never synchronises the device, so a communicator never waits on another communicator's
/// kernels (which could be stuck on a failed peer) just to release scratch memory.

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include <weft/backend/cuda/check.hpp>

namespace weft::detail::nccl {

class stream_buffer {
 public:
  /// `bytes` of device memory on the current device, usable by work queued on `stream` from now.
  stream_buffer(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) WEFT_CHECK_CUDA(cudaMallocAsync(&data_, bytes, stream_));
  }
  stream_buffer(const stream_buffer&) = delete;
  stream_buffer& operator=(const stream_buffer&) = delete;
  /// Freed once the work queued on the stream so far has finished.
  ~stream_buffer() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }

  char* data() const noexcept { return static_cast<char*>(data_); }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace weft::detail::nccl

#endif  // WEFT_HAS_CUDA
