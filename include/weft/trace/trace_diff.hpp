#pragma once
/// \file
/// What weft-trace-diff computes from the ranks' flight-recorder dumps, as a plain function:
/// which run the dumps belong to (dumps of another run, left in the same folder, are named and
/// left out), and for each group: which ranks left no dump, the first collective where the
/// ranks' calls differ (operation, dtype, count, reduction, root), the newest collective any rank
/// reached and the ranks that never arrived there, and the operation each rank was in.
///
/// Collectives are lined up by their place among the group's collectives, not by sequence
/// number: sequence numbers also count point-to-point operations, whose number legitimately
/// differs between ranks (pipeline stages). Each rank's own sequence numbers are reported too.
///
/// Operations recorded `untracked` (async operations of a backend that does not report
/// completion, NCCL today) are neither finished nor in flight to this comparison: their state is
/// unknown, and the report says so.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <weft/core/detail/json.hpp>
#include <weft/trace/flight_dump.hpp>
#include <weft/trace/operation.hpp>

namespace weft::trace {

/// One rank of a group, as its dump shows it.
struct rank_in_group {
  int rank = 0;                             ///< in the group
  int world_rank = -1;                      ///< the dump's rank
  std::uint64_t collectives = 0;            ///< collectives it issued
  std::optional<flight_record> in_flight;   ///< the oldest operation it had issued or started, not finished
  std::optional<flight_record> last;        ///< its newest operation
  std::optional<flight_record> unknown;     ///< its newest untracked operation (may still run)
  std::size_t untracked = 0;                ///< how many of its recorded operations are untracked
  std::int64_t dumped_at_ns = 0;
};

struct group_diff {
  std::string name;
  int size = 0;
  std::vector<int> members;  ///< world ranks, when known
  std::vector<rank_in_group> ranks;  ///< those with a dump, by rank in the group
  std::vector<int> missing;  ///< ranks of the group that left no dump
  /// The first collective (1-based place among the group's collectives) where the ranks' calls
  /// differ, and each rank's call there (rank in group, record).
  std::optional<std::uint64_t> first_divergent;
  std::vector<std::pair<int, flight_record>> divergent_calls;
  /// The newest collective any rank issued, and the ranks with a dump that never issued it.
  std::uint64_t newest_collective = 0;
  std::optional<flight_record> newest_call;
  std::vector<int> never_arrived;

  /// A rank left no dump, the calls differ, or a rank is behind: what weft-trace-diff exits 1 for.
  bool diverged() const noexcept { return !missing.empty() || first_divergent.has_value() || !never_arrived.empty(); }
  /// The calls differ or a rank is behind (more than a missing dump).
  bool calls_diverged() const noexcept { return first_divergent.has_value() || !never_arrived.empty(); }
  /// Some rank was inside an operation, or its last one is of unknown state, when it dumped.
  bool busy() const noexcept {
    return std::any_of(ranks.begin(), ranks.end(), [](const rank_in_group& r) {
      return r.in_flight || (r.last && r.last->state == op_state::untracked);
    });
  }
};

/// A dump of another run than the one compared.
struct other_run_dump {
  std::size_t index = 0;  ///< its place in the list given to diff_flight_dumps
  int rank = -1;
  std::string job;
  std::int64_t unix_time_ns = 0;
};

struct trace_diff {
  std::string job;                         ///< the run compared: the job of the newest dump
  bool job_known = true;                   ///< false when the compared dumps carry no job id
  std::size_t compared = 0;                ///< dumps of that run
  std::vector<other_run_dump> other_runs;  ///< dumps left out
  std::vector<group_diff> groups;          ///< in report order: calls diverged, busy, ranks missing only, idle
  std::vector<int> missing_world_ranks;    ///< world ranks missing from some group (of groups that list members)

