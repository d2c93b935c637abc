#pragma once
/// \file
/// The bucket-cap rule on a measured time-versus-size curve of a reduction, and which sizes a
/// bounded probe times, without the measuring (weft/grad/bucket_sizing.hpp measures; the tuner
/// reads curves from hardware files): the cap is the largest measured size whose bandwidth is
/// within a tolerance of the best.

#include <algorithm>
#include <cstddef>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/grad/options.hpp>

namespace weft::grad {

/// One measured size of a reduction: the slowest rank's time for `bytes` bytes.
struct curve_point {
  std::size_t bytes = 0;
  double seconds = 0;
  double bandwidth() const noexcept { return seconds > 0 ? static_cast<double>(bytes) / seconds : 0.0; }
};

/// The cap, and what it was chosen from.
struct bucket_size_choice {
  std::size_t bucket_bytes = 0;
  std::vector<curve_point> curve;  ///< empty when the cap was given, not measured
  std::size_t best_bytes = 0;      ///< the size with the best bandwidth
  double seconds_spent = 0;        ///< the probe's wall time on the slowest rank
  /// The probe's budget ended before any size above the cap was timed: larger caps were not
  /// ruled out, only left untimed (the cap is then the largest timed size, a safe side to err on:
  /// more calls, never a size past a measured drop).
  bool budget_ended_below_knee = false;

  /// One line: the cap, the best size and the curve, for logs and benchmarks.
  std::string describe() const {
    auto mib = [](std::size_t b) { return std::to_string(static_cast<double>(b) / (1 << 20)).substr(0, 6); };
    if (curve.empty()) return "bucket cap " + mib(bucket_bytes) + " MiB (given)";
    std::string out = "bucket cap " + mib(bucket_bytes) + " MiB (measured; best bandwidth at " + mib(best_bytes) +
                      " MiB; probe " + std::to_string(seconds_spent * 1e3).substr(0, 6) + " ms):";
    for (const curve_point& p : curve)
      out += " " + mib(p.bytes) + " MiB " + std::to_string(p.bandwidth() / 1e9).substr(0, 5) + " GB/s;";
    out.pop_back();
    if (budget_ended_below_knee) out += " (the probe's budget ended before any larger size was timed)";
    return out;
  }
};

/// The largest size of `curve` whose bandwidth is at least (1 - tolerance) of the best; ties in
/// bandwidth (within the tolerance) go to the larger size, which needs fewer calls.
inline bucket_size_choice choose_bucket_bytes(std::span<const curve_point> curve, double tolerance = 0.05) {
  if (curve.empty()) fail("bucket sizing: no measured sizes to choose a bucket cap from");
  if (!(tolerance >= 0 && tolerance < 1))
    fail("bucket sizing: tolerance " + std::to_string(tolerance) + " is not in [0, 1)");
  bucket_size_choice choice;
  choice.curve.assign(curve.begin(), curve.end());
  double best = 0;
  for (const curve_point& p : curve) {
    if (p.bytes == 0 || !(p.seconds > 0))
      fail("bucket sizing: a measured point has " + std::to_string(p.bytes) + " bytes in " +
           std::to_string(p.seconds) + " s; sizes and times must be positive");
    if (p.bandwidth() > best) {
      best = p.bandwidth();
      choice.best_bytes = p.bytes;
    }
  }
  for (const curve_point& p : curve)
    if (p.bandwidth() >= (1.0 - tolerance) * best) choice.bucket_bytes = std::max(choice.bucket_bytes, p.bytes);
  return choice;
}

/// Which sizes a bounded probe times, and in what order (pure: the caller times each step and
/// records it). The candidates are doubling sizes from `probe.smallest_bytes` up to `largest`
/// (the gradients' own size, at most `probe.largest_bytes`) and `largest` itself. What the cap
/// depends on is where the bandwidth drops (the library's switch to a slower algorithm), so the
/// search spends its budget there first:
///
///   1. the first size large enough to time in one call (`probe.run_bytes`, or the largest);
///   2. sizes four times larger, while each stays within the tolerance of the best bandwidth;
///   3. bisection between the largest size within the tolerance and the smallest larger size
///      outside it, until they are neighbours;
///   4. the other sizes for the rest of the curve (the tuner's, and the best bandwidth the rule
///      compares with): the smaller ones the largest first, then any larger ones left.
///
/// A size smaller than `run_bytes` is timed as `probe.repeats` runs of calls on consecutive slices
/// covering `run_bytes` in all (one call per run at least), keeping the fastest run; a larger size is
/// `probe.repeats` single calls, keeping the fastest. The first two calls of a new size pay for
/// the MPI library's scratch buffer of that size, fresh memory (Open MPI 4.1 here: 1025 and 512
/// page faults for 8 MiB, the third call none and up to 2 x faster), which a step whose buckets
/// repeat their sizes pays once; and one call on 4 ranks sharing 2 cores was once timed 3 x
/// slower than the same size in the step, with every later prediction taken from it. No step is started whose predicted time (its bytes at the lowest bandwidth measured so
/// far, with a 25 % margin) would take the probe past `probe.budget_s`, except the first, which
/// always runs. Every rank must record the same times (the slowest rank's), so every rank takes
/// the same steps and holds the same curve.
class probe_search {
 public:
  /// One size to time: `runs` runs of `calls` calls of `bytes` (on consecutive slices).
  struct step {
    std::size_t bytes = 0;
    std::size_t calls = 1;
    int runs = 1;
  };

