#pragma once
/// \file
/// weft's exceptions. Every failure that crosses weft's API is one of these:
///  - `weft::error`: bad input or a broken contract (mismatched sizes, invalid layout, ...);
///    the message says what was wrong, on which rank and group, and what to do.
///  - `weft::backend_error`: a call into MPI, NCCL or CUDA returned a failure code; it carries the
///    library, the raw code, the library's own message, the call's text, the source location,
///    the rank and the host, so a log line from rank 37 of 512 is enough to find the fault. When
///    the call belongs to an operation of a communicator, the message names the operation in
///    weft's words instead of the call ("all_reduce on group 'tp' (rank 1 of 2, 1000 x float)
///    failed: MPI_ERR_TRUNCATE: message truncated"); the call and location stay in call() and
///    location().

#include <cstdint>
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

/// An operation of a communicator as weft's messages name it: "all_reduce on group 'tp' (rank 1
/// of 2, 1000 x float)". `element` is the dtype's name; `count` 0 leaves the size out (a
/// barrier); `peer_role` ("peer", "root") names `peer` when it is not negative.
inline std::string operation_text(std::string_view operation, std::string_view group, int rank, int size,
                                  std::uint64_t count, std::string_view element, std::string_view peer_role = {},
                                  int peer = -1) {
  std::string text = std::string(operation) + " on group '" + std::string(group) + "' (rank " + std::to_string(rank) +
                     " of " + std::to_string(size);
  if (count > 0) text += ", " + std::to_string(count) + " x " + std::string(element);
  if (peer >= 0 && !peer_role.empty()) text += ", " + std::string(peer_role) + " " + std::to_string(peer);
  return text + ")";
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

  /// The same failure as part of `operation` (detail::operation_text: "all_reduce on group 'tp'
  /// (rank 1 of 2, 1000 x float)"); the message becomes "<operation> failed: <library's message>".
  /// A failure that already names its operation keeps it (the innermost one is the precise one).
  backend_error during(std::string operation) const {
    if (!operation_.empty()) return *this;
    backend_error named = *this;
    named.operation_ = std::move(operation);
    named.message_ = named.format_operation();
    return named;
  }

  const char* what() const noexcept override { return message_.empty() ? error::what() : message_.c_str(); }

  /// The operation this failure belongs to ("" when the call was not part of one).
  const std::string& operation() const noexcept { return operation_; }
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

  std::string format_operation() const {
    std::string text = "weft: ";
    if (rank_ >= 0) text += "rank " + std::to_string(rank_) + ": ";
    return text + operation_ + " failed: " + library_message_ + " (" + std::string(to_string(library_)) + " error " +
           std::to_string(code_) + ", host " + host_ + ")";
  }

  backend_library library_;
  int code_;
  std::string library_message_;
  std::string call_;
  std::source_location location_;
  int rank_;
  std::string host_;
  std::string operation_;
  std::string message_;  ///< the message naming operation_, when there is one
};

/// Throws weft::error with "rank R: " in front of the message.
[[noreturn]] inline void fail(const std::string& message) {
  int rank = detail::world_rank_for_messages();
  if (rank >= 0) throw error("weft: rank " + std::to_string(rank) + ": " + message);
  throw error("weft: " + message);
}

}  // namespace weft
