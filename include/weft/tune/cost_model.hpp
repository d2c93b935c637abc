#pragma once
/// \file
/// The cost model: memory per GPU and time per optimizer step of one layout, from published
/// formulas (sources in docs/tuning.md):
///  - FLOPs: 24 b s h^2 + 4 b s^2 h per GPT layer forward, backward twice the forward
///    (Narayanan et al. 2021; Korthikanti et al. 2022), generalised to GQA and gated MLPs;
///  - activations: s b h (34 + 5 a s / h) bytes per layer, split by tensor and sequence
///    parallelism, cut by selective or full recomputation (Korthikanti et al. 2022);
///  - training state: 18 bytes per parameter, 6 + 12/d with a distributed optimizer (Megatron-Core),
///    ZeRO stages 2 and 3 (Rajbhandari et al. 2020);
///  - pipeline bubble (p - 1) / (v m) and in-flight micro-batches of 1F1B and interleaved 1F1B
///    (Narayanan et al. 2021);
///  - tensor-parallel traffic: 4 all-reduces of b s h per layer per micro-batch (reduce-scatter +
///    all-gather with sequence parallelism), 6 with full recomputation;
///  - data-parallel traffic: 2 (d - 1) / d of the gradient bytes, hierarchically over NVLink and
///    the network (ring all-reduce bound), overlapped with the backward pass where allowed;
///  - GEMM efficiency d / (d + d_half) in the GEMM's smallest dimension d, with d_half scaled by
///    the GPU's ridge point, peak / memory bandwidth (the roofline, Williams et al. 2009).
/// Everything is a pure function of its inputs.

#include <algorithm>
#include <cmath>
#include <string>

#include <weft/core/error.hpp>
#include <weft/layout/model_shape.hpp>
#include <weft/tune/calibration.hpp>
#include <weft/tune/hardware.hpp>
#include <weft/tune/layout.hpp>
#include <weft/tune/model.hpp>

namespace weft::tune {

/// Bytes per GPU on the busiest pipeline stage.
struct memory_breakdown {
  double weights = 0;      ///< bf16 weights (plus gathered layers under full sharding)
  double gradients = 0;    ///< gradient buffers (fp32, or fp16 where the software keeps them so; plus any kept bf16 copy)
  double optimizer = 0;    ///< fp32 master weights and Adam moments
  double activations = 0;  ///< stored activations of in-flight micro-batches (+ the recompute working set)
  double logits = 0;       ///< output logits and the loss's fp32 softmax (last stage)
  double total = 0;
  double usable = 0;       ///< device memory minus the headroom
  bool fits() const noexcept { return total <= usable; }
};

/// Seconds per optimizer step on the busiest pipeline stage. `step` is the sum of the others
/// except `recompute`, which is the part of `compute` spent recomputing activations.
struct time_breakdown {
  double compute = 0;     ///< forward, backward and recomputation of every micro-batch
  double recompute = 0;   ///< of which recomputation
  double tp_comm = 0;     ///< tensor-parallel collectives (not overlapped)
  double cp_comm = 0;     ///< context-parallel key/value exchange not hidden behind attention
  double pp_comm = 0;     ///< pipeline point-to-point sends on the critical path
  double bubble = 0;      ///< pipeline fill and drain
  double dp_comm = 0;     ///< data-parallel reduction (and weight gathers) not hidden behind compute
  double optimizer = 0;   ///< the optimizer step (memory-bound)
  double step = 0;
};

/// A layout with its predictions.
struct plan {
  layout_choice config{};
  int micro_batches = 0;      ///< per pipeline per step
  memory_breakdown memory{};
  time_breakdown time{};
  double mfu = 0;             ///< model FLOPs (no recomputation) / (step time x GPUs x peak)
  double hfu = 0;             ///< hardware FLOPs (with recomputation) / (step time x GPUs x peak)
  double tokens_per_s = 0;    ///< whole cluster
  double days = 0;            ///< to train job.tokens (0 if not given)
  double cost = 0;            ///< days x 24 x GPUs x price (0 if not given)