  /// `granule`: every size is rounded up to a multiple of it (an element per rank, so that a
  /// reduce-scatter splits the size evenly).
  probe_search(std::size_t largest, const probe_options& probe, std::size_t granule = 1) : probe_(probe) {
    if (granule == 0) fail("bucket sizing: a probe granule of 0 bytes; give at least 1");
    if (probe.smallest_bytes == 0) fail("bucket sizing: probe.smallest_bytes is 0; give a positive smallest size");
    if (probe.repeats < 1) fail("bucket sizing: probe.repeats is " + std::to_string(probe.repeats) + "; it must be at least 1");
    if (!(probe.tolerance >= 0 && probe.tolerance < 1))
      fail("bucket sizing: probe.tolerance " + std::to_string(probe.tolerance) + " is not in [0, 1)");
    largest = std::min(largest, probe.largest_bytes);
    if (largest < probe.smallest_bytes) return;  // nothing to time: one bucket holds everything
    auto rounded = [&](std::size_t bytes) { return (bytes + granule - 1) / granule * granule; };
    for (std::size_t bytes = probe.smallest_bytes; bytes <= largest; bytes *= 2) {
      if (sizes_.empty() || rounded(bytes) > sizes_.back()) sizes_.push_back(rounded(bytes));
      if (bytes > largest / 2) break;  // no overflow past the largest
    }
    if (sizes_.back() < rounded(largest)) sizes_.push_back(rounded(largest));
    seconds_.assign(sizes_.size(), -1.0);
  }

  /// The candidate sizes, in increasing order.
  std::span<const std::size_t> sizes() const noexcept { return sizes_; }
  /// What to time next, or nothing once every size is timed or none fits in the budget.
  std::optional<step> next() const {
    const std::optional<std::size_t> i = next_index();
    if (!i) return std::nullopt;
    return step_of(*i);
  }
  /// The time per call of the step next() returned (the slowest rank's) and the wall time the
  /// step took, allocation included (the slowest rank's).
  void record(const step& s, double seconds_per_call, double seconds_spent) {
    const auto at = std::find(sizes_.begin(), sizes_.end(), s.bytes);
    if (at == sizes_.end()) fail("bucket sizing: a probe step of " + std::to_string(s.bytes) + " bytes is not a candidate size");
    if (!(seconds_per_call > 0)) seconds_per_call = std::numeric_limits<double>::min();  // a clock too coarse to see it
    seconds_[static_cast<std::size_t>(at - sizes_.begin())] = seconds_per_call;
    spent_ += std::max(seconds_spent, 0.0);
  }
  double seconds_spent() const noexcept { return spent_; }

