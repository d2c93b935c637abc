#pragma once
/// \file
/// The offline verifier: from a schedule alone it checks the table (every computation once, every
/// send paired with its receive), simulates the ranks with given costs to prove that none waits
/// forever, and reports the makespan, the bubble and the activations each stage holds. "Forever"
/// includes the executor's transfers: they are simulated as NCCL runs them, each rank's batches in
/// posting order on one stream and every send waiting until its receiver posts the receive
/// (`verify_transfers`), so a table `verify` accepts cannot deadlock on NCCL or MPI.

#include <weft/core/error.hpp>
#include <weft/pipeline/detail/action_index.hpp>
#include <weft/pipeline/detail/exchange_plan.hpp>
#include <weft/pipeline/detail/transfer_plan.hpp>
#include <weft/pipeline/schedule.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace weft::pipeline {

/// Time units per action. Costs are per action, i.e. per model chunk: for an interleaved schedule
/// of the same model, a chunk holds 1/v of a stage's layers, so give 1/v of the stage's costs.
struct costs {
  std::int64_t forward = 1;
  std::int64_t backward = 2;  ///< the whole backward: input plus weight gradients
  std::int64_t weight = 1;    ///< the weight-gradient part of `backward`, run apart by split schedules
  std::int64_t comm = 0;      ///< added between an action and a dependent one on another rank
};

/// Every problem with `c`, each saying what to give instead; empty when valid.
inline std::vector<std::string> validate(const costs& c) {
  std::vector<std::string> problems;
  if (c.forward < 1) problems.push_back("forward cost " + std::to_string(c.forward) + " is invalid: give at least 1 time unit");
  if (c.backward < 1) problems.push_back("backward cost " + std::to_string(c.backward) + " is invalid: give at least 1 time unit");
  if (c.weight < 0 || (c.backward >= 1 && c.weight >= c.backward))
    problems.push_back("weight cost " + std::to_string(c.weight) + " is invalid: it is the weight-gradient part of the backward cost " +
                       std::to_string(c.backward) + ", so give 0.." + std::to_string(std::max<std::int64_t>(c.backward - 1, 0)));
  if (c.comm < 0) problems.push_back("communication cost " + std::to_string(c.comm) + " is invalid: give 0 or more time units");
  return problems;
}

/// The time an action of `s` takes under `c`.
inline std::int64_t cost_of(const schedule& s, const costs& c, action_kind kind) noexcept {
  switch (kind) {
    case action_kind::forward: return c.forward;
    case action_kind::backward: return s.split_backward ? c.backward - c.weight : c.backward;
    case action_kind::weight: return c.weight;
  }
  return 0;
}

/// When one action ran.
struct action_time {
  std::int64_t start = -1;  ///< -1: never ran (the schedule deadlocks before it)
  std::int64_t finish = -1;
};

/// What the verifier found.
struct verify_report {
  /// Problems of the table: computations missing, repeated or out of range; sends without their
  /// receive and receives without their send. Empty for every generated schedule.
  std::vector<std::string> problems;
  /// True when every rank ran its whole list.
  bool deadlock_free = false;
  /// When not: for each rank that could not finish, what its next action waits for.
  std::vector<std::string> waits;
  /// The time the last action finishes (of those that ran).
  std::int64_t makespan = 0;
  /// Idle time over stages x makespan.
  double bubble_fraction = 0;
  /// Busy time per rank.
  std::vector<std::int64_t> busy;
  /// Per rank, the most micro-batches (per chunk: (micro-batch, chunk) pairs) whose forward has run
  /// and whose activations are not yet freed (by the backward, or by the weight gradient when the
  /// backward is split).
  std::vector<int> peak_in_flight;
  /// Start and finish of every action, the same shape as `schedule::ranks`.
  std::vector<std::vector<action_time>> times;

  bool ok() const noexcept { return problems.empty() && deadlock_free; }
};

