// What weft's MoE dispatch and combine cost on top of MPI: weft::moe::token_dispatcher (the count
// exchange, then one all_to_allv out and one back) against the same exchange written with raw MPI
// (MPI_Alltoall of the counts, MPI_Alltoallv out, MPI_Alltoallv back) on the same communicator,
// the same counts and the same buffers, for token counts per rank from -b to -e.
//
// Each rank routes its tokens to K of E experts at random (seeded by the rank; expert e is chosen
// with weight e + 1, so the counts are ragged), and the rows are already permuted by expert: both
// sides time exactly the communication of one MoE layer's forward. As in allreduce_overhead, both
// are timed in one run, interleaved call by call (rotating which goes first); a call's time is
// the slowest rank's; times are medians over repetitions; ratio = median(weft) / median(raw).
// --checks with several levels (default,local) times weft at each, on a communicator of its own,
// in the same interleaved run.
//
//   mpirun -n 4 moe_dispatch -b 256 -e 16K -f 4 --hidden 768 --experts 8 --top-k 2 --json moe.json
//
// Target: ratio <= 1.05 at the first level given (--enforce makes a miss exit non-zero).
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/moe/dispatcher.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
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
  struct level {
    std::string name;
    std::optional<weft::check_level> checks;  ///< nullopt: the communicator's default
  };
  std::vector<level> levels{{"default", std::nullopt}};
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
    "  --enforce        exit 1 when a size misses the target (ratio <= 1.05) at the first level\n"
    "  --checks L[,L..] weft's check levels, each timed in the same run: default, local, agreement,\n"
    "                   communication or fingerprint [default]\n"
    "  --json FILE      write [{\"ranks\", \"tokens\", \"bytes\", \"weft_s\", \"raw_s\", \"ratio\", ...,\n"
    "                   \"levels\": [{\"checks\", \"weft_s\", \"ratio\", \"median_of_ratios\"}]}]: weft_s and\n"
    "                   ratio are the first level's\n";

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
      o.levels.clear();
      const std::string list = value();
      for (std::size_t at = 0; at <= list.size();) {
        const std::size_t end = std::min(list.find(',', at), list.size());
        const std::string name = list.substr(at, end - at);
        options::level l{name, std::nullopt};
        if (name == "local") l.checks = weft::check_level::local;
        else if (name == "agreement") l.checks = weft::check_level::agreement;
        else if (name == "communication") l.checks = weft::check_level::communication;
        else if (name == "fingerprint") l.checks = weft::check_level::fingerprint;
        else if (name != "default")
          throw usage_error("--checks '" + name + "' is not a check level: use default, local, agreement, communication or fingerprint");
        o.levels.push_back(l);
        at = end + 1;
      }
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

struct level_result {
  double weft_s = 0, ratio = 0, median_of_ratios = 0;
};

struct row {
  std::size_t tokens = 0, bytes = 0;
  double raw_s = 0;
  std::vector<level_result> levels;  ///< in the order of --checks
  bool correct = true;
};

using comm_t = weft::communicator<weft::mpi_backend>;

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

row measure(std::vector<comm_t>& comms, const options& o, std::size_t tokens) {
  comm_t& comm = comms.front();
  const std::size_t variants = comms.size();
  const std::size_t ranks = static_cast<std::size_t>(comm.size()), local = o.experts / ranks, C = o.hidden;
  const MPI_Comm raw_comm = comm.native().native();
  const std::vector<std::size_t> per_expert = route(tokens, o, comm.rank());
  std::size_t sent_rows = 0;
  for (std::size_t n : per_expert) sent_rows += n;
  std::vector<float> rows(sent_rows * C);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(comm.rank() * 1000003 + static_cast<int>(i % 1000003));

  std::vector<std::unique_ptr<weft::moe::token_dispatcher<weft::mpi_backend>>> dispatchers;
  for (comm_t& c : comms) dispatchers.push_back(std::make_unique<weft::moe::token_dispatcher<weft::mpi_backend>>(c, o.experts));
  std::vector<std::vector<float>> weft_received(variants), weft_back(variants, std::vector<float>(rows.size()));
  auto weft_call = [&](std::size_t v) {
    auto& dispatcher = *dispatchers[v];
    dispatcher.plan(per_expert, C);
    weft_received[v].resize(dispatcher.rows_received() * C);
    dispatcher.dispatch(std::span<const float>(rows), std::span<float>(weft_received[v]));
    dispatcher.combine(std::span<const float>(weft_received[v]), std::span<float>(weft_back[v]));
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
  // Call k: 0 raw, 1.. weft at each level; each repetition starts one later in that cycle.
  const std::size_t kinds = variants + 1;
  auto call = [&](std::size_t k) { return k == 0 ? timed(raw_call) : timed([&] { weft_call(k - 1); }); };
  for (int i = 0; i < o.warmup; ++i)
    for (std::size_t k = 0; k < kinds; ++k) call(k);
  MPI_Barrier(raw_comm);
  std::vector<double> times(kinds * static_cast<std::size_t>(o.reps));
  for (int rep = 0; rep < o.reps; ++rep)
    for (std::size_t j = 0; j < kinds; ++j) {
      const std::size_t k = (static_cast<std::size_t>(rep) + j) % kinds;
      times[static_cast<std::size_t>(rep) * kinds + k] = call(k);
    }
  MPI_Allreduce(MPI_IN_PLACE, times.data(), static_cast<int>(times.size()), MPI_DOUBLE, MPI_MAX, raw_comm);
  std::vector<double> raw_times;
  for (int rep = 0; rep < o.reps; ++rep) raw_times.push_back(times[static_cast<std::size_t>(rep) * kinds]);
  row r;
  r.tokens = tokens;
  r.bytes = tokens * o.top_k * C * sizeof(float);
  r.raw_s = median(raw_times);
  // Both sides received the same rows, and the round trip returns every row to its sender.
  int wrong = raw_back == rows ? 0 : 1;
  for (std::size_t v = 0; v < variants; ++v) {
    std::vector<double> weft_times, ratios;
    for (int rep = 0; rep < o.reps; ++rep) {
      const double* t = &times[static_cast<std::size_t>(rep) * kinds];
      weft_times.push_back(t[1 + v]), ratios.push_back(t[1 + v] / t[0]);
    }
    const double weft_s = median(weft_times);
    r.levels.push_back({weft_s, weft_s / r.raw_s, median(ratios)});
    if (weft_received[v] != raw_received || weft_back[v] != rows) wrong = 1;
  }
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT, MPI_SUM, raw_comm);
  r.correct = wrong == 0;
  return r;
}

