#pragma once
/// \file
/// How the watchdog aborts a communicator from its own thread, whatever the backend: a callable
/// (NCCL: ncclCommAbort; MPI: MPI_Abort) and whether it returns. The watchdog runs the ones that
/// return first, then the ones that end the process (weft/trace/watchdog.hpp).

#include <functional>

namespace weft::trace {

struct abort_action {
  std::function<void(int status)> run;  ///< empty: nothing to abort (the process exit is enough)
  bool ends_process = false;            ///< true when run() never returns (MPI_Abort)
};

}  // namespace weft::trace
