#pragma once
/// \file
/// Checks that a model's shape can be split the way a layout asks.

#include <weft/core/error.hpp>
#include <weft/layout/layout.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace weft::layout {

/// The parts of a transformer's shape a layout splits. A field left at 0 is not checked.
struct model_shape {
  int heads = 0;           ///< attention heads, split over tp
  int kv_heads = 0;        ///< key/value heads (query groups) under grouped-query attention, split over tp
  int layers = 0;          ///< transformer layers, split over pp x virtual_stages
  /// Model chunks per pipeline stage (interleaved schedules); 1 takes the layout's
  /// (`layout_spec::virtual_stages`), anything else must equal it when that is above 1.
  int virtual_stages = 1;
  int experts = 0;         ///< experts per MoE layer, split over ep
  std::int64_t seq_length = 0;  ///< tokens per sample, split into 2 x cp chunks for load balance
};

// The divisibility rules a layout imposes on a model: the one copy, used by check_model_shape
// below and by the tuner's search (which cannot afford to build messages in its inner loop).
// A size of 0 is unknown and passes.

/// tp splits the attention heads and the key/value heads evenly.
constexpr bool tp_splits_heads(int heads, int kv_heads, int tp) noexcept {
  return tp >= 1 && (heads <= 0 || heads % tp == 0) && (kv_heads <= 0 || kv_heads % tp == 0);
}
/// pp stages of `virtual_stages` chunks each split the layers evenly.
constexpr bool pp_splits_layers(int layers, int pp, int virtual_stages) noexcept {
  return pp >= 1 && virtual_stages >= 1 && (layers <= 0 || layers % (pp * virtual_stages) == 0);
}
/// Context parallelism gives each rank two chunks of the sequence (balancing causal attention), so
/// the sequence splits into 2 x cp equal chunks.
constexpr bool cp_splits_sequence(std::int64_t seq_length, int cp) noexcept {
  return cp == 1 || (cp > 1 && (seq_length <= 0 || seq_length % (2 * static_cast<std::int64_t>(cp)) == 0));
}

/// ep splits the experts of each MoE layer evenly (every rank of the ep group holds experts / ep).
constexpr bool ep_splits_experts(int experts, int ep) noexcept { return ep >= 1 && (experts <= 0 || experts % ep == 0); }

/// Every way in which `shape` cannot be split by `layout`, each a sentence saying what to change;
/// empty when it fits.
inline std::vector<std::string> check_model_shape(const rank_layout& layout, const model_shape& shape) {
  std::vector<std::string> problems;
  auto options = [](std::int64_t n) { return detail::brace_list(detail::divisors(n)); };
  if (shape.heads < 0 || shape.kv_heads < 0 || shape.layers < 0 || shape.experts < 0 || shape.seq_length < 0) {
    problems.push_back("model sizes must not be negative (0 means unknown)");
    return problems;
  }
  if (shape.virtual_stages < 1) {
    problems.push_back("virtual stages " + std::to_string(shape.virtual_stages) + " is invalid: use 1 for no interleaving, or more");
    return problems;
  }
  if (shape.virtual_stages > 1 && layout.virtual_stages() > 1 && shape.virtual_stages != layout.virtual_stages()) {
    problems.push_back("the model is split into " + std::to_string(shape.virtual_stages) + " virtual stages but the layout has " +
                       std::to_string(layout.virtual_stages()) + ": give the same number in both, or 1 in the model shape");
    return problems;
  }
  const int virtual_stages = shape.virtual_stages > 1 ? shape.virtual_stages : layout.virtual_stages();
  const int tp = layout.tp();
  if (!tp_splits_heads(shape.heads, 0, tp)) {
    problems.push_back(std::to_string(shape.heads) + " attention heads do not divide over tp=" + std::to_string(tp) +
                       ": choose tp in " + options(shape.heads));
  }
  if (!tp_splits_heads(0, shape.kv_heads, tp)) {
    problems.push_back(std::to_string(shape.kv_heads) + " key/value heads do not divide over tp=" + std::to_string(tp) +
                       ": choose tp in " + options(shape.kv_heads));
  }
  if (shape.heads > 0 && shape.kv_heads > 0 && shape.heads % shape.kv_heads != 0) {
    problems.push_back(std::to_string(shape.heads) + " attention heads are not a multiple of " + std::to_string(shape.kv_heads) +
                       " key/value heads: check the model shape");
  }
  if (virtual_stages > 1 && layout.pp() == 1) {
    problems.push_back("virtual stages " + std::to_string(virtual_stages) +
                       " need pipeline parallelism, but pp=1: set pp > 1 or use 1 virtual stage");
  }
  const std::int64_t chunks = static_cast<std::int64_t>(layout.pp()) * virtual_stages;
  if (!pp_splits_layers(shape.layers, layout.pp(), virtual_stages)) {
    problems.push_back(std::to_string(shape.layers) + " layers do not divide over pp=" + std::to_string(layout.pp()) +
                       " x virtual stages=" + std::to_string(virtual_stages) + " = " + std::to_string(chunks) +
                       " model chunks: choose pp x virtual stages in " + options(shape.layers));
  }
  if (!ep_splits_experts(shape.experts, layout.ep())) {
    problems.push_back(std::to_string(shape.experts) + " experts do not divide over ep=" + std::to_string(layout.ep()) +
                       ": choose ep in " + options(shape.experts));
  }
  if (!cp_splits_sequence(shape.seq_length, layout.cp())) {
    problems.push_back("sequence length " + std::to_string(shape.seq_length) + " does not split into 2 x cp=" +
                       std::to_string(2 * layout.cp()) + " equal chunks (context parallelism gives each rank two chunks to "
                       "balance causal attention): pad the sequence to a multiple of " + std::to_string(2 * layout.cp()));
  }
  return problems;
}

/// Throws `weft::error` listing every problem `check_model_shape` finds.
inline void require_model_shape(const rank_layout& layout, const model_shape& shape) {
  std::vector<std::string> problems = check_model_shape(layout, shape);
  if (problems.empty()) return;
  std::string message = "the model does not fit the layout: " + problems.front();
  for (std::size_t i = 1; i < problems.size(); ++i) message += "; also, " + problems[i];
  fail(message);
}

}  // namespace weft::layout
