#pragma once
// Whole tensors from a sharded run and back: what train_gpt writes to and reads from
// safetensors files, whatever the layout.
//
// Saving: every rank writes the elements it owns into a zeroed copy of the whole model (one
// rank owns each element: dp rank 0 and cp rank 0, tp rank 0 for what tp replicates, the first
// stage for the tied embedding, expert-dp rank 0 of the ep rank that holds an MoE expert; for
// ZeRO-1 state, the rank whose shard holds it), and
// one sum-reduction to world rank 0 assembles the whole tensors there. Loading: every rank reads
// the file and cuts out its own part. (Distributed checkpoints, --save-dir, gather nothing: each
// rank's part is described as boxes of the whole tensors, whole_boxes, and the box helpers below
// move the values between a rank's memory and a box.)

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <span>
#include <string>
#include <vector>

#include <weft/checkpoint/safetensors.hpp>
#include <weft/comm/communicator.hpp>

#include "command_line.hpp"
#include "gpt_config.hpp"
#include "parameters.hpp"

namespace train_gpt {

/// A run of one parameter's local elements held in some state array (parameters, gradients,
/// AdamW moments): local elements [param_offset, param_offset + count) of parameter `param` are
/// at state[state_offset ...].
struct state_segment {
  std::size_t param = 0;
  std::size_t param_offset = 0;
  std::size_t count = 0;
  std::size_t state_offset = 0;
};

/// Where each whole tensor starts in the concatenation of all whole tensors (checkpoint order).
struct whole_index {
  std::vector<param_spec> tensors;
  std::map<std::string, std::size_t> offset;
  std::size_t total = 0;

  explicit whole_index(const gpt_config& m) : tensors(whole_parameters(m)) {
    for (const param_spec& t : tensors) {
      offset[t.name] = total;
      total += static_cast<std::size_t>(elements_of(t.whole));
    }
  }
};

/// Which of this rank's elements it contributes to a gathered whole copy.
struct ownership {
  int tp_rank = 0, tp = 1;
  bool data_leader = false;  // dp rank 0 and cp rank 0: the one copy of state every dp-cp rank holds whole
  /// expert-dp rank 0 and expert-tp rank 0: the one copy of the experts that the ranks of an
  /// expert-dp group hold (each MoE expert is held by its ep rank alone)
  bool expert_leader = false;
  int expert_tp_rank = 0;

