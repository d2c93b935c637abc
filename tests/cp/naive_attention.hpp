#pragma once
// Attention over a whole sequence on one rank, written independently of weft::cp: the scores of
// each query row, one softmax over the full row (no blocks, no online merge, no LSE), and the
// gradients through the softmax Jacobian (dS = P ∘ (dP − rowsum(P ∘ dP)), not the dout·out form
// the CP kernel uses). Everything in double. Layout [seq, heads, head_dim]; token i has position i.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <vector>

namespace cp_test {

struct full_attention {
  std::vector<double> out, lse, dq, dk, dv;
};

inline full_attention naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                                      const std::vector<double>& v, const std::vector<double>& dout, std::size_t seq,
                                      std::size_t heads, std::size_t dim, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  full_attention r;
  r.out.assign(seq * heads * dim, 0);
  r.lse.assign(seq * heads, 0);
  r.dq.assign(q.size(), 0);
  r.dk.assign(k.size(), 0);
  r.dv.assign(v.size(), 0);
  auto at = [&](std::size_t t, std::size_t h) { return (t * heads + h) * dim; };
  std::vector<double> p(seq), dp(seq);
  for (std::size_t h = 0; h < heads; ++h) {
    for (std::size_t i = 0; i < seq; ++i) {
      const std::size_t visible = causal ? i + 1 : seq;
      double sum = 0;
      for (std::size_t j = 0; j < visible; ++j) {
        double s = 0;
        for (std::size_t d = 0; d < dim; ++d) s += q[at(i, h) + d] * k[at(j, h) + d];
        p[j] = std::exp(s * scale);  // small inputs: no overflow, no max needed
        sum += p[j];
      }
      for (std::size_t j = 0; j < visible; ++j) p[j] /= sum;
      r.lse[i * heads + h] = std::log(sum);
      for (std::size_t j = 0; j < visible; ++j)
        for (std::size_t d = 0; d < dim; ++d) r.out[at(i, h) + d] += p[j] * v[at(j, h) + d];
      // Backward of this row.
      double row = 0;
      for (std::size_t j = 0; j < visible; ++j) {
        dp[j] = 0;
        for (std::size_t d = 0; d < dim; ++d) dp[j] += dout[at(i, h) + d] * v[at(j, h) + d];
        row += p[j] * dp[j];
      }
      for (std::size_t j = 0; j < visible; ++j) {
        const double ds = p[j] * (dp[j] - row);
        for (std::size_t d = 0; d < dim; ++d) {
          r.dv[at(j, h) + d] += p[j] * dout[at(i, h) + d];
          r.dq[at(i, h) + d] += scale * ds * k[at(j, h) + d];
          r.dk[at(j, h) + d] += scale * ds * q[at(i, h) + d];
        }
      }
    }
  }
  return r;
}

inline std::vector<double> random_tensor(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> x(n);
  for (double& e : x) e = dist(gen);
  return x;
}

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::abs(e));
  return m;
}

// The largest |got − want| relative to the largest |want| of the tensor.
template <class T>
double relative_error(const std::vector<T>& got, const std::vector<double>& want) {
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
  const double scale = max_abs(want);
  return scale == 0 ? worst : worst / scale;
}

}  // namespace cp_test
