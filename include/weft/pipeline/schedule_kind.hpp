#pragma once
/// \file
/// The pipeline schedules weft plans, as a runtime value (for command lines and configuration
/// files) and as tag types (for code that fixes its schedule at compile time). Both spell the
/// same four names, so there is one vocabulary.

#include <array>
#include <concepts>
#include <optional>
#include <string>
#include <string_view>

namespace weft::pipeline {

/// Which schedule orders the forward and backward passes of the micro-batches.
enum class schedule_kind {
  gpipe,        ///< every forward, then every backward (Huang et al., 2019)
  one_f_one_b,  ///< warm-up forwards, then one forward / one backward (PipeDream-Flush, Megatron-LM)
  interleaved,  ///< 1F1B over v model chunks per rank (Narayanan et al., 2021)
  zb_h1,        ///< 1F1B with the backward split into input and weight gradients (Qi et al., 2024)
};

inline constexpr std::array<schedule_kind, 4> all_schedule_kinds{schedule_kind::gpipe, schedule_kind::one_f_one_b,
                                                                 schedule_kind::interleaved, schedule_kind::zb_h1};

/// The name used on command lines and in JSON: "gpipe", "1f1b", "interleaved", "zb-h1".
constexpr std::string_view to_string(schedule_kind kind) noexcept {
  switch (kind) {
    case schedule_kind::gpipe: return "gpipe";
    case schedule_kind::one_f_one_b: return "1f1b";
    case schedule_kind::interleaved: return "interleaved";
    case schedule_kind::zb_h1: return "zb-h1";
  }
  return "?";
}

/// The kind named `name` (as `to_string` spells it), or nothing.
constexpr std::optional<schedule_kind> parse_schedule_kind(std::string_view name) noexcept {
  for (schedule_kind kind : all_schedule_kinds) {
    if (to_string(kind) == name) return kind;
  }
  return std::nullopt;
}

/// "gpipe, 1f1b, interleaved, zb-h1": for messages that list the valid names.
inline std::string schedule_kind_names() {
  std::string names;
  for (schedule_kind kind : all_schedule_kinds) {
    if (!names.empty()) names += ", ";
    names += to_string(kind);
  }
  return names;
}

/// Tag types, one per schedule. `interleaved<V>` carries its number of model chunks per rank.
struct gpipe {
  static constexpr schedule_kind kind = schedule_kind::gpipe;
  static constexpr int virtual_stages = 1;
};
struct one_f_one_b {
  static constexpr schedule_kind kind = schedule_kind::one_f_one_b;
  static constexpr int virtual_stages = 1;
};
template <int V>
  requires(V >= 2)
struct interleaved {
  static constexpr schedule_kind kind = schedule_kind::interleaved;
  static constexpr int virtual_stages = V;
};
struct zb_h1 {
  static constexpr schedule_kind kind = schedule_kind::zb_h1;
  static constexpr int virtual_stages = 1;
};

/// A schedule tag: one of the types above.
template <class T>
concept schedule_tag = requires {
  { T::kind } -> std::convertible_to<schedule_kind>;
  { T::virtual_stages } -> std::convertible_to<int>;
};

}  // namespace weft::pipeline
