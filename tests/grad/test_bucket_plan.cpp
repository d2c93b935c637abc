// The bucket plan in one process: order, caps, padding, layout and fingerprints, checked against
// plans worked out by hand.
#include <catch2/catch.hpp>

#include <weft/grad/bucket_cap.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/reduction_schedule.hpp>

#include "../../bench/grad_sync/gpt2_shapes.hpp"

#include <algorithm>
#include <numeric>
#include <optional>
#include <vector>

using weft::grad::bucket_plan;
using weft::grad::param_spec;
using weft::grad::plan_options;

namespace {

// Registration order a, b, c, d, e with these element counts.
std::vector<param_spec> five() { return {{"a", 100}, {"b", 300}, {"c", 50}, {"d", 1000}, {"e", 10}}; }

// Caps in float elements: first bucket 200, others 400.
plan_options small_caps(std::size_t pad = 1, int dp = 1) {
  return {.bucket_bytes = 400 * 4, .first_bucket_bytes = 200 * 4, .pad_elements = pad, .dp = dp};
}

std::vector<std::vector<std::size_t>> members(const bucket_plan& plan) {
  std::vector<std::vector<std::size_t>> out;
  for (const auto& b : plan.buckets()) out.push_back(b.params);
  return out;
}

}  // namespace

TEST_CASE("buckets are formed in reverse registration order under the caps", "[grad][plan]") {
  bucket_plan plan(five(), weft::dtype::float32, small_caps());
  // Worked by hand: e (10) fits the 200-element first bucket but d (1000) does not, so e is
  // alone; d exceeds the 400 cap and gets its own bucket; c + b = 350 fit, adding a would not.
  using v = std::vector<std::size_t>;
  REQUIRE(members(plan) == std::vector<v>{v{4}, v{3}, v{2, 1}, v{0}});
  REQUIRE(plan.offset_of(4) == 0);
  REQUIRE(plan.offset_of(3) == 10);
  REQUIRE(plan.offset_of(2) == 1010);
  REQUIRE(plan.offset_of(1) == 1060);
  REQUIRE(plan.offset_of(0) == 1360);
  REQUIRE(plan.total_elements() == 1460);
  REQUIRE(plan.used_elements() == 1460);
  REQUIRE(plan.bucket_of(1) == 2);
  REQUIRE(plan.bucket_of(0) == 3);
}

TEST_CASE("a bucket closes exactly at its cap", "[grad][plan]") {
  plan_options o{.bucket_bytes = 400 * 4, .first_bucket_bytes = 400 * 4, .pad_elements = 1};
  bucket_plan plan({{"x", 100}, {"y", 200}, {"z", 200}}, weft::dtype::float32, o);
  using v = std::vector<std::size_t>;
  REQUIRE(members(plan) == std::vector<v>{v{2, 1}, v{0}});  // z + y = 400 = cap: closed, x starts anew
}

TEST_CASE("caps are in bytes of the element type", "[grad][plan]") {
  // bfloat16: the 800-byte first cap holds 400 elements, the 1600-byte cap 800.
  bucket_plan plan(five(), weft::dtype::bfloat16, small_caps());
  using v = std::vector<std::size_t>;
  REQUIRE(members(plan) == std::vector<v>{v{4}, v{3}, v{2, 1, 0}});
}