  /// The layout `weft::process_groups` is built from, so a trainer goes from a plan to its
  /// communicators in one step: `weft::process_groups groups(world, plan.layout());`. Its
  /// virtual_stages() is the plan's interleaving; micro-batch, recomputation and sharding stay in
  /// `config`.
  weft::layout::rank_layout layout() const { return weft::layout::rank_layout(config.parallel); }
};

/// Sequences per optimizer step of a job (from `global_batch` or `global_batch_tokens`).
inline int global_batch_sequences(const job_desc& job, const model_desc& model) {
  if (job.global_batch > 0) return job.global_batch;
  if (job.global_batch_tokens > 0 && model.seq > 0)
    return std::max(1, static_cast<int>(std::lround(job.global_batch_tokens / model.seq)));
  return 0;
}

/// Checks that a model description is usable; throws weft::error saying which field is wrong.
inline void check_model(const model_desc& m) {
  auto need = [](bool ok, const char* what) {
    if (!ok) fail(std::string("tune: ") + what);
  };
  need(m.layers > 0, "the model needs a positive layer count (--layers)");
  need(m.hidden > 0, "the model needs a positive hidden size (--hidden)");
  need(m.heads > 0, "the model needs a positive head count (--heads)");
  need(m.hidden % m.heads == 0, "the hidden size must be a multiple of the head count");
  need(kv_heads_of(m) <= m.heads && m.heads % kv_heads_of(m) == 0,
       "the head count must be a multiple of the key/value head count (--kv-heads)");
  need(m.seq > 0, "the model needs a positive sequence length (--seq)");
  need(m.vocab > 0, "the model needs a positive vocabulary size (--vocab)");
  need(m.ffn >= 0, "the MLP size (--ffn) must be positive (or 0 for 4 x hidden)");
}

namespace detail {

/// Ring all-reduce time over one level: 2 (n - 1) / n of the bytes, plus a latency per step.
constexpr double ring_all_reduce(double bytes, int n, double bandwidth, double latency) noexcept {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) / n * bytes / bandwidth + 2.0 * (n - 1) * latency;
}

/// Per-layer, per-micro-batch costs that depend on (tp, cp, sequence parallel, micro-batch) only.
struct layer_costs {
  double forward = 0;          ///< forward compute of one layer (s)
  double weight_gemms = 0;     ///< of which the weight GEMMs (s), what tp collectives can hide behind
  double attention_core = 0;   ///< of which QK^T / softmax / AV (s), what selective recompute redoes
  double tp_collective = 0;    ///< one tp all-reduce (or reduce-scatter + all-gather) of the layer's activations (s)
  double cp_exchange = 0;      ///< key/value ring exchange of one forward pass (s)
  double logits_forward = 0;   ///< output layer and loss forward (s)
  double act_none = 0;         ///< activation bytes with no recomputation
  double act_selective = 0;    ///< activation bytes with selective recomputation
  double act_full = 0;         ///< activation bytes kept with full recomputation (the layer input)
  double logits_bytes = 0;     ///< logits and the loss's fp32 softmax
  double p2p = 0;              ///< one pipeline send of the stage boundary activations (s), before link choice
  double p2p_bytes = 0;
};

/// The invariant part of the model for one (model, cluster, job, software, calibration).
class evaluator {
 public:
  evaluator(const model_desc& model, const cluster_desc& cluster, const job_desc& job, const software_desc& software,
            const calibration& calib)
      : model_(model), cluster_(cluster), job_(job), software_(software), calib_(calib) {
    h_ = model.hidden;
    s_ = model.seq;
    a_ = model.heads;
    f_ = ffn_of(model);
    g_ = kv_ratio(model);
    v_ = model.vocab;
    global_batch_ = global_batch_sequences(job, model);
    gemm_peak_ = (job.gemm_precision == precision::fp8 && cluster.gpu.peak_fp8 > 0) ? cluster.gpu.peak_fp8
                                                                                     : cluster.gpu.peak_bf16;
    peak_fraction_ = gemm_peak_fraction(calib, cluster.gpu.architecture);
    layer_params_ = layer_params(model);
    embedding_ = static_cast<double>(model.vocab) * model.hidden;
    intra_bw_ = cluster.node.intra_bandwidth / 2 * calib.link_efficiency;
    net_bw_ = cluster.node.network_bandwidth * calib.link_efficiency / std::max(1.0, cluster.oversubscription);
    // Gradients go in buckets of the synchronizer's measured cap, at that size's bandwidth.
    dp_intra_bw_ = cluster.node.dp_bucket_bandwidth > 0 ? cluster.node.dp_bucket_bandwidth * calib.link_efficiency
                                                        : intra_bw_;
    usable_ = (cluster.gpu.memory_bytes - calib.memory_reserve) * (1 - calib.memory_headroom);
    flops_per_token_ = model_flops_per_token(model);
    half_size_ = calib.gemm_half_size;
    if (calib.gemm_half_size_follows_ridge && cluster.gpu.memory_bandwidth > 0)
      half_size_ *= (cluster.gpu.peak_bf16 / cluster.gpu.memory_bandwidth) / a100_ridge_point;
  }

