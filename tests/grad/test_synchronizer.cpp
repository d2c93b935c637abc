// The synchronizer on a real group: identical plans, bucket-ordered reductions whatever the ready
// order, bytes per optimizer step, precision and hooks, the step report, and every error case.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/synchronizer.hpp>

#include "dp_group.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <stdexcept>
#include <string_view>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

using weft::grad::scaling;
using weft::grad::synchronizer;

namespace {

// Parameter p has 3 + 5p elements (with a few large ones), so plans have buckets of 1 to several
// parameters.
std::size_t size_of_param(std::size_t p) { return p % 7 == 3 ? 300 + p : 3 + 5 * p; }

// Rank r's gradient of parameter p at element i: small integers, exact in every type we use.
double contribution(int rank, std::size_t p, std::size_t i) {
  return static_cast<double>(rank + 1) + static_cast<double>((p + i) % 7);
}
double summed(int ranks, std::size_t p, std::size_t i) {
  double s = 0;
  for (int r = 0; r < ranks; ++r) s += contribution(r, p, i);
  return s;
}

template <class T>
void register_params(synchronizer<weft::mpi_backend, T>& sync, std::size_t n) {
  for (std::size_t p = 0; p < n; ++p) sync.add_param("layer" + std::to_string(p), size_of_param(p));
  sync.freeze();
}

template <class T>
void fill(synchronizer<weft::mpi_backend, T>& sync, int rank, std::size_t p) {
  auto g = sync.grad(p);
  for (std::size_t i = 0; i < g.size(); ++i) g[i] = T(static_cast<float>(contribution(rank, p, i)));
}

std::vector<std::int64_t> all_gather_world(std::int64_t mine) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<std::int64_t> all(static_cast<std::size_t>(size));
  MPI_Allgather(&mine, 1, MPI_INT64_T, all.data(), 1, MPI_INT64_T, MPI_COMM_WORLD);
  return all;
}

}  // namespace

TEST_CASE("every rank plans the same buckets", "[grad][sync]") {
  auto dp = dp_group();
  synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 512, .first_bucket_bytes = 64});
  register_params(sync, 40);
  const auto& plan = sync.plan();
  REQUIRE(plan.buckets().size() > 5);
  // Compare the plans themselves, not only their fingerprints: every bucket's place and members.
  std::uint64_t layout = plan.fingerprint();
  for (const auto& b : plan.buckets()) {
    layout = layout * 1000003u + b.offset;
    layout = layout * 1000003u + b.count;
    for (std::size_t p : b.params) layout = layout * 1000003u + p;
  }
  for (std::int64_t other : all_gather_world(static_cast<std::int64_t>(layout)))
    REQUIRE(other == static_cast<std::int64_t>(layout));
  for (std::int64_t other : all_gather_world(static_cast<std::int64_t>(plan.fingerprint())))
    REQUIRE(other == static_cast<std::int64_t>(plan.fingerprint()));
  for (const auto& b : plan.buckets()) REQUIRE(b.count % static_cast<std::size_t>(dp.size()) == 0);
}

TEST_CASE("ranks marking gradients in different orders still reduce correctly", "[grad][sync]") {
  auto dp = dp_group();
  const std::size_t n = 40;
  synchronizer<weft::mpi_backend> sync(
      dp, {.bucket_bytes = 256, .first_bucket_bytes = 32, .scale = scaling::sum, .warn_if_not_overlapped = false});
  register_params(sync, n);
  std::mt19937 random(1234u + static_cast<unsigned>(dp.rank()));  // a different order on every rank
  for (int step = 0; step < 3; ++step) {
    std::vector<std::size_t> order(n);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), random);
    for (std::size_t p : order) {
      fill(sync, dp.rank(), p);
      sync.mark_ready(p);
    }
    REQUIRE(sync.finish());
    for (std::size_t p = 0; p < n; ++p) {
      auto g = sync.grad(p);
      for (std::size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == static_cast<float>(summed(dp.size(), p, i)));
    }
    // Bucket order, not ready order: the issue times are non-decreasing in bucket index.
    const auto& report = sync.last_report();
    REQUIRE(report.buckets.size() == sync.plan().buckets().size());
    for (std::size_t b = 1; b < report.buckets.size(); ++b)
      REQUIRE(report.buckets[b].start_s >= report.buckets[b - 1].start_s);
    sync.zero_grad();
  }
}

