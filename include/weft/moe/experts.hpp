#pragma once
/// \file
/// The experts: each GPT-2's MLP, run as grouped GEMMs (a loop of products, one per expert and
/// block of rows). Weights are in GPT-2's Conv1D layouts: c_fc.weight [C, F], c_fc.bias [F],
/// c_proj.weight [F, C], c_proj.bias [C]; y = gelu(x · W_fc + b_fc) · W_proj + b_proj, with
/// GPT-2's tanh GELU.

#include <cstddef>
#include <span>
#include <vector>

#include <weft/moe/detail/gelu.hpp>
#include <weft/moe/gemm.hpp>

namespace weft::moe {

/// One expert's four tensors: `float` for gradients, `const float` for weights.
template <class F>
struct expert_tensors {
  std::span<F> fc_weight;    ///< [C, ffn]
  std::span<F> fc_bias;      ///< [ffn]
  std::span<F> proj_weight;  ///< [ffn, C]
  std::span<F> proj_bias;    ///< [C]
};

/// What one block of rows through one expert keeps for its backward: the pre-activation and the
/// activation ([rows, ffn] each).
struct expert_activations {
  std::vector<float> pre, post;
};

/// out [n, C] = the expert applied to x [n, C] (n may be 0); keeps what backward needs in `saved`.
template <gemm_kernel G>
void expert_forward(const G& gemm, const expert_tensors<const float>& w, std::size_t hidden, std::size_t ffn,
                    const float* x, std::size_t n, float* out, expert_activations& saved) {
  saved.pre.resize(n * ffn);
  saved.post.resize(n * ffn);
  if (n == 0) return;
  for (std::size_t i = 0; i < n; ++i) std::copy(w.fc_bias.begin(), w.fc_bias.end(), saved.pre.begin() + i * ffn);
  gemm.gemm(false, false, n, ffn, hidden, 1.0f, x, hidden, w.fc_weight.data(), ffn, 1.0f, saved.pre.data(), ffn);
  for (std::size_t i = 0; i < n * ffn; ++i) saved.post[i] = detail::gelu(saved.pre[i]);
  for (std::size_t i = 0; i < n; ++i) std::copy(w.proj_bias.begin(), w.proj_bias.end(), out + i * hidden);
  gemm.gemm(false, false, n, hidden, ffn, 1.0f, saved.post.data(), ffn, w.proj_weight.data(), hidden, 1.0f, out,
            hidden);
}

/// dx [n, C] = dL/dx (overwritten) from dout [n, C]; the expert's gradients accumulate (+=) in `g`.
template <gemm_kernel G>
void expert_backward(const G& gemm, const expert_tensors<const float>& w, std::size_t hidden, std::size_t ffn,
                     const float* x, std::size_t n, const expert_activations& saved, const float* dout, float* dx,
                     const expert_tensors<float>& g) {
  if (n == 0) return;
  gemm.gemm(true, false, ffn, hidden, n, 1.0f, saved.post.data(), ffn, dout, hidden, 1.0f, g.proj_weight.data(),
            hidden);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t c = 0; c < hidden; ++c) g.proj_bias[c] += dout[i * hidden + c];
  std::vector<float> d_pre(n * ffn);
  gemm.gemm(false, true, n, ffn, hidden, 1.0f, dout, hidden, w.proj_weight.data(), hidden, 0.0f, d_pre.data(), ffn);
  for (std::size_t i = 0; i < n * ffn; ++i) d_pre[i] *= detail::gelu_derivative(saved.pre[i]);
  gemm.gemm(true, false, hidden, ffn, n, 1.0f, x, hidden, d_pre.data(), ffn, 1.0f, g.fc_weight.data(), ffn);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t f = 0; f < ffn; ++f) g.fc_bias[f] += d_pre[i * ffn + f];
  gemm.gemm(false, true, n, hidden, ffn, 1.0f, d_pre.data(), ffn, w.fc_weight.data(), ffn, 0.0f, dx, hidden);
}

}  // namespace weft::moe
