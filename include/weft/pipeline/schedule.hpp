#pragma once
/// \file
/// A pipeline schedule as a pure table: for each rank (pipeline stage) the ordered list of what it
/// computes and with which ranks it exchanges activations and gradients. An executor walks one
/// rank's list; the verifier (verify.hpp) reasons about all of them without running anything.

#include <weft/pipeline/schedule_kind.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace weft::pipeline {

/// What one action computes.
enum class action_kind {
  forward,   ///< the forward pass of one micro-batch through one model chunk
  backward,  ///< its backward pass: input and weight gradients, or only the input gradient when
             ///< the schedule splits the backward (then a `weight` action follows)
  weight,    ///< the weight gradient alone (schedules that split the backward)
};

constexpr std::string_view to_string(action_kind kind) noexcept {
  switch (kind) {
    case action_kind::forward: return "forward";
    case action_kind::backward: return "backward";
    case action_kind::weight: return "weight";
  }
  return "?";
}

/// One letter per kind, as in the figures of the pipeline papers: F, B, W.
constexpr char letter(action_kind kind) noexcept {
  switch (kind) {
    case action_kind::forward: return 'F';
    case action_kind::backward: return 'B';
    case action_kind::weight: return 'W';
  }
  return '?';
}

/// One step of one rank. `recv_from` is the rank whose output this action needs first (received
/// before computing), `send_to` the rank that needs this action's output (sent after computing);
/// -1 for none (the ends of the pipeline, weight gradients, and neighbours on the same rank).
struct action {
  action_kind kind = action_kind::forward;
  int micro_batch = 0;
  int chunk = 0;  ///< model chunk on this rank, 0..virtual_stages-1
  int recv_from = -1;
  int send_to = -1;
  bool operator==(const action&) const = default;
};

/// "F3", "B3.1" (micro-batch 3, chunk 1): short names for messages and listings.
inline std::string short_name(const action& a, int virtual_stages) {
  std::string name(1, letter(a.kind));
  name += std::to_string(a.micro_batch);
  if (virtual_stages > 1) name += "." + std::to_string(a.chunk);
  return name;
}

/// A whole schedule: one ordered action list per rank of the pipeline group.
///
/// Model chunk c on rank r is virtual stage c * stages + r, as in Megatron-Core's interleaved
/// schedule: a micro-batch's forward visits ranks 0..stages-1 once per chunk, in chunk order.
struct schedule {
  schedule_kind kind = schedule_kind::one_f_one_b;
  int stages = 1;
  int micro_batches = 1;
  int virtual_stages = 1;
  /// Whether backward actions compute only input gradients, with `weight` actions after them.
  bool split_backward = false;
  std::vector<std::vector<action>> ranks;

  /// Virtual stages in all: the number of model chunks of the whole model.
  int chunks_total() const noexcept { return stages * virtual_stages; }
  int virtual_stage(int rank, int chunk) const noexcept { return chunk * stages + rank; }
  int rank_of(int virtual_stage) const noexcept { return virtual_stage % stages; }
  int chunk_of(int virtual_stage) const noexcept { return virtual_stage / stages; }
};

/// `a` on `rank` with `recv_from` and `send_to` filled in from the chunk order: forwards flow to
/// the next virtual stage, backwards to the previous one, weight gradients stay on the rank.
inline action with_peers(const schedule& s, int rank, action a) {
  const int k = s.virtual_stage(rank, a.chunk);
  const int last = s.chunks_total() - 1;
  auto remote = [&](int other_virtual_stage) {
    const int other = s.rank_of(other_virtual_stage);
    return other == rank ? -1 : other;
  };
  a.recv_from = -1;
  a.send_to = -1;
  if (a.kind == action_kind::forward) {
    if (k > 0) a.recv_from = remote(k - 1);
    if (k < last) a.send_to = remote(k + 1);
  } else if (a.kind == action_kind::backward) {
    if (k < last) a.recv_from = remote(k + 1);
    if (k > 0) a.send_to = remote(k - 1);
  }
  return a;
}

}  // namespace weft::pipeline
