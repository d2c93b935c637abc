#pragma once
/// \file
/// The sizes of a mixture-of-experts MLP and the checks that name them: what every other part of
/// weft/moe takes, so that bad sizes are refused once, with one message, before any work.

#include <cmath>
#include <cstddef>
#include <string>

#include <weft/core/error.hpp>

namespace weft::moe {

/// A mixture-of-experts MLP: E experts, each GPT-2's MLP (c_fc [hidden, ffn] + bias, tanh GELU,
/// c_proj [ffn, hidden] + bias), of which each token uses its top K.
struct moe_shape {
  std::size_t hidden = 0;   ///< C: the width of a token row (the MLP's input and output)
  std::size_t ffn = 0;      ///< the experts' inner width (GPT-2: 4C)
  std::size_t experts = 0;  ///< E, over the whole ep group
  std::size_t top_k = 1;    ///< K: experts per token, 1 <= K <= E
};

/// How tokens reach their experts.
struct moe_options {
  /// 0 (the default): dropless, every assignment reaches its expert. f > 0: each rank keeps, per
  /// expert, at most capacity(f, T, K, E) = ceil(f · T · K / E) of its T tokens' assignments,
  /// the first in token order (then top-k slot order); a dropped assignment contributes 0 to y
  /// (the token passes through the residual).
  double capacity_factor = 0;
};

/// Assignments per expert a rank keeps in capacity mode (see moe_options::capacity_factor).
inline std::size_t capacity(double factor, std::size_t tokens, std::size_t top_k, std::size_t experts) {
  return static_cast<std::size_t>(
      std::ceil(factor * static_cast<double>(tokens) * static_cast<double>(top_k) / static_cast<double>(experts)));
}

/// Refuses sizes no MoE layer can run with, naming them: no experts, K outside 1..E, E not a
/// multiple of the ep group's size, a negative or non-finite capacity factor. `group` names the
/// ep group in the message.
inline void validate(const moe_shape& shape, std::size_t ep_size, const moe_options& options = {},
                     const std::string& group = "ep") {
  const std::string where = "weft::moe (group '" + group + "' of " + std::to_string(ep_size) + " ranks): ";
  if (shape.hidden == 0 || shape.ffn == 0)
    fail(where + "hidden (" + std::to_string(shape.hidden) + ") and ffn (" + std::to_string(shape.ffn) +
         ") must be positive");
  if (shape.experts == 0) fail(where + "there are no experts (E = 0); give E >= 1");
  if (shape.top_k == 0 || shape.top_k > shape.experts)
    fail(where + "top-k " + std::to_string(shape.top_k) + " is not between 1 and the " +
         std::to_string(shape.experts) + " experts; choose K <= E");
  if (ep_size == 0 || shape.experts % ep_size != 0)
    fail(where + std::to_string(shape.experts) + " experts do not divide over the " + std::to_string(ep_size) +
         " ranks of the ep group; choose E a multiple of ep");
  if (!(options.capacity_factor >= 0) || !std::isfinite(options.capacity_factor))
    fail(where + "capacity factor " + std::to_string(options.capacity_factor) +
         " is not a finite number >= 0 (0: dropless)");
}

}  // namespace weft::moe
