// The pure parts of weft/trace in one process: the flight recorder's ring, the dump's JSON (written
// and read back), the rolling fingerprint, and weft-trace-diff's comparison on hand-made dumps.
#include <catch2/catch.hpp>

#include <weft/core/detail/json.hpp>
#include <weft/core/timeout.hpp>
#include <weft/trace/fingerprint.hpp>
#include <weft/trace/flight_dump.hpp>
#include <weft/trace/flight_recorder.hpp>
#include <weft/trace/trace_diff.hpp>
#include <weft/trace/watchdog.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

using namespace weft::trace;
using Catch::Matchers::Contains;

TEST_CASE("the ring keeps the newest entries, numbered in issue order, with their states") {
  flight_recorder recorder("dp", 1, 4, 4, std::chrono::seconds(3));
  for (int i = 0; i < 6; ++i) {
    const auto seq = recorder.issue(operation::all_reduce, weft::dtype::float32, 10u + static_cast<unsigned>(i), -1, 0);
    if (i != 4) recorder.finish(seq, i != 3);
  }
  CHECK(recorder.issued() == 6);
  const auto records = recorder.snapshot();
  REQUIRE(records.size() == 4);
  CHECK(records.front().sequence == 3);
  CHECK(records.back().sequence == 6);
  CHECK(records[0].count == 12);
  CHECK(records[1].state == op_state::failed);
  CHECK(records[2].state == op_state::issued);
  CHECK(records[3].state == op_state::completed);
  REQUIRE(recorder.oldest_unfinished());
  CHECK(recorder.oldest_unfinished()->sequence == 5);
  recorder.start(5);
  CHECK(recorder.read(5)->state == op_state::started);
  CHECK_FALSE(recorder.read(1));  // overwritten
  CHECK(recorder.timeout() == std::chrono::seconds(3));
}

TEST_CASE("a capacity that is not a power of two is rounded up, and the ring still wraps in order") {
  flight_recorder recorder("tp", 0, 2, 5);
  REQUIRE(recorder.capacity() == 8);
  for (unsigned i = 1; i <= 21; ++i) recorder.finish(recorder.issue(operation::send, weft::dtype::float32, i, 1));
  const auto records = recorder.snapshot();
  REQUIRE(records.size() == 8);
  for (std::size_t k = 0; k < records.size(); ++k) {
    CHECK(records[k].sequence == 14 + k);
    CHECK(records[k].count == 14 + k);  // the slot holds its own operation, not a neighbour's
  }
  CHECK_FALSE(recorder.read(13));
}

TEST_CASE("offer and claim hand one async operation to the backend; untracked ones have no deadline") {
  flight_recorder recorder("world", 0, 2, 8);
  const auto seq = recorder.issue(operation::broadcast, weft::dtype::int64, 3, 1);
  recorder.offer(seq);
  CHECK(recorder.claim() == seq);
  CHECK(recorder.claim() == 0);
  recorder.untracked(seq);
  CHECK_FALSE(recorder.oldest_unfinished());
}

TEST_CASE("the fingerprint covers collectives only, and changes with any field of a call") {
  flight_recorder a("g", 0, 2, 16), b("g", 1, 2, 16);
  a.issue(operation::all_reduce, weft::dtype::float32, 4, -1, 0);
  b.issue(operation::all_reduce, weft::dtype::float32, 4, -1, 0);
  a.issue(operation::send, weft::dtype::float32, 9, 1);
  b.issue(operation::recv, weft::dtype::float32, 9, 0);
  CHECK(a.fingerprint() == b.fingerprint());
  CHECK(a.collectives() == 1);
  const auto base = fold_call(fingerprint_seed, operation::all_reduce, weft::dtype::float32, 4, 0, -1, 1);
  CHECK(base == a.fingerprint());
  CHECK(base != fold_call(fingerprint_seed, operation::all_reduce, weft::dtype::float32, 5, 0, -1, 1));
  CHECK(base != fold_call(fingerprint_seed, operation::all_reduce, weft::dtype::float64, 4, 0, -1, 1));
  CHECK(base != fold_call(fingerprint_seed, operation::all_reduce, weft::dtype::float32, 4, 3, -1, 1));
  CHECK(base != fold_call(fingerprint_seed, operation::reduce, weft::dtype::float32, 4, 0, -1, 1));
  CHECK(base != fold_call(fingerprint_seed, operation::all_reduce, weft::dtype::float32, 4, 0, 0, 1));
  CHECK(base != fold_call(fingerprint_seed, operation::all_reduce, weft::dtype::float32, 4, 0, -1, 2));
}

