#pragma once
/// \file
/// How many preallocated activation slots a stage needs when it keeps micro-batch `mb` of each
/// model chunk in slot `mb % n`, as a trainer on a GPU does so that no step allocates: the
/// smallest `n` for which no two micro-batches of one chunk that are in flight at once share a
/// slot. Pure, from the schedule table alone.

#include <weft/core/error.hpp>
#include <weft/pipeline/schedule.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace weft::pipeline {

/// The fewest slots a chunk with which rank `rank` of `s` can keep the activations of micro-batch
/// `mb` of chunk `c` in slot `mb % n` of that chunk's slots. A (micro-batch, chunk) pair is in
/// flight from its forward until the action that frees its activations: its backward, or its
/// weight action when the schedule splits the backward. Between 1 and `s.micro_batches`; it is the
/// most pairs of one chunk in flight at once whenever those are consecutive micro-batches, as in
/// every schedule of schedules.hpp (each runs a chunk's forwards and frees in micro-batch order).
/// @throws weft::error when `rank` is not a stage of `s`, or an action names a micro-batch or
/// chunk outside the table's.
inline int slots_by_micro_batch(const schedule& s, int rank) {
  if (rank < 0 || rank >= s.stages || static_cast<std::size_t>(rank) >= s.ranks.size())
    fail("slots_by_micro_batch: rank " + std::to_string(rank) + " is not a stage of a schedule of " +
         std::to_string(s.stages) + " stages: give 0.." + std::to_string(s.stages - 1));
  const std::vector<action>& actions = s.ranks[static_cast<std::size_t>(rank)];
  const int m = std::max(s.micro_batches, 1), v = std::max(s.virtual_stages, 1);
  for (const action& a : actions)
    if (a.micro_batch < 0 || a.micro_batch >= m || a.chunk < 0 || a.chunk >= v)
      fail("slots_by_micro_batch: stage " + std::to_string(rank) + " has " + short_name(a, v) + ", outside " +
           std::to_string(m) + " micro-batches and " + std::to_string(v) + " chunks");
  auto frees = [&](const action& a) {
    return s.split_backward ? a.kind == action_kind::weight : a.kind == action_kind::backward;
  };
  // No fewer than the most pairs of one chunk in flight at once; more only when the ones in
  // flight are not consecutive, which the walk below finds.
  int fewest = 1;
  std::vector<int> live(static_cast<std::size_t>(v), 0);
  for (const action& a : actions) {
    int& count = live[static_cast<std::size_t>(a.chunk)];
    if (a.kind == action_kind::forward) fewest = std::max(fewest, ++count);
    if (frees(a)) --count;
  }
  for (int n = std::min(fewest, m); n < m; ++n) {
    // occupant[chunk * n + slot]: the micro-batch in the slot, -1 when free.
    std::vector<int> occupant(static_cast<std::size_t>(v) * static_cast<std::size_t>(n), -1);
    bool fits = true;
    for (const action& a : actions) {
      int& at = occupant[static_cast<std::size_t>(a.chunk) * static_cast<std::size_t>(n) +
                         static_cast<std::size_t>(a.micro_batch % n)];
      if (a.kind == action_kind::forward) {
        if (at != -1) {
          fits = false;
          break;
        }
        at = a.micro_batch;
      } else if (frees(a) && at == a.micro_batch) {
        at = -1;
      }
    }
    if (fits) return n;
  }
  return m;  // a slot for every micro-batch never collides
}

}  // namespace weft::pipeline
