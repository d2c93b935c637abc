// Hybrid sharding (HSDP): the dp group split by node placement into shard groups (a node's ranks)
// and replicate groups (one rank per node); parameters are sharded inside a node, gradients
// reduce-scattered inside it and all-reduced across nodes. Training matches unsharded data parallel over
// the whole dp group, with and without accumulation (an absolute 1e-12 per element in double).
#include <catch2/catch.hpp>

#include <weft/fsdp/hybrid_groups.hpp>
#include <weft/layout/node_placement.hpp>

#include "training.hpp"

using namespace fsdp_test;
using weft::tune::sharding;

TEST_CASE("the dp group splits into per-node shard groups and cross-node replicate groups", "[fsdp][hybrid]") {
  auto dp = dp_world();
  const int per_node = dp.size() >= 4 ? 2 : 1;
  auto groups = weft::fsdp::split_by_node(dp, weft::layout::node_of(dp.rank(), per_node));
  REQUIRE(groups.shard.size() == per_node);
  REQUIRE(groups.replicate.size() == dp.size() / per_node);
  REQUIRE(groups.shard.name() == "dp-shard");
  REQUIRE(groups.replicate.name() == "dp-replicate");
  // The shard group is this rank's node; the replicate group its position on every node.
  std::vector<int> node_ranks(static_cast<std::size_t>(groups.shard.size()));
  const int me = dp.rank();
  groups.shard.all_gather(std::span<const int>(&me, 1), node_ranks);
  for (int i = 0; i < groups.shard.size(); ++i) REQUIRE(node_ranks[static_cast<std::size_t>(i)] == (me / per_node) * per_node + i);
  std::vector<int> peers(static_cast<std::size_t>(groups.replicate.size()));
  groups.replicate.all_gather(std::span<const int>(&me, 1), peers);
  for (int i = 0; i < groups.replicate.size(); ++i) REQUIRE(peers[static_cast<std::size_t>(i)] == i * per_node + me % per_node);
}

TEST_CASE("nodes given by index, as srun -m cyclic places ranks", "[fsdp][hybrid]") {
  // Ranks dealt to nodes in turn (rank r on node r % nodes): the shard groups are still each
  // node's ranks, not blocks of consecutive ranks.
  auto dp = dp_world();
  if (dp.size() < 4 || dp.size() % 2 != 0) return;
  const int nodes = 2;
  const int me = dp.rank();
  auto groups = weft::fsdp::split_by_node(dp, me % nodes);
  REQUIRE(groups.shard.size() == dp.size() / nodes);
  REQUIRE(groups.replicate.size() == nodes);
  std::vector<int> node_ranks(static_cast<std::size_t>(groups.shard.size()));
  groups.shard.all_gather(std::span<const int>(&me, 1), node_ranks);
  for (int i = 0; i < groups.shard.size(); ++i) REQUIRE(node_ranks[static_cast<std::size_t>(i)] == me % nodes + i * nodes);
  std::vector<int> peers(static_cast<std::size_t>(nodes));
  groups.replicate.all_gather(std::span<const int>(&me, 1), peers);
  for (int i = 0; i < nodes; ++i) REQUIRE(peers[static_cast<std::size_t>(i)] == (me / nodes) * nodes + i);
}

TEST_CASE("unequal nodes are refused on every rank", "[fsdp][hybrid][errors]") {
  auto dp = dp_world();
  REQUIRE_THROWS_WITH(weft::fsdp::split_by_node(dp, -1), Catch::Contains("this rank's node is -1 (unknown)"));
  if (dp.size() < 3) return;  // nodes of dp - 1 ranks and of 1 rank need 3 ranks
  REQUIRE_THROWS_WITH(weft::fsdp::split_by_node(dp, weft::layout::node_of(dp.rank(), dp.size() - 1)),
                      Catch::Contains("ranks disagree about the number of dp ranks on each node"));
}

TEST_CASE("HSDP matches unsharded data parallel", "[fsdp][hybrid]") {
  auto dp = dp_world();
  const int steps = 3;
  for (int per_node : {1, 2}) {
    if (dp.size() % per_node != 0) continue;
    auto groups = weft::fsdp::split_by_node(dp, weft::layout::node_of(dp.rank(), per_node));
    for (int k : {1, 2}) {
      for (sharding level : {sharding::full, sharding::gradients}) {
        DYNAMIC_SECTION(per_node << " ranks per node, accumulation " << k << ", " << weft::tune::to_string(level)) {
          const auto reference = train_ddp(dp, steps, k);
          model_t<double> model(groups.shard, groups.replicate,
                                {.level = level, .accumulation_steps = k, .reduce_dtype = weft::dtype::float64});
          REQUIRE(model.hybrid());
          REQUIRE(model.data_parallel_size() == dp.size());
          const auto sharded = train_sharded(model, steps, k, dp.rank(), dp.size());
          require_within(sharded, reference, 1e-12);
        }
      }
    }
  }
}
