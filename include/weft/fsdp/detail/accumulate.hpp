#pragma once
/// \file
/// Adding a reduced gradient shard, on the wire in one type, into an accumulator of another (the
/// master type), without a temporary: the "fp32 accumulation" of mixed-precision reduction.

#include <cstddef>
#include <span>

#include <weft/grad/detail/convert.hpp>

namespace weft::fsdp::detail {

/// into[i] += from[i], converted to the accumulator's type.
template <class Acc, class From>
void add_converted(std::span<const From> from, std::span<Acc> into) noexcept {
  for (std::size_t i = 0; i < from.size(); ++i) into[i] += grad::detail::convert<Acc>(from[i]);
}

}  // namespace weft::fsdp::detail