TEST_CASE("with an accumulation window of 8, one optimizer step communicates one buffer", "[grad][sync]") {
  auto dp = dp_group();
  const int k = 8;
  synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 1024, .first_bucket_bytes = 128, .accumulation_steps = k,
                                            .warn_if_not_overlapped = false});
  register_params(sync, 30);
  const std::size_t buffer_bytes = sync.plan().total_elements() * sizeof(float);
  for (int step = 0; step < 2; ++step) {
    auto before = dp.stats();
    for (int j = 0; j < k; ++j) {
      for (std::size_t p = 30; p-- > 0;) {
        fill(sync, dp.rank(), p);  // overwritten each micro-step: only the last one's values remain
        sync.mark_ready(p);
      }
      if (j < k - 1) REQUIRE(dp.stats().bytes == before.bytes);
      sync.finish();
    }
    auto after = dp.stats();
    REQUIRE(after.bytes - before.bytes == buffer_bytes);
    REQUIRE(after.operations - before.operations == sync.plan().buckets().size());
    sync.zero_grad();
  }
}

TEST_CASE("16-bit gradients reduced in float, and a bfloat16 compression hook", "[grad][sync][precision]") {
  auto dp = dp_group();
  const int p = dp.size();
  SECTION("bfloat16 gradients, precision fp32: one rounding of the exact sum") {
    synchronizer<weft::mpi_backend, weft::bfloat16> sync(
        dp, {.first_bucket_bytes = 64, .scale = scaling::sum, .precision = weft::grad::reduce_precision::fp32});
    sync.add_param("w", 1000);
    sync.freeze();
    // Rank 0 holds 256, the others 1: the exact sum 256 + (p - 1) rounded once to bfloat16.
    auto g = sync.grad(0);
    for (auto& x : g) x = weft::bfloat16(dp.rank() == 0 ? 256.0f : 1.0f);
    auto before = dp.stats();
    sync.reduce_all();
    const float want = float(weft::bfloat16(256.0f + static_cast<float>(p - 1)));
    for (auto x : g) REQUIRE(float(x) == want);
    REQUIRE(dp.stats().bytes - before.bytes == sync.plan().total_elements() * sizeof(float));  // float on the wire
  }
  SECTION("bfloat16 gradients, precision fp32, marked during backward over two micro-steps") {
    // Buckets issued during backward convert (with the 1 / (dp x 2) scale folded in) and convert
    // back on the progress thread, in order around their reductions; the result is the same.
    synchronizer<weft::mpi_backend, weft::bfloat16> sync(
        dp, {.bucket_bytes = 256, .first_bucket_bytes = 64, .accumulation_steps = 2,
             .precision = weft::grad::reduce_precision::fp32});
    constexpr std::size_t params = 6, n = 100;
    for (std::size_t q = 0; q < params; ++q) sync.add_param("w" + std::to_string(q), n);
    sync.freeze();
    REQUIRE(sync.plan().buckets().size() >= 3);
    for (int step = 0; step < 2; ++step) {
      for (int micro = 0; micro < 2; ++micro) {
        for (std::size_t q = params; q-- > 0;) {
          auto g = sync.grad(q);
          for (std::size_t i = 0; i < n; ++i)
            g[i] = weft::bfloat16(float(g[i]) + static_cast<float>(contribution(dp.rank(), q, i)));
          sync.mark_ready(q);
        }
        REQUIRE(sync.finish() == (micro == 1));
      }
      for (std::size_t q = 0; q < params; ++q) {
        auto g = sync.grad(q);
        for (std::size_t i = 0; i < n; ++i)  // the mean of 2 equal micro-steps per rank: summed / p
          REQUIRE(float(g[i]) == float(weft::bfloat16(static_cast<float>(summed(p, q, i) / p))));
      }
      sync.zero_grad();
    }
  }
  SECTION("half gradients, precision fp32, mean over dp") {
    synchronizer<weft::mpi_backend, weft::half> sync(dp, {.precision = weft::grad::reduce_precision::fp32});
    sync.add_param("w", 77);
    sync.freeze();
    auto g = sync.grad(0);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = weft::half(static_cast<float>(contribution(dp.rank(), 0, i)));
    sync.reduce_all();
    for (std::size_t i = 0; i < g.size(); ++i)
      REQUIRE(float(g[i]) == float(weft::half(static_cast<float>(summed(p, 0, i) / p))));
  }
  SECTION("float gradients compressed to bfloat16 on the wire") {
    synchronizer<weft::mpi_backend, float> sync(dp, {.first_bucket_bytes = 64, .scale = scaling::sum});
    sync.add_param("w", 500);
    sync.freeze();
    sync.set_comm_hook(std::make_shared<weft::grad::bfloat16_compression_hook<weft::mpi_backend>>());
    auto g = sync.grad(0);
    // Element 0 is 1 + 2^-10 on every rank: not a bfloat16, so it arrives rounded to 1 per rank.
    for (std::size_t i = 0; i < g.size(); ++i)
      g[i] = i == 0 ? 1.0f + 1.0f / 1024 : static_cast<float>(contribution(dp.rank(), 0, i));
    auto before = dp.stats();
    sync.reduce_all();
    REQUIRE(dp.stats().bytes - before.bytes == sync.plan().total_elements() * 2);  // half the bytes
    REQUIRE(g[0] == static_cast<float>(p));
    for (std::size_t i = 1; i < g.size(); ++i) REQUIRE(g[i] == static_cast<float>(summed(p, 0, i)));
  }
}

