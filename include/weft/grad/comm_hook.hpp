#pragma once
/// \file
/// The communication hook: how one bucket's gradients go on the wire. By default the synchronizer
/// reduces each bucket in the buffer's own type; a hook can change that (compress float gradients
/// to bfloat16, reduce 16-bit gradients in float, quantise, ...). A hook runs on the caller's
/// thread: `start` issues the (async) communication, `complete` runs once it has finished and
/// leaves the result in the bucket.

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/grad/detail/convert.hpp>

namespace weft::grad {

/// One bucket to reduce.
template <element T>
struct bucket_job {
  std::size_t index = 0;  ///< bucket index (the same bucket on every rank)
  std::span<T> data;      ///< the bucket's slice of the gradient buffer, padding included
  double scale = 1.0;     ///< multiply the sum over ranks by this (fold it into a conversion if you can)
  bool shard = false;     ///< leave only this rank's shard reduced (reduce-scatter), not the whole bucket
  /// The caller is about to wait for this bucket (it was issued by finish() or reduce_all(), not
  /// during backward): host work done on the caller's thread now runs beside the reductions
  /// already queued, which beats queueing it behind them on the progress thread.
  bool caller_waits = false;
};

namespace detail {

/// Runs `work` (a bucket's host-side preparation) so that it is done before the reduction issued
/// next: on the backend's progress thread, queued in order, when the caller is busy with backward
/// (the caller goes on at once; `pending` keeps the queued work's request); on the caller's thread
/// when it is about to wait anyway (it then runs beside the reductions already queued).
template <backend B, element T, class Work>
void run_before_reduction(communicator<B>& group, const bucket_job<T>& job, typename B::request& pending,
                          Work&& work) {
  if constexpr (runs_host_work_in_order<B>) {
    if (!job.caller_waits) {
      pending = group.native().run_in_order(std::forward<Work>(work));
      return;
    }
  }
  work();
}

}  // namespace detail

/// Interface of a communication hook for backend B and gradient type T.
template <backend B, element T>
class comm_hook {
 public:
  using request = typename B::request;
  virtual ~comm_hook() = default;
  /// A short name for reports.
  virtual std::string_view name() const = 0;
  /// Issues the reduction of `job` over `group` and returns its request. Called in bucket order,
  /// identically on every rank. Buffers it uses must stay valid until `complete` is called.
  virtual request start(communicator<B>& group, const bucket_job<T>& job) = 0;
  /// Called once the request has completed: the bucket (or, when `job.shard`, this rank's shard
  /// of it) must then hold the scaled sum over the group.
  virtual void complete(communicator<B>& group, const bucket_job<T>& job) {
    (void)group;
    (void)job;
  }
  /// Called once before the first bucket is started, with every bucket's size in elements
  /// (padding included), indexed by bucket. Size all per-bucket state here: once buckets are in
  /// flight, complete() may run on the backend's progress thread (see complete_is_local), so
  /// start() must not resize anything complete() reads.
  virtual void prepare(std::span<const std::size_t> bucket_elements) { (void)bucket_elements; }
  /// True when complete() only touches the job's memory and the hook's own state of that bucket
  /// (no communication, nothing shared between buckets): the synchronizer may then run it on the
  /// backend's progress thread right after the reduction (see runs_host_work_in_order), off the
  /// caller's thread.
  virtual bool complete_is_local() const noexcept { return false; }
};

/// Puts gradients on the wire as `Wire` (e.g. bfloat16 for float gradients: half the bytes; or
/// float for bfloat16 gradients: an exact-enough sum), converting with the scale folded in, and
/// converts the result back. Keeps one staging buffer per bucket.
template <backend B, element T, element Wire>
class cast_hook final : public comm_hook<B, T> {
  static_assert(buffer_memory_v<B> == memory_space::host,
                "cast_hook converts on the host; with a GPU backend convert in a hook of your own that queues a "
                "kernel on the communicator's stream");

 public:
  using request = typename B::request;

  std::string_view name() const override { return name_; }

  void prepare(std::span<const std::size_t> bucket_elements) override {
    // Sized here, never in start(): the progress thread may be converting an earlier bucket back
    // (complete) while the caller starts the next one, and a reallocation under that reader
    // would leave a bucket unreduced without a word.
    conversions_.clear();
    staging_.clear();
    staging_.reserve(bucket_elements.size());
    for (std::size_t n : bucket_elements) staging_.emplace_back(n);
    conversions_.resize(bucket_elements.size());
  }

  request start(communicator<B>& group, const bucket_job<T>& job) override {
    if (job.index >= staging_.size() || staging_[job.index].size() != job.data.size())
      fail("cast_hook on group '" + group.name() + "': bucket " + std::to_string(job.index) + " of " +
           std::to_string(job.data.size()) + " elements was not announced by prepare() (" +
           std::to_string(staging_.size()) + " buckets prepared); call prepare() with every bucket's size first");
    std::vector<Wire>& wire = staging_[job.index];
    std::span<const T> from = job.data;
    std::span<Wire> to = wire;
    const double scale = job.scale;
    detail::run_before_reduction(group, job, conversions_[job.index],
                                 [from, to, scale] { detail::convert_scaled<Wire, T>(from, to, scale); });
    if (job.shard) return group.reduce_scatter_in_place_async(wire);
    return group.all_reduce_async(wire);
  }

  bool complete_is_local() const noexcept override { return true; }

  void complete(communicator<B>& group, const bucket_job<T>& job) override {
    std::vector<Wire>& wire = staging_[job.index];
    if (!job.shard) {
      detail::convert_scaled<T, Wire>(wire, job.data, 1.0);
      return;
    }
    std::size_t length = wire.size() / static_cast<std::size_t>(group.size());
    std::size_t at = static_cast<std::size_t>(group.rank()) * length;
    detail::convert_scaled<T, Wire>(std::span<const Wire>(wire).subspan(at, length), job.data.subspan(at, length),
                                    1.0);
  }

 private:
  static constexpr std::string_view name_ = "cast";
  std::vector<std::vector<Wire>> staging_;
  std::vector<request> conversions_;  ///< last: finished before the staging buffers go
};

/// Float gradients travel as bfloat16 (half the bytes, about 3 significant digits per element).
template <backend B>
using bfloat16_compression_hook = cast_hook<B, float, bfloat16>;

}  // namespace weft::grad
