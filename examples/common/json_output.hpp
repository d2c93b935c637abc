#pragma once
// JSON results files of weft's programs: not part of the library.

#include <fstream>
#include <ios>
#include <limits>
#include <stdexcept>
#include <string>

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

}  // namespace weft_programs
