#pragma once
/// \file
/// Gradient bucket caps from a measured time-versus-size curve of the group's own reduction.
///
/// A collective library switches algorithm and protocol with the message size (Open MPI's tuned
/// all-reduce, NCCL's ring / tree and LL / LL128 / Simple), so the bandwidth a bucket gets is not
/// monotonic in its size: on a 2-core machine with Open MPI 4.1 a 25 MiB bucket (PyTorch DDP's
/// fixed default) ran 1.2x slower than 8 or 16 MiB ones. The synchronizer therefore measures the
/// reduction it will run, on the group it will run it on, before the first step:
///
///   * `probe_reduction` times the all-reduce (or, for ZeRO-1, the reduce-scatter) of doubling
///     sizes from 256 KiB up to the gradients' own size, within a time budget, each as a run of
///     calls on consecutive slices of fresh memory, as a step's buckets are. Each rank keeps its
///     fastest of a few runs (load from other processes only ever slows a call down); the
///     ranks' times are gathered and each size takes the slowest rank's, so every rank holds the
///     same curve and plans the same buckets;
///   * `choose_bucket_bytes` takes the largest measured size whose bandwidth is within a
///     tolerance (5 %) of the best one: as fast per byte as the best size, with the fewest calls.
///
/// The first bucket keeps its own small cap (it is what lets communication start early in
/// backward), and an explicit `sync_options::bucket_bytes` skips all of this.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/grad/bucket_cap.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/flat_buffer.hpp>
#include <weft/grad/options.hpp>

namespace weft::grad {

/// The collective a probe times. Sizes are the whole buffer's bytes in every case: the all-reduce's
/// buffer, the reduce-scatter's input, the all-gather's output (a sharded model's unit).
enum class probed_collective { all_reduce, reduce_scatter, all_gather };

/// Times `collective` over `group` on buffers of `T` in the backend's memory, at doubling sizes
/// up to `max_bytes` (in place, as the synchronizer and the sharded model run it). Collective:
/// every rank must call it with the same arguments, and every rank returns the same curve (each
/// size's slowest rank), so the choice made from it is the same everywhere.
template <element T, backend B>
std::vector<curve_point> probe_collective(communicator<B>& group, std::size_t max_bytes, probed_collective collective,
                                          const probe_options& options = {}, double* seconds_spent = nullptr) {
  using clock = std::chrono::steady_clock;
  const std::size_t ranks = static_cast<std::size_t>(group.size());
  const std::size_t largest = std::min(max_bytes, options.largest_bytes);
  std::vector<curve_point> curve;
  if (largest < options.smallest_bytes || options.repeats < 1) return curve;

  // Elements per size, a multiple of the group size so that a reduce-scatter splits it evenly.
  auto elements_of = [&](std::size_t bytes) {
    std::size_t n = std::max<std::size_t>(bytes / sizeof(T), 1);
    return (n + ranks - 1) / ranks * ranks;
  };
  auto plan = std::make_shared<const bucket_plan>(
      std::vector<param_spec>{{"bucket size probe", elements_of(largest)}}, dtype_of<T>,
      plan_options{.bucket_bytes = std::numeric_limits<std::size_t>::max() / 2,
                   .first_bucket_bytes = std::numeric_limits<std::size_t>::max() / 2,
                   .pad_elements = 1,
                   .dp = group.size()});
  flat_buffer<T, buffer_memory_v<B>> buffer = [&] {
    if constexpr (buffer_memory_v<B> == memory_space::device)
      return flat_buffer<T, buffer_memory_v<B>>(plan, group.native().device());
    else
      return flat_buffer<T, buffer_memory_v<B>>(plan);
  }();

  auto call = [&](std::span<T> data) {
    switch (collective) {
      case probed_collective::reduce_scatter: group.reduce_scatter_in_place(data); break;
      case probed_collective::all_gather: group.all_gather_in_place(data); break;
      case probed_collective::all_reduce: group.all_reduce(data); break;
    }
  };
  // Doubling sizes, and the gradients' own size last when doubling does not land on it.
  std::vector<std::size_t> sizes;
  for (std::size_t bytes = options.smallest_bytes; bytes <= largest; bytes *= 2) sizes.push_back(bytes);
  if (sizes.back() < largest) sizes.push_back(largest);

  double spent = 0;  // agreed by all ranks: the slowest rank's time so far
  const std::size_t buffer_elements = buffer.all().size();
  for (std::size_t bytes : sizes) {
    if (spent >= options.budget_s) break;
    const std::size_t n = elements_of(bytes);
    // A bucket of a real step is fresh memory, one of many back to back: time a run of calls on
    // consecutive slices (options.run_bytes of them, at least one call), not one slice again and
    // again, which stays in the cache and overstates small sizes (1 MiB looked twice as fast
    // as 16 MiB here that way; in the step, 16 MiB buckets were the faster).
    const std::size_t calls = std::max<std::size_t>(1, std::min(options.run_bytes, largest) / (n * sizeof(T)));
    std::size_t next = 0;
    auto slice = [&] {
      if (next + n > buffer_elements) next = 0;
      std::span<T> data = buffer.all().subspan(next, n);
      next += n;
      return data;
    };
    const auto size_started = clock::now();
    call(slice());  // untimed: first touch, connection set-up
    double mine = std::numeric_limits<double>::infinity();
    for (int r = 0; r < options.repeats; ++r) {
      const auto t = clock::now();
      for (std::size_t c = 0; c < calls; ++c) call(slice());
      mine = std::min(mine, std::chrono::duration<double>(clock::now() - t).count() / static_cast<double>(calls));
    }
    const double size_spent = std::chrono::duration<double>(clock::now() - size_started).count();
    // Every rank's fastest call and time spent (in nanoseconds), so that all take the same maxima.
    const std::int64_t local[2] = {static_cast<std::int64_t>(mine * 1e9), static_cast<std::int64_t>(size_spent * 1e9)};
    std::vector<std::int64_t> all(2 * ranks);
    group.host_all_gather(std::span<const std::int64_t>(local, 2), all);
    std::int64_t slowest = 1, longest = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      slowest = std::max(slowest, all[2 * r]);
      longest = std::max(longest, all[2 * r + 1]);
    }
    curve.push_back({n * sizeof(T), static_cast<double>(slowest) * 1e-9});
    spent += static_cast<double>(longest) * 1e-9;
  }
  if (seconds_spent) *seconds_spent = spent;
  return curve;
}

/// Times the reduction the synchronizer will run: the all-reduce, or the reduce-scatter when
/// `scatter` (ZeRO-1).
template <element T, backend B>
std::vector<curve_point> probe_reduction(communicator<B>& group, std::size_t max_bytes, bool scatter,
                                         const probe_options& options = {}, double* seconds_spent = nullptr) {
  return probe_collective<T>(group, max_bytes, scatter ? probed_collective::reduce_scatter : probed_collective::all_reduce,
                             options, seconds_spent);
}

}  // namespace weft::grad