namespace detail {

inline void check_pairing(const schedule& s, std::vector<std::string>& problems) {
  constexpr std::size_t max_reported = 16;
  // A message: (kind, micro-batch, producing virtual stage, from, to) -> sends minus receives.
  std::map<std::tuple<int, int, int, int, int>, int> balance;
  for (int rank = 0; rank < s.stages; ++rank) {
    for (const action& a : s.ranks[static_cast<std::size_t>(rank)]) {
      const action expected = with_peers(s, rank, a);
      const std::string name = "rank " + std::to_string(rank) + "'s " + short_name(a, s.virtual_stages);
      if (problems.size() < max_reported && a.recv_from != expected.recv_from) {
        problems.push_back(name + (a.recv_from < 0 ? " receives nothing" : " receives from rank " + std::to_string(a.recv_from)) +
                           ", but its input " +
                           (expected.recv_from < 0 ? "is on the same rank" : "comes from rank " + std::to_string(expected.recv_from)));
      }
      if (problems.size() < max_reported && a.send_to != expected.send_to) {
        problems.push_back(name + (a.send_to < 0 ? " sends nothing" : " sends to rank " + std::to_string(a.send_to)) + ", but its output " +
                           (expected.send_to < 0 ? "stays on the same rank" : "is needed by rank " + std::to_string(expected.send_to)));
      }
      const int k = s.virtual_stage(rank, a.chunk);
      if (a.send_to >= 0) ++balance[{static_cast<int>(a.kind), a.micro_batch, k, rank, a.send_to}];
      if (a.recv_from >= 0 && a.kind != action_kind::weight) {
        const work_key in = received_input(s, rank, a);
        --balance[{static_cast<int>(in.kind), in.micro_batch, in.virtual_stage, a.recv_from, rank}];
      }
    }
  }
  for (const auto& [message, count] : balance) {
    if (count == 0 || problems.size() >= max_reported) continue;
    const auto& [kind, mb, k, from, to] = message;
    const std::string what = std::string(1, letter(static_cast<action_kind>(kind))) + std::to_string(mb) +
                             (s.virtual_stages > 1 ? "." + std::to_string(s.chunk_of(k)) : "");
    problems.push_back(count > 0 ? "rank " + std::to_string(from) + " sends the output of " + what + " to rank " + std::to_string(to) +
                                       ", which never receives it: a blocking send would wait forever"
                                 : "rank " + std::to_string(to) + " receives the output of " + what + " from rank " + std::to_string(from) +
                                       ", which never sends it: the receive would wait forever");
  }
}

}  // namespace detail

namespace detail {

/// The table checks and the simulation of the computations alone (`verify` without transfers).
inline verify_report simulate(const schedule& s, const costs& c) {
  verify_report report;
  const detail::action_index index(s);
  report.problems = index.problems();
  if (static_cast<int>(s.ranks.size()) != s.stages) return report;
  detail::check_pairing(s, report.problems);

  const auto p = static_cast<std::size_t>(s.stages);
  report.times.resize(p);
  report.busy.assign(p, 0);
  report.peak_in_flight.assign(p, 0);
  for (std::size_t r = 0; r < p; ++r) {
    report.times[r].resize(s.ranks[r].size());
    int in_flight = 0;
    for (const action& a : s.ranks[r]) {
      if (a.kind == action_kind::forward) ++in_flight;
      const bool frees = s.split_backward ? a.kind == action_kind::weight : a.kind == action_kind::backward;
      if (frees) --in_flight;
      report.peak_in_flight[r] = std::max(report.peak_in_flight[r], in_flight);
    }
  }

  std::vector<std::size_t> next(p, 0);
  std::vector<std::int64_t> free_at(p, 0);
  auto finish_of = [&](const detail::work_key& key) -> std::int64_t {
    const detail::slot& where = index.at(key);
    if (where.rank < 0) return -1;
    return report.times[static_cast<std::size_t>(where.rank)][static_cast<std::size_t>(where.position)].finish;
  };
  // A rank that stops at a missing input is revisited only when the action producing that input
  // runs, so the simulation is linear in the actions. (Sweeping every rank until none advances
  // took one sweep per stage for a backward pass: quadratic, 0.4 s for gpipe on 4096 stages.)
  // Each stopped rank waits for one action; the waiters of an action form a list through
  // `next_waiter`, headed by `first_waiter` at the action's place in the flattened table.
  std::vector<std::size_t> offset(p + 1, 0);
  for (std::size_t r = 0; r < p; ++r) offset[r + 1] = offset[r] + s.ranks[r].size();
  std::vector<int> first_waiter(offset[p], -1);
  std::vector<int> next_waiter(p, -1);
  std::vector<int> work(p);
  for (std::size_t r = 0; r < p; ++r) work[r] = static_cast<int>(p - 1 - r);  // rank 0 first
  while (!work.empty()) {
    const int rank = work.back();
    work.pop_back();
    const auto r = static_cast<std::size_t>(rank);
    while (next[r] < s.ranks[r].size()) {
      const action& a = s.ranks[r][next[r]];
      if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches || a.chunk < 0 || a.chunk >= s.virtual_stages) break;
      std::int64_t ready = free_at[r];
      bool runnable = true;
      for (const detail::work_key& in : detail::inputs_of(s, {a.kind, a.micro_batch, s.virtual_stage(rank, a.chunk)})) {
        const std::int64_t done = finish_of(in);
        if (done < 0) {
          runnable = false;
          const detail::slot& where = index.at(in);
          if (where.rank >= 0) {  // an input no rank runs never comes: the rank stays stuck
            const std::size_t at = offset[static_cast<std::size_t>(where.rank)] + static_cast<std::size_t>(where.position);
            next_waiter[r] = first_waiter[at];
            first_waiter[at] = rank;
          }
          break;
        }
        ready = std::max(ready, done + (s.rank_of(in.virtual_stage) != rank ? c.comm : 0));
      }
      if (!runnable) break;
      const std::int64_t cost = cost_of(s, c, a.kind);
      report.times[r][next[r]] = {ready, ready + cost};
      free_at[r] = ready + cost;
      report.busy[r] += cost;
      const std::size_t at = offset[r] + next[r];
      for (int waiter = first_waiter[at]; waiter >= 0; waiter = next_waiter[static_cast<std::size_t>(waiter)]) work.push_back(waiter);
      first_waiter[at] = -1;
      ++next[r];
    }
  }

