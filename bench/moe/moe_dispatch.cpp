// What weft's MoE dispatch and combine cost on top of MPI: weft::moe::token_dispatcher (the count
// exchange, then one all_to_allv out and one back) against the same exchange written with raw MPI
// (MPI_Alltoall of the counts, MPI_Alltoallv out, MPI_Alltoallv back) on the same communicator,
// the same counts and the same buffers, for token counts per rank from -b to -e.
//
// Each rank routes its tokens to K of E experts at random (seeded by the rank; expert e is chosen
// with weight e + 1, so the counts are ragged), and the rows are already permuted by expert: both
// sides time exactly the communication of one MoE layer's forward. As in allreduce_overhead, both
// are timed in one run, interleaved call by call (alternating which goes first); a call's time is
// the slowest rank's; times are medians over repetitions; ratio = median(weft) / median(raw).
//
//   mpirun -n 4 moe_dispatch -b 256 -e 16K -f 4 --hidden 768 --experts 8 --top-k 2 --json moe.json
//
// Target: ratio <= 1.05 (--enforce makes a miss exit non-zero).
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/moe/dispatcher.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "command_line.hpp"

namespace {

using weft_programs::parse_integer;
using weft_programs::usage_error;

struct options {
  std::size_t min_tokens = 256;
  std::size_t max_tokens = 16384;
  std::size_t factor = 4;
  std::size_t hidden = 768;
  std::size_t experts = 8;
  std::size_t top_k = 2;
  int reps = 30;
  int warmup = 3;
  bool enforce = false;
  std::optional<weft::check_level> checks;
  std::string checks_name = "default";
  std::string json_path;
  bool help = false;
};

constexpr double target = 1.05;

constexpr const char* usage_text =
    "usage: mpirun -n RANKS moe_dispatch [options]\n"
    "  -b N             fewest tokens per rank [256]\n"
    "  -e N             most tokens per rank [16384]\n"
    "  -f N             factor between steps [4]\n"
    "  --hidden C       floats per token row [768]\n"
    "  --experts E      experts over the group (a multiple of the ranks) [8]\n"
    "  --top-k K        experts per token [2]\n"
    "  --reps N         timed repetitions per size [30]\n"
    "  --warmup N       untimed repetitions of each kind per size [3]\n"
    "  --enforce        exit 1 when a size misses the target (ratio <= 1.05)\n"
    "  --checks LEVEL   weft's check level: local, agreement, communication or fingerprint [the default]\n"
    "  --json FILE      write [{\"ranks\", \"tokens\", \"bytes\", \"weft_s\", \"raw_s\", \"ratio\", ...}]\n";

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error("option '" + arg + "' needs a value");
      return argv[++i];
    };
    if (arg == "-b") o.min_tokens = parse_integer<std::size_t>(arg, value(), 1, std::size_t{1} << 24);
    else if (arg == "-e") o.max_tokens = parse_integer<std::size_t>(arg, value(), 1, std::size_t{1} << 24);
    else if (arg == "-f") o.factor = parse_integer<std::size_t>(arg, value(), 2, 1 << 20);
    else if (arg == "--hidden") o.hidden = parse_integer<std::size_t>(arg, value(), 1, 1 << 20);
    else if (arg == "--experts") o.experts = parse_integer<std::size_t>(arg, value(), 1, 1 << 16);
    else if (arg == "--top-k") o.top_k = parse_integer<std::size_t>(arg, value(), 1, 1 << 16);
    else if (arg == "--reps") o.reps = parse_integer(arg, value(), 1, 1 << 24);
    else if (arg == "--warmup") o.warmup = parse_integer(arg, value(), 0, 1 << 20);
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
  if (o.max_tokens < o.min_tokens) throw usage_error("-e is smaller than -b");
  if (o.top_k > o.experts) throw usage_error("--top-k " + std::to_string(o.top_k) + " is above --experts " + std::to_string(o.experts));
  return o;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct row {
  std::size_t tokens = 0, bytes = 0;
  double weft_s = 0, raw_s = 0, ratio = 0, median_of_ratios = 0;
  bool correct = true;
};