namespace {

flight_record call(std::uint64_t seq, operation op, std::uint64_t count, op_state state,
                   weft::dtype type = weft::dtype::float32) {
  flight_record r;
  r.sequence = seq;
  r.op = op;
  r.type = type;
  r.count = count;
  r.reduction = op == operation::all_reduce ? 0 : -1;
  r.state = state;
  r.issued_ns = 1000 * static_cast<std::int64_t>(seq);
  r.started_ns = r.issued_ns;
  r.ended_ns = state == op_state::completed ? r.issued_ns + 10 : 0;
  return r;
}

flight_dump dump_of(int rank, std::vector<flight_record> entries, std::uint64_t collectives) {
  flight_dump d;
  d.rank = rank;
  d.host = "node\"" + std::to_string(rank);  // a quote, to exercise escaping
  d.pid = 100 + rank;
  d.reason = "timeout";
  d.message = "line one\nline two";
  d.dumped_at_ns = 5'000'000'000;
  d.unix_time_ns = 1'700'000'000'000'000'000;
  group_dump g;
  g.name = "world";
  g.rank = rank;
  g.size = 4;
  g.members = {0, 1, 2, 3};
  g.timeout_ms = 2000;
  g.issued = entries.empty() ? 0 : entries.back().sequence;
  g.collectives = collectives;
  g.fingerprint = 0xfedcba9876543210ull;
  g.entries = std::move(entries);
  d.groups.push_back(g);
  return d;
}

}  // namespace

TEST_CASE("a dump survives writing and reading back exactly") {
  const flight_dump original = dump_of(2, {call(1, operation::barrier, 0, op_state::completed),
                                           call(2, operation::all_reduce, 64, op_state::started)}, 2);
  const flight_dump back = parse_flight_dump(to_json(original));
  CHECK(back.rank == 2);
  CHECK(back.host == original.host);
  CHECK(back.message == original.message);
  CHECK(back.unix_time_ns == original.unix_time_ns);
  REQUIRE(back.groups.size() == 1);
  CHECK(back.groups[0].members == std::vector<int>{0, 1, 2, 3});
  CHECK(back.groups[0].fingerprint == 0xfedcba9876543210ull);
  REQUIRE(back.groups[0].entries.size() == 2);
  CHECK(back.groups[0].entries[1].op == operation::all_reduce);
  CHECK(back.groups[0].entries[1].count == 64);
  CHECK(back.groups[0].entries[1].reduction == 0);
  CHECK(back.groups[0].entries[1].state == op_state::started);
  CHECK_THROWS_WITH(parse_flight_dump("{\"format\": \"weft-flight-recorder\", \"rank\": 1"), Contains("not valid JSON"));
  CHECK_THROWS_WITH(parse_flight_dump("{\"format\": \"other\"}"), Contains("\"format\""));
}

TEST_CASE("trace diff: a rank that left no dump and ranks that never arrived are named") {
  // Ranks 0 and 1 are in collective 3; rank 3 is still in collective 2; rank 2 left no dump.
  std::vector<flight_dump> dumps = {
      dump_of(0, {call(1, operation::barrier, 0, op_state::completed), call(2, operation::all_reduce, 8, op_state::completed),
                  call(3, operation::all_reduce, 8, op_state::started)}, 3),
      dump_of(1, {call(1, operation::barrier, 0, op_state::completed), call(2, operation::all_reduce, 8, op_state::completed),
                  call(3, operation::all_reduce, 8, op_state::started)}, 3),
      dump_of(3, {call(1, operation::barrier, 0, op_state::completed), call(2, operation::all_reduce, 8, op_state::started)}, 2)};
  const auto diff = diff_flight_dumps(dumps);
  REQUIRE(diff.groups.size() == 1);
  const auto& g = diff.groups[0];
  CHECK(g.missing == std::vector<int>{2});
  CHECK_FALSE(g.first_divergent);
  CHECK(g.newest_collective == 3);
  CHECK(g.never_arrived == std::vector<int>{3});
  REQUIRE(g.ranks.size() == 3);
  CHECK(g.ranks[2].in_flight->sequence == 2);
  const std::string text = format_trace_diff(diff);
  CHECK_THAT(text, Contains("missing ranks") && Contains(": 2\n"));
  CHECK_THAT(text, Contains("never arrived: ranks 3"));
  CHECK_THAT(text, Contains("rank 3 (world rank 3): in all_reduce #2 (8 x float, sum), started"));
}

