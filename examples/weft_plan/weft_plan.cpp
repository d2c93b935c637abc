// weft-plan: picks TP / CP / PP / DP, virtual stages, micro-batch, recomputation and sharding for a
// transformer on a cluster, from weft's cost model, and explains the choice. See docs/tuning.md.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/tune/hardware_file.hpp>
#include <weft/tune/published_runs.hpp>
#include <weft/tune/report.hpp>

#include "command_line.hpp"
#if WEFT_PLAN_HAS_PROBE
#include "probe.hpp"
#endif

namespace {

using namespace weft::tune;

constexpr int exit_bad_input = 2;
constexpr int exit_no_fit = 3;

constexpr const char* usage = R"(usage: weft-plan [model] [cluster] [job] [options]
model:   --model NAME (gpt3-175b, llama2-7b, llama3-8b, llama3-70b, llama3-405b) or
         --layers L --hidden H --heads A [--kv-heads K] [--ffn F] [--swiglu] --seq S --vocab V
         [--params P] [--tied-embeddings] [--dropout]   (fields given after --model override it)
cluster: --gpu NAME (A100-40GB, A100-80GB, H100, H200, B200, L40S) --gpus N [--gpus-per-node G]
         or --cluster small|large --gpus N (the reference clusters: 4 x A100 80GB nodes with
         200 Gb/s per node, or 8 x H100 nodes with 400 Gb/s per GPU; --gpu is then optional)
         [--nvlink-gbytes X] [--network-gbits X] [--oversubscription X]
         or --hardware FILE [--gpus N]: a description written by --probe (N defaults to its ranks)
job:     --global-batch B (sequences) | --global-batch-tokens T; [--tokens T] [--price P per GPU-hour]
         [--fp8]   numbers accept K, M, B/G, T suffixes (1T = 1e12)
layout (evaluate instead of search; unset fields are searched):
         --tp --pp --dp --cp --vp --micro-batch N --recompute none|selective|full
         --sharding none|optimizer|gradients|full
options: --top K (5) --explain --json --uneven-stages
         --no-flash --no-sequence-parallel --no-interleaving --no-context-parallel --no-overlap
         --max-sharding none|optimizer|gradients|full
         --claim-days D   check a claimed training time for --tokens: implied MFU and the model's days
         --validate CSV   compare the model with published runs (docs/tuning.md)
         --probe FILE     measure the ranks this runs on (under mpiexec / srun, with the model's
                          flags: GEMMs at its shapes) and write the description --hardware reads
exit status: 0 ok, 2 bad input or invalid layout, 3 nothing fits in memory
)";

[[noreturn]] void bad_input(const std::string& message) {
  std::fprintf(stderr, "weft-plan: %s\n", message.c_str());
  std::exit(exit_bad_input);
}

// Numbers take a decimal suffix: 7B parameters, 15T tokens, 32K sequences.
constexpr weft_programs::unit_suffix decimal_suffixes[] = {{"K", 1e3}, {"k", 1e3}, {"M", 1e6},
                                                           {"B", 1e9}, {"G", 1e9}, {"T", 1e12}};

double parse_number(std::string_view flag, const std::string& text, double low = 0) {
  return weft_programs::parse_real(flag, text, low, std::numeric_limits<double>::max(), decimal_suffixes);
}

int parse_count(std::string_view flag, const std::string& text) {
  const double v = weft_programs::parse_real(flag, text, 1, 1e9, decimal_suffixes);
  if (v != std::floor(v)) bad_input(std::string(flag) + " needs a whole number, got '" + text + "'");
  return static_cast<int>(v);
}

struct arguments {
  std::map<std::string, std::string, std::less<>> values;
  std::map<std::string, bool, std::less<>> flags;
  bool has(std::string_view k) const { return values.count(k) > 0; }
  const std::string& get(std::string_view k) const { return values.find(k)->second; }
};

