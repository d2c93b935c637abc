#pragma once
// The model's arithmetic on the CPU: every operation GPT-2's forward and backward need, on float32
// host arrays, with the matrix products through CBLAS (OpenBLAS). The model (model.hpp) calls
// only these members, so a device implementation with the same members can replace this one.
//
// Conventions: activations are row-major [tokens, features]; a linear layer's weight is stored
// (in, out) as GPT-2's Conv1D stores it, so y = x W + b. Each backward comes in two parts, the
// input gradient (`*_backward_input`) and the parameter gradients (`*_backward_weight` /
// `*_params`), so that a schedule may run them at different times (ZB-H1). Parameter gradients
// are *added* (accumulation over micro-batches); input gradients are *overwritten* unless the
// function says otherwise.

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <weft/cp/attention_reference.hpp>

namespace train_gpt {

namespace detail {

/// e^x in float, within 1 ulp of the exact value for |x| <= 87 (Cephes' polynomial; measured
/// every 1e-4 over that range); |x| is clamped to 87 (e^-87 = 1.6e-38). Written so that the
/// compiler vectorises the loops that call it: libm's expf and tanhf are scalar calls, and GELU
/// alone took a fifth of a training step with them. No floating-point comparison (GCC does not
/// if-convert one that may trap, so a loop holding one stays scalar): the clamp is an integer
/// minimum on the magnitude's bits, and the rounding to a power of two adds and subtracts
/// 1.5 * 2^23 instead of calling floor.
inline float fast_exp(float x) {
  constexpr float log2e = 1.44269504088896341f, round_magic = 12582912.0f;
  const std::int32_t bits = std::bit_cast<std::int32_t>(x);
  const std::int32_t magnitude = std::min(bits & 0x7fffffff, std::bit_cast<std::int32_t>(87.0f));
  x = std::bit_cast<float>((bits & std::bit_cast<std::int32_t>(-0.0f)) | magnitude);
  const float t = x * log2e + round_magic;  // round(x log2 e) in the low bits of t
  const float n = t - round_magic;
  float r = x - n * 0.693359375f;  // x - n ln 2, with ln 2 in two parts
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const std::int32_t exponent = std::bit_cast<std::int32_t>(t) - std::bit_cast<std::int32_t>(round_magic) + 127;
  return p * std::bit_cast<float>(exponent << 23);
}

/// The logistic function 1 / (1 + e^-x), with fast_exp.
inline float fast_sigmoid(float x) { return 1.0f / (1.0f + fast_exp(-x)); }

}  // namespace detail

struct cpu_kernels {
  // ---- linear layers ---------------------------------------------------------------------

  /// y[T,out] = x[T,in] W[in,out] (+ b); `bias` may be empty.
  static void linear_forward(const float* x, const float* w, std::span<const float> bias, float* y, std::size_t tokens,
                             std::size_t in, std::size_t out) {
    if (!bias.empty()) {
      for (std::size_t t = 0; t < tokens; ++t) std::copy(bias.begin(), bias.end(), y + t * out);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(tokens), static_cast<int>(out),
                static_cast<int>(in), 1.0f, x, static_cast<int>(in), w, static_cast<int>(out), bias.empty() ? 0.0f : 1.0f,
                y, static_cast<int>(out));
  }

