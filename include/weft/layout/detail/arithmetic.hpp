#pragma once
/// \file
/// Small integer arithmetic for layout validation: products that cannot overflow, divisor lists.

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace weft::layout::detail {

/// a * b, or the largest int64 if that overflows (degrees come from users and may be absurd).
constexpr std::int64_t saturating_product(std::int64_t a, std::int64_t b) noexcept {
  constexpr std::int64_t max = std::numeric_limits<std::int64_t>::max();
  if (a != 0 && b > max / a) return max;
  return a * b;
}

/// The divisors of n (n >= 1), ascending.
inline std::vector<std::int64_t> divisors(std::int64_t n) {
  std::vector<std::int64_t> low;
  std::vector<std::int64_t> high;
  for (std::int64_t d = 1; d * d <= n; ++d) {
    if (n % d != 0) continue;
    low.push_back(d);
    if (d != n / d) high.push_back(n / d);
  }
  low.insert(low.end(), high.rbegin(), high.rend());
  return low;
}

/// "{1, 2, 4}", shortened in the middle when long.
inline std::string brace_list(const std::vector<std::int64_t>& values) {
  std::string text = "{";
  const std::size_t n = values.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (n > 12 && i == 6) {
      text += ", ...";
      i = n - 4;
    }
    if (i != 0) text += ", ";
    text += std::to_string(values[i]);
  }
  return text + "}";
}

}  // namespace weft::layout::detail