  /// The A100-80GB's ridge point (312 TFLOP/s over 2039 GB/s), where `gemm_half_size` is defined.
  static constexpr double a100_ridge_point = 312e12 / 2039e9;

  const model_desc& model() const noexcept { return model_; }
  const cluster_desc& cluster() const noexcept { return cluster_; }
  const software_desc& software() const noexcept { return software_; }
  int global_batch() const noexcept { return global_batch_; }
  double usable_memory() const noexcept { return usable_; }

  /// GEMM time for `flops` at the efficiency of a GEMM whose smallest dimension is `d`.
  double gemm(double flops, double d, double peak) const noexcept {
    return flops * (d + half_size_) / (peak * peak_fraction_ * d);
  }

  /// Per-layer costs for one micro-batch of `b` sequences.
  layer_costs costs(int tp, int cp, bool sp, int b) const noexcept {
    layer_costs c;
    const double t = tp;
    const double tokens = static_cast<double>(b) * s_ / cp;  // tokens this GPU holds per micro-batch
    const double h = h_, f = f_, g = g_;
    const double head_dim = h / a_;
    // Weight GEMMs: QKV, output projection, MLP up (gate + up when gated), MLP down.
    const double up = m_swiglu() ? 2.0 : 1.0;
    // A GEMM's efficiency follows its smallest dimension: tokens, or the weight's rows or columns.
    auto dim = [tokens](double rows, double cols) { return std::min(tokens, std::min(rows, cols)); };
    double fwd = gemm(2 * tokens * h * h * (1 + 2 * g) / t, dim(h, h * (1 + 2 * g) / t), gemm_peak_) +
                 gemm(2 * tokens * h * h / t, dim(h / t, h), gemm_peak_) +
                 gemm(2 * tokens * h * f * up / t, dim(h, f / t), gemm_peak_) +
                 gemm(2 * tokens * f * h / t, dim(h, f / t), gemm_peak_);
    c.weight_gemms = fwd;
    // Attention core: QK^T and AV over the whole sequence; a fused kernel skips the masked half.
    const double attention_flops = 4 * tokens * s_ * h / t * (software_.flash_attention ? 0.5 : 1.0);
    c.attention_core = gemm(attention_flops, head_dim, cluster_.gpu.peak_bf16);
    // Activation bytes (Korthikanti et al. 2022, generalised): replicated across tp unless
    // sequence parallel (norm inputs, QKV and MLP inputs, dropout masks); split across tp (Q, K,
    // V, attention output, MLP intermediates); attention scores, absent with fused attention.
    const double replicated = 8.0 + (model_.dropout ? 2.0 : 0.0);
    const double split = 4.0 + 4.0 * g + (m_swiglu() ? 6.0 : 4.0) * f / h;
    const double scores =
        software_.flash_attention ? 0.0 : (model_.dropout ? 5.0 : 2.0) * a_ * static_cast<double>(s_) * tokens / t;
    c.act_selective = tokens * h * (replicated / (sp ? t : 1.0) + split / t);
    c.act_none = c.act_selective + scores;
    c.act_full = 2 * tokens * h / (sp ? t : 1.0);
    // Elementwise work streams the layer's activations through memory a fitted number of times;
    // the score part of it belongs to the attention core.
    const double bw = cluster_.gpu.memory_bandwidth;
    c.attention_core += calib_.elementwise_passes * scores / bw;
    c.forward = fwd + c.attention_core + calib_.elementwise_passes * c.act_selective / bw;
    // Tensor parallelism: one all-reduce (or reduce-scatter + all-gather) of b s h bf16 values.
    c.tp_collective = tp > 1 ? ring_all_reduce(2 * tokens * h, tp, intra_bw_, cluster_.node.intra_latency) : 0;
    // Context parallelism: each GPU receives the other cp - 1 chunks of K and V.
    if (cp > 1) {
      const bool crosses = tp * cp > cluster_.node.gpus_per_node;
      const double bytes = (cp - 1) * tokens * 4 * h * g / t;
      c.cp_exchange = bytes / (crosses ? net_bw_ : intra_bw_) +
                      (cp - 1) * (crosses ? cluster_.node.network_latency : cluster_.node.intra_latency);
    }
    // Output layer and loss (vocab-parallel): logits GEMM plus a pass over the fp32 softmax.
    c.logits_forward = gemm(2 * tokens * h * v_ / t, dim(h, v_ / t), gemm_peak_) +
                       calib_.elementwise_passes * 6 * tokens * v_ / t / bw;
    c.logits_bytes = 6 * tokens * v_ / t;
    c.p2p_bytes = 2 * tokens * h / (sp ? t : 1.0);
    return c;
  }

