// Does gradient communication hide behind backward? A synthetic backward over GPT-2 small's 12
// transformer blocks (85,054,464 floats, 340 MB) whose compute takes 1.5x the time the reduction
// takes alone, run twice per iteration: serially (compute all, then reduce_all()) and overlapped
// (mark each block's gradients ready as its backward ends, then finish()). Once with compute that
// leaves the CPU free (sleep, as a GPU's kernels would) and once with real CPU compute.
//
//   mpirun -n 2 weft_bench_overlap [--iterations 7] [--warmup 1] [--json FILE] [--report] [--bf16]
//
// Target (sleep compute): overlapped step <= compute + 0.2 x communication.
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/synchronizer.hpp>

#include "../grad_sync/bench_args.hpp"
#include "../grad_sync/gpt2_shapes.hpp"
#include "json_output.hpp"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

using namespace weft_bench;
using comm_t = weft::communicator<weft::mpi_backend>;
using sync_t = weft::grad::synchronizer<weft::mpi_backend, float>;

namespace {

constexpr int layers = 12;
constexpr std::size_t params_per_layer = 12;

enum class compute_kind { sleep, cpu };

volatile double sink = 0;

// `seconds` of compute: a sleep (the CPU is free, as while a GPU computes), or arithmetic on a
// small in-cache array until the time is up (the CPU is busy, as in a CPU trainer).
void compute(compute_kind kind, double seconds) {
  if (kind == compute_kind::sleep) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return;
  }
  double a[64];
  for (int i = 0; i < 64; ++i) a[i] = 1.0 + i * 1e-3;
  const double end = now_s() + seconds;
  while (now_s() < end)
    for (int r = 0; r < 256; ++r)
      for (int i = 0; i < 64; ++i) a[i] = a[i] * 0.9999999 + 1e-7;
  sink = sink + a[7];
}

struct results {
  double compute_s = 0, comm_s = 0, step_overlap_s = 0, step_serial_s = 0;
  std::string report;
};

template <class Sync>
results measure(Sync& sync, MPI_Comm raw, compute_kind kind, double comm_s, int warmup, int iterations,
                bool want_report) {
  const double per_layer = 1.5 * comm_s / layers;
  std::vector<double> compute_only, serial, overlapped;
  results r;
  r.comm_s = comm_s;
  for (int it = 0; it < warmup + iterations; ++it) {
    for (int variant = 0; variant < 3; ++variant) {
      int v = (variant + it) % 3;
      MPI_Barrier(raw);
      double t = now_s();
      if (v == 0) {  // compute alone
        for (int l = layers; l-- > 0;) compute(kind, per_layer);
      } else if (v == 1) {  // no overlap: backward, then the whole reduction
        for (int l = layers; l-- > 0;) compute(kind, per_layer);
        sync.reduce_all();
      } else {  // overlap: each block's gradients go as soon as its backward is done
        for (int l = layers; l-- > 0;) {
          compute(kind, per_layer);
          for (std::size_t p = params_per_layer; p-- > 0;) sync.mark_ready(static_cast<std::size_t>(l) * params_per_layer + p);
        }
        sync.finish();
      }
      t = max_over_ranks(now_s() - t, raw);
      if (v == 2 && want_report) r.report = sync.last_report().describe();
      if (it < warmup) continue;
      (v == 0 ? compute_only : v == 1 ? serial : overlapped).push_back(t);
    }
  }
  r.compute_s = median(compute_only);
  r.step_serial_s = median(serial);
  r.step_overlap_s = median(overlapped);
  return r;
}

void print(const char* title, const results& r) {
  std::printf("%-6s compute %8.1f ms   comm %8.1f ms   serial step %8.1f ms   overlapped step %8.1f ms   "
              "exposed comm %6.1f ms = %.2f x comm (target <= 0.20 with sleep compute)\n",
              title, r.compute_s * 1e3, r.comm_s * 1e3, r.step_serial_s * 1e3, r.step_overlap_s * 1e3,
              (r.step_overlap_s - r.compute_s) * 1e3, (r.step_overlap_s - r.compute_s) / r.comm_s);
}

std::string json_of(const results& r) {
  return "\"compute_s\": " + json_value(r.compute_s) + ", \"comm_s\": " + json_value(r.comm_s) +
         ", \"step_overlap_s\": " + json_value(r.step_overlap_s) + ", \"step_serial_s\": " + json_value(r.step_serial_s);
}

