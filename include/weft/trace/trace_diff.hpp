#pragma once
/// \file
/// What weft-trace-diff computes from the ranks' flight-recorder dumps, as a plain function:
/// for each group, which ranks left no dump, the first collective where the ranks' calls differ
/// (operation, dtype, count, reduction, root), the newest collective any rank reached and the
/// ranks that never arrived there, and the operation each rank was in.
///
/// Collectives are lined up by their place among the group's collectives, not by sequence
/// number: sequence numbers also count point-to-point operations, whose number legitimately
/// differs between ranks (pipeline stages). Each rank's own sequence numbers are reported too.

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <weft/trace/flight_dump.hpp>
#include <weft/trace/operation.hpp>

namespace weft::trace {

/// One rank of a group, as its dump shows it.
struct rank_in_group {
  int rank = 0;                             ///< in the group
  int world_rank = -1;                      ///< the dump's rank
  std::uint64_t collectives = 0;            ///< collectives it issued
  std::optional<flight_record> in_flight;   ///< the oldest operation it had not finished
  std::optional<flight_record> last;        ///< its newest operation
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
};

struct trace_diff {
  std::vector<group_diff> groups;
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

}  // namespace detail

/// Compares the dumps of the ranks of a job (one per rank; any subset).
inline trace_diff diff_flight_dumps(const std::vector<flight_dump>& dumps) {
  // A group is its name and members (or size, when members are unknown): the "dp" groups of
  // different tensor-parallel ranks share a name but not members.
  using key = std::tuple<std::string, int, std::vector<int>>;
  std::map<key, std::vector<std::pair<const flight_dump*, const group_dump*>>> groups;
  for (const flight_dump& d : dumps)
    for (const group_dump& g : d.groups) groups[key{g.name, g.size, g.members}].push_back({&d, &g});

  trace_diff result;
  for (const auto& [id, seen] : groups) {
    group_diff diff;
    diff.name = std::get<0>(id);
    diff.size = std::get<1>(id);
    diff.members = std::get<2>(id);
    std::map<int, std::map<std::uint64_t, flight_record>> placed;
    for (const auto& [d, g] : seen) {
      rank_in_group r;
      r.rank = g->rank;
      r.world_rank = d->rank;
      r.collectives = g->collectives;
      r.dumped_at_ns = d->dumped_at_ns;
      for (const flight_record& e : g->entries)
        if (!finished(e.state)) {
          r.in_flight = e;
          break;
        }
      if (!g->entries.empty()) r.last = g->entries.back();
      diff.ranks.push_back(r);
      placed[g->rank] = detail::collectives_by_place(*g);
    }
    std::sort(diff.ranks.begin(), diff.ranks.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
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
    result.groups.push_back(std::move(diff));
  }
  return result;
}

namespace detail {

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) text += (text.empty() ? "" : ", ") + std::to_string(r);
  return text;
}

inline std::string call_text(const flight_record& r) {
  std::string text = std::string(to_string(r.op)) + " #" + std::to_string(r.sequence) + " (" + std::to_string(r.count) +
                     " x " + std::string(to_string(r.type));
  if (r.reduction >= 0) text += ", " + reduction_name(r.reduction);
  if (r.peer >= 0) text += (r.op == operation::send || r.op == operation::recv ? ", peer " : ", root ") + std::to_string(r.peer);
  return text + ")";
}

}  // namespace detail

/// The report weft-trace-diff prints.
inline std::string format_trace_diff(const trace_diff& diff) {
  using detail::call_text;
  using detail::rank_list;
  std::string out;
  for (const group_diff& g : diff.groups) {
    out += "group '" + g.name + "' (" + std::to_string(g.size) + " ranks";
    if (!g.members.empty()) out += "; world ranks " + rank_list(g.members);
    out += ")\n";
    std::vector<int> present;
    for (const rank_in_group& r : g.ranks) present.push_back(r.rank);
    out += "  dumps from ranks: " + rank_list(present) + "\n";
    if (!g.missing.empty())
      out += "  missing ranks (no dump: killed, or ended before they could write one): " + rank_list(g.missing) + "\n";
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
    for (const rank_in_group& r : g.ranks) {
      out += "  rank " + std::to_string(r.rank) + " (world rank " + std::to_string(r.world_rank) + "): ";
      if (r.in_flight) {
        const double waited = static_cast<double>(r.dumped_at_ns - r.in_flight->issued_ns) / 1e9;
        char seconds[32];
        std::snprintf(seconds, sizeof(seconds), "%.2f", waited);
        out += "in " + call_text(*r.in_flight) + ", " + std::string(to_string(r.in_flight->state)) + ", for " + seconds +
               " s when it dumped\n";
      } else if (r.last) {
        out += "idle; its last operation was " + call_text(*r.last) + ", " + std::string(to_string(r.last->state)) + "\n";
      } else {
        out += "no operation recorded\n";
      }
    }
  }
  return out;
}

}  // namespace weft::trace
