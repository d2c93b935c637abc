// Does the executor run each schedule as the verifier predicts? Every schedule on the ranks of
// the job (4 in the reference run), with stage work that leaves the CPU free (a sleep of F ms per
// forward, B per backward, W of it the weight gradient, as a GPU's kernels would), so that several
// ranks on few cores measure the scheduling and the messages, not the CPU. The measured bubble,
// 1 - (sum over ranks of time in the callbacks) / (ranks x step time), is set against verify()'s
// prediction for the nominal costs, and for the mean measured action times plus the measured
// point-to-point latency (pred_actual: the verifier's model fed what the run really did).
//
//   mpirun -n 4 weft_bench_pipeline [--micro-batches 8] [--forward-ms 4] [--backward-ms 8]
//                                   [--weight-ms 4] [--steps 5] [--elements 1024] [--json FILE]
//
// Target: the measured bubble within 10 % (relative) of pred_actual.
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/schedules.hpp>
#include <weft/pipeline/verify.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace wp = weft::pipeline;
using comm_t = weft::communicator<weft::mpi_backend>;

namespace {

struct args {
  int micro_batches = 8, steps = 5, elements = 1024;
  double forward_ms = 4, backward_ms = 8, weight_ms = 4;
  std::string json;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "weft_bench_pipeline: %s\nusage: weft_bench_pipeline [--micro-batches N] [--forward-ms F] "
               "[--backward-ms B] [--weight-ms W] [--steps S] [--elements E] [--json FILE]\n",
               why.c_str());
  std::exit(2);
}

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage(flag + " needs a value");
    const std::string value = argv[++i];
    char* end = nullptr;
    const double number = std::strtod(value.c_str(), &end);
    const bool numeric = end != value.c_str() && *end == '\0';
    if (flag == "--json") a.json = value;
    else if (!numeric || number < 0) usage(flag + "='" + value + "' is not a non-negative number");
    else if (flag == "--micro-batches") a.micro_batches = static_cast<int>(number);
    else if (flag == "--steps") a.steps = static_cast<int>(number);
    else if (flag == "--elements") a.elements = static_cast<int>(number);
    else if (flag == "--forward-ms") a.forward_ms = number;
    else if (flag == "--backward-ms") a.backward_ms = number;
    else if (flag == "--weight-ms") a.weight_ms = number;
    else usage("unknown flag " + flag);
  }
  if (a.micro_batches < 1 || a.steps < 1 || a.elements < 1 || a.forward_ms <= 0 || a.backward_ms <= 0 ||
      a.weight_ms >= a.backward_ms)
    usage("give micro-batches, steps, elements >= 1, F and B > 0, and W < B");
  return a;
}

void work(double ms) { std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms)); }

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// One-way latency of a message of `elements` floats between neighbours, by ping-pong.
double p2p_latency_ms(comm_t& pp, int elements) {
  std::vector<float> buffer(static_cast<std::size_t>(elements));
  const int rounds = 50;
  const int peer = pp.rank() ^ 1;
  if (peer >= pp.size()) {
    pp.barrier();
    return 0;
  }
  const double t0 = now_s();
  for (int r = 0; r < rounds; ++r) {
    if (pp.rank() % 2 == 0) {
      pp.send(buffer, peer);
      pp.recv(buffer, peer);
    } else {
      pp.recv(buffer, peer);
      pp.send(buffer, peer);
    }
  }
  const double one_way = (now_s() - t0) / (2.0 * rounds) * 1e3;
  pp.barrier();
  return one_way;
}