TEST_CASE("the step report shows overlap, and warns when a configured overlap hid nothing", "[grad][sync][report]") {
  auto dp = dp_group();
  const std::size_t layers = 4, per_layer = 1 << 20;  // 4 MiB of float per layer
  synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = per_layer * 4, .first_bucket_bytes = per_layer * 4,
                                            .warn_if_not_overlapped = false});
  for (std::size_t l = 0; l < layers; ++l) sync.add_param("layer" + std::to_string(l), per_layer);
  sync.freeze();
  REQUIRE(sync.plan().buckets().size() == layers);

  SECTION("compute between the marks: reductions start during backward") {
    for (std::size_t l = layers; l-- > 0;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // this layer's backward
      sync.mark_ready(l);
    }
    sync.finish();
    const auto& r = sync.last_report();
    REQUIRE(r.overlap_expected);
    REQUIRE(r.buckets[0].start_s < r.backward_s);
    REQUIRE(r.buckets[0].start_s >= r.buckets[0].ready_s);
    REQUIRE(r.buckets[0].end_s > r.buckets[0].start_s);
    REQUIRE(r.hidden_s > 0);
    REQUIRE_THAT(r.describe(), Catch::Contains("bucket") && Catch::Contains("exposed"));
  }
  SECTION("every mark at the end of backward: nothing hidden, a warning") {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));  // backward that marks nothing
    for (std::size_t l = layers; l-- > 0;) sync.mark_ready(l);
    sync.finish();
    const auto& r = sync.last_report();
    REQUIRE(r.hidden_s < 0.05 * r.comm_s);
    REQUIRE_THAT(r.warning, Catch::Contains("hid"));
  }
}

// ---- errors ------------------------------------------------------------------------------------

TEST_CASE("a parameter marked twice in one step", "[grad][sync][errors]") {
  auto dp = dp_group();
  synchronizer<weft::mpi_backend> sync(dp, {.warn_if_not_overlapped = false});
  register_params(sync, 5);
  sync.mark_ready(4);
  REQUIRE_THROWS_WITH(sync.mark_ready(4), Catch::Contains("'layer4'") && Catch::Contains("twice"));
  REQUIRE_THROWS_WITH(sync.mark_ready(4, std::vector<float>(size_of_param(4))), Catch::Contains("twice"));
  for (std::size_t p = 0; p < 4; ++p) sync.mark_ready(p);
  REQUIRE(sync.finish());  // the step completes normally
}

