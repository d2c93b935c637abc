#pragma once
/// \file
/// The one choke point for CUDA runtime calls: `WEFT_CHECK_CUDA(cudaXxx(...))` throws
/// weft::backend_error with CUDA's error name and string, the call's text, the source location,
/// the rank and the host. Compiles to nothing in a build without CUDA.

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <source_location>
#include <string>

#include <weft/core/error.hpp>

namespace weft::detail {

/// "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version".
inline std::string cuda_error_text(cudaError_t code) {
  const char* name = cudaGetErrorName(code);
  const char* text = cudaGetErrorString(code);
  return std::string(name != nullptr ? name : "unknown CUDA error") + ": " + (text != nullptr ? text : "");
}

[[noreturn]] inline void throw_cuda_error(cudaError_t code, const char* call, std::source_location location,
                                          std::string context = {}) {
  throw backend_error(backend_library::cuda, static_cast<int>(code), cuda_error_text(code), call, location,
                      std::move(context));
}

inline void check_cuda(cudaError_t code, const char* call,
                       std::source_location location = std::source_location::current()) {
  if (code != cudaSuccess) [[unlikely]]
    throw_cuda_error(code, call, location);
}

}  // namespace weft::detail

#define WEFT_CHECK_CUDA(call) ::weft::detail::check_cuda((call), #call, std::source_location::current())

#endif  // WEFT_HAS_CUDA
