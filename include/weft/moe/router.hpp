#pragma once
/// \file
/// The router of a mixture-of-experts MLP: a linear layer without bias, an fp32 softmax and top-k.
///
///   logits[t] = h[t] · W_rᵀ            (W_r: [E, C], h: [T, C], fp32)
///   p[t]      = softmax(logits[t])     over the E experts
///   top-k     = the K largest p[t][e]; ties go to the lower expert index; slot 0 is the largest
///   w[t][j]   = p[t][top_j] / Σ_j' p[t][top_j']
///
/// route() computes all of this; route_backward() turns the gradient of the loss with respect to
/// w (and to p, where the load-balancing loss adds to it, and to the logits, where the z-loss
/// does) into the gradients of h and W_r.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <weft/moe/gemm.hpp>
#include <weft/moe/shape.hpp>

namespace weft::moe {

/// The router's result for T tokens (row-major).
struct routing {
  std::size_t tokens = 0, experts = 0, top_k = 0;
  std::vector<float> logits;         ///< [T, E]
  std::vector<float> probs;          ///< [T, E]: p, the softmax of each row
  std::vector<float> lse;            ///< [T]: logsumexp of each row of logits
  std::vector<std::int32_t> expert;  ///< [T, K]: the chosen experts, slot 0 the most probable
  std::vector<float> weight;         ///< [T, K]: w, the chosen p normalised to sum 1
};

/// Routes the tokens h [T, C] with the router weight [E, C].
template <gemm_kernel G>
void route(const G& gemm, std::span<const float> h, std::span<const float> router_weight, const moe_shape& shape,
           routing& out) {
  const std::size_t C = shape.hidden, E = shape.experts, K = shape.top_k, T = h.size() / C;
  out.tokens = T, out.experts = E, out.top_k = K;
  out.logits.assign(T * E, 0.0f);
  out.probs.resize(T * E);
  out.lse.resize(T);
  out.expert.resize(T * K);
  out.weight.resize(T * K);
  if (T > 0) gemm.gemm(false, true, T, E, C, 1.0f, h.data(), C, router_weight.data(), C, 0.0f, out.logits.data(), E);
  for (std::size_t t = 0; t < T; ++t) {
    const float* x = &out.logits[t * E];
    float* p = &out.probs[t * E];
    const float top = *std::max_element(x, x + E);
    float sum = 0;
    for (std::size_t e = 0; e < E; ++e) sum += (p[e] = std::exp(x[e] - top));
    for (std::size_t e = 0; e < E; ++e) p[e] /= sum;
    out.lse[t] = top + std::log(sum);
    // K passes of an argmax over the experts not yet taken: strict '>' keeps the lower index on ties.
    std::int32_t* chosen = &out.expert[t * K];
    float total = 0;
    for (std::size_t j = 0; j < K; ++j) {
      std::int32_t best = -1;
      for (std::size_t e = 0; e < E; ++e) {
        if (std::find(chosen, chosen + j, static_cast<std::int32_t>(e)) != chosen + j) continue;
        if (best < 0 || p[e] > p[best]) best = static_cast<std::int32_t>(e);
      }
      chosen[j] = best;
      total += p[best];
    }
    for (std::size_t j = 0; j < K; ++j) out.weight[t * K + j] = p[chosen[j]] / total;
  }
}

/// The gradients of the router, given for every token
///  - `d_weight` [T, K]: dL/dw for each chosen slot,
///  - `d_probs` [T, E]: a gradient on p from elsewhere (the load-balancing loss; may be empty),
///  - `d_logits_extra` [T, E]: a gradient on the logits from elsewhere (the z-loss; may be empty).
/// dh [T, C] receives dL/dh added (+=); d_router_weight [E, C] accumulates dL/dW_r (+=).
template <gemm_kernel G>
void route_backward(const G& gemm, const routing& r, std::span<const float> h, std::span<const float> router_weight,
                    std::span<const float> d_weight, std::span<const float> d_probs,
                    std::span<const float> d_logits_extra, std::span<float> dh, std::span<float> d_router_weight) {
  const std::size_t T = r.tokens, E = r.experts, K = r.top_k, C = T > 0 ? h.size() / T : 0;
  if (T == 0) return;
  std::vector<float> dp(T * E, 0.0f), dlogits(T * E);
  if (!d_probs.empty()) std::copy(d_probs.begin(), d_probs.end(), dp.begin());
  for (std::size_t t = 0; t < T; ++t) {
    const float* p = &r.probs[t * E];
    const std::int32_t* chosen = &r.expert[t * K];
    // w_j = p_j / S over the chosen slots: dL/dp_j = (g_j - Σ_i g_i w_i) / S.
    float total = 0, mean = 0;
    for (std::size_t j = 0; j < K; ++j) total += p[chosen[j]];
    for (std::size_t j = 0; j < K; ++j) mean += d_weight[t * K + j] * r.weight[t * K + j];
    for (std::size_t j = 0; j < K; ++j) dp[t * E + chosen[j]] += (d_weight[t * K + j] - mean) / total;
    // Softmax: dlogit_e = p_e (dp_e - Σ_e' p_e' dp_e').
    float dot = 0;
    for (std::size_t e = 0; e < E; ++e) dot += p[e] * dp[t * E + e];
    for (std::size_t e = 0; e < E; ++e) {
      dlogits[t * E + e] = p[e] * (dp[t * E + e] - dot);
      if (!d_logits_extra.empty()) dlogits[t * E + e] += d_logits_extra[t * E + e];
    }
  }
  gemm.gemm(false, false, T, C, E, 1.0f, dlogits.data(), E, router_weight.data(), C, 1.0f, dh.data(), C);
  gemm.gemm(true, false, E, C, T, 1.0f, dlogits.data(), E, h.data(), C, 1.0f, d_router_weight.data(), C);
}

}  // namespace weft::moe
