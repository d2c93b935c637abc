// From a tuner plan to process groups in one step: the plan's layout is the one process_groups
// takes, and the communicators it makes connect the ranks that the default order puts together
// (computed here independently from the degrees).
#include <catch2/catch.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/layout/process_groups.hpp>
#include <weft/tune/search.hpp>

#include <vector>

using mpi_comm = weft::communicator<weft::mpi_backend>;

namespace {

mpi_comm world() { return mpi_comm(weft::mpi_backend::comm::world(), "world"); }

// A 16-layer GPT on nodes of 2 A100s, as many nodes as ranks / 2.
const weft::tune::model_desc small_gpt{.layers = 16, .hidden = 1024, .heads = 16, .vocab = 32000, .seq = 1024};

weft::tune::cluster_desc cluster_for(int ranks) {
  weft::tune::cluster_desc c = weft::tune::dgx_cluster(*weft::tune::gpu_preset("A100-80GB"), ranks / 2);
  c.node.gpus_per_node = 2;
  return c;
}

std::vector<int> gather_ranks(mpi_comm& group, int my_world_rank) {
  std::vector<int> mine{my_world_rank};
  std::vector<int> all(static_cast<std::size_t>(group.size()));
  group.all_gather(mine, all);
  return all;
}

}  // namespace

TEST_CASE("a plan becomes process groups in one call") {
  auto comm = world();
  REQUIRE(comm.size() % 2 == 0);
  weft::tune::search_options options;
  options.fixed.pp = 2;  // a pipeline with interleaving, so that every dimension shows
  options.fixed.vp = 2;
  const weft::tune::plan plan = weft::tune::best(small_gpt, cluster_for(comm.size()), {.global_batch = 64}, options);
  weft::process_groups<weft::mpi_backend> groups(comm, plan.layout());

  const auto& d = plan.config.parallel;
  REQUIRE(d.tp * d.cp * d.pp * d.dp == comm.size());
  CHECK(groups.layout().virtual_stages() == 2);
  CHECK(groups.tp().size() == d.tp);
  CHECK(groups.pp().size() == 2);
  CHECK(groups.dp().size() == d.dp);
  // Order tp-cp-dp-pp: tp ranks are adjacent, pipeline stages are tp x cp x dp apart.
  const int r = comm.rank();
  std::vector<int> tp_expected, pp_expected;
  for (int i = 0; i < d.tp; ++i) tp_expected.push_back(r / d.tp * d.tp + i);
  const int stage_stride = d.tp * d.cp * d.dp;
  for (int s = 0; s < d.pp; ++s) pp_expected.push_back(r % stage_stride + s * stage_stride);
  CHECK(gather_ranks(groups.tp(), r) == tp_expected);
  CHECK(gather_ranks(groups.pp(), r) == pp_expected);
}

TEST_CASE("ranks whose plans differ in virtual stages fail together instead of hanging") {
  auto comm = world();
  weft::tune::search_options options;
  options.fixed.pp = 2;
  options.fixed.vp = comm.rank() == 0 ? 2 : 1;
  const weft::tune::plan plan = weft::tune::best(small_gpt, cluster_for(comm.size()), {.global_batch = 64}, options);
  CHECK_THROWS_WITH((weft::process_groups<weft::mpi_backend>(comm, plan.layout())),
                    Catch::Matchers::Contains("ranks disagree about the parallel layout"));
  std::vector<int> one{1};
  comm.all_reduce(one);
  CHECK(one[0] == comm.size());
}
