#pragma once
/// \file
/// `weft::mpi_environment`: MPI's lifetime as a scope, in the mode the program needs.
///  - `init_and_finalize`: weft owns MPI: initialises it (an error if it already is) and
///    finalizes it at the end of the scope.
///  - `init_if_needed`: initialises MPI unless someone already did; finalizes only what it initialised.
///  - `never`: the program (a trainer, a framework) owns MPI: it must already be initialised, and
///    weft never finalizes it.
/// It asks for MPI_THREAD_MULTIPLE (async collectives run on a progress thread that needs it)
/// and reports the level obtained. Once MPI is up, the world rank goes into every weft error message.

#include <weft/config.hpp>

#if WEFT_HAS_MPI

#include <mpi.h>

#include <string>
#include <string_view>

#include <weft/backend/mpi/check.hpp>
#include <weft/core/error.hpp>

namespace weft {

enum class mpi_init_mode { init_and_finalize, init_if_needed, never };

constexpr std::string_view thread_level_name(int level) noexcept {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    default: return "unknown MPI thread level";
  }
}

class mpi_environment {
 public:
  /// `argc`/`argv` are passed to MPI_Init_thread when weft initialises MPI (they may be null).
  explicit mpi_environment(mpi_init_mode mode = mpi_init_mode::init_if_needed, int* argc = nullptr,
                           char*** argv = nullptr, int requested = MPI_THREAD_MULTIPLE)
      : mode_(mode), requested_(requested) {
    int initialized = 0;
    int finalized = 0;
    WEFT_CHECK_MPI(MPI_Initialized(&initialized));
    WEFT_CHECK_MPI(MPI_Finalized(&finalized));
    if (finalized)
      fail("mpi_environment: MPI was already finalized in this process and cannot be initialised again; "
           "keep one mpi_environment alive for the whole program");
    switch (mode) {
      case mpi_init_mode::init_and_finalize:
        if (initialized)
          fail("mpi_environment(init_and_finalize): MPI is already initialised by someone else; use "
               "mpi_init_mode::init_if_needed, or mpi_init_mode::never if the program owns MPI");
        break;
      case mpi_init_mode::never:
        if (!initialized)
          fail("mpi_environment(never): MPI is not initialised; the program must call MPI_Init_thread first "
               "(or use mpi_init_mode::init_if_needed to let weft do it)");
        break;
      case mpi_init_mode::init_if_needed: break;
    }
    if (!initialized) {
      WEFT_CHECK_MPI(MPI_Init_thread(argc, argv, requested, &provided_));
      initialized_here_ = true;
    } else {
      WEFT_CHECK_MPI(MPI_Query_thread(&provided_));
    }
    WEFT_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    WEFT_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    detail::known_world_rank().store(rank_, std::memory_order_relaxed);
  }

  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;

  /// Finalizes MPI if this object initialised it (every communicator must be gone by then).
  ~mpi_environment() {
    if (!initialized_here_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }

  mpi_init_mode mode() const noexcept { return mode_; }
  /// Whether this object called MPI_Init_thread (and so will call MPI_Finalize).
  bool initialized_here() const noexcept { return initialized_here_; }
  /// The thread level MPI provides (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  int thread_level() const noexcept { return provided_; }
  int requested_thread_level() const noexcept { return requested_; }
  /// True when async MPI operations can overlap the caller's work.
  bool thread_multiple() const noexcept { return provided_ == MPI_THREAD_MULTIPLE; }
  int world_rank() const noexcept { return rank_; }
  int world_size() const noexcept { return size_; }

  /// "MPI_THREAD_MULTIPLE (requested MPI_THREAD_MULTIPLE), initialised by weft", for logs.
  std::string describe() const {
    return std::string(thread_level_name(provided_)) + " (requested " + std::string(thread_level_name(requested_)) +
           "), " + (initialized_here_ ? "initialised by weft" : "initialised by the program");
  }

 private:
  mpi_init_mode mode_;
  int requested_;
  int provided_ = MPI_THREAD_SINGLE;
  bool initialized_here_ = false;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace weft

#endif  // WEFT_HAS_MPI
