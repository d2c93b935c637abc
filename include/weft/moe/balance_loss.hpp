#pragma once
/// \file
/// The load-balancing loss and the router z-loss, per sequence and per MoE layer:
///
///   aux = E · Σ_e f_e · P_e     f_e: the share of the sequence's T·K top-k assignments that go
///                                    to expert e, counted before any capacity drop
///                               P_e: the mean of p_e over the sequence's tokens
///   z   = mean_t (logsumexp(logits_t))²
///
/// Both are over the whole sequence, whichever ranks hold its tokens: each rank sums its own
/// tokens (sequence_sums), the sums are added over the ranks that share the sequences (an
/// all-reduce over the cp / sp groups, done by moe_layer), and finish_losses turns them into
/// the same aux and z on every such rank. f_e is a count, so it carries no gradient; the
/// gradients flow through P_e (into p) and through the logsumexp (into the logits).
///
/// Tokens are row-major [sequences, tokens per sequence]: a rank's T tokens hold `sequences`
/// equal runs, sequence s being rows s·T/S .. (s+1)·T/S - 1.

#include <cstddef>
#include <span>
#include <vector>

#include <weft/moe/router.hpp>

namespace weft::moe {

/// Values per sequence in the sums: E assignment counts, E sums of p, the sum of lse², tokens.
constexpr std::size_t sums_per_sequence(std::size_t experts) noexcept { return 2 * experts + 2; }

/// This rank's sums for each of its `sequences` sequences ([S, 2E + 2], double).
inline std::vector<double> sequence_sums(const routing& r, std::size_t sequences) {
  const std::size_t E = r.experts, K = r.top_k, width = sums_per_sequence(E);
  std::vector<double> sums(sequences * width, 0.0);
  const std::size_t per = sequences > 0 ? r.tokens / sequences : 0;
  for (std::size_t t = 0; t < r.tokens; ++t) {
    double* s = &sums[(t / per) * width];
    for (std::size_t j = 0; j < K; ++j) s[r.expert[t * K + j]] += 1;
    for (std::size_t e = 0; e < E; ++e) s[E + e] += r.probs[t * E + e];
    s[2 * E] += static_cast<double>(r.lse[t]) * r.lse[t];
    s[2 * E + 1] += 1;
  }
  return sums;
}

/// The losses of each sequence, from its sums over every rank that holds its tokens.
struct balance_losses {
  std::size_t experts = 0, top_k = 0;
  std::vector<double> aux;       ///< [S]
  std::vector<double> z;         ///< [S]
  std::vector<double> share;     ///< [S, E]: f_e
  std::vector<double> tokens;    ///< [S]: the sequence's tokens over all its ranks
};

inline balance_losses finish_losses(std::span<const double> sums, std::size_t experts, std::size_t top_k) {
  const std::size_t E = experts, width = sums_per_sequence(E), S = sums.size() / width;
  balance_losses out{E, top_k, std::vector<double>(S), std::vector<double>(S), std::vector<double>(S * E),
                     std::vector<double>(S)};
  for (std::size_t s = 0; s < S; ++s) {
    const double* v = &sums[s * width];
    const double T = v[2 * E + 1];
    out.tokens[s] = T;
    if (T == 0) continue;
    double aux = 0;
    for (std::size_t e = 0; e < E; ++e) {
      out.share[s * E + e] = v[e] / (T * static_cast<double>(top_k));
      aux += out.share[s * E + e] * (v[E + e] / T);
    }
    out.aux[s] = static_cast<double>(E) * aux;
    out.z[s] = v[2 * E] / T;
  }
  return out;
}

/// The gradients of d_aux · Σ_s aux_s + d_z · Σ_s z_s with respect to this rank's p (added to
/// d_probs [T, E]) and logits (added to d_logits [T, E]):
///   daux_s/dp[t][e]      = E · f_e / T_s
///   dz_s/dlogits[t][e]   = 2 · lse_t / T_s · p[t][e]
inline void balance_backward(const routing& r, const balance_losses& losses, double d_aux, double d_z,
                             std::span<float> d_probs, std::span<float> d_logits) {
  const std::size_t E = r.experts, S = losses.aux.size();
  if (r.tokens == 0 || S == 0) return;
  const std::size_t per = r.tokens / S;
  for (std::size_t t = 0; t < r.tokens; ++t) {
    const std::size_t s = t / per;
    const double T = losses.tokens[s];
    const double z_scale = d_z * 2.0 * r.lse[t] / T;
    for (std::size_t e = 0; e < E; ++e) {
      d_probs[t * E + e] += static_cast<float>(d_aux * static_cast<double>(E) * losses.share[s * E + e] / T);
      d_logits[t * E + e] += static_cast<float>(z_scale * r.probs[t * E + e]);
    }
  }
}

}  // namespace weft::moe
