// Pipeline schedules: the generators' tables, the verifier's figures against the papers' formulas
// over many random (p, m, v) and costs, the refused configurations, and deadlocks in broken tables.
#include <catch2/catch.hpp>

#include <weft/core/error.hpp>
#include <weft/pipeline/activation_slots.hpp>
#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule.hpp>
#include <weft/pipeline/schedule_kind.hpp>
#include <weft/pipeline/schedules.hpp>
#include <weft/pipeline/theory.hpp>
#include <weft/pipeline/verify.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
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

// The most micro-batches of `rank` whose forward has run and whose backward has not: the whole
// activations, which a split schedule frees with B, keeping only what W needs.
int peak_before_backward(const wp::schedule& s, int rank) {
  int held = 0, peak = 0;
  for (const wp::action& a : s.ranks[static_cast<std::size_t>(rank)]) {
    if (a.kind == action_kind::forward) peak = std::max(peak, ++held);
    if (a.kind == action_kind::backward) --held;
  }
  return peak;
}

// Calls f(spec) for every valid spec of every schedule kind with p stages from `first_stages`
// to 6, 1-13 micro-batches and 1-3 virtual stages (a Catch2 INFO names it).
template <class F>
void for_small_specs(int first_stages, F&& f) {
  for (schedule_kind kind : wp::all_schedule_kinds)
    for (int p = first_stages; p <= 6; ++p)
      for (int m = 1; m <= 13; ++m)
        for (int v = 1; v <= 3; ++v) {
          const wp::schedule_spec spec{.kind = kind, .stages = p, .micro_batches = m, .virtual_stages = v};
          if (!wp::validate(spec).empty()) continue;
          INFO(wp::to_string(kind) << " p=" << p << " m=" << m << " v=" << v);
          f(spec);
        }
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
      CHECK(r.bubble_fraction == Approx(*wp::theory_bubble_fraction(d.spec)).epsilon(0).margin(1e-12));
      for (int stage = 0; stage < d.spec.stages; ++stage) CHECK(r.peak_in_flight[static_cast<std::size_t>(stage)] == wp::theory_peak_in_flight(d.spec, stage));
      ++checked;
    }
  }
  CHECK(checked == 450);
}

TEST_CASE("deep and long pipelines: simulation, exchange plans and transfers stay exact", "[pipeline]") {
  // Sizes where a sweep over every rank per simulated step (quadratic in stages) or a search of a
  // sender's whole list per message (quadratic in micro-batches) once made verify take seconds.
  const wp::costs c{};
  const wp::schedule_spec specs[] = {{.kind = schedule_kind::gpipe, .stages = 4096, .micro_batches = 1},
                                     {.kind = schedule_kind::one_f_one_b, .stages = 2048, .micro_batches = 3},
                                     {.kind = schedule_kind::one_f_one_b, .stages = 4, .micro_batches = 8192},
                                     {.kind = schedule_kind::interleaved, .stages = 64, .micro_batches = 64, .virtual_stages = 4}};
  for (const wp::schedule_spec& spec : specs) {
    INFO(wp::to_string(spec.kind) << " p=" << spec.stages << " m=" << spec.micro_batches << " v=" << spec.virtual_stages);
    const wp::schedule s = wp::make_schedule(spec);
    const wp::verify_report r = wp::verify(s, c);
    REQUIRE(r.ok());
    CHECK(r.makespan == *wp::theory_makespan(spec, c));
    int wrong_peaks = 0;
    for (int stage = 0; stage < spec.stages; ++stage)
      wrong_peaks += r.peak_in_flight[static_cast<std::size_t>(stage)] != wp::theory_peak_in_flight(spec, stage) ? 1 : 0;
    CHECK(wrong_peaks == 0);
    for (const int rank : {0, 1, spec.stages / 2, spec.stages - 1}) {
      const wp::detail::exchange_plan plan = wp::detail::plan_exchange(s, rank);
      std::size_t received = 0, sent_here = 0;
      for (const wp::action& a : s.ranks[static_cast<std::size_t>(rank)]) received += a.recv_from >= 0 && a.kind != action_kind::weight ? 1 : 0;
      for (const auto& theirs : s.ranks)
        for (const wp::action& a : theirs) sent_here += a.send_to == rank ? 1 : 0;
      CHECK(plan.from.size() <= 2);  // the neighbours in the chunk order
      CHECK(plan.receives == received);
      std::size_t listed = 0;
      for (const wp::detail::inbound_channel& channel : plan.from) listed += channel.messages.size();
      CHECK(listed == sent_here);
    }
  }
}

