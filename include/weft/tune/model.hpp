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
};

/// Key/value heads after applying the default.
constexpr int kv_heads_of(const model_desc& m) noexcept { return m.kv_heads > 0 ? m.kv_heads : m.heads; }
/// MLP inner size after applying the default.
constexpr int ffn_of(const model_desc& m) noexcept { return m.ffn > 0 ? m.ffn : 4 * m.hidden; }
/// Fraction of key/value width relative to the query width (1 without GQA).
constexpr double kv_ratio(const model_desc& m) noexcept {
  return m.heads > 0 ? static_cast<double>(kv_heads_of(m)) / m.heads : 1.0;
}

/// Weights of one transformer layer: Q, K, V and output projections, the MLP, two norms.
constexpr double layer_params_from_shape(const model_desc& m) noexcept {
  const double h = m.hidden, f = ffn_of(m), g = kv_ratio(m);
  const double attention = h * h * (1.0 + 2.0 * g) + h * h;
  const double mlp = (m.swiglu ? 3.0 : 2.0) * h * f;
  return attention + mlp + 4.0 * h;
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

/// Forward FLOPs per token of one layer's weight matrices (2 FLOPs per multiply-add).
constexpr double layer_matmul_flops_per_token(const model_desc& m) noexcept {
  const double h = m.hidden, f = ffn_of(m), g = kv_ratio(m);
  return 2.0 * (h * h * (1.0 + 2.0 * g) + h * h + (m.swiglu ? 3.0 : 2.0) * h * f);
}

/// Forward FLOPs per token of one layer's attention scores and weighted sum (QK^T and AV),
/// counted over the full sequence as Korthikanti et al. do (no halving for the causal mask).
constexpr double layer_attention_flops_per_token(const model_desc& m) noexcept {
  return 4.0 * static_cast<double>(m.seq) * m.hidden;
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
/// `llama2-7b`, `llama3-8b`, `llama3-70b`, `llama3-405b`.
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
  return std::nullopt;
}

/// The names `model_preset` accepts, for help texts and error messages.
constexpr std::string_view model_preset_names = "gpt3-175b, llama2-7b, llama3-8b, llama3-70b, llama3-405b";

}  // namespace weft::tune
