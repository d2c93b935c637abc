// Preloaded into one rank of a job (tests/bench/slow_rank.sh) to harm it inside a chosen MPI call
// (the MPI profiling interface: each wrapper calls PMPI_...), for the health check's fault tests
// (fault_tests.py health):
//   WEFT_TEST_STOP_AT=MPI_Allreduce:3   the 3rd MPI_Allreduce stops the process (SIGSTOP; continued,
//                                       it never goes on) before it runs; the pid goes to $WEFT_TRACE_DIR/stopped first
//   WEFT_TEST_LATE_MS=30                every MPI_Allreduce returns 30 ms late, after its data
//                                       moved: this rank alone spends longer in each all-reduce
#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <time.h>
#include <unistd.h>

namespace {

struct stop_plan {
  std::string function;
  int call = 0;
};

const stop_plan& plan() {
  static const stop_plan parsed = [] {
    stop_plan p;
    const char* text = std::getenv("WEFT_TEST_STOP_AT");
    if (text == nullptr) return p;
    const char* colon = std::strchr(text, ':');
    if (colon == nullptr) return p;
    p.function.assign(text, colon);
    p.call = std::atoi(colon + 1);
    return p;
  }();
  return parsed;
}

/// Stops the process at the planned call of `function` (whose calls `count` counts).
void maybe_stop(const char* function, int& count) {
  ++count;
  if (plan().function != function || plan().call != count) return;
  if (const char* dir = std::getenv("WEFT_TRACE_DIR")) {
    if (FILE* out = std::fopen((std::string(dir) + "/stopped").c_str(), "w")) {
      std::fprintf(out, "%ld\n", static_cast<long>(getpid()));
      std::fclose(out);
    }
  }
  // Continued, it waits for the end: mpiexec sends SIGCONT before SIGTERM when it ends the job,
  // and a rank that ran on would finish the call the others timed out in.
  raise(SIGSTOP);
  for (;;) pause();
}

void late() {
  static const long ms = [] {
    const char* text = std::getenv("WEFT_TEST_LATE_MS");
    return text != nullptr ? std::atol(text) : 0L;
  }();
  if (ms <= 0) return;
  timespec pause{ms / 1000, (ms % 1000) * 1'000'000};
  nanosleep(&pause, nullptr);
}

int dups = 0, gathers = 0, reductions = 0, barriers = 0, broadcasts = 0, splits = 0;

}  // namespace

extern "C" {

int MPI_Comm_dup(MPI_Comm comm, MPI_Comm* newcomm) {
  maybe_stop("MPI_Comm_dup", dups);
  return PMPI_Comm_dup(comm, newcomm);
}

int MPI_Allgather(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf, int recvcount,
                  MPI_Datatype recvtype, MPI_Comm comm) {
  maybe_stop("MPI_Allgather", gathers);
  return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
}

int MPI_Allreduce(const void* sendbuf, void* recvbuf, int count, MPI_Datatype datatype, MPI_Op op, MPI_Comm comm) {
  maybe_stop("MPI_Allreduce", reductions);
  const int code = PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
  late();
  return code;
}

int MPI_Barrier(MPI_Comm comm) {
  maybe_stop("MPI_Barrier", barriers);
  return PMPI_Barrier(comm);
}

int MPI_Bcast(void* buffer, int count, MPI_Datatype datatype, int root, MPI_Comm comm) {
  maybe_stop("MPI_Bcast", broadcasts);
  return PMPI_Bcast(buffer, count, datatype, root, comm);
}

int MPI_Comm_split(MPI_Comm comm, int color, int key, MPI_Comm* newcomm) {
  maybe_stop("MPI_Comm_split", splits);
  return PMPI_Comm_split(comm, color, key, newcomm);
}

}  // extern "C"
