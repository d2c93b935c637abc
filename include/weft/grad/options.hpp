#pragma once
/// \file
/// Options of the gradient synchronizer, as one aggregate:
/// `weft::grad::synchronizer<B> sync(dp, {.accumulation_steps = 8, .scale = weft::grad::scaling::sum});`

#include <cstddef>

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

struct sync_options {
  /// Cap on a bucket's gradient bytes (a larger parameter gets a bucket of its own).
  std::size_t bucket_bytes = std::size_t{25} << 20;
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
};

}  // namespace weft::grad
