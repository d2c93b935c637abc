#pragma once
/// \file
/// The NCCL backend's request: a CUDA event recorded on the communicator's stream right after the
/// operation. `wait()` polls the event and, between polls, `ncclCommGetAsyncError`: a failed or
/// vanished peer surfaces as an error instead of an endless wait (cudaEventSynchronize would
/// block forever on a kernel whose peer is gone). `make_stream_wait()` orders another stream
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
class request {
 public:
  request() = default;
  request(std::shared_ptr<detail::nccl::shared_state> state, cuda::event done, const char* operation) noexcept
      : state_(std::move(state)), done_(std::move(done)), operation_(operation) {}

  request(request&& other) noexcept
      : state_(std::move(other.state_)), done_(std::move(other.done_)), operation_(other.operation_) {}
  request& operator=(request&& other) noexcept {
    if (this != &other) {
      finish_quietly();
      state_ = std::move(other.state_);
      done_ = std::move(other.done_);
      operation_ = other.operation_;
    }
    return *this;
  }
  request(const request&) = delete;
  request& operator=(const request&) = delete;
  /// Waits for an unfinished operation (its buffers stay in use until it ends); a failure is
  /// reported on stderr, since a destructor cannot throw. After abort() nothing is waited for.
  ~request() { finish_quietly(); }

  /// Blocks until the operation is complete. Throws weft::backend_error if CUDA or NCCL reports a
  /// failure (a peer's included), and weft::error if the communicator was aborted or the
  /// communicator's timeout (WEFT_NCCL_TIMEOUT) passed.
  void wait() {
    if (!state_) return;
    const auto start = std::chrono::steady_clock::now();
    for (unsigned polls = 0;; ++polls) {
      if (poll()) return;
      // Spin briefly (short collectives finish within microseconds), then back off so a long
      // wait does not take a core from the caller's other threads.
      if (polls < 2000) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (state_->timeout.count() > 0 && std::chrono::steady_clock::now() - start > state_->timeout) {
        auto state = std::move(state_);
        done_ = cuda::event();
        throw error("weft: " + state->describe() + ": " + operation_ + " did not complete within " +
                    std::to_string(state->timeout.count()) +
                    " ms (WEFT_NCCL_TIMEOUT): a peer may have stopped or be stuck; abort() the "
                    "communicator and restart the job");
      }
    }
  }

  /// True when the operation is complete (then rethrows its failure, if any); never blocks.
  bool test() { return !state_ || poll(); }

  /// Makes work queued on `other` after this call wait for the operation, without blocking the
  /// host. The request stays pending: wait() or test() still observe completion and errors.
  void make_stream_wait(cudaStream_t other) const {
    if (state_) done_.make_wait(other);
  }

  /// False for an empty request and once wait() or test() has seen the operation complete.
  bool pending() const noexcept { return state_ != nullptr; }

 private:
  /// One look at the operation: true when complete; throws on failure (and empties the request).
  bool poll() {
    if (state_->aborted.load(std::memory_order_acquire)) throw_aborted();
    cudaError_t status = cudaEventQuery(done_.native());
    if (status == cudaSuccess) {
      auto state = std::move(state_);
      state->give_back(std::move(done_));
      return true;
    }
    if (status != cudaErrorNotReady) {
      auto state = std::move(state_);
      done_ = cuda::event();
      detail::throw_cuda_error(status, "cudaEventQuery(event of the operation)", std::source_location::current(),
                               state->describe() + ": " + operation_ + " failed on the GPU");
    }
    ncclComm_t handle = state_->handle.load(std::memory_order_acquire);
    if (handle == nullptr) {
      auto state = std::move(state_);
      done_ = cuda::event();
      throw error("weft: " + state->describe() + ": the NCCL communicator was destroyed while " + operation_ +
                  " was still running");
    }
    ncclResult_t async = ncclSuccess;
    ncclResult_t queried = ncclCommGetAsyncError(handle, &async);
    if (queried != ncclSuccess) async = queried;
    if (async != ncclSuccess && async != ncclInProgress) {
      auto state = std::move(state_);
      done_ = cuda::event();
      detail::throw_nccl_error(async, handle, "ncclCommGetAsyncError(comm, &result)", std::source_location::current(),
                               state->describe() + ": " + operation_ +
                                   " cannot complete (a peer may have failed); abort() the communicator");
    }
    return false;
  }

  [[noreturn]] void throw_aborted() {
    auto state = std::move(state_);
    done_ = cuda::event();  // may still be recorded on the stream: never reused
    throw error("weft: " + state->describe() + ": the NCCL communicator was aborted while " + operation_ +
                " was pending; its result is undefined");
  }

  void finish_quietly() noexcept {
    if (!state_) return;
    if (state_->aborted.load(std::memory_order_acquire)) {
      state_.reset();
      done_ = cuda::event();
      return;
    }
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
};

}  // namespace weft::nccl

#endif  // WEFT_HAS_NCCL
