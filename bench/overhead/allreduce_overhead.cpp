// What weft's communicator costs on top of MPI: weft's blocking all_reduce against a raw
// MPI_Allreduce on the same communicator and the same buffers, for every size from -b to -e.
//
// Both are timed in one run, interleaved call by call: a repetition is one weft call and one raw
// call, back to back, alternating which goes first, each timed on its own. Interleaving at the
// finest grain means drift and bursts of noise (other processes taking the cores, frequency
// changes) hit both alike. A call's time is the slowest rank's (the per-call times are reduced
// with MAX across ranks after the run); the reported times are medians over repetitions, and the
// ratio is median(weft) / median(raw) (the median of the per-repetition ratios is reported too).
//
//   mpirun -n 2 allreduce_overhead -b 4 -e 256M -f 4 --json overhead.json
//   mpirun -n 2 allreduce_overhead --checks local ...   (weft without the default call agreement)
//
// Target: ratio <= 1.02 from 64 KiB up, <= 1.10 below (--enforce makes a miss exit non-zero).
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "command_line.hpp"

namespace {

using weft_programs::parse_bytes;
using weft_programs::parse_integer;
using weft_programs::usage_error;

struct options {
  std::size_t min_bytes = 4;
  std::size_t max_bytes = std::size_t{256} << 20;
  std::size_t factor = 4;
  int min_reps = 15;
  int max_reps = 1000;
  std::size_t budget_bytes = std::size_t{1} << 30;  // per size and kind: about this many bytes reduced
  int warmup = 3;
  bool in_place = false;
  bool enforce = false;
  std::optional<weft::check_level> checks;  // nullopt: the communicator's default
  std::string checks_name = "default";
  std::string json_path;
  bool help = false;
};

constexpr const char* usage_text =
    "usage: mpirun -n RANKS allreduce_overhead [options]\n"
    "  -b SIZE          smallest message in bytes (K, M, G suffixes) [4]\n"
    "  -e SIZE          largest message [256M]\n"
    "  -f N             size factor between steps [4]\n"
    "  --budget S       repetitions per size: about S bytes reduced by each kind [1G]\n"
    "  --min-reps N     at least N repetitions per size [15]\n"
    "  --max-reps N     at most N repetitions per size [1000]\n"
    "  --warmup N       untimed calls of each kind per size [3]\n"
    "  --in-place       in-place all-reduce (MPI_IN_PLACE) instead of out-of-place\n"
    "  --enforce        exit 1 when a size misses the target\n"
    "  --checks LEVEL   weft's check level: local, agreement, communication or fingerprint\n"
    "                   [the default: WEFT_CHECK_LEVEL, else agreement]\n"
    "  --json FILE      write [{\"ranks\", \"bytes\", \"weft_s\", \"raw_s\", \"ratio\", ...}]\n";

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error("option '" + arg + "' needs a value");
      return argv[++i];
    };
    if (arg == "-b") o.min_bytes = parse_bytes(arg, value());
    else if (arg == "-e") o.max_bytes = parse_bytes(arg, value());
    else if (arg == "-f") o.factor = parse_integer<std::size_t>(arg, value(), 2, 1 << 20);
    else if (arg == "--budget") o.budget_bytes = parse_bytes(arg, value());
    else if (arg == "--min-reps") o.min_reps = parse_integer(arg, value(), 1, 1 << 24);
    else if (arg == "--max-reps") o.max_reps = parse_integer(arg, value(), 1, 1 << 24);
    else if (arg == "--warmup") o.warmup = parse_integer(arg, value(), 0, 1 << 20);
    else if (arg == "--in-place") o.in_place = true;
    else if (arg == "--enforce") o.enforce = true;
    else if (arg == "--checks") {
      o.checks_name = value();
      if (o.checks_name == "local") o.checks = weft::check_level::local;
      else if (o.checks_name == "agreement") o.checks = weft::check_level::agreement;
      else if (o.checks_name == "communication") o.checks = weft::check_level::communication;
      else if (o.checks_name == "fingerprint") o.checks = weft::check_level::fingerprint;
      else throw usage_error("--checks '" + o.checks_name + "' is not a check level: use local, agreement, communication or fingerprint");
    }
    else if (arg == "--json") o.json_path = value();
    else if (arg == "-h" || arg == "--help") o.help = true;
    else throw usage_error("unknown option '" + arg + "'");
  }
  if (o.min_bytes < sizeof(float)) throw usage_error("-b must be at least 4 bytes (one float)");
  if (o.max_bytes < o.min_bytes) throw usage_error("-e is smaller than -b");
  if (o.max_reps < o.min_reps) throw usage_error("--max-reps is smaller than --min-reps");
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The target for a message of `bytes`.
double target_for(std::size_t bytes) { return bytes >= (std::size_t{64} << 10) ? 1.02 : 1.10; }