TEST_CASE("ZB-H1's makespan is the paper's, within 1F1B's activation memory", "[pipeline]") {
  // F and B in 1F1B's order, so at most 1F1B's micro-batches on each stage before their B, and on
  // every stage at most 1F1B's largest count (stage 0's) before their W.
  auto check_memory = [](const wp::schedule_spec& spec, const wp::verify_report& zb, const wp::verify_report& one) {
    const wp::schedule s = wp::make_schedule(spec);
    for (int stage = 0; stage < spec.stages; ++stage) {
      const auto r = static_cast<std::size_t>(stage);
      CHECK(zb.peak_in_flight[r] == wp::theory_peak_in_flight(spec, stage));
      CHECK(zb.peak_in_flight[r] == one.peak_in_flight.front());
      CHECK(peak_before_backward(s, stage) == one.peak_in_flight[r]);
    }
  };
  int formula = 0, paper = 0, fewer = 0;
  for (const drawn& d : draw(schedule_kind::zb_h1, 300, 7)) {
    const std::int64_t p = d.spec.stages, m = d.spec.micro_batches, F = d.costs.forward, B = d.costs.backward, W = d.costs.weight;
    INFO("p=" << p << " m=" << m << " F=" << F << " B=" << B << " W=" << W);
    const wp::verify_report zb = wp::verify(wp::make_schedule(d.spec), d.costs);
    const wp::verify_report one = wp::verify(wp::make_schedule(wp::one_f_one_b{}, d.spec.stages, d.spec.micro_batches), d.costs);
    REQUIRE(zb.ok());
    CHECK(zb.busy == one.busy);  // the same work, split differently
    check_memory(d.spec, zb, one);
    // Never slower than 1F1B; faster as soon as there is a weight gradient to move.
    if (W > 0 && p > 1) {
      CHECK(zb.makespan < one.makespan);
    } else {
      CHECK(zb.makespan == one.makespan);
    }
    const std::optional<std::int64_t> theory = wp::theory_makespan(d.spec, d.costs);
    CHECK(theory.has_value() == (m >= p));
    if (!theory) {
      ++fewer;
      continue;
    }
    CHECK(zb.makespan == *theory);
    CHECK(zb.bubble_fraction == Approx(1.0 - static_cast<double>(m * (F + B)) / static_cast<double>(*theory)).epsilon(0).margin(1e-12));
    ++formula;
    // The paper's case: the weight gradient costs no more than the forward or the input gradient.
    if (W <= F && W <= B - W) {
      CHECK(zb.makespan == m * (F + B) + (p - 1) * (F + B - 2 * W));
      ++paper;
    }
  }
  CHECK(formula > 100);
  CHECK(paper > 30);
  CHECK(fewer > 10);

  // Every small configuration with m >= p, every cost up to 4.
  for (int p = 1; p <= 6; ++p) {
    for (int m = p; m <= 14; ++m) {
      const wp::schedule_spec spec{.kind = schedule_kind::zb_h1, .stages = p, .micro_batches = m};
      const wp::schedule s = wp::make_schedule(spec);
      for (std::int64_t f = 1; f <= 4; ++f) {
        for (std::int64_t input = 1; input <= 4; ++input) {
          for (std::int64_t w = 0; w <= 4; ++w) {
            const wp::costs c{.forward = f, .backward = input + w, .weight = w};
            INFO("p=" << p << " m=" << m << " F=" << f << " B=" << input + w << " W=" << w);
            const wp::verify_report r = wp::verify(s, c);
            REQUIRE(r.ok());
            CHECK(r.makespan == *wp::theory_makespan(spec, c));
          }
        }
      }
    }
  }

  // The paper's figure 3: p = 4, m = 8, F = B_input = W = 1, so B = 2. 1F1B idles 3(F + B) = 9 per
  // stage, ZB-H1 3(F + B - 2W) = 3: makespan 27 against 33.
  const wp::schedule s = wp::make_schedule(wp::zb_h1{}, 4, 8);
  const wp::verify_report r = wp::verify(s, {.forward = 1, .backward = 2, .weight = 1});
  CHECK(r.makespan == 8 * 3 + 3 * 1);
  CHECK(r.peak_in_flight == std::vector<int>{4, 4, 4, 4});
  // Stage 0 runs 1F1B with each W right after its B; stage 3 holds three Ws back for the tail.
  auto listing = [&](int rank) {
    std::string text;
    for (const wp::action& a : s.ranks[static_cast<std::size_t>(rank)]) text += (text.empty() ? "" : " ") + wp::short_name(a, 1);
    return text;
  };
  CHECK(listing(0) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7");
  CHECK(listing(3) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7");
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
  for_small_specs(1, [](const wp::schedule_spec& spec) {
    const wp::verify_report r = wp::verify(wp::make_schedule(spec), {.forward = 2, .backward = 3, .weight = 1, .comm = 1});
    CHECK(r.ok());
  });
}

namespace {

// The fewest slots a chunk for activations kept at slot mb % n, found another way: each
// (micro-batch, chunk) pair's lifetime as an interval of the rank's action positions, and the
// smallest n for which no two overlapping intervals of one chunk have micro-batches equal mod n.
int slots_by_intervals(const wp::schedule& s, int rank) {
  struct life {
    int mb, chunk, begin, end;
  };
  std::vector<life> lives;
  const std::vector<wp::action>& actions = s.ranks[static_cast<std::size_t>(rank)];
  for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
    const wp::action& a = actions[static_cast<std::size_t>(i)];
    if (a.kind == action_kind::forward) lives.push_back({a.micro_batch, a.chunk, i, static_cast<int>(actions.size())});
    const bool frees = s.split_backward ? a.kind == action_kind::weight : a.kind == action_kind::backward;
    if (frees)
      for (life& l : lives)
        if (l.mb == a.micro_batch && l.chunk == a.chunk) l.end = i;
  }
  for (int n = 1;; ++n) {
    bool clash = false;
    for (const life& x : lives)
      for (const life& y : lives)
        clash = clash || (x.mb != y.mb && x.chunk == y.chunk && x.mb % n == y.mb % n && x.begin < y.end && y.begin < x.end);
    if (!clash) return n;
  }
}

}  // namespace

TEST_CASE("activation slots by micro-batch: the fewest with no two in-flight micro-batches in one slot", "[pipeline]") {
  for_small_specs(1, [](const wp::schedule_spec& spec) {
    const wp::schedule s = wp::make_schedule(spec);
    const int p = spec.stages, m = spec.micro_batches;
    for (int stage = 0; stage < p; ++stage) {
      INFO("stage " << stage);
      const int slots = wp::slots_by_micro_batch(s, stage);
      CHECK(slots == slots_by_intervals(s, stage));
      // The schedules' closed forms (schedules.hpp): GPipe holds every micro-batch, 1F1B
      // p - s on stage s, ZB-H1 min(p, m) on every stage (its Ws in micro-batch order).
      if (spec.kind == schedule_kind::gpipe) CHECK(slots == m);
      if (spec.kind == schedule_kind::one_f_one_b) CHECK(slots == std::min(p - stage, m));
      if (spec.kind == schedule_kind::zb_h1) CHECK(slots == std::min(p, m));
      // Never more than the pairs in flight at once (their micro-batches are consecutive).
      CHECK(slots <= wp::verify(s).peak_in_flight[static_cast<std::size_t>(stage)]);
    }
  });
}

TEST_CASE("activation slots: micro-batches in flight out of order need more slots than the peak", "[pipeline]") {
  // One stage: F0 F1 F2 B1 F3 B0 B2 B3. Three in flight at most, but after B1 frees slot 1 of 3,
  // F3 would land in slot 0, still mb 0's: 4 slots (then every micro-batch has its own).
  wp::schedule s = wp::make_schedule(wp::gpipe{}, 1, 4);
  using wp::action;
  s.ranks[0] = {action{.kind = action_kind::forward, .micro_batch = 0}, action{.kind = action_kind::forward, .micro_batch = 1},
                action{.kind = action_kind::forward, .micro_batch = 2}, action{.kind = action_kind::backward, .micro_batch = 1},
                action{.kind = action_kind::forward, .micro_batch = 3}, action{.kind = action_kind::backward, .micro_batch = 0},
                action{.kind = action_kind::backward, .micro_batch = 2}, action{.kind = action_kind::backward, .micro_batch = 3}};
  CHECK(wp::verify(s).peak_in_flight[0] == 3);
  CHECK(wp::slots_by_micro_batch(s, 0) == 4);
  CHECK(slots_by_intervals(s, 0) == 4);
  // F0 F1 B0 F2 B1 B2: consecutive in flight, two slots.
  s.micro_batches = 3;
  s.ranks[0] = {action{.kind = action_kind::forward, .micro_batch = 0}, action{.kind = action_kind::forward, .micro_batch = 1},
                action{.kind = action_kind::backward, .micro_batch = 0}, action{.kind = action_kind::forward, .micro_batch = 2},
                action{.kind = action_kind::backward, .micro_batch = 1}, action{.kind = action_kind::backward, .micro_batch = 2}};
  CHECK(wp::slots_by_micro_batch(s, 0) == 2);
  CHECK_THROWS_WITH(wp::slots_by_micro_batch(s, 1), Catch::Contains("rank 1 is not a stage of a schedule of 1 stages"));
  s.ranks[0][5].micro_batch = 7;
  CHECK_THROWS_WITH(wp::slots_by_micro_batch(s, 0), Catch::Contains("stage 0 has B7, outside 3 micro-batches"));
}

// Sends that wait for their receivers (NCCL once a tensor outgrows its buffers; MPI past its eager
// limit), each rank's transfers in posting order on one stream. The executor's order before
// batching (each send and receive alone) deadlocks 1F1B, ZB-H1 and interleaved whenever m >= 2:
// stage p-2 sends a1 (after F1, its one warm-up forward beyond F0) before it receives g0, while
// stage p-1 sends g0 (after B0) before it receives a1. gpipe never sends a gradient before every
// activation is through, so it never deadlocks. The expected sets come from that argument, not
// from the simulation. Megatron-LM's same-peer pairing is enough for 1F1B and ZB-H1 but not for
// interleaved on 2 stages; the executor's timeline batches deadlock nothing.
TEST_CASE("rendezvous sends: the unbatched order deadlocks 1F1B, ZB-H1 and interleaved; the executor's nothing",
          "[pipeline]") {
  using grouping = wp::detail::transfer_grouping;
  int separate_deadlocks = 0, checked = 0;
  for_small_specs(2, [&](const wp::schedule_spec& spec) {
    const wp::schedule s = wp::make_schedule(spec);
    const wp::transfer_report executor_order = wp::verify_transfers(s);  // grouping::timeline
    CHECK(executor_order.problems.empty());
    CHECK(executor_order.deadlock_free);
    CHECK(executor_order.waits.empty());
    CHECK(wp::verify(s).ok());  // what the executor checks before it sends anything
    const wp::transfer_report separate = wp::verify_transfers(s, grouping::separate);
    CHECK(separate.problems.empty());
    const bool sends_face_each_other = spec.kind != schedule_kind::gpipe && spec.micro_batches >= 2;
    CHECK(separate.deadlock_free == !sends_face_each_other);
    if (!separate.deadlock_free) {
      ++separate_deadlocks;
      CHECK_FALSE(separate.waits.empty());
    }
    if (spec.kind != schedule_kind::interleaved) CHECK(wp::verify_transfers(s, grouping::per_peer).deadlock_free);
    ++checked;
  });
  CHECK(separate_deadlocks > 100);
  CHECK(checked > separate_deadlocks);
  const wp::schedule interleaved = wp::make_schedule({.kind = schedule_kind::interleaved, .stages = 2, .micro_batches = 4, .virtual_stages = 2});
  CHECK_FALSE(wp::verify_transfers(interleaved, grouping::per_peer).deadlock_free);
}

TEST_CASE("rendezvous sends: the deadlock of the unbatched 1F1B order names who waits for whom", "[pipeline]") {
  const wp::schedule s = wp::make_schedule(wp::one_f_one_b{}, 2, 2);
  const wp::transfer_report r = wp::verify_transfers(s, wp::detail::transfer_grouping::separate);
  REQUIRE_FALSE(r.deadlock_free);
  // Rank 0 sends a1 (the input of F1 on rank 1) before it receives g0; rank 1 sends g0 first.
  CHECK(contains(r.waits, "rank 0 is stuck in its transfers before its action 2 (B0): its send of the input of F1 on rank 1 "
                          "waits for rank 1's receive, posted before its action 2 (F1), while rank 1 is stuck in its "
                          "transfers before its action 2 (F1)"));
  CHECK(contains(r.waits, "rank 1 is stuck in its transfers before its action 2 (F1): its send of the input of B0 on rank 0"));
  // Receives posted ahead sit before this stage's later sends on a stream: gpipe on 2 stages.
  const wp::transfer_report ahead =
      wp::verify_transfers(wp::make_schedule(wp::gpipe{}, 2, 2), wp::detail::transfer_grouping::timeline, 1);
  CHECK_FALSE(ahead.deadlock_free);
}