arguments parse(int argc, char** argv) {
  static const std::vector<std::string_view> with_value = {
      "--model", "--cluster", "--layers", "--hidden", "--heads", "--kv-heads", "--ffn", "--seq", "--vocab", "--params", "--gpu",
      "--gpus", "--gpus-per-node", "--nvlink-gbytes", "--network-gbits", "--oversubscription", "--global-batch",
      "--global-batch-tokens", "--tokens", "--price", "--tp", "--pp", "--dp", "--cp", "--vp", "--micro-batch",
      "--recompute", "--sharding", "--top", "--claim-days", "--validate", "--max-sharding", "--probe", "--hardware"};
  static const std::vector<std::string_view> switches = {
      "--swiglu", "--tied-embeddings", "--dropout", "--fp8", "--explain", "--json", "--uneven-stages", "--no-flash",
      "--no-sequence-parallel", "--no-interleaving", "--no-context-parallel", "--no-overlap", "--help", "-h"};
  arguments a;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    bool known = false;
    for (std::string_view s : switches)
      if (arg == s) a.flags[std::string(arg)] = known = true;
    for (std::string_view v : with_value)
      if (arg == v) {
        if (i + 1 >= argc) bad_input(std::string(arg) + " needs a value");
        a.values[std::string(arg)] = argv[++i];
        known = true;
      }
    if (!known) bad_input("unknown option '" + std::string(arg) + "' (see --help)");
  }
  return a;
}

model_desc read_model(const arguments& a) {
  model_desc m;
  if (a.has("--model")) {
    auto preset = model_preset(a.get("--model"));
    if (!preset) bad_input("unknown model '" + a.get("--model") + "'; known: " + std::string(model_preset_names));
    m = *preset;
  }
  if (a.has("--layers")) m.layers = parse_count("--layers", a.get("--layers"));
  if (a.has("--hidden")) m.hidden = parse_count("--hidden", a.get("--hidden"));
  if (a.has("--heads")) m.heads = parse_count("--heads", a.get("--heads"));
  if (a.has("--kv-heads")) m.kv_heads = parse_count("--kv-heads", a.get("--kv-heads"));
  if (a.has("--ffn")) m.ffn = parse_count("--ffn", a.get("--ffn"));
  if (a.has("--seq")) m.seq = parse_count("--seq", a.get("--seq"));
  if (a.has("--vocab")) m.vocab = parse_count("--vocab", a.get("--vocab"));
  if (a.has("--params")) m.params = parse_number("--params", a.get("--params"));
  if (a.flags.count("--swiglu")) m.swiglu = true;
  if (a.flags.count("--tied-embeddings")) m.tied_embeddings = true;
  if (a.flags.count("--dropout")) m.dropout = true;
  try {
    check_model(m);
  } catch (const weft::error& e) {
    bad_input(e.what());
  }
  return m;
}

/// The measured hardware of --hardware FILE, once read.
std::optional<measured_hardware> read_measured(const arguments& a) {
  if (!a.has("--hardware")) return std::nullopt;
  if (a.has("--gpu") || a.has("--cluster")) bad_input("--hardware replaces --gpu and --cluster: give one of them");
  try {
    return read_hardware(a.get("--hardware"));
  } catch (const weft::error& e) {
    bad_input(e.what());
  }
}