// Rows this rank sends each expert: K distinct experts per token, expert e with weight e + 1.
std::vector<std::size_t> route(std::size_t tokens, const options& o, int rank) {
  std::mt19937 engine(1234u + static_cast<unsigned>(rank));
  std::vector<double> weights(o.experts);
  for (std::size_t e = 0; e < o.experts; ++e) weights[e] = static_cast<double>(e + 1);
  std::vector<std::size_t> per_expert(o.experts, 0);
  for (std::size_t t = 0; t < tokens; ++t) {
    std::vector<double> w = weights;
    for (std::size_t j = 0; j < o.top_k; ++j) {
      std::discrete_distribution<std::size_t> pick(w.begin(), w.end());
      const std::size_t e = pick(engine);
      ++per_expert[e];
      w[e] = 0;
    }
  }
  return per_expert;
}

row measure(weft::communicator<weft::mpi_backend>& comm, const options& o, std::size_t tokens) {
  const int P = comm.size();
  const std::size_t ranks = static_cast<std::size_t>(P), local = o.experts / ranks, C = o.hidden;
  const MPI_Comm raw_comm = comm.native().native();
  const std::vector<std::size_t> per_expert = route(tokens, o, comm.rank());
  std::size_t sent_rows = 0;
  for (std::size_t n : per_expert) sent_rows += n;
  std::vector<float> rows(sent_rows * C);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(comm.rank() * 1000003 + static_cast<int>(i % 1000003));

  weft::moe::token_dispatcher<weft::mpi_backend> dispatcher(comm, o.experts);
  std::vector<float> weft_received, weft_back(rows.size());
  auto weft_call = [&] {
    dispatcher.plan(per_expert);
    weft_received.resize(dispatcher.rows_received() * C);
    dispatcher.dispatch(std::span<const float>(rows), C, std::span<float>(weft_received));
    dispatcher.combine(std::span<const float>(weft_received), C, std::span<float>(weft_back));
  };

  std::vector<int> counts_out(o.experts), counts_in(o.experts), sc(ranks), sd(ranks), rc(ranks), rd(ranks);
  for (std::size_t e = 0; e < o.experts; ++e) counts_out[e] = static_cast<int>(per_expert[e]);
  std::vector<float> raw_received, raw_back(rows.size());
  auto raw_call = [&] {
    MPI_Alltoall(counts_out.data(), static_cast<int>(local), MPI_INT, counts_in.data(), static_cast<int>(local), MPI_INT,
                 raw_comm);
    int s_at = 0, r_at = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      int s = 0, q = 0;
      for (std::size_t e = 0; e < local; ++e) s += counts_out[r * local + e], q += counts_in[r * local + e];
      sc[r] = s * static_cast<int>(C), rc[r] = q * static_cast<int>(C), sd[r] = s_at, rd[r] = r_at;
      s_at += sc[r], r_at += rc[r];
    }
    raw_received.resize(static_cast<std::size_t>(r_at));
    MPI_Alltoallv(rows.data(), sc.data(), sd.data(), MPI_FLOAT, raw_received.data(), rc.data(), rd.data(), MPI_FLOAT,
                  raw_comm);
    MPI_Alltoallv(raw_received.data(), rc.data(), rd.data(), MPI_FLOAT, raw_back.data(), sc.data(), sd.data(), MPI_FLOAT,
                  raw_comm);
  };
  auto timed = [](auto&& call) {
    const auto start = std::chrono::steady_clock::now();
    call();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (int i = 0; i < o.warmup; ++i) weft_call(), raw_call();
  MPI_Barrier(raw_comm);
  std::vector<double> times(2 * static_cast<std::size_t>(o.reps));
  for (int rep = 0; rep < o.reps; ++rep) {
    double* t = &times[2 * static_cast<std::size_t>(rep)];
    if (rep % 2 == 0) t[0] = timed(weft_call), t[1] = timed(raw_call);
    else t[1] = timed(raw_call), t[0] = timed(weft_call);
  }
  MPI_Allreduce(MPI_IN_PLACE, times.data(), 2 * o.reps, MPI_DOUBLE, MPI_MAX, raw_comm);
  std::vector<double> weft_times, raw_times, ratios;
  for (int rep = 0; rep < o.reps; ++rep) {
    const double* t = &times[2 * static_cast<std::size_t>(rep)];
    weft_times.push_back(t[0]), raw_times.push_back(t[1]), ratios.push_back(t[0] / t[1]);
  }
  // Both sides received the same rows, and the round trip returns every row to its sender.
  int wrong = (weft_received == raw_received && weft_back == rows && raw_back == rows) ? 0 : 1;
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT, MPI_SUM, raw_comm);
  row r;
  r.tokens = tokens;
  r.bytes = tokens * o.top_k * C * sizeof(float);
  r.weft_s = median(weft_times);
  r.raw_s = median(raw_times);
  r.ratio = r.weft_s / r.raw_s;
  r.median_of_ratios = median(ratios);
  r.correct = wrong == 0;
  return r;
}