TEST_CASE("trace diff: the first divergent collective is named with each rank's call, across p2p") {
  // Rank 1 did a send before its collectives (sequence numbers shift), and its second
  // all_reduce has a different count.
  std::vector<flight_dump> dumps = {
      dump_of(0, {call(1, operation::all_reduce, 8, op_state::completed), call(2, operation::all_reduce, 8, op_state::started)}, 2),
      dump_of(1, {call(1, operation::send, 3, op_state::completed), call(2, operation::all_reduce, 8, op_state::completed),
                  call(3, operation::all_reduce, 7, op_state::started)}, 2)};
  dumps[1].groups[0].entries[0].peer = 0;
  const auto diff = diff_flight_dumps(dumps);
  REQUIRE(diff.groups.size() == 1);
  const auto& g = diff.groups[0];
  REQUIRE(g.first_divergent);
  CHECK(*g.first_divergent == 2);
  REQUIRE(g.divergent_calls.size() == 2);
  CHECK(g.divergent_calls[0].second.count == 8);
  CHECK(g.divergent_calls[1].second.count == 7);
  CHECK(g.divergent_calls[1].second.sequence == 3);
  CHECK(g.missing == std::vector<int>{2, 3});
  CHECK_THAT(format_trace_diff(diff), Contains("first divergent call: collective 2") &&
                                          Contains("rank 1: all_reduce #3 (7 x float, sum)"));
}

TEST_CASE("trace diff: groups with one name but different members are kept apart") {
  flight_dump a = dump_of(0, {call(1, operation::all_reduce, 8, op_state::completed)}, 1);
  flight_dump b = dump_of(1, {call(1, operation::all_reduce, 9, op_state::completed)}, 1);
  a.groups[0].size = b.groups[0].size = 1;
  a.groups[0].rank = b.groups[0].rank = 0;
  a.groups[0].members = {0};
  b.groups[0].members = {1};
  const auto diff = diff_flight_dumps({a, b});
  REQUIRE(diff.groups.size() == 2);
  for (const auto& g : diff.groups) {
    CHECK_FALSE(g.first_divergent);
    CHECK(g.missing.empty());
  }
}


// ---- the recorder: marking is atomic per slot, the ring is bounded --------------------------

TEST_CASE("a finish racing the reuse of its slot never marks the new operation") {
  // One slot: every issue reuses it. The marking thread finishes only even sequence numbers,
  // and only after reading them as the newest; an odd operation is never finished by anyone, so
  // it must never read as completed. Before marking was a compare-and-swap on the slot's tag, the
  // check and the store could straddle a reuse and complete the odd operation.
  flight_recorder recorder("race", 0, 2, 1);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> wrongly_completed{0};
  std::thread marker([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const std::uint64_t newest = recorder.issued();
      if (newest != 0 && newest % 2 == 0) recorder.finish(newest);
    }
  });
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  std::uint64_t odd_checked = 0;
  while (std::chrono::steady_clock::now() < end) {
    for (int i = 0; i < 1000; ++i) {
      const std::uint64_t seq = recorder.issue(operation::all_reduce, weft::dtype::float32, 1, -1, 0);
      if (seq % 2 == 1) {
        ++odd_checked;
        for (int look = 0; look < 4; ++look)
          if (auto r = recorder.read(seq); r && r->state == op_state::completed) wrongly_completed.fetch_add(1);
      }
    }
  }
  stop = true;
  marker.join();
  INFO(odd_checked << " odd operations checked");
  CHECK(wrongly_completed.load() == 0);
}

