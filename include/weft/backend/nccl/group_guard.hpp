#pragma once
/// \file
/// `weft::nccl::group_guard`: ncclGroupStart on construction, ncclGroupEnd on `end()` or at the
/// end of the scope, so an exception between the two never leaves NCCL inside an open group
/// (where every later call of the thread would be silently deferred).

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <nccl.h>

#include <cstdio>

#include <weft/backend/nccl/check.hpp>

namespace weft::nccl {

class group_guard {
 public:
  group_guard() { WEFT_CHECK_NCCL(ncclGroupStart(), nullptr); }
  group_guard(const group_guard&) = delete;
  group_guard& operator=(const group_guard&) = delete;

  /// Closes the group: NCCL enqueues the fused operations on their streams; throws on failure.
  void end() {
    if (open_) {
      open_ = false;
      WEFT_CHECK_NCCL(ncclGroupEnd(), nullptr);
    }
  }

  /// Closes a group left open by an exception; a failure there is reported, not thrown.
  ~group_guard() {
    if (!open_) return;
    if (ncclResult_t result = ncclGroupEnd(); result != ncclSuccess)
      std::fprintf(stderr, "weft: ncclGroupEnd while unwinding failed: %s\n", ncclGetErrorString(result));
  }

 private:
  bool open_ = true;
};

}  // namespace weft::nccl

#endif  // WEFT_HAS_NCCL
