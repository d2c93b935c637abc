#pragma once
/// \file
/// Token permutation by expert and its inverse. Each token t has K assignments a = t·K + j (slot
/// j of its top-k); permute_by_expert orders the kept assignments by expert (stably: in token
/// order, then slot order, within an expert), which is also the order of the ep ranks that own
/// the experts, so the permuted rows are the send buffer of the dispatch. In capacity mode an
/// expert keeps its first `capacity` assignments in that order and drops the rest.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace weft::moe {

struct token_permutation {
  std::size_t top_k = 1;
  std::vector<std::size_t> source;      ///< [kept]: the assignment t·K + j of each permuted row
  std::vector<std::size_t> per_expert;  ///< [E]: kept rows per expert, in expert order
  std::size_t dropped = 0;              ///< assignments over capacity
};

/// No capacity: dropless.
inline constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();

/// `expert` [T, K]: the experts chosen per token (routing::expert).
inline token_permutation permute_by_expert(std::span<const std::int32_t> expert, std::size_t top_k,
                                           std::size_t experts, std::size_t capacity = unlimited) {
  token_permutation out{top_k, {}, std::vector<std::size_t>(experts, 0), 0};
  std::vector<std::size_t> wanted(experts, 0);
  for (std::int32_t e : expert) ++wanted[static_cast<std::size_t>(e)];
  std::vector<std::size_t> start(experts + 1, 0);
  for (std::size_t e = 0; e < experts; ++e) {
    out.per_expert[e] = std::min(wanted[e], capacity);
    start[e + 1] = start[e] + out.per_expert[e];
  }
  out.source.resize(start[experts]);
  std::vector<std::size_t> next(start.begin(), start.end() - 1);
  for (std::size_t a = 0; a < expert.size(); ++a) {
    const auto e = static_cast<std::size_t>(expert[a]);
    if (next[e] == start[e + 1]) {
      ++out.dropped;
      continue;
    }
    out.source[next[e]++] = a;
  }
  return out;
}

/// rows[i] = h[token of permuted row i] ([kept, width]).
template <class T>
void gather_rows(std::span<const T> h, std::size_t width, const token_permutation& p, std::span<T> rows) {
  for (std::size_t i = 0; i < p.source.size(); ++i) {
    const T* from = h.data() + (p.source[i] / p.top_k) * width;
    std::copy(from, from + width, rows.data() + i * width);
  }
}

/// The inverse, weighted: y[t] += scale[a] · rows[i] for each permuted row i of assignment a of
/// token t (`scale` [T, K]; empty: 1). Dropped assignments add nothing.
template <class T>
void scatter_add_rows(std::span<const T> rows, std::size_t width, const token_permutation& p,
                      std::span<const T> scale, std::span<T> y) {
  for (std::size_t i = 0; i < p.source.size(); ++i) {
    const std::size_t a = p.source[i];
    const T s = scale.empty() ? T(1) : scale[a];
    const T* from = rows.data() + i * width;
    T* to = y.data() + (a / p.top_k) * width;
    for (std::size_t c = 0; c < width; ++c) to[c] += s * from[c];
  }
}

}  // namespace weft::moe