TEST_CASE("a step finished with unmarked parameters names them, and no rank hangs", "[grad][sync][errors]") {
  auto dp = dp_group();
  const std::size_t n = 12;
  SECTION("every rank forgot the same parameters") {
    synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 128, .scale = scaling::sum,
                                              .warn_if_not_overlapped = false});
    register_params(sync, n);
    for (std::size_t p = n; p-- > 0;)
      if (p != 2 && p != 7) sync.mark_ready(p);
    REQUIRE_THROWS_WITH(sync.finish(), Catch::Contains("2 of 12") && Catch::Contains("'layer2'") &&
                                           Catch::Contains("'layer7'") && !Catch::Contains("'layer3'"));
    // The synchronizer starts a fresh step afterwards.
    sync.zero_grad();
    for (std::size_t p = n; p-- > 0;) {
      fill(sync, dp.rank(), p);
      sync.mark_ready(p);
    }
    REQUIRE(sync.finish());
    REQUIRE(sync.grad(7)[1] == static_cast<float>(summed(dp.size(), 7, 1)));
  }
  SECTION("one rank forgot: it throws, the others complete (local checks)") {
    dp.set_checks(weft::check_level::local);
    synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 128, .warn_if_not_overlapped = false});
    register_params(sync, n);
    for (std::size_t p = n; p-- > 0;)
      if (!(dp.rank() == 0 && p == 5)) sync.mark_ready(p);
    if (dp.rank() == 0)
      REQUIRE_THROWS_WITH(sync.finish(), Catch::Contains("'layer5'"));
    else
      REQUIRE(sync.finish());
  }
  SECTION("one rank forgot: with communication checks every rank throws") {
    dp.set_checks(weft::check_level::communication);
    synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 128, .warn_if_not_overlapped = false});
    register_params(sync, n);
    for (std::size_t p = n; p-- > 0;)
      if (!(dp.rank() == 0 && p == 5)) sync.mark_ready(p);
    if (dp.rank() == 0)
      REQUIRE_THROWS_WITH(sync.finish(), Catch::Contains("'layer5'"));
    else
      REQUIRE_THROWS_WITH(sync.finish(), Catch::Contains("marked ready") && Catch::Contains("disagree"));
  }
}

namespace {

// Reduces in the buffer's own type and throws from complete() on its first call for bucket 0:
// a reduction that fails after it was issued, as a dead peer's would.
class failing_once_hook final : public weft::grad::comm_hook<weft::mpi_backend, float> {
 public:
  std::string_view name() const override { return "failing once"; }
  request start(comm_t& group, const weft::grad::bucket_job<float>& job) override {
    return group.all_reduce_async(job.data);
  }
  void complete(comm_t&, const weft::grad::bucket_job<float>& job) override {
    if (job.index == 0 && armed_.exchange(false)) throw std::runtime_error("injected failure of bucket 0");
  }
  bool complete_is_local() const noexcept override { return true; }

 private:
  std::atomic<bool> armed_{true};  // complete() may run on the progress thread
};

}  // namespace

TEST_CASE("a reduction that fails still ends the step: the next one starts clean", "[grad][sync][errors]") {
  auto dp = dp_group();
  const std::size_t n = 12;
  for (bool during_backward : {true, false}) {
    DYNAMIC_SECTION((during_backward ? "buckets issued during backward" : "reduce_all()")) {
      synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 128, .first_bucket_bytes = 128,
                                                .scale = scaling::sum, .warn_if_not_overlapped = false});
      register_params(sync, n);
      sync.set_comm_hook(std::make_shared<failing_once_hook>());
      REQUIRE(sync.plan().buckets().size() > 2);
      auto backward = [&] {
        for (std::size_t p = n; p-- > 0;) {
          fill(sync, dp.rank(), p);
          if (during_backward) sync.mark_ready(p);
        }
        return during_backward ? sync.finish() : sync.reduce_all();
      };
      REQUIRE_THROWS_WITH(backward(), Catch::Contains("injected failure of bucket 0"));
      REQUIRE(sync.micro_step() == 0);
      // No parameter is left marked, and the reductions of the failed step are not mixed into this one.
      sync.zero_grad();
      REQUIRE(backward());
      for (std::size_t p = 0; p < n; ++p) {
        auto g = sync.grad(p);
        for (std::size_t i = 0; i < g.size(); ++i) REQUIRE(g[i] == static_cast<float>(summed(dp.size(), p, i)));
      }
    }
  }
}

TEST_CASE("16-bit gradients reduced in float with many buckets in flight", "[grad][sync][precision][threads]") {
  // Every bucket converts back on the progress thread while the caller starts the next one: the
  // hook's per-bucket state must not move under that reader (run under ThreadSanitizer in CI).
  auto dp = dp_group();
  const int p = dp.size();
  synchronizer<weft::mpi_backend, weft::bfloat16> sync(
      dp, {.bucket_bytes = 64, .first_bucket_bytes = 64, .pad_elements = 1, .scale = scaling::sum,
           .precision = weft::grad::reduce_precision::fp32, .warn_if_not_overlapped = false});
  constexpr std::size_t params = 48, n = 24;
  for (std::size_t q = 0; q < params; ++q) sync.add_param("w" + std::to_string(q), n);
  sync.freeze();
  REQUIRE(sync.plan().buckets().size() >= 40);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t q = params; q-- > 0;) {
      auto g = sync.grad(q);
      for (std::size_t i = 0; i < n; ++i) g[i] = weft::bfloat16(static_cast<float>(contribution(dp.rank(), q, i)));
      sync.mark_ready(q);
    }
    REQUIRE(sync.finish());
    for (std::size_t q = 0; q < params; ++q) {
      auto g = sync.grad(q);
      for (std::size_t i = 0; i < n; ++i)
        REQUIRE(float(g[i]) == float(weft::bfloat16(static_cast<float>(summed(p, q, i)))));
    }
    sync.zero_grad();
  }
}