  /// `sharded`: the state is split over the group that reduces it (ZeRO-1: dp-cp, or expert-dp
  /// for the experts), so each rank owns its shard.
  bool owns(const param_spec& p, bool sharded) const {
    if (p.expert >= 0) return expert_tp_rank == 0 && (sharded || expert_leader);
    if (p.split == tp_split::replicated && tp_rank != 0) return false;
    return sharded || data_leader;
  }
};

/// Assembles whole tensors on world rank 0 from every rank's local state (collective over
/// `world`): returns the concatenation (checkpoint order) on rank 0, an empty vector elsewhere.
/// `skip[i]` leaves parameter i out (the last stage's copy of the tied embedding).
template <weft::backend B>
std::vector<float> gather_whole(weft::communicator<B>& world, const whole_index& index,
                                std::span<const param_spec> specs, std::span<const state_segment> segments,
                                std::span<const float> state, const ownership& own, bool sharded_over_dp,
                                const std::vector<bool>& skip) {
  std::vector<float> whole(index.total, 0.0f);
  std::vector<float> local;
  for (const state_segment& s : segments) {
    const param_spec& p = specs[s.param];
    if (skip[s.param] || !own.owns(p, sharded_over_dp)) continue;
    local.assign(p.local_elements, 0.0f);
    std::copy_n(state.data() + s.state_offset, s.count, local.data() + s.param_offset);
    const std::size_t at = index.offset.at(p.name);
    std::span<float> target(whole.data() + at, static_cast<std::size_t>(elements_of(p.whole)));
    // Only this segment's elements: copy run by run where they fall in [param_offset, +count).
    for_each_local_run(p, own.tp_rank, own.tp, [&](std::size_t w, std::size_t l, std::size_t n) {
      const std::size_t lo = std::max(l, s.param_offset), hi = std::min(l + n, s.param_offset + s.count);
      for (std::size_t i = lo; i < hi; ++i) target[w + (i - l)] = local[i];
    });
  }
  world.reduce(std::span<float>(whole), 0);
  if (world.rank() != 0) whole.clear();
  return whole;
}

/// Fills this rank's local state from whole tensors (`lookup(name)` gives a whole tensor's
/// values, checked against its shape by the caller).
template <class Lookup>
void scatter_whole(std::span<const param_spec> specs, std::span<const state_segment> segments, std::span<float> state,
                   int tp_rank, int tp, Lookup&& lookup) {
  std::vector<float> local;
  for (const state_segment& s : segments) {
    const param_spec& p = specs[s.param];
    std::span<const float> whole = lookup(p.name);
    local.assign(p.local_elements, 0.0f);
    cut_local(p, tp_rank, tp, whole, local);
    std::copy_n(local.data() + s.param_offset, s.count, state.data() + s.state_offset);
  }
}

/// Calls `run(flat, packed, count)` for each run of consecutive elements of `box` in a tensor of
/// `shape`: elements [flat, flat + count) of the tensor (row-major) are elements
/// [packed, packed + count) of the box (row-major within the box).
template <class Run>
void for_each_box_run(std::span<const std::int64_t> shape, const weft::checkpoint::region& box, Run&& run) {
  const std::size_t dims = shape.size();
  const std::int64_t count = weft::checkpoint::element_count(box);
  if (count == 0) return;
  if (dims == 0) return run(std::int64_t{0}, std::int64_t{0}, std::int64_t{1});
  const std::int64_t length = box.extent[dims - 1];
  for (std::int64_t packed = 0; packed < count; packed += length) {
    std::int64_t rest = packed / length, flat = box.offset[dims - 1], stride = shape[dims - 1];
    for (std::size_t d = dims - 1; d-- > 0;) {
      flat += (box.offset[d] + rest % box.extent[d]) * stride;
      rest /= box.extent[d];
      stride *= shape[d];
    }
    run(flat, packed, length);
  }
}

/// Where `box` of a tensor of `shape` starts in its row-major elements, if its elements are
/// consecutive there (then a span of them is the box's values); nothing otherwise.
inline std::optional<std::int64_t> contiguous_start(std::span<const std::int64_t> shape, const weft::checkpoint::region& box) {
  std::optional<std::int64_t> start;
  std::int64_t runs = 0;
  for_each_box_run(shape, box, [&](std::int64_t flat, std::int64_t packed, std::int64_t) {
    if (!start) start = flat;
    else if (flat != *start + packed) ++runs;
  });
  if (runs > 0) return std::nullopt;
  return start.value_or(0);
}

/// The safetensors records of whole tensors (checkpoint order), with `prefix` before each name.
inline std::vector<weft::checkpoint::tensor_record> whole_records(const whole_index& index, std::span<const float> whole,
                                                                  const std::string& prefix = "") {
  std::vector<weft::checkpoint::tensor_record> out;
  for (const param_spec& t : index.tensors) {
    const std::size_t n = static_cast<std::size_t>(elements_of(t.whole));
    out.push_back(weft::checkpoint::make_record<float>(prefix + t.name, t.whole,
                                                       whole.subspan(index.offset.at(t.name), n)));
  }
  return out;
}

/// GPT-2's config names in a file's metadata.
/// An MoE model adds Mixtral's names (num_local_experts: E, num_experts_per_tok: K) and moe_every.
inline std::map<std::string, std::string> config_metadata(const gpt_config& m) {
  std::map<std::string, std::string> out{{"format", "pt"},
                                         {"n_layer", std::to_string(m.layers)},
                                         {"n_head", std::to_string(m.heads)},
                                         {"n_embd", std::to_string(m.hidden)},
                                         {"n_positions", std::to_string(m.positions)},
                                         {"vocab_size", std::to_string(m.vocab)}};
  if (m.moe_experts > 0) {
    out["num_local_experts"] = std::to_string(m.moe_experts);
    out["num_experts_per_tok"] = std::to_string(m.moe_top_k);
    out["moe_every"] = std::to_string(m.moe_every);
  }
  return out;
}

/// The model shape a file describes: its metadata's GPT-2 config names, or (for files without
/// them, such as Hugging Face's own) the shapes of its tensors. Throws naming what is missing.
inline gpt_config config_from_file(const weft::checkpoint::checkpoint_file& f, const std::string& path, int seq,
                                   std::optional<int> heads_given = std::nullopt) {
  gpt_config m;
  m.seq = seq;
  auto meta = [&](const char* key) -> std::optional<int> {
    auto it = f.metadata.find(key);
    if (it == f.metadata.end()) return std::nullopt;
    try {
      return std::stoi(it->second);
    } catch (...) {
      throw std::runtime_error("checkpoint '" + path + "': metadata " + key + " = '" + it->second +
                               "' is not a number; re-save the file");
    }
  };
  const auto* wte = f.find("wte.weight");
  const auto* wpe = f.find("wpe.weight");
  if (wte == nullptr || wpe == nullptr || wte->shape.size() != 2 || wpe->shape.size() != 2)
    throw std::runtime_error("checkpoint '" + path + "' has no GPT-2 embeddings (wte.weight, wpe.weight, 2-D): is it a "
                             "GPT-2 checkpoint?");
  m.vocab = meta("vocab_size").value_or(static_cast<int>(wte->shape[0]));
  m.hidden = meta("n_embd").value_or(static_cast<int>(wte->shape[1]));
  m.positions = meta("n_positions").value_or(static_cast<int>(wpe->shape[0]));
  int layers = 0;
  while (f.find("h." + std::to_string(layers) + ".ln_1.weight") != nullptr) ++layers;
  m.layers = meta("n_layer").value_or(layers);
  auto heads = meta("n_head");
  if (!heads) heads = heads_given;
  if (!heads)
    throw std::runtime_error("checkpoint '" + path + "' does not say its number of heads (metadata n_head): give the "
                             "model's --heads, or add n_head to the file's metadata");
  m.heads = *heads;
  m.moe_experts = meta("num_local_experts").value_or(0);
  m.moe_top_k = meta("num_experts_per_tok").value_or(m.moe_top_k);
  m.moe_every = meta("moe_every").value_or(m.moe_every);
  return m;
}

/// Checks that `f` holds every whole tensor of `m` with its shape, in float32; throws naming the
/// first tensor that differs and what to do.
inline void expect_model_tensors(const weft::checkpoint::checkpoint_file& f, const std::string& path,
                                 const whole_index& index, const std::string& prefix = "") {
  for (const param_spec& t : index.tensors) {
    const auto* r = f.find(prefix + t.name);
    if (r == nullptr)
      throw std::runtime_error("checkpoint '" + path + "' has no tensor '" + prefix + t.name +
                               "' that this model needs: the file is for another model shape or is incomplete");
    if (r->shape != t.whole)
      throw std::runtime_error("checkpoint '" + path + "': tensor '" + prefix + t.name + "' has shape " +
                               weft::checkpoint::detail::shape_text(r->shape) + " but this model needs " +
                               weft::checkpoint::detail::shape_text(t.whole) +
                               ": the flags (--layers --hidden --heads --vocab --positions) do not match the file; "
                               "drop them to take the file's shape, or pick the matching checkpoint");
    if (r->type != weft::dtype::float32)
      throw std::runtime_error("checkpoint '" + path + "': tensor '" + prefix + t.name + "' is " +
                               std::string(weft::checkpoint::safetensors_name(r->type)) +
                               "; train_gpt reads float32 checkpoints");
  }
}

/// The integer `key` of an optimizer-state file's metadata (`opt` names the file in the message):
/// missing or not a number is one input error saying to re-save.
inline std::int64_t optimizer_metadata_number(const weft::checkpoint::checkpoint_file& optimizer, const std::string& opt,
                                              const char* key) {
  const auto it = optimizer.metadata.find(key);
  if (it == optimizer.metadata.end())
    throw weft_programs::input_error("optimizer state '" + opt + "' has no '" + key +
                                     "' in its metadata: re-save the checkpoint");
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    throw weft_programs::input_error("optimizer state '" + opt + "': metadata " + key + " = '" + it->second +
                                     "' is not a number; re-save the checkpoint");
  }
}

}  // namespace train_gpt
