#pragma once
/// \file
/// The two groups of hybrid sharding (HSDP), made from the data-parallel group by node placement:
/// the dp ranks on one node form a shard group (parameters, gradients and optimizer state are
/// sharded over it, and its all-gathers and reduce-scatters stay on the node's fast links), and
/// the dp ranks with the same position on every node form a replicate group (one all-reduce of
/// each gradient shard crosses nodes).

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/error.hpp>

namespace weft::fsdp {

template <backend B>
struct hybrid_groups {
  communicator<B> shard;      ///< this node's dp ranks ("<dp>-shard")
  communicator<B> replicate;  ///< the dp ranks at this rank's position on every node ("<dp>-replicate")
};

/// Splits `dp` (collective) by `node`, the index of the node that holds this rank: the launcher's
/// node as weft::resolve_launch_with_mpi checks it against MPI (right under any rank placement,
/// srun's `-m cyclic` too), or layout::node_of(world_rank, ranks_per_node) for nodes simulated on
/// one host. Every node must hold the same number of dp ranks (shards must be equal); otherwise
/// every rank throws an error that says how they differ.
template <backend B>
hybrid_groups<B> split_by_node(communicator<B>& dp, int node) {
  if (node < 0)
    fail("fsdp hybrid groups on '" + dp.name() + "': this rank's node is " + std::to_string(node) +
         " (unknown); give the node index weft::resolve_launch_with_mpi() finds");
  std::optional<communicator<B>> shard = dp.split(node, dp.rank(), dp.name() + "-shard");
  if (!shard) fail("fsdp hybrid groups on '" + dp.name() + "': this rank got no shard group");
  dp.expect_same_on_all_ranks("the number of dp ranks on each node (hybrid sharding needs equal shard groups; "
                              "choose a dp that is a multiple of the ranks per node, or a dp inside one node)",
                              static_cast<std::uint64_t>(shard->size()));
  std::optional<communicator<B>> replicate = dp.split(shard->rank(), node, dp.name() + "-replicate");
  if (!replicate) fail("fsdp hybrid groups on '" + dp.name() + "': this rank got no replicate group");
  return {std::move(*shard), std::move(*replicate)};
}

}  // namespace weft::fsdp
