#pragma once
/// \file
/// Which tokens of a sequence each rank of a context-parallel (cp) group holds: pure maths, no
/// communicator, testable in one process.
///
/// Two splits:
///  - `contiguous`: rank i holds tokens [i·S/cp, (i+1)·S/cp). Fine without a causal mask.
///  - `load_balanced`: the sequence is cut into 2·cp equal chunks and rank i holds chunks i and
///    2·cp−1−i (the layout Llama 3 trains with). Under a causal mask the work of attention grows
///    with a token's position; pairing an early chunk with the matching late one gives every
///    rank the same number of unmasked (query, key) pairs.
///
/// A rank's local tensor is its tokens in order of their global positions, [local tokens, ...]
/// row-major, each token a row of `row` elements (heads × head_dim for attention).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>

namespace weft::cp {

enum class split_kind { contiguous, load_balanced };

constexpr std::string_view to_string(split_kind kind) noexcept {
  return kind == split_kind::contiguous ? "contiguous" : "load-balanced causal";
}

/// A sequence of `seq` tokens split over `cp` ranks.
struct sequence_split {
  std::int64_t seq = 0;
  int cp = 1;
  split_kind kind = split_kind::load_balanced;
};

/// Global positions [begin, begin + length): one contiguous piece of a rank's tokens.
struct segment {
  std::int64_t begin = 0;
  std::int64_t length = 0;
  constexpr std::int64_t last() const noexcept { return begin + length - 1; }
};

/// How many equal pieces the split cuts the sequence into: cp (contiguous) or 2·cp (load-balanced).
constexpr std::int64_t pieces(const sequence_split& s) noexcept {
  return s.kind == split_kind::contiguous ? s.cp : 2 * static_cast<std::int64_t>(s.cp);
}

/// Throws, naming the numbers and the nearest valid sequence lengths, unless `seq` is positive and
/// divides into `pieces(s)` equal pieces and cp ≥ 1.
inline void validate(const sequence_split& s) {
  if (s.cp < 1) fail("context parallelism: cp=" + std::to_string(s.cp) + " is not a group size; cp must be at least 1");
  const std::int64_t n = pieces(s);
  if (s.seq > 0 && s.seq % n == 0) return;
  const std::int64_t below = s.seq > 0 ? (s.seq / n) * n : 0;
  const std::int64_t above = below + n;
  std::string need = s.kind == split_kind::contiguous
                         ? "a multiple of cp = " + std::to_string(n)
                         : "a multiple of 2·cp = " + std::to_string(n) + ", since it is cut into 2·cp chunks";
  std::string nearest = below > 0 ? std::to_string(below) + " or " + std::to_string(above) : std::to_string(above);
  fail("context parallelism: a sequence of " + std::to_string(s.seq) + " tokens does not split for the " +
       std::string(to_string(s.kind)) + " split over cp=" + std::to_string(s.cp) + ": its length must be " + need +
       "; the nearest valid lengths are " + nearest + " (pad the sequence, or change cp)");
}

/// Tokens each rank holds.
constexpr std::int64_t local_tokens(const sequence_split& s) noexcept { return s.seq / s.cp; }

/// The pieces of global positions `rank` holds, in local order (one for contiguous, two for
/// load-balanced: chunk rank, then chunk 2·cp−1−rank).
inline std::vector<segment> segments(const sequence_split& s, int rank) {
  validate(s);
  if (rank < 0 || rank >= s.cp)
    fail("context parallelism: rank " + std::to_string(rank) + " is not in a cp group of " + std::to_string(s.cp));
  const std::int64_t len = s.seq / pieces(s);
  if (s.kind == split_kind::contiguous) return {segment{rank * len, len}};
  const std::int64_t late = 2 * static_cast<std::int64_t>(s.cp) - 1 - rank;
  return {segment{rank * len, len}, segment{late * len, len}};
}

/// The global position of each of `rank`'s tokens, in local order.
inline std::vector<std::int64_t> positions(const sequence_split& s, int rank) {
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(local_tokens(s)));
  for (const segment& g : segments(s, rank))
    for (std::int64_t p = g.begin; p <= g.last(); ++p) out.push_back(p);
  return out;
}

namespace detail {
inline void expect_size(std::string_view what, std::size_t got, std::size_t want) {
  if (got != want)
    fail("context parallelism: " + std::string(what) + " has " + std::to_string(got) + " elements; expected " +
         std::to_string(want));
}
}  // namespace detail

/// Copies `rank`'s tokens out of the full tensor [seq, row] into `local` [local tokens, row].
template <class T>
void shard(const sequence_split& s, int rank, std::span<const T> full, std::size_t row, std::span<T> local) {
  validate(s);
  detail::expect_size("shard: the full tensor", full.size(), static_cast<std::size_t>(s.seq) * row);
  detail::expect_size("shard: the local tensor", local.size(), static_cast<std::size_t>(local_tokens(s)) * row);
  std::size_t at = 0;
  for (const segment& g : segments(s, rank)) {
    const auto n = static_cast<std::size_t>(g.length) * row;
    const auto from = full.subspan(static_cast<std::size_t>(g.begin) * row, n);
    std::copy(from.begin(), from.end(), local.begin() + static_cast<std::ptrdiff_t>(at));
    at += n;
  }
}

/// Copies `rank`'s tokens from `local` [local tokens, row] back to their places in `full` [seq, row].
template <class T>
void unshard(const sequence_split& s, int rank, std::span<const T> local, std::size_t row, std::span<T> full) {
  validate(s);
  detail::expect_size("unshard: the full tensor", full.size(), static_cast<std::size_t>(s.seq) * row);
  detail::expect_size("unshard: the local tensor", local.size(), static_cast<std::size_t>(local_tokens(s)) * row);
  std::size_t at = 0;
  for (const segment& g : segments(s, rank)) {
    const auto n = static_cast<std::size_t>(g.length) * row;
    const auto from = local.subspan(at, n);
    std::copy(from.begin(), from.end(), full.begin() + static_cast<std::ptrdiff_t>(g.begin) * static_cast<std::ptrdiff_t>(row));
    at += n;
  }
}

}  // namespace weft::cp
