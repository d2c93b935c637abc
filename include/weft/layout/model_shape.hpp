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
  int virtual_stages = 1;  ///< model chunks per pipeline stage (interleaved schedules)
  int experts = 0;         ///< experts per MoE layer, split over ep
  std::int64_t seq_length = 0;  ///< tokens per sample, split into 2 x cp chunks for load balance
};

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
  const int tp = layout.tp();
  if (shape.heads > 0 && shape.heads % tp != 0) {
    problems.push_back(std::to_string(shape.heads) + " attention heads do not divide over tp=" + std::to_string(tp) +
                       ": choose tp in " + options(shape.heads));
  }
  if (shape.kv_heads > 0 && shape.kv_heads % tp != 0) {
    problems.push_back(std::to_string(shape.kv_heads) + " key/value heads do not divide over tp=" + std::to_string(tp) +
                       ": choose tp in " + options(shape.kv_heads));
  }
  if (shape.heads > 0 && shape.kv_heads > 0 && shape.heads % shape.kv_heads != 0) {
    problems.push_back(std::to_string(shape.heads) + " attention heads are not a multiple of " + std::to_string(shape.kv_heads) +
                       " key/value heads: check the model shape");
  }
  if (shape.virtual_stages > 1 && layout.pp() == 1) {
    problems.push_back("virtual stages " + std::to_string(shape.virtual_stages) +
                       " need pipeline parallelism, but pp=1: set pp > 1 or use 1 virtual stage");
  }
  const std::int64_t chunks = static_cast<std::int64_t>(layout.pp()) * shape.virtual_stages;
  if (shape.layers > 0 && shape.layers % chunks != 0) {
    problems.push_back(std::to_string(shape.layers) + " layers do not divide over pp=" + std::to_string(layout.pp()) +
                       " x virtual stages=" + std::to_string(shape.virtual_stages) + " = " + std::to_string(chunks) +
                       " model chunks: choose pp x virtual stages in " + options(shape.layers));
  }
  if (shape.experts > 0 && shape.experts % layout.ep() != 0) {
    problems.push_back(std::to_string(shape.experts) + " experts do not divide over ep=" + std::to_string(layout.ep()) +
                       ": choose ep in " + options(shape.experts));
  }
  if (shape.seq_length > 0 && layout.cp() > 1 && shape.seq_length % (2 * layout.cp()) != 0) {
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
