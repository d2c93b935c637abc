// Reducing GPT-2 small's 148 gradients (124,439,808 floats, 497.8 MB) over the ranks, or with
// --model mlp those of a model of few large tensors (16 layers of a 2048-wide MLP: 32 tensors,
// 268.6 MB), side by side in one run: weft's bucketed synchronizer against raw MPI (one flat
// MPI_Allreduce; one per tensor; one per weft bucket) and PyTorch DDP, whose result run.sh
// measures just before this run and passes in (--ddp-result, or --ddp-failed with the reason it
// has none). The weft and MPI variants take turns within every iteration, in a shuffled order, so
// load from other processes falls on every variant alike. The time of an iteration is the slowest
// rank's; the table shows medians over all rounds, the minor page faults a timed iteration took
// (the most of any rank; MPI's scratch buffers for large messages are fresh memory) and the
// median time to write the variant's buffer before it (fill_ms: the memory alone, no MPI).
//
// The raw MPI variants run on the default synchronizer's own buffer (its parameter views, or the
// whole of it), so that raw MPI and weft move the same memory: a synchronizer's buffer made first,
// right after its probe, was slower than later ones under raw MPI calls too, a difference of
// memory placement rather than of the calls (docs/benchmarks.md).
//
//   bench/grad_sync/run.sh BUILD_DIR [--iterations 12] [--rounds 3] [--json FILE]     (the usual way)
//   mpirun -n 2 weft_bench_grad_sync [--iterations 12] [--rounds 3] [--warmup 1] [--json FILE]
//          [--ddp-result FILE | --ddp-failed REASON] [--layers 12] [--bucket-mib 25]
//          [--first-bucket-mib 1] [--pad 128] [--sweep] [--caps 2,8,32] [--in-flight] [--model gpt2|mlp]
//
// --caps: sweep only these caps (MiB), without the padding variants: every variant holds its own
// copy of the gradients (498 MB), so the whole sweep does not fit in memory at 4 ranks here.
//
// --in-flight: whether a second bucket in flight pays on this backend. The measured cap's buckets
// issued as weft async all-reduces on one communicator (one bucket at a time on its progress
// thread, as the synchronizer does) against the same buckets alternating between two
// communicators over the same ranks, each with its own progress thread (two in flight).
#include <mpi.h>
#include <sys/resource.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/synchronizer.hpp>

#include "bench_args.hpp"
#include "gpt2_shapes.hpp"
#include "json_output.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using namespace weft_bench;
using comm_t = weft::communicator<weft::mpi_backend>;
using sync_t = weft::grad::synchronizer<weft::mpi_backend, float>;