TEST_CASE("the cast hook starts a bucket while the progress thread converts the one before", "[grad][hook][threads]") {
  // The exact interleaving of the review's finding, made deterministic: bucket 0's conversion back
  // runs on the progress thread and has read its staging buffer; only then does the caller start
  // bucket 1. The relaxed flag gives ThreadSanitizer no ordering between the two, so a hook that
  // resized its per-bucket state in start() is reported there (and may lose bucket 0 elsewhere).
  auto dp = dp_group();
  const int p = dp.size();
  weft::grad::cast_hook<weft::mpi_backend, weft::bfloat16, float> hook;
  constexpr std::size_t buckets = 9, n = 16;
  const std::vector<std::size_t> sizes(buckets, n);
  hook.prepare(sizes);
  std::vector<std::vector<weft::bfloat16>> data(buckets, std::vector<weft::bfloat16>(n));
  std::vector<weft::grad::bucket_job<weft::bfloat16>> jobs(buckets);
  for (std::size_t b = 0; b < buckets; ++b) {
    for (std::size_t i = 0; i < n; ++i) data[b][i] = weft::bfloat16(static_cast<float>(contribution(dp.rank(), b, i)));
    jobs[b] = {.index = b, .data = data[b]};
  }
  std::atomic<bool> first_converted{false};
  std::vector<comm_t::request> reductions, epilogues;
  reductions.push_back(hook.start(dp, jobs[0]));
  epilogues.push_back(dp.native().run_in_order([&] {
    hook.complete(dp, jobs[0]);
    first_converted.store(true, std::memory_order_relaxed);
  }));
  while (!first_converted.load(std::memory_order_relaxed)) std::this_thread::yield();
  for (std::size_t b = 1; b < buckets; ++b) {
    reductions.push_back(hook.start(dp, jobs[b]));
    epilogues.push_back(dp.native().run_in_order([&hook, &dp, &jobs, b] { hook.complete(dp, jobs[b]); }));
  }
  for (auto& r : reductions) r.wait();
  for (auto& e : epilogues) e.wait();
  for (std::size_t b = 0; b < buckets; ++b)
    for (std::size_t i = 0; i < n; ++i)
      REQUIRE(float(data[b][i]) == float(weft::bfloat16(static_cast<float>(summed(p, b, i)))));
  // A bucket the hook was not told about is refused, not silently given fresh state.
  std::vector<weft::bfloat16> stray(n);
  REQUIRE_THROWS_WITH(hook.start(dp, {.index = buckets, .data = stray}), Catch::Contains("prepare()"));
}

TEST_CASE("the synchronizer follows its group when the communicator moves", "[grad][sync]") {
  std::vector<comm_t> groups;
  groups.push_back(dp_group());
  synchronizer<weft::mpi_backend> sync(groups[0], {.scale = scaling::sum, .warn_if_not_overlapped = false});
  register_params(sync, 6);
  // Growing the vector moves the communicator: a raw pointer taken at construction would dangle.
  for (int i = 0; i < 8; ++i) groups.push_back(comm_t(weft::mpi_backend::comm::world(), "extra"));
  const int p = groups[0].size();
  for (std::size_t q = 0; q < 6; ++q) fill(sync, groups[0].rank(), q);
  REQUIRE(sync.reduce_all());
  REQUIRE(&sync.group() == &groups[0]);
  REQUIRE(sync.grad(5)[3] == static_cast<float>(summed(p, 5, 3)));
  // Once the communicator is gone, using the synchronizer says so instead of reading freed memory.
  groups.clear();
  sync.zero_grad();
  REQUIRE_THROWS_WITH(sync.reduce_all(), Catch::Contains("'dp'") && Catch::Contains("destroyed"));
}

