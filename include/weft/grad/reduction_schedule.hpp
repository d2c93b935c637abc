#pragma once
/// \file
/// What a gradient synchronizer reduces when, as pure bookkeeping shared by its host and device
/// parts (no communicator, no memory): which parameters a micro-step has marked, which bucket may
/// be issued next (strictly in bucket order, the same on every rank), the factor a window's sum is
/// scaled by, and which part of each bucket is this rank's shard under ZeRO-1.

#include <algorithm>
#include <cstddef>
#include <optional>
#include <vector>

#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/options.hpp>

namespace weft::grad {

/// A run of one parameter's elements that belongs to this rank's shard (ZeRO-1).
struct shard_segment {
  std::size_t param = 0;          ///< registration index
  std::size_t buffer_offset = 0;  ///< first element in the flat buffer
  std::size_t param_offset = 0;   ///< first element within the parameter
  std::size_t count = 0;
};

/// This rank's shard of one bucket, padding included: [offset, offset + count) of the flat buffer.
struct shard_range {
  std::size_t bucket = 0;
  std::size_t offset = 0;
  std::size_t count = 0;
};

/// Rank `rank`'s shard of every bucket of `plan` over `ranks` ranks, in bucket order.
inline std::vector<shard_range> shard_ranges_of(const bucket_plan& plan, int rank, int ranks) {
  std::vector<shard_range> out;
  const auto buckets = plan.buckets();
  for (std::size_t b = 0; b < buckets.size(); ++b) {
    auto [offset, count] = buckets[b].shard(rank, ranks);
    out.push_back({b, offset, count});
  }
  return out;
}

/// The same shards as runs of parameters (padding excluded), in buffer order.
inline std::vector<shard_segment> shard_segments_of(const bucket_plan& plan, const std::vector<param_spec>& specs,
                                                    int rank, int ranks) {
  std::vector<shard_segment> out;
  for (const shard_range& r : shard_ranges_of(plan, rank, ranks)) {
    for (std::size_t p : plan.buckets()[r.bucket].params) {
      const std::size_t lo = std::max(r.offset, plan.offset_of(p));
      const std::size_t hi = std::min(r.offset + r.count, plan.offset_of(p) + specs[p].count);
      if (lo < hi) out.push_back({p, lo, lo - plan.offset_of(p), hi - lo});
    }
  }
  return out;
}

/// The factor a window's reduced sum is multiplied by: the mean over `ranks` x
/// `accumulation_steps`, 1 for a sum, or 1 / tokens (nullopt while the count is unknown).
inline std::optional<double> window_scale_factor(scaling scale, int ranks, int accumulation_steps,
                                                 std::optional<double> token_count) {
  switch (scale) {
    case scaling::mean: return 1.0 / (static_cast<double>(ranks) * static_cast<double>(accumulation_steps));
    case scaling::sum: return 1.0;
    case scaling::token_count:
      if (token_count) return 1.0 / *token_count;
      return std::nullopt;
  }
  return 1.0;
}

/// The marks of one micro-step and the order buckets are issued in. A bucket is issuable once
/// all of its parameters are marked (on the reducing micro-step) and every earlier bucket has
/// been issued.
class reduction_schedule {
 public:
  reduction_schedule() = default;
  reduction_schedule(const bucket_plan& plan, std::size_t params, int accumulation_steps)
      : plan_(&plan), accumulation_steps_(accumulation_steps), marked_(params, 0) {
    reset_pending();
  }

  /// The micro-step the current (or next) backward belongs to: 0 .. accumulation_steps - 1.
  int micro_step() const noexcept { return micro_; }
  /// Whether the current (or next) backward is the one that reduces.
  bool reduces_this_micro_step() const noexcept { return micro_ == accumulation_steps_ - 1; }
  /// Inside an accumulation window (past its first micro-step, or in a backward).
  bool in_window() const noexcept { return micro_ != 0 || marked_count_ != 0; }

  bool marked(std::size_t param) const { return marked_[param] != 0; }
  std::size_t marked_count() const noexcept { return marked_count_; }

  /// Marks `param`; with `counts_toward_issue`, returns whether its bucket just became complete.
  bool mark(std::size_t param, bool counts_toward_issue) {
    marked_[param] = 1;
    ++marked_count_;
    if (!counts_toward_issue) return false;
    return --pending_[plan_->bucket_of(param)] == 0;
  }

  /// The next bucket to issue if it may go now (complete, every earlier one issued).
  std::optional<std::size_t> next_issuable() const {
    if (next_issue_ < pending_.size() && pending_[next_issue_] == 0) return next_issue_;
    return std::nullopt;
  }
  /// The next bucket not issued yet, complete or not (finish() issues them all).
  std::optional<std::size_t> next_unissued() const {
    if (next_issue_ < pending_.size()) return next_issue_;
    return std::nullopt;
  }
  /// Bucket next_unissued() went out (count it only once its issue returned: a bucket whose
  /// issue threw is not in flight).
  void issued() noexcept { ++next_issue_; }
  /// Buckets issued in this micro-step: 0 .. issued_count() - 1.
  std::size_t issued_count() const noexcept { return next_issue_; }

  /// The parameters not marked in this micro-step.
  std::vector<std::size_t> unmarked() const {
    std::vector<std::size_t> out;
    for (std::size_t p = 0; p < marked_.size(); ++p)
      if (!marked_[p]) out.push_back(p);
    return out;
  }

  /// Ends the micro-step: clears the marks; the next one begins a new window after the reducing
  /// micro-step, or after a failure (whose window's gradients are lost).
  void end_micro_step(bool failed) {
    std::fill(marked_.begin(), marked_.end(), 0);
    marked_count_ = 0;
    reset_pending();
    micro_ = failed || reduces_this_micro_step() ? 0 : micro_ + 1;
  }

 private:
  void reset_pending() {
    pending_.resize(plan_->buckets().size());
    for (std::size_t b = 0; b < pending_.size(); ++b) pending_[b] = plan_->buckets()[b].params.size();
    next_issue_ = 0;
  }

  const bucket_plan* plan_ = nullptr;
  int accumulation_steps_ = 1;
  int micro_ = 0;
  std::vector<char> marked_;
  std::size_t marked_count_ = 0;
  std::vector<std::size_t> pending_;  ///< unmarked parameters per bucket
  std::size_t next_issue_ = 0;        ///< buckets are issued strictly in order
};

}  // namespace weft::grad
