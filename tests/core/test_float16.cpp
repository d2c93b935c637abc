#include <catch2/catch.hpp>

#include <weft/core/dtype.hpp>

#include <cmath>
#include <cstring>
#include <limits>

using weft::bfloat16;
using weft::half;

TEST_CASE("half converts exactly representable values both ways") {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f /*2^-14*/, 5.9604645e-08f /*2^-24*/, 1000.5f}) {
    CHECK(float(half(v)) == v);
  }
  CHECK(half(1.0f).bits == 0x3c00);
  CHECK(half(-2.0f).bits == 0xc000);
  CHECK(half(65504.0f).bits == 0x7bff);
  CHECK(half(5.9604645e-08f).bits == 0x0001);
}

TEST_CASE("half rounds to nearest even, overflows to infinity and keeps NaN") {
  // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even mantissa (1.0).
  CHECK(half(1.0f + std::ldexp(1.0f, -11)).bits == 0x3c00);
  // 1 + 3*2^-11 lies halfway between 1+2^-10 (odd) and 1+2^-9 (even).
  CHECK(half(1.0f + 3 * std::ldexp(1.0f, -11)).bits == 0x3c02);
  CHECK(half(1.0e6f).bits == 0x7c00);
  CHECK(std::isinf(float(half(std::numeric_limits<float>::infinity()))));
  CHECK(std::isnan(float(half(std::numeric_limits<float>::quiet_NaN()))));
  // Subnormal halfway case: 1.5 * 2^-24 rounds to 2 * 2^-24 (even).
  CHECK(half(1.5f * 5.9604645e-08f).bits == 0x0002);
  CHECK(half(2.9e-08f).bits == 0x0000);  // below half the smallest subnormal
}

TEST_CASE("half round trip is exact for every finite half") {
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    half h = half::from_bits(static_cast<std::uint16_t>(bits));
    float f = float(h);
    if (std::isnan(f)) continue;
    REQUIRE(half(f).bits == h.bits);
  }
}

TEST_CASE("bfloat16 keeps the float exponent and rounds the mantissa to nearest even") {
  CHECK(bfloat16(1.0f).bits == 0x3f80);
  CHECK(float(bfloat16(3.0e38f)) == Approx(3.0e38f).epsilon(0.01));
  CHECK(bfloat16(1.0f + std::ldexp(1.0f, -8)).bits == 0x3f80);      // tie -> even
  CHECK(bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)).bits == 0x3f82);  // tie -> even (up)
  CHECK(std::isnan(float(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    bfloat16 b = bfloat16::from_bits(static_cast<std::uint16_t>(bits));
    float f = float(b);
    if (std::isnan(f)) continue;
    REQUIRE(bfloat16(f).bits == b.bits);
  }
}

TEST_CASE("dtype_of maps C++ types to dtypes with the right sizes") {
  STATIC_REQUIRE(weft::dtype_of<float> == weft::dtype::float32);
  STATIC_REQUIRE(weft::dtype_of<const double> == weft::dtype::float64);
  STATIC_REQUIRE(weft::dtype_of<half> == weft::dtype::float16);
  STATIC_REQUIRE(weft::dtype_of<bfloat16> == weft::dtype::bfloat16);
  STATIC_REQUIRE(weft::dtype_of<std::int64_t> == weft::dtype::int64);
  STATIC_REQUIRE(!weft::element<char*>);
  CHECK(weft::size_of(weft::dtype::bfloat16) == 2);
  CHECK(weft::size_of(weft::dtype::int64) == 8);
  CHECK(weft::to_string(weft::dtype::float16) == "half");
}
