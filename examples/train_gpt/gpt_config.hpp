#pragma once
// The model's shape (GPT-2's configuration names) and the checks that a shape fits a layout.

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <weft/layout/layout.hpp>
#include <weft/layout/model_shape.hpp>
#include <weft/tune/layout.hpp>

namespace train_gpt {

/// GPT-2's hyperparameters, named as in its config (n_layer, n_head, n_embd, n_positions,
/// vocab_size); `seq` is the training sequence length (at most n_positions).
struct gpt_config {
  int layers = 4;       // n_layer
  int hidden = 128;     // n_embd
  int heads = 4;        // n_head
  int vocab = 256;      // vocab_size (byte-level tokens by default)
  int positions = 256;  // n_positions
  int seq = 128;
  /// The vocabulary is padded to a multiple of this x tp (Megatron's --make-vocab-size-divisible-by).
  int vocab_divisible_by = 128;
  /// Mixture of experts (Mixtral's config names num_local_experts, num_experts_per_tok): blocks i
  /// with i % moe_every == 0 have E experts, each token using its top K, in place of the MLP.
  int moe_experts = 0;  // 0: dense
  int moe_top_k = 2;
  int moe_every = 1;

  bool moe_layer(int layer) const noexcept { return moe_experts > 0 && layer % moe_every == 0; }
  int head_dim() const noexcept { return hidden / heads; }
  /// Parameters of the whole model (the output layer is tied to the token embedding).
  std::int64_t parameter_count() const noexcept {
    const std::int64_t c = hidden;
    const std::int64_t per_layer = 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * c + (c * 4 * c + 4 * c) + (4 * c * c + c);
    const std::int64_t mlp = (c * 4 * c + 4 * c) + (4 * c * c + c);
    std::int64_t moe = 0;  // each MoE block: the router and E MLPs in place of one
    for (int i = 0; i < layers; ++i)
      if (moe_layer(i)) moe += static_cast<std::int64_t>(moe_experts) * c + (moe_experts - 1) * mlp;
    return static_cast<std::int64_t>(vocab) * c + static_cast<std::int64_t>(positions) * c + layers * per_layer + 2 * c +
           moe;
  }
};

/// Shapes by name: GPT-2's published sizes and a few small ones for tests and this machine.
inline std::optional<gpt_config> named_model(std::string_view name) {
  if (name == "gpt2" || name == "gpt2-small") return gpt_config{12, 768, 12, 50257, 1024, 1024};
  if (name == "gpt2-medium") return gpt_config{24, 1024, 16, 50257, 1024, 1024};
  if (name == "gpt2-large") return gpt_config{36, 1280, 20, 50257, 1024, 1024};
  if (name == "gpt2-xl") return gpt_config{48, 1600, 25, 50257, 1024, 1024};
  if (name == "tiny") return gpt_config{4, 64, 4, 256, 128, 64};
  if (name == "small") return gpt_config{4, 128, 4, 256, 256, 128};
  return std::nullopt;
}
inline constexpr std::string_view model_names = "gpt2 (= gpt2-small), gpt2-medium, gpt2-large, gpt2-xl, tiny, small";

/// What the layout asks of the model's shape; empty when it fits. Each line says what to change.
/// The divisibility rules every layout imposes (heads over tp, layers over pp x virtual stages,
/// the sequence over 2 x cp) are weft's (layout/model_shape.hpp); GPT-2's own are added here.
inline std::vector<std::string> shape_problems(const gpt_config& m, const weft::tune::layout_choice& layout) {
  std::vector<std::string> p;
  auto s = [](auto v) { return std::to_string(v); };
  if (m.layers < 1 || m.hidden < 1 || m.heads < 1 || m.vocab < 2 || m.positions < 1 || m.seq < 1) {
    p.push_back("every size must be positive (layers " + s(m.layers) + ", hidden " + s(m.hidden) + ", heads " +
                s(m.heads) + ", vocab " + s(m.vocab) + ", positions " + s(m.positions) + ", seq " + s(m.seq) + ")");
    return p;
  }
  if (m.hidden % m.heads != 0)
    p.push_back("--hidden " + s(m.hidden) + " is not divisible by --heads " + s(m.heads) +
                ": the hidden size must split evenly into heads");
  if (m.seq > m.positions)
    p.push_back("--seq " + s(m.seq) + " is longer than the model's " + s(m.positions) +
                " positions (n_positions): shorten --seq or raise --positions");
  const weft::layout::layout_spec& d = layout.parallel;
  weft::layout::layout_spec spec = d;
  if (spec.world_size == 0) spec.world_size = d.tp * d.cp * d.pp * std::max(d.dp, 1);
  for (std::string& problem : weft::layout::validate(spec)) p.push_back(std::move(problem));
  if (!p.empty()) return p;
  for (std::string& problem : weft::layout::check_model_shape(
           weft::layout::rank_layout(spec),
           {.heads = m.heads, .layers = m.layers, .virtual_stages = d.virtual_stages, .seq_length = m.seq}))
    p.push_back(std::move(problem));
  if (layout.sequence_parallel && d.tp > 1) {
    const long tokens = static_cast<long>(layout.micro_batch) * (m.seq / d.cp);
    if (tokens % d.tp != 0)
      p.push_back("sequence parallelism splits the " + s(tokens) + " tokens of a micro-batch (micro-batch x seq / cp) " +
                  "over --tp " + s(d.tp) + ", which does not divide them: change --micro-batch or --seq");
  }
  return p;
}

}  // namespace train_gpt
