#pragma once
/// \file
/// `weft::cuda::event`: an owned CUDA event (move-only), created without timing so recording and
/// querying it is as cheap as CUDA allows. It marks a point in a stream: `query()` says whether
/// the stream got there, `make_wait(other)` orders another stream after it without blocking the host.

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <utility>

#include <weft/backend/cuda/check.hpp>

namespace weft::cuda {

class event {
 public:
  /// An empty event (owns nothing); `create()` makes a real one.
  event() noexcept = default;

  /// A new event on the current device; `timing` enables elapsed-time measurement.
  static event create(bool timing = false) {
    cudaEvent_t handle = nullptr;
    WEFT_CHECK_CUDA(cudaEventCreateWithFlags(&handle, timing ? cudaEventDefault : cudaEventDisableTiming));
    return event(handle);
  }

  event(event&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  event& operator=(event&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, nullptr);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { reset(); }

  cudaEvent_t native() const noexcept { return handle_; }
  explicit operator bool() const noexcept { return handle_ != nullptr; }

  /// Marks the current end of `s`'s queue.
  void record(cudaStream_t s) { WEFT_CHECK_CUDA(cudaEventRecord(handle_, s)); }

  /// True when the work before the recorded point has finished (also for a never-recorded event).
  bool query() const {
    cudaError_t status = cudaEventQuery(handle_);
    if (status == cudaErrorNotReady) return false;
    WEFT_CHECK_CUDA(status);
    return true;
  }

  /// Work queued on `other` after this call starts only once the recorded point is reached;
  /// the host does not wait.
  void make_wait(cudaStream_t other) const { WEFT_CHECK_CUDA(cudaStreamWaitEvent(other, handle_, 0)); }

  /// Blocks the host until the recorded point is reached (no NCCL error polling: for plain CUDA work).
  void synchronize() const { WEFT_CHECK_CUDA(cudaEventSynchronize(handle_)); }

  /// Milliseconds between `start` and this event (both recorded with timing enabled).
  float elapsed_ms_since(const event& start) const {
    float ms = 0.0f;
    WEFT_CHECK_CUDA(cudaEventElapsedTime(&ms, start.handle_, handle_));
    return ms;
  }

 private:
  explicit event(cudaEvent_t handle) noexcept : handle_(handle) {}
  void reset() noexcept {
    if (handle_ != nullptr) cudaEventDestroy(handle_);
    handle_ = nullptr;
  }
  cudaEvent_t handle_ = nullptr;
};

/// Work queued on `waiting` from now on starts only after everything queued on `producer` so far;
/// the host does not wait. (The event may be destroyed at once: CUDA keeps it until it is used.)
inline void wait_for_stream(cudaStream_t waiting, cudaStream_t producer) {
  event boundary = event::create();
  boundary.record(producer);
  boundary.make_wait(waiting);
}

}  // namespace weft::cuda

#endif  // WEFT_HAS_CUDA
