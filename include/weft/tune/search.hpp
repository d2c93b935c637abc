#pragma once
/// \file
/// The search: every valid layout of the cluster's GPUs (tp x cp x pp x dp, virtual stages,
/// micro-batch, recomputation, sharding) ranked by predicted throughput. Memory is checked first
/// and cuts whole branches (a pipeline/sharding choice whose weights alone do not fit, a
/// micro-batch larger than one that did not fit); the inner loop allocates nothing.

#include <array>
#include <optional>
#include <string>
#include <vector>

#include <weft/layout/model_shape.hpp>
#include <weft/tune/cost_model.hpp>

namespace weft::tune {

/// Fields of a layout the search must keep; 0 (or empty) leaves the field free.
struct layout_constraint {
  int tp = 0, cp = 0, pp = 0, dp = 0, vp = 0, micro_batch = 0;
  int ep = 0, expert_tp = 0;  ///< expert parallelism (mixtures of experts only)
  std::optional<recompute> recompute_mode{};
  std::optional<sharding> sharding_mode{};
};

/// How to search.
struct search_options {
  int top = 5;                      ///< plans to return, best first (at most 64)
  layout_constraint fixed{};        ///< fields to keep fixed
  software_desc software{};         ///< what the training software supports
  calibration calib = default_calibration;
  bool allow_uneven_stages = false; ///< accept pp x vp that does not divide the layers
  int max_cp = 16;                  ///< largest context-parallel degree to try
  int max_vp = 8;                   ///< most virtual stages per pipeline rank
  int max_micro_batch = 64;         ///< largest micro-batch to try
};

/// What the search found.
struct search_result {
  std::vector<plan> plans;          ///< the best layouts that fit, best first (empty if none fits)
  std::optional<plan> smallest;     ///< when nothing fits: the valid layout needing the least memory
  long long layouts_valid = 0;      ///< layouts that met every rule except memory
  long long layouts_evaluated = 0;  ///< layouts that fit and were timed
};

namespace detail {

/// The best `capacity` plans by step time, kept sorted without allocating.
class top_plans {
 public:
  static constexpr int max_size = 64;
  explicit top_plans(int capacity) noexcept : capacity_(std::clamp(capacity, 1, max_size)) {}

  /// Step time a plan must beat to enter.
  double bar() const noexcept { return size_ < capacity_ ? 1e300 : plans_[size_ - 1].time.step; }

  void offer(const plan& p) noexcept {
    if (p.time.step >= bar()) return;
    int i = size_ < capacity_ ? size_++ : size_ - 1;
    while (i > 0 && plans_[i - 1].time.step > p.time.step) {
      plans_[i] = plans_[i - 1];
      --i;
    }
    plans_[i] = p;
  }

  std::vector<plan> take() const { return {plans_.begin(), plans_.begin() + size_}; }

