#pragma once
// Command-line and timing bits shared by the gradient benchmarks.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "command_line.hpp"

namespace weft_bench {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The largest of every rank's value (a step is as slow as its slowest rank).
inline double max_over_ranks(double local, MPI_Comm comm) {
  double out = 0;
  MPI_Allreduce(&local, &out, 1, MPI_DOUBLE, MPI_MAX, comm);
  return out;
}

/// Throws weft_programs::usage_error unless every argument is one of `with_value` followed by its
/// value, or one of `switches`: a misspelt option would otherwise be ignored, its default used.
inline void check_arguments(int argc, char** argv, std::initializer_list<std::string_view> with_value,
                            std::initializer_list<std::string_view> switches) {
  auto listed = [](std::initializer_list<std::string_view> names, std::string_view arg) {
    return std::find(names.begin(), names.end(), arg) != names.end();
  };
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (listed(switches, arg)) continue;
    if (!listed(with_value, arg)) throw weft_programs::usage_error("unknown option '" + std::string(arg) + "'");
    if (++i >= argc) throw weft_programs::usage_error("option '" + std::string(arg) + "' needs a value");
  }
}

/// The value after `--name`, or `fallback` when absent (check_arguments first).
inline std::string option(int argc, char** argv, std::string_view name, std::string fallback = {}) {
  for (int i = 1; i + 1 < argc; ++i)
    if (name == argv[i]) return argv[i + 1];
  return fallback;
}
inline bool flag(int argc, char** argv, std::string_view name) {
  for (int i = 1; i < argc; ++i)
    if (name == argv[i]) return true;
  return false;
}

/// The number after `"key":` in a small JSON text, or a negative value when absent or null.
inline double json_number(const std::string& text, const std::string& key) {
  std::size_t at = text.find("\"" + key + "\"");
  if (at == std::string::npos) return -1;
  at = text.find(':', at);
  if (at == std::string::npos) return -1;
  const char* start = text.c_str() + at + 1;
  char* end = nullptr;
  double value = std::strtod(start, &end);
  return end == start ? -1 : value;
}

/// The numbers of the array after `"key":` in a small JSON text.
inline std::vector<double> json_numbers(const std::string& text, const std::string& key) {
  std::vector<double> out;
  std::size_t at = text.find("\"" + key + "\"");
  if (at == std::string::npos) return out;
  at = text.find('[', at);
  std::size_t end = text.find(']', at);
  if (at == std::string::npos || end == std::string::npos) return out;
  const char* p = text.c_str() + at + 1;
  const char* stop = text.c_str() + end;
  while (p < stop) {
    char* next = nullptr;
    double value = std::strtod(p, &next);
    if (next == p) {
      ++p;
      continue;
    }
    out.push_back(value);
    p = next;
  }
  return out;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// "null" for a negative value (absent), otherwise the number.
inline std::string json_value(double v) {
  if (v < 0) return "null";
  char text[64];
  std::snprintf(text, sizeof(text), "%.6f", v);
  return text;
}

}  // namespace weft_bench