  /// Memory per GPU of `l` on its busiest stage, with per-layer costs `c`.
  memory_breakdown memory(const layout_choice& l, const layer_costs& c) const noexcept {
    const int m = global_batch_ / (l.parallel.dp * l.micro_batch);
    const double lps = (model_.layers + l.parallel.pp - 1) / l.parallel.pp;
    const double t = l.parallel.tp;
    const int shard_group = l.parallel.dp * l.parallel.cp;
    const double d = shard_group;
    const double max_params = stage_params(l);
    const double stage = lps * layer_params_;
    const bool z1 = l.sharding_mode != sharding::none;
    const bool z2 = l.sharding_mode == sharding::gradients || l.sharding_mode == sharding::full;
    const bool z3 = l.sharding_mode == sharding::full;
    auto state = [&](double params, memory_breakdown& mb) {
      mb.weights = 2 * params / (z3 ? d : 1.0) + (z3 && shard_group > 1 ? 2 * 2 * layer_params_ / t : 0.0);
      mb.gradients = (software_.gradient_bytes / (z2 ? d : 1.0) + software_.low_precision_gradient_bytes) * params;
      mb.optimizer = 12 * params / (z1 ? d : 1.0);
    };
    double stored = c.act_none;
    if (l.recompute_mode == recompute::selective) stored = c.act_selective;
    if (l.recompute_mode == recompute::full) stored = c.act_full;
    const double working = l.recompute_mode == recompute::full ? c.act_none : 0.0;
    memory_breakdown result;
    if (l.parallel.pp == 1) {
      state(max_params, result);
      result.activations = lps * stored + working;
      result.logits = c.logits_bytes;
    } else {
      // 1F1B keeps min(p, m) micro-batches in flight on the first stage; interleaving with v
      // chunks keeps p (1 + (p - 1) / (p v)) (Korthikanti et al. 2022, section 4.2.3).
      const double in_flight = l.parallel.virtual_stages > 1 ? l.parallel.pp + static_cast<double>(l.parallel.pp - 1) / l.parallel.virtual_stages : std::min(l.parallel.pp, m);
      memory_breakdown first, last;
      state((stage + embedding_) / t, first);
      first.activations = lps * in_flight * stored + working;
      // The last stage holds the output layer (a tied embedding keeps a copy there) and one
      // micro-batch in flight, plus its logits.
      state((stage + embedding_) / t, last);
      last.activations = lps * stored + working;
      last.logits = c.logits_bytes;
      first.total = first.weights + first.gradients + first.optimizer + first.activations;
      last.total = last.weights + last.gradients + last.optimizer + last.activations + last.logits;
      result = first.total >= last.total ? first : last;
    }
    result.total = result.weights + result.gradients + result.optimizer + result.activations + result.logits;
    result.usable = usable_;
    return result;
  }

