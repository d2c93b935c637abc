#pragma once
/// \file
/// What the flight recorder calls the operations it records and the states they pass through,
/// with the names used in dumps (and read back by weft-trace-diff).

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace weft::trace {

/// Every operation a communicator issues; `split` and `dup` make a communicator (collective over
/// the parent, and held to its deadline like the others).
enum class operation : std::uint8_t {
  all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all, barrier, send, recv, p2p_batch, split, dup,
  all_to_allv  ///< ragged blocks (MoE token dispatch); last, so that earlier operations keep their numbers
};

/// issued -> started -> completed or failed. `untracked`: an async operation of a backend that
/// does not report completion to the recorder (no deadline applies to it).
enum class op_state : std::uint8_t { issued, started, completed, failed, untracked };

inline constexpr std::array<std::string_view, 13> operation_names = {
    "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all",
    "barrier",    "send",   "recv",      "p2p_batch",  "split",          "dup", "all_to_allv"};
inline constexpr std::array<std::string_view, 5> op_state_names = {"issued", "started", "completed", "failed",
                                                                   "untracked"};

constexpr std::string_view to_string(operation op) noexcept {
  const auto index = static_cast<std::size_t>(op);
  return index < operation_names.size() ? operation_names[index] : "?";
}
constexpr std::string_view to_string(op_state state) noexcept {
  const auto index = static_cast<std::size_t>(state);
  return index < op_state_names.size() ? op_state_names[index] : "?";
}

/// Collectives involve every rank of the group in the same order; point-to-point does not.
constexpr bool is_collective(operation op) noexcept {
  return op != operation::send && op != operation::recv && op != operation::p2p_batch;
}
constexpr bool finished(op_state state) noexcept {
  return state == op_state::completed || state == op_state::failed || state == op_state::untracked;
}

inline std::optional<operation> operation_from_name(std::string_view name) noexcept {
  for (std::size_t i = 0; i < operation_names.size(); ++i)
    if (operation_names[i] == name) return static_cast<operation>(i);
  return std::nullopt;
}
inline std::optional<op_state> op_state_from_name(std::string_view name) noexcept {
  for (std::size_t i = 0; i < op_state_names.size(); ++i)
    if (op_state_names[i] == name) return static_cast<op_state>(i);
  return std::nullopt;
}

}  // namespace weft::trace
