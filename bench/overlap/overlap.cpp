// Does gradient communication hide behind backward? A synthetic backward over GPT-2 small's 12
// transformer blocks (85,054,464 floats, 340 MB) whose compute takes 1.5x the time the reduction
// takes alone, run twice per iteration: serially (compute all, then reduce_all()) and overlapped
// (mark each block's gradients ready as its backward ends, then finish()). Once with compute that
// leaves the CPU free (sleep, as a GPU's kernels would), once with real CPU compute that runs for
// the time (cpu), and once with a fixed amount of CPU work calibrated to take that time alone
// (work): there, CPU time the communication takes from compute lengthens the step, as in a CPU
// trainer, instead of being absorbed by a loop that stops at a deadline. For `work`, the machine's
// idle CPU time (/proc/stat) and the ranks' own CPU time (getrusage, every thread) are read around
// each variant: communication that needs C CPU-seconds in W seconds alone can hide at most
// min(W, I x W / C) behind compute during which the machine had I idle CPU-seconds.
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

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
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

enum class compute_kind { sleep, cpu, work };

volatile double sink = 0;
double blocks_per_second = 0;  // of arithmetic_blocks on this rank, both ranks computing (calibrated)

// Arithmetic on a small in-cache array, in blocks of 256 x 64 multiply-adds, until `done` says so.
template <class Done>
void arithmetic(Done&& done) {
  double a[64];
  for (int i = 0; i < 64; ++i) a[i] = 1.0 + i * 1e-3;
  for (long block = 0; !done(block); ++block)
    for (int r = 0; r < 256; ++r)
      for (int i = 0; i < 64; ++i) a[i] = a[i] * 0.9999999 + 1e-7;
  sink = sink + a[7];
}

// `seconds` of compute: a sleep (the CPU is free, as while a GPU computes), arithmetic until the
// time is up (cpu), or the arithmetic blocks that take `seconds` alone (work).
void compute(compute_kind kind, double seconds) {
  if (kind == compute_kind::sleep) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  } else if (kind == compute_kind::cpu) {
    const double end = now_s() + seconds;
    arithmetic([&](long) { return now_s() >= end; });
  } else {
    const long blocks = std::lround(seconds * blocks_per_second);
    arithmetic([&](long block) { return block >= blocks; });
  }
}

// Blocks per second with every rank computing and nothing else of this program running: the
// fastest of three 0.3 s runs.
void calibrate(MPI_Comm raw) {
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    MPI_Barrier(raw);
    const double start = now_s(), end = start + 0.3;
    long blocks = 0;
    arithmetic([&](long block) {
      blocks = block;
      return now_s() >= end;
    });
    best = std::max(best, static_cast<double>(blocks) / (now_s() - start));
  }
  blocks_per_second = best;
}

// CPU-seconds: the machine's idle time (idle + iowait over every CPU, /proc/stat) and this
// process's own (user + system, every thread).
double machine_idle_s() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, system = 0, idle = 0, iowait = 0;
  stat >> cpu >> user >> nice >> system >> idle >> iowait;
  return (idle + iowait) / static_cast<double>(sysconf(_SC_CLK_TCK));
}
double process_cpu_s() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}
double sum_over_ranks(double local, MPI_Comm comm) {
  double out = 0;
  MPI_Allreduce(&local, &out, 1, MPI_DOUBLE, MPI_SUM, comm);
  return out;
}

struct results {
  double compute_s = 0, comm_s = 0, step_overlap_s = 0, step_serial_s = 0;
  // `work` only (medians): the machine's idle CPU-seconds during compute alone and during the
  // overlapped step, and the ranks' CPU-seconds in each.
  double idle_compute_s = 0, idle_overlap_s = 0, cpu_compute_s = 0, cpu_overlap_s = 0;
  std::string report;
};

template <class Sync>
results measure(Sync& sync, MPI_Comm raw, compute_kind kind, double comm_s, int warmup, int iterations,
                bool want_report) {
  const double per_layer = 1.5 * comm_s / layers;
  std::vector<double> compute_only, serial, overlapped, idle_compute, idle_overlap, cpu_compute, cpu_overlap;
  results r;
  r.comm_s = comm_s;
  for (int it = 0; it < warmup + iterations; ++it) {
    for (int variant = 0; variant < 3; ++variant) {
      int v = (variant + it) % 3;
      MPI_Barrier(raw);
      const double idle_before = machine_idle_s(), cpu_before = process_cpu_s();
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
      const double idle = machine_idle_s() - idle_before, cpu = process_cpu_s() - cpu_before;
      t = max_over_ranks(now_s() - t, raw);
      const double ranks_cpu = sum_over_ranks(cpu, raw), machine_idle = max_over_ranks(idle, raw);
      if (v == 2 && want_report) r.report = sync.last_report().describe();
      if (it < warmup) continue;
      (v == 0 ? compute_only : v == 1 ? serial : overlapped).push_back(t);
      if (v == 0) {
        idle_compute.push_back(machine_idle);
        cpu_compute.push_back(ranks_cpu);
      } else if (v == 2) {
        idle_overlap.push_back(machine_idle);
        cpu_overlap.push_back(ranks_cpu);
      }
    }
  }
  r.compute_s = median(compute_only);
  r.step_serial_s = median(serial);
  r.step_overlap_s = median(overlapped);
  r.idle_compute_s = median(idle_compute);
  r.idle_overlap_s = median(idle_overlap);
  r.cpu_compute_s = median(cpu_compute);
  r.cpu_overlap_s = median(cpu_overlap);
  return r;
}

