#pragma once
/// \file
/// `weft::cuda::device_memory`: an owned allocation of device memory (cudaMalloc), move-only.
/// For long-lived buffers (a model's gradient buffer); scratch that lives for one operation is
/// stream-ordered instead (see backend/nccl/detail/stream_buffer.hpp).

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include <weft/backend/cuda/check.hpp>

namespace weft::cuda {

class device_memory {
 public:
  device_memory() noexcept = default;

  /// `bytes` of memory on the current device (none for 0).
  explicit device_memory(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) WEFT_CHECK_CUDA(cudaMalloc(&data_, bytes_));
  }

  device_memory(device_memory&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  device_memory& operator=(device_memory&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  device_memory(const device_memory&) = delete;
  device_memory& operator=(const device_memory&) = delete;
  /// cudaFree waits for work still using the memory.
  ~device_memory() { reset(); }

  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  void reset() noexcept {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace weft::cuda

#endif  // WEFT_HAS_CUDA
