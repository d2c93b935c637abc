#pragma once
/// \file
/// 64-bit FNV-1a: a hash that is the same on every platform and compiler, for layout fingerprints.

#include <cstdint>
#include <string_view>

namespace weft::layout::detail {

constexpr std::uint64_t fnv1a_64(std::string_view text) noexcept {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (char c : text) {
    hash ^= static_cast<std::uint8_t>(c);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

}  // namespace weft::layout::detail
