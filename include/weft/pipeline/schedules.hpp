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
// bubble. ZB-H1 (below) keeps this order of F and B.
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

// ZB-H1 (Qi et al. 2024, figure 3): the backward split into the input gradient (B), which the
// previous stage waits for, and the weight gradient (W), which nobody waits for. F and B keep
// 1F1B's order: stage s runs k = min(p - s - 1, m) warm-up forwards, then pairs F B, then the last
// k backwards. Only the Ws move. Stage s holds back s of them: in the steady state it runs one W
// after each pair once s backwards wait for their W, in the cool-down one W after each backward,
// and the s it held back at the very end. Every stage thus keeps min(p, m) micro-batches in flight
// (stage 0's 1F1B peak, so no stage holds more than 1F1B's most loaded one), of which at most
// min(p - s, m) before their B, as in 1F1B; a W after B holds only what the weight gradient needs.
// The held-back Ws are what lets B start earlier than in 1F1B on every stage and what fills the
// tail: with uniform costs and m >= p, the makespan is m(F + B + W) + (p - 1)(F + B - min(F, B, W))
// with B the input gradient (theory.hpp). The order does not depend on the costs: it runs without
// deadlock under any costs, as each rank's F and B are 1F1B's and a W only follows its own B.
inline schedule make_zb_h1(const schedule_spec& spec) {
  schedule s = empty_schedule(spec, true);
  const int p = s.stages, m = s.micro_batches;
  for (int rank = 0; rank < p; ++rank) {
    const int warmup = std::min(p - rank - 1, m);
    int backwards = 0, weights = 0;
    auto backward = [&](int mb) {
      append(s, rank, action_kind::backward, mb);
      ++backwards;
    };
    auto weight = [&] { append(s, rank, action_kind::weight, weights++); };
    for (int mb = 0; mb < warmup; ++mb) append(s, rank, action_kind::forward, mb);
    for (int i = 0; i < m - warmup; ++i) {
      append(s, rank, action_kind::forward, warmup + i);
      backward(i);
      if (backwards - weights > rank) weight();
    }
    for (int mb = m - warmup; mb < m; ++mb) {
      backward(mb);
      weight();
    }
    while (weights < m) weight();
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