  report.deadlock_free = true;
  for (std::size_t r = 0; r < p; ++r) {
    report.makespan = std::max(report.makespan, free_at[r]);
    if (next[r] == s.ranks[r].size()) continue;
    report.deadlock_free = false;
    const int rank = static_cast<int>(r);
    const action& a = s.ranks[r][next[r]];
    std::string wait = "rank " + std::to_string(rank) + " is stuck at its action " + std::to_string(next[r]) + " (" +
                       short_name(a, s.virtual_stages) + ")";
    if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches || a.chunk < 0 || a.chunk >= s.virtual_stages) {
      report.waits.push_back(wait + ", which is out of range");
      continue;
    }
    std::string needs;
    for (const detail::work_key& in : detail::inputs_of(s, {a.kind, a.micro_batch, s.virtual_stage(rank, a.chunk)})) {
      if (finish_of(in) >= 0) continue;
      const detail::slot& where = index.at(in);
      needs += needs.empty() ? ", waiting for " : " and ";
      needs += detail::key_name(s, in);
      if (where.rank < 0) {
        needs += ", which no rank runs";
      } else if (where.rank == rank) {
        needs += ", which comes later in its own list (action " + std::to_string(where.position) + ")";
      } else {
        needs += ", action " + std::to_string(where.position) + " of rank " + std::to_string(where.rank) + ", itself stuck at action " +
                 std::to_string(next[static_cast<std::size_t>(where.rank)]);
      }
    }
    report.waits.push_back(wait + needs);
  }
  std::int64_t busy = 0;
  for (std::int64_t b : report.busy) busy += b;
  if (report.makespan > 0) {
    report.bubble_fraction = 1.0 - static_cast<double>(busy) / (static_cast<double>(report.makespan) * static_cast<double>(s.stages));
  }
  return report;
}

}  // namespace detail

/// What `verify_transfers` found.
struct transfer_report {
  /// Transfers that pair with a transfer of another message (matching between two ranks is by
  /// posting order): empty for every table that passed `verify`'s table checks.
  std::vector<std::string> problems;
  bool deadlock_free = true;
  /// When not: for each stuck rank, the batch it is in and what that batch waits for.
  std::vector<std::string> waits;
};