cluster_desc read_cluster(const arguments& a, const std::optional<measured_hardware>& measured) {
  if (measured) {
    cluster_desc c = cluster_of(*measured);
    if (a.has("--gpus")) {
      const int ranks = parse_count("--gpus", a.get("--gpus"));
      if (ranks % c.node.gpus_per_node != 0)
        bad_input("--gpus " + std::to_string(ranks) + " is not a whole number of the description's nodes of " +
                  std::to_string(c.node.gpus_per_node) + " ranks");
      c.nodes = ranks / c.node.gpus_per_node;
    }
    return c;
  }
  cluster_desc c;
  if (a.has("--cluster")) {
    if (a.get("--cluster") == "small") c = small_reference_cluster(1);
    else if (a.get("--cluster") == "large") c = large_reference_cluster(1);
    else bad_input("--cluster must be small or large, got '" + a.get("--cluster") + "'");
  }
  if (a.has("--gpu") || !a.has("--cluster")) {
    if (!a.has("--gpu")) bad_input("--gpu is required; known: " + std::string(gpu_preset_names));
    auto gpu = gpu_preset(a.get("--gpu"));
    if (!gpu) bad_input("unknown GPU '" + a.get("--gpu") + "'; known: " + std::string(gpu_preset_names));
    if (a.has("--cluster")) c.gpu = *gpu;
    else c = dgx_cluster(*gpu, 1);
  }
  if (!a.has("--gpus")) bad_input("--gpus (the number of GPUs) is required");
  const int gpus = parse_count("--gpus", a.get("--gpus"));
  if (a.has("--gpus-per-node")) c.node.gpus_per_node = parse_count("--gpus-per-node", a.get("--gpus-per-node"));
  if (gpus < c.node.gpus_per_node) c.node.gpus_per_node = gpus;  // a partial node
  if (gpus % c.node.gpus_per_node != 0)
    bad_input("--gpus " + std::to_string(gpus) + " is not a whole number of nodes of " +
              std::to_string(c.node.gpus_per_node) + " GPUs; use " +
              std::to_string(gpus / c.node.gpus_per_node * c.node.gpus_per_node) + " or " +
              std::to_string((gpus / c.node.gpus_per_node + 1) * c.node.gpus_per_node));
  c.nodes = gpus / c.node.gpus_per_node;
  if (a.has("--nvlink-gbytes")) c.node.intra_bandwidth = parse_number("--nvlink-gbytes", a.get("--nvlink-gbytes")) * 1e9;
  if (a.has("--network-gbits")) c.node.network_bandwidth = parse_number("--network-gbits", a.get("--network-gbits")) * 1e9 / 8;
  if (a.has("--oversubscription")) c.oversubscription = parse_number("--oversubscription", a.get("--oversubscription"), 1);
  if (c.node.intra_bandwidth <= 0 || c.node.network_bandwidth <= 0 || c.oversubscription < 1)
    bad_input("bandwidths must be positive and oversubscription at least 1");
  return c;
}

job_desc read_job(const arguments& a) {
  job_desc j;
  if (a.has("--global-batch")) j.global_batch = parse_count("--global-batch", a.get("--global-batch"));
  if (a.has("--global-batch-tokens"))
    j.global_batch_tokens = parse_number("--global-batch-tokens", a.get("--global-batch-tokens"));
  if (j.global_batch <= 0 && j.global_batch_tokens <= 0)
    bad_input("--global-batch (sequences per step) or --global-batch-tokens is required");
  if (a.has("--tokens")) j.tokens = parse_number("--tokens", a.get("--tokens"));
  if (a.has("--price")) j.price_per_gpu_hour = parse_number("--price", a.get("--price"));
  if (a.flags.count("--fp8")) j.gemm_precision = precision::fp8;
  return j;
}

search_options read_options(const arguments& a) {
  search_options o;
  if (a.has("--top")) o.top = std::min(parse_count("--top", a.get("--top")), 64);
  o.allow_uneven_stages = a.flags.count("--uneven-stages") > 0;
  software_desc& s = o.software;
  s.flash_attention = !a.flags.count("--no-flash");
  s.sequence_parallel = !a.flags.count("--no-sequence-parallel");
  s.interleaved_schedule = !a.flags.count("--no-interleaving");
  s.context_parallel = !a.flags.count("--no-context-parallel");
  s.overlap_dp = !a.flags.count("--no-overlap");
  if (a.has("--max-sharding")) {
    auto sh = parse_sharding(a.get("--max-sharding"));
    if (!sh) bad_input("--max-sharding must be none, optimizer, gradients or full");
    s.max_sharding = *sh;
  }
  layout_constraint& f = o.fixed;
  if (a.has("--tp")) f.tp = parse_count("--tp", a.get("--tp"));
  if (a.has("--pp")) f.pp = parse_count("--pp", a.get("--pp"));
  if (a.has("--dp")) f.dp = parse_count("--dp", a.get("--dp"));
  if (a.has("--cp")) f.cp = parse_count("--cp", a.get("--cp"));
  if (a.has("--vp")) f.vp = parse_count("--vp", a.get("--vp"));
  if (a.has("--micro-batch")) f.micro_batch = parse_count("--micro-batch", a.get("--micro-batch"));
  if (a.has("--recompute")) {
    f.recompute_mode = parse_recompute(a.get("--recompute"));
    if (!f.recompute_mode) bad_input("--recompute must be none, selective or full, got '" + a.get("--recompute") + "'");
  }
  if (a.has("--sharding")) {
    f.sharding_mode = parse_sharding(a.get("--sharding"));
    if (!f.sharding_mode) bad_input("--sharding must be none, optimizer, gradients or full");
  }
  return o;
}

