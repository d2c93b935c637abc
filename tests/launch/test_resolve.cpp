// The launcher resolver on hand-written environments: every launcher, precedence, missing,
// malformed and contradictory variables, and the messages that name them.
#include <catch2/catch.hpp>

#include <weft/launch/resolve.hpp>

#include <cstdlib>
#include <string>
#include <vector>

using weft::environment_map;
using weft::launcher;
using weft::resolve_launch;
using Catch::Contains;

namespace {

// The message of the weft::error that resolving `env` throws ("" if it does not throw).
std::string error_of(const environment_map& env) {
  try {
    resolve_launch(env);
  } catch (const weft::error& e) {
    return e.what();
  }
  return "";
}

environment_map slurm_8_on_4() {
  return {{"SLURM_PROCID", "5"},  {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
          {"SLURM_NODEID", "2"},  {"SLURM_NNODES", "4"}, {"SLURM_TASKS_PER_NODE", "2(x4)"}};
}

environment_map torchrun_8_on_2() {
  return {{"RANK", "6"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"}};
}

environment_map open_mpi_6_on_3() {
  return {{"OMPI_COMM_WORLD_RANK", "3"},
          {"OMPI_COMM_WORLD_SIZE", "6"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
}

}  // namespace

TEST_CASE("no launcher variables: a single process", "[launch]") {
  auto info = resolve_launch(environment_map{{"PATH", "/usr/bin"}, {"RANK", ""}});
  CHECK(info.source == launcher::none);
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.local_rank == 0);
  CHECK(info.local_world_size == 1);
  CHECK(info.node == 0);
  CHECK(info.node_count == 1);
}

TEST_CASE("Slurm: rank, local rank, sizes and node from srun's variables", "[launch][slurm]") {
  auto info = resolve_launch(slurm_8_on_4());
  CHECK(info.source == launcher::slurm);
  CHECK(info.rank == 5);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 2);
  CHECK(info.node == 2);
  CHECK(info.node_count == 4);
  CHECK_FALSE(info.node_derived);
  CHECK_THAT(info.variables, Contains("SLURM_PROCID=5") && Contains("SLURM_TASKS_PER_NODE=2(x4)"));
  CHECK_THAT(info.describe(), Contains("rank 5 of 8") && Contains("local rank 1 of 2") &&
                                  Contains("node 2 of 4") && Contains("from slurm"));
}

TEST_CASE("Slurm: uneven nodes take this node's entry of the step's task list", "[launch][slurm]") {
  environment_map env{{"SLURM_PROCID", "6"},        {"SLURM_NTASKS", "7"},
                      {"SLURM_LOCALID", "0"},       {"SLURM_NODEID", "2"},
                      {"SLURM_STEP_NUM_NODES", "3"}, {"SLURM_STEP_TASKS_PER_NODE", "3(x2),1"},
                      {"SLURM_TASKS_PER_NODE", "4(x3)"}};  // the job's list: the step's wins
  auto info = resolve_launch(env);
  CHECK(info.local_world_size == 1);
  CHECK(info.node_count == 3);
  env["SLURM_PROCID"] = "4";
  env["SLURM_LOCALID"] = "1";
  env["SLURM_NODEID"] = "1";
  CHECK(resolve_launch(env).local_world_size == 3);
}

TEST_CASE("Slurm: --ntasks-per-node alone gives the local size; node count from the layout", "[launch][slurm]") {
  environment_map env{{"SLURM_PROCID", "3"}, {"SLURM_NPROCS", "4"}, {"SLURM_LOCALID", "1"},
                      {"SLURM_NODEID", "1"}, {"SLURM_NTASKS_PER_NODE", "2"}};
  auto info = resolve_launch(env);
  CHECK(info.world_size == 4);
  CHECK(info.local_world_size == 2);
  CHECK(info.node == 1);
  CHECK(info.node_count == 2);
}

TEST_CASE("Slurm task lists expand as Slurm writes them", "[launch][slurm]") {
  using weft::detail::launch::parse_tasks_per_node;
  CHECK(parse_tasks_per_node("X", "2(x3),1") == std::vector<int>{2, 2, 2, 1});
  CHECK(parse_tasks_per_node("X", "4") == std::vector<int>{4});
  CHECK(parse_tasks_per_node("X", "1,8(x2)") == std::vector<int>{1, 8, 8});
  for (const char* bad : {"", "2(x", "2(3)", "a", "2(x0)", "2,,1", "2(x3)x"})
    CHECK_THROWS_WITH(parse_tasks_per_node("SLURM_TASKS_PER_NODE", bad),
                      Contains("SLURM_TASKS_PER_NODE='" + std::string(bad) + "' is not a Slurm task list"));
}

TEST_CASE("Slurm: missing variables are all named at once", "[launch][slurm]") {
  std::string message = error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}});
  CHECK_THAT(message, Contains("Slurm variables are incomplete"));
  CHECK_THAT(message, Contains("SLURM_LOCALID") && Contains("SLURM_NODEID"));
  CHECK_THAT(message, Contains("SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE"));
  CHECK_THAT(message, Contains("found SLURM_PROCID=0 SLURM_NTASKS=4"));
  CHECK_THAT(message, !Contains("SLURM_NTASKS or"));  // present ones are not reported missing
}

