#pragma once
/// \file
/// `watched_call`: a blocking MPI call that weft makes outside any communicator's operations
/// (duplicating MPI_COMM_WORLD for a new communicator, the launch cross-check, the NCCL
/// bootstrap's exchange) runs as the one operation of a flight recorder of its own, registered
/// with the process's watchdog for the call's length. So it has a deadline like every collective:
/// a rank that never joins makes the others print the timeout message, dump their recorders and
/// end the job with MPI_Abort (exit 124), instead of waiting forever. Costs one small allocation
/// and the watchdog's lock: for set-up calls, not for the hot path.

#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include <weft/backend/mpi/detail/finalize_watch.hpp>
#include <weft/core/dtype.hpp>
#include <weft/trace/abort_action.hpp>
#include <weft/trace/flight_recorder.hpp>
#include <weft/trace/operation.hpp>
#include <weft/trace/watchdog.hpp>

namespace weft::detail::mpi {

/// What the watchdog does to end a late MPI call: MPI_Abort on MPI_COMM_WORLD, which ends every
/// rank of the job (MPI cannot abort one communicator alone).
/// The watchdog calls it from its own thread, which MPI allows only under MPI_THREAD_MULTIPLE
/// (the level is read here, on the thread that makes the action); at a lower level it says so and
/// returns, and the watchdog ends this process with the same status (the launcher then ends the
/// others).
inline trace::abort_action abort_job() {
  int level = MPI_THREAD_SINGLE;
  if (!mpi_finalized()) MPI_Query_thread(&level);
  return {[threads_ok = level == MPI_THREAD_MULTIPLE](int status) {
            if (mpi_finalized()) return;
            if (!threads_ok) {
              const std::string text = "weft: MPI was initialised below MPI_THREAD_MULTIPLE, so MPI_Abort cannot be "
                                       "called from the watchdog's thread; ending this process with status " +
                                       std::to_string(status) + " instead\n";
              [[maybe_unused]] auto written = write(STDERR_FILENO, text.data(), text.size());
              return;
            }
            MPI_Abort(MPI_COMM_WORLD, status);
          },
          /*ends_process=*/true};
}

/// Runs `work` (a blocking MPI call over `over`) recorded as operation `op` of `count` x `type`
/// on group `group`, held to `timeout` (0: none) by the watchdog. Rethrows what `work` throws.
template <class Work>
void watched_call(MPI_Comm over, std::string group, trace::operation op, dtype type, std::uint64_t count,
                  std::chrono::milliseconds timeout, Work&& work) {
  int rank = 0, size = 1;
  MPI_Comm_rank(over, &rank);
  MPI_Comm_size(over, &size);
  auto recorder = std::make_shared<trace::flight_recorder>(std::move(group), rank, size, 1, timeout);
  const trace::watchdog::registration watch = trace::watchdog::instance().watch(recorder, abort_job());
  const std::uint64_t sequence = recorder->issue(op, type, count, -1, -1, /*started=*/true);
  try {
    std::forward<Work>(work)();
  } catch (...) {
    recorder->finish(sequence, false);
    throw;
  }
  recorder->finish(sequence);
}

}  // namespace weft::detail::mpi
