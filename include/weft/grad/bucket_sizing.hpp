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
///   * `probe_reduction` times the all-reduce (or, for ZeRO-1, the reduce-scatter) at sizes from
///     256 KiB up to the gradients' own size (never beyond: no cap larger than the gradients),
///     within a time budget, spent first where the bandwidth drops (`probe_search`,
///     weft/grad/bucket_cap.hpp: the first size one call times, the largest affordable, then
///     bisection of the drop, then the rest of the curve). Small sizes are timed as runs of calls on
///     consecutive slices of fresh memory, as a step's buckets are, each rank keeping its fastest
///     of a few runs (load from other processes only ever slows a call down); a large size is three
///     single calls, the fastest kept (the first two pay for the MPI library's scratch buffer of a
///     new size). The ranks' times are gathered and each size takes the slowest rank's, so every rank
///     holds the same curve, takes the same next size and plans the same buckets;
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
#include <optional>
#include <span>
#include <string>
#include <utility>
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

/// Times `collectives` (one after the other on the same slice; a size's time is their sum) over
/// `group` on buffers of `T` in the backend's memory, at the sizes probe_search chooses up to
/// `max_bytes` within `options.budget_s` (in place, as the synchronizer and the sharded model run
/// them), and returns the rule's choice with the curve (weft/grad/bucket_cap.hpp). Collective:
/// every rank must call it with the same arguments, and every rank returns the same curve (each
/// size's slowest rank), so the choice made from it is the same everywhere. Gradients smaller
/// than the smallest size: an empty curve, and the whole gradients as the cap.
template <element T, backend B>
bucket_size_choice probe_collectives(communicator<B>& group, std::size_t max_bytes,
                                     std::span<const probed_collective> collectives, const probe_options& options = {}) {
  using clock = std::chrono::steady_clock;
  const std::size_t ranks = static_cast<std::size_t>(group.size());
  // Sizes in whole elements per rank, so that a reduce-scatter splits them evenly.
  probe_search search(max_bytes, options, sizeof(T) * ranks);
  if (search.sizes().empty()) {
    bucket_size_choice whole;
    whole.bucket_bytes = whole.best_bytes = std::max<std::size_t>(max_bytes, 1);
    return whole;
  }

  using buffer_t = flat_buffer<T, buffer_memory_v<B>>;
  // Grown to the largest run a step needs (zeroed, so its pages are in place before any timing).
  auto make_buffer = [&](std::size_t elements) {
    auto plan = std::make_shared<const bucket_plan>(
        std::vector<param_spec>{{"bucket size probe", elements}}, dtype_of<T>,
        plan_options{.bucket_bytes = std::numeric_limits<std::size_t>::max() / 2,
                     .first_bucket_bytes = std::numeric_limits<std::size_t>::max() / 2,
                     .pad_elements = 1,
                     .dp = group.size()});
    if constexpr (buffer_memory_v<B> == memory_space::device)
      return buffer_t(plan, group.native().device());
    else
      return buffer_t(plan);
  };
  buffer_t buffer;
  std::size_t buffer_elements = 0;

  auto call = [&](std::span<T> data) {
    for (probed_collective c : collectives) switch (c) {
        case probed_collective::reduce_scatter: group.reduce_scatter_in_place(data); break;
        case probed_collective::all_gather: group.all_gather_in_place(data); break;
        case probed_collective::all_reduce: group.all_reduce(data); break;
      }
  };
  bool first = true;
  while (const std::optional<probe_search::step> step = search.next()) {
    const auto started = clock::now();
    const std::size_t n = step->bytes / sizeof(T);
    if (buffer_elements < n * step->calls) {
      buffer = buffer_t();  // the old one goes first: the two need not fit at once
      buffer = make_buffer(n * step->calls);
      buffer_elements = buffer.all().size();
    }
    // A bucket of a real step is fresh memory, one of many back to back: small sizes are timed
    // as runs of calls on consecutive slices, not one slice again and again, which stays in the
    // cache and overstates small sizes (1 MiB looked twice as fast as 16 MiB here that way; in
    // the step, 16 MiB buckets were the faster).
    std::size_t next = 0;
    auto slice = [&] {
      if (next + n > buffer_elements) next = 0;
      std::span<T> data = buffer.all().subspan(next, n);
      next += n;
      return data;
    };
    if (first) call(slice());  // untimed: connection set-up
    first = false;
    double mine = std::numeric_limits<double>::infinity();
    for (int r = 0; r < step->runs; ++r) {
      const auto t = clock::now();
      for (std::size_t c = 0; c < step->calls; ++c) call(slice());
      mine = std::min(mine, std::chrono::duration<double>(clock::now() - t).count() / static_cast<double>(step->calls));
    }
    const double step_spent = std::chrono::duration<double>(clock::now() - started).count();
    // Every rank's fastest call and time spent (in nanoseconds), so that all take the same maxima
    // and the search takes the same next step everywhere.
    const std::int64_t local[2] = {static_cast<std::int64_t>(mine * 1e9), static_cast<std::int64_t>(step_spent * 1e9)};
    std::vector<std::int64_t> all(2 * ranks);
    group.host_all_gather(std::span<const std::int64_t>(local, 2), all);
    std::int64_t slowest = 1, longest = 0;
    for (std::size_t r = 0; r < ranks; ++r) {
      slowest = std::max(slowest, all[2 * r]);
      longest = std::max(longest, all[2 * r + 1]);
    }
    // The curve holds the bytes each call moved (rounded up to whole elements per rank).
    search.record(*step, static_cast<double>(slowest) * 1e-9, static_cast<double>(longest) * 1e-9);
  }
  return search.choice();
}

/// Times the reduction the synchronizer will run, the all-reduce or, when `scatter` (ZeRO-1), the
/// reduce-scatter, and chooses the cap from it (probe_collectives).
template <element T, backend B>
bucket_size_choice probe_reduction_choice(communicator<B>& group, std::size_t max_bytes, bool scatter,
                                          const probe_options& options = {}) {
  const probed_collective reduction = scatter ? probed_collective::reduce_scatter : probed_collective::all_reduce;
  return probe_collectives<T>(group, max_bytes, std::span<const probed_collective>(&reduction, 1), options);
}

/// The curve alone (weft-plan --probe writes it for the tuner), with the time it took.
template <element T, backend B>
std::vector<curve_point> probe_reduction(communicator<B>& group, std::size_t max_bytes, bool scatter,
                                         const probe_options& options = {}, double* seconds_spent = nullptr) {
  bucket_size_choice choice = probe_reduction_choice<T>(group, max_bytes, scatter, options);
  if (seconds_spent) *seconds_spent = choice.seconds_spent;
  return std::move(choice.curve);
}

}  // namespace weft::grad
