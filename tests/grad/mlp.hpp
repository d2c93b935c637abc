#pragma once
// A two-layer perceptron with analytic gradients, for the equivalence tests: y = W2 tanh(W1 x + b1)
// + b2, loss 0.5 |y - t|^2 per sample. Inputs, targets and initial weights are functions of their
// indices, so every rank can build any sample and the reference gradient on its own.
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace grad_test {

struct mlp {
  static constexpr std::size_t in = 5, hidden = 7, out = 3;
  // Registration order (forward order) and sizes.
  static constexpr std::size_t sizes[4] = {hidden * in, hidden, out * hidden, out};
  static inline const std::string names[4] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

  std::vector<double> w1, b1, w2, b2;

  mlp() : w1(hidden * in), b1(hidden), w2(out * hidden), b2(out) {
    for (std::size_t i = 0; i < w1.size(); ++i) w1[i] = 0.3 * std::sin(1.7 * static_cast<double>(i) + 0.2);
    for (std::size_t i = 0; i < b1.size(); ++i) b1[i] = 0.1 * std::cos(0.9 * static_cast<double>(i));
    for (std::size_t i = 0; i < w2.size(); ++i) w2[i] = 0.4 * std::cos(1.3 * static_cast<double>(i) + 0.5);
    for (std::size_t i = 0; i < b2.size(); ++i) b2[i] = 0.05 * static_cast<double>(i);
  }

  std::vector<double>& param(std::size_t p) {
    switch (p) {
      case 0: return w1;
      case 1: return b1;
      case 2: return w2;
      default: return b2;
    }
  }

  static double input(std::size_t sample, std::size_t j) {
    return std::sin(0.37 * static_cast<double>(sample) + 0.11 * static_cast<double>(j) + 0.3);
  }
  static double target(std::size_t sample, std::size_t k) {
    return std::cos(0.23 * static_cast<double>(sample) + 0.5 * static_cast<double>(k));
  }

  /// Adds the gradient of the summed loss over `samples` into g[0..3] (sized like the params).
  void add_gradient(std::span<const std::size_t> samples, std::vector<double> (&g)[4]) const {
    for (std::size_t s : samples) {
      double x[in], h[hidden], y[out], dy[out], dh[hidden];
      for (std::size_t j = 0; j < in; ++j) x[j] = input(s, j);
      for (std::size_t i = 0; i < hidden; ++i) {
        double a = b1[i];
        for (std::size_t j = 0; j < in; ++j) a += w1[i * in + j] * x[j];
        h[i] = std::tanh(a);
      }
      for (std::size_t k = 0; k < out; ++k) {
        double a = b2[k];
        for (std::size_t i = 0; i < hidden; ++i) a += w2[k * hidden + i] * h[i];
        y[k] = a;
        dy[k] = y[k] - target(s, k);
      }
      for (std::size_t i = 0; i < hidden; ++i) {
        double a = 0;
        for (std::size_t k = 0; k < out; ++k) a += w2[k * hidden + i] * dy[k];
        dh[i] = a * (1 - h[i] * h[i]);
      }
      for (std::size_t k = 0; k < out; ++k) {
        g[3][k] += dy[k];
        for (std::size_t i = 0; i < hidden; ++i) g[2][k * hidden + i] += dy[k] * h[i];
      }
      for (std::size_t i = 0; i < hidden; ++i) {
        g[1][i] += dh[i];
        for (std::size_t j = 0; j < in; ++j) g[0][i * in + j] += dh[i] * x[j];
      }
    }
  }

  /// The gradient of the summed loss, scaled by `factor`.
  std::vector<double> gradient(std::size_t p, std::span<const std::size_t> samples, double factor) const {
    std::vector<double> g[4] = {std::vector<double>(sizes[0]), std::vector<double>(sizes[1]),
                                std::vector<double>(sizes[2]), std::vector<double>(sizes[3])};
    add_gradient(samples, g);
    for (double& v : g[p]) v *= factor;
    return g[p];
  }
};

inline std::vector<std::size_t> range(std::size_t first, std::size_t count) {
  std::vector<std::size_t> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = first + i;
  return out;
}

}  // namespace grad_test
