#pragma once
/// \file
/// What a schedule may be asked for. The configurations that hang or silently misbehave in other
/// frameworks (an interleaved schedule whose micro-batch count its rule forbids, layers that do
/// not split into the model chunks) are refused here, before any rank sends anything, with the
/// rule and the nearest valid values.

#include <weft/core/error.hpp>
#include <weft/pipeline/schedule_kind.hpp>

#include <string>
#include <vector>

namespace weft::pipeline {

/// What a user asks of a schedule.
struct schedule_spec {
  schedule_kind kind = schedule_kind::one_f_one_b;
  int stages = 1;          ///< pp: ranks of the pipeline group
  int micro_batches = 1;   ///< m: micro-batches per training step
  int virtual_stages = 1;  ///< v: model chunks per rank (interleaved only)
  int layers = 0;          ///< transformer layers, split over stages x virtual stages; 0: not checked
};

namespace detail {

/// "4 or 8": the multiples of `step` nearest to `value` (at least `step`).
inline std::string nearest_multiples(long long value, long long step) {
  const long long below = value / step * step;
  const long long above = below + step;
  if (below < step) return std::to_string(above);
  if (below == value) return std::to_string(value);
  return std::to_string(below) + " or " + std::to_string(above);
}

/// "{1, 2, 3, 4, 6, 12}": the divisors of n (n >= 1).
inline std::string divisor_list(long long n) {
  std::vector<long long> low, high;
  for (long long d = 1; d * d <= n; ++d) {
    if (n % d != 0) continue;
    low.push_back(d);
    if (d != n / d) high.push_back(n / d);
  }
  low.insert(low.end(), high.rbegin(), high.rend());
  std::string text;
  for (long long d : low) text += (text.empty() ? "{" : ", ") + std::to_string(d);
  return text + "}";
}

}  // namespace detail

/// Every problem with `spec`, each a sentence saying what is wrong and what to do; empty when a
/// schedule can be made from it.
inline std::vector<std::string> validate(const schedule_spec& spec) {
  std::vector<std::string> problems;
  const std::string name(to_string(spec.kind));
  if (spec.stages < 1) problems.push_back("stages=" + std::to_string(spec.stages) + " is invalid: give the pipeline-parallel size, at least 1");
  if (spec.micro_batches < 1)
    problems.push_back("micro-batches=" + std::to_string(spec.micro_batches) + " is invalid: give the micro-batches per step, at least 1");
  if (spec.virtual_stages < 1)
    problems.push_back("virtual stages=" + std::to_string(spec.virtual_stages) + " is invalid: give the model chunks per rank, at least 1");
  if (spec.layers < 0) problems.push_back("layers=" + std::to_string(spec.layers) + " is invalid: give the transformer layers, or 0 not to check them");
  if (!problems.empty()) return problems;

  const long long p = spec.stages, m = spec.micro_batches, v = spec.virtual_stages;
  if (spec.kind == schedule_kind::interleaved) {
    if (v < 2) {
      problems.push_back("the interleaved schedule needs at least 2 model chunks per rank, but virtual stages=" + std::to_string(v) +
                         ": give virtual stages >= 2, or use the 1f1b schedule, which is interleaving with one chunk");
    }
    if (p < 2) {
      problems.push_back("the interleaved schedule needs at least 2 stages, but stages=1: with one rank there is no bubble to "
                         "shrink; use the 1f1b schedule");
    }
    // Megatron-Core's rule: micro-batches go through the chunks in groups of pp, so a last,
    // partial group would leave ranks waiting for messages no one sends.
    if (p >= 2 && m % p != 0) {
      problems.push_back("the interleaved schedule needs micro-batches to be a multiple of stages (it runs them through the model "
                         "chunks in groups of stages), but micro-batches=" + std::to_string(m) + " and stages=" + std::to_string(p) +
                         ": use micro-batches=" + detail::nearest_multiples(m, p) + ", or the 1f1b schedule");
    }
  } else if (v != 1) {
    problems.push_back("virtual stages=" + std::to_string(v) + " needs the interleaved schedule, but the schedule is " + name +
                       ": use --schedule interleaved, or 1 virtual stage");
  }
  if (spec.layers > 0 && spec.layers % (p * v) != 0) {
    problems.push_back(std::to_string(spec.layers) + " layers do not split over stages=" + std::to_string(p) + " x virtual stages=" +
                       std::to_string(v) + " = " + std::to_string(p * v) + " model chunks: use layers=" +
                       detail::nearest_multiples(spec.layers, p * v) + ", or stages x virtual stages in " +
                       detail::divisor_list(spec.layers));
  }
  return problems;
}

/// Throws `weft::error` listing every problem `validate` finds.
inline void require_valid(const schedule_spec& spec) {
  std::vector<std::string> problems = validate(spec);
  if (problems.empty()) return;
  std::string message = "invalid " + std::string(to_string(spec.kind)) + " schedule: " + problems.front();
  for (std::size_t i = 1; i < problems.size(); ++i) message += "; also, " + problems[i];
  fail(message);
}

}  // namespace weft::pipeline
