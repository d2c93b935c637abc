// What weft resolves from the launcher that started this process, checked against MPI's own view
// (resolve_launch_with_mpi), one line per rank for a driver script to compare with what it asked
// the launcher for, with the host it runs on. Any disagreement aborts the job with weft's message.
#include <mpi.h>

#include <weft/launch/mpi_cross_check.hpp>
#include <weft/launch/mpi_environment.hpp>
#include <weft/launch/resolve.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include <unistd.h>

int main(int argc, char** argv) {
  weft::mpi_environment environment(weft::mpi_init_mode::init_and_finalize, &argc, &argv);
  try {
    const weft::launch_info info = weft::resolve_launch_with_mpi();
    int rank_sum = 0;
    MPI_Allreduce(&info.rank, &rank_sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    const std::string source(weft::to_string(info.source));
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    std::printf("launcher=%s rank=%d world=%d local_rank=%d local_world=%d node=%d nodes=%d rank_sum=%d host=%s\n",
                source.c_str(), info.rank, info.world_size, info.local_rank, info.local_world_size, info.node,
                info.node_count, rank_sum, host);
    std::fflush(stdout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launcher_report: %s\n", e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  return 0;
}
