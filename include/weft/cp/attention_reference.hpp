#pragma once
/// \file
/// The local attention computation context parallelism is built around, as a clear CPU
/// reference: scaled dot-product attention of a block of queries against a block of keys and
/// values, with the causal mask taken from global token positions (so any split of the sequence
/// is masked correctly), returning the output and the log-sum-exp (LSE) of each query row's
/// scores; the online-softmax merge of two partial results; and the backward pass of one block
/// given the final output and LSE.
///
/// Context parallelism (ring_attention.hpp, ulysses.hpp) only moves data and calls these
/// operations; a trainer with its own kernel (flash attention on a GPU) passes an object with the
/// same members, satisfying `weft::cp::attention_kernel`. This one runs on host memory
/// (`memory == memory_space::host`) and is refused at compile time with a device backend.
///
/// Layouts, row-major: q, k, v, out, dout, dq, dk, dv are [tokens, heads, head_dim]; lse is
/// [tokens, heads]. Arithmetic is carried in double whatever T is.

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include <weft/backend/backend.hpp>

namespace weft::cp {

/// Heads and elements per head of every token row.
struct attention_shape {
  std::size_t heads = 1;
  std::size_t head_dim = 1;
  constexpr std::size_t row() const noexcept { return heads * head_dim; }
};

struct attention_options {
  bool causal = true;  ///< key j is visible to query i only when position(j) <= position(i)
  double scale = 0;    ///< multiplies q·k; 0 means 1/sqrt(head_dim)
};

constexpr double softmax_scale(attention_shape shape, attention_options options) {
  return options.scale != 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
}

/// What context parallelism needs from a local attention computation on element type T. All
/// sizes follow from the spans: queries = q_pos.size(), keys = k_pos.size().
///  - forward: attention of the queries to the keys alone; out and lse are overwritten (a row
///    that sees no key gets out = 0, lse = -inf).
///  - merge: folds a partial result (block_out, block_lse) into a running one (out, lse), which
///    stays normalised: the result is what attending to both sets of keys at once would give.
///  - backward: adds this block's contribution to dq, dk, dv, given the final out and lse of the
///    queries (over every key of the sequence) and dout.
///  - allocate / fill: scratch buffers in the kernel's memory and filling them (zero, -inf).
template <class K, class T>
concept attention_kernel =
    requires(const K& kernel, std::span<const T> in, std::span<T> inout, std::span<const std::int64_t> pos,
             attention_shape shape, attention_options options, std::size_t n, T value) {
      { K::memory } -> std::convertible_to<memory_space>;
      kernel.forward(in, pos, in, in, pos, shape, options, inout, inout);
      kernel.merge(inout, inout, in, in);
      kernel.backward(in, pos, in, in, pos, shape, options, in, in, in, inout, inout, inout);
      kernel.fill(inout, value);
      requires std::constructible_from<std::span<T>, decltype(kernel.template allocate<T>(n))&>;
    };

/// Whether kernel K works on the memory backend B's buffers live in (host for MPI, device for NCCL).
template <class K, class B>
concept kernel_runs_on = (K::memory == buffer_memory_v<B>);

/// The CPU reference (host memory only).
struct reference_attention {
  static constexpr memory_space memory = memory_space::host;

  template <class T>
  std::vector<T> allocate(std::size_t n) const {
    return std::vector<T>(n);
  }
  template <class T>
  void fill(std::span<T> data, T value) const {
    for (T& x : data) x = value;
  }

