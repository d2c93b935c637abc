// A communicator that outlives MPI_Finalize makes no MPI call: its operations throw a weft::error
// that says why, and destroying it (with a pending point-to-point request) does not touch MPI
// (Open MPI would abort the process on any call after MPI_Finalize).
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "after finalize: FAILED: %s\n", what);
      ++failures;
    }
  };
  {
    std::optional<weft::communicator<weft::mpi_backend>> world;
    world.emplace(weft::mpi_backend::comm::world(), "world");
    std::vector<int> data{1};
    world->all_reduce(data);
    expect(data[0] == world->size(), "all_reduce before MPI_Finalize");
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    try {
      world->all_reduce(data);
      expect(false, "all_reduce after MPI_Finalize threw");
    } catch (const weft::error& e) {
      expect(std::string(e.what()).find("after MPI_Finalize") != std::string::npos, "the message names MPI_Finalize");
    }
    try {
      auto pending = world->all_reduce_async(data);
      pending.wait();
      expect(false, "async all_reduce after MPI_Finalize threw");
    } catch (const weft::error&) {
    }
    world.reset();  // no MPI_Comm_free, no progress-thread MPI call
  }
  std::printf(failures == 0 ? "after finalize: ok\n" : "after finalize: FAILED\n");
  return failures == 0 ? 0 : 1;
}
