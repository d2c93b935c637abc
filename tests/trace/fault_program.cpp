// The program the fault tests drive (fault_tests.py): every rank writes its pid to
// <dir>/pid-<rank>, then runs collectives on the world communicator, with the deadline of
// WEFT_COMM_TIMEOUT (and the check level of WEFT_CHECK_LEVEL), until the test harms one rank.
//
//   fault_program DIR loop SECONDS          all_reduce after all_reduce for SECONDS, then exit 0
//   fault_program DIR mismatch KIND         one rank issues a different collective (KIND: count,
//                                           dtype, op, order), the others the expected one
//   fault_program DIR stop WHERE VICTIM     rank VICTIM stops itself (SIGSTOP) at a known place,
//                                           the others go on into WHERE: collective (after 50
//                                           all_reduces, #2..#51, the others enter #52), split,
//                                           groups (process_groups' creation), pipeline (the
//                                           executor's shape agreement), dup (creating the world
//                                           communicator: MPI_Comm_dup)
//   fault_program DIR drain VICTIM SECONDS  every rank but VICTIM queues an async all_reduce on a
//                                           second communicator and destroys it, which waits for
//                                           the queued work; VICTIM sleeps SECONDS instead of joining
//   fault_program DIR slow SECONDS VICTIM   50 all_reduces; before the 20th, VICTIM sleeps SECONDS
//                                           (the others wait inside it), then exit 0
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/layout/layout.hpp>
#include <weft/layout/process_groups.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/schedules.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "busy_loop.hpp"

namespace {

using world_comm = weft::communicator<weft::mpi_backend>;

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

/// The victim stops here; the others go on into the operation under test. It writes its flight
/// recorder first: a stopped rank leaves a dump only if mpiexec's SIGTERM reaches it before the
/// SIGKILL, and the test checks what weft-trace-diff says of it, so its state must be on disk.
/// Continued, it waits for the end: when the job is aborted, mpiexec sends SIGCONT before SIGTERM,
/// and a victim that ran on would finish the collective the others timed out in, and they would
/// go on. (Stopping again instead would leave mpiexec waiting to SIGKILL it: slower to end.)
void stop_if(bool victim) {
  if (!victim) return;
  weft::trace::dump_flight_recorders("request");
  raise(SIGSTOP);
  for (;;) pause();
}

/// `where`: the operation the others wait in while `victim` is stopped (see the top of the file).
void stop_in(world_comm& world, const std::string& where, int victim) {
  const bool stops = world.rank() == victim;
  if (where == "collective") {
    std::vector<float> data(256, 1.0f);
    for (int i = 0; i < 50; ++i) world.all_reduce(data);
    stop_if(stops);
    world.all_reduce(data);
  } else if (where == "split") {
    stop_if(stops);
    world.split(world.rank() % 2, world.rank(), "half");
  } else if (where == "groups") {
    stop_if(stops);
    weft::process_groups<weft::mpi_backend> groups(world, weft::layout::rank_layout({.world_size = world.size(), .tp = 2}));
  } else if (where == "pipeline") {
    stop_if(stops);
    namespace wp = weft::pipeline;
    wp::stage_callbacks<float> callbacks;
    callbacks.forward = [](int, int, std::span<const float>, std::span<float>) {};
    callbacks.backward = [](int, int, std::span<const float>, std::span<float>) {};
    wp::executor<weft::mpi_backend, float> executor(
        world, wp::make_schedule({.kind = wp::schedule_kind::gpipe, .stages = world.size(), .micro_batches = 2}),
        callbacks, {.elements = 16});
  } else if (where != "dup") {  // dup: the victim stopped before the world communicator was made
    throw std::runtime_error("unknown place to stop '" + where + "' (collective, split, groups, pipeline, dup)");
  }
  std::printf("rank %d: went on past the stopped rank\n", world.rank());
}

/// Work queued on a communicator that is then destroyed: its destruction waits for the work,
/// which waits for `victim`, and must stay under the deadline meanwhile.
void drain(world_comm& world, int victim, double victim_sleeps) {
  std::vector<float> data(256, 1.0f);
  std::optional<world_comm::request> pending;
  {
    world_comm second(weft::mpi_backend::comm::world(), "second");
    if (world.rank() == victim) {
      std::this_thread::sleep_for(std::chrono::duration<double>(victim_sleeps));
      return;
    }
    pending = second.all_reduce_async(data);
  }
  std::printf("rank %d: the communicator was destroyed before its queued work finished\n", world.rank());
}

/// A rank slow by `seconds` inside one collective of 50: within the deadline, nothing times out.
void slow(world_comm& world, double seconds, int victim) {
  std::vector<float> data(256, 1.0f);
  for (int i = 0; i < 50; ++i) {
    if (i == 19 && world.rank() == victim) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    world.all_reduce(data);
  }
  const std::vector<float> expected(256, static_cast<float>(world.size()));
  std::fill(data.begin(), data.end(), 1.0f);
  world.all_reduce(data);
  if (data != expected) throw std::runtime_error("the all_reduce after the slow rank gave a wrong sum");
  std::printf("rank %d: 51 all_reduces done\n", world.rank());
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int status = 0;
  try {
    if (argc < 4)
      throw std::runtime_error("usage: fault_program DIR loop SECONDS | DIR mismatch KIND | DIR stop WHERE VICTIM | "
                               "DIR drain VICTIM | DIR slow SECONDS VICTIM");
    const std::string dir = argv[1], mode = argv[2];
    {
      std::ofstream(dir + "/pid-" + std::to_string(rank)) << getpid() << "\n";
    }
    if (mode == "stop" && std::string(argv[3]) == "dup") stop_if(argc > 4 && rank == std::stoi(argv[4]));
    world_comm world(weft::mpi_backend::comm::world(), "world");
    world.barrier();
    if (mode == "loop") weft_tests::all_reduce_loop(world, std::stod(argv[3]));
    else if (mode == "mismatch") mismatch(world, argv[3]);
    else if (mode == "stop" && argc == 5) stop_in(world, argv[3], std::stoi(argv[4]));
    else if (mode == "drain" && argc == 5) drain(world, std::stoi(argv[3]), std::stod(argv[4]));
    else if (mode == "slow" && argc == 5) slow(world, std::stod(argv[3]), std::stoi(argv[4]));
    else throw std::runtime_error("unknown mode or wrong arguments: '" + mode + "'");
    world.barrier();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fault_program: rank %d: %s\n", rank, e.what());
    status = 3;
  }
  std::fflush(stderr);
  MPI_Finalize();
  return status;
}
