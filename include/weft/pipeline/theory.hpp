#pragma once
/// \file
/// The closed forms of the pipeline papers, for uniform per-action costs and no communication
/// cost: what the verifier's simulation must reproduce.
///
/// - GPipe and 1F1B: makespan (m + p - 1)(F + B), bubble (p - 1) / (m + p - 1), for any F and B
///   (Huang et al. 2019; Narayanan et al. 2021).
/// - Interleaved 1F1B with v chunks per rank and per-chunk costs f, b: makespan
///   (v m + p - 1)(f + b), bubble (p - 1) / (v m + p - 1) (Narayanan et al. 2021, section 2.2.2).
/// - Activations held (micro-batches in flight): m on every stage for GPipe; min(p - s, m) on
///   stage s for 1F1B and ZB-H1; min(2(p - s - 1) + (v - 1)p + 1, v m) (micro-batch, chunk)
///   pairs for interleaved.
/// ZB-H1 has no closed form here: its bubble, about (p - 1)(F + B - 2W) against 1F1B's
/// (p - 1)(F + B) (Qi et al. 2024, with B the whole backward), is the simulation's to measure.

#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule_kind.hpp>
#include <weft/pipeline/verify.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace weft::pipeline {

/// The papers' makespan for `spec` under `c` (c.comm ignored), or nothing for ZB-H1.
inline std::optional<std::int64_t> theory_makespan(const schedule_spec& spec, const costs& c) {
  const std::int64_t p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  switch (spec.kind) {
    case schedule_kind::gpipe:
    case schedule_kind::one_f_one_b: return (m + p - 1) * (c.forward + c.backward);
    case schedule_kind::interleaved: return (v * m + p - 1) * (c.forward + c.backward);
    case schedule_kind::zb_h1: return std::nullopt;
  }
  return std::nullopt;
}

/// The papers' bubble fraction for `spec`, or nothing for ZB-H1.
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
    case schedule_kind::one_f_one_b:
    case schedule_kind::zb_h1: return std::min(p - stage, m);
    case schedule_kind::interleaved: return std::min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m);
  }
  return 0;
}

}  // namespace weft::pipeline