  bool diverged() const noexcept {
    return std::any_of(groups.begin(), groups.end(), [](const group_diff& g) { return g.diverged(); });
  }
};

namespace detail {

inline bool same_call(const flight_record& a, const flight_record& b) noexcept {
  return a.op == b.op && a.type == b.type && a.count == b.count && a.reduction == b.reduction && a.peer == b.peer;
}

/// A rank's recorded collectives by their place among the group's collectives.
inline std::map<std::uint64_t, flight_record> collectives_by_place(const group_dump& g) {
  std::map<std::uint64_t, flight_record> placed;
  std::uint64_t place = g.collectives;
  for (auto r = g.entries.rbegin(); r != g.entries.rend() && place > 0; ++r)
    if (is_collective(r->op)) placed.emplace(place--, *r);
  return placed;
}

/// `later - earlier` in seconds, or nothing when the times are unset, out of order or overflow.
inline std::optional<double> seconds_between(std::int64_t earlier, std::int64_t later) noexcept {
  std::int64_t difference = 0;
  if (earlier <= 0 || later <= 0 || __builtin_sub_overflow(later, earlier, &difference) || difference < 0)
    return std::nullopt;
  return static_cast<double>(difference) / 1e9;
}

/// Report order: calls that differ or ranks behind, then a rank inside an operation, then groups
/// whose only finding is a missing dump (a stopped rank shows in every group it belongs to), then
/// the idle, consistent ones.
inline int group_order(const group_diff& g) noexcept {
  return g.calls_diverged() ? 0 : g.busy() ? 1 : !g.missing.empty() ? 2 : 3;
}

}  // namespace detail

/// Compares the dumps of the ranks of a job (one per rank; any subset). Dumps of another run
/// than the newest dump's (by job id) are left out and listed in `other_runs`.
inline trace_diff diff_flight_dumps(const std::vector<flight_dump>& dumps) {
  trace_diff result;
  const flight_dump* newest = nullptr;
  for (const flight_dump& d : dumps)
    if (newest == nullptr || d.unix_time_ns > newest->unix_time_ns) newest = &d;
  if (newest != nullptr) result.job = newest->job;
  result.job_known = !result.job.empty();
  std::vector<const flight_dump*> compared;
  for (std::size_t i = 0; i < dumps.size(); ++i) {
    if (dumps[i].job == result.job) compared.push_back(&dumps[i]);
    else result.other_runs.push_back({i, dumps[i].rank, dumps[i].job, dumps[i].unix_time_ns});
  }
  result.compared = compared.size();

  // A group is its name and members (or size, when members are unknown): the "dp" groups of
  // different tensor-parallel ranks share a name but not members.
  using key = std::tuple<std::string, int, std::vector<int>>;
  std::map<key, std::vector<std::pair<const flight_dump*, const group_dump*>>> groups;
  for (const flight_dump* d : compared)
    for (const group_dump& g : d->groups) groups[key{g.name, g.size, g.members}].push_back({d, &g});

  for (const auto& [id, seen] : groups) {
    group_diff diff;
    diff.name = std::get<0>(id);
    diff.size = std::get<1>(id);
    diff.members = std::get<2>(id);
    std::map<int, std::map<std::uint64_t, flight_record>> placed;
    for (const auto& [d, g] : seen) {
      if (placed.contains(g->rank)) continue;  // two dumps of one rank of one run: the first is kept
      rank_in_group r;
      r.rank = g->rank;
      r.world_rank = d->rank;
      r.collectives = g->collectives;
      r.dumped_at_ns = d->dumped_at_ns;
      for (const flight_record& e : g->entries) {
        if (e.state == op_state::untracked) {
          ++r.untracked;
          r.unknown = e;
        } else if (!r.in_flight && (e.state == op_state::issued || e.state == op_state::started)) {
          r.in_flight = e;
        }
      }
      if (!g->entries.empty()) r.last = g->entries.back();
      diff.ranks.push_back(r);
      placed[g->rank] = detail::collectives_by_place(*g);
    }
    std::sort(diff.ranks.begin(), diff.ranks.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
    // The parser bounds the size (by the listed members, or max_group_size_without_members).
    for (int r = 0; r < diff.size; ++r)
      if (!placed.contains(r)) diff.missing.push_back(r);

    // The first place where two ranks recorded different calls.
    std::map<std::uint64_t, std::vector<std::pair<int, flight_record>>> by_place;
    for (const auto& [rank, records] : placed)
      for (const auto& [place, record] : records) by_place[place].push_back({rank, record});
    for (const auto& [place, calls] : by_place) {
      bool differ = false;
      for (const auto& call : calls) differ = differ || !detail::same_call(call.second, calls.front().second);
      if (differ) {
        diff.first_divergent = place;
        diff.divergent_calls = calls;
        break;
      }
    }

    for (const rank_in_group& r : diff.ranks) diff.newest_collective = std::max(diff.newest_collective, r.collectives);
    for (const rank_in_group& r : diff.ranks) {
      if (r.collectives < diff.newest_collective) {
        diff.never_arrived.push_back(r.rank);
      } else if (!diff.newest_call) {
        auto found = placed[r.rank].find(diff.newest_collective);
        if (found != placed[r.rank].end()) diff.newest_call = found->second;
      }
    }
    if (!diff.members.empty())
      for (int r : diff.missing)
        if (static_cast<std::size_t>(r) < diff.members.size())
          result.missing_world_ranks.push_back(diff.members[static_cast<std::size_t>(r)]);
    result.groups.push_back(std::move(diff));
  }
  std::sort(result.missing_world_ranks.begin(), result.missing_world_ranks.end());
  result.missing_world_ranks.erase(std::unique(result.missing_world_ranks.begin(), result.missing_world_ranks.end()),
                                   result.missing_world_ranks.end());
  std::stable_sort(result.groups.begin(), result.groups.end(), [](const group_diff& a, const group_diff& b) {
    return detail::group_order(a) < detail::group_order(b);
  });
  return result;
}

namespace detail {

/// "0, 2, 5-9": runs of three or more consecutive ranks folded into a range.
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    text += (text.empty() ? "" : ", ") + std::to_string(ranks[i]);
    if (j >= i + 2) {
      text += "-" + std::to_string(ranks[j]);
      i = j + 1;
    } else {
      ++i;
    }
  }
  return text;
}

inline std::string call_text(const flight_record& r) {
  std::string text = std::string(to_string(r.op)) + " #" + std::to_string(r.sequence) + " (" + std::to_string(r.count) +
                     " x " + std::string(to_string(r.type));
  if (r.reduction >= 0) text += ", " + reduction_name(r.reduction);
  if (r.peer >= 0) text += (r.op == operation::send || r.op == operation::recv ? ", peer " : ", root ") + std::to_string(r.peer);
  return text + ")";
}

inline std::string time_text(std::int64_t unix_ns) {
  const std::time_t seconds = static_cast<std::time_t>(unix_ns / 1'000'000'000);
  std::tm utc{};
  char text[40] = "an unknown time";
  if (unix_ns > 0 && gmtime_r(&seconds, &utc) != nullptr) std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S UTC", &utc);
  return text;
}

inline std::string waited_text(const rank_in_group& r, const flight_record& op) {
  if (auto waited = seconds_between(op.issued_ns, r.dumped_at_ns)) {
    char seconds[48];
    std::snprintf(seconds, sizeof(seconds), "%.2f s", *waited);
    return seconds;
  }
  return "an unknown time (the dump's times are out of order)";
}

inline std::string rank_line(const rank_in_group& r) {
  std::string out = "  rank " + std::to_string(r.rank) + " (world rank " + std::to_string(r.world_rank) + "): ";
  if (r.in_flight) {
    out += "in " + call_text(*r.in_flight) + ", " + std::string(to_string(r.in_flight->state)) + ", for " +
           waited_text(r, *r.in_flight) + " when it dumped";
  } else if (r.last && r.last->state == op_state::untracked) {
    out += "unknown: its last operation, " + call_text(*r.last) +
           ", is untracked (the backend does not report when it finishes; it may still run)";
  } else if (r.last) {
    out += "idle; its last operation was " + call_text(*r.last) + ", " + std::string(to_string(r.last->state));
  } else {
    out += "no operation recorded";
  }
  if (r.untracked > 0 && !(r.last && r.last->state == op_state::untracked && !r.in_flight))
    out += "; " + std::to_string(r.untracked) + " untracked operation" + (r.untracked == 1 ? "" : "s") +
           " of unknown state, the newest " + call_text(*r.unknown);
  return out + "\n";
}

inline std::string group_title(const group_diff& g) {
  std::string out = "group '" + g.name + "' (" + std::to_string(g.size) + (g.size == 1 ? " rank" : " ranks");
  if (!g.members.empty()) out += "; world ranks " + rank_list(g.members);
  std::vector<std::string> facts;
  if (g.first_divergent) facts.push_back("CALLS DIFFER");
  if (!g.never_arrived.empty()) facts.push_back("ranks behind");
  if (!g.missing.empty()) facts.push_back("ranks without a dump");
  if (g.busy()) facts.push_back("a rank inside an operation");
  std::string joined;
  for (const std::string& f : facts) joined += (joined.empty() ? "" : ", ") + f;
  return out + "): " + joined;
}

/// "'tp' x3, 'dp'": names with their counts.
inline std::string names_counted(const std::vector<const group_diff*>& groups) {
  std::map<std::string, int> by_name;
  for (const group_diff* g : groups) ++by_name[g->name];
  std::string text;
  for (const auto& [name, count] : by_name)
    text += (text.empty() ? "'" : ", '") + name + "'" + (count > 1 ? " x" + std::to_string(count) : "");
  return text;
}

}  // namespace detail

/// The report weft-trace-diff prints: the run, the dumps left out, the world ranks without a dump,
/// then in full the groups whose calls differ or where ranks are behind, then those where a rank
/// was inside an operation; then one line for the groups whose only finding is a missing dump,
/// and one for the idle, consistent ones. `names`: the dumps' file names, in
/// the order given to diff_flight_dumps (optional, for naming left-out dumps).
inline std::string format_trace_diff(const trace_diff& diff, const std::vector<std::string>& names = {}) {
  using detail::call_text;
  using detail::rank_list;
  std::string out;
  out += diff.job_known ? "job " + diff.job + ": " + std::to_string(diff.compared) + " dumps compared\n"
                        : std::to_string(diff.compared) +
                              " dumps compared; they carry no job id, so dumps of an earlier run in the same folder "
                              "cannot be told apart (weft::trace::set_job_id, or launch with Slurm or Open MPI)\n";
  for (const other_run_dump& o : diff.other_runs) {
    const std::string what = o.index < names.size() ? names[o.index] : "the dump of world rank " + std::to_string(o.rank);
    out += "left out: " + what + " belongs to another run (job " + (o.job.empty() ? std::string("unknown") : o.job) +
           ", written " + detail::time_text(o.unix_time_ns) + ")\n";
  }
  if (!diff.missing_world_ranks.empty())
    out += "no dump from world ranks " + rank_list(diff.missing_world_ranks) +
           " (stopped, killed, or ended before they could write one)\n";
  std::vector<const group_diff*> idle, missing_only;
  for (const group_diff& g : diff.groups) {
    const int order = detail::group_order(g);
    if (order == 2) missing_only.push_back(&g);
    if (order == 3) idle.push_back(&g);
    if (order >= 2) continue;
    out += detail::group_title(g) + "\n";
    std::vector<int> present;
    for (const rank_in_group& r : g.ranks) present.push_back(r.rank);
    out += "  dumps from ranks: " + rank_list(present) + "\n";
    if (!g.missing.empty())
      out += "  missing ranks (no dump: killed, stopped, or ended before they could write one): " + rank_list(g.missing) +
             "\n";
    if (g.first_divergent) {
      out += "  first divergent call: collective " + std::to_string(*g.first_divergent) + " of the group, sequence number " +
             std::to_string(g.divergent_calls.front().second.sequence) + ":\n";
      for (const auto& [rank, call] : g.divergent_calls) out += "    rank " + std::to_string(rank) + ": " + call_text(call) + "\n";
    } else {
      out += "  first divergent call: none (the recorded collectives agree on every rank)\n";
    }
    if (g.newest_collective > 0) {
      out += "  newest collective: " + std::to_string(g.newest_collective) +
             (g.newest_call ? " (" + call_text(*g.newest_call) + ")" : std::string()) + "; ";
      out += g.never_arrived.empty() ? "every rank with a dump reached it\n"
                                     : "never arrived: ranks " + rank_list(g.never_arrived) + "\n";
    }
    for (const rank_in_group& r : g.ranks) out += detail::rank_line(r);
  }
  if (!missing_only.empty())
    out += std::to_string(missing_only.size()) + (missing_only.size() == 1 ? " group" : " groups") +
           " idle and consistent but for ranks without a dump: " + detail::names_counted(missing_only) + "\n";
  if (!idle.empty())
    out += std::to_string(idle.size()) + (idle.size() == 1 ? " group" : " groups") +
           " idle and consistent (every rank dumped, none inside an operation, calls agree): " +
           detail::names_counted(idle) + "\n";
  return out;
}

namespace detail {

inline std::string json_ranks(const std::vector<int>& ranks) {
  std::string out = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return out + "]";
}

inline std::string json_call(const flight_record& r) {
  return "{\"seq\": " + std::to_string(r.sequence) + ", \"op\": \"" + std::string(to_string(r.op)) + "\", \"dtype\": \"" +
         std::string(to_string(r.type)) + "\", \"count\": " + std::to_string(r.count) + ", \"peer\": " +
         std::to_string(r.peer) + ", \"reduction\": \"" + reduction_name(r.reduction) + "\", \"state\": \"" +
         std::string(to_string(r.state)) + "\"}";
}

}  // namespace detail

/// The same report as JSON (weft-trace-diff --json): {"format": "weft-trace-diff", "version": 1,
/// "job", "job_known", "compared", "diverged", "missing_world_ranks", "left_out": [{"file",
/// "rank", "job", "unix_time_ns"}], "groups": [{"name", "size", "members", "status" ("diverged":
/// calls differ or ranks behind, "busy", "missing": only dumps missing, or "idle"), "dumps_from", "missing", "first_divergent": null or {"collective", "calls": [{"rank",
/// "call"}]}, "newest_collective", "never_arrived", "ranks": [{"rank", "world_rank", "state"
/// ("in_flight", "unknown", "idle" or "none"), "operation": null or a call, "waited_s": null or
/// seconds, "untracked"}]}]}; a call is {"seq", "op", "dtype", "count", "peer", "reduction",
/// "state"}.
inline std::string trace_diff_json(const trace_diff& diff, const std::vector<std::string>& names = {}) {
  using weft::detail::json_string;
  using namespace detail;
  std::string out = "{\"format\": \"weft-trace-diff\", \"version\": 1, \"job\": " + json_string(diff.job) +
                    ", \"job_known\": " + (diff.job_known ? "true" : "false") +
                    ", \"compared\": " + std::to_string(diff.compared) +
                    ", \"diverged\": " + (diff.diverged() ? "true" : "false") +
                    ", \"missing_world_ranks\": " + json_ranks(diff.missing_world_ranks) + ",\n \"left_out\": [";
  for (std::size_t i = 0; i < diff.other_runs.size(); ++i) {
    const other_run_dump& o = diff.other_runs[i];
    out += std::string(i == 0 ? "" : ", ") + "{\"file\": " + json_string(o.index < names.size() ? names[o.index] : "") +
           ", \"rank\": " + std::to_string(o.rank) + ", \"job\": " + json_string(o.job) +
           ", \"unix_time_ns\": " + std::to_string(o.unix_time_ns) + "}";
  }
  out += "],\n \"groups\": [";
  for (std::size_t gi = 0; gi < diff.groups.size(); ++gi) {
    const group_diff& g = diff.groups[gi];
    std::vector<int> present;
    for (const rank_in_group& r : g.ranks) present.push_back(r.rank);
    out += std::string(gi == 0 ? "\n  {" : ",\n  {") + "\"name\": " + json_string(g.name) +
           ", \"size\": " + std::to_string(g.size) + ", \"members\": " + json_ranks(g.members) + ", \"status\": \"" +
           (g.calls_diverged() ? "diverged" : g.busy() ? "busy" : !g.missing.empty() ? "missing" : "idle") +
           "\", \"dumps_from\": " + json_ranks(present) +
           ", \"missing\": " + json_ranks(g.missing) + ", \"first_divergent\": ";
    if (g.first_divergent) {
      out += "{\"collective\": " + std::to_string(*g.first_divergent) + ", \"calls\": [";
      for (std::size_t c = 0; c < g.divergent_calls.size(); ++c)
        out += std::string(c == 0 ? "" : ", ") + "{\"rank\": " + std::to_string(g.divergent_calls[c].first) +
               ", \"call\": " + json_call(g.divergent_calls[c].second) + "}";
      out += "]}";
    } else {
      out += "null";
    }
    out += ", \"newest_collective\": " + std::to_string(g.newest_collective) +
           ", \"never_arrived\": " + json_ranks(g.never_arrived) + ",\n   \"ranks\": [";
    for (std::size_t ri = 0; ri < g.ranks.size(); ++ri) {
      const rank_in_group& r = g.ranks[ri];
      const bool unknown = !r.in_flight && r.last && r.last->state == op_state::untracked;
      const std::optional<flight_record>& op = r.in_flight ? r.in_flight : r.last;
      std::optional<double> waited;
      if (r.in_flight) waited = seconds_between(r.in_flight->issued_ns, r.dumped_at_ns);
      char seconds[48] = "null";
      if (waited) std::snprintf(seconds, sizeof(seconds), "%.3f", *waited);
      out += std::string(ri == 0 ? "" : ", ") + "{\"rank\": " + std::to_string(r.rank) +
             ", \"world_rank\": " + std::to_string(r.world_rank) + ", \"state\": \"" +
             (r.in_flight ? "in_flight" : unknown ? "unknown" : r.last ? "idle" : "none") +
             "\", \"operation\": " + (op ? json_call(*op) : std::string("null")) + ", \"waited_s\": " + seconds +
             ", \"untracked\": " + std::to_string(r.untracked) + "}";
    }
    out += "]}";
  }
  out += diff.groups.empty() ? "]}\n" : "\n ]}\n";
  return out;
}

}  // namespace weft::trace