TEST_CASE("buckets are padded to multiples of lcm(pad, dp) elements", "[grad][plan]") {
  SECTION("pad 128, dp 2: unit 128") {
    bucket_plan plan(five(), weft::dtype::float32, small_caps(128, 2));
    REQUIRE(plan.padding_unit() == 128);
    std::vector<std::size_t> counts, offsets, used;
    for (const auto& b : plan.buckets()) {
      counts.push_back(b.count);
      offsets.push_back(b.offset);
      used.push_back(b.used);
    }
    REQUIRE(counts == std::vector<std::size_t>{128, 1024, 384, 128});
    REQUIRE(offsets == std::vector<std::size_t>{0, 128, 1152, 1536});
    REQUIRE(used == std::vector<std::size_t>{10, 1000, 350, 100});
    REQUIRE(plan.total_elements() == 1664);
    REQUIRE(plan.used_elements() == 1460);
    REQUIRE(plan.offset_of(1) == 1152 + 50);
  }
  SECTION("pad 128, dp 3: unit 384") {
    bucket_plan plan(five(), weft::dtype::float32, small_caps(128, 3));
    REQUIRE(plan.padding_unit() == 384);
    for (const auto& b : plan.buckets()) REQUIRE(b.count % 384 == 0);
    REQUIRE(plan.buckets()[1].count == 1152);
  }
  SECTION("no padding but dp 4: multiples of 4, so buckets shard evenly") {
    bucket_plan plan(five(), weft::dtype::float32, small_caps(1, 4));
    std::vector<std::size_t> counts;
    for (const auto& b : plan.buckets()) counts.push_back(b.count);
    REQUIRE(counts == std::vector<std::size_t>{12, 1000, 352, 100});
    auto [offset, length] = plan.buckets()[2].shard(3, 4);
    REQUIRE(offset == 12 + 1000 + 3 * 88);
    REQUIRE(length == 88);
  }
}

TEST_CASE("GPT-2 small with the default caps", "[grad][plan]") {
  std::vector<param_spec> specs;
  for (const auto& s : weft_bench::gpt2_small_shapes()) specs.push_back({s.name, s.count()});
  REQUIRE(specs.size() == 148);
  bucket_plan plan(specs, weft::dtype::float32, plan_options{.dp = 2});
  REQUIRE(plan.used_elements() == 124'439'808);
  const std::size_t cap = (std::size_t{25} << 20) / 4;

  // Every parameter is in exactly one bucket, the buckets tile the buffer, and parameters lie in
  // the buffer in reverse registration order.
  std::vector<int> seen(specs.size(), 0);
  std::size_t at = 0;
  for (std::size_t b = 0; b < plan.buckets().size(); ++b) {
    const auto& k = plan.buckets()[b];
    REQUIRE(k.offset == at);
    REQUIRE(k.count % 128 == 0);
    REQUIRE(k.count - k.used < 128);
    std::size_t used = 0;
    for (std::size_t p : k.params) {
      ++seen[p];
      REQUIRE(plan.bucket_of(p) == b);
      REQUIRE(plan.offset_of(p) == k.offset + used);
      used += specs[p].count;
    }
    REQUIRE(used == k.used);
    if (k.params.size() > 1) REQUIRE(k.used <= (b == 0 ? cap / 25 : cap));
    at += k.count;
  }
  REQUIRE(at == plan.total_elements());
  REQUIRE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  for (std::size_t p = 1; p < specs.size(); ++p) REQUIRE(plan.offset_of(p) < plan.offset_of(p - 1));

  // The first bucket starts with ln_f.bias; wte (38.6 M elements, over the cap) is alone.
  REQUIRE(plan.buckets().front().params.front() == 147);
  std::size_t wte = plan.bucket_of(0);
  REQUIRE(plan.buckets()[wte].params == std::vector<std::size_t>{0});
}

TEST_CASE("fingerprints change with anything that changes the plan", "[grad][plan]") {
  const auto base = bucket_plan(five(), weft::dtype::float32, small_caps()).fingerprint();
  REQUIRE(bucket_plan(five(), weft::dtype::float32, small_caps()).fingerprint() == base);

  auto renamed = five();
  renamed[2].name = "c2";
  REQUIRE(bucket_plan(renamed, weft::dtype::float32, small_caps()).fingerprint() != base);
  auto resized = five();
  resized[0].count = 101;
  REQUIRE(bucket_plan(resized, weft::dtype::float32, small_caps()).fingerprint() != base);
  auto swapped = five();
  std::swap(swapped[0], swapped[1]);
  REQUIRE(bucket_plan(swapped, weft::dtype::float32, small_caps()).fingerprint() != base);
  REQUIRE(bucket_plan(five(), weft::dtype::bfloat16, small_caps()).fingerprint() != base);
  REQUIRE(bucket_plan(five(), weft::dtype::float32, small_caps(128)).fingerprint() != base);
  REQUIRE(bucket_plan(five(), weft::dtype::float32, small_caps(1, 2)).fingerprint() != base);
  auto cap = small_caps();
  cap.bucket_bytes += 4;
  REQUIRE(bucket_plan(five(), weft::dtype::float32, cap).fingerprint() != base);
}