struct row {
  std::size_t bytes = 0;
  int reps = 0;
  double weft_s = 0;
  double raw_s = 0;
  double ratio = 0;            // median(weft) / median(raw)
  double median_of_ratios = 0;
  double ratio_q1 = 0;         // quartiles of the per-repetition ratios, to show the noise
  double ratio_q3 = 0;
  bool correct = true;
};

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double position = q * static_cast<double>(v.size() - 1);
  const auto low = static_cast<std::size_t>(position);
  const std::size_t high = std::min(low + 1, v.size() - 1);
  const double frac = position - static_cast<double>(low);
  return v[low] * (1.0 - frac) + v[high] * frac;
}

row measure(weft::communicator<weft::mpi_backend>& comm, const options& o, std::size_t bytes,
            std::vector<float>& send, std::vector<float>& recv) {
  const std::size_t count = bytes / sizeof(float);
  const MPI_Comm raw_comm = comm.native().native();  // the very communicator weft uses
  std::span<const float> in(send.data(), count);
  std::span<float> out(recv.data(), count);
  auto weft_call = [&] {
    if (o.in_place) comm.all_reduce(out);
    else comm.all_reduce(in, out);
  };
  auto raw_call = [&] {
    MPI_Allreduce(o.in_place ? MPI_IN_PLACE : static_cast<const void*>(in.data()), out.data(),
                  static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw_comm);
  };
  // Same repetition count on every rank (derived from the size alone), so the ranks stay in step.
  const std::size_t wanted = o.budget_bytes / std::max<std::size_t>(bytes, 1);
  const int reps = static_cast<int>(std::clamp<std::size_t>(wanted, static_cast<std::size_t>(o.min_reps),
                                                            static_cast<std::size_t>(o.max_reps)));
  auto timed = [](auto&& call) {
    const auto start = std::chrono::steady_clock::now();
    call();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };

  for (int i = 0; i < o.warmup; ++i) {
    weft_call();
    raw_call();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::vector<double> times(2 * static_cast<std::size_t>(reps));  // weft, raw per repetition
  for (int rep = 0; rep < reps; ++rep) {
    double* t = &times[2 * static_cast<std::size_t>(rep)];
    if (rep % 2 == 0) {
      t[0] = timed(weft_call);
      t[1] = timed(raw_call);
    } else {
      t[1] = timed(raw_call);
      t[0] = timed(weft_call);
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, times.data(), 2 * reps, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  std::vector<double> weft_times, raw_times, ratios;
  for (int rep = 0; rep < reps; ++rep) {
    const double* t = &times[2 * static_cast<std::size_t>(rep)];
    weft_times.push_back(t[0]);
    raw_times.push_back(t[1]);
    ratios.push_back(t[0] / t[1]);
  }

  // Both paths must also compute the right thing: every rank contributes rank + 1.
  row r;
  const int n = comm.size();
  const float expected = static_cast<float>(n * (n + 1) / 2);
  int wrong = 0;
  for (int path = 0; path < 2; ++path) {
    std::fill(send.begin(), send.begin() + static_cast<std::ptrdiff_t>(count), static_cast<float>(comm.rank() + 1));
    if (o.in_place) std::copy(send.begin(), send.begin() + static_cast<std::ptrdiff_t>(count), recv.begin());
    if (path == 0) weft_call();
    else raw_call();
    for (std::size_t i = 0; i < count; ++i) wrong += recv[i] == expected ? 0 : 1;
  }
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);

  r.bytes = count * sizeof(float);
  r.reps = reps;
  r.weft_s = median(weft_times);
  r.raw_s = median(raw_times);
  r.ratio = r.weft_s / r.raw_s;
  r.median_of_ratios = median(ratios);
  r.ratio_q1 = quantile(ratios, 0.25);
  r.ratio_q3 = quantile(ratios, 0.75);
  r.correct = wrong == 0;
  return r;
}

int run(const options& o) {
  auto comm = weft::communicator<weft::mpi_backend>(weft::mpi_backend::comm::world(), "world");
  if (o.checks) comm.set_checks(*o.checks);
  const bool root = comm.rank() == 0;
  std::vector<float> send(o.max_bytes / sizeof(float), 1.0f);
  std::vector<float> recv(send.size(), 0.0f);
  if (root) {
    std::printf("# weft all_reduce vs raw MPI_Allreduce, float sum, %s, %d ranks, weft's checks: %s, interleaved call "
                "by call\n",
                o.in_place ? "in place" : "out of place", comm.size(), o.checks_name.c_str());
    std::printf("# times: median over repetitions of the slowest rank's time per call; ratio: median(weft) / "
                "median(raw);\n# per-repetition ratios weft/raw: median and quartiles q1..q3 (the noise)\n");
    std::printf("# %10s %6s %12s %12s %8s %9s %17s %8s %7s\n", "bytes", "reps", "weft (us)", "raw (us)", "ratio",
                "med.rat", "q1..q3", "target", "");
  }
  std::vector<row> rows;
  bool all_met = true;
  bool all_correct = true;
  for (std::size_t bytes = o.min_bytes;;) {
    row r = measure(comm, o, bytes, send, recv);
    const double target = target_for(r.bytes);
    const bool met = r.ratio <= target;
    all_met = all_met && met;
    all_correct = all_correct && r.correct;
    if (root) {
      std::printf("  %10zu %6d %12.3f %12.3f %8.4f %9.4f %8.4f..%-7.4f %8.2f %7s%s\n", r.bytes, r.reps,
                  r.weft_s * 1e6, r.raw_s * 1e6, r.ratio, r.median_of_ratios, r.ratio_q1, r.ratio_q3, target,
                  met ? "ok" : "MISSED",
                  r.correct ? "" : "  WRONG RESULT");
      std::fflush(stdout);
    }
    rows.push_back(r);
    if (bytes >= o.max_bytes || bytes > o.max_bytes / o.factor) break;
    bytes *= o.factor;
  }
  if (root) {
    std::printf("# target (ratio <= 1.02 from 64 KiB, <= 1.10 below): %s\n", all_met ? "met" : "MISSED");
    if (!o.json_path.empty()) {
      std::ofstream out(o.json_path);
      out << "[";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const row& r = rows[i];
        char line[512];
        std::snprintf(line, sizeof(line),
                      "%s\n  {\"ranks\": %d, \"bytes\": %zu, \"weft_s\": %.9g, \"raw_s\": %.9g, \"ratio\": %.6f, "
                      "\"median_of_ratios\": %.6f, \"ratio_q1\": %.6f, \"ratio_q3\": %.6f, \"reps\": %d, "
                      "\"in_place\": %s, \"checks\": \"%s\", \"target\": %.2f, \"correct\": %s}",
                      i == 0 ? "" : ",", comm.size(), r.bytes, r.weft_s, r.raw_s, r.ratio, r.median_of_ratios,
                      r.ratio_q1, r.ratio_q3, r.reps, o.in_place ? "true" : "false", o.checks_name.c_str(), target_for(r.bytes),
                      r.correct ? "true" : "false");
        out << line;
      }
      out << "\n]\n";
      if (!out) throw std::runtime_error("cannot write '" + o.json_path + "'");
    }
  }
  if (!all_correct) return 1;
  return o.enforce && !all_met ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  return weft_programs::mpi_main("allreduce_overhead", usage_text, argc, argv, [&](int rank) {
    const options o = parse(argc, argv);
    if (o.help) {
      if (rank == 0) std::printf("%s", usage_text);
      return 0;
    }
    return run(o);
  });
}