  /// The timed sizes in increasing order.
  std::vector<curve_point> curve() const {
    std::vector<curve_point> out;
    for (std::size_t i = 0; i < sizes_.size(); ++i)
      if (timed(i)) out.push_back({sizes_[i], seconds_[i]});
    return out;
  }
  /// The rule on the timed sizes (choose_bucket_bytes), with the time spent and whether the
  /// budget ended before any size above the cap was timed. Needs at least one timed size.
  bucket_size_choice choice() const {
    const std::vector<curve_point> points = curve();
    bucket_size_choice out = choose_bucket_bytes(points, probe_.tolerance);
    out.seconds_spent = spent_;
    bool larger_timed = false, larger_left = false;
    for (std::size_t i = 0; i < sizes_.size(); ++i)
      if (sizes_[i] > out.bucket_bytes) (timed(i) ? larger_timed : larger_left) = true;
    out.budget_ended_below_knee = larger_left && !larger_timed;
    return out;
  }

 private:
  bool timed(std::size_t i) const { return seconds_[i] >= 0; }
  double bandwidth(std::size_t i) const { return static_cast<double>(sizes_[i]) / seconds_[i]; }

  step step_of(std::size_t i) const {
    const std::size_t bytes = sizes_[i];
    if (bytes >= probe_.run_bytes) return {bytes, 1, probe_.repeats};
    const std::size_t runs = static_cast<std::size_t>(probe_.repeats);
    return {bytes, std::max<std::size_t>(1, probe_.run_bytes / runs / bytes), probe_.repeats};
  }

  bool affordable(std::size_t i) const {
    double slowest = std::numeric_limits<double>::infinity();  // bytes per second
    for (std::size_t j = 0; j < sizes_.size(); ++j)
      if (timed(j)) slowest = std::min(slowest, bandwidth(j));
    const step s = step_of(i);
    const double predicted = 1.25 * static_cast<double>(s.bytes * s.calls * static_cast<std::size_t>(s.runs)) / slowest;
    return spent_ + predicted <= probe_.budget_s;
  }

  std::optional<std::size_t> next_index() const {
    const std::size_t n = sizes_.size();
    if (n == 0) return std::nullopt;
    std::size_t count = 0;
    for (std::size_t i = 0; i < n; ++i) count += timed(i) ? 1 : 0;
    if (count == 0) {  // 1. the first size that one call times, or the largest
      for (std::size_t i = 0; i < n; ++i)
        if (sizes_[i] >= probe_.run_bytes) return i;
      return n - 1;
    }
    if (count == n) return std::nullopt;
    double best = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (timed(i)) best = std::max(best, bandwidth(i));
    // The largest timed size within the tolerance, and the first timed size above it (n: none).
    std::size_t low = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (timed(i) && bandwidth(i) >= (1.0 - probe_.tolerance) * best) low = i;
    std::size_t high = n;
    for (std::size_t i = n; i-- > low + 1;)
      if (timed(i)) high = i;
    // 2. and 3.: above the bracket's low end, four times the size while nothing larger was timed
    // (a size past the drop costs most of all: a long jump can use up the budget on it), else the
    // middle of the bracket; when the budget does not afford it, the largest size below it that it does.
    const std::size_t aim = high == n ? std::min(n - 1, low + 2) : low + (high - low) / 2;
    for (std::size_t i = aim; i > low; --i)
      if (!timed(i) && affordable(i)) return i;
    // 4. the rest: below the bracket the largest first, then above it the smallest first.
    for (std::size_t i = low; i-- > 0;)
      if (!timed(i) && affordable(i)) return i;
    for (std::size_t i = low + 1; i < n; ++i)
      if (!timed(i) && affordable(i)) return i;
    return std::nullopt;
  }

  probe_options probe_;
  std::vector<std::size_t> sizes_;
  std::vector<double> seconds_;  // per call, the slowest rank's; negative: not timed
  double spent_ = 0;
};

}  // namespace weft::grad
