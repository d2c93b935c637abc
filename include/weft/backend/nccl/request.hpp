#pragma once
/// \file
/// The NCCL backend's request: a CUDA event recorded on the communicator's stream right after the
/// operation. `wait()` polls the event and, between polls, `ncclCommGetAsyncError`, under a
/// deadline: a failed peer surfaces as an error and a peer that never joins as a timeout, instead
/// of an endless wait (cudaEventSynchronize would block forever on a kernel whose peer is gone). `make_stream_wait()` orders another stream
/// after the operation without involving the host, which is how compute consumes a result.

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <source_location>
#include <string>
#include <thread>
#include <utility>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/nccl/check.hpp>
#include <weft/backend/nccl/detail/shared_state.hpp>
#include <weft/core/error.hpp>

namespace weft::nccl {

/// Move-only handle on an enqueued NCCL operation; an empty request is a completed one.
///
/// Waiting has a deadline (WEFT_COMM_TIMEOUT, 10 minutes by default; `set_timeout`): past it the
/// communicator is aborted, which stops the operation's kernels, and only then does the request
/// let go of the operation (its buffers may be reused once wait() has thrown). A request made
/// while its stream was being captured into a CUDA graph completes in graph order: waiting on it
/// does not query its event (that would invalidate the capture).
class request {
 public:
  request() = default;
  request(std::shared_ptr<detail::nccl::shared_state> state, cuda::event done, const char* operation,
          bool captured = false) noexcept
      : state_(std::move(state)), done_(std::move(done)), operation_(operation), captured_(captured) {}

  request(request&& other) noexcept
      : state_(std::move(other.state_)),
        done_(std::move(other.done_)),
        operation_(other.operation_),
        captured_(std::exchange(other.captured_, false)) {}
  request& operator=(request&& other) noexcept {
    if (this != &other) {
      finish_quietly();
      state_ = std::move(other.state_);
      done_ = std::move(other.done_);
      operation_ = other.operation_;
      captured_ = std::exchange(other.captured_, false);
    }
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  /// Waits for an unfinished operation (its buffers stay in use until it ends), under the
  /// deadline; a failure is reported on stderr, since a destructor cannot throw.
  ~request() { finish_quietly(); }

  /// Blocks until the operation is complete. Throws weft::backend_error if CUDA or NCCL reports a
  /// failure (a peer's included), and weft::error if the communicator was aborted or the deadline
  /// passed (the communicator is then aborted).
  void wait() {
    if (!state_) return;
    if (captured_) return forget();
    try {
      state_->poll_until([this] { return look(); }, operation_);
    } catch (...) {
      forget();
      throw;
    }
    complete();
  }

  /// True when the operation is complete (then rethrows its failure, if any); never blocks.
  bool test() {
    if (!state_) return true;
    if (captured_) {
      forget();
      return true;
    }
    try {
      if (!look()) return false;
    } catch (...) {
      forget();
      throw;
    }
    complete();
    return true;
  }

  /// Makes work queued on `other` after this call wait for the operation, without blocking the
  /// host. The request stays pending: wait() or test() still observe completion and errors.
  void make_stream_wait(cudaStream_t other) const {
    if (state_) done_.make_wait(other);
  }

  /// False for an empty request and once wait() or test() has seen the operation complete.
  bool pending() const noexcept { return state_ != nullptr; }

 private:
  /// One look at the operation: true when complete; throws on failure.
  bool look() {
    if (state_->aborted.load(std::memory_order_acquire)) state_->throw_gone(operation_);
    cudaError_t status = cudaEventQuery(done_.native());
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady)
      detail::throw_cuda_error(status, "cudaEventQuery(event of the operation)", std::source_location::current(),
                               state_->describe() + ": " + operation_ + " failed on the GPU");
    state_->check_async(operation_);
    return false;
  }

  void complete() {
    auto state = std::move(state_);
    state->give_back(std::move(done_));
  }

  /// Lets go of an operation that will not be waited for. After an abort its kernels are
  /// stopping: give them a few seconds, so the caller reuses the buffers only once they have.
  void forget() noexcept {
    auto state = std::move(state_);
    if (!captured_ && state && state->aborted.load(std::memory_order_acquire) && done_) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (cudaEventQuery(done_.native()) == cudaErrorNotReady && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    captured_ = false;
    done_ = cuda::event();  // may still be recorded on a stream or in a graph: never reused
  }

  void finish_quietly() noexcept {
    if (!state_) return;
    if (captured_ || state_->aborted.load(std::memory_order_acquire)) return forget();
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weft: an NCCL operation whose request was dropped failed: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "weft: an NCCL operation whose request was dropped failed\n");
    }
  }

  std::shared_ptr<detail::nccl::shared_state> state_;
  cuda::event done_;
  const char* operation_ = "";
  bool captured_ = false;
};

}  // namespace weft::nccl

#endif  // WEFT_HAS_NCCL