TEST_CASE("bad plans are rejected with a reason", "[grad][plan]") {
  REQUIRE_THROWS_WITH(bucket_plan({{"a", 10}, {"empty", 0}}, weft::dtype::float32, {}),
                      Catch::Contains("'empty'") && Catch::Contains("0 elements"));
  REQUIRE_THROWS_WITH(bucket_plan(five(), weft::dtype::float32, {.bucket_bytes = 0}),
                      Catch::Contains("bucket_bytes is 0"));
  REQUIRE_THROWS_WITH(bucket_plan(five(), weft::dtype::float32, {.dp = 0}), Catch::Contains("dp is 0"));
}

TEST_CASE("describe() names every bucket", "[grad][plan]") {
  bucket_plan plan(five(), weft::dtype::float32, small_caps());
  std::string text = plan.describe();
  REQUIRE_THAT(text, Catch::Contains("4 buckets") && Catch::Contains("bucket 2") && Catch::Contains("c .. b"));
}

TEST_CASE("the reduction schedule issues buckets in bucket order, whatever order parameters are marked in",
          "[grad][plan]") {
  bucket_plan plan(five(), weft::dtype::float32, small_caps());  // buckets {e}, {d}, {c, b}, {a}
  weft::grad::reduction_schedule s(plan, 5, 2);
  REQUIRE_FALSE(s.reduces_this_micro_step());
  for (std::size_t p = 0; p < 5; ++p) REQUIRE_FALSE(s.mark(p, false));  // the first micro-step reduces nothing
  REQUIRE_FALSE(s.next_issuable());
  s.end_micro_step(false);
  REQUIRE(s.micro_step() == 1);
  REQUIRE(s.reduces_this_micro_step());
  REQUIRE(s.marked_count() == 0);
  // Bucket 2 (c, b) completes first, but bucket 0 (e) has not been issued: nothing may go.
  REQUIRE_FALSE(s.mark(2, true));
  REQUIRE(s.mark(1, true));
  REQUIRE_FALSE(s.next_issuable());
  REQUIRE(s.mark(4, true));
  REQUIRE(s.next_issuable() == std::optional<std::size_t>(0));
  s.issued();
  REQUIRE_FALSE(s.next_issuable());  // bucket 1 (d) is not complete
  REQUIRE(s.unmarked() == std::vector<std::size_t>{0, 3});
  REQUIRE(s.next_unissued() == std::optional<std::size_t>(1));
  REQUIRE(s.mark(3, true));
  REQUIRE(s.next_issuable() == std::optional<std::size_t>(1));
  s.issued();
  REQUIRE(s.next_issuable() == std::optional<std::size_t>(2));
  s.issued();
  REQUIRE_FALSE(s.next_issuable());  // bucket 3 (a) is not marked
  REQUIRE(s.issued_count() == 3);
  s.end_micro_step(false);
  REQUIRE(s.micro_step() == 0);
  REQUIRE(s.issued_count() == 0);
  // A failure ends the window: the next micro-step begins a new one.
  s.end_micro_step(false);
  REQUIRE(s.micro_step() == 1);
  s.end_micro_step(true);
  REQUIRE(s.micro_step() == 0);
}

