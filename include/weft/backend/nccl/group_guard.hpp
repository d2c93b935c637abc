#pragma once
/// \file
/// `weft::nccl::group_guard`: ncclGroupStart on construction, ncclGroupEnd on `end()` or at the
/// end of the scope, so an exception between the two never leaves NCCL inside an open group
/// (where every later call of the thread would be silently deferred).

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <nccl.h>

#include <cstdio>
#include <source_location>

#include <weft/backend/nccl/check.hpp>

namespace weft::nccl {

class group_guard {
 public:
  group_guard() { WEFT_CHECK_NCCL(ncclGroupStart(), nullptr); }
  group_guard(const group_guard&) = delete;
  group_guard& operator=(const group_guard&) = delete;

  /// Closes the group: NCCL enqueues the fused operations on their streams; throws on failure.
  /// Returns ncclInProgress when a non-blocking communicator is still carrying the group out
  /// (then poll its ncclCommGetAsyncError before the next call on it), else ncclSuccess.
  ncclResult_t end() {
    if (!open_) return ncclSuccess;
    open_ = false;
    ncclResult_t result = ncclGroupEnd();
    if (result != ncclSuccess && result != ncclInProgress)
      detail::throw_nccl_error(result, nullptr, "ncclGroupEnd()", std::source_location::current());
    return result;
  }

  /// Closes a group left open by an exception; a failure there is reported, not thrown.
  ~group_guard() {
    if (!open_) return;
    if (ncclResult_t result = ncclGroupEnd(); result != ncclSuccess && result != ncclInProgress)
      std::fprintf(stderr, "weft: ncclGroupEnd while unwinding failed: %s\n", ncclGetErrorString(result));
  }

 private:
  bool open_ = true;
};

}  // namespace weft::nccl

#endif  // WEFT_HAS_NCCL
