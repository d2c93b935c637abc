#pragma once
/// \file
/// weft's exceptions. Every failure that crosses weft's API is one of these:
///  - `weft::error`: bad input or a broken contract (mismatched sizes, invalid layout, ...);
///    the message says what was wrong, on which rank and group, and what to do.
///  - `weft::backend_error`: a call into MPI, NCCL or CUDA returned a failure code; it carries the
///    library, the raw code, the library's own message, the call's text, the source location,
///    the rank and the host, so a log line from rank 37 of 512 is enough to find the fault.

#include <cstdlib>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>
#include <atomic>

#include <unistd.h>

namespace weft {

namespace detail {

/// The world rank of this process for error messages: set by the launcher code once known,
/// otherwise read from the launcher's variables, otherwise -1 (unknown).
inline std::atomic<int>& known_world_rank() {
  static std::atomic<int> rank{-1};
  return rank;
}

inline int world_rank_for_messages() {
  int rank = known_world_rank().load(std::memory_order_relaxed);
  if (rank >= 0) return rank;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID", "RANK"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') {
      char* end = nullptr;
      long parsed = std::strtol(value, &end, 10);
      if (end != value && *end == '\0' && parsed >= 0) return static_cast<int>(parsed);
    }
  }
  return -1;
}

inline std::string host_name() {
  char buffer[256] = {};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "unknown-host";
  return buffer;
}

inline std::string where(const std::source_location& loc) {
  return std::string(loc.file_name()) + ":" + std::to_string(loc.line());
}

}  // namespace detail

/// Bad input or a broken contract, detected by weft before anything was sent.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Which library a failed call belongs to.
enum class backend_library { mpi, nccl, cuda };

constexpr std::string_view to_string(backend_library lib) noexcept {
  switch (lib) {
    case backend_library::mpi: return "MPI";
    case backend_library::nccl: return "NCCL";
    case backend_library::cuda: return "CUDA";
  }
  return "?";
}

/// A call into MPI, NCCL or CUDA failed.
class backend_error : public error {
 public:
  backend_error(backend_library library, int code, std::string library_message, std::string call,
                std::source_location location, std::string context = {})
      : error(format(library, code, library_message, call, location, context)),
        library_(library),
        code_(code),
        library_message_(std::move(library_message)),
        call_(std::move(call)),
        location_(location),
        rank_(detail::world_rank_for_messages()),
        host_(detail::host_name()) {}

  backend_library library() const noexcept { return library_; }
  /// The library's raw result code (an MPI error code, an ncclResult_t, a cudaError_t).
  int code() const noexcept { return code_; }
  const std::string& library_message() const noexcept { return library_message_; }
  /// The text of the call as written at the call site.
  const std::string& call() const noexcept { return call_; }
  const std::source_location& location() const noexcept { return location_; }
  /// World rank of the process that saw the failure (-1 if unknown).
  int rank() const noexcept { return rank_; }
  const std::string& host() const noexcept { return host_; }

 private:
  static std::string format(backend_library library, int code, const std::string& message,
                            const std::string& call, const std::source_location& location,
                            const std::string& context) {
    std::string text = std::string(to_string(library)) + " error " + std::to_string(code) + " (" + message +
                       ") in " + call + " at " + detail::where(location) + " on rank " +
                       std::to_string(detail::world_rank_for_messages()) + " (host " + detail::host_name() + ")";
    if (!context.empty()) text += ": " + context;
    return text;
  }

  backend_library library_;
  int code_;
  std::string library_message_;
  std::string call_;
  std::source_location location_;
  int rank_;
  std::string host_;
};

/// Throws weft::error with "rank R: " in front of the message.
[[noreturn]] inline void fail(const std::string& message) {
  int rank = detail::world_rank_for_messages();
  if (rank >= 0) throw error("weft: rank " + std::to_string(rank) + ": " + message);
  throw error("weft: " + message);
}

}  // namespace weft
