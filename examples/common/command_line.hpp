#pragma once
// Command-line pieces shared by weft's programs (examples and benchmarks): not part of the library.

#include <cstddef>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>

namespace weft_programs {

/// A mistake on the command line: reported once, with the usage, by rank 0.
class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// "8", "64K", "256M", "1G" (powers of 1024) to bytes.
inline std::size_t parse_bytes(std::string_view flag, const std::string& text) {
  std::size_t used = 0;
  unsigned long long value = 0;
  try {
    if (text.empty() || text[0] == '-') throw std::invalid_argument("negative");
    value = std::stoull(text, &used);
  } catch (const std::exception&) {
    throw usage_error(std::string(flag) + " expects a byte count such as 8, 64K, 256M or 1G, not '" + text + "'");
  }
  std::string_view suffix = std::string_view(text).substr(used);
  unsigned shift = 0;
  if (suffix == "K" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "m") shift = 20;
  else if (suffix == "G" || suffix == "g") shift = 30;
  else if (!suffix.empty())
    throw usage_error(std::string(flag) + ": unknown size suffix '" + std::string(suffix) + "' in '" + text +
                      "' (use K, M or G)");
  if (value > (std::numeric_limits<std::size_t>::max() >> shift))
    throw usage_error(std::string(flag) + ": '" + text + "' is too large");
  return static_cast<std::size_t>(value) << shift;
}

}  // namespace weft_programs
