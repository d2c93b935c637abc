#pragma once
/// \file
/// A rank's flight-recorder dump: every communicator's recent operations, as written to
/// `weft-flight-<rank>.json` and read back by weft-trace-diff. `capture` takes a recorder's
/// snapshot, `to_json` writes a dump, `parse_flight_dump` reads one; all three are plain
/// functions, tested in one process.
///
/// The file (one object per rank):
///   {"format": "weft-flight-recorder", "version": 1, "rank": 2, "host": "node07", "pid": 4242,
///    "job": "1219231745", "reason": "timeout", "message": "...", "dumped_at_ns": ..., "unix_time_ns": ...,
///    "groups": [{"name": "world", "rank": 2, "size": 4, "members": [0, 1, 2, 3],
///                "timeout_ms": 600000, "issued": 57, "collectives": 55, "fingerprint": "0x...",
///                "entries": [{"seq": 56, "op": "all_reduce", "dtype": "float32", "count": 1024,
///                             "peer": -1, "reduction": "sum", "state": "completed",
///                             "issued_ns": ..., "started_ns": ..., "ended_ns": ...}, ...]}]}
/// Times are the recorder's monotonic clock in nanoseconds; `dumped_at_ns` and `unix_time_ns`
/// give the same instant on the monotonic and the wall clock, to line ranks up. `job` names the
/// run (weft::trace::job_id(); "" when unknown), so dumps left by an earlier run are told apart.

#include <charconv>
#include <system_error>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/core/detail/json.hpp>
#include <weft/core/reduce_op.hpp>
#include <weft/trace/flight_recorder.hpp>
#include <weft/trace/operation.hpp>

