#pragma once
/// \file
/// A 64-bit FNV-1a accumulator for bucket-plan fingerprints: the same value on every platform and
/// compiler, so ranks can compare plans by exchanging one integer.

#include <cstdint>
#include <string_view>

namespace weft::grad::detail {

class fingerprint_builder {
 public:
  constexpr fingerprint_builder& add(std::string_view text) noexcept {
    add(static_cast<std::uint64_t>(text.size()));
    for (char c : text) mix(static_cast<std::uint8_t>(c));
    return *this;
  }
  constexpr fingerprint_builder& add(std::uint64_t value) noexcept {
    for (int i = 0; i < 8; ++i) mix(static_cast<std::uint8_t>(value >> (8 * i)));
    return *this;
  }
  constexpr std::uint64_t value() const noexcept { return hash_; }

 private:
  constexpr void mix(std::uint8_t byte) noexcept {
    hash_ ^= byte;
    hash_ *= 0x100000001b3ull;
  }
  std::uint64_t hash_ = 0xcbf29ce484222325ull;
};

}  // namespace weft::grad::detail