  /// The input gradient: dx = dy W^T (overwrites).
  static void linear_backward_input(const float* w, const float* dy, float* dx, std::size_t tokens, std::size_t in,
                                    std::size_t out) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tokens), static_cast<int>(in),
                static_cast<int>(out), 1.0f, dy, static_cast<int>(out), w, static_cast<int>(out), 0.0f, dx,
                static_cast<int>(in));
  }
  /// The parameter gradients: dW += x^T dy, db += column sums of dy (`dbias` may be empty).
  static void linear_backward_weight(const float* x, const float* dy, float* dw, std::span<float> dbias,
                                     std::size_t tokens, std::size_t in, std::size_t out) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(in), static_cast<int>(out),
                static_cast<int>(tokens), 1.0f, x, static_cast<int>(in), dy, static_cast<int>(out), 1.0f, dw,
                static_cast<int>(out));
    if (!dbias.empty()) column_sums(dy, dbias, tokens);
  }
  /// db += column sums of dy[T, db.size()].
  static void column_sums(const float* dy, std::span<float> db, std::size_t tokens) {
    const std::size_t out = db.size();
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t j = 0; j < out; ++j) db[j] += dy[t * out + j];
  }

  // ---- layer norm --------------------------------------------------------------------------

  /// y = (x - mean) * rstd * w + b per row; keeps mean and rstd ([T]) for backward.
  static void layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                                std::size_t tokens, std::size_t c, float eps = 1e-5f) {
    for (std::size_t t = 0; t < tokens; ++t) {
      const float* xt = x + t * c;
      float m = 0;
      for (std::size_t i = 0; i < c; ++i) m += xt[i];
      m /= static_cast<float>(c);
      float v = 0;
      for (std::size_t i = 0; i < c; ++i) v += (xt[i] - m) * (xt[i] - m);
      v /= static_cast<float>(c);
      const float s = 1.0f / std::sqrt(v + eps);
      float* yt = y + t * c;
      for (std::size_t i = 0; i < c; ++i) yt[i] = (xt[i] - m) * s * w[i] + b[i];
      mean[t] = m;
      rstd[t] = s;
    }
  }

  /// The input gradient, added: dx += ... (layer norms sit on the residual stream).
  static void layernorm_backward_input(const float* x, const float* w, const float* mean, const float* rstd,
                                       const float* dy, float* dx, std::size_t tokens, std::size_t c) {
    for (std::size_t t = 0; t < tokens; ++t) {
      const float* xt = x + t * c;
      const float* dyt = dy + t * c;
      float* dxt = dx + t * c;
      const float m = mean[t], s = rstd[t];
      float mean_dn = 0, mean_dn_xhat = 0;
      for (std::size_t i = 0; i < c; ++i) {
        const float xhat = (xt[i] - m) * s;
        const float dn = w[i] * dyt[i];
        mean_dn += dn;
        mean_dn_xhat += dn * xhat;
      }
      mean_dn /= static_cast<float>(c);
      mean_dn_xhat /= static_cast<float>(c);
      for (std::size_t i = 0; i < c; ++i) {
        const float xhat = (xt[i] - m) * s;
        dxt[i] += (w[i] * dyt[i] - mean_dn - xhat * mean_dn_xhat) * s;
      }
    }
  }
  /// The parameter gradients: dw += x̂ dy, db += dy, summed over the rows.
  static void layernorm_backward_params(const float* x, const float* mean, const float* rstd, const float* dy,
                                        float* dw, float* db, std::size_t tokens, std::size_t c) {
    for (std::size_t t = 0; t < tokens; ++t) {
      const float* xt = x + t * c;
      const float* dyt = dy + t * c;
      const float m = mean[t], s = rstd[t];
      for (std::size_t i = 0; i < c; ++i) {
        db[i] += dyt[i];
        dw[i] += (xt[i] - m) * s * dyt[i];
      }
    }
  }

  // ---- GELU (tanh approximation, as GPT-2) -----------------------------------------------------

  // 0.5 u (1 + tanh(y)) = u sigmoid(2 y), y = sqrt(2/pi) (u + 0.044715 u^3): the same function,
  // without the cancellation of 1 + tanh for negative u.
  static void gelu_forward(const float* x, float* y, std::size_t n) {
    constexpr float k2 = 2.0f * 0.7978845608028654f;  // 2 sqrt(2/pi)
    for (std::size_t i = 0; i < n; ++i) {
      const float u = x[i];
      y[i] = u * detail::fast_sigmoid(k2 * (u + 0.044715f * u * u * u));
    }
  }

  /// dx = dy * gelu'(x) (overwrites). With s = sigmoid(2 y): 1 + tanh y = 2 s and
  /// 1 - tanh^2 y = 4 s (1 - s), so gelu'(u) = s + 2 u s (1 - s) y'(u).
  static void gelu_backward(const float* x, const float* dy, float* dx, std::size_t n) {
    constexpr float k = 0.7978845608028654f;
    for (std::size_t i = 0; i < n; ++i) {
      const float u = x[i];
      const float s = detail::fast_sigmoid(2.0f * k * (u + 0.044715f * u * u * u));
      const float grad = s + 2.0f * u * s * (1.0f - s) * k * (1.0f + 3.0f * 0.044715f * u * u);
      dx[i] = dy[i] * grad;
    }
  }

  // ---- embeddings, residuals ---------------------------------------------------------------

  /// x[t] = wte[token[t]] + wpe[position[t]].
  static void embedding_forward(std::span<const std::int32_t> tokens, std::span<const std::int64_t> positions,
                                const float* wte, const float* wpe, float* x, std::size_t c) {
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      const float* e = wte + static_cast<std::size_t>(tokens[t]) * c;
      const float* p = wpe + static_cast<std::size_t>(positions[t]) * c;
      for (std::size_t i = 0; i < c; ++i) x[t * c + i] = e[i] + p[i];
    }
  }

  static void embedding_backward(std::span<const std::int32_t> tokens, std::span<const std::int64_t> positions,
                                 const float* dx, float* dwte, float* dwpe, std::size_t c) {
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      float* e = dwte + static_cast<std::size_t>(tokens[t]) * c;
      float* p = dwpe + static_cast<std::size_t>(positions[t]) * c;
      for (std::size_t i = 0; i < c; ++i) {
        e[i] += dx[t * c + i];
        p[i] += dx[t * c + i];
      }
    }
  }

  /// The residual connection after a row-parallel layer: y = x + out + bias per row ([T, C]).
  static void residual_add(const float* x, const float* out, const float* bias, float* y, std::size_t tokens,
                           std::size_t c) {
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t j = 0; j < c; ++j) y[t * c + j] = x[t * c + j] + out[t * c + j] + bias[j];
  }

  // ---- the tied output layer and the loss ---------------------------------------------------

  /// logits[T,V] = h[T,C] wte^T.
  static void logits_forward(const float* h, const float* wte, float* logits, std::size_t tokens, std::size_t c,
                             std::size_t vocab) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(tokens), static_cast<int>(vocab),
                static_cast<int>(c), 1.0f, h, static_cast<int>(c), wte, static_cast<int>(c), 0.0f, logits,
                static_cast<int>(vocab));
  }
  /// The input gradient: dh = dlogits wte (overwrites).
  static void logits_backward_input(const float* wte, const float* dlogits, float* dh, std::size_t tokens,
                                    std::size_t c, std::size_t vocab) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(tokens), static_cast<int>(c),
                static_cast<int>(vocab), 1.0f, dlogits, static_cast<int>(vocab), wte, static_cast<int>(c), 0.0f, dh,
                static_cast<int>(c));
  }
  /// The embedding's gradient from the output layer: dwte += dlogits^T h.
  static void logits_backward_weight(const float* h, const float* dlogits, float* dwte, std::size_t tokens,
                                     std::size_t c, std::size_t vocab) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(vocab), static_cast<int>(c),
                static_cast<int>(tokens), 1.0f, dlogits, static_cast<int>(vocab), h, static_cast<int>(c), 1.0f, dwte,
                static_cast<int>(c));
  }

  /// Cross-entropy of each row against its label; returns the sum of the rows' losses (in double)
  /// and overwrites `logits` with the gradient of (sum of losses) * `scale`. The softmax's
  /// exponentials are computed once (vectorised) and summed in double.
  static double cross_entropy(float* logits, std::span<const std::int32_t> labels, std::size_t vocab, float scale) {
    double total = 0;
    for (std::size_t t = 0; t < labels.size(); ++t) {
      float* row = logits + t * vocab;
      const float max = *std::max_element(row, row + vocab);
      const float label_logit = row[labels[t]];
      for (std::size_t j = 0; j < vocab; ++j) row[j] = detail::fast_exp(row[j] - max);
      double sum = 0;
      for (std::size_t j = 0; j < vocab; ++j) sum += static_cast<double>(row[j]);
      total += std::log(sum) + static_cast<double>(max) - static_cast<double>(label_logit);
      const float to_probability = static_cast<float>(static_cast<double>(scale) / sum);
      for (std::size_t j = 0; j < vocab; ++j) row[j] *= to_probability;
      row[labels[t]] -= scale;
    }
    return total;
  }

  // ---- optimizer -------------------------------------------------------------------------------

  struct adamw_settings {
    float lr = 3e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  };
  /// One AdamW step (decoupled weight decay, bias-corrected moments) over `n` elements; `step`
  /// counts from 1.
  static void adamw(float* param, const float* grad, float* m, float* v, std::size_t n, long step,
                    const adamw_settings& s, bool decay) {
    const float c1 = 1.0f - std::pow(s.beta1, static_cast<float>(step));
    const float c2 = 1.0f - std::pow(s.beta2, static_cast<float>(step));
    const float wd = decay ? s.weight_decay : 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      const float g = grad[i];
      m[i] = s.beta1 * m[i] + (1.0f - s.beta1) * g;
      v[i] = s.beta2 * v[i] + (1.0f - s.beta2) * g * g;
      const float mhat = m[i] / c1, vhat = v[i] / c2;
      param[i] -= s.lr * (mhat / (std::sqrt(vhat) + s.eps) + wd * param[i]);
    }
  }
};