constexpr const char* usage_text =
    "usage: mpirun -n RANKS weft_bench_overlap [options]\n"
    "  --iterations N   timed iterations of each variant [7]\n"
    "  --warmup N       untimed iterations first [1]\n"
    "  --report         print the synchronizer's report of the last overlapped step\n"
    "  --bf16           bfloat16 gradients reduced in float (precision = fp32), not float gradients\n"
    "  --json FILE      write the results as JSON\n";

/// The whole measurement for one synchronizer (its gradients set to `one`).
template <class Sync, class T>
void run(Sync& sync, comm_t& dp, MPI_Comm raw, int iterations, int warmup, const std::string& json_path,
         bool want_report, T one) {
  std::size_t total = 0;
  for (const auto& s : gpt2_small_shapes(layers, /*blocks_only=*/true)) {
    sync.add_param(s.name, s.count());
    total += s.count();
  }
  sync.freeze();
  std::fill(sync.grads().all().begin(), sync.grads().all().end(), one);

  // The communication time: the whole reduction with nothing else running (the slowest rank's).
  std::vector<double> comm;
  for (int it = 0; it < warmup + iterations; ++it) {
    MPI_Barrier(raw);
    double t = now_s();
    sync.reduce_all();
    t = max_over_ranks(now_s() - t, raw);
    if (it >= warmup) comm.push_back(t);
  }
  const double comm_s = median(comm);

  results gpu_like = measure(sync, raw, compute_kind::sleep, comm_s, warmup, iterations, want_report);
  results cpu = measure(sync, raw, compute_kind::cpu, comm_s, warmup, iterations, false);

  if (dp.rank() == 0) {
    std::printf("# synthetic backward: %d GPT-2 blocks, %zu %s gradients (%.1f MB), %zu buckets, %d ranks, "
                "compute = 1.5 x comm, medians of %d (slowest rank)\n",
                layers, total, sizeof(T) == 2 ? "bfloat16 (reduced in float)" : "float",
                static_cast<double>(total * sizeof(T)) / 1e6, sync.plan().buckets().size(), dp.size(), iterations);
    print("sleep", gpu_like);
    print("cpu", cpu);
    double bound = gpu_like.compute_s + 0.2 * gpu_like.comm_s;
    std::printf("# sleep compute: overlapped step %.1f ms vs target %.1f ms: %s\n", gpu_like.step_overlap_s * 1e3,
                bound * 1e3, gpu_like.step_overlap_s <= bound ? "met" : "MISSED");
    if (want_report) std::printf("# last overlapped step on rank 0:\n%s", gpu_like.report.c_str());
    if (!json_path.empty()) {
      std::ofstream out = weft_programs::open_json_output(json_path);
      out << "{" << json_of(gpu_like) << ", \"cpu\": {" << json_of(cpu) << "}, \"ranks\": " << dp.size()
          << ", \"iterations\": " << iterations << "}\n";
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  return weft_programs::mpi_main("weft_bench_overlap", usage_text, argc, argv, [&](int world_rank) {
    check_arguments(argc, argv, {"--iterations", "--warmup", "--json"}, {"--report", "--bf16", "--help", "-h"});
    if (flag(argc, argv, "--help") || flag(argc, argv, "-h")) {
      if (world_rank == 0) std::printf("%s", usage_text);
      return 0;
    }
    using weft_programs::parse_integer;
    const int iterations = parse_integer("--iterations", option(argc, argv, "--iterations", "7"), 1, 1 << 20);
    const int warmup = parse_integer("--warmup", option(argc, argv, "--warmup", "1"), 0, 1 << 20);
    const std::string json_path = option(argc, argv, "--json");
    const bool want_report = flag(argc, argv, "--report");

    comm_t dp(weft::mpi_backend::comm::world(), "dp");
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);

    if (flag(argc, argv, "--bf16")) {
      weft::grad::synchronizer<weft::mpi_backend, weft::bfloat16> sync(
          dp, {.precision = weft::grad::reduce_precision::fp32, .warn_if_not_overlapped = true});
      run(sync, dp, raw, iterations, warmup, json_path, want_report, weft::bfloat16(1.0f));
    } else {
      sync_t sync(dp, {.warn_if_not_overlapped = true});
      run(sync, dp, raw, iterations, warmup, json_path, want_report, 1.0f);
    }
    MPI_Comm_free(&raw);
    return 0;
  });
}
