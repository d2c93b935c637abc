// The program dump_tests.py drives: every rank writes its pid to <dir>/pid-<rank>, then
//
//   dump_program DIR loop SECONDS    all_reduce after all_reduce on the world communicator for
//                                    SECONDS, then exit 0
//   dump_program DIR idle SECONDS    rank 0 waits for a message from rank 1 that never comes; the
//                                    other ranks wait outside any operation (so only rank 0 times
//                                    out; the others dump only when it asks them to)
//
// DUMP_PROGRAM_THREAD_LEVEL=funneled initialises MPI with MPI_THREAD_FUNNELED (default: multiple).
// DUMP_PROGRAM_OWN_TRACE_DIR=RANK:DIR gives world rank RANK the WEFT_TRACE_DIR DIR.
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "busy_loop.hpp"

namespace {

using world_comm = weft::communicator<weft::mpi_backend>;

void idle(world_comm& world, double seconds) {
  if (world.rank() == 0) {
    std::vector<float> data(16);
    world.recv(std::span<float>(data), 1);
  } else {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* level_text = std::getenv("DUMP_PROGRAM_THREAD_LEVEL");
  const bool funneled = level_text != nullptr && std::string(level_text) == "funneled";
  int provided = 0;
  MPI_Init_thread(&argc, &argv, funneled ? MPI_THREAD_FUNNELED : MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  if (const char* own = std::getenv("DUMP_PROGRAM_OWN_TRACE_DIR")) {
    const std::string spec = own;
    const auto colon = spec.find(':');
    if (colon != std::string::npos && std::stoi(spec.substr(0, colon)) == rank)
      setenv("WEFT_TRACE_DIR", spec.substr(colon + 1).c_str(), 1);  // before any thread of weft's starts
  }
  try {
    if (argc != 4) throw std::runtime_error("usage: dump_program DIR loop|idle SECONDS");
    const std::string dir = argv[1], mode = argv[2];
    world_comm world(weft::mpi_backend::comm::world(), "world");
    {
      std::ofstream(dir + "/pid-" + std::to_string(rank)) << getpid() << "\n";
    }
    world.barrier();
    if (mode == "loop") weft_tests::all_reduce_loop(world, std::stod(argv[3]));
    else if (mode == "idle") idle(world, std::stod(argv[3]));
    else throw std::runtime_error("unknown mode '" + mode + "'");
    world.barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dump_program: rank %d: %s\n", rank, e.what());
    status = 3;
  }
  std::fflush(stderr);
  MPI_Finalize();
  return status;
}