bool has_layout(const layout_constraint& f) {
  return f.tp || f.pp || f.dp || f.cp || f.vp || f.micro_batch || f.recompute_mode || f.sharding_mode;
}

/// The best plan when one given field is let go, as "nearest valid alternative: ...".
std::string nearest_alternative(const model_desc& m, const cluster_desc& c, const job_desc& j, search_options o) {
  layout_constraint given = o.fixed;
  o.top = 1;
  using field = int layout_constraint::*;
  const field order[] = {&layout_constraint::dp, &layout_constraint::tp, &layout_constraint::pp,
                         &layout_constraint::cp, &layout_constraint::vp, &layout_constraint::micro_batch};
  for (field f : order) {
    if (!(given.*f)) continue;
    o.fixed = given;
    o.fixed.*f = 0;
    search_result r = search(m, c, j, o);
    if (!r.plans.empty()) return "nearest valid alternative: " + describe(r.plans.front().config);
  }
  o.fixed = {};
  search_result r = search(m, c, j, o);
  if (!r.plans.empty()) return "best valid layout: " + describe(r.plans.front().config);
  return "no layout of these GPUs fits this model";
}

/// Checks the fully given degrees of an evaluate request before searching the rest.
void check_given_layout(const model_desc& m, const cluster_desc& c, const job_desc& j, const search_options& o) {
  const layout_constraint& f = o.fixed;
  const int gpus = gpu_count(c);
  auto divides_heads = [&](int tp) { return weft::layout::tp_splits_heads(m.heads, kv_heads_of(m), tp); };
  if (f.tp && (!divides_heads(f.tp) || f.tp > c.node.gpus_per_node)) {
    int lower = f.tp, higher = f.tp;
    while (lower > 1 && !(divides_heads(lower) && c.node.gpus_per_node % lower == 0)) --lower;
    while (higher <= c.node.gpus_per_node && !(divides_heads(higher) && c.node.gpus_per_node % higher == 0)) ++higher;
    std::string reason = f.tp > c.node.gpus_per_node
                             ? "tp = " + std::to_string(f.tp) + " is larger than a node (" +
                                   std::to_string(c.node.gpus_per_node) + " GPUs)"
                             : "the " + std::to_string(m.heads) + " heads (" + std::to_string(kv_heads_of(m)) +
                                   " key/value heads) do not divide by tp = " + std::to_string(f.tp);
    std::string hint = "nearest valid tp: " + std::to_string(lower);
    if (higher <= c.node.gpus_per_node && higher != lower) hint += " or " + std::to_string(higher);
    bad_input("invalid layout: " + reason + "; " + hint);
  }
  if (f.tp && f.pp && f.dp && f.tp * (f.cp ? f.cp : 1) * f.pp * f.dp != gpus) {
    const int known = f.tp * (f.cp ? f.cp : 1) * f.pp;
    std::string hint = gpus % known == 0 ? "; with these tp, cp and pp use --dp " + std::to_string(gpus / known)
                                         : "; " + nearest_alternative(m, c, j, o);
    bad_input("invalid layout: tp x cp x pp x dp = " + std::to_string(known * f.dp) + " but there are " +
              std::to_string(gpus) + " GPUs" + hint);
  }
  // Everything given: use the cost model's own rules for the precise reason.
  if (f.tp && f.pp && f.dp) {
    layout_choice l{.parallel = {.world_size = gpus, .tp = f.tp, .cp = f.cp ? f.cp : 1, .pp = f.pp, .dp = f.dp,
                                 .virtual_stages = f.vp ? f.vp : 1},
                    .micro_batch = f.micro_batch ? f.micro_batch : 1};
    if (std::string problem = layout_problem(m, c, j, l, o.allow_uneven_stages); !problem.empty())
      bad_input("invalid layout: " + problem + "; " + nearest_alternative(m, c, j, o));
  }
}

