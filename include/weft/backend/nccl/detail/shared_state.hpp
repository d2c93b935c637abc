#pragma once
/// \file
/// What an NCCL communicator shares with its requests: the native handle while it lives, whether
/// it was aborted, the wait timeout, and a pool of CUDA events (one is recorded per operation, so
/// reusing them keeps event creation out of the per-call cost). Requests hold it by shared_ptr,
/// so a request that outlives its communicator never touches a destroyed handle.

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/core/error.hpp>

namespace weft::detail::nccl {

struct shared_state {
  std::atomic<ncclComm_t> handle{nullptr};  ///< null once destroyed or aborted
  std::atomic<bool> aborted{false};
  int device = -1;
  int rank = 0;
  int size = 0;
  std::chrono::milliseconds timeout{0};  ///< 0: wait as long as NCCL reports no error

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

  /// "rank 3 of 8 (device 3)", for messages.
  std::string describe() const {
    return "rank " + std::to_string(rank) + " of " + std::to_string(size) + " (CUDA device " +
           std::to_string(device) + ")";
  }

 private:
  static constexpr std::size_t max_pooled = 64;
  std::mutex pool_mutex_;
  std::vector<cuda::event> pool_;
};

/// The wait timeout from WEFT_NCCL_TIMEOUT (seconds; unset or 0: none).
inline std::chrono::milliseconds timeout_from_environment() {
  const char* value = std::getenv("WEFT_NCCL_TIMEOUT");
  if (value == nullptr || *value == '\0') return std::chrono::milliseconds(0);
  char* end = nullptr;
  double seconds = std::strtod(value, &end);
  if (end == value || *end != '\0' || !(seconds >= 0.0))
    throw error("weft: WEFT_NCCL_TIMEOUT='" + std::string(value) +
                "' is not a number of seconds; set it to e.g. 600, or unset it to wait without a limit");
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
}

}  // namespace weft::detail::nccl

#endif  // WEFT_HAS_NCCL
