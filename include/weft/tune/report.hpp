#pragma once
/// \file
/// Reports on plans: a readable table, JSON for tools, and an explanation of why the best layout
/// won and why the usual alternatives lost, in the model's own numbers.

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/detail/json.hpp>
#include <weft/tune/search.hpp>

namespace weft::tune {

namespace detail {

inline std::string format(const char* pattern, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, pattern, value);
  return buffer;
}

inline std::string percent(double fraction) { return format("%.1f %%", 100 * fraction); }
inline std::string gigabytes(double bytes) { return format("%.1f GB", bytes / 1e9); }

}  // namespace detail

/// "tp=2 cp=1 pp=4 dp=16 vp=3 mb=1 recompute=none sharding=optimizer"; with expert parallelism
/// "ep=8" (and "expert-tp=1" where the experts are split otherwise than tp) after cp.
inline std::string describe(const layout_choice& l) {
  const std::string experts =
      (l.parallel.ep > 1 ? " ep=" + std::to_string(l.parallel.ep) : std::string()) +
      (l.parallel.expert_tp > 0 && l.parallel.expert_tp != l.parallel.tp ? " expert-tp=" + std::to_string(l.parallel.expert_tp)
                                                                          : std::string());
  return "tp=" + std::to_string(l.parallel.tp) + " cp=" + std::to_string(l.parallel.cp) + experts + " pp=" + std::to_string(l.parallel.pp) +
         " dp=" + std::to_string(l.parallel.dp) + " vp=" + std::to_string(l.parallel.virtual_stages) + " mb=" + std::to_string(l.micro_batch) +
         " recompute=" + std::string(to_string(l.recompute_mode)) +
         " sharding=" + std::string(to_string(l.sharding_mode)) + (l.sequence_parallel ? " sp" : "");
}

/// Where the step time goes, as percentages: "compute 84.0 % (recompute 0.0 %), TP 6.1 %, ...".
inline std::string describe_time(const time_breakdown& t) {
  auto part = [&](const char* name, double seconds) {
    return std::string(name) + " " + detail::percent(seconds / t.step);
  };
  return part("compute", t.compute) + " (recompute " + detail::percent(t.recompute / t.step) + "), " +
         part("TP", t.tp_comm) + ", " + part("CP", t.cp_comm) + ", " +
         (t.ep_comm > 0 ? part("EP all-to-all", t.ep_comm) + ", " : std::string()) + part("PP", t.pp_comm) + ", " +
         part("bubble", t.bubble) + ", " + part("DP", t.dp_comm) + ", " + part("optimizer", t.optimizer);
}

/// "61.2 GB of 73.6 GB usable (weights 9.0, gradients 18.0, optimizer 6.0, activations 25.0, logits 3.2)".
inline std::string describe_memory(const memory_breakdown& m) {
  auto g = [](double b) { return detail::format("%.1f", b / 1e9); };
  return detail::gigabytes(m.total) + " of " + detail::gigabytes(m.usable) + " usable (weights " + g(m.weights) +
         ", gradients " + g(m.gradients) + ", optimizer " + g(m.optimizer) + ", activations " + g(m.activations) +
         ", logits " + g(m.logits) + ")";
}

/// A human-readable table of plans, best first. A rank written "2=" ties with the plan above it
/// (the same predicted step time); of tied plans the simpler layout is listed first (see search).
inline std::string format_table(const std::vector<plan>& plans) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%-4s %3s %3s %3s %4s %5s %3s %3s %-9s %-9s %6s %12s %9s %9s %7s %7s %7s %7s %7s %9s %11s\n",
                "rank", "tp", "cp", "ep", "pp", "dp", "vp", "mb", "recompute", "sharding", "mfu", "tokens/s", "step_s",
                "mem_GB", "tp_%", "ep_%", "pp_%", "bubble%", "dp_%", "days", "cost");
  out += line;
  int rank = 0;
  for (std::size_t i = 0; i < plans.size(); ++i) {
    const plan& p = plans[i];
    const layout_choice& l = p.config;
    const double s = p.time.step;
    const bool tied = i > 0 && s == plans[i - 1].time.step;
    if (!tied) rank = static_cast<int>(i) + 1;
    const std::string rank_text = std::to_string(rank) + (tied ? "=" : "");
    std::snprintf(line, sizeof line,
                  "%-4s %3d %3d %3d %4d %5d %3d %3d %-9s %-9s %5.1f%% %12.4g %9.3f %9.1f %7.1f %7.1f %7.1f %7.1f %7.1f %9.2f %11.4g\n",
                  rank_text.c_str(), l.parallel.tp, l.parallel.cp, l.parallel.ep, l.parallel.pp, l.parallel.dp, l.parallel.virtual_stages, l.micro_batch, std::string(to_string(l.recompute_mode)).c_str(),
                  std::string(to_string(l.sharding_mode)).c_str(), 100 * p.mfu, p.tokens_per_s, s,
                  p.memory.total / 1e9, 100 * p.time.tp_comm / s, 100 * p.time.ep_comm / s, 100 * p.time.pp_comm / s, 100 * p.time.bubble / s,
                  100 * p.time.dp_comm / s, p.days, p.cost);
    out += line;
  }
  return out;
}

