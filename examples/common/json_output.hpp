#pragma once
// JSON output of weft's programs (results files, --json on stdout): not part of the library.

#include <cstdio>
#include <fstream>
#include <ios>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace weft_programs {

/// Opens `path` for a program's JSON results. Numbers are written with enough digits to read back
/// the same double (a checker comparing derived fields, e.g. Gb/s with 8 x GB/s, would otherwise
/// see rounding to the stream's default 6 significant digits as a wrong result).
inline std::ofstream open_json_output(const std::string& path) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot open '" + path + "' for the JSON results");
  out.precision(std::numeric_limits<double>::max_digits10);
  return out;
}

/// `text` as a JSON string literal: quoted, with quotes, backslashes and control characters escaped.
inline std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (byte < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(byte));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

/// `items` as a JSON array of strings.
inline std::string json_strings(const std::vector<std::string>& items) {
  std::string out = "[";
  for (std::size_t i = 0; i < items.size(); ++i) out += (i != 0 ? ", " : "") + json_string(items[i]);
  return out + "]";
}

}  // namespace weft_programs
