// mpi_environment when weft owns MPI: run under mpiexec with one mode per test. A plain main (the
// shared test main would initialise MPI itself); every check prints what failed and the process
// exits non-zero, which fails the test.
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/launch/mpi_environment.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "mpi_environment_owner: FAILED: %s\n", what);
    ++failures;
  }
}

bool mpi_initialized() {
  int flag = 0;
  MPI_Initialized(&flag);
  return flag != 0;
}

bool mpi_finalized() {
  int flag = 0;
  MPI_Finalized(&flag);
  return flag != 0;
}

// A weft::error whose message contains `text` when constructing with `mode`.
bool refuses(weft::mpi_init_mode mode, const char* text) {
  try {
    weft::mpi_environment env(mode);
  } catch (const weft::error& e) {
    if (std::strstr(e.what(), text) != nullptr) return true;
    std::fprintf(stderr, "mpi_environment_owner: unexpected message: %s\n", e.what());
  }
  return false;
}

// A weft::error (not an abort inside MPI) whose message contains `when` and names
// weft::mpi_environment, when a communicator is made outside MPI's lifetime.
bool communicator_refused(const char* when) {
  try {
    weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  } catch (const weft::error& e) {
    if (std::strstr(e.what(), when) != nullptr && std::strstr(e.what(), "weft::mpi_environment") != nullptr)
      return true;
    std::fprintf(stderr, "mpi_environment_owner: unexpected message: %s\n", e.what());
  }
  return false;
}

// Initialises and finalizes through `mode`, checking what the environment reports.
void owned_lifetime(weft::mpi_init_mode mode, int* argc, char*** argv) {
  expect(!mpi_initialized(), "MPI starts uninitialised");
  {
    weft::mpi_environment env(mode, argc, argv);
    expect(env.initialized_here(), "the environment initialised MPI");
    expect(mpi_initialized(), "MPI is initialised inside the scope");
    int provided = 0;
    MPI_Query_thread(&provided);
    expect(env.thread_level() == provided, "thread_level() is what MPI provides");
    expect(env.thread_level() == MPI_THREAD_MULTIPLE, "MPI_THREAD_MULTIPLE was obtained");
    int rank = -1, size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    expect(env.world_rank() == rank && env.world_size() == size, "world rank and size");
    expect(weft::detail::known_world_rank().load() == rank, "the rank for error messages is set");
    int one = 1, sum = 0;
    MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    expect(sum == size, "MPI works inside the scope");
  }
  expect(mpi_finalized(), "MPI is finalized at the end of the scope");
  expect(communicator_refused("after MPI_Finalize"), "a communicator after MPI_Finalize is a weft::error");
  expect(refuses(weft::mpi_init_mode::init_if_needed, "already finalized"),
         "a second environment after finalize is refused with a clear message");
}

}  // namespace

int main(int argc, char* argv[]) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "init_and_finalize") {
    owned_lifetime(weft::mpi_init_mode::init_and_finalize, &argc, &argv);
  } else if (mode == "init_if_needed") {
    owned_lifetime(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  } else if (mode == "before_init") {
    expect(communicator_refused("before MPI was initialised"),
           "a communicator before MPI is initialised is a weft::error naming weft::mpi_environment");
    weft::mpi_environment env(weft::mpi_init_mode::init_if_needed, &argc, &argv);
    weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
    std::vector<int> one{1};
    world.all_reduce(one);
    expect(one[0] == world.size(), "the same communicator works once the environment exists");
  } else if (mode == "never") {
    expect(refuses(weft::mpi_init_mode::never, "MPI is not initialised"),
           "never mode without an initialised MPI is refused with a clear message");
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    {
      weft::mpi_environment env(weft::mpi_init_mode::never);
      expect(!env.initialized_here(), "never mode does not initialise");
    }
    expect(!mpi_finalized(), "never mode does not finalize");
    MPI_Finalize();
  } else {
    std::fprintf(stderr, "usage: %s init_and_finalize|init_if_needed|never|before_init\n", argv[0]);
    return 2;
  }
  return failures == 0 ? 0 : 1;
}
