#pragma once
/// \file
/// CRC-32 as zlib, PNG and Python's `zlib.crc32` compute it (reflected polynomial 0xEDB88320,
/// initial value and final xor 0xFFFFFFFF), so a tool in any language can check a checkpoint's
/// pieces with its standard library. Eight bytes per step (slicing-by-8), about 1-2 GB/s.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace weft::checkpoint::detail {

using crc32_tables = std::array<std::array<std::uint32_t, 256>, 8>;

consteval crc32_tables make_crc32_tables() {
  crc32_tables tables{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) != 0 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    tables[0][i] = c;
  }
  for (std::size_t t = 1; t < 8; ++t) {
    for (std::size_t i = 0; i < 256; ++i) tables[t][i] = (tables[t - 1][i] >> 8) ^ tables[0][tables[t - 1][i] & 0xffu];
  }
  return tables;
}

inline constexpr crc32_tables crc32_table = make_crc32_tables();

/// Continues a CRC-32: start with `crc32_update(0, first)`, then `crc32_update(crc, next)`.
inline std::uint32_t crc32_update(std::uint32_t crc, std::span<const std::byte> bytes) noexcept {
  std::uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  while (n >= 8) {
    std::uint32_t low = 0;
    std::uint32_t high = 0;
    std::memcpy(&low, p, 4);  // little-endian hosts only, as the rest of weft::checkpoint
    std::memcpy(&high, p + 4, 4);
    low ^= c;
    c = crc32_table[7][low & 0xffu] ^ crc32_table[6][(low >> 8) & 0xffu] ^ crc32_table[5][(low >> 16) & 0xffu] ^
        crc32_table[4][low >> 24] ^ crc32_table[3][high & 0xffu] ^ crc32_table[2][(high >> 8) & 0xffu] ^
        crc32_table[1][(high >> 16) & 0xffu] ^ crc32_table[0][high >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = crc32_table[0][(c ^ std::to_integer<std::uint32_t>(*p++)) & 0xffu] ^ (c >> 8);
  return ~c;
}

inline std::uint32_t crc32(std::span<const std::byte> bytes) noexcept { return crc32_update(0, bytes); }

}  // namespace weft::checkpoint::detail
