// Preloaded into one rank of a job (tests/bench/slow_rank.sh) to harm it inside a chosen MPI call
// (the MPI profiling interface: each wrapper calls PMPI_...), for the health check's fault tests
// (fault_tests.py health):
//   WEFT_TEST_STOP_AT=MPI_Allreduce:3   the 3rd MPI_Allreduce stops the process (SIGSTOP; continued,
//                                       it never goes on) before it runs; the pid goes to $WEFT_TRACE_DIR/stopped first
//   WEFT_TEST_LATE_MS=30                every MPI_Allreduce returns 30 ms late, after its data
//                                       moved: this rank alone spends longer in each all-reduce
//   WEFT_TEST_LATE_RSB=0:524288:20000,1:0:300
//                                       RANK:BYTES:MICROSECONDS, comma-separated: on world rank RANK,
//                                       each MPI_Reduce_scatter_block of at least BYTES (the whole
//                                       buffer reduced) returns that late, so that each group a
//                                       bucket probe times sees costs of its own (train_gpt's tests)
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

struct reduce_scatter_delay {
  long min_bytes = -1;  // -1: no delay on this rank
  long microseconds = 0;
};

const reduce_scatter_delay& rsb_delay() {
  static const reduce_scatter_delay parsed = [] {
    reduce_scatter_delay d;
    const char* text = std::getenv("WEFT_TEST_LATE_RSB");
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    if (text == nullptr || rank == nullptr) return d;
    const long me = std::atol(rank);
    long r = 0, bytes = 0, us = 0;
    for (const char* at = text; at != nullptr && *at != '\0';) {
      if (std::sscanf(at, "%ld:%ld:%ld", &r, &bytes, &us) == 3 && r == me) d = {bytes, us};
      at = std::strchr(at, ',');
      if (at != nullptr) ++at;
    }
    return d;
  }();
  return parsed;
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

int MPI_Reduce_scatter_block(const void* sendbuf, void* recvbuf, int recvcount, MPI_Datatype datatype, MPI_Op op,
                             MPI_Comm comm) {
  const int code = PMPI_Reduce_scatter_block(sendbuf, recvbuf, recvcount, datatype, op, comm);
  const reduce_scatter_delay& d = rsb_delay();
  if (d.min_bytes >= 0) {
    int type_bytes = 0, ranks = 0;
    PMPI_Type_size(datatype, &type_bytes);
    PMPI_Comm_size(comm, &ranks);
    if (static_cast<long>(recvcount) * type_bytes * ranks >= d.min_bytes) {
      timespec pause{d.microseconds / 1'000'000, (d.microseconds % 1'000'000) * 1000};
      nanosleep(&pause, nullptr);
    }
  }
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
