#pragma once
/// \file
/// `cross_check_with_mpi`: compares what the launcher variables say with what MPI itself knows
/// (rank, size, and which ranks share a node), so variables left over from another launch (a job
/// script's own SLURM_PROCID, a RANK exported by hand) are caught before they misplace a GPU or
/// hang a rendezvous. Collective over the communicator; every rank throws if any rank disagrees.
/// Each of its MPI calls is held to WEFT_COMM_TIMEOUT's deadline (detail/watched_call.hpp): a rank
/// that never joins ends the job with the timeout message and exit 124, as a late collective does.

#include <weft/config.hpp>

#if WEFT_HAS_MPI

#include <mpi.h>

#include <exception>
#include <string>
#include <vector>

#include <weft/backend/mpi/check.hpp>
#include <weft/backend/mpi/detail/watched_call.hpp>
#include <weft/core/timeout.hpp>
#include <weft/core/error.hpp>
#include <weft/launch/resolve.hpp>

namespace weft {

namespace detail::launch {

/// Runs one collective MPI call of the launch check over `comm`, recorded on group 'launch' and
/// held to WEFT_COMM_TIMEOUT's deadline.
template <class Call>
int launch_call(MPI_Comm comm, trace::operation op, dtype type, std::uint64_t count, Call&& call) {
  int code = MPI_SUCCESS;
  detail::mpi::watched_call(comm, "launch", op, type, count, comm_timeout_from_environment(), [&] { code = call(); });
  return code;
}

/// MPI's own layout: rank and size in `world`, local rank and size among the ranks sharing this
/// node, node index (nodes ordered by their lowest rank) and node count. Collective.
inline launch_info mpi_layout(MPI_Comm world) {
  launch_info info;
  info.source = launcher::mpi;
  WEFT_CHECK_MPI(MPI_Comm_rank(world, &info.rank));
  WEFT_CHECK_MPI(MPI_Comm_size(world, &info.world_size));
  MPI_Comm node_comm = MPI_COMM_NULL;
  WEFT_CHECK_MPI(launch_call(world, trace::operation::split, dtype::uint8, 0, [&] {
    return MPI_Comm_split_type(world, MPI_COMM_TYPE_SHARED, info.rank, MPI_INFO_NULL, &node_comm);
  }));
  int leader = info.rank;  // lowest rank on this node names the node
  int ok = MPI_Comm_rank(node_comm, &info.local_rank);
  if (ok == MPI_SUCCESS) ok = MPI_Comm_size(node_comm, &info.local_world_size);
  if (ok == MPI_SUCCESS)
    ok = launch_call(node_comm, trace::operation::all_reduce, dtype::int32, 1,
                     [&] { return MPI_Allreduce(&info.rank, &leader, 1, MPI_INT, MPI_MIN, node_comm); });
  MPI_Comm_free(&node_comm);
  WEFT_CHECK_MPI(ok);
  std::vector<int> leaders(static_cast<std::size_t>(info.world_size));
  WEFT_CHECK_MPI(launch_call(world, trace::operation::all_gather, dtype::int32, 1,
                             [&] { return MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, world); }));
  info.node = 0;
  info.node_count = 0;
  for (int r = 0; r < info.world_size; ++r) {
    if (leaders[static_cast<std::size_t>(r)] != r) continue;  // r leads its node
    ++info.node_count;
    if (r < leader) ++info.node;
  }
  return info;
}

}  // namespace detail::launch

