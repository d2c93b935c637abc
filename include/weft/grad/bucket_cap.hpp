#pragma once
/// \file
/// The bucket-cap rule on a measured time-versus-size curve of a reduction, without the
/// measuring (weft/grad/bucket_sizing.hpp measures; the tuner reads curves from hardware files):
/// the cap is the largest measured size whose bandwidth is within a tolerance of the best.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <weft/core/error.hpp>

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

  /// One line: the cap, the best size and the curve, for logs and benchmarks.
  std::string describe() const {
    auto mib = [](std::size_t b) { return std::to_string(static_cast<double>(b) / (1 << 20)).substr(0, 6); };
    if (curve.empty()) return "bucket cap " + mib(bucket_bytes) + " MiB (given)";
    std::string out = "bucket cap " + mib(bucket_bytes) + " MiB (measured; best bandwidth at " + mib(best_bytes) +
                      " MiB; probe " + std::to_string(seconds_spent * 1e3).substr(0, 6) + " ms):";
    for (const curve_point& p : curve)
      out += " " + mib(p.bytes) + " MiB " + std::to_string(p.bandwidth() / 1e9).substr(0, 5) + " GB/s;";
    out.pop_back();
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

}  // namespace weft::grad
