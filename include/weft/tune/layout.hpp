#pragma once
/// \file
/// The choices the tuner makes (a layout) and the facts it is given about the job and the
/// training software.

#include <optional>
#include <string_view>

#include <weft/layout/layout.hpp>

namespace weft::tune {

/// Activation recomputation (Korthikanti et al. 2022): keep every activation, recompute only the
/// attention core (softmax and its inputs), or keep only each layer's input and rerun its forward.
enum class recompute { none, selective, full };

/// How data-parallel ranks shard the training state (ZeRO stages 0 to 3): nothing, the optimizer
/// state (ZeRO-1, Megatron's distributed optimizer), optimizer and gradients (ZeRO-2), or
/// everything including the weights (ZeRO-3, FSDP).
enum class sharding { none, optimizer, gradients, full };

/// Arithmetic precision of the weight matrices' GEMMs.
enum class precision { bf16, fp8 };

constexpr std::string_view to_string(recompute r) noexcept {
  switch (r) {
    case recompute::none: return "none";
    case recompute::selective: return "selective";
    case recompute::full: return "full";
  }
  return "?";
}

constexpr std::string_view to_string(sharding s) noexcept {
  switch (s) {
    case sharding::none: return "none";
    case sharding::optimizer: return "optimizer";
    case sharding::gradients: return "gradients";
    case sharding::full: return "full";
  }
  return "?";
}

constexpr std::string_view to_string(precision p) noexcept { return p == precision::fp8 ? "fp8" : "bf16"; }

constexpr std::optional<recompute> parse_recompute(std::string_view text) noexcept {
  if (text == "none") return recompute::none;
  if (text == "selective") return recompute::selective;
  if (text == "full") return recompute::full;
  return std::nullopt;
}

/// Accepts the names of `to_string(sharding)` and `zero0`..`zero3`, `fsdp`.
constexpr std::optional<sharding> parse_sharding(std::string_view text) noexcept {
  if (text == "none" || text == "zero0") return sharding::none;
  if (text == "optimizer" || text == "zero1") return sharding::optimizer;
  if (text == "gradients" || text == "zero2") return sharding::gradients;
  if (text == "full" || text == "zero3" || text == "fsdp") return sharding::full;
  return std::nullopt;
}

/// One layout as the tuner chooses it: the parallel degrees in weft::layout's vocabulary (the
/// spec `weft::process_groups` is built from: world size, tp, cp, pp, dp, virtual stages, and for
/// a mixture of experts ep and expert_tp, Megatron-Core's expert grid), and how each model replica
/// trains. The cost
/// model assumes the default order, tp-cp-ep-dp-pp (Megatron-Core's): a tp group stays inside a
/// node and a pp group is the first to leave it.
struct layout_choice {
  weft::layout::layout_spec parallel{};  ///< world_size 0: the cluster's GPUs; dp 0: derived from it
  int micro_batch = 1;                   ///< sequences per micro-batch
  recompute recompute_mode = recompute::none;
  sharding sharding_mode = sharding::none;
  bool sequence_parallel = false;        ///< norms and dropout split over the tp group (needs tp > 1)
};

/// GPUs a layout uses: tp x cp x pp x dp.
constexpr int gpus_of(const layout_choice& l) noexcept {
  return l.parallel.tp * l.parallel.cp * l.parallel.pp * l.parallel.dp;
}

/// What the training software can do; the tuner only proposes what it supports. The defaults
/// describe a current Megatron-Core-like stack.
struct software_desc {
  bool flash_attention = true;      ///< fused attention: no s x s score matrix in memory, causal half skipped
  bool sequence_parallel = true;    ///< tensor-parallel runs may use sequence parallelism
  bool interleaved_schedule = true; ///< virtual pipeline stages (interleaved 1F1B) are available
  bool context_parallel = true;     ///< the sequence may be split across GPUs (cp > 1)
  bool overlap_dp = true;           ///< gradient reduction and weight all-gather overlap compute
  bool overlap_tp = false;          ///< tensor-parallel collectives are split and overlapped with the GEMMs
  sharding max_sharding = sharding::full;  ///< deepest ZeRO stage available
  /// ZeRO-2 and ZeRO-3 combine with pipeline parallelism (torchtitan shards each stage). False
  /// where a fully sharded model runs each micro-batch's units forward and backward in order
  /// before the next micro-batch (weft::fsdp::sharded_model), which pipeline schedules interleave.
  bool sharding_with_pipeline = true;
  /// Selective recomputation (only the attention core; Korthikanti et al. 2022) is available.
  /// Software older than that paper checkpoints whole layers or nothing.
  bool selective_recompute = true;
  /// Routed experts may be split over fewer tensor-parallel ranks than the dense layers
  /// (expert-tp 1 with tp > 1: Megatron-Core's parallel folding). False where every tp rank runs
  /// each expert as the dense MLP is run (expert-tp = tp).
  bool expert_tp_folding = true;
  /// Bytes per element of the gradient buffers and of their data-parallel reduction: 4 for fp32
  /// accumulation (bf16 training, Megatron-Core, FSDP with fp32 reduce), 2 for fp16 training that
  /// keeps and reduces gradients in fp16 (Megatron-LM 2021, GPT-NeoX).
  int gradient_bytes = 4;
  /// Bytes per parameter of the low-precision gradients the backward pass writes, where the
  /// software keeps them beside the accumulation buffer for the whole step: 2 for DeepSpeed's bf16
  /// optimizer (BLOOM's stack), which adds each micro-batch's bf16 gradients into separate fp32
  /// copies; 0 where the backward pass accumulates straight into the buffer (Megatron's
  /// gradient-accumulation fusion) or frees each gradient once it is added. Never sharded: the
  /// software that keeps them shards the optimizer state only.
  int low_precision_gradient_bytes = 0;
  /// Where the layers do not fill pp x ceil(layers / pp), the first and last pipeline stages take a
  /// layer fewer, for the embedding and the output layer and loss (Llama 3's pipeline, "The Llama 3
  /// Herd of Models", section 3.3.2; Megatron-DeepSpeed's `type:transformer|embedding` partition).
  /// Otherwise every stage but the last may be short and the last has a whole share.
  bool balanced_end_stages = false;
};

/// The job: how much data per step, how much in total, at what price.
struct job_desc {
  int global_batch = 0;            ///< sequences per optimizer step (see also global_batch_tokens)
  double global_batch_tokens = 0;  ///< alternative to global_batch: tokens per step (rounded to sequences)
  double tokens = 0;               ///< tokens to train on (0: no days / cost)
  double price_per_gpu_hour = 0;   ///< currency per GPU-hour (0: no cost)
  precision gemm_precision = precision::bf16;
};

}  // namespace weft::tune
