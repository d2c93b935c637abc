#pragma once
/// \file
/// What an NCCL communicator shares with its requests: the native handle while it lives, whether
/// it was aborted, the deadline, the names for messages, and a pool of CUDA events (one is
/// recorded per operation, so reusing them keeps event creation out of the per-call cost).
/// Requests hold it by shared_ptr, so a request that outlives its communicator never touches a
/// destroyed handle.
///
/// Every use of the handle (an enqueue, a status query) happens under `use`; abort() takes the
/// same lock to retire the handle before ncclCommAbort, so another thread (a watchdog) may abort
/// while the owner waits or polls, and no call ever sees a freed handle.

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <source_location>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/nccl/check.hpp>
#include <weft/backend/nccl/detail/policy.hpp>
#include <weft/core/error.hpp>
#include <weft/core/timeout.hpp>

namespace weft::detail::nccl {

struct shared_state {
  std::atomic<ncclComm_t> handle{nullptr};  ///< null once destroyed or aborted
  std::atomic<bool> aborted{false};
  int device = -1;
  int rank = 0;
  int size = 0;
  std::string name;         ///< the group's name, for messages (may be empty)
  std::string config_name;  ///< the name given to NCCL at creation; never changed, NCCL may keep its address
  std::chrono::milliseconds timeout{default_comm_timeout};  ///< 0: no deadline
  /// Held while the handle is used. Recursive: the owner polls from inside its own calls.
  std::recursive_mutex use;

  wait_site site() const { return {rank, size, device, host_name(), name}; }
  /// "rank 3 of 8 on host n7 (CUDA device 3), group 'dp'", for messages.
  std::string describe() const { return nccl::describe(site()); }

  /// Retires the handle (once no call is using it), then aborts it: kernels stop, requests throw.
  /// Safe from any thread, any number of times.
  void abort() noexcept {
    ncclComm_t h = nullptr;
    {
      std::lock_guard lock(use);
      aborted.store(true, std::memory_order_release);
      h = handle.exchange(nullptr, std::memory_order_acq_rel);
    }
    if (h == nullptr) return;
    if (ncclResult_t r = ncclCommAbort(h); r != ncclSuccess)
      std::fprintf(stderr, "weft: NCCL %s: ncclCommAbort failed: %s\n", describe().c_str(), ncclGetErrorString(r));
  }

  /// Takes the handle to destroy it (null if it was aborted meanwhile).
  ncclComm_t take_handle() noexcept {
    std::lock_guard lock(use);
    return handle.exchange(nullptr, std::memory_order_acq_rel);
  }

  [[noreturn]] void throw_gone(std::string_view operation) const {
    if (aborted.load(std::memory_order_acquire))
      throw error("weft: NCCL " + describe() + ": the communicator was aborted while " + std::string(operation) +
                  " was pending; its result is undefined");
    throw error("weft: NCCL " + describe() + ": the communicator was destroyed while " + std::string(operation) +
                " was still running");
  }

  /// One look at NCCL's asynchronous state: ncclSuccess or ncclInProgress (a non-blocking call
  /// still being carried out); throws on an error (a failed peer) or when the handle is gone.
  ncclResult_t check_async(std::string_view operation) {
    std::lock_guard lock(use);
    ncclComm_t h = handle.load(std::memory_order_acquire);
    if (h == nullptr) throw_gone(operation);
    ncclResult_t async = ncclSuccess;
    ncclResult_t queried = ncclCommGetAsyncError(h, &async);
    if (queried != ncclSuccess) async = queried;
    if (async != ncclSuccess && async != ncclInProgress)
      throw_nccl_error(async, h, "ncclCommGetAsyncError(comm, &result)", std::source_location::current(),
                       describe() + ": " + std::string(operation) +
                           " cannot complete (a peer may have failed); abort() the communicator");
    return async;
  }

  /// Calls `step` until it returns true, backing off, under the deadline. Past the deadline the
  /// communicator is aborted (so its kernels stop and the buffers they use may be released), and
  /// the timeout is thrown.
  template <class Step>
  void poll_until(Step&& step, std::string_view operation) {
    const auto start = std::chrono::steady_clock::now();
    const std::chrono::milliseconds limit = timeout;
    for (unsigned polls = 0;; ++polls) {
      if (step()) return;
      // Spin briefly (short collectives finish within microseconds), then back off so a long
      // wait does not take a core from the caller's other threads.
      if (polls < 2000) {
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(polls < 20000 ? 50 : 1000));
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
      if (limit.count() > 0 && waited > limit) {
        abort();
        throw error(timeout_message(site(), operation, waited, limit));
      }
    }
  }

  /// Waits until the non-blocking calls made so far have been carried out (ncclInProgress gone).
  void settle(std::string_view operation) {
    poll_until([&] { return check_async(operation) == ncclSuccess; }, operation);
  }

  /// Waits for `e` (recorded after this communicator's work, or after work that waits for it),
  /// watching NCCL's error state and the deadline.
  void wait_event(cudaEvent_t e, std::string_view operation) {
    poll_until(
        [&] {
          cudaError_t status = cudaEventQuery(e);
          if (status == cudaSuccess) return true;
          if (status != cudaErrorNotReady)
            throw_cuda_error(status, "cudaEventQuery(event)", std::source_location::current(),
                             describe() + ": " + std::string(operation) + " failed on the GPU");
          check_async(operation);
          return false;
        },
        operation);
  }

  cuda::event take_event() {
    {
      std::lock_guard lock(pool_mutex_);
      if (!pool_.empty()) {
        cuda::event e = std::move(pool_.back());
        pool_.pop_back();
        return e;
      }
    }
    cuda::device_guard on(device);
    return cuda::event::create();
  }

  /// Only events whose recorded work has completed come back here.
  void give_back(cuda::event e) {
    std::lock_guard lock(pool_mutex_);
    if (pool_.size() < max_pooled) pool_.push_back(std::move(e));
  }

 private:
  static constexpr std::size_t max_pooled = 64;
  std::mutex pool_mutex_;
  std::vector<cuda::event> pool_;
};

}  // namespace weft::detail::nccl

#endif  // WEFT_HAS_NCCL
