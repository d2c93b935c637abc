#pragma once
/// \file
/// A decoder-only transformer as the tuner sees it: its shape, its parameter count and the FLOPs
/// one token costs. Everything here is a pure function of the description.

#include <optional>
#include <string_view>

namespace weft::tune {

/// The shape of a decoder-only transformer. Zero means "the usual default" where one exists:
/// `kv_heads` = `heads` (no grouped-query attention), `ffn` = 4 x `hidden`, `params` = derived.
struct model_desc {
  int layers = 0;
  int hidden = 0;
  int heads = 0;
  int kv_heads = 0;          ///< key/value heads (GQA); 0: same as `heads`
  int ffn = 0;               ///< MLP inner size; 0: 4 x hidden
  bool swiglu = false;       ///< gated MLP (three weight matrices instead of two)
  int vocab = 0;
  int seq = 0;               ///< training sequence length
  double params = 0;         ///< total parameter count if known; 0: derived from the shape
  bool tied_embeddings = false;  ///< output layer shares the input embedding's weights
  bool dropout = false;      ///< dropout after attention and MLP (GPT-3-era recipes); costs activation memory
  int head_dim = 0;          ///< width of one attention head; 0: hidden / heads (Qwen3 sets it wider)
  // Mixture of experts (Megatron-Core's MoE layer): an MoE layer's MLP is `experts` MLPs of width
  // `expert_ffn`, of which each token runs `top_k` chosen by a router (a linear layer of hidden x
  // experts), plus `shared_experts` that every token runs. experts = 0: a dense model.
  int experts = 0;           ///< routed experts per MoE layer (--moe-experts); 0: dense
  int top_k = 0;             ///< experts each token is routed to (--moe-top-k); 0: 2, Megatron's default
  int moe_every = 1;         ///< layers i with i % moe_every == 0 are MoE (--moe-every; Megatron's --moe-layer-freq)
  int expert_ffn = 0;        ///< MLP inner size of one expert (fine-grained experts); 0: ffn
  int shared_experts = 0;    ///< always-active experts of width expert_ffn, split like a dense MLP
};

/// Key/value heads after applying the default.
constexpr int kv_heads_of(const model_desc& m) noexcept { return m.kv_heads > 0 ? m.kv_heads : m.heads; }
/// MLP inner size after applying the default.
constexpr int ffn_of(const model_desc& m) noexcept { return m.ffn > 0 ? m.ffn : 4 * m.hidden; }
/// Width of the queries (heads x head size): the hidden size unless head_dim says otherwise.
constexpr int attention_width_of(const model_desc& m) noexcept {
  return m.head_dim > 0 ? m.heads * m.head_dim : m.hidden;
}
/// Whether the model has mixture-of-experts layers.
constexpr bool is_moe(const model_desc& m) noexcept { return m.experts > 0; }
/// Experts per token after applying the default.
constexpr int top_k_of(const model_desc& m) noexcept { return m.top_k > 0 ? m.top_k : 2; }
/// MLP inner size of one expert after applying the default.
constexpr int expert_ffn_of(const model_desc& m) noexcept { return m.expert_ffn > 0 ? m.expert_ffn : (m.ffn > 0 ? m.ffn : 4 * m.hidden); }
/// Number of MoE layers: i in [0, layers) with i % moe_every == 0.
constexpr int moe_layer_count(const model_desc& m) noexcept {
  return is_moe(m) && m.moe_every > 0 ? (m.layers + m.moe_every - 1) / m.moe_every : 0;
}
/// Share of the layers that are MoE layers (the cost model charges every layer the average).
constexpr double moe_fraction(const model_desc& m) noexcept {
  return m.layers > 0 ? static_cast<double>(moe_layer_count(m)) / m.layers : 0.0;
}

/// Fraction of key/value width relative to the query width (1 without GQA).
constexpr double kv_ratio(const model_desc& m) noexcept {
  return m.heads > 0 ? static_cast<double>(kv_heads_of(m)) / m.heads : 1.0;
}

/// Weight matrices of one MLP of inner size `f` (two, or three when gated).
constexpr double mlp_params(const model_desc& m, double f) noexcept { return (m.swiglu ? 3.0 : 2.0) * m.hidden * f; }

/// Routed-expert weights per layer, averaged over the layers (MoE layers hold experts x one
/// expert's MLP; dense layers none). These are what expert parallelism splits.
constexpr double expert_params_per_layer(const model_desc& m) noexcept {
  return moe_fraction(m) * m.experts * mlp_params(m, expert_ffn_of(m));
}

/// Weights of one transformer layer, averaged over the layers: Q, K, V and output projections,
/// the MLP (an MoE layer's router, routed and shared experts), two norms.
constexpr double layer_params_from_shape(const model_desc& m) noexcept {
  const double h = m.hidden, q = attention_width_of(m), g = kv_ratio(m);
  const double attention = h * q * (1.0 + 2.0 * g) + q * h;
  const double dense_mlp = mlp_params(m, ffn_of(m));
  const double moe_mlp = m.experts * h + (m.experts + m.shared_experts) * mlp_params(m, expert_ffn_of(m));
  const double x = moe_fraction(m);
  return attention + (1 - x) * dense_mlp + x * moe_mlp + 4.0 * h;
}

/// Input embedding plus, unless tied, the output layer.
constexpr double embedding_params(const model_desc& m) noexcept {
  return static_cast<double>(m.vocab) * m.hidden * (m.tied_embeddings ? 1.0 : 2.0);
}

/// Total parameter count: `params` if given, otherwise derived from the shape.
constexpr double param_count(const model_desc& m) noexcept {
  if (m.params > 0) return m.params;
  return m.layers * layer_params_from_shape(m) + embedding_params(m);
}

/// Weights of one layer such that layers x layer + embeddings equals `param_count` (a given count
/// that differs from the shape, e.g. biases or padding, is spread over the layers).
constexpr double layer_params(const model_desc& m) noexcept {
  if (m.params <= 0 || m.layers <= 0) return layer_params_from_shape(m);
  const double rest = m.params - embedding_params(m);
  return rest > 0 ? rest / m.layers : layer_params_from_shape(m);
}

/// Forward FLOPs per token of one layer's weight matrices (2 FLOPs per multiply-add), averaged
/// over the layers. An MoE layer counts what a token runs: the router, its top-k experts and the
/// shared experts, not the experts it skips.
constexpr double layer_matmul_flops_per_token(const model_desc& m) noexcept {
  const double h = m.hidden, q = attention_width_of(m), g = kv_ratio(m);
  const double x = moe_fraction(m);
  const double moe_mlp = m.experts * h + (top_k_of(m) + m.shared_experts) * mlp_params(m, expert_ffn_of(m));
  return 2.0 * (h * q * (1.0 + 2.0 * g) + q * h + (1 - x) * mlp_params(m, ffn_of(m)) + x * moe_mlp);
}

/// Forward FLOPs per token of one layer's attention scores and weighted sum (QK^T and AV),
/// counted over the full sequence as Korthikanti et al. do (no halving for the causal mask).
constexpr double layer_attention_flops_per_token(const model_desc& m) noexcept {
  return 4.0 * static_cast<double>(m.seq) * attention_width_of(m);
}

/// Forward FLOPs per token of the output (logits) layer.
constexpr double logits_flops_per_token(const model_desc& m) noexcept {
  return 2.0 * static_cast<double>(m.hidden) * m.vocab;
}

/// Model FLOPs per token: forward plus backward (3 x forward) of every layer and the logits,
/// without recomputation. For a GPT shape this is 72 l h^2 (1 + s/6h + V/12lh) / s per token,
/// the count of Korthikanti et al. (2022) and of the MFU the tuner reports.
constexpr double model_flops_per_token(const model_desc& m) noexcept {
  return 3.0 * (m.layers * (layer_matmul_flops_per_token(m) + layer_attention_flops_per_token(m)) +
                logits_flops_per_token(m));
}

/// The shape of some well-known models (public configurations). Names: `gpt3-175b`,
/// `llama2-7b`, `llama3-8b`, `llama3-70b`, `llama3-405b`, and the mixtures of experts
/// `mixtral-8x7b`, `mixtral-8x22b` (Mistral AI's configurations), `qwen3-30b-a3b`,
/// `qwen3-235b-a22b` (Qwen's).
inline std::optional<model_desc> model_preset(std::string_view name) {
  if (name == "gpt3-175b")
    return model_desc{.layers = 96, .hidden = 12288, .heads = 96, .vocab = 51200, .seq = 2048, .tied_embeddings = true};
  if (name == "llama2-7b")
    return model_desc{.layers = 32, .hidden = 4096, .heads = 32, .ffn = 11008, .swiglu = true, .vocab = 32000, .seq = 4096};
  if (name == "llama3-8b")
    return model_desc{.layers = 32, .hidden = 4096, .heads = 32, .kv_heads = 8, .ffn = 14336, .swiglu = true,
                      .vocab = 128256, .seq = 8192};
  if (name == "llama3-70b")
    return model_desc{.layers = 80, .hidden = 8192, .heads = 64, .kv_heads = 8, .ffn = 28672, .swiglu = true,
                      .vocab = 128256, .seq = 8192};
  if (name == "llama3-405b")
    return model_desc{.layers = 126, .hidden = 16384, .heads = 128, .kv_heads = 8, .ffn = 53248, .swiglu = true,
                      .vocab = 128256, .seq = 8192};
  if (name == "mixtral-8x7b")
    return model_desc{.layers = 32, .hidden = 4096, .heads = 32, .kv_heads = 8, .ffn = 14336, .swiglu = true,
                      .vocab = 32000, .seq = 4096, .experts = 8, .top_k = 2};
  if (name == "mixtral-8x22b")
    return model_desc{.layers = 56, .hidden = 6144, .heads = 48, .kv_heads = 8, .ffn = 16384, .swiglu = true,
                      .vocab = 32768, .seq = 4096, .experts = 8, .top_k = 2};
  if (name == "qwen3-30b-a3b")
    return model_desc{.layers = 48, .hidden = 2048, .heads = 32, .kv_heads = 4, .ffn = 6144, .swiglu = true,
                      .vocab = 151936, .seq = 4096, .head_dim = 128, .experts = 128, .top_k = 8, .expert_ffn = 768};
  if (name == "qwen3-235b-a22b")
    return model_desc{.layers = 94, .hidden = 4096, .heads = 64, .kv_heads = 4, .ffn = 12288, .swiglu = true,
                      .vocab = 151936, .seq = 4096, .head_dim = 128, .experts = 128, .top_k = 8, .expert_ffn = 1536};
  return std::nullopt;
}

/// The names `model_preset` accepts, for help texts and error messages.
constexpr std::string_view model_preset_names =
    "gpt3-175b, llama2-7b, llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, mixtral-8x22b, qwen3-30b-a3b, qwen3-235b-a22b";

}  // namespace weft::tune