TEST_CASE("Slurm: contradictory variables are named with their values", "[launch][slurm]") {
  auto env = slurm_8_on_4();
  env["SLURM_PROCID"] = "8";
  CHECK_THAT(error_of(env), Contains("SLURM_PROCID=8 is not below SLURM_NTASKS=8"));

  env = slurm_8_on_4();
  env["SLURM_LOCALID"] = "2";
  CHECK_THAT(error_of(env), Contains("SLURM_LOCALID=2 is not below SLURM_TASKS_PER_NODE[2]=2"));

  env = slurm_8_on_4();
  env["SLURM_NNODES"] = "3";
  CHECK_THAT(error_of(env), Contains("SLURM_TASKS_PER_NODE='2(x4)' lists 4 nodes but the node count is 3"));

  env = slurm_8_on_4();
  env.erase("SLURM_NNODES");
  env["SLURM_NODEID"] = "4";
  CHECK_THAT(error_of(env), Contains("SLURM_NODEID=4 but SLURM_TASKS_PER_NODE='2(x4)' lists 4 nodes"));

  env = slurm_8_on_4();
  env["SLURM_STEP_TASKS_PER_NODE"] = "3(x4)";
  CHECK_THAT(error_of(env), Contains("SLURM_STEP_TASKS_PER_NODE='3(x4)' adds up to 12 tasks but the world size is 8"));
}

TEST_CASE("Open MPI: mpirun's variables; node derived from the layout", "[launch][openmpi]") {
  auto info = resolve_launch(open_mpi_6_on_3());
  CHECK(info.source == launcher::open_mpi);
  CHECK(info.rank == 3);
  CHECK(info.world_size == 6);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 2);
  CHECK(info.node == 1);
  CHECK(info.node_count == 3);
  CHECK(info.node_derived);

  auto uneven = open_mpi_6_on_3();
  uneven["OMPI_COMM_WORLD_SIZE"] = "5";
  auto u = resolve_launch(uneven);
  CHECK(u.node == -1);
  CHECK(u.node_count == -1);
  CHECK_THAT(u.describe(), Contains("node ? of ?"));
}

TEST_CASE("Open MPI: missing and contradictory variables", "[launch][openmpi]") {
  auto env = open_mpi_6_on_3();
  env.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
  std::string message = error_of(env);
  CHECK_THAT(message, Contains("Open MPI variables are incomplete: missing OMPI_COMM_WORLD_LOCAL_SIZE"));

  env = open_mpi_6_on_3();
  env["OMPI_COMM_WORLD_LOCAL_SIZE"] = "7";
  CHECK_THAT(error_of(env), Contains("OMPI_COMM_WORLD_LOCAL_SIZE=7 exceeds OMPI_COMM_WORLD_SIZE=6"));

  env = open_mpi_6_on_3();
  env["OMPI_COMM_WORLD_SIZE"] = "0";
  env["OMPI_COMM_WORLD_RANK"] = "0";
  CHECK_THAT(error_of(env), Contains("OMPI_COMM_WORLD_SIZE=0 must be at least 1"));
}

