// Pipeline schedules: the generators' tables, the verifier's figures against the papers' formulas
// over many random (p, m, v), the refused configurations, and deadlocks in broken tables.
#include <catch2/catch.hpp>

#include <weft/core/error.hpp>
#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule.hpp>
#include <weft/pipeline/schedule_kind.hpp>
#include <weft/pipeline/schedules.hpp>
#include <weft/pipeline/theory.hpp>
#include <weft/pipeline/verify.hpp>

#include <random>
#include <string>
#include <vector>

namespace wp = weft::pipeline;
using wp::action_kind;
using wp::schedule_kind;

namespace {

bool contains(const std::vector<std::string>& texts, const std::string& part) {
  for (const std::string& text : texts) {
    if (text.find(part) != std::string::npos) return true;
  }
  return false;
}

// A random valid spec of `kind` and random uniform costs; fixed seed, so failures reproduce.
struct drawn {
  wp::schedule_spec spec;
  wp::costs costs;
};

std::vector<drawn> draw(schedule_kind kind, int count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  auto uniform = [&](int low, int high) { return std::uniform_int_distribution<int>(low, high)(rng); };
  std::vector<drawn> out;
  for (int i = 0; i < count; ++i) {
    drawn d;
    d.spec.kind = kind;
    d.spec.stages = uniform(kind == schedule_kind::interleaved ? 2 : 1, 12);
    d.spec.virtual_stages = kind == schedule_kind::interleaved ? uniform(2, 5) : 1;
    d.spec.micro_batches = kind == schedule_kind::interleaved ? d.spec.stages * uniform(1, 5) : uniform(1, 40);
    d.costs.forward = uniform(1, 6);
    d.costs.backward = uniform(1, 12);
    d.costs.weight = uniform(0, static_cast<int>(d.costs.backward) - 1);
    out.push_back(d);
  }
  return out;
}

}  // namespace

TEST_CASE("schedule names and tags share one vocabulary", "[pipeline]") {
  for (schedule_kind kind : wp::all_schedule_kinds) CHECK(wp::parse_schedule_kind(wp::to_string(kind)) == kind);
  CHECK_FALSE(wp::parse_schedule_kind("pipedream").has_value());
  CHECK(wp::make_schedule(wp::interleaved<2>{}, 4, 8).virtual_stages == 2);
  CHECK(wp::make_schedule(wp::one_f_one_b{}, 4, 8).ranks == wp::make_schedule({.kind = schedule_kind::one_f_one_b, .stages = 4, .micro_batches = 8}).ranks);
}

TEST_CASE("1F1B's table is the textbook one", "[pipeline]") {
  const wp::schedule s = wp::make_schedule(wp::one_f_one_b{}, 4, 8);
  // Stage 0: three warm-up forwards, then F3 B0 F4 B1 ..., then the last three backwards.
  const std::vector<wp::action>& first = s.ranks[0];
  REQUIRE(first.size() == 16);
  CHECK(first[0] == wp::action{action_kind::forward, 0, 0, -1, 1});
  CHECK(first[3] == wp::action{action_kind::forward, 3, 0, -1, 1});
  CHECK(first[4] == wp::action{action_kind::backward, 0, 0, 1, -1});
  // The last stage alternates from the start, and receives forwards and sends backwards.
  CHECK(s.ranks[3][0] == wp::action{action_kind::forward, 0, 0, 2, -1});
  CHECK(s.ranks[3][1] == wp::action{action_kind::backward, 0, 0, -1, 2});
}

TEST_CASE("the verifier's makespan, bubble and peak equal the papers' formulas", "[pipeline]") {
  int checked = 0;
  std::uint32_t seed = 20240601;
  for (schedule_kind kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b, schedule_kind::interleaved}) {
    for (const drawn& d : draw(kind, 150, seed++)) {
      INFO(wp::to_string(kind) << " p=" << d.spec.stages << " m=" << d.spec.micro_batches << " v=" << d.spec.virtual_stages
                               << " F=" << d.costs.forward << " B=" << d.costs.backward);
      const wp::schedule s = wp::make_schedule(d.spec);
      const wp::verify_report r = wp::verify(s, d.costs);
      REQUIRE(r.ok());
      CHECK(r.makespan == *wp::theory_makespan(d.spec, d.costs));
      CHECK(r.bubble_fraction == Approx(*wp::theory_bubble_fraction(d.spec)).margin(1e-12));
      for (int stage = 0; stage < d.spec.stages; ++stage) CHECK(r.peak_in_flight[static_cast<std::size_t>(stage)] == wp::theory_peak_in_flight(d.spec, stage));
      ++checked;
    }
  }
  CHECK(checked == 450);
}