  /// Parameters per GPU on the stage that holds the most.
  double stage_params(const layout_choice& l) const noexcept {
    const double lps = (model_.layers + l.parallel.pp - 1) / l.parallel.pp;
    if (l.parallel.pp == 1) return (model_.layers * layer_params_ + embedding_params(model_)) / l.parallel.tp;
    return (lps * layer_params_ + embedding_) / l.parallel.tp;
  }

  /// Evaluates `l` with precomputed per-layer costs `c` (from costs(l.parallel.tp, l.parallel.cp, l.sequence_parallel,
  /// l.micro_batch)). The layout must be valid (see layout_problem).
  plan evaluate(const layout_choice& l, const layer_costs& c) const noexcept {
    plan p;
    p.config = l;
    p.memory = memory(l, c);
    const int gpus = gpus_of(l);
    const int m = global_batch_ / (l.parallel.dp * l.micro_batch);
    p.micro_batches = m;
    const double lps = (model_.layers + l.parallel.pp - 1) / l.parallel.pp;
    const int shard_group = l.parallel.dp * l.parallel.cp;
    const double d = shard_group;
    const double max_params = stage_params(l);
    const bool z1 = l.sharding_mode != sharding::none;

    // ---- time ----------------------------------------------------------------------------
    const double fwd = c.forward, bwd = 2 * c.forward;
    double redo = 0;
    if (l.recompute_mode == recompute::full) redo = c.forward;
    if (l.recompute_mode == recompute::selective) redo = c.attention_core;
    const double collectives = 4.0 + (l.recompute_mode == recompute::full ? 2.0 : 0.0);
    double tp_layer = collectives * c.tp_collective;
    // Overlapped collectives run chunk by chunk behind the GEMMs (forward, backward, recompute);
    // the first chunk of each, 1/tp of it, stays exposed.
    if (software_.overlap_tp && l.parallel.tp > 1)
      tp_layer = std::max(tp_layer - (3 + (redo > 0 ? 1 : 0)) * c.weight_gemms, tp_layer / l.parallel.tp);
    const double cp_layer = std::max(0.0, c.cp_exchange - c.attention_core) +
                            std::max(0.0, 2 * c.cp_exchange - 2 * c.attention_core) +
                            (l.recompute_mode == recompute::full ? std::max(0.0, c.cp_exchange - c.attention_core) : 0.0);
    const double logits = 3 * c.logits_forward;  // the busiest stage is the last: it has the output layer
    const double mb_compute = lps * (fwd + bwd + redo) + logits;
    const double mb_time = mb_compute + lps * (tp_layer + cp_layer);
    time_breakdown& tb = p.time;
    tb.compute = m * mb_compute;
    tb.recompute = m * lps * redo;
    tb.tp_comm = m * lps * tp_layer;
    tb.cp_comm = m * lps * cp_layer;
    if (l.parallel.pp > 1) {
      tb.bubble = static_cast<double>(l.parallel.pp - 1) / l.parallel.virtual_stages * mb_time;
      const bool crosses = l.parallel.tp * l.parallel.cp * l.parallel.dp >= cluster_.node.gpus_per_node;
      const double send = c.p2p_bytes / (crosses ? net_bw_ : intra_bw_) +
                          (crosses ? cluster_.node.network_latency : cluster_.node.intra_latency);
      tb.pp_comm = 2.0 * (static_cast<double>(l.parallel.virtual_stages) * m + l.parallel.pp - 1) * send;
      // Where ranks share cores (compute measured with every rank busy), a stage idle in the
      // bubble lends its core to the busy ones: the step is the longer of the ranks' work at the
      // shared speed and the schedule's critical path at a whole core's speed.
      const double k = cluster_.node.ranks_per_core;
      if (k > 1) tb.bubble = std::max(0.0, (tb.compute + tb.bubble) / k - tb.compute);
    }

    // Data parallelism: the dp x cp group spans `per_node` GPUs in each of `nodes_spanned` nodes;
    // reduce inside the node over NVLink, across nodes over each GPU's own port.
    if (shard_group > 1) {
      const int per_node = std::max(1, std::min(shard_group, cluster_.node.gpus_per_node / std::max(1, l.parallel.tp * 1)));
      const int nodes_spanned = (shard_group + per_node - 1) / per_node;
      auto all_reduce = [&](double bytes) {
        return ring_all_reduce(bytes, per_node, dp_intra_bw_, cluster_.node.intra_latency) +
               ring_all_reduce(bytes / per_node, nodes_spanned, net_bw_, cluster_.node.network_latency);
      };
      const double grads = software_.gradient_bytes * max_params, weights = 2 * max_params;
      const double back_window = lps * (bwd + redo) * (1 - 1 / lps);
      const double fwd_window = lps * fwd * (1 - 1 / lps);
      auto exposed = [&](double comm, double window) {
        return software_.overlap_dp ? std::max(comm - window, comm / lps) : comm;
      };
      switch (l.sharding_mode) {
        case sharding::none: tb.dp_comm = exposed(all_reduce(grads), back_window); break;
        case sharding::optimizer:
          tb.dp_comm = exposed(all_reduce(grads) / 2, back_window) + exposed(all_reduce(weights) / 2, fwd_window);
          break;
        case sharding::gradients:
          tb.dp_comm = m * exposed(all_reduce(grads) / 2, back_window) + exposed(all_reduce(weights) / 2, fwd_window);
          break;
        case sharding::full:
          tb.dp_comm = m * (exposed(all_reduce(weights) / 2, fwd_window) +
                            exposed(all_reduce(weights) / 2 + all_reduce(grads) / 2, back_window));
          break;
      }
    }
    // Adam: read weights, gradients, master weights and two moments, write four of them back.
    tb.optimizer = 32 * max_params / (z1 ? d : 1.0) / cluster_.gpu.memory_bandwidth;
    tb.step = tb.compute + tb.tp_comm + tb.cp_comm + tb.pp_comm + tb.bubble + tb.dp_comm + tb.optimizer;

    const double tokens = static_cast<double>(global_batch_) * s_;
    const double peak = gpus * gemm_peak_;
    p.tokens_per_s = tokens / tb.step;
    p.mfu = tokens * flops_per_token_ / (tb.step * peak);
    double hw = flops_per_token_;
    if (l.recompute_mode == recompute::full)
      hw += model_.layers * (layer_matmul_flops_per_token(model_) + layer_attention_flops_per_token(model_));
    if (l.recompute_mode == recompute::selective) hw += model_.layers * layer_attention_flops_per_token(model_);
    p.hfu = tokens * hw / (tb.step * peak);
    if (job_.tokens > 0) {
      p.days = job_.tokens / p.tokens_per_s / 86400.0;
      p.cost = p.days * 24.0 * gpus * job_.price_per_gpu_hour;
    }
    return p;
  }

