#pragma once
// A stack of dense layers with analytic, layer-by-layer forward and backward, for the sharding
// tests: layer l maps width[l] -> width[l+1] as y = tanh(W x + b) (the last layer without tanh);
// loss 0.5 |y - t|^2 per sample. Each layer is one unit (weight, bias). Inputs, targets and
// initial weights are functions of their indices, so every rank builds any sample and any
// initial value on its own.
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/core/float16.hpp>

namespace fsdp_test {

struct layer_stack {
  std::vector<std::size_t> width;

  std::size_t layers() const { return width.size() - 1; }
  std::size_t weight_count(std::size_t l) const { return width[l + 1] * width[l]; }
  std::size_t bias_count(std::size_t l) const { return width[l + 1]; }
  std::string name(std::size_t l) const { return "layer" + std::to_string(l); }

  double initial_weight(std::size_t l, std::size_t i) const {
    return 0.5 / std::sqrt(static_cast<double>(width[l])) * std::sin(1.3 * static_cast<double>(i) + 0.7 * static_cast<double>(l) + 0.2);
  }
  double initial_bias(std::size_t l, std::size_t i) const {
    return 0.05 * std::cos(0.9 * static_cast<double>(i) + static_cast<double>(l));
  }
  double input(std::size_t sample, std::size_t j) const {
    return std::sin(0.37 * static_cast<double>(sample) + 0.11 * static_cast<double>(j) + 0.3);
  }
  double target(std::size_t sample, std::size_t k) const {
    return 0.8 * std::cos(0.23 * static_cast<double>(sample) + 0.5 * static_cast<double>(k));
  }

  /// Activations of a batch: acts[l] is the input of layer l (batch x width[l]); acts[layers()] the output.
  struct activations {
    std::vector<std::vector<double>> acts;
    std::size_t batch = 0;
  };

  activations begin(std::span<const std::size_t> samples) const {
    activations a;
    a.batch = samples.size();
    a.acts.resize(width.size());
    a.acts[0].resize(a.batch * width[0]);
    for (std::size_t s = 0; s < a.batch; ++s)
      for (std::size_t j = 0; j < width[0]; ++j) a.acts[0][s * width[0] + j] = input(samples[s], j);
    return a;
  }

  template <class P>
  static double value(P x) {
    return static_cast<double>(static_cast<float>(x));
  }
  static double value(double x) { return x; }
  template <class G>
  static G to(double x) {
    if constexpr (std::is_same_v<G, double>)
      return x;
    else
      return G(static_cast<float>(x));
  }

  /// Layer l's forward with parameters w, b (any element type).
  template <class P>
  void forward(std::size_t l, std::span<const P> w, std::span<const P> b, activations& a) const {
    const std::size_t in = width[l], out = width[l + 1];
    a.acts[l + 1].assign(a.batch * out, 0.0);
    for (std::size_t s = 0; s < a.batch; ++s)
      for (std::size_t o = 0; o < out; ++o) {
        double z = value(b[o]);
        for (std::size_t i = 0; i < in; ++i) z += value(w[o * in + i]) * a.acts[l][s * in + i];
        a.acts[l + 1][s * out + o] = l + 1 == layers() ? z : std::tanh(z);
      }
  }

  /// d loss / d output of the last layer, times `factor`.
  std::vector<double> output_gradient(std::span<const std::size_t> samples, const activations& a, double factor) const {
    const std::size_t out = width.back();
    std::vector<double> d(a.batch * out);
    for (std::size_t s = 0; s < a.batch; ++s)
      for (std::size_t k = 0; k < out; ++k) d[s * out + k] = factor * (a.acts.back()[s * out + k] - target(samples[s], k));
    return d;
  }

  /// Layer l's backward: given d loss / d (its output) in `dy`, adds its weight and bias gradients
  /// into gw, gb and returns d loss / d (its input).
  template <class P, class G>
  std::vector<double> backward(std::size_t l, std::span<const P> w, const activations& a, std::span<const double> dy,
                               std::span<G> gw, std::span<G> gb) const {
    const std::size_t in = width[l], out = width[l + 1];
    std::vector<double> dz(dy.begin(), dy.end()), dx(a.batch * in, 0.0);
    if (l + 1 != layers())
      for (std::size_t i = 0; i < dz.size(); ++i) {
        const double y = a.acts[l + 1][i];
        dz[i] *= 1 - y * y;
      }
    std::vector<double> accw(out * in, 0.0), accb(out, 0.0);
    for (std::size_t s = 0; s < a.batch; ++s)
      for (std::size_t o = 0; o < out; ++o) {
        const double d = dz[s * out + o];
        accb[o] += d;
        for (std::size_t i = 0; i < in; ++i) {
          accw[o * in + i] += d * a.acts[l][s * in + i];
          dx[s * in + i] += d * value(w[o * in + i]);
        }
      }
    for (std::size_t i = 0; i < accw.size(); ++i) gw[i] = to<G>(value(gw[i]) + accw[i]);
    for (std::size_t o = 0; o < out; ++o) gb[o] = to<G>(value(gb[o]) + accb[o]);
    return dx;
  }
};

inline std::vector<std::size_t> range(std::size_t first, std::size_t count) {
  std::vector<std::size_t> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = first + i;
  return out;
}

}  // namespace fsdp_test
