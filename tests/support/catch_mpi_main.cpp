// Catch2 main for multi-rank tests: MPI with MPI_THREAD_MULTIPLE (weft's progress threads need it),
// the session on every rank (each rank prints its own report), then one agreed exit code: the
// maximum of the ranks' failure counts, so a failure on any rank fails the run on all of them.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <mpi.h>

#include <cstdio>

int main(int argc, char* argv[]) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  Catch::Session session;
  int status = session.applyCommandLine(argc, argv);
  int failures = status;
  if (status == 0) {
    try {
      failures = session.run();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: uncaught exception: %s\n", rank, e.what());
      failures = 1;
    }
  }
  int any_failure = 0;
  MPI_Allreduce(&failures, &any_failure, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failure != 0) std::fprintf(stderr, "weft test: a rank reported failures\n");
  MPI_Finalize();
  return any_failure != 0 ? 1 : 0;
}
