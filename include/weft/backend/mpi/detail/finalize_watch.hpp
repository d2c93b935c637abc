#pragma once
/// \file
/// Whether MPI is finalized (or finalizing), cheaply enough to ask before every operation. A
/// communicator can outlive MPI_Finalize (a global, or one destroyed after the mpi_environment
/// that finalized MPI); any MPI call it made then would be erroneous, and Open MPI aborts the
/// process on it. weft sets a flag from an attribute delete callback on MPI_COMM_SELF, which MPI
/// runs at the very start of MPI_Finalize, and each operation tests that flag (one relaxed load)
/// and throws instead of calling MPI.

#include <mpi.h>

#include <atomic>
#include <mutex>
#include <string>

#include <weft/core/error.hpp>

namespace weft::detail::mpi {

inline std::atomic<bool>& finalize_started() {
  static std::atomic<bool> started{false};
  return started;
}

inline int note_finalize(MPI_Comm, int, void*, void*) {
  finalize_started().store(true, std::memory_order_release);
  return MPI_SUCCESS;
}

/// Arms the flag (once per process: MPI cannot be initialised twice). Needs MPI initialised.
inline void watch_for_finalize() {
  static std::once_flag once;
  std::call_once(once, [] {
    int keyval = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &note_finalize, &keyval, nullptr) != MPI_SUCCESS) return;
    MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr);
    MPI_Comm_free_keyval(&keyval);
  });
}

/// True once MPI_Finalize has begun (by weft's flag, or by MPI's own answer).
inline bool mpi_finalized() noexcept {
  if (finalize_started().load(std::memory_order_acquire)) return true;
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

[[noreturn, gnu::cold, gnu::noinline]] inline void used_after_finalize(const char* what) {
  fail(std::string("an MPI communicator of weft was used (") + what +
       ") after MPI_Finalize; weft makes no MPI call then. Destroy communicators, and finish their "
       "operations, before MPI is finalized (before the weft::mpi_environment that owns MPI ends)");
}

/// Throws instead of calling MPI once MPI_Finalize has begun: one relaxed load on the hot path.
inline void expect_mpi_alive(const char* what) {
  if (finalize_started().load(std::memory_order_relaxed)) [[unlikely]]
    used_after_finalize(what);
}

}  // namespace weft::detail::mpi