int validate(const std::string& path) {
  const std::vector<published_run> runs = read_published_runs(path);
  std::printf("| source | model | GPUs | layout tp/pp/dp (vp, mb, recompute) | published MFU | predicted MFU | error | "
              "chosen tp/cp/pp/dp vp mb recompute sharding | same TP | PP within 2x | chosen/published throughput | "
              "chosen/best at published TP |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  double sum = 0, worst = 0;
  int tp = 0, pp = 0, not_worse = 0;
  int checked = 0;
  for (const published_run& r : runs) {
    run_check c;
    try {
      c = check_run(r);
    } catch (const weft::error& e) {  // reported, and left out of the totals
      std::printf("| %s | %s | %d | %s |\n", r.source.c_str(), r.name.c_str(), r.gpus, e.what());
      continue;
    }
    ++checked;
    const layout_choice& p = c.published.config;
    const layout_choice& q = c.chosen.config;
    std::printf("| %s | %s | %d | %d/%d/%d (%d, %d, %s) | %.1f %% | %.1f %% | %+.1f %% | %d/%d/%d/%d vp%d mb%d %s %s | %s | %s | %.2f | %.3f |\n",
                r.source.c_str(), r.name.c_str(), r.gpus, p.parallel.tp, p.parallel.pp, p.parallel.dp, p.parallel.virtual_stages, p.micro_batch,
                std::string(to_string(p.recompute_mode)).c_str(), 100 * r.published_mfu, 100 * c.predicted_mfu,
                100 * c.error, q.parallel.tp, q.parallel.cp, q.parallel.pp, q.parallel.dp, q.parallel.virtual_stages, q.micro_batch,
                std::string(to_string(q.recompute_mode)).c_str(), std::string(to_string(q.sharding_mode)).c_str(),
                c.same_tp ? "yes" : "no", c.pp_within_2 ? "yes" : "no",
                c.chosen.tokens_per_s / c.published.tokens_per_s, c.chosen.tokens_per_s / c.with_published_tp.tokens_per_s);
    sum += std::abs(c.error);
    worst = std::max(worst, std::abs(c.error));
    tp += c.same_tp;
    pp += c.pp_within_2;
    not_worse += c.not_worse;
  }
  const double n = static_cast<double>(checked);
  if (checked < static_cast<int>(runs.size()))
    std::printf("\n%zu of %zu runs could not be checked (above); the totals are over the other %d\n",
                runs.size() - static_cast<std::size_t>(checked), runs.size(), checked);
  std::printf("\nruns %d: mean |error| %.1f %%, max |error| %.1f %%; same TP %d (%.0f %%), PP within 2x %d (%.0f %%), "
              "chosen not slower %d (%.0f %%)\n",
              checked, 100 * sum / n, 100 * worst, tp, 100 * tp / n, pp, 100 * pp / n, not_worse, 100 * not_worse / n);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const arguments a = parse(argc, argv);
    if (a.flags.count("--help") || a.flags.count("-h") || argc == 1) {
      std::fputs(usage, argc == 1 ? stderr : stdout);
      return argc == 1 ? exit_bad_input : 0;
    }
    if (a.has("--validate")) return validate(a.get("--validate"));
    const model_desc model = read_model(a);
    if (a.has("--probe")) {
#if WEFT_PLAN_HAS_PROBE
      return weft_plan::run_probe(a.get("--probe"), model, argc, argv);
#else
      bad_input("--probe needs MPI, and this weft-plan was built without it");
#endif
    }
    const std::optional<measured_hardware> measured = read_measured(a);
    const cluster_desc cluster = read_cluster(a, measured);
    const job_desc job = read_job(a);
    search_options options = read_options(a);
    if (measured) options.calib = calibration_of(*measured);
    const bool json = a.flags.count("--json") > 0;
    const bool evaluating = has_layout(options.fixed);
    if (evaluating) check_given_layout(model, cluster, job, options);

    const search_result result = search(model, cluster, job, options);
    if (result.plans.empty()) {
      std::string message = evaluating ? "this layout does not fit in memory" : "no layout fits in memory";
      if (result.smallest)
        message += ": the smallest, " + describe(result.smallest->config) + ", needs " +
                   std::to_string(static_cast<long long>(result.smallest->memory.total / 1e9)) + " GB per GPU of " +
                   std::to_string(static_cast<long long>(result.smallest->memory.usable / 1e9)) + " GB usable";
      else
        message += ": no valid layout (check that the global batch divides by the data-parallel degree)";
      if (evaluating) message += "; " + nearest_alternative(model, cluster, job, options);
      else message += "; use more GPUs, a GPU with more memory, a smaller global batch or sequence, or allow sharding";
      std::fprintf(stderr, "weft-plan: %s\n", message.c_str());
      return exit_no_fit;
    }

    std::optional<claim_check> claim;
    double claim_days = 0;
    if (a.has("--claim-days")) {
      if (job.tokens <= 0) bad_input("--claim-days needs --tokens (the tokens the claim is about)");
      claim_days = parse_number("--claim-days", a.get("--claim-days"));
      claim = check_claim(model, cluster.gpu, gpu_count(cluster), job.tokens, claim_days, job.gemm_precision);
    }
    const plan& best = result.plans.front();
    const search_options explain_options{.top = 1, .software = options.software, .calib = options.calib,
                                         .allow_uneven_stages = options.allow_uneven_stages};
    const explanation why = explain(best, model, cluster, job, explain_options, evaluating ? "evaluated" : "best");
    if (json) {
      std::string out = "{\"gpus\": " + std::to_string(gpu_count(cluster)) +
                        ", \"global_batch\": " + std::to_string(global_batch_sequences(job, model)) +
                        ", \"params\": " + detail::json_number(param_count(model)) +
                        ", \"layouts_valid\": " + std::to_string(result.layouts_valid) +
                        ", \"layouts_evaluated\": " + std::to_string(result.layouts_evaluated) + ", \"plans\": [";
      for (std::size_t i = 0; i < result.plans.size(); ++i) out += (i ? ", " : "") + to_json(result.plans[i]);
      out += "]";
      if (claim)
        out += ", \"claim\": {\"days\": " + detail::json_number(claim_days) + ", \"implied_mfu\": " +
               detail::json_number(claim->implied_mfu) + ", \"possible\": " + (claim->possible ? "true" : "false") +
               ", \"predicted_days\": " + detail::json_number(best.days) + ", \"predicted_cost\": " +
               detail::json_number(best.cost) + "}";
      if (!evaluating) out += ", \"headline\": " + detail::json_string(headline(best, why, job));
      if (a.flags.count("--explain")) {
        const explanation& e = why;
        out += ", \"explanation\": [";
        for (std::size_t i = 0; i < e.alternatives.size(); ++i)
          out += std::string(i ? ", " : "") + "{\"alternative\": " + detail::json_string(e.alternatives[i].name) +
                 ", \"verdict\": " + detail::json_string(e.alternatives[i].verdict) + "}";
        out += "]";
      }
      std::printf("%s}\n", out.c_str());
      return 0;
    }
    // The answer first (for a search, not an evaluation of the user's own layout), then the table.
    if (!evaluating) std::printf("%s\n\n", headline(best, why, job).c_str());
    std::printf("%.3g B parameters, %d GPUs (%s, %d per node), global batch %d sequences of %d tokens; "
                "%lld valid layouts, %lld fit\n",
                param_count(model) / 1e9, gpu_count(cluster), std::string(cluster.gpu.name).c_str(),
                cluster.node.gpus_per_node, global_batch_sequences(job, model), model.seq, result.layouts_valid,
                result.layouts_evaluated);
    std::printf("%s", format_table(result.plans).c_str());
    if (claim) {
      std::printf("\nClaim: %.3g tokens in %.3g days on %d %s: implies %.1f %% MFU -> %s. The model predicts %.1f %% MFU: "
                  "%.3g days",
                  job.tokens, claim_days, gpu_count(cluster), std::string(cluster.gpu.name).c_str(),
                  100 * claim->implied_mfu,
                  !claim->possible                      ? "IMPOSSIBLE (over 100 % MFU)"
                  : claim->implied_mfu > 1.25 * best.mfu ? "physically possible but far above what the model predicts"
                                                         : "consistent with the model",
                  100 * best.mfu, best.days);
      if (best.cost > 0) std::printf(", cost %.4g", best.cost);
      std::printf(".\n");
    }
    if (a.flags.count("--explain")) std::printf("\n%s", to_text(why).c_str());
    return 0;
  } catch (const weft_programs::usage_error& e) {
    std::fprintf(stderr, "weft-plan: %s\n", e.what());
    return exit_bad_input;
  } catch (const weft::error& e) {
    std::fprintf(stderr, "weft-plan: %s\n", e.what());
    return exit_bad_input;
  }
}