  template <class T>
  void forward(std::span<const T> q, std::span<const std::int64_t> q_pos, std::span<const T> k, std::span<const T> v,
               std::span<const std::int64_t> k_pos, attention_shape shape, attention_options options, std::span<T> out,
               std::span<T> lse) const {
    const std::size_t nq = q_pos.size(), nk = k_pos.size(), H = shape.heads, D = shape.head_dim;
    const double scale = softmax_scale(shape, options);
    std::vector<double> score(nk), acc(D);
    for (std::size_t i = 0; i < nq; ++i) {
      for (std::size_t h = 0; h < H; ++h) {
        const T* qi = q.data() + (i * H + h) * D;
        double max = -std::numeric_limits<double>::infinity();
        for (std::size_t j = 0; j < nk; ++j) {
          if (options.causal && k_pos[j] > q_pos[i]) {
            score[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          const T* kj = k.data() + (j * H + h) * D;
          double dot = 0;
          for (std::size_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * static_cast<double>(kj[d]);
          score[j] = dot * scale;
          if (score[j] > max) max = score[j];
        }
        T* oi = out.data() + (i * H + h) * D;
        if (max == -std::numeric_limits<double>::infinity()) {  // no visible key
          for (std::size_t d = 0; d < D; ++d) oi[d] = T(0);
          lse[i * H + h] = static_cast<T>(-std::numeric_limits<double>::infinity());
          continue;
        }
        double sum = 0;
        for (double& a : acc) a = 0;
        for (std::size_t j = 0; j < nk; ++j) {
          if (score[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(score[j] - max);
          sum += p;
          const T* vj = v.data() + (j * H + h) * D;
          for (std::size_t d = 0; d < D; ++d) acc[d] += p * static_cast<double>(vj[d]);
        }
        for (std::size_t d = 0; d < D; ++d) oi[d] = static_cast<T>(acc[d] / sum);
        lse[i * H + h] = static_cast<T>(max + std::log(sum));
      }
    }
  }

  /// out = (e^(lse - l)·out + e^(block_lse - l)·block_out), lse = l = log(e^lse + e^block_lse).
  template <class T>
  void merge(std::span<T> out, std::span<T> lse, std::span<const T> block_out, std::span<const T> block_lse) const {
    const std::size_t rows = lse.size();
    const std::size_t D = rows == 0 ? 0 : out.size() / rows;
    for (std::size_t r = 0; r < rows; ++r) {
      const double a = static_cast<double>(lse[r]), b = static_cast<double>(block_lse[r]);
      if (b == -std::numeric_limits<double>::infinity()) continue;
      if (a == -std::numeric_limits<double>::infinity()) {
        for (std::size_t d = 0; d < D; ++d) out[r * D + d] = block_out[r * D + d];
        lse[r] = block_lse[r];
        continue;
      }
      const double m = a > b ? a : b;
      const double l = m + std::log(std::exp(a - m) + std::exp(b - m));
      const double wa = std::exp(a - l), wb = std::exp(b - l);
      for (std::size_t d = 0; d < D; ++d)
        out[r * D + d] = static_cast<T>(wa * static_cast<double>(out[r * D + d]) +
                                        wb * static_cast<double>(block_out[r * D + d]));
      lse[r] = static_cast<T>(l);
    }
  }

  /// With P = exp(scale·q·k − lse) (the final probabilities) and Δ_i = dout_i·out_i:
  /// dv_j += Σ_i P_ij dout_i; dS_ij = P_ij (dout_i·v_j − Δ_i); dq_i += scale Σ_j dS_ij k_j;
  /// dk_j += scale Σ_i dS_ij q_i.
  template <class T>
  void backward(std::span<const T> q, std::span<const std::int64_t> q_pos, std::span<const T> k, std::span<const T> v,
                std::span<const std::int64_t> k_pos, attention_shape shape, attention_options options,
                std::span<const T> out, std::span<const T> lse, std::span<const T> dout, std::span<T> dq,
                std::span<T> dk, std::span<T> dv) const {
    const std::size_t nq = q_pos.size(), nk = k_pos.size(), H = shape.heads, D = shape.head_dim;
    const double scale = softmax_scale(shape, options);
    std::vector<double> dqi(D);
    for (std::size_t i = 0; i < nq; ++i) {
      for (std::size_t h = 0; h < H; ++h) {
        const double l = static_cast<double>(lse[i * H + h]);
        if (l == -std::numeric_limits<double>::infinity()) continue;
        const std::size_t qo = (i * H + h) * D;
        double delta = 0;
        for (std::size_t d = 0; d < D; ++d) delta += static_cast<double>(dout[qo + d]) * static_cast<double>(out[qo + d]);
        for (double& x : dqi) x = 0;
        for (std::size_t j = 0; j < nk; ++j) {
          if (options.causal && k_pos[j] > q_pos[i]) continue;
          const std::size_t ko = (j * H + h) * D;
          double dot = 0, dp = 0;
          for (std::size_t d = 0; d < D; ++d) {
            dot += static_cast<double>(q[qo + d]) * static_cast<double>(k[ko + d]);
            dp += static_cast<double>(dout[qo + d]) * static_cast<double>(v[ko + d]);
          }
          const double p = std::exp(dot * scale - l);
          const double ds = p * (dp - delta) * scale;
          for (std::size_t d = 0; d < D; ++d) {
            dv[ko + d] = static_cast<T>(static_cast<double>(dv[ko + d]) + p * static_cast<double>(dout[qo + d]));
            dk[ko + d] = static_cast<T>(static_cast<double>(dk[ko + d]) + ds * static_cast<double>(q[qo + d]));
            dqi[d] += ds * static_cast<double>(k[ko + d]);
          }
        }
        for (std::size_t d = 0; d < D; ++d) dq[qo + d] = static_cast<T>(static_cast<double>(dq[qo + d]) + dqi[d]);
      }
    }
  }
};

static_assert(attention_kernel<reference_attention, float>);
static_assert(attention_kernel<reference_attention, double>);

}  // namespace weft::cp
