#pragma once
/// \file
/// The rolling fingerprint of a communicator's collectives: each call (operation, dtype, count,
/// reduction, root, and its place among the collectives) is folded into one 64-bit value, so two
/// ranks whose fingerprints agree issued the same collectives in the same order, and comparing
/// histories costs one small all-gather however long they are (check_level::fingerprint).
/// Point-to-point is left out: its peers differ from rank to rank by design.

#include <cstdint>

#include <weft/core/dtype.hpp>
#include <weft/trace/operation.hpp>

namespace weft::trace {

inline constexpr std::uint64_t fingerprint_seed = 0xcbf29ce484222325ull;

/// One 64-bit word mixed into `hash`: xor, rotate, multiply by an odd constant (the golden
/// ratio's). Integer arithmetic only, so every platform computes the same value, and a few cycles
/// per word, which the hot path can afford (a byte-wise hash would cost ten times more).
constexpr std::uint64_t fold_word(std::uint64_t hash, std::uint64_t word) noexcept {
  hash ^= word;
  hash = (hash << 29) | (hash >> 35);
  return hash * 0x9e3779b97f4a7c15ull;
}

/// `hash` after the `index`-th collective (1-based) with this shape. `reduction` is the
/// reduce_op's value, or -1 for operations that do not reduce; `root` -1 when there is none.
constexpr std::uint64_t fold_call(std::uint64_t hash, operation op, dtype type, std::uint64_t count, int reduction,
                                  int root, std::uint64_t index) noexcept {
  const std::uint64_t shape = static_cast<std::uint64_t>(op) | (static_cast<std::uint64_t>(type) << 8) |
                              (static_cast<std::uint64_t>(static_cast<std::uint8_t>(reduction)) << 16) |
                              (static_cast<std::uint64_t>(static_cast<std::uint32_t>(root)) << 32);
  return fold_word(fold_word(fold_word(hash, shape), count), index);
}

}  // namespace weft::trace
