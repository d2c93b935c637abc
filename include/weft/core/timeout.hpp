#pragma once
/// \file
/// The deadline every collective and p2p operation runs under. A peer that is alive but never
/// joins (stopped, stuck in its own code, waiting in a different collective) would otherwise
/// keep the other ranks waiting forever; with a deadline they fail with a message instead. The
/// default is 10 minutes, as PyTorch's process groups: long enough for a slow first step or a
/// checkpoint on another rank, short enough that a hung job does not burn a cluster for hours.

#include <chrono>
#include <cstdlib>
#include <string>

#include <weft/core/error.hpp>

namespace weft {

/// The default deadline of a communication operation.
inline constexpr std::chrono::milliseconds default_comm_timeout{std::chrono::minutes(10)};

/// Parses a deadline given in seconds (e.g. "600", "2.5"); "0" means no deadline (returned as 0 ms).
/// `source` names where the text came from, for the error message.
inline std::chrono::milliseconds parse_comm_timeout(const std::string& text, const std::string& source) {
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  if (text.empty() || end == text.c_str() || *end != '\0' || !(seconds >= 0.0) || seconds > 1e9)
    throw error("weft: " + source + "='" + text +
                "' is not a number of seconds; give e.g. 600 (10 minutes, the default), or 0 to wait without a "
                "deadline");
  // Deadlines are kept in whole milliseconds: a positive one below 1 ms would become 0, "no
  // deadline", the opposite of what was asked.
  if (seconds > 0.0 && seconds < 0.001)
    throw error("weft: " + source + "='" + text +
                "' is below 1 ms, the deadline's resolution; give at least 0.001 (seconds), or 0 to wait without a "
                "deadline");
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
}

/// The deadline from WEFT_COMM_TIMEOUT (seconds; 0: none), or the default of 10 minutes when unset.
inline std::chrono::milliseconds comm_timeout_from_environment() {
  const char* value = std::getenv("WEFT_COMM_TIMEOUT");
  if (value == nullptr || *value == '\0') return default_comm_timeout;
  return parse_comm_timeout(value, "WEFT_COMM_TIMEOUT");
}

}  // namespace weft