TEST_CASE("the recorder's capacity is bounded, with a message naming the limit") {
  CHECK(max_flight_recorder_entries == 65536);
  CHECK_NOTHROW(flight_recorder("g", 0, 1, max_flight_recorder_entries));
  CHECK_THROWS_WITH(flight_recorder("g", 0, 1, max_flight_recorder_entries + 1),
                    Contains("65537 entries") && Contains("limit of 65536") && Contains("WEFT_FLIGHT_RECORDER_ENTRIES"));
  setenv("WEFT_FLIGHT_RECORDER_ENTRIES", "16777216", 1);
  CHECK_THROWS_WITH(flight_recorder_capacity_from_environment(), Contains("from 1 to 65536"));
  setenv("WEFT_FLIGHT_RECORDER_ENTRIES", "-1", 1);
  CHECK_THROWS_WITH(flight_recorder_capacity_from_environment(), Contains("from 1 to 65536"));
  setenv("WEFT_FLIGHT_RECORDER_ENTRIES", "65536", 1);
  CHECK(flight_recorder_capacity_from_environment() == 65536);
  unsetenv("WEFT_FLIGHT_RECORDER_ENTRIES");
}

// ---- the dump's bounds and weft-trace-diff -------------------------------------------------

TEST_CASE("a dump's sizes are bounded by the file, and out-of-range numbers are named") {
  const std::string head = "{\"format\": \"weft-flight-recorder\", \"version\": 1, \"rank\": 0, \"host\": \"h\", \"pid\": 1, "
                           "\"reason\": \"timeout\", \"dumped_at_ns\": 5, \"unix_time_ns\": 5, \"groups\": [";
  auto group = [](const std::string& size, const std::string& members, const std::string& issued = "0") {
    return "{\"name\": \"g\", \"rank\": 0, \"size\": " + size + ", \"members\": " + members +
           ", \"timeout_ms\": 0, \"issued\": " + issued + ", \"collectives\": 0, \"fingerprint\": \"0x1\", \"entries\": []}";
  };
  CHECK_THROWS_WITH(parse_flight_dump(head + group("2147483647", "[]") + "]}"),
                    Contains("size 2147483647") && Contains("at most 1048576"));
  CHECK_THROWS_WITH(parse_flight_dump(head + group("3", "[0, 1]") + "]}"), Contains("size 3 but lists 2 members"));
  CHECK_THROWS_WITH(parse_flight_dump(head + group("0", "[]") + "]}"), Contains("\"size\"") && Contains("not within 1.."));
  CHECK_THROWS_WITH(parse_flight_dump(head + group("2", "[0, 1]", "99999999999999999999999") + "]}"),
                    Contains("\"issued\"") && Contains("not a count"));
  CHECK_NOTHROW(parse_flight_dump(head + group("1048576", "[]") + "]}"));
}

TEST_CASE("trace diff: a dump of another run is named and left out, so the missing rank shows") {
  // Ranks 0, 1 and 3 of job "new" are stuck; weft-flight-2.json is left from job "old".
  std::vector<flight_dump> dumps;
  for (int rank : {0, 1, 2, 3}) {
    dumps.push_back(dump_of(rank, {call(1, operation::all_reduce, 8, op_state::started)}, 1));
    dumps.back().job = rank == 2 ? "old" : "new";
    dumps.back().unix_time_ns = rank == 2 ? 1'600'000'000'000'000'000 : 1'700'000'000'000'000'000;
  }
  const auto diff = diff_flight_dumps(dumps);
  CHECK(diff.job == "new");
  CHECK(diff.compared == 3);
  REQUIRE(diff.other_runs.size() == 1);
  CHECK(diff.other_runs[0].index == 2);
  REQUIRE(diff.groups.size() == 1);
  CHECK(diff.groups[0].missing == std::vector<int>{2});
  CHECK(diff.diverged());
  const std::string text = format_trace_diff(diff, {"d/weft-flight-0.json", "d/weft-flight-1.json", "d/weft-flight-2.json",
                                                    "d/weft-flight-3.json"});
  CHECK_THAT(text, Contains("job new: 3 dumps compared"));
  CHECK_THAT(text, Contains("left out: d/weft-flight-2.json belongs to another run (job old, written 2020-09-13 12:26:40 UTC)"));
  CHECK_THAT(text, Contains("): 2\n"));
}

TEST_CASE("trace diff: without job ids the report says runs cannot be told apart") {
  const auto diff = diff_flight_dumps({dump_of(0, {}, 0)});
  CHECK_FALSE(diff.job_known);
  CHECK_THAT(format_trace_diff(diff), Contains("carry no job id"));
}