namespace detail {
inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buffer[40];
  std::snprintf(buffer, sizeof buffer, "%.6g", v);
  return buffer;
}
using weft::detail::json_string;  // core/detail/json.hpp
}  // namespace detail

/// One plan as a JSON object.
inline std::string to_json(const plan& p) {
  using detail::json_number;
  const layout_choice& l = p.config;
  std::string o = "{";
  o += "\"tp\": " + std::to_string(l.parallel.tp) + ", \"cp\": " + std::to_string(l.parallel.cp) + ", \"pp\": " + std::to_string(l.parallel.pp) +
       ", \"dp\": " + std::to_string(l.parallel.dp) + ", \"ep\": " + std::to_string(l.parallel.ep) +
       ", \"expert_tp\": " + std::to_string(l.parallel.expert_tp > 0 ? l.parallel.expert_tp : l.parallel.tp) +
       ", \"vp\": " + std::to_string(l.parallel.virtual_stages) +
       ", \"micro_batch\": " + std::to_string(l.micro_batch) + ", \"micro_batches\": " + std::to_string(p.micro_batches) +
       ", \"recompute\": \"" + std::string(to_string(l.recompute_mode)) + "\", \"sharding\": \"" +
       std::string(to_string(l.sharding_mode)) + "\", \"sequence_parallel\": " + (l.sequence_parallel ? "true" : "false");
  o += ", \"mfu\": " + json_number(p.mfu) + ", \"hfu\": " + json_number(p.hfu) +
       ", \"tokens_per_s\": " + json_number(p.tokens_per_s) + ", \"step_time_s\": " + json_number(p.time.step) +
       ", \"memory_per_gpu_bytes\": " + json_number(p.memory.total) + ", \"days\": " + json_number(p.days) +
       ", \"cost\": " + json_number(p.cost);
  const memory_breakdown& m = p.memory;
  o += ", \"memory\": {\"weights\": " + json_number(m.weights) + ", \"gradients\": " + json_number(m.gradients) +
       ", \"optimizer\": " + json_number(m.optimizer) + ", \"activations\": " + json_number(m.activations) +
       ", \"logits\": " + json_number(m.logits) + ", \"usable\": " + json_number(m.usable) + "}";
  const time_breakdown& t = p.time;
  o += ", \"time_s\": {\"compute\": " + json_number(t.compute) + ", \"recompute\": " + json_number(t.recompute) +
       ", \"tp_comm\": " + json_number(t.tp_comm) + ", \"cp_comm\": " + json_number(t.cp_comm) +
       ", \"pp_comm\": " + json_number(t.pp_comm) + ", \"bubble\": " + json_number(t.bubble) +
       ", \"ep_comm\": " + json_number(t.ep_comm) + ", \"dp_comm\": " + json_number(t.dp_comm) +
       ", \"optimizer\": " + json_number(t.optimizer) + "}";
  return o + "}";
}

/// The usual alternative to a plan and what the model says about it.
struct alternative {
  std::string name;             ///< e.g. "pure data parallel", "8-way TP"
  std::optional<plan> best;     ///< the best plan under that constraint, if one fits
  std::optional<plan> smallest; ///< when none fits: the one needing the least memory
  std::string verdict;          ///< one sentence with the model's numbers
};

/// Why the winner won and why the alternatives lost.
struct explanation {
  std::string summary;                   ///< the winner, its throughput, time and memory breakdowns
  std::vector<alternative> alternatives; ///< each usual alternative with its verdict
  std::vector<std::string> caveats;      ///< what the model cannot know here, one sentence each
};

/// The largest run of the published runs the cost model is validated on (tests/tune/data).
inline constexpr int largest_validated_gpus = 16384;