TEST_CASE("registering after the plan is frozen, and using the buffer before", "[grad][sync][errors]") {
  auto dp = dp_group();
  synchronizer<weft::mpi_backend> sync(dp);
  sync.add_param("a", 10);
  REQUIRE_THROWS_WITH(sync.grad(0), Catch::Contains("before freeze()"));
  REQUIRE_THROWS_WITH(sync.mark_ready(0), Catch::Contains("before freeze()"));
  sync.freeze();
  REQUIRE_THROWS_WITH(sync.add_param("late", 5), Catch::Contains("'late'") && Catch::Contains("frozen"));
  REQUIRE_THROWS_WITH(sync.freeze(), Catch::Contains("twice"));
  REQUIRE_THROWS_WITH(sync.mark_ready(3), Catch::Contains("no such parameter"));
  REQUIRE_THROWS_WITH(sync.shard_segments(), Catch::Contains("shard_optimizer_state"));
}

TEST_CASE("a gradient of the wrong size", "[grad][sync][errors]") {
  auto dp = dp_group();
  synchronizer<weft::mpi_backend> sync(dp);
  sync.add_param("embedding", 12);
  sync.freeze();
  std::vector<float> wrong(11, 1.0f);
  REQUIRE_THROWS_WITH(sync.mark_ready(0, wrong), Catch::Contains("'embedding'") && Catch::Contains("11 elements") &&
                                                     Catch::Contains("registered with 12"));
  REQUIRE(sync.grad(0)[0] == 0.0f);  // nothing was added
  sync.mark_ready(0, std::vector<float>(12, 1.0f));
  REQUIRE(sync.finish());
  REQUIRE(sync.grad(0)[0] == 1.0f);  // the mean of ones
}

TEST_CASE("ranks whose bucket plans differ are stopped before the first step", "[grad][sync][errors]") {
  auto dp = dp_group();
  SECTION("a size differs on the last rank") {
    synchronizer<weft::mpi_backend> sync(dp);
    sync.add_param("a", 10);
    sync.add_param("b", dp.rank() == dp.size() - 1 ? 21 : 20);
    REQUIRE_THROWS_WITH(sync.freeze(), Catch::Contains("bucket plan") && Catch::Contains("disagree") &&
                                           Catch::Contains("ranks " + std::to_string(dp.size() - 1)));
    REQUIRE_FALSE(sync.frozen());
  }
  SECTION("a bucket cap differs on rank 0") {
    synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = dp.rank() == 0 ? 4096u : 8192u});
    sync.add_param("a", 10);
    REQUIRE_THROWS_WITH(sync.freeze(), Catch::Contains("bucket plan"));
  }
  SECTION("accumulation windows differ") {
    synchronizer<weft::mpi_backend> sync(dp, {.accumulation_steps = dp.rank() == 0 ? 2 : 4});
    sync.add_param("a", 10);
    REQUIRE_THROWS_WITH(sync.freeze(), Catch::Contains("accumulation"));
  }
}

TEST_CASE("bad options and a forgotten token count", "[grad][sync][errors]") {
  auto dp = dp_group();
  REQUIRE_THROWS_WITH((synchronizer<weft::mpi_backend>(dp, {.accumulation_steps = 0})),
                      Catch::Contains("accumulation_steps is 0"));
  synchronizer<weft::mpi_backend> sync(dp, {.scale = scaling::token_count});
  sync.add_param("a", 10);
  sync.freeze();
  REQUIRE_THROWS_WITH(sync.set_token_count(0), Catch::Contains("positive"));
  std::fill(sync.grad(0).begin(), sync.grad(0).end(), 3.0f);
  REQUIRE_THROWS_WITH(sync.reduce_all(), Catch::Contains("set_token_count"));
  REQUIRE(sync.grad(0)[0] == 3.0f * static_cast<float>(dp.size()));  // reduced, left unscaled
  synchronizer<weft::mpi_backend> mean(dp);
  mean.add_param("a", 10);
  mean.freeze();
  REQUIRE_THROWS_WITH(mean.set_token_count(100), Catch::Contains("token_count"));
}

