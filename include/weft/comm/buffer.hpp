#pragma once
/// \file
/// What weft accepts as a buffer: any contiguous, sized range of an element type
/// (std::span, std::vector, std::array, C arrays, ...).

#include <cstddef>
#include <ranges>
#include <type_traits>

#include <weft/core/dtype.hpp>

namespace weft {

/// A contiguous, sized range of weft elements (read-only use). A contiguous sized range of any
/// other type stops the build with a message listing the element types.
template <class R>
concept buffer = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
                 detail::explain_element<std::ranges::range_value_t<R>>();

/// A buffer whose elements can be written.
template <class R>
concept mutable_buffer = buffer<R> && std::is_lvalue_reference_v<std::ranges::range_reference_t<R>> &&
                         !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>;

/// The element type of a buffer.
template <buffer R>
using buffer_element_t = std::remove_cv_t<std::ranges::range_value_t<R>>;

}  // namespace weft
