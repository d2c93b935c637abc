#pragma once
/// \file
/// The order in which one rank of a schedule posts its sends and receives, and how it batches
/// them, derived from the table alone (pure; no communicator). The executor posts exactly this
/// plan, and the verifier simulates it with sends that wait for their receivers (what NCCL does
/// once a message is larger than its buffers), so a table the verifier accepts cannot deadlock on
/// the executor's transfers.
///
/// A rank's transfers are posted in steps: step i before action i, step n after the last action.
/// Each rank posts them in the order of the verifier's simulated times, and the transfers of one
/// time form one batch (one NCCL group, as Megatron-LM's `send_forward_recv_backward` pairs a send
/// with the receive facing it). So no two stages each send before they receive: in 1F1B on two
/// stages, a1 leaves stage 0 at time 2 and g0 leaves stage 1 at time 4, so stage 1 posts its
/// receive of a1 before its send of g0 (before B0, not before F1 as an unbatched order would).

#include <weft/pipeline/detail/exchange_plan.hpp>
#include <weft/pipeline/schedule.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace weft::pipeline::detail {

/// One send or receive of a step.
struct transfer {
  bool send = false;
  int peer = -1;
  /// Sends: the action (index in this rank's list) whose output is sent.
  int action = -1;
  /// The message, named by the action that consumes it (for sends, on the peer).
  inbound_message message{};
};

/// Transfers posted together as one batch (`communicator::batch()`, one NCCL group).
struct transfer_batch {
  std::vector<transfer> transfers;
};

/// How a rank's transfers are ordered and batched.
enum class transfer_grouping {
  /// Each transfer alone: the send of an action's output right after it, the receives of an
  /// action's input right before it, in the sender's order (the executor's order before batching;
  /// it deadlocks 1F1B once sends wait for their receivers).
  separate,
  /// Megatron-LM's pairing: before each action, the previous action's send and this action's
  /// receives, those with the same peer in one batch. Enough for 1F1B and ZB-H1, not for
  /// interleaved, where a stage's receives from one peer arrive in another order than it uses them.
  per_peer,
  /// What the executor posts: each transfer at the time the verifier's simulation (default costs)
  /// gives it, when its sender's action finishes; a rank's transfers of one time form one batch,
  /// posted before the first action that starts at or after it. Every rank then meets its
  /// partners in the simulation's global time order, so no batch waits on a later one: no
  /// deadlock whatever the speeds, for every table whose computations can run.
  timeline,
};

/// Per step (0..actions), the batches posted before that action, in posting order.
struct transfer_plan {
  std::vector<std::vector<transfer_batch>> steps;
};

/// The plan of `rank` in `s` (which passed `verify`'s table checks). `times[r][k]` has `start`
/// and `finish`: when action k of rank r runs in a simulation of `s` (used by `timeline`).
/// `prefetch`: the receives of the next `prefetch` steps are posted at each step too, in batches
/// of their own after the step's (for MPI, where a receive posted early holds back nothing).
template <class Times>
transfer_plan plan_transfers(const schedule& s, int rank, const exchange_plan& exchange, const Times& times,
                             int prefetch = 0, transfer_grouping grouping = transfer_grouping::timeline) {
  const std::vector<action>& list = s.ranks[static_cast<std::size_t>(rank)];
  const std::size_t n = list.size();
  transfer_plan plan;
  plan.steps.resize(n + 1);

  if (grouping == transfer_grouping::timeline) {
    struct timed {
      std::int64_t time;
      transfer what;
    };
    std::vector<timed> all;
    for (std::size_t k = 0; k < n; ++k)
      if (list[k].send_to >= 0)
        all.push_back({times[static_cast<std::size_t>(rank)][k].finish,
                       {true, list[k].send_to, static_cast<int>(k), outbound_of(s, rank, list[k])}});
    for (const inbound_channel& channel : exchange.from) {
      const int peer = channel.peer;
      const std::vector<inbound_message>& from = channel.messages;
      std::size_t next = 0;
      const std::vector<action>& theirs = s.ranks[static_cast<std::size_t>(peer)];
      for (std::size_t k = 0; k < theirs.size() && next < from.size(); ++k)
        if (peer != rank && theirs[k].send_to == rank)
          all.push_back({times[static_cast<std::size_t>(peer)][k].finish, {false, peer, -1, from[next++]}});
    }
    // By time; sends first; the receives of one channel keep the sender's order (its times rise).
    std::stable_sort(all.begin(), all.end(), [](const timed& a, const timed& b) {
      if (a.time != b.time) return a.time < b.time;
      return a.what.send && !b.what.send;
    });
    for (std::size_t t = 0; t < all.size();) {
      // Before the first action that starts at or after it (starts rise along the list).
      const auto& mine = times[static_cast<std::size_t>(rank)];
      std::size_t low = 0, high = n;
      while (low < high) {
        const std::size_t mid = (low + high) / 2;
        if (mine[mid].start < all[t].time) low = mid + 1;
        else high = mid;
      }
      const std::size_t step = low;
      transfer_batch& batch = plan.steps[step].emplace_back();
      const std::int64_t time = all[t].time;
      for (; t < all.size() && all[t].time == time; ++t) batch.transfers.push_back(all[t].what);
    }
  } else {
    std::vector<int> posted(static_cast<std::size_t>(s.stages), 0);
    for (std::size_t i = 0; i <= n; ++i) {
      std::vector<transfer> now;
      if (i > 0 && list[i - 1].send_to >= 0)
        now.push_back({true, list[i - 1].send_to, static_cast<int>(i - 1), outbound_of(s, rank, list[i - 1])});
      // The receives, in the sender's order, up to the message action i consumes.
      if (i < n && exchange.consumes[i].peer >= 0) {
        const inbound_slot& need = exchange.consumes[i];
        for (int& next = posted[static_cast<std::size_t>(need.peer)]; next <= need.position; ++next)
          now.push_back({false, need.peer, -1, exchange.messages_from(need.peer)[static_cast<std::size_t>(next)]});
      }
      for (const transfer& t : now) {
        transfer_batch* into = nullptr;
        if (grouping == transfer_grouping::per_peer)
          for (transfer_batch& b : plan.steps[i])
            if (b.transfers.front().peer == t.peer) into = &b;
        if (into == nullptr) into = &plan.steps[i].emplace_back();
        into->transfers.push_back(t);
      }
    }
  }

  // Receives posted ahead go in batches of their own, so waiting for this action's input never
  // waits for a later action's; taken in step order, so each channel keeps the sender's order.
  for (std::size_t i = 0; prefetch > 0 && i <= n; ++i) {
    for (std::size_t j = i + 1; j <= n && j <= i + static_cast<std::size_t>(prefetch); ++j) {
      std::vector<transfer_batch> kept;
      for (transfer_batch& b : plan.steps[j]) {
        transfer_batch sends, receives;
        for (const transfer& t : b.transfers) (t.send ? sends : receives).transfers.push_back(t);
        if (!receives.transfers.empty()) plan.steps[i].push_back(std::move(receives));
        if (!sends.transfers.empty()) kept.push_back(std::move(sends));
      }
      plan.steps[j] = std::move(kept);
    }
  }
  return plan;
}

}  // namespace weft::pipeline::detail
