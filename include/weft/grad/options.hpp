#pragma once
/// \file
/// Options of the gradient synchronizer, as one aggregate:
/// `weft::grad::synchronizer<B> sync(dp, {.accumulation_steps = 8, .scale = weft::grad::scaling::sum});`

#include <cstddef>
#include <limits>

namespace weft::grad {

/// How reduced gradients are normalised over one optimizer step (an accumulation window).
enum class scaling {
  mean,         ///< divide the sum by dp x accumulation_steps (each micro-step's gradient is a mean)
  sum,          ///< leave the sum over ranks and micro-steps
  token_count,  ///< divide the sum by the global token count given to set_token_count() (gradients
                ///< are sums over tokens; right when micro-batches hold different numbers of tokens)
};

/// The type gradients are reduced in.
enum class reduce_precision {
  own,   ///< the buffer's own type (half and bfloat16 sums are rounded at every step of the reduction)
  fp32,  ///< half and bfloat16 gradients are converted to float, reduced, and converted back
};

/// `sync_options::bucket_bytes` value that asks the synchronizer to measure its cap (the default;
/// weft/grad/bucket_sizing.hpp says how).
inline constexpr std::size_t measured_bucket_bytes = std::numeric_limits<std::size_t>::max();

/// How the synchronizer measures its bucket cap at freeze() (weft/grad/bucket_sizing.hpp).
struct probe_options {
  std::size_t smallest_bytes = std::size_t{256} << 10;  ///< the first size timed
  std::size_t largest_bytes = std::size_t{128} << 20;   ///< never more than this (nor the gradients' size)
  double budget_s = 0.2;    ///< no new size is started once the sizes so far took this long (slowest rank)
  int repeats = 3;          ///< timed runs per size, after one untimed call; the fastest is kept
  /// Bytes a timed run covers: calls of the size on consecutive slices (at least one call), so
  /// that small sizes are timed on fresh memory, as a step's buckets are, not on a cached slice.
  std::size_t run_bytes = std::size_t{8} << 20;
  double tolerance = 0.05;  ///< sizes within this share of the best bandwidth count as fast as it
};

struct sync_options {
  /// Cap on a bucket's gradient bytes (a larger parameter gets a bucket of its own). By default
  /// measured at freeze(): the largest size whose reduction on this group is as fast per byte as
  /// the best size (within `probe.tolerance`); give a number to skip the measurement.
  std::size_t bucket_bytes = measured_bucket_bytes;
  /// Cap on the first bucket, so that communication starts soon after backward begins.
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// Buckets are padded to a multiple of lcm(pad_elements, dp) elements.
  std::size_t pad_elements = 128;
  /// Micro-steps per optimizer step: the first k-1 only accumulate; the k-th reduces.
  int accumulation_steps = 1;
  scaling scale = scaling::mean;
  reduce_precision precision = reduce_precision::own;
  /// ZeRO-1: reduce-scatter instead of all-reduce, so each rank holds the reduced gradients of its
  /// shard of every bucket; the caller updates its shard and gathers parameters with gather_params().
  bool shard_optimizer_state = false;
  /// Start each bucket's reduction as soon as its gradients are marked ready (false: all at finish()).
  bool overlap = true;
  /// Print (once) the step report's warning when overlap was configured but hid nothing.
  bool warn_if_not_overlapped = true;
  /// How the cap is measured when bucket_bytes is measured_bucket_bytes.
  probe_options probe{};
};

}  // namespace weft::grad
