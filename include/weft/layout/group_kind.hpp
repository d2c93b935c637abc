#pragma once
/// \file
/// The kinds of process group a layout defines, their names, and the axes each one varies.

#include <weft/layout/dimension.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

namespace weft::layout {

/// A kind of process group. Dense (non-expert) layers use the first eleven; expert layers of a
/// mixture-of-experts model use the last five, which come from the expert grid (see rank_layout).
enum class group_kind : std::uint8_t {
  tp,                  ///< tensor parallel: splits each layer's matrices
  cp,                  ///< context parallel: splits the sequence
  dp,                  ///< data parallel: replicas that see different batches
  pp,                  ///< pipeline parallel: the stages of one model replica
  dp_cp,               ///< dp x cp: gradient reduction under context parallelism
  tp_cp,               ///< tp x cp
  tp_pp,               ///< model parallel: all ranks that hold one model replica (cp = 1)
  tp_dp,               ///< tp x dp
  tp_dp_cp,            ///< tp x dp x cp: all ranks of one pipeline stage
  embedding,           ///< first and last pipeline stage: tied input/output embedding gradients
  position_embedding,  ///< first pipeline stage: position embedding
  ep,                  ///< expert parallel: the experts of an MoE layer are spread over it
  expert_tp,           ///< tensor parallel inside an expert
  expert_dp,           ///< data parallel for expert weights
  expert_tp_ep,        ///< expert_tp x ep: the token dispatch (all-to-all) group
  expert_tp_ep_pp,     ///< expert_tp x ep x pp: expert model parallel
};

inline constexpr int group_kind_count = 16;

/// Every kind, in the order `process_groups` creates them (identical on every rank).
inline constexpr std::array<group_kind, group_kind_count> all_group_kinds{
    group_kind::tp,         group_kind::cp,           group_kind::dp,
    group_kind::pp,         group_kind::dp_cp,        group_kind::tp_cp,
    group_kind::tp_pp,      group_kind::tp_dp,        group_kind::tp_dp_cp,
    group_kind::embedding,  group_kind::position_embedding, group_kind::ep,
    group_kind::expert_tp,  group_kind::expert_dp,    group_kind::expert_tp_ep,
    group_kind::expert_tp_ep_pp};

/// The group's name, used in errors, traces and `weft-layout --json`: "tp", "dp-cp", "embedding", ...
constexpr std::string_view to_string(group_kind kind) noexcept {
  switch (kind) {
    case group_kind::tp: return "tp";
    case group_kind::cp: return "cp";
    case group_kind::dp: return "dp";
    case group_kind::pp: return "pp";
    case group_kind::dp_cp: return "dp-cp";
    case group_kind::tp_cp: return "tp-cp";
    case group_kind::tp_pp: return "tp-pp";
    case group_kind::tp_dp: return "tp-dp";
    case group_kind::tp_dp_cp: return "tp-dp-cp";
    case group_kind::embedding: return "embedding";
    case group_kind::position_embedding: return "position-embedding";
    case group_kind::ep: return "ep";
    case group_kind::expert_tp: return "expert-tp";
    case group_kind::expert_dp: return "expert-dp";
    case group_kind::expert_tp_ep: return "expert-tp-ep";
    case group_kind::expert_tp_ep_pp: return "expert-tp-ep-pp";
  }
  return "?";
}

/// The kind named `name`, or nothing.
constexpr std::optional<group_kind> parse_group_kind(std::string_view name) noexcept {
  for (group_kind kind : all_group_kinds) {
    if (to_string(kind) == name) return kind;
  }
  return std::nullopt;
}

/// Whether the kind's groups come from the expert grid (expert_tp x ep x expert_dp x pp).
constexpr bool is_expert(group_kind kind) noexcept {
  switch (kind) {
    case group_kind::ep:
    case group_kind::expert_tp:
    case group_kind::expert_dp:
    case group_kind::expert_tp_ep:
    case group_kind::expert_tp_ep_pp: return true;
    default: return false;
  }
}

/// Whether the kind is picked out of the pipeline groups rather than being a plain mask.
constexpr bool is_embedding(group_kind kind) noexcept {
  return kind == group_kind::embedding || kind == group_kind::position_embedding;
}

/// The axes the kind's groups vary over, on its grid (dense or expert). For the embedding kinds,
/// the pipeline axis they are picked from.
constexpr dim_set mask_of(group_kind kind) noexcept {
  switch (kind) {
    case group_kind::tp: return {dim::tp};
    case group_kind::cp: return {dim::cp};
    case group_kind::dp: return {dim::dp};
    case group_kind::pp: return {dim::pp};
    case group_kind::dp_cp: return {dim::dp, dim::cp};
    case group_kind::tp_cp: return {dim::tp, dim::cp};
    case group_kind::tp_pp: return {dim::tp, dim::pp};
    case group_kind::tp_dp: return {dim::tp, dim::dp};
    case group_kind::tp_dp_cp: return {dim::tp, dim::dp, dim::cp};
    case group_kind::embedding: return {dim::pp};
    case group_kind::position_embedding: return {dim::pp};
    // On the expert grid the tp axis has the expert-tp size and the dp axis the expert-dp size.
    case group_kind::ep: return {dim::ep};
    case group_kind::expert_tp: return {dim::tp};
    case group_kind::expert_dp: return {dim::dp};
    case group_kind::expert_tp_ep: return {dim::tp, dim::ep};
    case group_kind::expert_tp_ep_pp: return {dim::tp, dim::ep, dim::pp};
  }
  return {};
}

}  // namespace weft::layout
