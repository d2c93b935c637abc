#pragma once
// train_gpt and weft's tuner: the model and software as the tuner sees them, the prediction for
// the layout in use (--hardware), and the layout the tuner picks for the ranks given (--plan),
// expert parallelism included for a mixture of experts.

#include <string>

#include <weft/tune/cost_model.hpp>
#include <weft/tune/hardware_file.hpp>
#include <weft/tune/report.hpp>
#include <weft/tune/search.hpp>

#include "gpt_config.hpp"

namespace train_gpt {

/// GPT-2 as the tuner describes a model; a mixture of experts with its experts (each GPT-2's
/// MLP, so the tuner's expert MLP size is the dense one's), top-k and MoE block frequency.
inline weft::tune::model_desc tuner_model(const gpt_config& m) {
  weft::tune::model_desc d{.layers = m.layers, .hidden = m.hidden, .heads = m.heads, .vocab = m.vocab, .seq = m.seq,
                           .tied_embeddings = true};
  if (m.moe_experts > 0) d.experts = m.moe_experts, d.top_k = m.moe_top_k, d.moe_every = m.moe_every;
  return d;
}

/// What train_gpt can run: sequence, context and interleaved pipeline parallelism, gradient
/// reduction overlapped with backward, ZeRO-1 with any layout and ZeRO-2/3 without pipeline
/// stages, selective and full recomputation (--recompute); attention skips the masked half of
/// the causal scores and never stores them (so the tuner weighs selective recomputation only
/// when asked for it); float32 gradients; experts split over ep, each run whole on every tp rank
/// (expert-tp = tp, no parallel folding). A mixture of experts shards at most the optimizer
/// state: ZeRO-2, ZeRO-3 and HSDP shard units every dp x cp rank holds, which experts held by their
/// ep rank alone are not (train_gpt refuses them with ep > 1).
inline weft::tune::software_desc tuner_software(bool mixture_of_experts = false) {
  return {.flash_attention = true,
          .sequence_parallel = true,
          .interleaved_schedule = true,
          .context_parallel = true,
          .overlap_dp = true,
          .overlap_tp = false,
          .max_sharding = mixture_of_experts ? weft::tune::sharding::optimizer : weft::tune::sharding::full,
          .sharding_with_pipeline = false,
          .selective_recompute = true,
          .expert_tp_folding = false,
          .gradient_bytes = 4};
}

/// The tuner's step time (seconds) for `layout` (with its world size set) on measured hardware.
inline double predicted_step_seconds(const gpt_config& m, const weft::tune::measured_hardware& hw,
                                     const weft::tune::layout_choice& layout, int global_batch) {
  return weft::tune::predict(tuner_model(m), hw, {.global_batch = global_batch}, layout, tuner_software(m.moe_experts > 0)).time.step;
}

/// The best layout for `world` ranks of the measured hardware, and the tuner's report on it
/// (the headline, then the table of the best few and why the usual alternatives lose).
struct planned_layout {
  weft::tune::layout_choice layout;
  std::string report;
};

inline planned_layout plan_layout(const gpt_config& m, const weft::tune::measured_hardware& hw, int global_batch) {
  using namespace weft::tune;
  const model_desc model = tuner_model(m);
  const cluster_desc cluster = cluster_of(hw);
  const job_desc job{.global_batch = global_batch};
  search_options options{.top = 5, .software = tuner_software(m.moe_experts > 0), .calib = calibration_of(hw)};
  const search_result result = search(model, cluster, job, options);
  if (result.plans.empty())
    weft::fail("--plan: no layout of " + std::to_string(gpu_count(cluster)) + " ranks fits this model with a global batch of " +
         std::to_string(global_batch) + " sequences (" +
         (result.smallest ? "the closest needs " + std::to_string(result.smallest->memory.total / 1e9) + " GB per rank"
                          : std::string("no valid layout: check that the global batch divides over the ranks")) +
         ")");
  const plan& best = result.plans.front();
  const explanation why = explain(best, model, cluster, job,
                                  {.top = 1, .software = options.software, .calib = options.calib});
  return {best.config, headline(best, why, job) + "\n" + format_table(result.plans) + to_text(why)};
}

}  // namespace train_gpt
