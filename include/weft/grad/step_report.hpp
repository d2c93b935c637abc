#pragma once
/// \file
/// What one optimizer step's gradient communication did, per bucket and in total, with times in
/// seconds relative to the first mark_ready() of the reducing micro-step (the start of its
/// backward as far as weft can see).

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace weft::grad {

struct bucket_timing {
  std::size_t bucket = 0;
  std::size_t bytes = 0;   ///< bytes of the buffer the bucket covers (padding included)
  double ready_s = 0;      ///< its last gradient was marked ready
  double start_s = 0;      ///< its reduction was issued (bucket order, so possibly after ready_s)
  double end_s = 0;        ///< it was seen complete: during backward at the next mark_ready(), or in finish()
  double exposed_s = 0;    ///< how long finish() waited for it
};

struct step_report {
  std::size_t step = 0;        ///< optimizer steps completed before this one
  bool overlap_expected = false;  ///< overlap was configured and the step went through mark_ready()/finish()
  double backward_s = 0;       ///< first mark_ready() to finish()
  double issue_s = 0;          ///< time spent issuing reductions on the caller's thread (scaling, conversion)
  double finish_s = 0;         ///< time inside finish(): communication left after backward, plus epilogues
  double comm_s = 0;           ///< wall time during which at least one reduction was in flight
  double exposed_s = 0;        ///< communication time the caller paid for: issue_s + finish_s
  double hidden_s = 0;         ///< communication time that ran under backward
  std::string warning;         ///< empty unless overlap was configured and hid (almost) nothing
  std::vector<bucket_timing> buckets;

  /// A readable table (one line per bucket, then the totals).
  std::string describe() const {
    char line[160];
    std::snprintf(line, sizeof(line),
                  "step %zu: backward %.3f ms, communication %.3f ms, hidden %.3f ms, exposed %.3f ms "
                  "(issue %.3f, finish %.3f)\n",
                  step, backward_s * 1e3, comm_s * 1e3, hidden_s * 1e3, exposed_s * 1e3, issue_s * 1e3,
                  finish_s * 1e3);
    std::string out = line;
    out += "  bucket        bytes   ready_ms   start_ms     end_ms exposed_ms\n";
    for (const bucket_timing& b : buckets) {
      std::snprintf(line, sizeof(line), "  %6zu %12zu %10.3f %10.3f %10.3f %10.3f\n", b.bucket, b.bytes,
                    b.ready_s * 1e3, b.start_s * 1e3, b.end_s * 1e3, b.exposed_s * 1e3);
      out += line;
    }
    if (!warning.empty()) out += "  warning: " + warning + "\n";
    return out;
  }
};

namespace detail {

/// Length of the union of intervals, and of its part before `cutoff`.
inline std::pair<double, double> union_length(std::vector<std::pair<double, double>> spans, double cutoff) {
  std::sort(spans.begin(), spans.end());
  double total = 0, before = 0;
  double lo = 0, hi = 0;
  bool open = false;
  auto flush = [&] {
    if (!open) return;
    total += hi - lo;
    before += std::max(0.0, std::min(hi, cutoff) - lo);
  };
  for (auto [a, b] : spans) {
    if (b < a) b = a;
    if (open && a <= hi) {
      hi = std::max(hi, b);
    } else {
      flush();
      lo = a;
      hi = b;
      open = true;
    }
  }
  flush();
  return {total, before};
}

}  // namespace detail

}  // namespace weft::grad