TEST_CASE("ZB-H1 has a smaller bubble than 1F1B with the same activations", "[pipeline]") {
  for (const drawn& d : draw(schedule_kind::zb_h1, 200, 7)) {
    INFO("p=" << d.spec.stages << " m=" << d.spec.micro_batches << " F=" << d.costs.forward << " B=" << d.costs.backward << " W=" << d.costs.weight);
    const wp::verify_report zb = wp::verify(wp::make_schedule(d.spec), d.costs);
    const wp::verify_report one = wp::verify(wp::make_schedule(wp::one_f_one_b{}, d.spec.stages, d.spec.micro_batches), d.costs);
    REQUIRE(zb.ok());
    CHECK(zb.peak_in_flight == one.peak_in_flight);
    CHECK(zb.busy == one.busy);  // the same work, split differently
    if (d.costs.weight > 0 && d.spec.stages > 1) {
      CHECK(zb.makespan < one.makespan);
      CHECK(zb.bubble_fraction < one.bubble_fraction);
    } else {
      CHECK(zb.makespan <= one.makespan);
    }
  }
  // F = B_input = W = 1 (B = 2): each stage's idle time drops from (p-1)(F+B) to (p-1)(F+B-W).
  const wp::verify_report r = wp::verify(wp::make_schedule(wp::zb_h1{}, 4, 8), {.forward = 1, .backward = 2, .weight = 1});
  CHECK(r.makespan == 8 * 3 + 3 * 2);
}

TEST_CASE("communication cost delays every cross-rank dependency", "[pipeline]") {
  const wp::verify_report r = wp::verify(wp::make_schedule(wp::gpipe{}, 3, 4), {.forward = 1, .backward = 1, .weight = 0, .comm = 2});
  REQUIRE(r.ok());
  // The first forward crosses two links, the first backward two more.
  CHECK(r.makespan == (4 + 2) * 2 + 2 * 2 * 2);
}

TEST_CASE("refused configurations say the rule and a valid alternative", "[pipeline]") {
  auto problems = [](wp::schedule_spec spec) { return wp::validate(spec); };
  CHECK(contains(problems({.kind = schedule_kind::interleaved, .stages = 4, .micro_batches = 6, .virtual_stages = 2}),
                 "use micro-batches=4 or 8"));
  CHECK(contains(problems({.kind = schedule_kind::interleaved, .stages = 4, .micro_batches = 3, .virtual_stages = 2}), "use micro-batches=4"));
  CHECK(contains(problems({.kind = schedule_kind::interleaved, .stages = 4, .micro_batches = 8, .virtual_stages = 1}), "use the 1f1b schedule"));
  CHECK(contains(problems({.kind = schedule_kind::interleaved, .stages = 1, .micro_batches = 8, .virtual_stages = 2}), "at least 2 stages"));
  CHECK(contains(problems({.kind = schedule_kind::one_f_one_b, .stages = 4, .micro_batches = 8, .virtual_stages = 2}),
                 "use --schedule interleaved"));
  CHECK(contains(problems({.kind = schedule_kind::interleaved, .stages = 4, .micro_batches = 8, .virtual_stages = 3, .layers = 32}),
                 "use layers=24 or 36, or stages x virtual stages in {1, 2, 4, 8, 16, 32}"));
  CHECK(contains(problems({.kind = schedule_kind::gpipe, .stages = 0, .micro_batches = 8}), "stages=0 is invalid"));
  CHECK(contains(problems({.kind = schedule_kind::gpipe, .stages = 2, .micro_batches = 0}), "micro-batches=0 is invalid"));
  CHECK(problems({.kind = schedule_kind::interleaved, .stages = 4, .micro_batches = 8, .virtual_stages = 3, .layers = 36}).empty());
  CHECK_THROWS_WITH(wp::make_schedule({.kind = schedule_kind::interleaved, .stages = 4, .micro_batches = 6, .virtual_stages = 2}),
                    Catch::Contains("invalid interleaved schedule") && Catch::Contains("multiple of stages"));
  CHECK(contains(wp::validate(wp::costs{.forward = 1, .backward = 2, .weight = 2}), "give 0..1"));
  CHECK_THROWS_WITH(wp::verify(wp::make_schedule(wp::gpipe{}, 2, 2), {.forward = 0}), Catch::Contains("forward cost 0 is invalid"));
}