TEST_CASE("the bucket cap is the largest size as fast per byte as the best", "[grad][sync][sizing]") {
  using weft::grad::curve_point;
  constexpr std::size_t mib = std::size_t{1} << 20;
  // Bandwidth in bytes per second -> a point of that size.
  auto at = [](std::size_t bytes, double bandwidth) { return curve_point{bytes, static_cast<double>(bytes) / bandwidth}; };
  SECTION("an algorithm switch above 16 MiB (this machine's Open MPI): 16 MiB, not the largest") {
    std::vector<curve_point> curve{at(1 * mib, 3.0e9), at(2 * mib, 4.6e9), at(4 * mib, 4.9e9), at(8 * mib, 5.0e9),
                                   at(16 * mib, 4.9e9), at(32 * mib, 3.1e9), at(64 * mib, 2.9e9)};
    auto choice = weft::grad::choose_bucket_bytes(curve);
    REQUIRE(choice.best_bytes == 8 * mib);
    REQUIRE(choice.bucket_bytes == 16 * mib);  // 4.9 >= 0.95 x 5.0
    REQUIRE(weft::grad::choose_bucket_bytes(curve, 0.0).bucket_bytes == 8 * mib);
  }
  SECTION("bandwidth that keeps growing: the largest size") {
    std::vector<curve_point> curve{at(1 * mib, 1e9), at(2 * mib, 2e9), at(4 * mib, 3e9)};
    REQUIRE(weft::grad::choose_bucket_bytes(curve).bucket_bytes == 4 * mib);
  }
  SECTION("just outside the tolerance is left out") {
    std::vector<curve_point> curve{at(1 * mib, 10e9), at(2 * mib, 9.49e9), at(4 * mib, 9.51e9)};
    REQUIRE(weft::grad::choose_bucket_bytes(curve).bucket_bytes == 4 * mib);
    curve.back() = at(4 * mib, 9.49e9);
    REQUIRE(weft::grad::choose_bucket_bytes(curve).bucket_bytes == 1 * mib);
  }
  SECTION("bad curves") {
    REQUIRE_THROWS_WITH(weft::grad::choose_bucket_bytes({}), Catch::Contains("no measured sizes"));
    std::vector<curve_point> zero{{1 * mib, 0.0}};
    REQUIRE_THROWS_WITH(weft::grad::choose_bucket_bytes(zero), Catch::Contains("must be positive"));
    std::vector<curve_point> fine{{1 * mib, 1.0}};
    REQUIRE_THROWS_WITH(weft::grad::choose_bucket_bytes(fine, 1.5), Catch::Contains("tolerance"));
  }
}

TEST_CASE("a measured bucket cap is the same on every rank and drives the plan", "[grad][sync][sizing]") {
  auto dp = dp_group();
  constexpr std::size_t kib = 1024;
  // 3 MiB of float gradients in 24 parameters: the probe times 256 KiB .. 2 MiB, then 3 MiB.
  const bool shard = GENERATE(false, true);
  // A budget no run reaches (sanitizers and loaded machines slow the calls): every size is timed.
  weft::grad::sync_options o{.shard_optimizer_state = shard, .warn_if_not_overlapped = false};
  o.probe.budget_s = 600;
  synchronizer<weft::mpi_backend> sync(dp, o);
  for (int p = 0; p < 24; ++p) sync.add_param("p" + std::to_string(p), 32 * kib);
  sync.freeze();
  const auto& choice = sync.bucket_choice();
  REQUIRE(choice.curve.size() == 5);
  std::vector<std::size_t> expected_sizes{256 * kib, 512 * kib, 1024 * kib, 2048 * kib, 3072 * kib};
  for (std::size_t i = 0; i < choice.curve.size(); ++i) {
    // Each size rounded up to whole elements per rank (a reduce-scatter splits it evenly).
    const std::size_t unit = sizeof(float) * static_cast<std::size_t>(dp.size());
    REQUIRE(choice.curve[i].bytes == (expected_sizes[i] + unit - 1) / unit * unit);
    REQUIRE(choice.curve[i].seconds > 0);
  }
  // The chosen cap, recomputed from the curve by the rule: the largest size within 5 % of the best.
  double best = 0;
  for (const auto& p : choice.curve) best = std::max(best, static_cast<double>(p.bytes) / p.seconds);
  std::size_t largest_fast = 0;
  for (const auto& p : choice.curve)
    if (static_cast<double>(p.bytes) / p.seconds >= 0.95 * best) largest_fast = std::max(largest_fast, p.bytes);
  REQUIRE(choice.bucket_bytes == largest_fast);
  REQUIRE(sync.plan().buckets().size() >= 1);
  // Every rank measured the same curve and chose the same cap.
  const auto caps = all_gather_world(static_cast<std::int64_t>(choice.bucket_bytes));
  REQUIRE(std::all_of(caps.begin(), caps.end(), [&](std::int64_t c) { return c == caps[0]; }));
  for (const auto& p : choice.curve) {
    const auto times = all_gather_world(std::bit_cast<std::int64_t>(p.seconds));
    REQUIRE(std::all_of(times.begin(), times.end(), [&](std::int64_t t) { return t == times[0]; }));
  }
  // The buckets after the first are no larger than the cap (a larger parameter would have its own).
  const auto buckets = sync.plan().buckets();
  for (std::size_t b = 1; b < buckets.size(); ++b) REQUIRE(buckets[b].used * sizeof(float) <= choice.bucket_bytes);
  REQUIRE_THAT(choice.describe(), Catch::Contains("measured"));

  // The reduction still sums: every rank adds ones.
  std::fill(sync.grads().all().begin(), sync.grads().all().end(), 1.0f);
  sync.reduce_all();
  if (!shard) REQUIRE(sync.grad(23)[0] == 1.0f);  // mean over ranks
}