int run(const options& o) {
  std::vector<comm_t> comms;
  std::string names;
  for (const options::level& l : o.levels) {
    comms.emplace_back(weft::mpi_backend::comm::world(), "ep");
    if (l.checks) comms.back().set_checks(*l.checks);
    names += (names.empty() ? "" : ", ") + l.name;
  }
  comm_t& comm = comms.front();
  if (o.experts % static_cast<std::size_t>(comm.size()) != 0)
    throw usage_error("--experts " + std::to_string(o.experts) + " is not a multiple of the " +
                      std::to_string(comm.size()) + " ranks");
  const bool root = comm.rank() == 0;
  if (root) {
    std::printf("# weft MoE dispatch + combine vs raw MPI_Alltoall + 2 x MPI_Alltoallv, %d ranks, C %zu floats, E %zu, "
                "K %zu, weft's checks: %s, interleaved call by call\n",
                comm.size(), o.hidden, o.experts, o.top_k, names.c_str());
    std::printf("# bytes: tokens x K x C x 4 sent per rank each way; times: median over %d repetitions of the slowest "
                "rank's time; ratio: median(weft) / median(raw); target %.2f at the first level\n",
                o.reps, target);
    std::printf("# %8s %12s %12s", "tokens", "bytes", "raw (us)");
    for (const options::level& l : o.levels)
      std::printf(" %14s %8s %9s", (l.name + " (us)").c_str(), "ratio", "med.rat");
    std::printf("\n");
  }
  std::vector<row> rows;
  bool all_met = true, all_correct = true;
  for (std::size_t tokens = o.min_tokens;;) {
    const row r = measure(comms, o, tokens);
    const bool met = r.levels.front().ratio <= target;
    all_met = all_met && met;
    all_correct = all_correct && r.correct;
    if (root) {
      std::printf("  %8zu %12zu %12.1f", r.tokens, r.bytes, r.raw_s * 1e6);
      for (const level_result& l : r.levels) std::printf(" %14.1f %8.4f %9.4f", l.weft_s * 1e6, l.ratio, l.median_of_ratios);
      std::printf(" %s%s\n", met ? "ok" : "MISSED", r.correct ? "" : "  WRONG RESULT");
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
        const level_result& first = r.levels.front();
        char line[512];
        std::snprintf(line, sizeof(line),
                      "%s\n  {\"ranks\": %d, \"tokens\": %zu, \"bytes\": %zu, \"weft_s\": %.9g, \"raw_s\": %.9g, "
                      "\"ratio\": %.6f, \"median_of_ratios\": %.6f, \"reps\": %d, \"hidden\": %zu, \"experts\": %zu, "
                      "\"top_k\": %zu, \"checks\": \"%s\", \"target\": %.2f, \"correct\": %s, \"levels\": [",
                      i == 0 ? "" : ",", comm.size(), r.tokens, r.bytes, first.weft_s, r.raw_s, first.ratio,
                      first.median_of_ratios, o.reps, o.hidden, o.experts, o.top_k, o.levels.front().name.c_str(), target,
                      r.correct ? "true" : "false");
        out << line;
        for (std::size_t v = 0; v < r.levels.size(); ++v) {
          std::snprintf(line, sizeof(line), "%s{\"checks\": \"%s\", \"weft_s\": %.9g, \"ratio\": %.6f, \"median_of_ratios\": %.6f}",
                        v == 0 ? "" : ", ", o.levels[v].name.c_str(), r.levels[v].weft_s, r.levels[v].ratio,
                        r.levels[v].median_of_ratios);
          out << line;
        }
        out << "]}";
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
