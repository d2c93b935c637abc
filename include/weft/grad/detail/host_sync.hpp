#pragma once
/// \file
/// A gradient synchronizer's host part (host-memory backends: MPI): buckets are scaled before
/// their reduction (on the communicator's progress thread when issued during backward, so the
/// caller's backward never pays for it), reduced asynchronously, and completed when the caller
/// next polls or finishes; finish() of the window's last micro-step waits for every bucket, and
/// a token count that arrived late is applied in one more pass. The shared state and what is
/// reduced when: grad/detail/sync_core.hpp, grad/reduction_schedule.hpp.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/core/reduce_op.hpp>
#include <weft/grad/comm_hook.hpp>
#include <weft/grad/detail/convert.hpp>
#include <weft/grad/detail/sync_core.hpp>
#include <weft/grad/param_gather.hpp>
#include <weft/grad/step_report.hpp>

namespace weft::grad::detail {

template <backend B, element T>
class host_sync : public sync_core<B, T> {
  using core = sync_core<B, T>;

 public:
  using typename core::clock;
  using typename core::request;

 protected:
  host_sync(communicator<B>& group, sync_options options) : core(group, options) {}
  ~host_sync() = default;

  // ---- what synchronizer<B, T> calls -------------------------------------------------------

  typename core::buffer_type make_grads() { return typename core::buffer_type(this->plan_); }

  /// After freeze(): per-bucket state; precision = fp32 for 16-bit gradients is a conversion hook.
  void prepare_space(std::size_t buckets) {
    prologues_.clear();
    prologues_.resize(buckets);
    epilogues_.clear();
    epilogues_.resize(buckets);
    completed_in_epilogue_.assign(buckets, 0);
    next_complete_ = 0;
    if (this->options_.precision == reduce_precision::fp32 && is_16bit_float_v<T>)
      this->hook_ = std::make_shared<cast_hook<B, T, float>>();
  }

  void zero_buffer() { this->grads_.zero(); }
  void begin_space_micro_step() {}
  void bucket_ready(std::size_t) {}
  void refresh_report() {}
  /// The host waits for gathers itself: no consumer stream.
  void* gather_consumer() { return nullptr; }
  void keep_gather(param_gather<B>&) {}

  void issue(std::size_t b) {
    auto t = clock::now();
    bucket_job<T>& job = this->prepare_job(b);
    this->requests_[b] = this->hook_ ? this->hook_->start(this->group(), job) : start_direct(job);
    completed_in_epilogue_[b] = 0;
    if constexpr (runs_host_work_in_order<B>) {
      // The hook's epilogue and the end time, on the progress thread right after the reduction:
      // the time is exact, and a conversion back runs beside the caller's backward.
      if (!job.caller_waits && (!this->hook_ || this->hook_->complete_is_local())) {
        completed_in_epilogue_[b] = 1;
        epilogues_[b] = this->group().native().run_in_order([this, b] {
          if (this->hook_) this->hook_->complete(this->group(), this->jobs_[b]);
          this->timings_[b].end_s = this->since_start();
        });
      }
    }
    this->issue_s_ += std::chrono::duration<double>(clock::now() - t).count();
  }

  /// Records buckets that have finished, oldest first (they finish in issue order). A failure
  /// seen here is kept for finish(): thrown in the middle of backward, it would stop this rank
  /// from issuing the buckets its peers are already waiting in.
  void poll() {
    while (next_complete_ < this->schedule_.issued_count()) {
      const std::size_t b = next_complete_;
      try {
        if (!bucket_done(b)) return;
        complete(b);
      } catch (...) {
        if (!failure_) failure_ = std::current_exception();
      }
      ++next_complete_;
    }
  }

  /// The reducing micro-step's end, every bucket issued: waits for each in order, runs its
  /// completion, and applies a token count that was unknown at issue. Returns whether the count
  /// is still missing.
  bool complete_window(bool /*overlap_expected*/) {
    wait_and_complete_issued();
    bool token_count_missing = false;
    for (std::size_t b = 0; b < this->deferred_.size(); ++b) {
      if (!this->deferred_[b]) continue;
      if (!this->token_count_) {
        token_count_missing = true;
        continue;
      }
      scale_in_place<T>(this->result_of(b), 1.0 / *this->token_count_);
    }
    return token_count_missing;
  }

