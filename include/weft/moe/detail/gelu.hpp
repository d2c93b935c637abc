#pragma once
/// \file
/// GPT-2's tanh GELU and its derivative, as the experts use them.

#include <cmath>

namespace weft::moe::detail {

inline constexpr float gelu_scale = 0.7978845608028654f;  // sqrt(2 / pi)
inline float gelu(float x) { return 0.5f * x * (1.0f + std::tanh(gelu_scale * (x + 0.044715f * x * x * x))); }
inline float gelu_derivative(float x) {
  const float th = std::tanh(gelu_scale * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * gelu_scale * (1.0f + 3.0f * 0.044715f * x * x);
}

}  // namespace weft::moe::detail
