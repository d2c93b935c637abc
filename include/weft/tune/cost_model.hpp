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
///  - a latency per blocking exchange on the critical path (tp collectives, cp ring steps, pipeline
///    sends; `blocking_exchanges`), measured on probed machines (exchange_latency);
///  - data-parallel traffic: 2 (d - 1) / d of the gradient bytes, hierarchically over NVLink and
///    the network (ring all-reduce bound), overlapped with the backward pass where allowed;
///  - GEMM efficiency d / (d + d_half) in the GEMM's smallest dimension d, with d_half scaled by
///    the GPU's ridge point, peak / memory bandwidth (the roofline, Williams et al. 2009).
///  - mixtures of experts (Megatron-Core's MoE layer and expert grid): the router and the top-k
///    experts' FLOPs, grouped expert GEMMs, 4 all-to-alls of the routed tokens per MoE layer per
///    micro-batch over the ep group, routed experts split by ep x expert-tp and their state
///    sharded over the expert data-parallel group (docs/tuning.md, "Mixtures of experts").
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
  double ep_comm = 0;     ///< expert-parallel all-to-all (dispatch and combine, forward and backward)
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
  need(m.head_dim >= 0, "the head size (--head-dim) must be positive (or 0 for hidden / heads)");
  if (m.experts < 0 || m.top_k < 0 || m.expert_ffn < 0 || m.shared_experts < 0)
    fail("tune: the MoE sizes (--moe-experts, --moe-top-k, --moe-ffn, --moe-shared-experts) must not be negative");
  if (is_moe(m) && top_k_of(m) > m.experts)
    fail("tune: top-k = " + std::to_string(top_k_of(m)) + " is more than the " + std::to_string(m.experts) +
         " experts: a token is routed to at most every expert; give --moe-top-k from 1 to " + std::to_string(m.experts));
  if (is_moe(m) && m.moe_every < 1)
    fail("tune: --moe-every must be at least 1 (1: every layer is an MoE layer), got " + std::to_string(m.moe_every));
  if (!is_moe(m) && (m.top_k > 0 || m.expert_ffn > 0 || m.shared_experts > 0))
    fail("tune: --moe-top-k, --moe-ffn and --moe-shared-experts need --moe-experts (the routed experts per MoE layer)");
}

/// The blocking exchanges a rank of the busiest pipeline stage waits in, where they occur. Each
/// costs `node_desc::exchange_latency` on top of its transfer; they are counted as Megatron-Core
/// and train_gpt issue them (docs/tuning.md, "Communication").
struct exchange_counts {
  /// Tensor parallelism, per layer per micro-batch: the forward pass's 2 all-reduces and the
  /// backward pass's 2 (with sequence parallelism each a reduce-scatter and an all-gather, so 8);
  /// full recomputation reruns the forward pass's.
  double tp_per_layer = 0;
  /// Tensor parallelism outside the layers, per micro-batch: the output layer's input gathered
  /// (sequence parallel), the vocab-parallel loss's all-reduces of the row maxima and sums, the
  /// input gradient's reduction, and without pipeline stages the embedding's sum and (sequence
  /// parallel) its gradient's gather.
  double tp_per_micro_batch = 0;
  /// Context parallelism, per layer per micro-batch: ring attention's cp - 1 key/value hops
  /// forward, cp - 1 of them and cp hops of the gradient accumulators backward (and the forward
  /// ones again under full recomputation).
  double cp_per_layer = 0;
  /// Pipeline sends and receives on the critical path per step: 2 (v m + p - 1).
  double pp_per_step = 0;
};

