#pragma once
/// \file
/// The one choke point for NCCL calls: `WEFT_CHECK_NCCL(ncclXxx(...), comm)` throws
/// weft::backend_error carrying NCCL's result string and NCCL's own last-error text
/// (`ncclGetLastError(comm)`, which says what went wrong, not just which class of error), the
/// call's text, the source location, the rank and the host. Pass `nullptr` as `comm` for calls
/// that have none (ncclGetUniqueId, ncclGroupEnd). Compiles to nothing in a build without NCCL.

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <nccl.h>

#include <source_location>
#include <string>

#include <weft/core/error.hpp>

namespace weft::detail {

/// NCCL's result string, followed by its last-error text when it has one.
inline std::string nccl_error_text(ncclResult_t code, ncclComm_t comm) {
  const char* text = ncclGetErrorString(code);
  std::string message = text != nullptr ? text : "unknown NCCL error";
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') message += "; NCCL says: " + std::string(last);
  return message;
}

[[noreturn]] inline void throw_nccl_error(ncclResult_t code, ncclComm_t comm, const char* call,
                                          std::source_location location, std::string context = {}) {
  throw backend_error(backend_library::nccl, static_cast<int>(code), nccl_error_text(code, comm), call, location,
                      std::move(context));
}

inline void check_nccl(ncclResult_t code, ncclComm_t comm, const char* call,
                       std::source_location location = std::source_location::current()) {
  if (code != ncclSuccess) [[unlikely]]
    throw_nccl_error(code, comm, call, location);
}

}  // namespace weft::detail

#define WEFT_CHECK_NCCL(call, comm) \
  ::weft::detail::check_nccl((call), (comm), #call, std::source_location::current())

#endif  // WEFT_HAS_NCCL
