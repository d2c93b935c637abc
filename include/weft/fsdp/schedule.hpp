#pragma once
/// \file
/// The log of a sharded model's communication, in the order the caller issued and waited for it:
/// which unit's parameters were gathered or freed, which unit's gradients were reduced, in which
/// pass. Tests read it to check the prefetch order; a trainer can print it to see what it asked for.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace weft::fsdp {

enum class schedule_kind {
  gather_issued,   ///< the unit's all-gather was issued
  gather_waited,   ///< the unit's all-gather was waited for (its scope begins now)
  params_freed,    ///< the unit's gathered parameters were freed
  reduce_issued,   ///< the unit's reduce-scatter was issued
  reduce_done,     ///< the unit's reduced shard was added into the gradient shard
};

constexpr std::string_view to_string(schedule_kind kind) noexcept {
  switch (kind) {
    case schedule_kind::gather_issued: return "gather_issued";
    case schedule_kind::gather_waited: return "gather_waited";
    case schedule_kind::params_freed: return "params_freed";
    case schedule_kind::reduce_issued: return "reduce_issued";
    case schedule_kind::reduce_done: return "reduce_done";
  }
  return "?";
}

/// Which pass an event happened in.
enum class pass { forward, backward, between };

constexpr std::string_view to_string(pass p) noexcept {
  return p == pass::forward ? "forward" : p == pass::backward ? "backward" : "between";
}

struct schedule_event {
  schedule_kind kind{};
  std::size_t unit = 0;
  pass during = pass::between;
  int micro_step = 0;
};

/// One line per event ("forward gather_issued 3").
inline std::string describe(const std::vector<schedule_event>& events) {
  std::string out;
  for (const schedule_event& e : events)
    out += std::string(to_string(e.during)) + " " + std::string(to_string(e.kind)) + " " + std::to_string(e.unit) +
           " (micro-step " + std::to_string(e.micro_step) + ")\n";
  return out;
}

}  // namespace weft::fsdp