/// A published source whose runs the model, with the constants it ships (never fitted on them),
/// predicts wrong in one direction by more than 15 % (docs/tuning.md, "Published runs at
/// 1,536-16,384 GPUs"), and the regime its runs cover: a plan in that regime may inherit the error.
struct systematic_error {
  const char* source;  ///< as in tests/tune/data (LLAMA3, MTNLG)
  const char* runs;    ///< what was run, in words
  bool hopper;         ///< Hopper or Blackwell GPUs; Ampere otherwise
  int min_gpus;        ///< the regime: at least this many GPUs
  int min_pp;          ///< and at least this pipeline depth
  double low, high;    ///< the range of its runs' errors (predicted / published - 1)
  const char* cause;   ///< what the model lacks there, as far as it is known
};

/// The sources whose runs all err one way by more than 15 % (checked against the data by
/// tests/tune/test_published_runs.cpp).
inline constexpr systematic_error systematic_errors[] = {
    {"LLAMA3", "Llama 3 405B on 8,192-16,384 H100 with pp 16 and cp up to 16", true, 8192, 8, -0.41, -0.24,
     "its memory model needs full recomputation for those layouts (the activations interleaved "
     "1F1B keeps in flight on the first stages), without which they come out within 8 %, and it "
     "runs attention at 131,072 tokens far below the kernels' speed"},
    {"MTNLG", "MT-NLG 530B on 2,240-3,360 A100 with pp 35", false, 2000, 6, 0.18, 0.22,
     "the same shape on Megatron-LM at the same scale (N21) is predicted 9 % low: the gap is the "
     "software's, not the scale's"},
};

inline std::vector<std::string> caveats(const plan& winner, const cluster_desc& cluster,
                                        const std::vector<alternative>& alternatives) {
  std::vector<std::string> out;
  const bool measured = cluster.gpu.name == "measured";  // cluster_of(measured_hardware)
  if (cluster.timing_spread > 0) {
    std::string close;
    int count = 0;
    for (const alternative& a : alternatives)
      if (a.best && std::abs(a.best->time.step / winner.time.step - 1) < cluster.timing_spread) {
        close += std::string(count ? ", " : "") + a.name;
        ++count;
      }
    if (count > 0)
      out.push_back("the probe's repeated timings on this machine spread by " + detail::percent(cluster.timing_spread) +
                    ", more than the predicted difference to " + close +
                    ": measured there, their order against this layout may come out either way");
  }
  if (measured && cluster.node.ranks_per_core > 1 && cluster.node.exchange_latency == 0)
    out.push_back("these ranks share cores, and the description has no exchange_latency (an older probe): each tp "
                  "collective, cp ring step and pipeline send is charged its idle latency only, where a rank that "
                  "waits for a descheduled partner loses a time slice; probe again (weft-plan --probe)");
  const int gpus = gpus_of(winner.config);
  const bool hopper =
      cluster.gpu.architecture == gpu_architecture::hopper || cluster.gpu.architecture == gpu_architecture::blackwell;
  bool named = false;
  for (const systematic_error& e : systematic_errors)
    if (!measured && hopper == e.hopper && gpus >= e.min_gpus && winner.config.parallel.pp >= e.min_pp) {
      const bool low = e.high < 0;
      out.push_back("at " + std::to_string(gpus) + " GPUs with pp " + std::to_string(winner.config.parallel.pp) +
                    " the model errs one way: for " + e.runs + " (source " + e.source + ") it predicted " +
                    detail::percent(std::abs(low ? e.high : e.low)) + " to " + detail::percent(std::abs(low ? e.low : e.high)) +
                    (low ? " too little" : " too much") + "; " + e.cause +
                    "; read this MFU as a " + (low ? "floor" : "ceiling"));
      named = true;
    }
  if (!named && !measured && gpus > largest_validated_gpus)
    out.push_back(std::to_string(gpus) + " GPUs is beyond the largest published run the model is checked on (" +
                  std::to_string(largest_validated_gpus) + "): its error there is not known");
  return out;
}

