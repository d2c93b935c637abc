// What the MoE tests share: deterministic weights and tokens, and a mixture-of-experts MLP written
// out here in double, independently of weft::moe (its own softmax, top-k, GELU, capacity rule and
// losses, from the semantics in docs/moe.md), as the reference the library must match.
#pragma once

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/moe/layer.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <span>
#include <vector>

namespace moe_test {

using comm_t = weft::communicator<weft::mpi_backend>;

inline std::vector<float> values(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 engine(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(engine);
  return v;
}

// Every expert's weights and the router's, the same on every rank.
struct model {
  std::size_t C, F, E, K;
  std::vector<float> router;                             // [E, C]
  std::vector<std::vector<float>> fc_w, fc_b, pj_w, pj_b;  // per expert

  model(std::size_t c, std::size_t f, std::size_t e, std::size_t k, unsigned seed) : C(c), F(f), E(e), K(k) {
    router = values(E * C, seed, 1.0f);
    for (std::size_t x = 0; x < E; ++x) {
      fc_w.push_back(values(C * F, seed + 100 + static_cast<unsigned>(x), 0.5f));
      fc_b.push_back(values(F, seed + 200 + static_cast<unsigned>(x), 0.1f));
      pj_w.push_back(values(F * C, seed + 300 + static_cast<unsigned>(x), 0.5f));
      pj_b.push_back(values(C, seed + 400 + static_cast<unsigned>(x), 0.1f));
    }
  }
  weft::moe::moe_shape shape() const { return {.hidden = C, .ffn = F, .experts = E, .top_k = K}; }
  // Experts first .. first + count - 1 as the layer takes them.
  weft::moe::moe_tensors<const float> tensors(std::size_t first, std::size_t count) const {
    weft::moe::moe_tensors<const float> t{router, {}};
    for (std::size_t e = first; e < first + count; ++e) t.experts.push_back({fc_w[e], fc_b[e], pj_w[e], pj_b[e]});
    return t;
  }
};

// Gradient storage shaped like a model's tensors for experts first .. first + count - 1, zeroed.
struct gradients {
  std::vector<float> router;
  std::vector<std::vector<float>> fc_w, fc_b, pj_w, pj_b;
  gradients(const model& m, std::size_t count) : router(m.E * m.C, 0.0f) {
    for (std::size_t e = 0; e < count; ++e) {
      fc_w.emplace_back(m.C * m.F, 0.0f), fc_b.emplace_back(m.F, 0.0f);
      pj_w.emplace_back(m.F * m.C, 0.0f), pj_b.emplace_back(m.C, 0.0f);
    }
  }
  weft::moe::moe_tensors<float> tensors() {
    weft::moe::moe_tensors<float> t{router, {}};
    for (std::size_t e = 0; e < fc_w.size(); ++e) t.experts.push_back({fc_w[e], fc_b[e], pj_w[e], pj_b[e]});
    return t;
  }
};

struct naive_result {
  std::vector<double> y;       // [T, C]
  std::vector<double> aux, z;  // [S]
  std::size_t dropped = 0;
};

// The MoE MLP on one rank's tokens h [T, C] (S sequences), in double. capacity_factor 0: dropless.
inline naive_result naive_forward(const std::vector<float>& h, std::size_t S, const model& m,
                                  double capacity_factor = 0) {
  const std::size_t C = m.C, F = m.F, E = m.E, K = m.K, T = h.size() / C;
  naive_result out{std::vector<double>(T * C, 0.0), std::vector<double>(S, 0.0), std::vector<double>(S, 0.0), 0};
  std::vector<std::size_t> taken(E, 0);
  const std::size_t cap = capacity_factor > 0 ? static_cast<std::size_t>(std::ceil(capacity_factor * static_cast<double>(T * K) / static_cast<double>(E))) : T * K;
  std::vector<double> counts(S * E, 0.0), psum(S * E, 0.0), lse2(S, 0.0);
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<double> logit(E), p(E);
    for (std::size_t e = 0; e < E; ++e) {
      double s = 0;
      for (std::size_t c = 0; c < C; ++c) s += static_cast<double>(h[t * C + c]) * m.router[e * C + c];
      logit[e] = s;
    }
    const double top = *std::max_element(logit.begin(), logit.end());
    double sum = 0;
    for (std::size_t e = 0; e < E; ++e) sum += std::exp(logit[e] - top);
    const double lse = top + std::log(sum);
    for (std::size_t e = 0; e < E; ++e) p[e] = std::exp(logit[e] - lse);
    // Top-k by sorting indices on (p descending, index ascending).
    std::vector<std::size_t> order(E);
    for (std::size_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return p[a] > p[b]; });
    double chosen = 0;
    for (std::size_t j = 0; j < K; ++j) chosen += p[order[j]];
    const std::size_t s = t / (T / S);
    for (std::size_t e = 0; e < E; ++e) psum[s * E + e] += p[e];
    lse2[s] += lse * lse;
    for (std::size_t j = 0; j < K; ++j) {
      const std::size_t e = order[j];
      counts[s * E + e] += 1;  // before any drop
      if (taken[e]++ >= cap) {
        ++out.dropped;
        continue;
      }
      const double w = p[e] / chosen;
      std::vector<double> a(F);
      for (std::size_t f = 0; f < F; ++f) {
        double u = m.fc_b[e][f];
        for (std::size_t c = 0; c < C; ++c) u += static_cast<double>(h[t * C + c]) * m.fc_w[e][c * F + f];
        a[f] = 0.5 * u * (1 + std::tanh(std::sqrt(2 / M_PI) * (u + 0.044715 * u * u * u)));
      }
      for (std::size_t c = 0; c < C; ++c) {
        double v = m.pj_b[e][c];
        for (std::size_t f = 0; f < F; ++f) v += a[f] * m.pj_w[e][f * C + c];
        out.y[t * C + c] += w * v;
      }
    }
  }
  const double L = static_cast<double>(T / std::max<std::size_t>(S, 1));
  for (std::size_t s = 0; s < S; ++s) {
    for (std::size_t e = 0; e < E; ++e) out.aux[s] += (counts[s * E + e] / (L * static_cast<double>(K))) * (psum[s * E + e] / L);
    out.aux[s] *= static_cast<double>(E);
    out.z[s] = lse2[s] / L;
  }
  return out;
}

// |a - b| <= tol * max(1, |b|) for every element.
template <class A, class B>
bool close(const A& a, const B& b, double tol) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])) <=
          tol * std::max(1.0, std::fabs(static_cast<double>(b[i])))))
      return false;
  return true;
}

// A group of this rank alone (the layer with every expert on one rank).
inline comm_t self_group() { return comm_t(weft::mpi_backend::comm::self(), "self"); }

}  // namespace moe_test
