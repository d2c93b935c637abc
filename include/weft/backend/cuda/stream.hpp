#pragma once
/// \file
/// `weft::cuda::stream`: an owned CUDA stream (move-only). Created non-blocking, so it never
/// synchronises implicitly with the legacy default stream: communication overlaps the caller's
/// work unless an event orders them.

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <utility>

#include <weft/backend/cuda/check.hpp>

namespace weft::cuda {

class stream {
 public:
  /// An empty stream (owns nothing); `create()` makes a real one.
  stream() noexcept = default;

  /// A new non-blocking stream on the current device.
  static stream create(int priority = 0) {
    cudaStream_t handle = nullptr;
    WEFT_CHECK_CUDA(cudaStreamCreateWithPriority(&handle, cudaStreamNonBlocking, priority));
    return stream(handle);
  }

  stream(stream&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  stream& operator=(stream&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  /// Work still queued on the stream completes; CUDA frees the stream afterwards.
  ~stream() { reset(); }

  cudaStream_t native() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

  /// Blocks the host until all work queued so far has finished.
  void synchronize() const { WEFT_CHECK_CUDA(cudaStreamSynchronize(handle_)); }

  /// True when all work queued so far has finished.
  bool query() const {
    cudaError_t status = cudaStreamQuery(handle_);
    if (status == cudaErrorNotReady) return false;
    WEFT_CHECK_CUDA(status);
    return true;
  }

 private:
  explicit stream(cudaStream_t handle) noexcept : handle_(handle) {}
  void reset() noexcept {
    if (handle_ != nullptr) cudaStreamDestroy(handle_);
    handle_ = nullptr;
  }
  cudaStream_t handle_ = nullptr;
};

}  // namespace weft::cuda

#endif  // WEFT_HAS_CUDA
