#pragma once
/// \file
/// The element types weft moves and reduces, and the compile-time map from C++ types to them.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include <weft/core/float16.hpp>

namespace weft {

enum class dtype { float32, float64, float16, bfloat16, int32, int64, uint8 };

constexpr std::size_t size_of(dtype type) noexcept {
  switch (type) {
    case dtype::float32: return 4;
    case dtype::float64: return 8;
    case dtype::float16: return 2;
    case dtype::bfloat16: return 2;
    case dtype::int32: return 4;
    case dtype::int64: return 8;
    case dtype::uint8: return 1;
  }
  return 0;
}

constexpr std::string_view to_string(dtype type) noexcept {
  switch (type) {
    case dtype::float32: return "float";
    case dtype::float64: return "double";
    case dtype::float16: return "half";
    case dtype::bfloat16: return "bfloat16";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
    case dtype::uint8: return "uint8";
  }
  return "?";
}

constexpr bool is_floating(dtype type) noexcept {
  return type == dtype::float32 || type == dtype::float64 || type == dtype::float16 || type == dtype::bfloat16;
}

namespace detail {
template <class T> struct dtype_of_impl {};
template <> struct dtype_of_impl<float> : std::integral_constant<dtype, dtype::float32> {};
template <> struct dtype_of_impl<double> : std::integral_constant<dtype, dtype::float64> {};
template <> struct dtype_of_impl<half> : std::integral_constant<dtype, dtype::float16> {};
template <> struct dtype_of_impl<bfloat16> : std::integral_constant<dtype, dtype::bfloat16> {};
template <> struct dtype_of_impl<std::int32_t> : std::integral_constant<dtype, dtype::int32> {};
template <> struct dtype_of_impl<std::int64_t> : std::integral_constant<dtype, dtype::int64> {};
template <> struct dtype_of_impl<std::uint8_t> : std::integral_constant<dtype, dtype::uint8> {};
}  // namespace detail

/// A type weft can send and reduce: float, double, weft::half, weft::bfloat16, int32, int64, uint8.
template <class T>
concept element = requires { detail::dtype_of_impl<std::remove_cv_t<T>>::value; };

namespace detail {
/// True for an element type; any other type stops the build with this message (a failed concept
/// alone would end in "dtype_of_impl<...>::value is invalid" after dozens of lines). For the
/// buffer concepts, which only ask it of contiguous sized ranges, so overloads stay usable.
template <class T>
consteval bool explain_element() {
  static_assert(element<T>,
                "weft: buffers must hold one of weft's element types: float, double, weft::half, weft::bfloat16, "
                "std::int32_t, std::int64_t or std::uint8_t; copy other data into a buffer of one of these "
                "(e.g. bytes into std::vector<std::uint8_t>)");
  return true;
}
}  // namespace detail

/// The dtype of an element type.
template <element T>
inline constexpr dtype dtype_of = detail::dtype_of_impl<std::remove_cv_t<T>>::value;

}  // namespace weft