struct row {
  std::string name;
  double step_ms = 0, measured = 0, predicted = 0, predicted_comm = 0, error = 0, error_nominal = 0;
  long long predicted_makespan_ms = 0;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const args a = parse(argc, argv);
  int status = 0;
  {
    comm_t pp(weft::mpi_backend::comm::world(), "pp");
    const int p = pp.size();
    double latency = p2p_latency_ms(pp, a.elements);
    pp.all_reduce(std::span<double>(&latency, 1), weft::reduce_op::max);

    std::vector<row> rows;
    struct config {
      wp::schedule_kind kind;
      int v;
    };
    for (config c : {config{wp::schedule_kind::gpipe, 1}, config{wp::schedule_kind::one_f_one_b, 1},
                     config{wp::schedule_kind::interleaved, 2}, config{wp::schedule_kind::zb_h1, 1}}) {
      if (c.kind == wp::schedule_kind::interleaved && (p < 2 || a.micro_batches % p != 0)) continue;
      const wp::schedule s = wp::make_schedule(
          {.kind = c.kind, .stages = p, .micro_batches = a.micro_batches, .virtual_stages = c.v});
      // Per-chunk costs: a chunk holds 1/v of the stage's layers.
      const double f = a.forward_ms / c.v, b = a.backward_ms / c.v, w = a.weight_ms / c.v;
      const bool split = s.split_backward;
      double busy_ms = 0;
      // Per kind (F, B, W): time slept and count, over the measured steps, for the prediction with
      // the costs the actions really had (a sleep overshoots by the scheduler's wake-up latency).
      double spent[6] = {0, 0, 0, 0, 0, 0};
      bool measuring = false;
      wp::stage_callbacks<float> cb;
      auto timed = [&](int kind, double ms) {
        const double t0 = now_s();
        work(ms);
        const double took = (now_s() - t0) * 1e3;
        busy_ms += took;
        if (measuring) {
          spent[kind] += took;
          spent[3 + kind] += 1;
        }
      };
      cb.forward = [&](int, int, std::span<const float>, std::span<float>) { timed(0, f); };
      cb.backward = [&](int, int, std::span<const float>, std::span<float>) { timed(1, split ? b - w : b); };
      cb.weight = [&](int, int) { timed(2, w); };
      wp::executor<weft::mpi_backend, float> exec(pp, s, cb, {.elements = static_cast<std::size_t>(a.elements)});
      std::vector<double> measured;
      std::vector<double> steps;
      for (int step = 0; step < a.steps + 1; ++step) {
        busy_ms = 0;
        measuring = step > 0;
        pp.barrier();
        const double t0 = now_s();
        exec.run();
        double span_ms = (now_s() - t0) * 1e3;
        double sums[2] = {busy_ms, 0};
        pp.all_reduce(std::span<double>(sums, 1), weft::reduce_op::sum);
        pp.all_reduce(std::span<double>(&span_ms, 1), weft::reduce_op::max);
        if (step == 0) continue;  // warm-up
        measured.push_back(1.0 - sums[0] / (p * span_ms));
        steps.push_back(span_ms);
      }
      std::sort(measured.begin(), measured.end());
      std::sort(steps.begin(), steps.end());
      // The prediction in 1/100 ms units.
      auto units = [](double ms) { return static_cast<std::int64_t>(std::llround(ms * 100)); };
      wp::costs costs{.forward = units(f), .backward = units(b), .weight = units(w), .comm = 0};
      const wp::verify_report plain = wp::verify(s, costs);
      pp.all_reduce(std::span<double>(spent, 6), weft::reduce_op::sum);
      const double mf = spent[0] / spent[3];
      const double mb = spent[1] / spent[4];
      const double mw = split ? spent[2] / spent[5] : 0;
      // Measured: the whole backward is B's part plus W's when split.
      wp::costs actual{.forward = units(mf), .backward = units(mb + mw), .weight = split ? units(mw) : 0,
                       .comm = units(latency)};
      const wp::verify_report with_comm = wp::verify(s, actual);
      row r;
      r.name = std::string(wp::to_string(c.kind)) + (c.v > 1 ? " v=" + std::to_string(c.v) : "");
      r.measured = measured[measured.size() / 2];
      r.step_ms = steps[steps.size() / 2];
      r.predicted = plain.bubble_fraction;
      r.predicted_comm = with_comm.bubble_fraction;
      r.predicted_makespan_ms = plain.makespan / 100;
      r.error = std::abs(r.measured - r.predicted_comm) / r.predicted_comm;
      r.error_nominal = std::abs(r.measured - r.predicted) / r.predicted;
      rows.push_back(r);
    }

    if (pp.rank() == 0) {
      std::printf("# weft_bench_pipeline: %d ranks, %d micro-batches, F=%g ms B=%g ms W=%g ms, %d floats per message, "
                  "p2p latency %.3f ms, median of %d steps\n",
                  p, a.micro_batches, a.forward_ms, a.backward_ms, a.weight_ms, a.elements, latency, a.steps);
      std::printf("%-16s %9s %9s %9s %10s %9s %12s %8s\n", "schedule", "step_ms", "pred_ms", "bubble", "predicted",
                  "error", "pred_actual", "error");
      bool all_met = true;
      for (const row& r : rows) {
        std::printf("%-16s %9.1f %9lld %8.2f%% %9.2f%% %8.1f%% %11.2f%% %7.1f%%\n", r.name.c_str(), r.step_ms,
                    r.predicted_makespan_ms, 100 * r.measured, 100 * r.predicted, 100 * r.error_nominal,
                    100 * r.predicted_comm, 100 * r.error);
        all_met = all_met && r.error <= 0.10;
      }
      std::printf("predicted: verify() with the nominal costs; pred_actual: with the mean measured action times and "
                  "the p2p latency; error: relative to each\n");
      std::printf("target (measured bubble within 10 %% of pred_actual for every schedule): %s\n",
                  all_met ? "met" : "NOT met");
      if (!a.json.empty()) {
        std::ofstream out(a.json);
        out << "{\"ranks\": " << p << ", \"micro_batches\": " << a.micro_batches << ", \"forward_ms\": " << a.forward_ms
            << ", \"backward_ms\": " << a.backward_ms << ", \"weight_ms\": " << a.weight_ms
            << ", \"elements\": " << a.elements << ", \"p2p_latency_ms\": " << latency
            << ", \"target_met\": " << (all_met ? "true" : "false") << ", \"schedules\": [";
        for (std::size_t i = 0; i < rows.size(); ++i) {
          const row& r = rows[i];
          out << (i ? ", " : "") << "{\"schedule\": \"" << r.name << "\", \"step_ms\": " << r.step_ms
              << ", \"predicted_step_ms\": " << r.predicted_makespan_ms << ", \"bubble\": " << r.measured
              << ", \"predicted_bubble\": " << r.predicted << ", \"predicted_bubble_with_comm\": " << r.predicted_comm
              << ", \"relative_error\": " << r.error << ", \"relative_error_nominal\": " << r.error_nominal << "}";
        }
        out << "]}\n";
        if (!out) {
          std::fprintf(stderr, "weft_bench_pipeline: cannot write %s\n", a.json.c_str());
          status = 1;
        }
      }
    }
  }
  MPI_Finalize();
  return status;
}
