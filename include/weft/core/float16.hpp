#pragma once
/// \file
/// Host-side 16-bit floating types that work without CUDA: `weft::half` (IEEE binary16) and
/// `weft::bfloat16`. They have the same bits as CUDA's `__half` / `__nv_bfloat16`, so a span of
/// them may point at device memory for the NCCL backend. Arithmetic converts through float;
/// float-to-16-bit conversions round to nearest even, as the hardware does.

#include <bit>
#include <cstdint>
#include <cmath>

namespace weft {

namespace detail {

constexpr std::uint16_t float_to_bfloat16_bits(float value) noexcept {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  std::uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding_bias) >> 16);
}

constexpr float bfloat16_bits_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

constexpr std::uint16_t float_to_half_bits(float value) noexcept {
  std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  std::uint32_t sign = (f >> 16) & 0x8000u;
  std::uint32_t abs = f & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow (incl. inf)
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    // value = abs_float; half subnormal unit is 2^-24.
    std::uint32_t mantissa = (abs & 0x007fffffu) | 0x00800000u;
    int exponent = static_cast<int>(abs >> 23);  // biased float exponent
    int shift = 126 - exponent;                  // so that result = mantissa >> (shift - 24 + ...)
    // half_sub = round(abs * 2^24) = round(mantissa * 2^(exponent-127-23+24)) = mantissa >> (126-exponent)
    if (exponent == 0 || shift > 24) return static_cast<std::uint16_t>(sign);
    std::uint32_t result = mantissa >> shift;
    std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
    std::uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  // normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits to nearest even
  std::uint32_t rebased = abs - 0x38000000u;  // (127-15) << 23
  std::uint32_t result = rebased >> 13;
  std::uint32_t remainder = rebased & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return static_cast<std::uint16_t>(sign | result);
}

constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    mantissa &= 0x3ffu;
    std::uint32_t biased = static_cast<std::uint32_t>(127 - 15 - e);
    return std::bit_cast<float>(sign | (biased << 23) | (mantissa << 13));
  }
  return std::bit_cast<float>(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

}  // namespace detail

/// IEEE 754 binary16, host-side storage type.
struct half {
  std::uint16_t bits = 0;
  constexpr half() noexcept = default;
  constexpr explicit half(float value) noexcept : bits(detail::float_to_half_bits(value)) {}
  constexpr explicit operator float() const noexcept { return detail::half_bits_to_float(bits); }
  static constexpr half from_bits(std::uint16_t raw) noexcept {
    half h;
    h.bits = raw;
    return h;
  }
  friend constexpr bool operator==(half a, half b) noexcept { return float(a) == float(b); }
};

/// bfloat16 (8-bit exponent, 7-bit mantissa), host-side storage type.
struct bfloat16 {
  std::uint16_t bits = 0;
  constexpr bfloat16() noexcept = default;
  constexpr explicit bfloat16(float value) noexcept : bits(detail::float_to_bfloat16_bits(value)) {}
  constexpr explicit operator float() const noexcept { return detail::bfloat16_bits_to_float(bits); }
  static constexpr bfloat16 from_bits(std::uint16_t raw) noexcept {
    bfloat16 b;
    b.bits = raw;
    return b;
  }
  friend constexpr bool operator==(bfloat16 a, bfloat16 b) noexcept { return float(a) == float(b); }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2);

}  // namespace weft