void print(const char* title, const results& r) {
  std::printf("%-6s compute %8.1f ms   comm %8.1f ms   serial step %8.1f ms   overlapped step %8.1f ms   "
              "exposed comm %6.1f ms = %.2f x comm (target <= 0.20 with sleep compute)\n",
              title, r.compute_s * 1e3, r.comm_s * 1e3, r.step_serial_s * 1e3, r.step_overlap_s * 1e3,
              (r.step_overlap_s - r.compute_s) * 1e3, (r.step_overlap_s - r.compute_s) / r.comm_s);
}

// A number that may be negative (json_value writes those as null, "absent"): the hidden time is
// negative when overlapping made the step longer than compute plus the reduction.
std::string signed_json(double v) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.6f", v);
  return text;
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
  std::vector<double> comm, comm_cpu;
  for (int it = 0; it < warmup + iterations; ++it) {
    MPI_Barrier(raw);
    const double cpu_before = process_cpu_s();
    double t = now_s();
    sync.reduce_all();
    const double cpu = process_cpu_s() - cpu_before;
    t = max_over_ranks(now_s() - t, raw);
    const double ranks_cpu = sum_over_ranks(cpu, raw);
    if (it >= warmup) {
      comm.push_back(t);
      comm_cpu.push_back(ranks_cpu);
    }
  }
  const double comm_s = median(comm), comm_cpu_s = median(comm_cpu);

  results gpu_like = measure(sync, raw, compute_kind::sleep, comm_s, warmup, iterations, want_report);
  results cpu = measure(sync, raw, compute_kind::cpu, comm_s, warmup, iterations, false);
  calibrate(raw);
  results work = measure(sync, raw, compute_kind::work, comm_s, warmup, iterations, false);
  // What idle CPU time allows: the communication runs at comm_cpu_s / comm_s CPUs when alone.
  const double hide_limit_s = std::min(comm_s, work.idle_compute_s * comm_s / std::max(comm_cpu_s, 1e-9));
  const double hidden_s = comm_s - (work.step_overlap_s - work.compute_s);

  if (dp.rank() == 0) {
    std::printf("# synthetic backward: %d GPT-2 blocks, %zu %s gradients (%.1f MB), %zu buckets, %d ranks, "
                "compute = 1.5 x comm, medians of %d (slowest rank)\n",
                layers, total, sizeof(T) == 2 ? "bfloat16 (reduced in float)" : "float",
                static_cast<double>(total * sizeof(T)) / 1e6, sync.plan().buckets().size(), dp.size(), iterations);
    print("sleep", gpu_like);
    print("cpu", cpu);
    print("work", work);
    std::printf("# work: communication alone %.1f ms using %.1f ms of the ranks' CPU (%.2f CPUs); compute alone "
                "%.1f ms with %.1f ms of the machine's CPU idle; so at most %.1f ms (%.2f x comm) can hide; hidden "
                "%.1f ms = %.2f x comm, %.2f of that limit (ranks' CPU: %.1f ms compute alone, %.1f ms overlapped; "
                "idle during the overlapped step %.1f ms)\n",
                comm_s * 1e3, comm_cpu_s * 1e3, comm_cpu_s / comm_s, work.compute_s * 1e3, work.idle_compute_s * 1e3,
                hide_limit_s * 1e3, hide_limit_s / comm_s, hidden_s * 1e3, hidden_s / comm_s,
                hide_limit_s > 0 ? hidden_s / hide_limit_s : 0.0, work.cpu_compute_s * 1e3, work.cpu_overlap_s * 1e3,
                work.idle_overlap_s * 1e3);
    double bound = gpu_like.compute_s + 0.2 * gpu_like.comm_s;
    std::printf("# sleep compute: overlapped step %.1f ms vs target %.1f ms: %s\n", gpu_like.step_overlap_s * 1e3,
                bound * 1e3, gpu_like.step_overlap_s <= bound ? "met" : "MISSED");
    if (want_report) std::printf("# last overlapped step on rank 0:\n%s", gpu_like.report.c_str());
    if (!json_path.empty()) {
      std::ofstream out = weft_programs::open_json_output(json_path);
      out << "{" << json_of(gpu_like) << ", \"cpu\": {" << json_of(cpu) << "}, \"work\": {" << json_of(work)
          << ", \"comm_cpu_s\": " << json_value(comm_cpu_s) << ", \"idle_during_compute_s\": "
          << json_value(work.idle_compute_s) << ", \"hide_limit_s\": " << json_value(hide_limit_s)
          << ", \"hidden_s\": " << signed_json(hidden_s) << "}, \"ranks\": " << dp.size()
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