 private:
  bool m_swiglu() const noexcept { return model_.swiglu; }

  model_desc model_;
  cluster_desc cluster_;
  job_desc job_;
  software_desc software_;
  calibration calib_;
  double h_ = 0, s_ = 0, a_ = 0, f_ = 0, g_ = 1, v_ = 0;
  int global_batch_ = 0;
  double gemm_peak_ = 0, peak_fraction_ = 0, layer_params_ = 0, embedding_ = 0;
  double intra_bw_ = 0, net_bw_ = 0, dp_intra_bw_ = 0, usable_ = 0, flops_per_token_ = 0, half_size_ = 0;
};

}  // namespace detail

/// `l` with what it leaves to be derived filled in: world_size 0 becomes the cluster's GPU count,
/// dp 0 the world size over tp x cp x pp (when that divides).
inline layout_choice complete_layout(layout_choice l, const cluster_desc& cluster) {
  weft::layout::layout_spec& d = l.parallel;
  if (d.world_size == 0) d.world_size = gpu_count(cluster);
  const long long model_parallel = static_cast<long long>(d.tp) * d.cp * d.pp;
  if (d.dp == 0 && model_parallel > 0 && d.world_size % model_parallel == 0)
    d.dp = static_cast<int>(d.world_size / model_parallel);
  return l;
}

