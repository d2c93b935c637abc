#pragma once
/// \file
/// The messages one rank of a schedule exchanges, derived from the table alone (pure; no
/// communicator): for each peer, the order in which that peer sends to this rank, and for each of
/// this rank's actions, which message it consumes. The executor posts receives in the sender's
/// order, so that point-to-point matching, which pairs messages between two ranks in the order
/// they were posted (MPI without tags, NCCL), can never give an action another action's tensor,
/// even where two ranks exchange activations and gradients in both directions (interleaved on two
/// stages).

#include <weft/pipeline/schedule.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace weft::pipeline::detail {

/// One message into this rank, named by the action of this rank that consumes it.
struct inbound_message {
  action_kind consumer = action_kind::forward;  ///< forward (activation) or backward (gradient)
  int micro_batch = 0;
  int chunk = 0;  ///< the consuming chunk on this rank
  int peer = -1;  ///< the sending rank
};

/// Where a consumed message sits in its sender's order.
struct inbound_slot {
  int peer = -1;
  int position = -1;  ///< index in the peer's `inbound_channel::messages`
};

/// The messages one peer sends to this rank, in its action order.
struct inbound_channel {
  int peer = -1;
  std::vector<inbound_message> messages;
};

/// What one rank receives, in the order each peer sends it.
struct exchange_plan {
  int rank = 0;
  /// The peers that send to this rank, ascending: at most its two neighbours in the chunk order
  /// (a list per peer of the whole group would make the plans of all ranks quadratic in stages).
  std::vector<inbound_channel> from;
  /// Per action of this rank, the message it consumes ({-1, -1}: none).
  std::vector<inbound_slot> consumes;
  /// Messages this rank sends in one step, and receives.
  std::size_t sends = 0, receives = 0;

  /// The messages `peer` sends to this rank, in its action order; empty for a peer that sends none.
  const std::vector<inbound_message>& messages_from(int peer) const {
    static const std::vector<inbound_message> none;
    for (const inbound_channel& c : from)
      if (c.peer == peer) return c.messages;
    return none;
  }
};

/// The message `a`, run on `sender`, sends: named by the action that consumes it.
inline inbound_message outbound_of(const schedule& s, int sender, const action& a) {
  const int k = s.virtual_stage(sender, a.chunk);
  if (a.kind == action_kind::forward) return {action_kind::forward, a.micro_batch, s.chunk_of(k + 1), sender};
  return {action_kind::backward, a.micro_batch, s.chunk_of(k - 1), sender};
}

/// The plan of `rank` in `s`. Assumes the table passed `verify` (every send has its receive).
/// Linear in the actions of the rank and its two neighbours.
inline exchange_plan plan_exchange(const schedule& s, int rank) {
  exchange_plan plan;
  plan.rank = rank;
  // Only the neighbours in the chunk order send to a rank (rules the table passed), so the plans
  // of all ranks cost a pass over the table, not one per rank.
  const int previous = (rank + s.stages - 1) % s.stages, next = (rank + 1) % s.stages;
  for (const int peer : {std::min(previous, next), std::max(previous, next)}) {
    if (peer == rank || (!plan.from.empty() && plan.from.back().peer == peer)) continue;
    inbound_channel channel{peer, {}};
    for (const action& a : s.ranks[static_cast<std::size_t>(peer)]) {
      if (a.send_to == rank) channel.messages.push_back(outbound_of(s, peer, a));
    }
    if (!channel.messages.empty()) plan.from.push_back(std::move(channel));
  }
  // Each message by its consumer (kind, micro-batch, chunk), per peer: a search of the peer's
  // list per action would be quadratic in micro-batches (47 s for 1F1B on 16 x 65536).
  auto key = [](action_kind kind, int micro_batch, int chunk) {
    return (std::uint64_t{static_cast<std::uint32_t>(micro_batch)} << 32) | (std::uint64_t{static_cast<std::uint32_t>(chunk)} << 1) |
           (kind == action_kind::backward ? 1u : 0u);
  };
  std::vector<std::unordered_map<std::uint64_t, int>> position(plan.from.size());
  for (std::size_t c = 0; c < plan.from.size(); ++c) {
    const std::vector<inbound_message>& list = plan.from[c].messages;
    position[c].reserve(list.size());
    for (std::size_t j = 0; j < list.size(); ++j)
      position[c].try_emplace(key(list[j].consumer, list[j].micro_batch, list[j].chunk), static_cast<int>(j));
  }
  const std::vector<action>& mine = s.ranks[static_cast<std::size_t>(rank)];
  plan.consumes.assign(mine.size(), {});
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const action& a = mine[i];
    if (a.send_to >= 0) ++plan.sends;
    if (a.recv_from < 0 || a.kind == action_kind::weight) continue;
    for (std::size_t c = 0; c < plan.from.size(); ++c) {
      if (plan.from[c].peer != a.recv_from) continue;
      if (const auto found = position[c].find(key(a.kind, a.micro_batch, a.chunk)); found != position[c].end()) {
        plan.consumes[i] = {a.recv_from, found->second};
        ++plan.receives;
      }
    }
  }
  return plan;
}

/// A fingerprint of the whole table (FNV-1a over every field), for checking that all ranks of the
/// group walk the same schedule.
inline std::uint64_t fingerprint(const schedule& s) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](long long value) {
    for (int byte = 0; byte < 8; ++byte) {
      h ^= static_cast<std::uint64_t>(value >> (8 * byte)) & 0xffu;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<long long>(s.kind));
  mix(s.stages);
  mix(s.micro_batches);
  mix(s.virtual_stages);
  mix(s.split_backward ? 1 : 0);
  mix(static_cast<long long>(s.ranks.size()));
  for (const std::vector<action>& list : s.ranks) {
    mix(static_cast<long long>(list.size()));
    for (const action& a : list) {
      mix(static_cast<long long>(a.kind));
      mix(a.micro_batch);
      mix(a.chunk);
      mix(a.recv_from);
      mix(a.send_to);
    }
  }
  return h;
}

}  // namespace weft::pipeline::detail
