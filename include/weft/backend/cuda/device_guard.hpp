#pragma once
/// \file
/// `weft::cuda::device_guard`: makes a device current for a scope and restores the previous one,
/// so weft's calls on a communicator's device never change the caller's current device.

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <weft/backend/cuda/check.hpp>

namespace weft::cuda {

class device_guard {
 public:
  /// Makes `device` current (a negative device leaves the current one alone).
  explicit device_guard(int device) {
    if (device < 0) return;
    WEFT_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) {
      WEFT_CHECK_CUDA(cudaSetDevice(device));
      restore_ = true;
    }
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (restore_) cudaSetDevice(previous_);  // cannot throw from here; the next checked call reports
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

/// The current device.
inline int current_device() {
  int device = 0;
  WEFT_CHECK_CUDA(cudaGetDevice(&device));
  return device;
}

/// The current device, or `fallback` when CUDA cannot say (no driver, no device).
inline int current_device_or(int fallback) noexcept {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess ? device : fallback;
}

}  // namespace weft::cuda

#endif  // WEFT_HAS_CUDA
