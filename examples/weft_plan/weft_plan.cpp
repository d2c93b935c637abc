// weft-plan: picks TP / CP / PP / DP, virtual stages, micro-batch, recomputation and sharding for a
// transformer on a cluster, from weft's cost model, and explains the choice. See docs/tuning.md.

#include <cmath>
#include <cstdint>
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
#include "plan_arguments.hpp"
#if WEFT_PLAN_HAS_PROBE
#include "probe.hpp"
#endif

namespace {

using namespace weft::tune;

constexpr int exit_bad_input = 2;
constexpr int exit_no_fit = 3;

using weft_plan::arguments;
using weft_plan::bad_input;
using weft_plan::usage;

constexpr int exit_failure = 1;

/// What to change when no layout fits. Sharding is named only when the search was kept from
/// sharding fully (--max-sharding) and the closest layout does not: otherwise it cannot help.
std::string no_fit_advice(const search_result& result, const search_options& options) {
  const bool shards_fully = result.smallest && result.smallest->config.sharding_mode == sharding::full;
  if (!shards_fully && options.software.max_sharding != sharding::full)
    return "use more GPUs, a GPU with more memory, a smaller global batch or sequence, or allow sharding "
           "(--max-sharding full)";
  return "use more GPUs, a GPU with more memory, or a smaller global batch or sequence";
}

bool has_layout(const layout_constraint& f) {
  return f.tp || f.pp || f.dp || f.cp || f.vp || f.micro_batch || f.recompute_mode || f.sharding_mode || f.ep ||
         f.expert_tp;
}

/// The best plan when one given field is let go, as "nearest valid alternative: ...".
std::string nearest_alternative(const model_desc& m, const cluster_desc& c, const job_desc& j, search_options o) {
  layout_constraint given = o.fixed;
  o.top = 1;
  using field = int layout_constraint::*;
  const field order[] = {&layout_constraint::dp, &layout_constraint::tp, &layout_constraint::pp,
                         &layout_constraint::cp, &layout_constraint::ep, &layout_constraint::expert_tp,
                         &layout_constraint::vp, &layout_constraint::micro_batch};
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
  // Expert parallelism: Megatron-Core's rules, each with one message.
  if ((f.ep > 1 || f.expert_tp) && !is_moe(m))
    bad_input("invalid layout: --ep and --expert-tp split the experts of a mixture of experts, and this model has none "
              "(give --moe-experts)");
  if (f.ep > 1 && !weft::layout::ep_splits_experts(m.experts, f.ep))
    bad_input("invalid layout: " + std::to_string(m.experts) + " experts do not divide over ep = " + std::to_string(f.ep) +
              "; choose ep dividing the experts");
  // ep x expert-tp divides tp x cp x dp, a stage's ranks, so it divides the GPUs whatever pp is.
  if (const int etp = f.expert_tp ? f.expert_tp : f.tp; f.ep > 1 && etp && gpus % (std::int64_t{f.ep} * etp) != 0)
    bad_input("invalid layout: ep x expert-tp = " + std::to_string(std::int64_t{f.ep} * etp) + " does not divide the " +
              std::to_string(gpus) + " GPUs (it must divide tp x cp x dp, the ranks of a pipeline stage)");
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
  // tp is at most a node here and cp, pp, dp at most 2^20 (plan_arguments.hpp): `known` fits in 64
  // bits, and times dp too once it is at most the GPU count.
  const std::int64_t known = std::int64_t{f.tp} * (f.cp ? f.cp : 1) * f.pp;
  if (f.tp && f.pp && f.dp && !(known <= gpus && known * f.dp == gpus)) {
    std::string hint = known <= gpus && gpus % known == 0
                           ? "; with these tp, cp and pp use --dp " + std::to_string(gpus / known)
                           : "; " + nearest_alternative(m, c, j, o);
    const std::string product = known <= gpus ? std::to_string(known * f.dp) : "more than " + std::to_string(gpus);
    bad_input("invalid layout: tp x cp x pp x dp = " + product + " but there are " + std::to_string(gpus) + " GPUs" + hint);
  }
  // Everything given: use the cost model's own rules for the precise reason.
  if (f.tp && f.pp && f.dp) {
    layout_choice l{.parallel = {.world_size = gpus, .tp = f.tp, .cp = f.cp ? f.cp : 1, .ep = f.ep ? f.ep : 1, .pp = f.pp,
                                 .dp = f.dp, .expert_tp = f.expert_tp, .virtual_stages = f.vp ? f.vp : 1},
                    .micro_batch = f.micro_batch ? f.micro_batch : 1,
                    .sequence_parallel = f.tp > 1 && o.software.sequence_parallel};
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
    const arguments a = weft_plan::parse(argc, argv);
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
      else message += "; " + no_fit_advice(result, options);
      std::fprintf(stderr, "weft-plan: %s\n", message.c_str());
      return exit_no_fit;
    }

    std::optional<claim_check> claim;
    double claim_days = 0;
    if (a.has("--claim-days")) {
      if (job.tokens <= 0) bad_input("--claim-days needs --tokens (the tokens the claim is about)");
      claim_days = weft_plan::parse_number("--claim-days", a.get("--claim-days"), 1e-3, 1e6);
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
        out += "], \"caveats\": [";
        for (std::size_t i = 0; i < e.caveats.size(); ++i) out += (i ? ", " : "") + detail::json_string(e.caveats[i]);
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
  } catch (const std::exception& e) {  // e.g. std::bad_alloc: one line, not an abort
    std::fprintf(stderr, "weft-plan: %s\n", e.what());
    return exit_failure;
  }
}