namespace detail {

/// `verify_transfers` from the simulation of `s` under the default costs (`timeline`).
inline transfer_report check_transfers(const schedule& s, const verify_report& timeline, transfer_grouping grouping,
                                       int prefetch) {
  transfer_report report;
  if (!timeline.ok()) {
    report.problems = timeline.problems;
    report.deadlock_free = false;
    report.waits = timeline.waits;
    return report;
  }
  const auto p = static_cast<std::size_t>(s.stages);
  struct op_state {
    detail::transfer what;
    int step = 0;
    int partner_rank = -1, partner_batch = -1, partner_op = -1;
    bool done = false;
  };
  // Per rank, its batches in posting order (flattened over steps).
  std::vector<std::vector<std::vector<op_state>>> batches(p);
  for (int rank = 0; rank < s.stages; ++rank) {
    const detail::transfer_plan plan =
        detail::plan_transfers(s, rank, detail::plan_exchange(s, rank), timeline.times, prefetch, grouping);
    for (std::size_t step = 0; step < plan.steps.size(); ++step)
      for (const detail::transfer_batch& b : plan.steps[step]) {
        std::vector<op_state>& ops = batches[static_cast<std::size_t>(rank)].emplace_back();
        for (const detail::transfer& t : b.transfers) ops.push_back({t, static_cast<int>(step)});
      }
  }
  auto message_name = [&](const detail::inbound_message& m, int to) {
    return "the input of " + std::string(1, letter(m.consumer)) + std::to_string(m.micro_batch) +
           (s.virtual_stages > 1 ? "." + std::to_string(m.chunk) : "") + " on rank " + std::to_string(to);
  };
  auto step_name = [&](int rank, int step) {
    const std::vector<action>& list = s.ranks[static_cast<std::size_t>(rank)];
    if (static_cast<std::size_t>(step) >= list.size()) return std::string("after its last action");
    return "before its action " + std::to_string(step) + " (" + short_name(list[static_cast<std::size_t>(step)], s.virtual_stages) + ")";
  };

  // Pair the k-th send from a to b with the k-th receive on b from a.
  struct where {
    int rank, batch, op;
  };
  std::map<std::pair<int, int>, std::pair<std::vector<where>, std::vector<where>>> channels;  // (from, to)
  for (int rank = 0; rank < s.stages; ++rank) {
    const auto& mine = batches[static_cast<std::size_t>(rank)];
    for (std::size_t b = 0; b < mine.size(); ++b)
      for (std::size_t o = 0; o < mine[b].size(); ++o) {
        const detail::transfer& t = mine[b][o].what;
        const where w{rank, static_cast<int>(b), static_cast<int>(o)};
        if (t.send) channels[{rank, t.peer}].first.push_back(w);
        else channels[{t.peer, rank}].second.push_back(w);
      }
  }
  auto at = [&](const where& w) -> op_state& {
    return batches[static_cast<std::size_t>(w.rank)][static_cast<std::size_t>(w.batch)][static_cast<std::size_t>(w.op)];
  };
  for (auto& [ends, lists] : channels) {
    auto& [sends, receives] = lists;
    if (sends.size() != receives.size()) {
      report.problems.push_back("rank " + std::to_string(ends.first) + " sends " + std::to_string(sends.size()) +
                                " message(s) to rank " + std::to_string(ends.second) + ", which receives " +
                                std::to_string(receives.size()));
      continue;
    }
    for (std::size_t k = 0; k < sends.size(); ++k) {
      op_state& send = at(sends[k]);
      op_state& receive = at(receives[k]);
      const detail::inbound_message& a = send.what.message;
      const detail::inbound_message& b = receive.what.message;
      if (a.consumer != b.consumer || a.micro_batch != b.micro_batch || a.chunk != b.chunk)
        report.problems.push_back("rank " + std::to_string(ends.first) + "'s message " + std::to_string(k) + " to rank " +
                                  std::to_string(ends.second) + " is " + message_name(a, ends.second) +
                                  ", but is matched with the receive of " + message_name(b, ends.second));
      send.partner_rank = receives[k].rank, send.partner_batch = receives[k].batch, send.partner_op = receives[k].op;
      receive.partner_rank = sends[k].rank, receive.partner_batch = sends[k].batch, receive.partner_op = sends[k].op;
    }
  }
  if (!report.problems.empty()) {
    report.deadlock_free = false;
    return report;
  }

  // Each rank advances through its batches; a transfer completes when its partner's batch is the
  // partner rank's current one. A worklist revisits a rank whenever a partner may have freed it.
  std::vector<std::size_t> current(p, 0);
  std::deque<int> work;
  for (int rank = 0; rank < s.stages; ++rank) work.push_back(rank);
  while (!work.empty()) {
    const int rank = work.front();
    work.pop_front();
    const auto r = static_cast<std::size_t>(rank);
    while (current[r] < batches[r].size()) {
      bool all_done = true;
      for (op_state& op : batches[r][current[r]]) {
        if (op.done) continue;
        const auto partner = static_cast<std::size_t>(op.partner_rank);
        if (current[partner] == static_cast<std::size_t>(op.partner_batch)) {
          op.done = true;
          at({op.partner_rank, op.partner_batch, op.partner_op}).done = true;
          work.push_back(op.partner_rank);
        } else {
          all_done = false;
        }
      }
      if (!all_done) break;
      ++current[r];
      for (const op_state& op : batches[r][current[r] - 1]) work.push_back(op.partner_rank);
    }
  }

  for (std::size_t r = 0; r < p; ++r) {
    if (current[r] == batches[r].size()) continue;
    report.deadlock_free = false;
    const int rank = static_cast<int>(r);
    const std::vector<op_state>& batch = batches[r][current[r]];
    std::string wait = "rank " + std::to_string(rank) + " is stuck in its transfers " + step_name(rank, batch.front().step);
    for (const op_state& op : batch) {
      if (op.done) continue;
      const op_state& partner = at({op.partner_rank, op.partner_batch, op.partner_op});
      const std::vector<op_state>& theirs = batches[static_cast<std::size_t>(op.partner_rank)][current[static_cast<std::size_t>(op.partner_rank)]];
      wait += std::string(": its ") + (op.what.send ? "send of " : "receive of ") +
              message_name(op.what.message, op.what.send ? op.what.peer : rank) + " waits for rank " +
              std::to_string(op.partner_rank) + "'s " + (op.what.send ? "receive" : "send") + ", posted " +
              step_name(op.partner_rank, partner.step) + ", while rank " + std::to_string(op.partner_rank) +
              " is stuck in its transfers " + step_name(op.partner_rank, theirs.front().step);
      break;
    }
    report.waits.push_back(wait);
  }
  return report;
}

}  // namespace detail

