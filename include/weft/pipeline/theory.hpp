#pragma once
/// \file
/// The closed forms of the pipeline papers, for uniform per-action costs and no communication
/// cost: what the verifier's simulation must reproduce.
///
/// - GPipe and 1F1B: makespan (m + p - 1)(F + B), bubble (p - 1) / (m + p - 1), for any F and B
///   (Huang et al. 2019; Narayanan et al. 2021).
/// - Interleaved 1F1B with v chunks per rank and per-chunk costs f, b: makespan
///   (v m + p - 1)(f + b), bubble (p - 1) / (v m + p - 1) (Narayanan et al. 2021, section 2.2.2).
/// - ZB-H1 with the backward B split into input gradient B - W and weight gradient W, m >= p:
///   makespan m(F + B) + (p - 1)(F + B - W - min(F, B - W, W)), for any F, B, W. Where
///   W <= F and W <= B - W, as in the paper (Qi et al. 2024, section 3.1, with its T_B = B - W),
///   that is m(F + B) + (p - 1)(F + B - 2W): each stage idles (p - 1)(F + B - 2W) against 1F1B's
///   (p - 1)(F + B). The unit test checks the verifier against it for every p <= 6, p <= m <= 14,
///   F <= 4, B - W <= 4, W <= 4, and for hundreds of random (p, m, F, B, W) with m >= p. For m < p
///   there is no closed form here; the test checks that ZB-H1 is then no slower than 1F1B.
/// - Activations held (micro-batches in flight): m on every stage for GPipe; min(p - s, m) on
///   stage s for 1F1B; min(2(p - s - 1) + (v - 1)p + 1, v m) (micro-batch, chunk) pairs for
///   interleaved. ZB-H1: min(p, m) on every stage until their W, as 1F1B's stage 0, of which at
///   most min(p - s, m) on stage s before their B, as 1F1B's stage s (after B, a micro-batch holds
///   only what its weight gradient needs).

#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule_kind.hpp>
#include <weft/pipeline/verify.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace weft::pipeline {

/// The papers' makespan for `spec` under `c` (c.comm ignored), or nothing for ZB-H1 with fewer
/// micro-batches than stages.
inline std::optional<std::int64_t> theory_makespan(const schedule_spec& spec, const costs& c) {
  const std::int64_t p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  switch (spec.kind) {
    case schedule_kind::gpipe:
    case schedule_kind::one_f_one_b: return (m + p - 1) * (c.forward + c.backward);
    case schedule_kind::interleaved: return (v * m + p - 1) * (c.forward + c.backward);
    case schedule_kind::zb_h1: {
      if (m < p) return std::nullopt;
      const std::int64_t input = c.backward - c.weight;
      return m * (c.forward + c.backward) + (p - 1) * (c.forward + input - std::min({c.forward, input, c.weight}));
    }
  }
  return std::nullopt;
}

/// The papers' bubble fraction for `spec`, or nothing for ZB-H1, whose bubble depends on the costs:
/// 1 - m(F + B) / theory_makespan.
inline std::optional<double> theory_bubble_fraction(const schedule_spec& spec) {
  const double p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  switch (spec.kind) {
    case schedule_kind::gpipe:
    case schedule_kind::one_f_one_b: return (p - 1) / (m + p - 1);
    case schedule_kind::interleaved: return (p - 1) / (v * m + p - 1);
    case schedule_kind::zb_h1: return std::nullopt;
  }
  return std::nullopt;
}

/// The papers' peak of micro-batches in flight on `stage` (0-based).
inline int theory_peak_in_flight(const schedule_spec& spec, int stage) {
  const int p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  switch (spec.kind) {
    case schedule_kind::gpipe: return m;
    case schedule_kind::one_f_one_b: return std::min(p - stage, m);
    case schedule_kind::zb_h1: return std::min(p, m);
    case schedule_kind::interleaved: return std::min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m);
  }
  return 0;
}

}  // namespace weft::pipeline