TEST_CASE("a window's scale factor and the ZeRO-1 shards", "[grad][plan]") {
  using weft::grad::scaling;
  using weft::grad::window_scale_factor;
  REQUIRE(window_scale_factor(scaling::mean, 4, 2, std::nullopt) == 1.0 / 8);
  REQUIRE(window_scale_factor(scaling::sum, 4, 2, std::nullopt) == 1.0);
  REQUIRE_FALSE(window_scale_factor(scaling::token_count, 4, 2, std::nullopt));
  REQUIRE(window_scale_factor(scaling::token_count, 4, 2, 64.0) == 1.0 / 64);

  const std::vector<param_spec> params = five();
  bucket_plan plan(params, weft::dtype::float32, small_caps(4, 2));
  std::size_t covered = 0;
  for (int rank = 0; rank < 2; ++rank) {
    const auto ranges = weft::grad::shard_ranges_of(plan, rank, 2);
    REQUIRE(ranges.size() == plan.buckets().size());
    for (const auto& r : ranges) {
      REQUIRE(r.count * 2 == plan.buckets()[r.bucket].count);
      REQUIRE(r.offset == plan.buckets()[r.bucket].offset + static_cast<std::size_t>(rank) * r.count);
    }
    // Runs of one parameter each, inside that parameter and inside this rank's shard.
    for (const auto& seg : weft::grad::shard_segments_of(plan, params, rank, 2)) {
      REQUIRE(seg.buffer_offset == plan.offset_of(seg.param) + seg.param_offset);
      REQUIRE(seg.param_offset + seg.count <= params[seg.param].count);
      covered += seg.count;
    }
  }
  // The two ranks' segments cover every parameter element once (padding excluded).
  REQUIRE(covered == 100 + 300 + 50 + 1000 + 10);
}

namespace {

/// The probe's search run on a synthetic curve: a call of b bytes takes b / bandwidth(b) seconds,
/// and the first step pays one more call (the probe's untimed first call).
struct simulated_probe {
  weft::grad::bucket_size_choice choice;
  std::vector<std::size_t> order;  // the sizes in the order they were timed
};
template <class Bandwidth>
simulated_probe simulate_probe(std::size_t gradient_bytes, const weft::grad::probe_options& o, Bandwidth bandwidth) {
  weft::grad::probe_search search(gradient_bytes, o);
  simulated_probe out;
  while (const auto step = search.next()) {
    const double per_call = static_cast<double>(step->bytes) / bandwidth(step->bytes);
    const double calls = static_cast<double>(step->calls * static_cast<std::size_t>(step->runs)) + (out.order.empty() ? 1 : 0);
    search.record(*step, per_call, per_call * calls);
    out.order.push_back(step->bytes);
  }
  if (!out.order.empty()) out.choice = search.choice();
  return out;
}

constexpr std::size_t probe_mib = std::size_t{1} << 20;

}  // namespace