TEST_CASE("a hand-made schedule that waits for itself is a deadlock, with who waits for what", "[pipeline]") {
  wp::schedule s = wp::make_schedule(wp::one_f_one_b{}, 2, 2);
  // The last rank runs B0 before F0: it waits for its own later forward, and rank 0 for it.
  std::swap(s.ranks[1][0], s.ranks[1][1]);
  const wp::verify_report r = wp::verify(s);
  CHECK(r.problems.empty());
  CHECK_FALSE(r.deadlock_free);
  CHECK_FALSE(r.ok());
  CHECK(contains(r.waits, "rank 1 is stuck at its action 0 (B0)"));
  CHECK(contains(r.waits, "which comes later in its own list"));
  CHECK(contains(r.waits, "rank 0 is stuck"));
}

TEST_CASE("two ranks each waiting for the other's later action deadlock", "[pipeline]") {
  // Rank 0 wants B0 before sending F1; rank 1 wants F1 before sending B0.
  wp::schedule s = wp::make_schedule(wp::gpipe{}, 2, 2);
  s.ranks[0] = {wp::with_peers(s, 0, {action_kind::forward, 0}), wp::with_peers(s, 0, {action_kind::backward, 0}),
                wp::with_peers(s, 0, {action_kind::forward, 1}), wp::with_peers(s, 0, {action_kind::backward, 1})};
  s.ranks[1] = {wp::with_peers(s, 1, {action_kind::forward, 0}), wp::with_peers(s, 1, {action_kind::forward, 1}),
                wp::with_peers(s, 1, {action_kind::backward, 0}), wp::with_peers(s, 1, {action_kind::backward, 1})};
  const wp::verify_report r = wp::verify(s);
  CHECK(r.problems.empty());
  CHECK_FALSE(r.deadlock_free);
  CHECK(contains(r.waits, "rank 0 is stuck at its action 1 (B0), waiting for B0 (stage 1), action 2 of rank 1"));
  CHECK(contains(r.waits, "rank 1 is stuck at its action 1 (F1), waiting for F1 (stage 0), action 2 of rank 0"));
}

TEST_CASE("unpaired sends and receives and missing actions are reported", "[pipeline]") {
  wp::schedule s = wp::make_schedule(wp::one_f_one_b{}, 3, 2);
  s.ranks[0][0].send_to = -1;  // F0 computed but never sent
  wp::verify_report r = wp::verify(s);
  CHECK(contains(r.problems, "rank 0's F0 sends nothing, but its output is needed by rank 1"));
  CHECK(contains(r.problems, "rank 1 receives the output of F0 from rank 0, which never sends it"));

  s = wp::make_schedule(wp::one_f_one_b{}, 3, 2);
  s.ranks[1][0].send_to = 0;  // sent to the wrong rank
  r = wp::verify(s);
  CHECK(contains(r.problems, "rank 1 sends the output of F0 to rank 0, which never receives it"));

  s = wp::make_schedule(wp::one_f_one_b{}, 3, 2);
  s.ranks[2].pop_back();
  r = wp::verify(s);
  CHECK(contains(r.problems, "B1 (stage 2) is missing: add it to rank 2's list"));
  CHECK_FALSE(r.deadlock_free);
  CHECK(contains(r.waits, "which no rank runs"));

  s = wp::make_schedule(wp::one_f_one_b{}, 2, 2);
  s.ranks[0].push_back(s.ranks[0].front());
  CHECK(contains(wp::verify(s).problems, "repeats action 0 of rank 0"));
}

TEST_CASE("every generated schedule passes the verifier for small sizes", "[pipeline]") {
  for (schedule_kind kind : wp::all_schedule_kinds) {
    for (int p = 1; p <= 6; ++p) {
      for (int m = 1; m <= 13; ++m) {
        for (int v = 1; v <= 3; ++v) {
          const wp::schedule_spec spec{.kind = kind, .stages = p, .micro_batches = m, .virtual_stages = v};
          if (!wp::validate(spec).empty()) continue;
          INFO(wp::to_string(kind) << " p=" << p << " m=" << m << " v=" << v);
          const wp::verify_report r = wp::verify(wp::make_schedule(spec), {.forward = 2, .backward = 3, .weight = 1, .comm = 1});
          CHECK(r.ok());
        }
      }
    }
  }
}
