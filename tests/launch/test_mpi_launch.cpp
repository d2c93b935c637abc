// mpi_environment in a program that already initialised MPI (the shared test main did, with
// MPI_THREAD_MULTIPLE), and the launcher resolver checked against MPI's own view.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <weft/launch/mpi_cross_check.hpp>
#include <weft/launch/mpi_environment.hpp>
#include <weft/launch/resolve.hpp>

#include <string>

using weft::environment_map;
using weft::launcher;
using weft::mpi_environment;
using weft::mpi_init_mode;
using Catch::Contains;

namespace {

int mpi_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int mpi_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

environment_map torchrun_env(int rank, int size, int local_rank, int local_size) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(size)},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(local_size)}};
}

// The message cross_check_with_mpi throws on this rank ("" if none).
std::string cross_check_error(weft::launch_info info) {
  try {
    weft::cross_check_with_mpi(info);
  } catch (const weft::error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("mpi_environment(never) uses the program's MPI and reports its thread level", "[launch][mpi]") {
  weft::detail::known_world_rank().store(-1);
  int provided = 0;
  MPI_Query_thread(&provided);
  {
    mpi_environment env(mpi_init_mode::never);
    CHECK_FALSE(env.initialized_here());
    CHECK(env.thread_level() == provided);
    CHECK(env.thread_multiple() == (provided == MPI_THREAD_MULTIPLE));
    CHECK(env.world_rank() == mpi_rank());
    CHECK(env.world_size() == mpi_size());
    CHECK(weft::detail::known_world_rank().load() == mpi_rank());
    CHECK_THAT(env.describe(), Contains(std::string(weft::thread_level_name(provided))) &&
                                   Contains("initialised by the program"));
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  CHECK(finalized == 0);  // never finalizes what it did not initialise
}

TEST_CASE("mpi_environment(init_if_needed) leaves an initialised MPI alone", "[launch][mpi]") {
  {
    mpi_environment env(mpi_init_mode::init_if_needed);
    CHECK_FALSE(env.initialized_here());
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  CHECK(finalized == 0);
  int one = 1, sum = 0;  // MPI still works afterwards
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == mpi_size());
}

TEST_CASE("mpi_environment(init_and_finalize) refuses an MPI someone else initialised", "[launch][mpi]") {
  CHECK_THROWS_WITH(mpi_environment(mpi_init_mode::init_and_finalize),
                    Contains("MPI is already initialised by someone else") && Contains("init_if_needed"));
}

TEST_CASE("the launcher's layout under mpirun agrees with MPI", "[launch][mpi]") {
  auto info = weft::resolve_launch();
  CHECK(info.source == launcher::open_mpi);
  CHECK(info.rank == mpi_rank());
  CHECK(info.world_size == mpi_size());
  weft::cross_check_with_mpi(info);
  // All test ranks run on this one machine.
  CHECK(info.local_world_size == mpi_size());
  CHECK(info.local_rank == mpi_rank());
  CHECK(info.node == 0);
  CHECK(info.node_count == 1);
  CHECK_FALSE(info.node_derived);

  weft::detail::known_world_rank().store(-1);
  auto checked = weft::resolve_launch_with_mpi();
  CHECK(checked.rank == mpi_rank());
  CHECK(weft::detail::known_world_rank().load() == mpi_rank());
}

TEST_CASE("without launcher variables, MPI's own layout is used", "[launch][mpi]") {
  auto info = weft::resolve_launch(environment_map{{"WEFT_LAUNCHER", "none"}});
  REQUIRE(info.source == launcher::none);
  weft::cross_check_with_mpi(info);
  CHECK(info.source == launcher::mpi);
  CHECK(info.rank == mpi_rank());
  CHECK(info.world_size == mpi_size());
  CHECK(info.local_rank == mpi_rank());
  CHECK(info.local_world_size == mpi_size());
  CHECK(info.node == 0);
  CHECK(info.node_count == 1);
}

TEST_CASE("launcher variables that disagree with MPI fail on every rank", "[launch][mpi]") {
  const int r = mpi_rank();
  const int p = mpi_size();

  SECTION("every rank shifted by one") {
    auto info = weft::resolve_launch(torchrun_env((r + 1) % p, p, (r + 1) % p, p));
    std::string message = cross_check_error(info);
    if (p == 1) {
      CHECK(message.empty());
    } else {
      CHECK_THAT(message, Contains("the launcher variables say rank " + std::to_string((r + 1) % p) + " of " +
                                   std::to_string(p) + " but MPI says rank " + std::to_string(r)));
      CHECK_THAT(message, Contains("RANK=" + std::to_string((r + 1) % p)));
    }
  }

  SECTION("one rank with a stale world size: it names the cause, the others point to it") {
    auto info = weft::resolve_launch(torchrun_env(r, r == 0 ? p + 1 : p, r, r == 0 ? p + 1 : p));
    std::string message = cross_check_error(info);
    if (r == 0)
      CHECK_THAT(message, Contains("say rank 0 of " + std::to_string(p + 1) + " but MPI says rank 0 of " +
                                   std::to_string(p)));
    else
      CHECK_THAT(message, Contains("another rank's launcher variables disagree with MPI"));
  }

  SECTION("local ranks that do not match the processes sharing the node") {
    // One process per node claimed, but all ranks share this machine.
    auto env = torchrun_env(r, p, 0, 1);
    auto info = weft::resolve_launch(env);
    std::string message = cross_check_error(info);
    if (p == 1) {
      CHECK(message.empty());
    } else if (r == 0) {
      CHECK_THAT(message, Contains("say local rank 0 of 1 but MPI finds local rank 0 of " + std::to_string(p)));
    } else {
      CHECK_THAT(message, Contains("say local rank 0 of 1 but MPI finds local rank " + std::to_string(r)));
    }
  }
}
