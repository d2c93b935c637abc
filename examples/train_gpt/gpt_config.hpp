#pragma once
// The model's shape (GPT-2's configuration names) and the checks that a shape fits a layout.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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

  int head_dim() const noexcept { return hidden / heads; }
  /// Parameters of the whole model (the output layer is tied to the token embedding).
  std::int64_t parameter_count() const noexcept {
    const std::int64_t c = hidden;
    const std::int64_t per_layer = 2 * c + (c * 3 * c + 3 * c) + (c * c + c) + 2 * c + (c * 4 * c + 4 * c) + (4 * c * c + c);
    return static_cast<std::int64_t>(vocab) * c + static_cast<std::int64_t>(positions) * c + layers * per_layer + 2 * c;
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
struct layout_degrees {
  int tp = 1, pp = 1, dp = 1, cp = 1, vp = 1;
  bool sequence_parallel = false;
  int micro_batch = 1;
};

inline std::vector<std::string> shape_problems(const gpt_config& m, const layout_degrees& d) {
  std::vector<std::string> p;
  auto s = [](auto v) { return std::to_string(v); };
  if (m.layers < 1 || m.hidden < 1 || m.heads < 1 || m.vocab < 2 || m.positions < 1 || m.seq < 1)
    p.push_back("every size must be positive (layers " + s(m.layers) + ", hidden " + s(m.hidden) + ", heads " +
                s(m.heads) + ", vocab " + s(m.vocab) + ", positions " + s(m.positions) + ", seq " + s(m.seq) + ")");
  if (m.heads > 0 && m.hidden % m.heads != 0)
    p.push_back("--hidden " + s(m.hidden) + " is not divisible by --heads " + s(m.heads) +
                ": the hidden size must split evenly into heads");
  if (m.seq > m.positions)
    p.push_back("--seq " + s(m.seq) + " is longer than the model's " + s(m.positions) +
                " positions (n_positions): shorten --seq or raise --positions");
  if (d.tp > 0 && m.heads % d.tp != 0)
    p.push_back("--heads " + s(m.heads) + " is not divisible by --tp " + s(d.tp) +
                ": tensor parallelism splits whole heads; pick a tp that divides the heads");
  if (d.pp * d.vp > 0 && m.layers % (d.pp * d.vp) != 0)
    p.push_back("--layers " + s(m.layers) + " do not split over --pp " + s(d.pp) + " x --vp " + s(d.vp) +
                " virtual stages: pick a layer count divisible by pp x vp");
  if (d.cp > 1 && m.seq % (2 * d.cp) != 0)
    p.push_back("--seq " + s(m.seq) + " does not split over --cp " + s(d.cp) + ": context parallelism cuts each " +
                "sequence into 2 x cp chunks; pick seq divisible by " + s(2 * d.cp));
  if (d.sequence_parallel && d.tp > 1) {
    const long tokens = static_cast<long>(d.micro_batch) * (m.seq / d.cp);
    if (tokens % d.tp != 0)
      p.push_back("sequence parallelism splits the " + s(tokens) + " tokens of a micro-batch (micro-batch x seq / cp) " +
                  "over --tp " + s(d.tp) + ", which does not divide them: change --micro-batch or --seq");
  }
  return p;
}

}  // namespace train_gpt