/// Simulates the executor's transfers of `s` (detail::plan_transfers with `grouping` and
/// `prefetch`) as NCCL runs them: each rank posts its batches in order on one stream, a batch
/// ends when each of its transfers has met its partner, and a send meets its receive only while
/// both are in their rank's current batch (rendezvous: a send waits for its receiver, whatever
/// NCCL or MPI may buffer for small messages). The schedule's computations need nothing else: an
/// action's input arrives in the batch before it, and its output leaves in the batch after it.
/// A table whose computations cannot all run is reported as `verify` reports it.
inline transfer_report verify_transfers(const schedule& s,
                                        detail::transfer_grouping grouping = detail::transfer_grouping::timeline,
                                        int prefetch = 0) {
  return detail::check_transfers(s, detail::simulate(s, costs{}), grouping, prefetch);
}

/// Checks `s` and simulates it under `c`: each rank runs its list in order; an action starts when
/// the rank is free and its inputs are done (plus `c.comm` for an input from another rank). When
/// every computation can run, the executor's transfers are simulated too (`verify_transfers`):
/// `deadlock_free` then means deadlock-free on NCCL.
/// @throws weft::error when `c` is invalid.
inline verify_report verify(const schedule& s, const costs& c = {}) {
  if (std::vector<std::string> bad = validate(c); !bad.empty()) fail("invalid costs: " + bad.front());
  verify_report report = detail::simulate(s, c);
  if (report.deadlock_free && report.problems.empty() && s.stages > 1) {
    const costs plain{};  // the executor's plan comes from the simulation under the default costs
    const bool same = c.forward == plain.forward && c.backward == plain.backward && c.weight == plain.weight && c.comm == plain.comm;
    transfer_report transfers = same ? detail::check_transfers(s, report, detail::transfer_grouping::timeline, 0)
                                     : verify_transfers(s);
    for (std::string& problem : transfers.problems) report.problems.push_back(std::move(problem));
    report.deadlock_free = transfers.deadlock_free;
    report.waits = std::move(transfers.waits);
  }
  return report;
}

}  // namespace weft::pipeline