TEST_CASE("trace diff: untracked operations are reported as unknown, not as finished") {
  // NCCL's async operations are untracked: rank 1's last one may still run.
  std::vector<flight_dump> dumps = {
      dump_of(0, {call(1, operation::all_reduce, 8, op_state::completed), call(2, operation::all_reduce, 8, op_state::untracked)}, 2),
      dump_of(1, {call(1, operation::all_reduce, 8, op_state::untracked), call(2, operation::all_reduce, 8, op_state::started)}, 2)};
  for (auto& d : dumps) d.groups[0].size = 2, d.groups[0].members = {0, 1};
  const auto diff = diff_flight_dumps(dumps);
  REQUIRE(diff.groups.size() == 1);
  const auto& g = diff.groups[0];
  CHECK(g.busy());
  CHECK(g.ranks[0].untracked == 1);
  CHECK_FALSE(g.ranks[0].in_flight);
  REQUIRE(g.ranks[1].in_flight);
  CHECK(g.ranks[1].in_flight->sequence == 2);  // not the untracked #1
  const std::string text = format_trace_diff(diff);
  CHECK_THAT(text, Contains("rank 0 (world rank 0): unknown: its last operation, all_reduce #2 (8 x float, sum), is untracked"));
  CHECK_THAT(text, Contains("1 untracked operation of unknown state, the newest all_reduce #1"));
}

TEST_CASE("trace diff: times that would overflow are reported as unknown") {
  flight_dump d = dump_of(0, {call(1, operation::all_reduce, 8, op_state::started)}, 1);
  d.groups[0].size = 1;
  d.groups[0].members = {0};
  d.groups[0].entries[0].issued_ns = std::numeric_limits<std::int64_t>::min() + 1;
  d.dumped_at_ns = std::numeric_limits<std::int64_t>::max();
  const std::string text = format_trace_diff(diff_flight_dumps({d}));
  CHECK_THAT(text, Contains("for an unknown time (the dump's times are out of order)"));
  d.groups[0].entries[0].issued_ns = 1'000'000'000;
  d.dumped_at_ns = 3'500'000'000;
  CHECK_THAT(format_trace_diff(diff_flight_dumps({d})), Contains("for 2.50 s when it dumped"));
}

TEST_CASE("trace diff: diverged groups come first, idle consistent ones fold into one line; JSON says the same") {
  // 30 one-rank groups that never ran anything (as train_gpt's per-rank groups) and one group of
  // 2 where rank 1 is behind.
  std::vector<flight_dump> dumps;
  for (int rank = 0; rank < 2; ++rank) {
    flight_dump d = dump_of(rank, {call(1, operation::all_reduce, 8, op_state::completed)}, rank == 0 ? 2 : 1);
    if (rank == 0) d.groups[0].entries.push_back(call(2, operation::all_reduce, 8, op_state::started));
    d.groups[0].size = 2;
    d.groups[0].members = {0, 1};
    for (int k = 0; k < 15; ++k) {
      group_dump single;
      single.name = std::string(k % 2 == 0 ? "tp" : "cp") + std::to_string(k / 2);
      single.rank = 0;
      single.size = 1;
      single.members = {rank};
      d.groups.insert(d.groups.begin(), std::move(single));
    }
    dumps.push_back(d);
  }
  const auto diff = diff_flight_dumps(dumps);
  REQUIRE(diff.groups.size() == 31);
  CHECK(diff.groups.front().name == "world");
  const std::string text = format_trace_diff(diff);
  CHECK(text.find("group 'world'") < text.find("idle and consistent"));
  CHECK(std::count(text.begin(), text.end(), '\n') < 15);
  CHECK_THAT(text, Contains("30 groups idle and consistent") && Contains("'tp0' x2"));
  CHECK_THAT(text, Contains("group 'world' (2 ranks; world ranks 0, 1): ranks behind, a rank inside an operation") &&
                       Contains("never arrived: ranks 1"));

  const auto json = weft::detail::json_parser::parse(trace_diff_json(diff, {"a.json", "b.json"}));
  CHECK(weft::detail::find_member(json, "format")->text == "weft-trace-diff");
  CHECK(weft::detail::find_member(json, "diverged")->boolean);
  const auto& groups = weft::detail::find_member(json, "groups")->items;
  REQUIRE(groups.size() == 31);
  CHECK(weft::detail::find_member(groups[0], "status")->text == "diverged");
  CHECK(*weft::detail::find_member(groups[0], "never_arrived")->items.at(0).integer == 1);
  CHECK(weft::detail::find_member(groups[1], "status")->text == "idle");
  const auto& ranks = weft::detail::find_member(groups[0], "ranks")->items;
  REQUIRE(ranks.size() == 2);
  CHECK(weft::detail::find_member(ranks[0], "state")->text == "in_flight");
  CHECK(*weft::detail::find_member(*weft::detail::find_member(ranks[0], "operation"), "seq")->integer == 2);
}

