// What the tp tests share: deterministic inputs and a serial (one-rank) linear layer written out
// here, independently of weft::tp, as the reference the sharded versions must match.
#pragma once

#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace tp_test {

using comm_t = weft::communicator<weft::mpi_backend>;

inline comm_t tp_group() { return comm_t(weft::mpi_backend::comm::world(), "tp"); }

// Multiples of 1/16 in [-0.5, 0.5]: products and sums of a few dozen of them are exact in float,
// so sharded and serial results agree exactly whatever the summation order; the tolerance below
// (documented in docs/parallelism.md) is for the general case.
inline std::vector<float> values(std::size_t n, int seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(seed) * 13 + i / 5) % 17) - 8) / 16.0f;
  return v;
}

// |a - b| <= 1e-5 * max(1, |b|) elementwise.
inline bool close(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= 1e-5f * std::fmax(1.0f, std::fabs(b[i])))) return false;
  return true;
}

// Rows [first, first + count) of a row-major [*, width] matrix.
inline std::vector<float> rows(const std::vector<float>& m, std::size_t width, std::size_t first, std::size_t count) {
  return std::vector<float>(m.begin() + static_cast<std::ptrdiff_t>(first * width),
                            m.begin() + static_cast<std::ptrdiff_t>((first + count) * width));
}
// Columns [first, first + count) of a row-major [height, width] matrix.
inline std::vector<float> columns(const std::vector<float>& m, std::size_t width, std::size_t first,
                                  std::size_t count) {
  std::vector<float> out;
  for (std::size_t i = 0; i < m.size() / width; ++i)
    for (std::size_t j = 0; j < count; ++j) out.push_back(m[i * width + first + j]);
  return out;
}

// A full linear layer on one rank: y = x Wᵀ + b, and its gradients from dy.
struct serial_linear {
  std::size_t in, out;
  std::vector<float> forward(const std::vector<float>& x, const std::vector<float>& w,
                             const std::vector<float>& b) const {
    const std::size_t t = x.size() / in;
    std::vector<float> y(t * out);
    for (std::size_t i = 0; i < t; ++i)
      for (std::size_t o = 0; o < out; ++o) {
        double s = b.empty() ? 0.0 : b[o];
        for (std::size_t q = 0; q < in; ++q) s += static_cast<double>(x[i * in + q]) * w[o * in + q];
        y[i * out + o] = static_cast<float>(s);
      }
    return y;
  }
  void backward(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& dy,
                std::vector<float>& dx, std::vector<float>& dw, std::vector<float>& db) const {
    const std::size_t t = x.size() / in;
    dx.assign(t * in, 0.0f);
    dw.assign(out * in, 0.0f);
    db.assign(out, 0.0f);
    for (std::size_t i = 0; i < t; ++i)
      for (std::size_t q = 0; q < in; ++q) {
        double s = 0;
        for (std::size_t o = 0; o < out; ++o) s += static_cast<double>(dy[i * out + o]) * w[o * in + q];
        dx[i * in + q] = static_cast<float>(s);
      }
    for (std::size_t o = 0; o < out; ++o) {
      for (std::size_t q = 0; q < in; ++q) {
        double s = 0;
        for (std::size_t i = 0; i < t; ++i) s += static_cast<double>(dy[i * out + o]) * x[i * in + q];
        dw[o * in + q] = static_cast<float>(s);
      }
      double s = 0;
      for (std::size_t i = 0; i < t; ++i) s += dy[i * out + o];
      db[o] = static_cast<float>(s);
    }
  }
};

}  // namespace tp_test