TEST_CASE("torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK", "[launch][torchrun]") {
  auto env = torchrun_8_on_2();
  auto derived = resolve_launch(env);
  CHECK(derived.source == launcher::torchrun);
  CHECK(derived.rank == 6);
  CHECK(derived.world_size == 8);
  CHECK(derived.local_rank == 2);
  CHECK(derived.local_world_size == 4);
  CHECK(derived.node == 1);
  CHECK(derived.node_count == 2);
  CHECK(derived.node_derived);

  env["GROUP_RANK"] = "1";
  env["GROUP_WORLD_SIZE"] = "2";
  auto given = resolve_launch(env);
  CHECK(given.node == 1);
  CHECK(given.node_count == 2);
  CHECK_FALSE(given.node_derived);

  env["GROUP_RANK"] = "2";
  CHECK_THAT(error_of(env), Contains("GROUP_RANK=2 is not below GROUP_WORLD_SIZE=2"));

  env["GROUP_RANK"] = "0";
  env.erase("GROUP_WORLD_SIZE");
  env["LOCAL_WORLD_SIZE"] = "0";
  CHECK_THAT(error_of(env), Contains("LOCAL_WORLD_SIZE=0 must be at least 1"));
}

TEST_CASE("torchrun: missing and malformed variables", "[launch][torchrun]") {
  std::string message = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
  CHECK_THAT(message, Contains("torchrun-style variables are incomplete: missing LOCAL_RANK, LOCAL_WORLD_SIZE"));

  auto env = torchrun_8_on_2();
  env["RANK"] = "abc";
  CHECK_THAT(error_of(env), Contains("RANK='abc' is not a non-negative integer"));
  env["RANK"] = "-1";
  CHECK_THAT(error_of(env), Contains("RANK='-1' is not a non-negative integer"));
  env["RANK"] = "6 ";
  CHECK_THAT(error_of(env), Contains("RANK='6 ' is not a non-negative integer"));
}

TEST_CASE("precedence: torchrun over Open MPI over Slurm", "[launch]") {
  environment_map env = slurm_8_on_4();
  // mpirun inside a Slurm job: the SLURM_* variables describe the job script, not the rank.
  for (auto& [k, v] : open_mpi_6_on_3()) env[k] = v;
  auto info = resolve_launch(env);
  CHECK(info.source == launcher::open_mpi);
  CHECK(info.rank == 3);

  // A wrapper that exports RANK/WORLD_SIZE consistently with mpirun.
  env["RANK"] = "3";
  env["WORLD_SIZE"] = "6";
  env["LOCAL_RANK"] = "1";
  env["LOCAL_WORLD_SIZE"] = "2";
  CHECK(resolve_launch(env).source == launcher::torchrun);

  env["RANK"] = "4";
  std::string message = error_of(env);
  CHECK_THAT(message, Contains("contradictory launcher variables: RANK=4 WORLD_SIZE=6 but OMPI_COMM_WORLD_RANK=3"));
  CHECK_THAT(message, Contains("WEFT_LAUNCHER=openmpi"));
}

TEST_CASE("WEFT_LAUNCHER chooses the launcher explicitly", "[launch]") {
  environment_map env = slurm_8_on_4();
  for (auto& [k, v] : torchrun_8_on_2()) env[k] = v;
  env["WEFT_LAUNCHER"] = "slurm";
  CHECK(resolve_launch(env).source == launcher::slurm);
  CHECK(resolve_launch(env).rank == 5);
  env["WEFT_LAUNCHER"] = "torchrun";
  CHECK(resolve_launch(env).rank == 6);
  env["WEFT_LAUNCHER"] = "none";
  CHECK(resolve_launch(env).source == launcher::none);
  env["WEFT_LAUNCHER"] = "openmpi";
  CHECK_THAT(error_of(env), Contains("Open MPI variables are incomplete"));
  env["WEFT_LAUNCHER"] = "pbs";
  CHECK_THAT(error_of(env), Contains("WEFT_LAUNCHER='pbs' is not one of slurm, openmpi, torchrun, none"));
}

TEST_CASE("resolve_launch() reads this process's environment", "[launch]") {
  setenv("WEFT_LAUNCHER", "torchrun", 1);
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "3", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "3", 1);
  CHECK(weft::current_environment().at("WORLD_SIZE") == "3");
  auto info = resolve_launch();
  for (const char* name : {"WEFT_LAUNCHER", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}) unsetenv(name);
  CHECK(info.source == launcher::torchrun);
  CHECK(info.rank == 1);
  CHECK(info.world_size == 3);
  CHECK(info.node_count == 1);
}