TEST_CASE("the default probe, ended by its budget, chooses the same cap on every rank", "[grad][sync][sizing]") {
  auto dp = dp_group();
  // 24 MiB of gradients under the default 0.2 s budget: the search's steps follow from the times
  // recorded so far, which are the slowest rank's, so every rank takes the same steps.
  synchronizer<weft::mpi_backend> sync(dp, {.warn_if_not_overlapped = false});
  for (int p = 0; p < 3; ++p) sync.add_param("p" + std::to_string(p), 2 << 20);
  sync.freeze();
  const auto& choice = sync.bucket_choice();
  REQUIRE_FALSE(choice.curve.empty());
  REQUIRE(choice.curve.back().bytes <= std::size_t{24} << 20);  // never past the gradients' size
  std::uint64_t curve_hash = choice.bucket_bytes;
  for (const auto& p : choice.curve) curve_hash = curve_hash * 1000003 ^ p.bytes ^ std::bit_cast<std::uint64_t>(p.seconds);
  const auto hashes = all_gather_world(static_cast<std::int64_t>(curve_hash));
  REQUIRE(std::all_of(hashes.begin(), hashes.end(), [&](std::int64_t h) { return h == hashes[0]; }));
  const auto caps = all_gather_world(static_cast<std::int64_t>(choice.bucket_bytes));
  REQUIRE(std::all_of(caps.begin(), caps.end(), [&](std::int64_t c) { return c == caps[0]; }));
}

TEST_CASE("a given bucket cap skips the probe; ranks that disagree on measuring are stopped", "[grad][sync][sizing]") {
  auto dp = dp_group();
  SECTION("given") {
    synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 64 * 1024});
    sync.add_param("a", 1 << 20);
    sync.freeze();
    REQUIRE(sync.bucket_choice().curve.empty());
    REQUIRE(sync.bucket_choice().bucket_bytes == 64 * 1024);
  }
  SECTION("gradients smaller than the smallest probed size: one bucket, nothing timed") {
    synchronizer<weft::mpi_backend> sync(dp);
    sync.add_param("a", 100);
    sync.add_param("b", 100);
    sync.freeze();
    REQUIRE(sync.bucket_choice().curve.empty());
    REQUIRE(sync.plan().buckets().size() == 1);
  }
  SECTION("the budget bounds the probe: no size is started once it is spent") {
    weft::grad::sync_options o;
    o.probe.budget_s = 1e-9;  // spent by the first size, on every rank alike (the slowest rank's time)
    synchronizer<weft::mpi_backend> sync(dp, o);
    sync.add_param("a", 4 << 20);  // 16 MiB: the first size is the first one call times, 8 MiB
    sync.freeze();
    REQUIRE(sync.bucket_choice().curve.size() == 1);
    REQUIRE(sync.bucket_choice().bucket_bytes == 8 << 20);
    REQUIRE(sync.bucket_choice().budget_ended_below_knee);
  }
  SECTION("rank 0 measures, the others give a cap") {
    weft::grad::sync_options o;
    if (dp.rank() != 0) o.bucket_bytes = 1 << 20;
    synchronizer<weft::mpi_backend> sync(dp, o);
    sync.add_param("a", 1 << 20);
    REQUIRE_THROWS_WITH(sync.freeze(), Catch::Contains("measured or given bucket cap") && Catch::Contains("disagree"));
  }
  SECTION("probe budgets differ") {
    weft::grad::sync_options o;
    o.probe.budget_s = dp.rank() == 0 ? 0.1 : 0.2;
    synchronizer<weft::mpi_backend> sync(dp, o);
    sync.add_param("a", 1 << 20);
    REQUIRE_THROWS_WITH(sync.freeze(), Catch::Contains("probe options"));
  }
}