/// Why `l` is not a valid layout for this model, cluster and job, or an empty string. The rules
/// of the degrees and of how they split the model are weft::layout's (`validate`,
/// `check_model_shape`); the rest is the tuner's own (tp inside a node, the batch split into
/// micro-batches). `allow_uneven_stages` accepts a layer count that pp x vp does not divide (the
/// busiest stage then gets the rounded-up share).
inline std::string layout_problem(const model_desc& model, const cluster_desc& cluster, const job_desc& job,
                                  const layout_choice& given, bool allow_uneven_stages = false) {
  const layout_choice l = complete_layout(given, cluster);
  const weft::layout::layout_spec& d = l.parallel;
  const int gpus = gpu_count(cluster);
  const int batch = global_batch_sequences(job, model);
  auto str = [](auto v) { return std::to_string(v); };
  if (l.micro_batch < 1) return "the micro-batch must be at least 1";
  if (d.world_size != gpus)
    return "the layout is for a world of " + str(d.world_size) + " ranks but the cluster has " + str(gpus) + " GPUs";
  if (const std::vector<std::string> problems = weft::layout::validate(d); !problems.empty()) return problems.front();
  if (d.ep != 1 || (d.expert_tp != 0 && d.expert_tp != d.tp))
    return "the cost model has no expert parallelism: leave ep and expert_tp at their defaults";
  if (weft::layout::dim_order::parse(d.order) != weft::layout::dim_order())
    return "the cost model assumes the order " + std::string(weft::layout::default_order) + ", not '" + d.order + "'";
  if (d.tp > cluster.node.gpus_per_node)
    return "tp = " + str(d.tp) + " is larger than a node (" + str(cluster.node.gpus_per_node) +
           " GPUs): tensor parallelism needs NVLink";
  // With uneven stages allowed, the layer count is not checked against pp x vp (0: unknown).
  const weft::layout::model_shape shape{.heads = model.heads, .kv_heads = kv_heads_of(model),
                                        .layers = allow_uneven_stages ? 0 : model.layers, .seq_length = model.seq};
  if (const std::vector<std::string> problems = weft::layout::check_model_shape(weft::layout::rank_layout(d), shape);
      !problems.empty())
    return problems.front();
  if (d.pp * d.virtual_stages > model.layers)
    return "pp x vp = " + str(d.pp * d.virtual_stages) + " is more than the " + str(model.layers) + " layers";
  if (batch <= 0) return "the job needs a global batch (--global-batch)";
  if (batch % (d.dp * l.micro_batch) != 0)
    return "the global batch (" + str(batch) + " sequences) does not divide into dp x micro-batch = " +
           str(d.dp * l.micro_batch);
  const int m = batch / (d.dp * l.micro_batch);
  if (d.pp > 1 && m < d.pp)
    return str(m) + " micro-batches per step are fewer than the " + str(d.pp) + " pipeline stages";
  if (d.virtual_stages > 1 && m % d.pp != 0)
    return "the interleaved schedule needs the micro-batch count (" + str(m) + ") to be a multiple of pp = " + str(d.pp);
  if (l.sequence_parallel && d.tp == 1) return "sequence parallelism needs tp > 1";
  return {};
}

/// Predicts memory and step time of `l`. Throws weft::error if the layout is invalid (see
/// layout_problem); a layout that does not fit in memory is still evaluated (`memory.fits()`).
inline plan evaluate(const model_desc& model, const cluster_desc& cluster, const job_desc& job, const layout_choice& given,
                     const software_desc& software = {}, const calibration& calib = default_calibration,
                     bool allow_uneven_stages = false) {
  check_model(model);
  const layout_choice l = complete_layout(given, cluster);
  if (std::string problem = layout_problem(model, cluster, job, l, allow_uneven_stages); !problem.empty())
    fail("tune: invalid layout: " + problem);
  detail::evaluator ev(model, cluster, job, software, calib);
  return ev.evaluate(l, ev.costs(l.parallel.tp, l.parallel.cp, l.sequence_parallel, l.micro_batch));
}

}  // namespace weft::tune