/// Causal attention of a block of queries to a block of keys through BLAS, per head: the local
/// computation weft's context parallelism (ring attention) calls, in the layout it expects
/// (q, k, v, out: [tokens, heads, head_dim]; lse: [tokens, heads]). The merge of partial results
/// and scratch buffers are the reference's; forward and backward are matrix products here.
///
/// Causal blocks are cut into bands of query rows: when positions ascend (as every split weft's
/// context parallelism makes gives them), a band sees only a prefix of the keys, so the products
/// skip the masked upper triangle instead of computing it and throwing it away.
struct blas_attention : weft::cp::reference_attention {
  static constexpr std::size_t band_rows = 32;

  void forward(std::span<const float> q, std::span<const std::int64_t> q_pos, std::span<const float> k,
               std::span<const float> v, std::span<const std::int64_t> k_pos, weft::cp::attention_shape shape,
               weft::cp::attention_options options, std::span<float> out, std::span<float> lse) const {
    const std::size_t nq = q_pos.size(), nk = k_pos.size(), H = shape.heads, D = shape.head_dim, row = H * D;
    const float scale = static_cast<float>(weft::cp::softmax_scale(shape, options));
    const masking mask(q_pos, k_pos, options.causal);
    std::vector<float> s(std::min(nq, mask.band) * nk);
    for (std::size_t h = 0; h < H; ++h) {
      for (std::size_t i0 = 0; i0 < nq; i0 += mask.band) {
        const std::size_t rows = std::min(mask.band, nq - i0), kn = mask.keys_seen(i0 + rows - 1, nk);
        if (kn > 0)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(kn),
                      static_cast<int>(D), scale, q.data() + i0 * row + h * D, static_cast<int>(row), k.data() + h * D,
                      static_cast<int>(row), 0.0f, s.data(), static_cast<int>(kn));
        for (std::size_t r = 0; r < rows; ++r) {
          float* si = s.data() + r * kn;
          const std::size_t i = i0 + r, seen = mask.keys_seen(i, kn);
          mask.hide_unseen(i, si, seen);
          float max = minus_inf;
          for (std::size_t j = 0; j < seen; ++j) max = std::max(max, si[j]);
          if (max == minus_inf) {  // the row sees no key
            std::fill(si, si + kn, 0.0f);
            lse[i * H + h] = minus_inf;
            continue;
          }
          for (std::size_t j = 0; j < seen; ++j) si[j] = detail::fast_exp(si[j] - max);
          mask.zero_unseen(i, si, seen);
          std::fill(si + seen, si + kn, 0.0f);
          float sum = 0;
          for (std::size_t j = 0; j < seen; ++j) sum += si[j];
          const float inv = 1.0f / sum;
          for (std::size_t j = 0; j < seen; ++j) si[j] *= inv;
          lse[i * H + h] = max + std::log(sum);
        }
        float* o = out.data() + i0 * row + h * D;
        if (kn == 0) {
          for (std::size_t r = 0; r < rows; ++r) std::fill(o + r * row, o + r * row + D, 0.0f);
          continue;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(D),
                    static_cast<int>(kn), 1.0f, s.data(), static_cast<int>(kn), v.data() + h * D, static_cast<int>(row),
                    0.0f, o, static_cast<int>(row));
      }
    }
  }

  void backward(std::span<const float> q, std::span<const std::int64_t> q_pos, std::span<const float> k,
                std::span<const float> v, std::span<const std::int64_t> k_pos, weft::cp::attention_shape shape,
                weft::cp::attention_options options, std::span<const float> out, std::span<const float> lse,
                std::span<const float> dout, std::span<float> dq, std::span<float> dk, std::span<float> dv) const {
    const std::size_t nq = q_pos.size(), nk = k_pos.size(), H = shape.heads, D = shape.head_dim, row = H * D;
    const float scale = static_cast<float>(weft::cp::softmax_scale(shape, options));
    const masking mask(q_pos, k_pos, options.causal);
    std::vector<float> p(std::min(nq, mask.band) * nk), dp(p.size());
    for (std::size_t h = 0; h < H; ++h) {
      for (std::size_t i0 = 0; i0 < nq; i0 += mask.band) {
        const std::size_t rows = std::min(mask.band, nq - i0), kn = mask.keys_seen(i0 + rows - 1, nk);
        if (kn == 0) continue;
        const int m = static_cast<int>(rows), n = static_cast<int>(kn), d = static_cast<int>(D), ld = static_cast<int>(row);
        const float* qb = q.data() + i0 * row + h * D;
        const float* dob = dout.data() + i0 * row + h * D;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, d, scale, qb, ld, k.data() + h * D, ld, 0.0f,
                    p.data(), n);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, d, 1.0f, dob, ld, v.data() + h * D, ld, 0.0f,
                    dp.data(), n);
        for (std::size_t r = 0; r < rows; ++r) {
          const std::size_t i = i0 + r;
          const float l = lse[i * H + h];
          float* pi = p.data() + r * kn;
          float* dpi = dp.data() + r * kn;
          const std::size_t seen = l == minus_inf ? 0 : mask.keys_seen(i, kn);
          float delta = 0;
          for (std::size_t e = 0; e < D; ++e) delta += dout[i * row + h * D + e] * out[i * row + h * D + e];
          for (std::size_t j = 0; j < seen; ++j) pi[j] = detail::fast_exp(pi[j] - l);
          mask.zero_unseen(i, pi, seen);
          for (std::size_t j = 0; j < seen; ++j) dpi[j] = pi[j] * (dpi[j] - delta) * scale;  // dS, scale folded in
          std::fill(pi + seen, pi + kn, 0.0f);
          std::fill(dpi + seen, dpi + kn, 0.0f);
        }
        // dv += P^T dout; dq += dS k; dk += dS^T q.
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, d, m, 1.0f, p.data(), n, dob, ld, 1.0f,
                    dv.data() + h * D, ld);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, d, n, 1.0f, dp.data(), n, k.data() + h * D, ld, 1.0f,
                    dq.data() + i0 * row + h * D, ld);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, d, m, 1.0f, dp.data(), n, qb, ld, 1.0f,
                    dk.data() + h * D, ld);
      }
    }
  }

 private:
  static constexpr float minus_inf = -std::numeric_limits<float>::infinity();

  /// Which keys each query row sees. With ascending positions a row sees a prefix of the keys and
  /// rows are taken in bands; otherwise (any other order) in one band, masked key by key.
  struct masking {
    std::span<const std::int64_t> q_pos, k_pos;
    bool causal, prefix;
    std::size_t band;

    masking(std::span<const std::int64_t> q, std::span<const std::int64_t> k, bool is_causal)
        : q_pos(q), k_pos(k), causal(is_causal),
          prefix(!is_causal || (std::is_sorted(q.begin(), q.end()) && std::is_sorted(k.begin(), k.end()))),
          band(is_causal && prefix ? band_rows : std::max<std::size_t>(q.size(), 1)) {}

    /// Keys among the first `limit` that query row `i` may see: a prefix of them, or (unordered
    /// positions) all of them, the unseen ones hidden (-inf scores) and zeroed (probabilities).
    std::size_t keys_seen(std::size_t i, std::size_t limit) const {
      if (!causal || !prefix) return limit;
      return static_cast<std::size_t>(std::upper_bound(k_pos.begin(), k_pos.begin() + static_cast<std::ptrdiff_t>(limit),
                                                       q_pos[i]) -
                                      k_pos.begin());
    }
    /// Sets the entries of keys row `i` must not see to `value` (unordered positions only).
    void set_unseen(std::size_t i, float* row, std::size_t count, float value) const {
      if (!causal || prefix) return;
      for (std::size_t j = 0; j < count; ++j)
        if (k_pos[j] > q_pos[i]) row[j] = value;
    }
    void hide_unseen(std::size_t i, float* scores, std::size_t count) const { set_unseen(i, scores, count, minus_inf); }
    void zero_unseen(std::size_t i, float* probabilities, std::size_t count) const {
      set_unseen(i, probabilities, count, 0.0f);
    }
  };
};

static_assert(weft::cp::attention_kernel<blas_attention, float>);

}  // namespace train_gpt
