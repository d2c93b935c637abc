#pragma once
/// \file
/// The schedule generators: GPipe, 1F1B, interleaved 1F1B and ZB-H1, each a plain function of
/// (stages, micro-batches, virtual stages) that returns the table of every rank's actions.

#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule.hpp>
#include <weft/pipeline/schedule_kind.hpp>

#include <algorithm>
#include <vector>

namespace weft::pipeline {

namespace detail {

inline schedule empty_schedule(const schedule_spec& spec, bool split_backward) {
  schedule s;
  s.kind = spec.kind;
  s.stages = spec.stages;
  s.micro_batches = spec.micro_batches;
  s.virtual_stages = spec.virtual_stages;
  s.split_backward = split_backward;
  s.ranks.resize(static_cast<std::size_t>(spec.stages));
  return s;
}

inline void append(schedule& s, int rank, action_kind kind, int micro_batch, int chunk = 0) {
  s.ranks[static_cast<std::size_t>(rank)].push_back(with_peers(s, rank, {.kind = kind, .micro_batch = micro_batch, .chunk = chunk}));
}

// All forwards, then all backwards in the same order: the last stage can start backward 0 as soon
// as its forwards are done, and every stage holds all m micro-batches at the turn.
inline schedule make_gpipe(const schedule_spec& spec) {
  schedule s = empty_schedule(spec, false);
  for (int rank = 0; rank < s.stages; ++rank) {
    for (int mb = 0; mb < s.micro_batches; ++mb) append(s, rank, action_kind::forward, mb);
    for (int mb = 0; mb < s.micro_batches; ++mb) append(s, rank, action_kind::backward, mb);
  }
  return s;
}

// Stage s runs p-s-1 warm-up forwards, then alternates forward / backward, then drains the
// backwards. At most p-s micro-batches are in flight on stage s, against m for GPipe, for the same
// bubble. With `split`, each backward is followed by its weight gradient (ZB-H1, below).
inline schedule make_one_f_one_b(const schedule_spec& spec) {
  schedule s = empty_schedule(spec, false);
  const int p = s.stages, m = s.micro_batches;
  for (int rank = 0; rank < p; ++rank) {
    const int warmup = std::min(p - rank - 1, m);
    for (int mb = 0; mb < warmup; ++mb) append(s, rank, action_kind::forward, mb);
    for (int i = 0; i < m - warmup; ++i) {
      append(s, rank, action_kind::forward, warmup + i);
      append(s, rank, action_kind::backward, i);
    }
    for (int mb = m - warmup; mb < m; ++mb) append(s, rank, action_kind::backward, mb);
  }
  return s;
}

// ZB-H1: the backward split into the input gradient (B), which the previous stage waits for, and
// the weight gradient (W), which nobody waits for, so Ws can fill the time 1F1B spends idle. The
// order is what a greedy rank does when F, B and W take one unit each (the paper's assumption):
// a ready B first, since every upstream stage waits for it; else a new F while fewer than p - s
// micro-batches are in flight (1F1B's activation memory; W frees them); else the oldest W. The
// order, not those unit costs, is the schedule: it runs without deadlock under any costs.
inline schedule make_zb_h1(const schedule_spec& spec) {
  schedule s = empty_schedule(spec, true);
  const int p = s.stages, m = s.micro_batches;
  const auto stages = static_cast<std::size_t>(p);
  const auto mbs = static_cast<std::size_t>(m);
  // The time step at whose end each F and B finished; -1: not yet.
  std::vector<std::vector<long long>> forward_done(stages, std::vector<long long>(mbs, -1));
  std::vector<std::vector<long long>> backward_done(stages, std::vector<long long>(mbs, -1));
  std::vector<int> forwards(stages, 0), backwards(stages, 0), weights(stages, 0);
  auto ready = [](long long done, long long now) { return done >= 0 && done < now; };
  int remaining = 3 * p * m;
  for (long long now = 0; remaining > 0; ++now) {
    for (int rank = 0; rank < p; ++rank) {
      const auto r = static_cast<std::size_t>(rank);
      const int limit = std::min(p - rank, m);
      // Backwards run in micro-batch order, as do forwards and weights.
      const int b = backwards[r];
      const bool b_ready = b < forwards[r] && ready(forward_done[r][static_cast<std::size_t>(b)], now) &&
                           (rank == p - 1 || ready(backward_done[r + 1][static_cast<std::size_t>(b)], now));
      const int f = forwards[r];
      const bool f_ready = f < m && f - weights[r] < limit && (rank == 0 || ready(forward_done[r - 1][static_cast<std::size_t>(f)], now));
      if (b_ready) {
        append(s, rank, action_kind::backward, b);
        backward_done[r][static_cast<std::size_t>(b)] = now;
        ++backwards[r];
      } else if (f_ready) {
        append(s, rank, action_kind::forward, f);
        forward_done[r][static_cast<std::size_t>(f)] = now;
        ++forwards[r];
      } else if (weights[r] < backwards[r]) {
        append(s, rank, action_kind::weight, weights[r]);
        ++weights[r];
      } else {
        continue;
      }
      --remaining;
    }
  }
  return s;
}

// Megatron-Core's interleaved 1F1B. The k-th forward of a rank (k = 0..v*m-1) works on chunk
// (k mod p*v) / p and micro-batch (k / p*v) * p + k mod p: micro-batches go through the chunks in
// groups of p. Backwards visit the chunks in the reverse order. Stage s warms up with
// 2(p-s-1) + (v-1)p forwards, so that the first backward of the last chunk can arrive in time.
inline schedule make_interleaved(const schedule_spec& spec) {
  schedule s = empty_schedule(spec, false);
  const int p = s.stages, m = s.micro_batches, v = s.virtual_stages;
  const int total = m * v;
  const int group = p * v;
  auto micro_batch = [&](int k) { return k / group * p + k % p; };
  auto forward_chunk = [&](int k) { return k % group / p; };
  auto backward_chunk = [&](int k) { return v - 1 - forward_chunk(k); };
  for (int rank = 0; rank < p; ++rank) {
    const int warmup = std::min(2 * (p - rank - 1) + (v - 1) * p, total);
    for (int k = 0; k < warmup; ++k) append(s, rank, action_kind::forward, micro_batch(k), forward_chunk(k));
    for (int i = 0; i < total - warmup; ++i) {
      append(s, rank, action_kind::forward, micro_batch(warmup + i), forward_chunk(warmup + i));
      append(s, rank, action_kind::backward, micro_batch(i), backward_chunk(i));
    }
    for (int k = total - warmup; k < total; ++k) append(s, rank, action_kind::backward, micro_batch(k), backward_chunk(k));
  }
  return s;
}

}  // namespace detail

/// The schedule `spec` asks for.
/// @throws weft::error when `validate(spec)` finds a problem, with every problem and the fix.
inline schedule make_schedule(const schedule_spec& spec) {
  require_valid(spec);
  switch (spec.kind) {
    case schedule_kind::gpipe: return detail::make_gpipe(spec);
    case schedule_kind::one_f_one_b: return detail::make_one_f_one_b(spec);
    case schedule_kind::interleaved: return detail::make_interleaved(spec);
    case schedule_kind::zb_h1: return detail::make_zb_h1(spec);
  }
  fail("unknown schedule kind");
}

/// The schedule of tag `Tag` (`gpipe`, `one_f_one_b`, `interleaved<V>`, `zb_h1`).
template <schedule_tag Tag>
schedule make_schedule(Tag, int stages, int micro_batches, int layers = 0) {
  return make_schedule({.kind = Tag::kind, .stages = stages, .micro_batches = micro_batches,
                        .virtual_stages = Tag::virtual_stages, .layers = layers});
}

}  // namespace weft::pipeline
