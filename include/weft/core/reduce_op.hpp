#pragma once
/// \file
/// Reduction operators understood by every backend.

#include <string_view>

namespace weft {

/// `avg` is the sum divided by the number of ranks (integer division for integer types).
enum class reduce_op { sum, prod, min, max, avg };

constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::prod: return "prod";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::avg: return "avg";
  }
  return "?";
}

}  // namespace weft