namespace {

struct variant {
  std::string name;
  std::function<void()> prepare;  // untimed: fresh gradient values
  std::function<void()> run;      // timed
  std::vector<double> times;
  long faults = 0;  // minor page faults in the timed part, the most of any rank, all iterations
  std::vector<double> fill_times{};  // prepare(): writing the variant's buffer, no MPI (slowest rank)
};

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

std::unique_ptr<sync_t> make_sync(comm_t& dp, const std::vector<named_shape>& shapes, weft::grad::sync_options o) {
  o.warn_if_not_overlapped = false;  // gradients are all ready at once here: nothing to hide behind
  auto sync = std::make_unique<sync_t>(dp, o);
  for (const auto& s : shapes) sync->add_param(s.name, s.count());
  sync->freeze();
  return sync;
}

void fill(std::span<float> data, float value) { std::fill(data.begin(), data.end(), value); }

// One backward as a trainer with per-parameter hooks does it, with no compute between the marks:
// the last parameter first, then finish().
void weft_backward(sync_t& sync) {
  for (std::size_t p = sync.plan().params().size(); p-- > 0;) sync.mark_ready(p);
  sync.finish();
}

constexpr const char* usage_text =
    "usage: mpirun -n RANKS weft_bench_grad_sync [options]   (bench/grad_sync/run.sh adds PyTorch DDP)\n"
    "  --iterations N          timed iterations, all rounds together [12]\n"
    "  --rounds N              rounds the iterations are split into [3]\n"
    "  --warmup N              untimed iterations before the first round [1]\n"
    "  --bucket-mib X          weft's bucket cap in MiB [measured: the synchronizer's default]\n"
    "  --first-bucket-mib X    weft's first bucket cap in MiB [1]\n"
    "  --pad N                 weft pads buckets to multiples of N elements [128]\n"
    "  --sweep                 also time other bucket caps and paddings\n"
    "  --caps A,B,...          sweep only these caps in MiB (no padding variants), to fit in memory\n"
    "  --in-flight             also time the buckets with one and with two in flight (two communicators)\n"
    "  --ddp-result FILE       PyTorch DDP's times, as run.sh measures them\n"
    "  --ddp-failed REASON     DDP was meant to run but did not: the result says so, with REASON\n"
    "  --layers N              GPT-2's transformer blocks, or the MLP's layers [12 / 16]; fewer for quick checks\n"
    "  --model gpt2|mlp        GPT-2 small's 148 gradients, or 16 layers of a 2048-wide MLP (32 tensors) [gpt2]\n"
    "  --json FILE             write the results as JSON\n";

int parse_count(std::string_view name, int argc, char** argv, const char* fallback, int low) {
  return weft_programs::parse_integer(name, option(argc, argv, name, fallback), low, 1 << 20);
}

double parse_mib(std::string_view name, int argc, char** argv, const char* fallback) {
  return weft_programs::parse_real(name, option(argc, argv, name, fallback), 1.0 / 1024, 1 << 20);
}

}  // namespace

