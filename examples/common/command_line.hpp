#pragma once
// Command-line pieces shared by weft's programs (examples and benchmarks): not part of the library.

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

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

/// The edit distance from `a` to `b`, ignoring case: insertions, deletions, substitutions and
/// swaps of two neighbouring characters count one each ("--explian" is one from "--explain").
inline std::size_t spelling_distance(std::string_view a, std::string_view b) {
  auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
  const std::size_t n = a.size(), m = b.size();
  // Three rows of the table: two back (for swaps), one back and the current one.
  std::vector<std::size_t> before(m + 1), previous(m + 1), current(m + 1);
  for (std::size_t j = 0; j <= m; ++j) previous[j] = j;
  for (std::size_t i = 1; i <= n; ++i) {
    current[0] = i;
    for (std::size_t j = 1; j <= m; ++j) {
      const bool same = lower(a[i - 1]) == lower(b[j - 1]);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) && lower(a[i - 2]) == lower(b[j - 1]))
        current[j] = std::min(current[j], before[j - 2] + 1);
    }
    std::swap(before, previous);
    std::swap(previous, current);
  }
  return previous[m];
}

/// The one of `choices` that `text` most likely misspells, if one is close: the same word in
/// another case ("1F1B" for "1f1b"), the only choice that `text` begins ("--micro" for
/// "--micro-batch"), or the only choice nearest by spelling_distance, at most one edit per three
/// characters (at least one; leading dashes not counted). Nothing when two choices are as close.
inline std::optional<std::string_view> nearest_spelling(std::string_view text, std::span<const std::string_view> choices) {
  std::string_view core = text;
  while (core.starts_with('-')) core.remove_prefix(1);
  if (core.empty() || text.size() > 200) return std::nullopt;  // no word, or no word anyone meant
  std::optional<std::string_view> best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  bool tied = false;
  for (std::string_view choice : choices) {
    const std::size_t distance = spelling_distance(text, choice);
    if (distance < best_distance) best = choice, best_distance = distance, tied = false;
    else if (distance == best_distance && choice != *best) tied = true;
  }
  if (best && best_distance == 0) return best;
  if (core.size() >= 3) {
    std::optional<std::string_view> extended;
    int extensions = 0;
    for (std::string_view choice : choices)
      if (choice.size() > text.size() && choice.starts_with(text) && (!extended || choice != *extended))
        extended = choice, ++extensions;
    if (extensions == 1) return extended;
  }
  if (!best || tied || best_distance > std::max<std::size_t>(1, core.size() / 3)) return std::nullopt;
  return best;
}

/// "; did you mean 'X'?" for the nearest_spelling of `text` among `choices`, or "".
inline std::string did_you_mean(std::string_view text, std::span<const std::string_view> choices) {
  const std::optional<std::string_view> nearest = nearest_spelling(text, choices);
  return nearest ? "; did you mean '" + std::string(*nearest) + "'?" : std::string();
}

/// The words of a list written for people, "a, b or c" or "a|b|c", for did_you_mean.
inline std::vector<std::string_view> listed_words(std::string_view list) {
  std::vector<std::string_view> words;
  auto separator = [](char c) { return c == ',' || c == '|' || c == ' ' || c == '\n'; };
  std::size_t i = 0;
  while (i < list.size()) {
    while (i < list.size() && separator(list[i])) ++i;
    std::size_t end = i;
    while (end < list.size() && !separator(list[end])) ++end;
    if (end > i && list.substr(i, end - i) != "or" && list.substr(i, end - i) != "and") words.push_back(list.substr(i, end - i));
    i = end;
  }
  return words;
}

/// The options a usage text names: every "--word" in it, each once, in order.
inline std::vector<std::string_view> options_in_usage(std::string_view usage) {
  std::vector<std::string_view> options;
  for (std::size_t at = usage.find("--"); at != std::string_view::npos; at = usage.find("--", at + 2)) {
    if (at > 0 && usage[at - 1] != ' ' && usage[at - 1] != '[' && usage[at - 1] != '(' && usage[at - 1] != '\n' &&
        usage[at - 1] != '|')
      continue;
    std::size_t end = at + 2;
    while (end < usage.size() && ((usage[end] >= 'a' && usage[end] <= 'z') || (usage[end] >= '0' && usage[end] <= '9') ||
                                  usage[end] == '-'))
      ++end;
    const std::string_view option = usage.substr(at, end - at);
    if (option.size() > 2 && std::find(options.begin(), options.end(), option) == options.end()) options.push_back(option);
  }
  return options;
}

/// Walks a command line's options, each `--name value` or `--name=value`: next() moves to the
/// next argument, name() is it without an `=value`, value() takes its value (after `=`, else the
/// following argument; a missing one is a usage_error naming the option).
class option_walker {
 public:
  option_walker(int argc, char** argv) : argc_(argc), argv_(argv) {}

  bool next() {
    if (++index_ >= argc_) return false;
    name_ = argv_[index_];
    inline_value_.reset();
    if (auto eq = name_.find('='); name_.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value_ = name_.substr(eq + 1);
      name_.resize(eq);
    }
    return true;
  }
  const std::string& name() const noexcept { return name_; }
  std::string value() {
    if (inline_value_) return *inline_value_;
    if (index_ + 1 >= argc_) throw usage_error("option '" + name_ + "' needs a value");
    return argv_[++index_];
  }

 private:
  int argc_;
  char** argv_;
  int index_ = 0;
  std::string name_;
  std::optional<std::string> inline_value_;
};

/// The mistake of an option `usage` does not name, with the nearest one it does.
inline usage_error unknown_option(std::string_view option, std::string_view usage) {
  return usage_error("unknown option '" + std::string(option) + "'" + did_you_mean(option, options_in_usage(usage)));
}

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
/// @returns what `body(rank)` returns, or `usage_status` after a usage_error or an input_error.
template <class Body>
int mpi_main(std::string_view program, std::string_view usage, int& argc, char**& argv, Body&& body,
             int abort_status = 2, int usage_status = 1) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string name(program);
  int status = usage_status;
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