namespace weft::trace {

/// The largest group a dump may describe without listing its members (weft-trace-diff lists the
/// ranks that left no dump, so the size is what it allocates for); one that lists them is
/// bounded by the file itself.
inline constexpr int max_group_size_without_members = 1 << 20;

/// One communicator in a dump.
struct group_dump {
  std::string name;
  int rank = 0;  ///< this rank's place in the group
  int size = 0;
  std::vector<int> members;  ///< world ranks in group order (empty: unknown)
  std::int64_t timeout_ms = 0;
  std::uint64_t issued = 0;
  std::uint64_t collectives = 0;
  std::uint64_t fingerprint = 0;
  std::vector<flight_record> entries;  ///< oldest first
};

/// One rank's dump.
struct flight_dump {
  int rank = -1;  ///< world rank
  std::string host;
  long pid = 0;
  std::string job;      ///< the run's job id (trace::job_id()); empty: unknown
  std::string reason;   ///< "timeout", "signal", "request", "terminate", ...
  std::string message;  ///< what the process said when it dumped (the timeout message)
  std::int64_t dumped_at_ns = 0;
  std::int64_t unix_time_ns = 0;
  std::vector<group_dump> groups;
};

inline group_dump capture(const flight_recorder& recorder) {
  group_dump g;
  g.name = recorder.group();
  g.rank = recorder.rank();
  g.size = recorder.size();
  g.members = recorder.members();
  g.timeout_ms = recorder.timeout().count();
  g.issued = recorder.issued();
  g.collectives = recorder.collectives();
  g.fingerprint = recorder.fingerprint();
  g.entries = recorder.snapshot();
  return g;
}

inline std::string reduction_name(int reduction) {
  if (reduction < 0 || reduction > static_cast<int>(reduce_op::avg)) return "none";
  return std::string(to_string(static_cast<reduce_op>(reduction)));
}

inline std::string to_json(const flight_dump& dump) {
  using weft::detail::json_string;
  char hex[32];
  std::string out = "{\"format\": \"weft-flight-recorder\", \"version\": 1, \"rank\": " + std::to_string(dump.rank) +
                    ", \"host\": " + json_string(dump.host) + ", \"pid\": " + std::to_string(dump.pid) +
                    ", \"job\": " + json_string(dump.job) + ", \"reason\": " + json_string(dump.reason) + ", \"message\": " + json_string(dump.message) +
                    ", \"dumped_at_ns\": " + std::to_string(dump.dumped_at_ns) +
                    ", \"unix_time_ns\": " + std::to_string(dump.unix_time_ns) + ",\n \"groups\": [";
  for (std::size_t g = 0; g < dump.groups.size(); ++g) {
    const group_dump& group = dump.groups[g];
    std::snprintf(hex, sizeof(hex), "0x%016llx", static_cast<unsigned long long>(group.fingerprint));
    out += (g == 0 ? "\n  {" : ",\n  {");
    out += "\"name\": " + json_string(group.name) + ", \"rank\": " + std::to_string(group.rank) +
           ", \"size\": " + std::to_string(group.size) + ", \"members\": [";
    for (std::size_t m = 0; m < group.members.size(); ++m)
      out += (m == 0 ? "" : ", ") + std::to_string(group.members[m]);
    out += "], \"timeout_ms\": " + std::to_string(group.timeout_ms) + ", \"issued\": " + std::to_string(group.issued) +
           ", \"collectives\": " + std::to_string(group.collectives) + ", \"fingerprint\": \"" + hex +
           "\",\n   \"entries\": [";
    for (std::size_t e = 0; e < group.entries.size(); ++e) {
      const flight_record& r = group.entries[e];
      out += (e == 0 ? "\n    {" : ",\n    {");
      out += "\"seq\": " + std::to_string(r.sequence) + ", \"op\": \"" + std::string(to_string(r.op)) +
             "\", \"dtype\": \"" + std::string(to_string(r.type)) + "\", \"count\": " + std::to_string(r.count) +
             ", \"peer\": " + std::to_string(r.peer) + ", \"reduction\": \"" + reduction_name(r.reduction) +
             "\", \"state\": \"" + std::string(to_string(r.state)) + "\", \"issued_ns\": " +
             std::to_string(r.issued_ns) + ", \"started_ns\": " + std::to_string(r.started_ns) +
             ", \"ended_ns\": " + std::to_string(r.ended_ns) + "}";
    }
    out += group.entries.empty() ? "]}" : "\n   ]}";
  }
  out += dump.groups.empty() ? "]}\n" : "\n ]}\n";
  return out;
}

namespace detail {

using weft::detail::json_value;
using kind = json_value::kind;

inline const json_value& member(const json_value& object, std::string_view key, std::string_view where) {
  const json_value* found = weft::detail::find_member(object, key);
  if (!found) throw error("flight-recorder dump: " + std::string(where) + " has no \"" + std::string(key) + "\"");
  return *found;
}

inline std::int64_t integer_member(const json_value& object, std::string_view key, std::string_view where) {
  const json_value& v = member(object, key, where);
  if (v.type != kind::number || !v.integer)
    throw error("flight-recorder dump: \"" + std::string(key) + "\" in " + std::string(where) + " is not an integer");
  return *v.integer;
}

inline std::string string_member(const json_value& object, std::string_view key, std::string_view where) {
  const json_value& v = member(object, key, where);
  if (v.type != kind::string)
    throw error("flight-recorder dump: \"" + std::string(key) + "\" in " + std::string(where) + " is not a string");
  return v.text;
}

/// An integer member within [low, high]; the message names the range.
inline std::int64_t bounded_member(const json_value& object, std::string_view key, std::string_view where,
                                   std::int64_t low, std::int64_t high) {
  const std::int64_t value = integer_member(object, key, where);
  if (value < low || value > high)
    throw error("flight-recorder dump: \"" + std::string(key) + "\" in " + std::string(where) + " is " +
                std::to_string(value) + ", not within " + std::to_string(low) + ".." + std::to_string(high));
  return value;
}

inline std::uint64_t unsigned_member(const json_value& object, std::string_view key, std::string_view where) {
  const json_value& v = member(object, key, where);
  std::uint64_t value = 0;
  const char* first = v.text.data();
  const char* last = first + v.text.size();
  const auto [end, code] = std::from_chars(first, last, value);
  if (v.type != kind::number || code != std::errc() || end != last || v.text.empty())
    throw error("flight-recorder dump: \"" + std::string(key) + "\" in " + std::string(where) +
                " is not a count from 0 to 18446744073709551615");
  return value;
}

inline std::uint64_t hex_member(const json_value& object, std::string_view key, std::string_view where) {
  const std::string text = string_member(object, key, where);
  std::uint64_t value = 0;
  const std::string_view digits = std::string_view(text).substr(text.starts_with("0x") ? 2 : 0);
  const auto [end, code] = std::from_chars(digits.data(), digits.data() + digits.size(), value, 16);
  if (digits.empty() || code != std::errc() || end != digits.data() + digits.size())
    throw error("flight-recorder dump: \"" + std::string(key) + "\" in " + std::string(where) +
                " is not a 64-bit hexadecimal number");
  return value;
}

inline json_value parse_dump_text(std::string_view text) {
  try {
    return weft::detail::json_parser::parse(text);
  } catch (const weft::detail::json_syntax_error& e) {
    throw error("flight-recorder dump: not valid JSON: " + std::string(e.what()) + " (byte " +
                std::to_string(e.offset()) + ")");
  }
}

inline dtype dtype_from_name(const std::string& name) {
  for (dtype t : {dtype::float32, dtype::float64, dtype::float16, dtype::bfloat16, dtype::int32, dtype::int64, dtype::uint8})
    if (to_string(t) == name) return t;
  throw error("flight-recorder dump: unknown dtype \"" + name + "\"");
}

inline int reduction_from_name(const std::string& name) {
  for (reduce_op op : {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg})
    if (to_string(op) == name) return static_cast<int>(op);
  return -1;
}

}  // namespace detail

/// Reads a dump written by to_json. @throws weft::error saying what is missing or malformed.
inline flight_dump parse_flight_dump(std::string_view text) {
  using namespace detail;
  const json_value top = parse_dump_text(text);
  if (top.type != kind::object) throw error("flight-recorder dump: the file is not a JSON object");
  if (string_member(top, "format", "the dump") != "weft-flight-recorder")
    throw error("flight-recorder dump: \"format\" is not \"weft-flight-recorder\"");
  flight_dump dump;
  dump.rank = static_cast<int>(bounded_member(top, "rank", "the dump", -1, std::numeric_limits<int>::max()));
  dump.host = string_member(top, "host", "the dump");
  dump.pid = static_cast<long>(integer_member(top, "pid", "the dump"));
  if (const json_value* job = weft::detail::find_member(top, "job"); job && job->type == kind::string) dump.job = job->text;
  dump.reason = string_member(top, "reason", "the dump");
  if (const json_value* m = weft::detail::find_member(top, "message"); m && m->type == kind::string) dump.message = m->text;
  dump.dumped_at_ns = integer_member(top, "dumped_at_ns", "the dump");
  dump.unix_time_ns = integer_member(top, "unix_time_ns", "the dump");
  const json_value& groups = member(top, "groups", "the dump");
  if (groups.type != kind::array) throw error("flight-recorder dump: \"groups\" is not an array");
  for (const json_value& go : groups.items) {
    if (go.type != kind::object) throw error("flight-recorder dump: a group is not an object");
    group_dump g;
    g.name = string_member(go, "name", "a group");
    const std::string where = "group '" + g.name + "'";
    // The size drives what weft-trace-diff allocates: bounded by the members the file lists, or
    // by max_group_size_without_members when it lists none.
    g.size = static_cast<int>(bounded_member(go, "size", where, 1, std::numeric_limits<int>::max()));
    g.rank = static_cast<int>(bounded_member(go, "rank", where, 0, g.size - 1));
    if (const json_value* m = weft::detail::find_member(go, "members"); m && m->type == kind::array) {
      for (const json_value& rank : m->items) {
        if (!rank.integer || *rank.integer < 0 || *rank.integer > std::numeric_limits<int>::max())
          throw error("flight-recorder dump: \"members\" of " + where + " holds something other than a world rank");
        g.members.push_back(static_cast<int>(*rank.integer));
      }
    }
    if (!g.members.empty() && g.members.size() != static_cast<std::size_t>(g.size))
      throw error("flight-recorder dump: " + where + " has size " + std::to_string(g.size) + " but lists " +
                  std::to_string(g.members.size()) + " members");
    if (g.members.empty() && g.size > max_group_size_without_members)
      throw error("flight-recorder dump: " + where + " has size " + std::to_string(g.size) +
                  " and lists no members; without members a group may have at most " +
                  std::to_string(max_group_size_without_members) + " ranks");
    g.timeout_ms = integer_member(go, "timeout_ms", where);
    g.issued = unsigned_member(go, "issued", where);
    g.collectives = unsigned_member(go, "collectives", where);
    g.fingerprint = hex_member(go, "fingerprint", where);
    const json_value& entries = member(go, "entries", where);
    if (entries.type != kind::array) throw error("flight-recorder dump: \"entries\" of " + where + " is not an array");
    for (const json_value& eo : entries.items) {
      if (eo.type != kind::object) throw error("flight-recorder dump: an entry of " + where + " is not an object");
      flight_record r;
      r.sequence = unsigned_member(eo, "seq", where);
      const std::string op = string_member(eo, "op", where);
      const auto parsed_op = operation_from_name(op);
      if (!parsed_op) throw error("flight-recorder dump: unknown operation \"" + op + "\" in " + where);
      r.op = *parsed_op;
      r.type = dtype_from_name(string_member(eo, "dtype", where));
      r.count = unsigned_member(eo, "count", where);
      r.peer = static_cast<int>(bounded_member(eo, "peer", where, -1, g.size - 1));
      if (const json_value* red = weft::detail::find_member(eo, "reduction"); red && red->type == kind::string)
        r.reduction = reduction_from_name(red->text);
      const std::string state = string_member(eo, "state", where);
      const auto parsed_state = op_state_from_name(state);
      if (!parsed_state) throw error("flight-recorder dump: unknown state \"" + state + "\" in " + where);
      r.state = *parsed_state;
      r.issued_ns = integer_member(eo, "issued_ns", where);
      r.started_ns = integer_member(eo, "started_ns", where);
      r.ended_ns = integer_member(eo, "ended_ns", where);
      g.entries.push_back(r);
    }
    dump.groups.push_back(std::move(g));
  }
  return dump;
}

}  // namespace weft::trace
