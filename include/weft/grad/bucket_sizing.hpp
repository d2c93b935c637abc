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
///     sizes from 256 KiB up to the gradients' own size, within a time budget. Each rank keeps
///     its fastest of a few calls (load from other processes only ever slows a call down); the
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

/// Times the reduction the synchronizer will run (all-reduce, or reduce-scatter when `scatter`)
/// over `group` on buffers of `T` in the backend's memory, at doubling sizes up to `max_bytes`.
/// Collective: every rank must call it with the same arguments, and every rank returns the same
/// curve (each size's slowest rank), so the choice made from it is the same everywhere.
template <element T, backend B>
std::vector<curve_point> probe_reduction(communicator<B>& group, std::size_t max_bytes, bool scatter,
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

  auto reduce = [&](std::span<T> data) {
    if (scatter)
      group.reduce_scatter_in_place(data);
    else
      group.all_reduce(data);
  };
  // Doubling sizes, and the gradients' own size last when doubling does not land on it.
  std::vector<std::size_t> sizes;
  for (std::size_t bytes = options.smallest_bytes; bytes <= largest; bytes *= 2) sizes.push_back(bytes);
  if (sizes.back() < largest) sizes.push_back(largest);

  double spent = 0;  // agreed by all ranks: the slowest rank's time so far
  for (std::size_t bytes : sizes) {
    if (spent >= options.budget_s) break;
    std::span<T> data = buffer.all().subspan(0, elements_of(bytes));
    const auto size_started = clock::now();
    reduce(data);  // untimed: first touch, connection set-up
    double mine = std::numeric_limits<double>::infinity();
    for (int r = 0; r < options.repeats; ++r) {
      const auto t = clock::now();
      reduce(data);
      mine = std::min(mine, std::chrono::duration<double>(clock::now() - t).count());
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
    curve.push_back({data.size() * sizeof(T), static_cast<double>(slowest) * 1e-9});
    spent += static_cast<double>(longest) * 1e-9;
  }
  if (seconds_spent) *seconds_spent = spent;
  return curve;
}
}  // namespace weft::grad