TEST_CASE("trace diff: rank lists fold runs into ranges") {
  CHECK(weft::trace::detail::rank_list({0, 1, 2, 3, 5, 7, 8}) == "0-3, 5, 7, 8");
  CHECK(weft::trace::detail::rank_list({}) == "");
}

// ---- what the watchdog reads: the deadline, the job id -----------------------------------------

TEST_CASE("a deadline below 1 ms is refused, not turned into no deadline") {
  CHECK_THROWS_WITH(weft::parse_comm_timeout("0.0005", "WEFT_COMM_TIMEOUT"),
                    Contains("below 1 ms") && Contains("at least 0.001") && Contains("0 to wait without a deadline"));
  CHECK_THROWS_WITH(weft::parse_comm_timeout("1e-9", "--comm-timeout"), Contains("--comm-timeout='1e-9'"));
  CHECK(weft::parse_comm_timeout("0.001", "x") == std::chrono::milliseconds(1));
  CHECK(weft::parse_comm_timeout("0", "x") == std::chrono::milliseconds(0));
}

TEST_CASE("a dump carries its job id, and the job id comes from the launcher") {
  flight_dump d = dump_of(1, {call(1, operation::barrier, 0, op_state::completed)}, 1);
  d.job = "slurm-77.0";
  CHECK(parse_flight_dump(to_json(d)).job == "slurm-77.0");
  setenv("SLURM_JOB_ID", "77", 1);
  setenv("SLURM_STEP_ID", "3", 1);
  CHECK(job_id() == "slurm-77.3");  // two sruns of one allocation are two runs
  unsetenv("SLURM_STEP_ID");
  CHECK(job_id() == "slurm-77");
  unsetenv("SLURM_JOB_ID");
  set_job_id("agreed-at-start");
  CHECK(job_id() == "agreed-at-start");
  set_job_id("");
  CHECK_THAT(dump_request_path("a/b c"), Contains("weft-dump-request-a_b_c"));
}

TEST_CASE("trace diff: a stopped rank's groups where nothing else happened fold into one line") {
  // World rank 1 left no dump; group 'a' (0, 1) has rank 0 inside an operation, groups 'b' and
  // 'c' (0, 1) are idle apart from the missing dump, 'solo' (0) is idle and complete.
  flight_dump d = dump_of(0, {call(1, operation::all_reduce, 8, op_state::started)}, 1);
  d.groups[0].name = "a";
  d.groups[0].size = 2;
  d.groups[0].members = {0, 1};
  for (const char* name : {"b", "c"}) {
    group_dump g;
    g.name = name;
    g.size = 2;
    g.members = {0, 1};
    d.groups.push_back(g);
  }
  group_dump solo;
  solo.name = "solo";
  solo.size = 1;
  solo.members = {0};
  d.groups.push_back(solo);
  const auto diff = diff_flight_dumps({d});
  CHECK(diff.missing_world_ranks == std::vector<int>{1});
  REQUIRE(diff.groups.size() == 4);
  CHECK(diff.groups[0].name == "a");
  const std::string text = format_trace_diff(diff);
  CHECK_THAT(text, Contains("no dump from world ranks 1 (stopped, killed"));
  CHECK_THAT(text, Contains("group 'a' (2 ranks; world ranks 0, 1): ranks without a dump, a rank inside an operation"));
  CHECK_THAT(text, Contains("2 groups idle and consistent but for ranks without a dump: 'b', 'c'\n"));
  CHECK_THAT(text, Contains("1 group idle and consistent (every rank dumped, none inside an operation, calls agree): 'solo'"));
  CHECK(text.find("group 'b'") == std::string::npos);
}