int main(int argc, char** argv) {
  return weft_programs::mpi_main("weft_bench_grad_sync", usage_text, argc, argv, [&](int world_rank) {
    check_arguments(argc, argv,
                    {"--iterations", "--rounds", "--warmup", "--ddp-result", "--ddp-failed", "--layers", "--bucket-mib",
                     "--first-bucket-mib", "--pad", "--json", "--caps", "--model"},
                    {"--sweep", "--in-flight", "--help", "-h"});
    if (flag(argc, argv, "--help") || flag(argc, argv, "-h")) {
      if (world_rank == 0) std::printf("%s", usage_text);
      return 0;
    }
    const int iterations = parse_count("--iterations", argc, argv, "12", 1);
    const int rounds = parse_count("--rounds", argc, argv, "3", 1);
    const int warmup = parse_count("--warmup", argc, argv, "1", 0);
    // DDP's result, measured by run.sh just before this run (DDP's ranks started from inside an
    // MPI rank proved unreliable: one could die at start-up and leave the other waiting).
    const std::string ddp_result = option(argc, argv, "--ddp-result");
    // Why run.sh has no DDP result: a comparison without DDP must say so in its table and JSON.
    const std::string ddp_failed = option(argc, argv, "--ddp-failed");
    if (!ddp_result.empty() && !ddp_failed.empty())
      throw weft_programs::usage_error("give --ddp-result or --ddp-failed, not both");
    const std::string model = option(argc, argv, "--model", "gpt2");
    if (model != "gpt2" && model != "mlp")
      throw weft_programs::usage_error("--model " + model + ": give gpt2 (GPT-2 small) or mlp (few large tensors)");
    const int layers = parse_count("--layers", argc, argv, model == "gpt2" ? "12" : "16", 0);
    // Without --bucket-mib, weft runs at its default: a cap measured at freeze().
    const bool given_cap = !option(argc, argv, "--bucket-mib").empty();
    const double bucket_mib = given_cap ? parse_mib("--bucket-mib", argc, argv, "25") : 0.0;
    const double first_mib = parse_mib("--first-bucket-mib", argc, argv, "1");
    const std::size_t pad = static_cast<std::size_t>(parse_count("--pad", argc, argv, "128", 0));
    const std::string json_path = option(argc, argv, "--json");
    const std::string caps_text = option(argc, argv, "--caps");
    const bool sweep = flag(argc, argv, "--sweep") || !caps_text.empty();
    std::vector<double> caps = {1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 50.0, 100.0};
    if (!caps_text.empty()) {
      caps.clear();
      for (std::size_t at = 0; at <= caps_text.size();) {
        const std::size_t end = std::min(caps_text.find(',', at), caps_text.size());
        caps.push_back(weft_programs::parse_real("--caps", caps_text.substr(at, end - at), 1.0 / 1024, 1 << 20));
        at = end + 1;
      }
    }
    const bool in_flight = flag(argc, argv, "--in-flight");

    int exit_code = 0;
    comm_t dp(weft::mpi_backend::comm::world(), "dp");
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    const int rank = dp.rank(), ranks = dp.size();

    const auto shapes = model == "gpt2" ? gpt2_small_shapes(layers) : wide_mlp_shapes(layers);
    if (shapes.empty()) throw weft_programs::usage_error("--layers 0 leaves the MLP without parameters; give at least 1");
    std::size_t total = 0;
    for (const auto& s : shapes) total += s.count();

    auto mib = [](double m) { return static_cast<std::size_t>(m * (1 << 20)); };
    weft::grad::sync_options defaults{.bucket_bytes = given_cap ? mib(bucket_mib) : weft::grad::measured_bucket_bytes,
                                      .first_bucket_bytes = mib(first_mib),
                                      .pad_elements = pad};
    auto summing = defaults;
    summing.scale = weft::grad::scaling::sum;
    auto weft_sum = make_sync(dp, shapes, summing);      // the same arithmetic as raw MPI
    auto weft_mean = make_sync(dp, shapes, defaults);    // the default: averaged gradients

    // Raw MPI on the default synchronizer's buffer: per tensor, its parameter views; flat, all of it.
    sync_t& shared = *weft_sum;
    std::vector<variant> variants;
    variants.push_back({"mpi_flat", [&] { fill(shared.grads().all(), 1.0f); },
                        [&] {
                          auto all = shared.grads().all();
                          MPI_Allreduce(MPI_IN_PLACE, all.data(), static_cast<int>(all.size()), MPI_FLOAT, MPI_SUM, raw);
                        },
                        {}});
    variants.push_back({"mpi_per_tensor", [&] { fill(shared.grads().all(), 1.0f); },
                        [&] {
                          for (std::size_t p = shapes.size(); p-- > 0;) {
                            auto g = shared.grad(p);
                            MPI_Allreduce(MPI_IN_PLACE, g.data(), static_cast<int>(g.size()), MPI_FLOAT, MPI_SUM, raw);
                          }
                        },
                        {}});
    variants.push_back({"weft", [&] { fill(weft_sum->grads().all(), 1.0f); }, [&] { weft_backward(*weft_sum); }, {}});
    variants.push_back(
        {"weft_mean", [&] { fill(weft_mean->grads().all(), 1.0f); }, [&] { weft_backward(*weft_mean); }, {}});
    // Raw MPI on weft's own buckets, one blocking call each on the caller's thread: separates what
    // the bucketing costs from what running the calls on the progress thread costs.
    variants.push_back({"mpi_weft_buckets", [&] { fill(weft_sum->grads().all(), 1.0f); },
                        [&] {
                          for (std::size_t b = weft_sum->plan().buckets().size(); b-- > 0;) {
                            auto slice = weft_sum->grads().bucket_slice(b);
                            MPI_Allreduce(MPI_IN_PLACE, slice.data(), static_cast<int>(slice.size()), MPI_FLOAT,
                                          MPI_SUM, raw);
                          }
                        },
                        {}});

    // Extra weft configurations, to choose the defaults from measurements.
    // One or two buckets in flight, on weft's async all-reduce: the default's buckets in a buffer
    // of their own, issued last bucket first (as backward marks them) and waited for at the end.
    std::unique_ptr<comm_t> second;  // the same ranks again: its own progress thread
    std::unique_ptr<weft::grad::flat_buffer<float>> in_flight_buffer;
    auto issue_buckets = [&](int communicators) {
      std::vector<comm_t::request> pending;
      const std::size_t buckets = weft_sum->plan().buckets().size();
      for (std::size_t b = buckets; b-- > 0;) {
        comm_t& on = (communicators == 2 && (buckets - 1 - b) % 2 == 1) ? *second : dp;
        pending.push_back(on.all_reduce_async(in_flight_buffer->bucket_slice(b)));
      }
      for (auto& r : pending) r.wait();
    };
    if (in_flight) {
      second = std::make_unique<comm_t>(weft::mpi_backend::comm::world(), "dp-second");
      in_flight_buffer = std::make_unique<weft::grad::flat_buffer<float>>(weft_sum->shared_plan());
      variants.push_back({"in_flight_1", [&] { fill(in_flight_buffer->all(), 1.0f); }, [&] { issue_buckets(1); }, {}});
      variants.push_back({"in_flight_2", [&] { fill(in_flight_buffer->all(), 1.0f); }, [&] { issue_buckets(2); }, {}});
    }

    std::vector<std::unique_ptr<sync_t>> swept;
    if (sweep) {
      for (double cap : caps) {
        auto o = summing;
        o.bucket_bytes = mib(cap);
        swept.push_back(make_sync(dp, shapes, o));
        sync_t* s = swept.back().get();
        char name[64];
        std::snprintf(name, sizeof(name), "weft_cap%gMiB", cap);
        variants.push_back({name, [s] { fill(s->grads().all(), 1.0f); }, [s] { weft_backward(*s); }, {}});
      }
      for (std::size_t p : caps_text.empty() ? std::vector<std::size_t>{1, 1024} : std::vector<std::size_t>{}) {
        auto o = summing;
        o.pad_elements = p;
        swept.push_back(make_sync(dp, shapes, o));
        sync_t* s = swept.back().get();
        variants.push_back({"weft_pad" + std::to_string(p), [s] { fill(s->grads().all(), 1.0f); },
                            [s] { weft_backward(*s); }, {}});
      }
      // The default's plan again (its measured cap, given), in a synchronizer made last: whether
      // the default variant's time is its plan's or its buffer's (made first, right after a probe).
      auto again = summing;
      again.bucket_bytes = weft_sum->bucket_choice().bucket_bytes;
      swept.push_back(make_sync(dp, shapes, again));
      sync_t* late = swept.back().get();
      variants.push_back({"weft_default_late", [late] { fill(late->grads().all(), 1.0f); },
                          [late] { weft_backward(*late); }, {}});
    }

    // The same per-tensor calls on a buffer of their own, allocated after every synchronizer (as
    // the raw variants were before they moved to the default's buffer): what the buffer alone changes.
    std::vector<float> own(total);
    std::vector<std::size_t> offsets;
    for (std::size_t at = 0; const auto& s : shapes) {
      offsets.push_back(at);
      at += s.count();
    }
    variants.push_back({"mpi_per_tensor_own", [&] { fill(own, 1.0f); },
                        [&] {
                          for (std::size_t p = shapes.size(); p-- > 0;)
                            MPI_Allreduce(MPI_IN_PLACE, own.data() + offsets[p], static_cast<int>(shapes[p].count()),
                                          MPI_FLOAT, MPI_SUM, raw);
                        },
                        {}});

    std::vector<double> ddp_times, ddp_backward_only_times;
    // "ok", "failed" (with a reason) or "not_run" (DDP was not asked for): the JSON's ddp_status.
    std::string ddp_status = "not_run", ddp_reason = "no --ddp-result (bench/grad_sync/run.sh measures DDP)";
    if (!ddp_failed.empty()) {
      ddp_status = "failed";
      ddp_reason = ddp_failed;
    } else if (!ddp_result.empty() && rank == 0) {
      std::string text = read_text(ddp_result.c_str());
      for (double t : json_numbers(text, "ddp_times")) ddp_times.push_back(t);
      for (double t : json_numbers(text, "ddp_backward_only_times")) ddp_backward_only_times.push_back(t);
      if (ddp_times.empty()) {
        ddp_status = "failed";
        ddp_reason = "no DDP times in " + ddp_result;
      } else {
        ddp_status = "ok";
        ddp_reason.clear();
      }
    }
    const int per_round = std::max(1, iterations / rounds);
    std::mt19937 shuffler(28);
    for (int round = 0; round < rounds; ++round) {
      for (int it = 0; it < (round == 0 ? warmup : 0) + per_round; ++it) {
        // A new order every iteration, the same on every rank (a fixed seed): each variant follows
        // every other in turn, so none always runs after the same one (after the heap and the
        // caches one variant leaves behind), as a plain rotation had it.
        std::vector<std::size_t> order(variants.size());
        std::iota(order.begin(), order.end(), std::size_t{0});
        std::shuffle(order.begin(), order.end(), shuffler);
        for (std::size_t k : order) {
          variant& v = variants[k];
          const double fill_start = now_s();
          v.prepare();
          const double fill_s = max_over_ranks(now_s() - fill_start, raw);
          MPI_Barrier(raw);
          const long faults = minor_faults();
          double t = now_s();
          v.run();
          t = max_over_ranks(now_s() - t, raw);
          const double most_faults = max_over_ranks(static_cast<double>(minor_faults() - faults), raw);
          if (round > 0 || it >= warmup) {
            v.times.push_back(t);
            v.faults += static_cast<long>(most_faults);
            v.fill_times.push_back(fill_s);
          }
        }
      }
    }
    // Check the answers: every variant summed ones over the ranks.
    bool correct = shared.grads().all().front() == static_cast<float>(ranks) &&
                   shared.grad(shapes.size() - 1).back() == static_cast<float>(ranks) &&
                   own.front() == static_cast<float>(ranks) && own.back() == static_cast<float>(ranks) &&
                   weft_mean->grad(shapes.size() - 1)[shapes.back().count() - 1] == 1.0f;
    if (in_flight)
      correct = correct && in_flight_buffer->all().front() == static_cast<float>(ranks) &&
                in_flight_buffer->all()[total - 1] == static_cast<float>(ranks);

    double ddp_s = -1, ddp_backward_only_s = -1;
    if (ddp_status == "ok") {
      ddp_s = median(ddp_times);
      ddp_backward_only_s = median(ddp_backward_only_times);
    }

    if (rank == 0) {
      const double bytes = static_cast<double>(total) * sizeof(float);
      const double bus_factor = 2.0 * (ranks - 1) / ranks;
      double best_raw = std::min(median(variants[0].times), median(variants[1].times));
      std::printf("# %s gradients: %zu parameters, %zu floats (%.1f MB), %d ranks, %zu iterations in %d "
                  "rounds (medians; each the slowest rank's time)\n",
                  model == "gpt2" ? "GPT-2 small" : "wide MLP", shapes.size(), total, bytes / 1e6, ranks,
                  variants[0].times.size(), rounds);
      const double cap_mib = static_cast<double>(weft_sum->bucket_choice().bucket_bytes) / (1 << 20);
      std::printf("# weft plan: %zu buckets, cap %.3g MiB, first %.3g MiB, pad %zu\n# %s\n",
                  weft_sum->plan().buckets().size(), cap_mib, first_mib, pad,
                  weft_sum->bucket_choice().describe().c_str());
      std::printf("%-18s %10s %10s %10s %12s %12s %12s %12s %8s\n", "variant", "median_ms", "min_ms", "max_ms",
                  "algbw_GB/s", "busbw_GB/s", "vs_best_mpi", "faults/iter", "fill_ms");
      for (const variant& v : variants) {
        double m = median(v.times);
        std::printf("%-18s %10.1f %10.1f %10.1f %12.2f %12.2f %12.2f %12ld %8.1f\n", v.name.c_str(), m * 1e3,
                    *std::min_element(v.times.begin(), v.times.end()) * 1e3,
                    *std::max_element(v.times.begin(), v.times.end()) * 1e3, bytes / m / 1e9,
                    bytes / m / 1e9 * bus_factor, m / best_raw, v.faults / static_cast<long>(v.times.size()),
                    median(v.fill_times) * 1e3);
      }
      if (ddp_s > 0) {
        std::printf("%-18s %10.1f %10.1f %10.1f %12.2f %12.2f %12.2f   (backward without sync: %.1f ms)\n", "torch_ddp",
                    ddp_s * 1e3, *std::min_element(ddp_times.begin(), ddp_times.end()) * 1e3,
                    *std::max_element(ddp_times.begin(), ddp_times.end()) * 1e3, bytes / ddp_s / 1e9, bytes / ddp_s / 1e9 * bus_factor, ddp_s / best_raw,
                    ddp_backward_only_s * 1e3);
      } else if (ddp_status == "failed") {
        std::printf("%-18s (not run: DDP FAILED: %s)\n", "torch_ddp", ddp_reason.c_str());
      } else {
        std::printf("%-18s (not run: %s)\n", "torch_ddp", ddp_reason.c_str());
      }
      double weft_s = median(variants[2].times);
      std::printf("# weft / best raw MPI = %.3f (target <= 1.00)", weft_s / best_raw);
      if (ddp_s > 0) std::printf(", weft / DDP = %.3f (target <= 0.50)", weft_s / ddp_s);
      if (ddp_status == "failed") std::printf(", weft / DDP not measured: DDP failed");
      std::printf("\n# results %s\n", correct ? "correct" : "WRONG");
      if (sweep) {
        // The cap the probe chose against the best swept one, in the same run.
        const variant* best_swept = nullptr;
        for (const variant& v : variants)
          if (v.name.rfind("weft_cap", 0) == 0 && (!best_swept || median(v.times) < median(best_swept->times)))
            best_swept = &v;
        if (best_swept) {
          std::printf("# weft (cap %.3g MiB) / best swept cap (%s) = %.3f (target <= 1.03)\n", cap_mib,
                      best_swept->name.c_str() + 8, weft_s / median(best_swept->times));
          // The same plan in a synchronizer made after the others, like the swept ones: the
          // comparison of caps on buffers of the same history.
          for (const variant& v : variants)
            if (v.name == "weft_default_late")
              std::printf("# the default's plan made last / best swept cap = %.3f (target <= 1.03)\n",
                          median(v.times) / median(best_swept->times));
        }
      }
      const auto named = [&](std::string_view name) -> const variant* {
        for (const variant& v : variants)
          if (v.name == name) return &v;
        return nullptr;
      };
      if (in_flight)
        std::printf("# two buckets in flight / one = %.3f (medians; it pays below 1)\n",
                    median(named("in_flight_2")->times) / median(named("in_flight_1")->times));
      std::printf("%s", weft_sum->plan().describe().c_str());
      if (!json_path.empty()) {
        std::ofstream out(json_path);
        out << "{\"weft_s\": " << json_value(weft_s) << ", \"weft_mean_s\": " << json_value(median(variants[3].times))
            << ", \"ddp_s\": " << json_value(ddp_s) << ", \"ddp_backward_only_s\": " << json_value(ddp_backward_only_s)
            << ", \"mpi_flat_s\": " << json_value(median(variants[0].times))
            << ", \"mpi_per_tensor_s\": " << json_value(median(variants[1].times)) << ", \"ranks\": " << ranks
            << ", \"iterations\": " << variants[0].times.size() << ", \"ddp_iterations\": " << ddp_times.size()
            << ", \"ddp_status\": " << weft_programs::json_string(ddp_status)
            << ", \"ddp_reason\": " << (ddp_reason.empty() ? "null" : weft_programs::json_string(ddp_reason))
            << ", \"model\": " << weft_programs::json_string(model) << ", \"layers\": " << layers << ", \"bucket_bytes\": " << weft_sum->bucket_choice().bucket_bytes
            << ", \"bucket_cap_measured\": " << (given_cap ? "false" : "true");
        if (in_flight)
          out << ", \"in_flight_1_s\": " << json_value(median(named("in_flight_1")->times))
              << ", \"in_flight_2_s\": " << json_value(median(named("in_flight_2")->times));
        out << "}\n";
      }
    }
    if (!correct) exit_code = 1;
    MPI_Comm_free(&raw);
    return exit_code;
  });
}