TEST_CASE("the probe finds a bandwidth drop within its budget, on synthetic curves", "[grad][plan][probe]") {
  const weft::grad::probe_options o;  // 0.2 s, 256 KiB up to 128 MiB, 8 MiB runs
  const std::size_t gpt2 = 124439808 * sizeof(float);
  SECTION("4 ranks' speed, slower past 32 MiB: 16 MiB, where doubling from 256 KiB stopped at 2 MiB") {
    // (the probe that doubled upwards, 32 MiB of calls a size, spent the budget on 256 KiB - 2 MiB)
    auto curve = [](std::size_t b) { return b < probe_mib ? 0.6e9 : b <= 32 * probe_mib ? 0.72e9 : 0.55e9; };
    const auto run = simulate_probe(gpt2, o, curve);
    REQUIRE(run.choice.bucket_bytes == 16 * probe_mib);
    // 32 MiB three times does not fit in what is left of 0.2 s at this speed: larger sizes are
    // not timed, and the choice says so.
    REQUIRE(run.choice.budget_ended_below_knee);
    REQUIRE(run.choice.seconds_spent <= o.budget_s);
    // The first size is the first one call times; four times larger does not fit, so the largest that does.
    REQUIRE(run.order.front() == 8 * probe_mib);
    REQUIRE(run.order.at(1) == 16 * probe_mib);
    // Every size at most the gradients' own (128 MiB here, the probe's limit).
    for (std::size_t b : run.order) REQUIRE(b <= o.largest_bytes);
  }
  SECTION("2 ranks' speed, slower past 32 MiB: bracketed and bisected to 32 MiB") {
    auto curve = [](std::size_t b) { return b <= 32 * probe_mib ? 2.0e9 : 1.6e9; };
    const auto run = simulate_probe(gpt2, o, curve);
    REQUIRE(run.choice.bucket_bytes == 32 * probe_mib);
    REQUIRE(run.choice.best_bytes <= 32 * probe_mib);
    REQUIRE(run.choice.seconds_spent <= o.budget_s);
    REQUIRE(std::find(run.order.begin(), run.order.end(), 64 * probe_mib) != run.order.end());
    REQUIRE_FALSE(run.choice.budget_ended_below_knee);  // 64 MiB was timed, and slower
    REQUIRE(std::is_sorted(run.choice.curve.begin(), run.choice.curve.end(),
                           [](const auto& a, const auto& b) { return a.bytes < b.bytes; }));
  }
  SECTION("small sizes faster per byte than the rest: the rule still takes the largest within 5 % of the best") {
    auto curve = [](std::size_t b) { return b <= 2 * probe_mib ? 2.0e9 : 1.0e9; };
    const auto run = simulate_probe(64 * probe_mib, {.budget_s = 10}, curve);
    REQUIRE(run.choice.curve.size() == 9);  // 256 KiB .. 64 MiB, all timed with this budget
    REQUIRE(run.choice.bucket_bytes == 2 * probe_mib);
  }
  SECTION("the budget ends before the curve drops: the largest timed size, and the choice says so") {
    weft::grad::probe_options short_budget;
    short_budget.budget_s = 0.05;
    auto flat = [](std::size_t) { return 0.72e9; };
    const auto run = simulate_probe(gpt2, short_budget, flat);
    REQUIRE(run.choice.bucket_bytes == 8 * probe_mib);
    REQUIRE(run.choice.budget_ended_below_knee);
    REQUIRE(run.choice.seconds_spent <= short_budget.budget_s);
    REQUIRE_THAT(run.choice.describe(), Catch::Contains("budget ended"));
  }
  SECTION("the first size always runs, whatever the budget") {
    const auto run = simulate_probe(gpt2, {.budget_s = 0}, [](std::size_t) { return 1e9; });
    REQUIRE(run.order == std::vector<std::size_t>{8 * probe_mib});
  }
  SECTION("the gradients' size bounds the sizes, and is one of them") {
    const auto run = simulate_probe(20 * probe_mib, {.budget_s = 10}, [](std::size_t) { return 1e9; });
    REQUIRE(*std::max_element(run.order.begin(), run.order.end()) == 20 * probe_mib);
    REQUIRE(run.choice.bucket_bytes == 20 * probe_mib);
    // Smaller than one run: the first size is the largest, timed in one call.
    const auto small = simulate_probe(3 * probe_mib, {.budget_s = 10}, [](std::size_t) { return 1e9; });
    REQUIRE(small.order.front() == 3 * probe_mib);
    REQUIRE(small.choice.curve.size() == 5);  // 256 KiB .. 2 MiB, 3 MiB
  }
  SECTION("gradients smaller than the smallest size: nothing to time") {
    REQUIRE(weft::grad::probe_search(100 * 1024, {}).sizes().empty());
    REQUIRE_FALSE(weft::grad::probe_search(100 * 1024, {}).next());
  }
  SECTION("sizes in whole granules, and bad options refused") {
    weft::grad::probe_search search(1000, {.smallest_bytes = 100}, 48);
    REQUIRE(std::vector<std::size_t>(search.sizes().begin(), search.sizes().end()) ==
            std::vector<std::size_t>{144, 240, 432, 816, 1008});
    REQUIRE_THROWS_WITH(weft::grad::probe_search(1000, {.smallest_bytes = 0}), Catch::Contains("smallest_bytes"));
    REQUIRE_THROWS_WITH(weft::grad::probe_search(1000, {.repeats = 0}), Catch::Contains("repeats"));
    REQUIRE_THROWS_WITH(weft::grad::probe_search(1000, {.tolerance = 1}), Catch::Contains("tolerance"));
  }
}