namespace detail {

/// The part of the step that is most larger in `loser` than in `better`, as a sentence about
/// `loser` ("TP collectives take 24.4 % of its step (best: 0.0 %)"); `better_name` names the other.
inline std::string main_loss(const plan& better, const plan& loser, const std::string& better_name) {
  struct part {
    const char* text;
    double b, l;
  };
  const time_breakdown& a = better.time;
  const time_breakdown& z = loser.time;
  const part parts[] = {
      {"TP collectives take", a.tp_comm / a.step, z.tp_comm / z.step},
      {"the pipeline bubble takes", a.bubble / a.step, z.bubble / z.step},
      {"pipeline sends take", a.pp_comm / a.step, z.pp_comm / z.step},
      {"exposed data-parallel communication takes", a.dp_comm / a.step, z.dp_comm / z.step},
      {"the context-parallel exchange takes", a.cp_comm / a.step, z.cp_comm / z.step},
      {"the expert-parallel all-to-all takes", a.ep_comm / a.step, z.ep_comm / z.step},
      {"recomputation takes", a.recompute / a.step, z.recompute / z.step},
      {"the optimizer step takes", a.optimizer / a.step, z.optimizer / z.step},
  };
  const part* worst = nullptr;
  for (const part& p : parts)
    if (p.l - p.b > 0.005 && (!worst || p.l - p.b > worst->l - worst->b)) worst = &p;
  if (worst)
    return std::string(worst->text) + " " + percent(worst->l) + " of its step (" + better_name + ": " +
           percent(worst->b) + ")";
  // No overhead grew: the busiest GPU simply computes longer (smaller or fewer-token GEMMs run
  // less efficiently, or a pipeline stage carries the output layer on top of its share).
  return "its busiest GPU computes " + percent(z.compute / a.compute - 1) +
         " longer per step (smaller GEMMs run less efficiently, or a stage carries the output layer)";
}

}  // namespace detail

/// Explains `winner` (the best plan of a search with `options`, or a layout the user chose) by
/// searching the usual alternatives under the same rules: pure data parallelism, TP across the
/// whole node, the neighbouring TP degrees, pipeline parallelism or none, recomputation, sharding.
/// `reference` names `winner` in the sentences ("best", or "evaluated").
inline explanation explain(const plan& winner, const model_desc& model, const cluster_desc& cluster, const job_desc& job,
                           const search_options& options = {}, const std::string& reference = "best") {
  explanation e;
  const layout_choice& w = winner.config;
  e.summary = (reference == "best" ? "Best: " : "Evaluated: ") + describe(w) + ": MFU " + detail::percent(winner.mfu) + ", " +
              detail::format("%.4g", winner.tokens_per_s) + " tokens/s, step " + detail::format("%.3g", winner.time.step) +
              " s.\n  Step time: " + describe_time(winner.time) + ".\n  Memory per GPU: " + describe_memory(winner.memory) +
              ".";
  auto consider = [&](std::string name, layout_constraint c) {
    alternative alt;
    alt.name = std::move(name);
    search_options o = options;
    o.top = 1;
    o.fixed = c;
    o.software.max_sharding = std::max(o.software.max_sharding, c.sharding_mode.value_or(sharding::none));
    const search_result r = search(model, cluster, job, o);
    if (!r.plans.empty()) {
      alt.best = r.plans.front();
      const plan& p = *alt.best;
      auto same = [](const layout_choice& x, const layout_choice& y) {
        return x.parallel.tp == y.parallel.tp && x.parallel.cp == y.parallel.cp && x.parallel.pp == y.parallel.pp && x.parallel.dp == y.parallel.dp && x.parallel.virtual_stages == y.parallel.virtual_stages &&
               x.parallel.ep == y.parallel.ep && x.parallel.expert_tp == y.parallel.expert_tp &&
               x.micro_batch == y.micro_batch && x.recompute_mode == y.recompute_mode && x.sharding_mode == y.sharding_mode;
      };
      for (const alternative& seen : e.alternatives)
        if (seen.best && same(seen.best->config, p.config)) return;  // already listed under another name
      if (same(p.config, w)) return;  // that is the winner itself
      const double slower = winner.tokens_per_s / p.tokens_per_s - 1;
      if (slower >= 0)
        alt.verdict = describe(p.config) + ": " + detail::percent(slower) + " slower (MFU " + detail::percent(p.mfu) +
                      "): " + detail::main_loss(winner, p, reference) + ".";
      else  // only when `winner` is a layout the user fixed rather than the search's best
        alt.verdict = describe(p.config) + ": " + detail::percent(p.tokens_per_s / winner.tokens_per_s - 1) +
                      " FASTER (MFU " + detail::percent(p.mfu) + "); in the " + reference + " layout " +
                      detail::main_loss(p, winner, "this one") + ".";
    } else if (r.smallest) {
      alt.smallest = r.smallest;
      alt.verdict = "does not fit: even " + describe(r.smallest->config) + " needs " +
                    detail::gigabytes(r.smallest->memory.total) + " per GPU, " +
                    detail::gigabytes(r.smallest->memory.usable) + " usable.";
    } else {
      alt.verdict = "not a valid layout for this model and cluster (degrees, heads or batch do not divide).";
    }
    e.alternatives.push_back(std::move(alt));
  };
  const int node = cluster.node.gpus_per_node;
  consider("pure data parallel (tp=1, pp=1, cp=1)", {.tp = 1, .cp = 1, .pp = 1});
  if (node > 1) consider(std::to_string(node) + "-way TP (a whole node), no pipeline", {.tp = node, .pp = 1});
  if (w.parallel.tp > 1) consider("half the TP (tp=" + std::to_string(w.parallel.tp / 2) + ")", {.tp = w.parallel.tp / 2});
  if (w.parallel.tp * 2 <= node && w.parallel.tp * 2 != node) consider("twice the TP (tp=" + std::to_string(w.parallel.tp * 2) + ")", {.tp = w.parallel.tp * 2});
  if (w.parallel.pp > 1) consider("no pipeline (pp=1)", {.pp = 1});
  consider("twice the pipeline depth (pp=" + std::to_string(w.parallel.pp * 2) + ")", {.pp = w.parallel.pp * 2});
  if (w.recompute_mode != recompute::none) consider("no recomputation", {.recompute_mode = recompute::none});
  if (w.recompute_mode != recompute::full) consider("full recomputation", {.recompute_mode = recompute::full});
  if (w.sharding_mode != sharding::none) consider("no sharding", {.sharding_mode = sharding::none});
  // Mixtures of experts: the experts not split (ep = 1) or split twice as far.
  if (is_moe(model)) {
    if (w.parallel.ep > 1) consider("no expert parallelism (ep=1)", {.ep = 1});
    if (model.experts % (w.parallel.ep * 2) == 0)
      consider("twice the expert parallelism (ep=" + std::to_string(w.parallel.ep * 2) + ")", {.ep = w.parallel.ep * 2});
  }
  e.caveats = caveats(winner, cluster, e.alternatives);
  return e;
}

