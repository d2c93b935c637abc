// The program the fault tests drive (fault_tests.py): every rank writes its pid to
// <dir>/pid-<rank>, then runs collectives on the world communicator, with the deadline of
// WEFT_COMM_TIMEOUT, until the test harms one rank.
//
//   fault_program DIR loop SECONDS          all_reduce after all_reduce for SECONDS, then exit 0
//   fault_program DIR mismatch KIND         one rank issues a different collective (KIND: count,
//                                           dtype, op, order), the others the expected one
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

using world_comm = weft::communicator<weft::mpi_backend>;

void loop(world_comm& world, double seconds) {
  std::vector<float> data(256, 1.0f);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    world.all_reduce(data);
    std::fill(data.begin(), data.end(), 1.0f);
    usleep(1000);  // leave the cores to the test harness and the other ranks
  }
}

/// Ranks agree on a few collectives, then the last rank diverges in one way.
void mismatch(world_comm& world, const std::string& kind) {
  std::vector<float> floats(64, 1.0f);
  std::vector<double> doubles(64, 1.0);
  for (int i = 0; i < 3; ++i) world.all_reduce(floats);
  const bool odd = world.rank() == world.size() - 1;
  if (kind == "count") {
    world.all_reduce(std::span<float>(floats).first(odd ? 63 : 64));
  } else if (kind == "dtype") {
    if (odd) world.all_reduce(doubles);
    else world.all_reduce(floats);
  } else if (kind == "op") {
    world.all_reduce(floats, odd ? weft::reduce_op::max : weft::reduce_op::sum);
  } else if (kind == "order") {
    if (odd) {
      world.broadcast(floats, 0);
      world.all_reduce(floats);
    } else {
      world.all_reduce(floats);
      world.broadcast(floats, 0);
    }
  } else {
    throw std::runtime_error("unknown mismatch kind '" + kind + "' (count, dtype, op, order)");
  }
  std::printf("rank %d: the mismatch went unnoticed\n", world.rank());
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  try {
    if (argc != 4) throw std::runtime_error("usage: fault_program DIR loop SECONDS | DIR mismatch KIND");
    const std::string dir = argv[1], mode = argv[2];
    world_comm world(weft::mpi_backend::comm::world(), "world");
    {
      std::ofstream(dir + "/pid-" + std::to_string(rank)) << getpid() << "\n";
    }
    world.barrier();
    if (mode == "loop") loop(world, std::stod(argv[3]));
    else if (mode == "mismatch") mismatch(world, argv[3]);
    else throw std::runtime_error("unknown mode '" + mode + "'");
    world.barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fault_program: rank %d: %s\n", rank, e.what());
    status = 3;
  }
  std::fflush(stderr);
  MPI_Finalize();
  return status;
}