int run(const options& o) {
  auto comm = weft::communicator<weft::mpi_backend>(weft::mpi_backend::comm::world(), "ep");
  if (o.checks) comm.set_checks(*o.checks);
  if (o.experts % static_cast<std::size_t>(comm.size()) != 0)
    throw usage_error("--experts " + std::to_string(o.experts) + " is not a multiple of the " +
                      std::to_string(comm.size()) + " ranks");
  const bool root = comm.rank() == 0;
  if (root) {
    std::printf("# weft MoE dispatch + combine vs raw MPI_Alltoall + 2 x MPI_Alltoallv, %d ranks, C %zu floats, E %zu, "
                "K %zu, weft's checks: %s, interleaved call by call\n",
                comm.size(), o.hidden, o.experts, o.top_k, o.checks_name.c_str());
    std::printf("# bytes: tokens x K x C x 4 sent per rank each way; times: median over %d repetitions of the slowest "
                "rank's time; ratio: median(weft) / median(raw)\n",
                o.reps);
    std::printf("# %8s %12s %12s %12s %8s %9s %8s\n", "tokens", "bytes", "weft (us)", "raw (us)", "ratio", "med.rat",
                "target");
  }
  std::vector<row> rows;
  bool all_met = true, all_correct = true;
  for (std::size_t tokens = o.min_tokens;;) {
    const row r = measure(comm, o, tokens);
    const bool met = r.ratio <= target;
    all_met = all_met && met;
    all_correct = all_correct && r.correct;
    if (root) {
      std::printf("  %8zu %12zu %12.1f %12.1f %8.4f %9.4f %8.2f %s%s\n", r.tokens, r.bytes, r.weft_s * 1e6, r.raw_s * 1e6,
                  r.ratio, r.median_of_ratios, target, met ? "ok" : "MISSED", r.correct ? "" : "  WRONG RESULT");
      std::fflush(stdout);
    }
    rows.push_back(r);
    if (tokens >= o.max_tokens || tokens > o.max_tokens / o.factor) break;
    tokens *= o.factor;
  }
  if (root) {
    std::printf("# target (ratio <= 1.05): %s\n", all_met ? "met" : "MISSED");
    if (!o.json_path.empty()) {
      std::ofstream out(o.json_path);
      out << "[";
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const row& r = rows[i];
        char line[512];
        std::snprintf(line, sizeof(line),
                      "%s\n  {\"ranks\": %d, \"tokens\": %zu, \"bytes\": %zu, \"weft_s\": %.9g, \"raw_s\": %.9g, "
                      "\"ratio\": %.6f, \"median_of_ratios\": %.6f, \"reps\": %d, \"hidden\": %zu, \"experts\": %zu, "
                      "\"top_k\": %zu, \"checks\": \"%s\", \"target\": %.2f, \"correct\": %s}",
                      i == 0 ? "" : ",", comm.size(), r.tokens, r.bytes, r.weft_s, r.raw_s, r.ratio, r.median_of_ratios,
                      o.reps, o.hidden, o.experts, o.top_k, o.checks_name.c_str(), target, r.correct ? "true" : "false");
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
  return weft_programs::mpi_main("moe_dispatch", usage_text, argc, argv, [&](int rank) {
    const options o = parse(argc, argv);
    if (o.help) {
      if (rank == 0) std::printf("%s", usage_text);
      return 0;
    }
    return run(o);
  });
}