  /// After a failure: waits for what is still in flight so no reduction outlives the step that
  /// issued it; further failures are the same fault seen again and are dropped.
  void after_failure() noexcept {
    for (std::size_t b = 0; b < this->schedule_.issued_count(); ++b) {
      for (request* r : {&epilogues_[b], &prologues_[b], &this->requests_[b]}) {
        try {
          r->wait();
        } catch (...) {
        }
      }
    }
  }

  /// A failure seen while polling during backward (it happened first), handed over once.
  std::exception_ptr take_poll_failure() noexcept { return std::exchange(failure_, nullptr); }

  /// The micro-step ended: the next one completes from its first bucket.
  void end_space_micro_step() noexcept { next_complete_ = 0; }

  /// The report of the step just reduced: the caller paid for issuing and for finish().
  void report_step(bool overlap_expected, double backward_end) {
    step_report r;
    r.step = this->steps_;
    r.overlap_expected = overlap_expected;
    r.backward_s = backward_end;
    r.issue_s = this->issue_s_;
    r.finish_s = this->since_start() - backward_end;
    r.buckets = this->timings_;
    const auto spans = core::spans_of(r);
    r.comm_s = spans.comm_s;
    r.exposed_s = r.issue_s + r.finish_s;
    r.hidden_s = std::max(0.0, std::min(spans.before_s - r.issue_s, spans.comm_s));
    this->warn_if_not_overlapped(r, spans.started_during_backward);
    this->report_ = std::move(r);
  }

 private:
  /// The default path: the bucket in its own type. A mean over the group alone is the backend's
  /// `avg` (MPI divides on its progress thread); any other factor is applied before the sum,
  /// which also keeps 16-bit sums in range.
  request start_direct(bucket_job<T>& job) {
    reduce_op op = reduce_op::sum;
    if (job.scale == 1.0 / static_cast<double>(this->group().size()) && this->group().size() > 1) {
      op = reduce_op::avg;
    } else if (job.scale != 1.0) {
      std::span<T> data = job.data;
      const double factor = job.scale;
      run_before_reduction(this->group(), job, prologues_[job.index],
                           [data, factor] { scale_in_place<T>(data, factor); });
    }
    if (job.shard) return this->group().reduce_scatter_in_place_async(job.data, op);
    return this->group().all_reduce_async(job.data, op);
  }

  void complete(std::size_t b) {
    if (completed_in_epilogue_[b]) return;
    if (this->hook_) this->hook_->complete(this->group(), this->jobs_[b]);
    this->timings_[b].end_s = this->since_start();
  }

  /// Whether bucket b's reduction, with its prologue and epilogue, is done (rethrows a failure).
  /// They run in order, so once the epilogue is done the others are.
  bool bucket_done(std::size_t b) {
    if (!epilogues_[b].test()) return false;
    return prologues_[b].test() && this->requests_[b].test();
  }
  void bucket_wait(std::size_t b) {
    epilogues_[b].wait();
    prologues_[b].wait();
    this->requests_[b].wait();
  }

  /// Waits for every issued bucket in order and runs its completion.
  void wait_and_complete_issued() {
    for (; next_complete_ < this->schedule_.issued_count(); ++next_complete_) {
      const std::size_t b = next_complete_;
      auto t = clock::now();
      bucket_wait(b);
      this->timings_[b].exposed_s = std::chrono::duration<double>(clock::now() - t).count();
      complete(b);
    }
  }

  std::size_t next_complete_ = 0;  ///< buckets before it are complete
  std::exception_ptr failure_;     ///< a bucket's failure seen while polling, rethrown by finish()
  std::vector<char> completed_in_epilogue_;  ///< the bucket's hook epilogue and end time ran on the progress thread
  // Destroyed before the core's reductions; each waits for its own work.
  std::vector<request> prologues_;  ///< per bucket: scaling queued before the reduction
  std::vector<request> epilogues_;  ///< per bucket: the hook's completion and the end time, after the reduction
};

}  // namespace weft::grad::detail