/// The blocking exchanges of layout `l` with `micro_batches` micro-batches per step.
constexpr exchange_counts blocking_exchanges(const layout_choice& l, int micro_batches) noexcept {
  exchange_counts n;
  const bool full = l.recompute_mode == recompute::full;
  const double t = l.parallel.tp, c = l.parallel.cp, p = l.parallel.pp, v = l.parallel.virtual_stages;
  const bool sp = l.sequence_parallel;
  if (t > 1) {
    n.tp_per_layer = (sp ? 8.0 : 4.0) + (full ? (sp ? 4.0 : 2.0) : 0.0);
    n.tp_per_micro_batch = (sp ? 4.0 : 3.0) + (p == 1 ? (sp ? 2.0 : 1.0) : 0.0);
  }
  if (c > 1) n.cp_per_layer = (c - 1) + (2 * c - 1) + (full ? c - 1 : 0.0);
  if (p > 1) n.pp_per_step = 2 * (v * micro_batches + p - 1);
  return n;
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
  double all_to_all = 0;       ///< one expert-parallel all-to-all (dispatch or combine) of an MoE layer (s)
  double all_to_all_bytes = 0; ///< bytes each GPU sends in it (to the other ep - 1 ranks)
  double mlp_tp_collective = 0;  ///< the MLP's share: tp_collective in a dense layer, the expert-tp one in an MoE layer (averaged)
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
    q_ = attention_width_of(model);
    v_ = model.vocab;
    global_batch_ = global_batch_sequences(job, model);
    gemm_peak_ = (job.gemm_precision == precision::fp8 && cluster.gpu.peak_fp8 > 0) ? cluster.gpu.peak_fp8
                                                                                     : cluster.gpu.peak_bf16;
    peak_fraction_ = gemm_peak_fraction(calib, cluster.gpu.architecture);
    layer_params_ = layer_params(model);
    expert_layer_params_ = expert_params_per_layer(model);
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

  /// Per-layer costs for one micro-batch of `b` sequences; `ep` and `etp` (0: tp) place the
  /// experts of MoE layers. The costs of a layer are the average over dense and MoE layers.
  layer_costs costs(int tp, int cp, bool sp, int b, int ep = 1, int etp = 0) const noexcept {
    layer_costs c;
    const double t = tp;
    const double tokens = static_cast<double>(b) * s_ / cp;  // tokens this GPU holds per micro-batch
    const double h = h_, f = f_, g = g_, q = q_;
    const double head_dim = q / a_;
    const double x = moe_fraction(model_);  // share of MoE layers
    if (etp <= 0) etp = tp;
    // Weight GEMMs: QKV, output projection, MLP up (gate + up when gated), MLP down.
    const double up = m_swiglu() ? 2.0 : 1.0;
    // A GEMM's efficiency follows its smallest dimension: tokens, or the weight's rows or columns.
    auto dim = [tokens](double rows, double cols) { return std::min(tokens, std::min(rows, cols)); };
    const double dense_mlp = gemm(2 * tokens * h * f * up / t, dim(h, f / t), gemm_peak_) +
                             gemm(2 * tokens * f * h / t, dim(h, f / t), gemm_peak_);
    double fwd = gemm(2 * tokens * h * q * (1 + 2 * g) / t, dim(h, q * (1 + 2 * g) / t), gemm_peak_) +
                 gemm(2 * tokens * q * h / t, dim(q / t, h), gemm_peak_) + (1 - x) * dense_mlp;
    double moe_act = 0;  // split activation bytes of an MoE layer's MLP per token and hidden unit
    double expert_tp_collective = 0;
    if (x > 0) {
      // An MoE layer (Megatron-Core's all-to-all dispatcher; Megatron-Core MoE README). Each GPU
      // routes its tokens / t (sequence parallel) to top_k experts: the router (hidden x experts,
      // fp32 softmax), then the all-to-all over the ep group, an all-gather over the expert-tp
      // group, the experts as one grouped GEMM, and the reverse. With balanced routing every GPU
      // runs tokens x k / t tokens' worth of expert MLPs, whatever ep and etp: an expert GEMM sees
      // (tokens / t) k ep etp / experts rows.
      const double k = top_k_of(model_), e = model_.experts, fe = expert_ffn_of(model_);
      const double routed = tokens / t * k;  // token copies this GPU sends and (balanced) receives
      const double rows = routed * ep * etp / e;
      const double experts = gemm(2 * routed * h * fe * up, std::min(rows, std::min(h, fe / etp)), gemm_peak_) +
                             gemm(2 * routed * fe * h, std::min(rows, std::min(h, fe / etp)), gemm_peak_);
      const double router = gemm(2 * tokens / t * h * e, dim(h, e), gemm_peak_);
      const double shared = model_.shared_experts > 0
                                ? model_.shared_experts * (gemm(2 * tokens * h * fe * up / t, dim(h, fe / t), gemm_peak_) +
                                                           gemm(2 * tokens * fe * h / t, dim(h, fe / t), gemm_peak_))
                                : 0.0;
      fwd += x * (experts + router + shared);
      // Stored per token: each routed copy's permuted input (2 h bytes) and expert intermediates,
      // the shared experts' intermediates, the router's fp32 probabilities.
      const double inner = (m_swiglu() ? 6.0 : 4.0) * fe / h;
      moe_act = k * (2.0 + inner) + model_.shared_experts * inner + 4.0 * e / h;
      // The all-to-all: each GPU sends its routed copies (bf16) to the ep group, (ep - 1) / ep of
      // them to other GPUs. On the expert grid (tp-cp-ep-dp-pp with cp 1) the ep group is etp
      // apart: inside a node while etp x ep fits in it; beyond that the share of its members in
      // other nodes crosses the network, concurrently with the NVLink share.
      if (ep > 1) {
        const int node = cluster_.node.gpus_per_node;
        const double sent = 2 * routed * h * (ep - 1) / ep;
        const double per_node = etp * ep <= node ? ep : std::max(1, node / etp);
        const double remote = (ep - per_node) / (ep - 1.0);  // share of the other members in other nodes
        c.all_to_all_bytes = sent;
        c.all_to_all = std::max(sent * (1 - remote) / intra_bw_, sent * remote / std::max(net_bw_, 1e-30)) +
                       (ep - 1) * (remote > 0 ? cluster_.node.network_latency : cluster_.node.intra_latency);
      }
      // An MoE layer's MLP collectives are the expert-tp all-gather and reduce-scatter of the
      // routed copies (k x the tokens when etp = tp), in place of a dense MLP's over tp.
      expert_tp_collective =
          etp > 1 ? ring_all_reduce(2 * routed * etp * h, etp, intra_bw_, cluster_.node.intra_latency) : 0.0;
    }
    c.weight_gemms = fwd;
    // Attention core: QK^T and AV over the whole sequence; a fused kernel skips the masked half.
    const double attention_flops = 4 * tokens * s_ * q / t * (software_.flash_attention ? 0.5 : 1.0);
    c.attention_core = gemm(attention_flops, head_dim, cluster_.gpu.peak_bf16);
    // Activation bytes (Korthikanti et al. 2022, generalised): replicated across tp unless
    // sequence parallel (norm inputs, QKV and MLP inputs, dropout masks); split across tp (Q, K,
    // V, attention output, MLP intermediates); attention scores, absent with fused attention.
    const double replicated = 8.0 + (model_.dropout ? 2.0 : 0.0);
    const double split = (4.0 + 4.0 * g) * q / h + (1 - x) * (m_swiglu() ? 6.0 : 4.0) * f / h + x * moe_act;
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
    c.mlp_tp_collective = (1 - x) * c.tp_collective + x * expert_tp_collective;
    // Context parallelism: each GPU receives the other cp - 1 chunks of K and V.
    if (cp > 1) {
      const bool crosses = tp * cp > cluster_.node.gpus_per_node;
      const double bytes = (cp - 1) * tokens * 4 * q * g / t;
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
    const double stage = lps * (layer_params_ - expert_layer_params_);
    // Routed experts: split over ep x etp, their state sharded over the expert data-parallel group.
    const double experts = expert_stage_params(l);
    const double de = expert_dp_of(l);
    const bool z1 = l.sharding_mode != sharding::none;
    const bool z2 = l.sharding_mode == sharding::gradients || l.sharding_mode == sharding::full;
    const bool z3 = l.sharding_mode == sharding::full;
    const double layer_share = (layer_params_ - expert_layer_params_) / t + expert_layer_params_ / expert_split_of(l);
    auto state = [&](double params, memory_breakdown& mb) {
      mb.weights = 2 * params / (z3 ? d : 1.0) + 2 * experts / (z3 ? de : 1.0) +
                   (z3 && shard_group > 1 ? 2 * 2 * layer_share : 0.0);
      mb.gradients = (software_.gradient_bytes / (z2 ? d : 1.0) + software_.low_precision_gradient_bytes) * params +
                     (software_.gradient_bytes / (z2 ? de : 1.0) + software_.low_precision_gradient_bytes) * experts;
      mb.optimizer = 12 * params / (z1 ? d : 1.0) + 12 * experts / (z1 ? de : 1.0);
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
      // Balanced end stages: the first and last stages take a layer fewer for the embedding and
      // the output layer; stage 1 then holds a whole share with two fewer warm-up chunks in flight
      // (Megatron-Core's interleaved schedule warms up (p - rank - 1) x 2 + (v - 1) x p chunks).
      const bool ends = balanced_ends(l);
      const double end_layers = ends ? lps - 1 : lps;
      const double per_layer = layer_params_ - expert_layer_params_;
      state((end_layers * per_layer + embedding_) / t, first);
      first.activations = end_layers * in_flight * stored + working;
      if (ends) {
        const double in_flight_1 = l.parallel.virtual_stages > 1
                                       ? l.parallel.pp + static_cast<double>(l.parallel.pp - 3) / l.parallel.virtual_stages
                                       : std::min(l.parallel.pp - 1, m);
        memory_breakdown second;
        state(stage / t, second);
        second.activations = lps * in_flight_1 * stored + working;
        if (second.weights + second.gradients + second.optimizer + second.activations >
            first.weights + first.gradients + first.optimizer + first.activations)
          first = second;
      }
      // The last stage holds the output layer (a tied embedding keeps a copy there) and one
      // micro-batch in flight, plus its logits.
      state((end_layers * per_layer + embedding_) / t, last);
      last.activations = end_layers * stored + working;
      last.logits = c.logits_bytes;
      first.total = first.weights + first.gradients + first.optimizer + first.activations;
      last.total = last.weights + last.gradients + last.optimizer + last.activations + last.logits;
      result = first.total >= last.total ? first : last;
    }
    result.total = result.weights + result.gradients + result.optimizer + result.activations + result.logits;
    result.usable = usable_;
    return result;
  }

  /// Whether `l`'s first and last pipeline stages take one layer fewer than the others: where the
  /// software balances the embedding and the output layer against a layer (Llama 3, section
  /// 3.3.2; Megatron-DeepSpeed's `type:transformer|embedding` partition, BLOOM's) and the layers
  /// leave two places of pp x ceil(l / pp) empty.
  bool balanced_ends(const layout_choice& l) const noexcept {
    const int lps = (model_.layers + l.parallel.pp - 1) / l.parallel.pp;
    return software_.balanced_end_stages && l.parallel.pp > 2 && model_.layers <= l.parallel.pp * lps - 2;
  }

  /// Parameters per GPU on the stage that holds the most, except routed experts (split by tp,
  /// sharded over dp x cp).
  double stage_params(const layout_choice& l) const noexcept {
    const double lps = (model_.layers + l.parallel.pp - 1) / l.parallel.pp;
    const double per_layer = layer_params_ - expert_layer_params_;
    if (l.parallel.pp == 1) return (model_.layers * per_layer + embedding_params(model_)) / l.parallel.tp;
    return (lps * per_layer + embedding_) / l.parallel.tp;
  }

  /// The expert-tensor-parallel degree of `l` (expert_tp 0: tp).
  static int expert_tp_of(const layout_choice& l) noexcept {
    return l.parallel.expert_tp > 0 ? l.parallel.expert_tp : l.parallel.tp;
  }
  /// GPUs one MoE layer's routed experts are split over: ep x etp.
  static double expert_split_of(const layout_choice& l) noexcept {
    return static_cast<double>(l.parallel.ep) * expert_tp_of(l);
  }
  /// The expert data-parallel size: world / (etp x ep x pp) = tp x cp x dp / (etp x ep), the
  /// group that reduces expert gradients and shards their optimizer state (Megatron-Core).
  static double expert_dp_of(const layout_choice& l) noexcept {
    return static_cast<double>(l.parallel.tp) * l.parallel.cp * l.parallel.dp / expert_split_of(l);
  }
  /// Routed-expert parameters per GPU on the busiest stage.
  double expert_stage_params(const layout_choice& l) const noexcept {
    const double lps = (model_.layers + l.parallel.pp - 1) / l.parallel.pp;
    return lps * expert_layer_params_ / expert_split_of(l);
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
    const double experts = expert_stage_params(l);
    const double de = expert_dp_of(l);
    const bool z1 = l.sharding_mode != sharding::none;

    // ---- time ----------------------------------------------------------------------------
    const double fwd = c.forward, bwd = 2 * c.forward;
    double redo = 0;
    if (l.recompute_mode == recompute::full) redo = c.forward;
    if (l.recompute_mode == recompute::selective) redo = c.attention_core;
    const double collectives = 4.0 + (l.recompute_mode == recompute::full ? 2.0 : 0.0);
    // Half of them are the attention's, half the MLP's (an MoE layer's expert-tp ones).
    double tp_layer = collectives / 2 * (c.tp_collective + c.mlp_tp_collective);
    // Overlapped collectives run chunk by chunk behind the GEMMs (forward, backward, recompute);
    // the first chunk of each, 1/tp of it, stays exposed.
    if (software_.overlap_tp && l.parallel.tp > 1)
      tp_layer = std::max(tp_layer - (3 + (redo > 0 ? 1 : 0)) * c.weight_gemms, tp_layer / l.parallel.tp);
    // Each blocking exchange also costs its launch, the wait for the last member and the hand-off
    // (exchange_latency); overlapping the transfer hides none of that.
    const exchange_counts waits = blocking_exchanges(l, m);
    const double handoff = cluster_.node.exchange_latency;
    tp_layer += waits.tp_per_layer * handoff;
    const double tp_edge = waits.tp_per_micro_batch * handoff;  // per micro-batch, outside the layers
    const double cp_layer = std::max(0.0, c.cp_exchange - c.attention_core) +
                            std::max(0.0, 2 * c.cp_exchange - 2 * c.attention_core) +
                            (l.recompute_mode == recompute::full ? std::max(0.0, c.cp_exchange - c.attention_core) : 0.0) +
                            waits.cp_per_layer * handoff;
    // Expert parallelism: dispatch and combine in the forward pass and their transposes in the
    // backward pass, 4 all-to-alls per MoE layer (6 when full recomputation reruns the forward),
    // on the critical path: the experts wait for their tokens.
    const double ep_layer =
        moe_fraction(model_) * (4.0 + (l.recompute_mode == recompute::full ? 2.0 : 0.0)) * c.all_to_all;
    // The busiest stage is the last: it has the output layer. With balanced end stages it has a
    // layer fewer, and a middle stage is the busiest where a layer takes longer than the output layer.
    double logits = 3 * c.logits_forward;
    double busy_layers = lps;
    if (balanced_ends(l)) {
      if (fwd + bwd + redo + tp_layer + cp_layer + ep_layer >= logits) logits = 0;
      else busy_layers = lps - 1;
    }
    const double mb_compute = busy_layers * (fwd + bwd + redo) + logits;
    const double mb_time = mb_compute + busy_layers * (tp_layer + cp_layer + ep_layer) + tp_edge;
    time_breakdown& tb = p.time;
    tb.compute = m * mb_compute;
    tb.recompute = m * busy_layers * redo;
    tb.tp_comm = m * (busy_layers * tp_layer + tp_edge);
    tb.cp_comm = m * busy_layers * cp_layer;
    tb.ep_comm = m * busy_layers * ep_layer;
    if (l.parallel.pp > 1) {
      tb.bubble = static_cast<double>(l.parallel.pp - 1) / l.parallel.virtual_stages * mb_time;
      const bool crosses = l.parallel.tp * l.parallel.cp * l.parallel.dp >= cluster_.node.gpus_per_node;
      const double send = c.p2p_bytes / (crosses ? net_bw_ : intra_bw_) +
                          (crosses ? cluster_.node.network_latency : cluster_.node.intra_latency) + handoff;
      tb.pp_comm = waits.pp_per_step * send;
      // Where ranks share cores (compute measured with every rank busy), a stage idle in the
      // bubble lends its core to the busy ones: the step is the longer of the ranks' work at the
      // shared speed and the schedule's critical path at a whole core's speed.
      const double k = cluster_.node.ranks_per_core;
      if (k > 1) tb.bubble = std::max(0.0, (tb.compute + tb.bubble) / k - tb.compute);
    }

    // Data parallelism: the dp x cp group spans `per_node` GPUs in each of `nodes_spanned` nodes;
    // reduce inside the node over NVLink, across nodes over each GPU's own port.
    // Routed experts' gradients go over the expert data-parallel group instead (etp x ep apart
    // on the expert grid), after the others.
    if (shard_group > 1 || de > 1) {
      auto group_all_reduce = [&](double bytes, int n, int apart) {
        const int per_node = std::max(1, std::min(n, cluster_.node.gpus_per_node / std::max(1, apart)));
        const int nodes_spanned = (n + per_node - 1) / per_node;
        return ring_all_reduce(bytes, per_node, dp_intra_bw_, cluster_.node.intra_latency) +
               ring_all_reduce(bytes / per_node, nodes_spanned, net_bw_, cluster_.node.network_latency);
      };
      const int expert_group = static_cast<int>(std::lround(de));
      const int expert_apart = static_cast<int>(std::lround(expert_split_of(l)));
      // `bytes` per dense parameter; the experts' share follows from the same bytes per parameter.
      auto all_reduce = [&](double bytes) {
        const double per_param = bytes / max_params;
        return group_all_reduce(bytes, shard_group, l.parallel.tp) +
               (experts > 0 ? group_all_reduce(per_param * experts, expert_group, expert_apart) : 0.0);
      };
      const double grads = software_.gradient_bytes * max_params, weights = 2 * max_params;
      const double back_window = lps * (bwd + redo) * (1 - 1 / lps);
      const double fwd_window = lps * fwd * (1 - 1 / lps);
      // Where ranks share cores no core is free to progress a reduction behind compute.
      const bool overlaps = software_.overlap_dp && cluster_.node.ranks_per_core <= 1;
      auto exposed = [&](double comm, double window) {
        return overlaps ? std::max(comm - window, comm / lps) : comm;
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
    tb.optimizer = 32 * (max_params / (z1 ? d : 1.0) + experts / (z1 ? de : 1.0)) / cluster_.gpu.memory_bandwidth;
    tb.step = tb.compute + tb.tp_comm + tb.cp_comm + tb.ep_comm + tb.pp_comm + tb.bubble + tb.dp_comm + tb.optimizer;

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
  double h_ = 0, s_ = 0, a_ = 0, f_ = 0, g_ = 1, v_ = 0, q_ = 0;
  int global_batch_ = 0;
  double gemm_peak_ = 0, peak_fraction_ = 0, layer_params_ = 0, expert_layer_params_ = 0, embedding_ = 0;
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
  if (!is_moe(model) && (d.ep != 1 || (d.expert_tp != 0 && d.expert_tp != d.tp)))
    return "the model has no experts, so ep must be 1 and expert-tp the tp (give --moe-experts for a mixture of experts)";
  if (weft::layout::dim_order::parse(d.order) != weft::layout::dim_order())
    return "the cost model assumes the order " + std::string(weft::layout::default_order) + ", not '" + d.order + "'";
  if (d.tp > cluster.node.gpus_per_node)
    return "tp = " + str(d.tp) + " is larger than a node (" + str(cluster.node.gpus_per_node) +
           " GPUs): tensor parallelism needs NVLink";
  // With uneven stages allowed, the layer count is not checked against pp x vp (0: unknown).
  const weft::layout::model_shape shape{.heads = model.heads, .kv_heads = kv_heads_of(model),
                                        .layers = allow_uneven_stages ? 0 : model.layers, .experts = model.experts,
                                        .seq_length = model.seq};
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
  const int etp = d.expert_tp > 0 ? d.expert_tp : d.tp;
  if (etp > cluster.node.gpus_per_node)
    return "expert-tp = " + str(etp) + " is larger than a node (" + str(cluster.node.gpus_per_node) +
           " GPUs): tensor parallelism needs NVLink";
  if (d.ep > 1 && d.tp > 1 && !l.sequence_parallel)
    return "ep = " + str(d.ep) + " with tp = " + str(d.tp) +
           " needs sequence parallelism (Megatron-Core's rule for expert and tensor parallelism together)";
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
  return ev.evaluate(l, ev.costs(l.parallel.tp, l.parallel.cp, l.sequence_parallel, l.micro_batch, l.parallel.ep,
                                 l.parallel.expert_tp));
}

}  // namespace weft::tune