/// Checks `info` against MPI's view over `world` (collective). A layout from no launcher
/// (`launcher::none`) is replaced by MPI's, as are node numbers the resolver had to derive;
/// launcher node numbers are checked as a grouping (same node number ⇔ same shared-memory node).
/// Throws weft::error on every rank if any rank disagrees, naming the variables involved.
inline void cross_check_with_mpi(launch_info& info, MPI_Comm world = MPI_COMM_WORLD) {
  const launch_info mpi = detail::launch::mpi_layout(world);

  // Grouping check: ranks on one MPI node must share a launcher node number, and no rank of
  // another MPI node may have it. Gather every rank's (launcher node, MPI node).
  const bool check_nodes = info.source != launcher::none && !info.node_derived && info.node >= 0;
  int mine[2] = {check_nodes ? info.node : -1, mpi.node};
  std::vector<int> all(2 * static_cast<std::size_t>(mpi.world_size));
  WEFT_CHECK_MPI(detail::launch::launch_call(world, trace::operation::all_gather, dtype::int32, 2, [&] {
    return MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, world);
  }));

  std::string problem;
  if (info.source != launcher::none) {
    if (info.rank != mpi.rank || info.world_size != mpi.world_size)
      problem = "the launcher variables say rank " + std::to_string(info.rank) + " of " +
                std::to_string(info.world_size) + " but MPI says rank " + std::to_string(mpi.rank) + " of " +
                std::to_string(mpi.world_size);
    else if (info.local_rank != mpi.local_rank || info.local_world_size != mpi.local_world_size)
      problem = "the launcher variables say local rank " + std::to_string(info.local_rank) + " of " +
                std::to_string(info.local_world_size) + " but MPI finds local rank " +
                std::to_string(mpi.local_rank) + " of " + std::to_string(mpi.local_world_size) +
                " processes sharing this node";
    else if (check_nodes) {
      for (int r = 0; r < mpi.world_size && problem.empty(); ++r) {
        const int their_node = all[2 * static_cast<std::size_t>(r)];
        const int their_mpi_node = all[2 * static_cast<std::size_t>(r) + 1];
        if (their_node < 0) continue;
        if ((their_mpi_node == mpi.node) != (their_node == info.node))
          problem = "the launcher variables put this rank on node " + std::to_string(info.node) + " and rank " +
                    std::to_string(r) + " on node " + std::to_string(their_node) + ", but MPI finds them on " +
                    (their_mpi_node == mpi.node ? "the same node" : "different nodes");
      }
    }
  }

  int failed = problem.empty() ? 0 : 1;
  int any_failed = 0;
  WEFT_CHECK_MPI(detail::launch::launch_call(world, trace::operation::all_reduce, dtype::int32, 1, [&] {
    return MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, world);
  }));
  if (any_failed) {
    if (!failed)
      fail("launch: another rank's launcher variables disagree with MPI (see that rank's error); this rank: " +
           info.describe());
    fail("launch: " + problem + " (" + info.describe() +
         "); the variables belong to another launch or were set by hand: fix or unset them, or set "
         "WEFT_LAUNCHER to choose the right launcher");
  }

  if (info.source == launcher::none) {
    info = mpi;
  } else if (info.node_derived || info.node < 0) {
    info.node = mpi.node;
    info.node_count = mpi.node_count;
    info.node_derived = false;
  }
}

/// The launcher's layout checked against MPI's over `world` (collective); sets the world rank
/// used in weft's error messages.
inline launch_info resolve_launch_with_mpi(MPI_Comm world = MPI_COMM_WORLD) {
  // A rank whose variables are broken still takes part in the agreement, so the others fail too
  // instead of waiting for it in the cross-check.
  launch_info info;
  std::exception_ptr failure;
  try {
    info = resolve_launch();
  } catch (...) {
    failure = std::current_exception();
  }
  int failed = failure ? 1 : 0;
  int any_failed = 0;
  WEFT_CHECK_MPI(detail::launch::launch_call(world, trace::operation::all_reduce, dtype::int32, 1, [&] {
    return MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, world);
  }));
  if (failure) std::rethrow_exception(failure);
  if (any_failed) fail("launch: another rank could not read its launcher variables (see that rank's error)");
  cross_check_with_mpi(info, world);
  detail::known_world_rank().store(info.rank, std::memory_order_relaxed);
  return info;
}

}  // namespace weft

#endif  // WEFT_HAS_MPI
