#pragma once
// Command-line pieces shared by weft's programs (examples and benchmarks): not part of the library.

#include <charconv>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>

#include <weft/core/timeout.hpp>

// Only the programs built with MPI find <mpi.h>; mpi_main (below) is for them alone.
#if __has_include(<mpi.h>)
#include <mpi.h>
#endif

namespace weft_programs {

/// A mistake on the command line: reported once, with the usage, by rank 0.
class usage_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A mistake in what the command line points to (a file, a shape that does not fit the ranks)
/// that every rank finds alike: reported once, by rank 0, without the usage.
class input_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class T>
std::string number_text(T value) {
  char text[48];
  const auto done = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, done.ptr);
}

}  // namespace detail

/// `text`, the value of option `flag`, as an integer from `low` to `high` (both included).
/// The whole text must be the number: "12abc", " 12" and "" are mistakes, not 12.
/// @throws usage_error naming the flag, the range and the text.
template <std::integral T>
T parse_integer(std::string_view flag, std::string_view text, T low, T high) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [stop, problem] = std::from_chars(text.data(), end, value);
  if (text.empty() || problem != std::errc{} || stop != end || value < low || value > high)
    throw usage_error(std::string(flag) + " expects an integer from " + detail::number_text(low) + " to " +
                      detail::number_text(high) + ", not '" + std::string(text) + "'");
  return value;
}

/// A suffix that multiplies the number it ends: {"K", 1e3} reads "4K" as 4000.
struct unit_suffix {
  std::string_view name;
  double scale;
};

/// `text`, the value of option `flag`, as a finite number from `low` to `high` (both included),
/// optionally ended by one of `units` (the bounds apply to the scaled value). The whole text must
/// be the number: "2.5x", "inf" and "" are mistakes.
/// @throws usage_error naming the flag, the range (a bound at the type's limit is left unsaid),
/// the suffixes allowed and the text.
inline double parse_real(std::string_view flag, std::string_view text, double low, double high,
                         std::span<const unit_suffix> units = {}) {
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, problem] = std::from_chars(text.data(), end, value);
  bool read = !text.empty() && problem == std::errc{};
  if (read && stop != end) {
    read = false;
    for (const unit_suffix& unit : units) {
      if (std::string_view(stop, static_cast<std::size_t>(end - stop)) == unit.name) {
        value *= unit.scale;
        read = true;
        break;
      }
    }
  }
  if (!read || !std::isfinite(value) || value < low || value > high) {
    using limits = std::numeric_limits<double>;
    // Appended piece by piece: g++ 12 warns falsely (-Wrestrict) on "text" + std::string here.
    std::string message(flag);
    message += " expects a number";
    if (low > limits::lowest() && high < limits::max())
      message.append(" from ").append(detail::number_text(low)).append(" to ").append(detail::number_text(high));
    else if (low > limits::lowest())
      message.append(" of at least ").append(detail::number_text(low));
    else if (high < limits::max())
      message.append(" of at most ").append(detail::number_text(high));
    if (!units.empty()) {
      message += " (suffixes:";
      for (const unit_suffix& unit : units) message.append(" ").append(unit.name);
      message += ")";
    }
    message.append(", not '").append(text).append("'");
    throw usage_error(message);
  }
  return value;
}

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

/// The value of `--comm-timeout` (seconds; 0: no deadline) as a deadline for every
/// communication operation; it overrides WEFT_COMM_TIMEOUT.
/// @throws usage_error naming the flag and the text.
inline std::chrono::milliseconds parse_comm_timeout_flag(std::string_view flag, const std::string& text) {
  try {
    return weft::parse_comm_timeout(text, std::string(flag));
  } catch (const std::exception& e) {
    throw usage_error(e.what());
  }
}

#if __has_include(<mpi.h>)

/// The whole of a program that runs on every rank of an MPI job: MPI up (it may take its own
/// arguments out of `argc` and `argv`), `body(rank)`, MPI down, with mistakes reported the same
/// way in every such program. Every rank reads the same command line, so every rank throws a
/// usage_error alike, before any collective call that could leave another waiting: rank 0 prints
/// it with `usage` and each rank exits with 1. Any other exception is printed with its rank and
/// ends in MPI_Abort with `abort_status`: the other ranks could otherwise wait for this one forever.
/// @returns what `body(rank)` returns, or 1 after a usage_error.
template <class Body>
int mpi_main(std::string_view program, std::string_view usage, int& argc, char**& argv, Body&& body,
             int abort_status = 2) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string name(program);
  int status = 1;
  try {
    status = body(rank);
  } catch (const usage_error& e) {
    if (rank == 0) std::fprintf(stderr, "%s: %s\n%s", name.c_str(), e.what(), std::string(usage).c_str());
  } catch (const input_error& e) {
    if (rank == 0) std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: rank %d: %s\n", name.c_str(), rank, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, abort_status);
  }
  MPI_Finalize();
  return status;
}

#endif

}  // namespace weft_programs
