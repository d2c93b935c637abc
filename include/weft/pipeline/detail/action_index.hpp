#pragma once
/// \file
/// Where each (kind, micro-batch, virtual stage) sits in a schedule, and what it depends on: the
/// common ground of the verifier and the point-to-point check.

#include <weft/pipeline/schedule.hpp>

#include <cstddef>
#include <string>
#include <vector>

namespace weft::pipeline::detail {

/// A place in the table: rank and position in its list; rank -1 for "not in the table".
struct slot {
  int rank = -1;
  int position = -1;
};

/// The identity of a computation: (kind, micro-batch, virtual stage).
struct work_key {
  action_kind kind = action_kind::forward;
  int micro_batch = 0;
  int virtual_stage = 0;
};

inline std::string key_name(const schedule& s, const work_key& key) {
  std::string name(1, letter(key.kind));
  name += std::to_string(key.micro_batch);
  if (s.virtual_stages > 1) name += "." + std::to_string(s.chunk_of(key.virtual_stage));
  return name + " (stage " + std::to_string(s.rank_of(key.virtual_stage)) + ")";
}

/// The computations whose results `key` needs. A cross-rank one arrives by message.
inline std::vector<work_key> inputs_of(const schedule& s, const work_key& key) {
  const int last = s.chunks_total() - 1;
  switch (key.kind) {
    case action_kind::forward:
      if (key.virtual_stage > 0) return {{action_kind::forward, key.micro_batch, key.virtual_stage - 1}};
      return {};
    case action_kind::backward:
      if (key.virtual_stage < last)
        return {{action_kind::backward, key.micro_batch, key.virtual_stage + 1}, {action_kind::forward, key.micro_batch, key.virtual_stage}};
      return {{action_kind::forward, key.micro_batch, key.virtual_stage}};
    case action_kind::weight: return {{action_kind::backward, key.micro_batch, key.virtual_stage}};
  }
  return {};
}

/// The computation whose output a receiving action gets by message (its cross-stage input).
inline work_key received_input(const schedule& s, int rank, const action& a) {
  const int k = s.virtual_stage(rank, a.chunk);
  if (a.kind == action_kind::forward) return {action_kind::forward, a.micro_batch, k - 1};
  return {action_kind::backward, a.micro_batch, k + 1};
}

/// Slots of every computation a schedule names, with the problems of the table itself:
/// actions out of range, on the wrong rank, missing or repeated.
class action_index {
 public:
  explicit action_index(const schedule& s) : s_(s), slots_(3 * static_cast<std::size_t>(s.micro_batches) * s.chunks_total()) {
    if (static_cast<int>(s.ranks.size()) != s.stages) {
      problems_.push_back("the table has " + std::to_string(s.ranks.size()) + " rank lists for " + std::to_string(s.stages) +
                          " stages: give one list per stage");
      return;
    }
    for (int rank = 0; rank < s.stages; ++rank) {
      const std::vector<action>& list = s.ranks[static_cast<std::size_t>(rank)];
      for (int i = 0; i < static_cast<int>(list.size()); ++i) {
        const action& a = list[static_cast<std::size_t>(i)];
        const std::string where = "rank " + std::to_string(rank) + " action " + std::to_string(i) + " (" + short_name(a, s.virtual_stages) + ")";
        if (a.micro_batch < 0 || a.micro_batch >= s.micro_batches || a.chunk < 0 || a.chunk >= s.virtual_stages) {
          problems_.push_back(where + " names micro-batch " + std::to_string(a.micro_batch) + " chunk " + std::to_string(a.chunk) +
                              ", outside 0.." + std::to_string(s.micro_batches - 1) + " and 0.." + std::to_string(s.virtual_stages - 1));
          continue;
        }
        if (a.kind == action_kind::weight && !s.split_backward) {
          problems_.push_back(where + " is a weight-gradient action, but the schedule does not split the backward: remove it, or mark "
                              "the schedule split_backward");
          continue;
        }
        slot& place = slots_[index({a.kind, a.micro_batch, s.virtual_stage(rank, a.chunk)})];
        if (place.rank >= 0) {
          problems_.push_back(where + " repeats action " + std::to_string(place.position) + " of rank " + std::to_string(place.rank) +
                              ": each computation must appear once");
          continue;
        }
        place = {rank, i};
      }
    }
    for (int mb = 0; mb < s.micro_batches; ++mb) {
      for (int k = 0; k < s.chunks_total(); ++k) {
        for (action_kind kind : {action_kind::forward, action_kind::backward, action_kind::weight}) {
          if (kind == action_kind::weight && !s.split_backward) continue;
          if (at({kind, mb, k}).rank < 0) {
            problems_.push_back(key_name(s, {kind, mb, k}) + " is missing: add it to rank " + std::to_string(s.rank_of(k)) + "'s list");
          }
        }
      }
    }
  }

  const slot& at(const work_key& key) const { return slots_[index(key)]; }
  const std::vector<std::string>& problems() const noexcept { return problems_; }

 private:
  std::size_t index(const work_key& key) const {
    return (static_cast<std::size_t>(key.kind) * static_cast<std::size_t>(s_.micro_batches) + static_cast<std::size_t>(key.micro_batch)) *
               static_cast<std::size_t>(s_.chunks_total()) +
           static_cast<std::size_t>(key.virtual_stage);
  }

  const schedule& s_;
  std::vector<slot> slots_;
  std::vector<std::string> problems_;
};

}  // namespace weft::pipeline::detail