/// The answer a user wants first, on one line: the best layout, its days and cost for the job's
/// tokens (when given), and why: its nearest alternative in `e` and what that one loses to.
/// "Best: tp=1 ... for 1e+12 tokens: 16.9 days, cost 6.48e+04 (MFU 50.0 %); the closest
/// alternative, twice the TP (tp=2), is 6.0 % slower: TP collectives take 5.3 % of its step (best: 0.0 %)."
inline std::string headline(const plan& best, const explanation& e, const job_desc& job) {
  std::string line = "Best: " + describe(best.config);
  if (job.tokens > 0) {
    line += " for " + detail::format("%.3g", job.tokens) + " tokens: " + detail::format("%.3g", best.days) + " days";
    if (best.cost > 0) line += ", cost " + detail::format("%.4g", best.cost);
    line += " (MFU " + detail::percent(best.mfu) + ")";
  } else {
    line += ": MFU " + detail::percent(best.mfu) + ", step " + detail::format("%.3g", best.time.step) + " s";
  }
  const alternative* closest = nullptr;
  for (const alternative& a : e.alternatives)
    if (a.best && a.best->tokens_per_s <= best.tokens_per_s &&
        (!closest || a.best->tokens_per_s > closest->best->tokens_per_s))
      closest = &a;
  if (closest) {
    line += "; the closest alternative, " + closest->name + ", is " +
            detail::percent(best.tokens_per_s / closest->best->tokens_per_s - 1) + " slower: " +
            detail::main_loss(best, *closest->best, "best") + ".";
  } else {
    line += "; no usual alternative fits in memory.";
  }
  return line;
}

/// The explanation as text.
inline std::string to_text(const explanation& e) {
  std::string out = e.summary + "\nWhy not the usual alternatives:\n";
  for (const alternative& a : e.alternatives) out += "  - " + a.name + ": " + a.verdict + "\n";
  if (!e.caveats.empty()) {
    out += "What the model cannot know here:\n";
    for (const std::string& c : e.caveats) out += "  - " + c + ".\n";
  }
  return out;
}

/// A claimed training time checked against the model: the MFU the claim implies (model FLOPs of
/// `tokens` over days x GPUs x peak) and whether that is physically possible (at most 100 %).
struct claim_check {
  double implied_mfu = 0;
  bool possible = false;
};

/// Checks "training `model` on `tokens` takes `days` on `gpus` GPUs like `gpu`".
constexpr claim_check check_claim(const model_desc& model, const gpu_desc& gpu, int gpus, double tokens, double days,
                                  precision p = precision::bf16) noexcept {
  const double peak = (p == precision::fp8 && gpu.peak_fp8 > 0) ? gpu.peak_fp8 : gpu.peak_bf16;
  claim_check c;
  c.implied_mfu = tokens * model_flops_per_token(model) / (days * 86400.0 * gpus * peak);
  c.possible = c.implied_mfu <= 1.0;
  return c;
}

}  // namespace weft::tune