 private:
  std::array<plan, max_size> plans_{};
  int capacity_;
  int size_ = 0;
};

constexpr bool keep(int fixed, int value) noexcept { return fixed == 0 || fixed == value; }

}  // namespace detail

/// Ranks every valid layout of `cluster`'s GPUs for `model` and `job` by predicted throughput.
/// Rules: tp divides the heads and the key/value heads and fits in a node; cp splits the sequence
/// into 2 cp chunks; pp x vp divides the layers (unless allow_uneven_stages); dp x micro-batch
/// divides the global batch; at least pp micro-batches per step (a multiple of pp when
/// interleaved); the busiest stage fits in memory. For a mixture of experts, Megatron-Core's
/// rules for the expert grid: ep divides the experts; ep x expert-tp divides tp x cp x dp (the
/// ranks of a pipeline stage; what remains is the expert data-parallel size); expert-tp is tp or
/// 1 (Megatron-Core's parallel folding) and fits in a node; ep > 1 with tp > 1 needs sequence
/// parallelism. The divisibility rules are weft::layout's
/// (model_shape.hpp). Plans with equal step times stay in the order the loops meet them, smaller
/// tp, cp and pp first: of tied layouts the simpler ranks higher. Throws weft::error for an
/// unusable model or job.
inline search_result search(const model_desc& model, const cluster_desc& cluster, const job_desc& job,
                            const search_options& options = {}) {
  check_model(model);
  const int gpus = gpu_count(cluster);
  if (gpus < 1) fail("tune: the cluster has no GPUs (--gpus)");
  const int batch = global_batch_sequences(job, model);
  if (batch < 1) fail("tune: the job needs a global batch (--global-batch)");
  const software_desc& sw = options.software;
  const layout_constraint& fx = options.fixed;
  detail::evaluator ev(model, cluster, job, sw, options.calib);
  detail::top_plans best(options.top);
  search_result result;
  double smallest_memory = 1e300;
  const int kv = kv_heads_of(model);
  const double usable = ev.usable_memory();

  for (int tp = 1; tp <= cluster.node.gpus_per_node; ++tp) {
    if (cluster.node.gpus_per_node % tp || !weft::layout::tp_splits_heads(model.heads, kv, tp) || gpus % tp ||
        !detail::keep(fx.tp, tp))
      continue;
    const bool sp = sw.sequence_parallel && tp > 1;
    const int max_cp = sw.context_parallel ? options.max_cp : 1;
    for (int cp = 1; cp <= max_cp && tp * cp <= gpus; cp *= 2) {
      if ((gpus / tp) % cp || !weft::layout::cp_splits_sequence(model.seq, cp) || !detail::keep(fx.cp, cp)) continue;
      const int rest = gpus / (tp * cp);
      for (int pp = 1; pp <= rest && pp <= model.layers; ++pp) {
        if (rest % pp || !detail::keep(fx.pp, pp)) continue;
        if (!options.allow_uneven_stages && !weft::layout::pp_splits_layers(model.layers, pp, 1)) continue;
        const int dp = rest / pp;
        if (!detail::keep(fx.dp, dp) || batch % dp) continue;
        const int per_dp = batch / dp;  // sequences per pipeline per step
        if (pp > 1 && per_dp < pp) continue;
        for (int mb = 1; mb <= per_dp && mb <= options.max_micro_batch; ++mb) {
          if (per_dp % mb || !detail::keep(fx.micro_batch, mb)) continue;
          const int m = per_dp / mb;
          if (pp > 1 && m < pp) break;  // larger micro-batches only make fewer
          bool any_fit = false;
          // Expert layouts: ep dividing the experts, expert-tp tp or 1, ep x expert-tp dividing the
          // stage's tp x cp x dp ranks. A dense model has one: ep = 1, expert-tp = tp.
          const int max_ep = is_moe(model) ? std::min(model.experts, tp * cp * dp) : 1;
          for (int ep = 1; ep <= max_ep; ++ep) {
            if (!weft::layout::ep_splits_experts(model.experts, ep) || !detail::keep(fx.ep, ep)) continue;
            if (ep > 1 && tp > 1 && !sp) continue;  // Megatron-Core: ep with tp needs sequence parallelism
            for (int folded = 0; folded <= (is_moe(model) && tp > 1 && sw.expert_tp_folding ? 1 : 0); ++folded) {
              const int etp = folded ? 1 : tp;
              if (!detail::keep(fx.expert_tp, etp) || (tp * cp * dp) % (ep * etp)) continue;
              const detail::layer_costs costs = ev.costs(tp, cp, sp, mb, ep, etp);
              for (int sh = 0; sh <= static_cast<int>(sw.max_sharding); ++sh) {
                const auto shard = static_cast<sharding>(sh);
                if (fx.sharding_mode && *fx.sharding_mode != shard) continue;
                if (shard != sharding::none && dp * cp == 1) continue;  // nothing to shard over
                if (shard >= sharding::gradients && pp > 1 && !sw.sharding_with_pipeline) continue;
                for (int vp = 1; vp <= (pp > 1 && sw.interleaved_schedule ? options.max_vp : 1); ++vp) {
                  if (!detail::keep(fx.vp, vp)) continue;
                  if (vp > 1 && ((!weft::layout::pp_splits_layers(model.layers, pp, vp) && !options.allow_uneven_stages) ||
                                 pp * vp > model.layers || m % pp))
                    continue;
                  for (int rc = 0; rc <= 2; ++rc) {
                    const auto mode = static_cast<recompute>(rc);
                    if (fx.recompute_mode && *fx.recompute_mode != mode) continue;
                    // Selective recomputation only saves the attention scores a fused kernel never stores.
                    if (mode == recompute::selective && sw.flash_attention && !fx.recompute_mode) continue;
                    if (mode == recompute::selective && !sw.selective_recompute && !fx.recompute_mode) continue;
                    const layout_choice l{
                        .parallel = {.world_size = gpus, .tp = tp, .cp = cp, .ep = ep, .pp = pp, .dp = dp,
                                     .expert_tp = etp == tp ? 0 : etp, .virtual_stages = vp},
                        .micro_batch = mb, .recompute_mode = mode, .sharding_mode = shard, .sequence_parallel = sp};
                    ++result.layouts_valid;
                    const memory_breakdown mem = ev.memory(l, costs);
                    if (mem.total > usable) {
                      if (mem.total < smallest_memory) {
                        smallest_memory = mem.total;
                        result.smallest = ev.evaluate(l, costs);
                      }
                      continue;  // try more recomputation
                    }
                    any_fit = true;
                    ++result.layouts_evaluated;
                    best.offer(ev.evaluate(l, costs));
                    break;  // more recomputation only adds time
                  }
                }
              }
            }  // expert-tp
          }  // ep
          if (!any_fit && !fx.micro_batch) break;  // a larger micro-batch needs even more memory
        }
      }
    }
  }
  result.plans = best.take();
  if (!result.plans.empty()) result.smallest.reset();
  return result;
}

/// The best plan of `search`, for a trainer that goes straight to its process groups:
///   auto plan = weft::tune::best(model, cluster, job);
///   weft::process_groups groups(world, plan.layout());
/// Throws weft::error when no layout fits in memory, naming the one that came closest.
inline plan best(const model_desc& model, const cluster_desc& cluster, const job_desc& job,
                 search_options options = {}) {
  options.top = 1;
  search_result r = search(model, cluster, job, options);
  if (r.plans.empty()) {
    std::string message = "tune: no layout of " + std::to_string(gpu_count(cluster)) + " GPUs fits this model in memory";
    if (r.smallest)
      message += "; the closest needs " + std::to_string(static_cast<long long>(r.smallest->memory.total / 1e9)) +
                 " GB per GPU of " + std::to_string(static_cast<long long>(r.smallest->memory.usable / 1e9)) +
                 " GB usable: use more GPUs, a smaller micro-batch or sequence, or allow sharding";
    fail(message);
  }
  return r.plans.front();
}

}  // namespace weft::tune
