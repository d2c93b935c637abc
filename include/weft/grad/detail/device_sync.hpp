#pragma once
/// \file
/// A gradient synchronizer's device part (GPU backends: NCCL), where nothing waits on the host.
/// Backward runs on a compute stream (`set_compute_stream`, default the default stream); a ready
/// bucket's reduction is queued on the communicator's own stream behind an event recorded on the
/// compute stream, so it reads the gradients only after the kernels that wrote them and runs
/// beside the rest of backward; scaling is folded into the reduction (NCCL's pre-multiplied sum);
/// finish() makes the compute stream wait for the reductions and returns at once, keeping their
/// requests (polled: a failed peer surfaces at the next call) until they are seen complete. The
/// shared state and what is reduced when: grad/detail/sync_core.hpp, grad/reduction_schedule.hpp.

#include <weft/config.hpp>

#include <weft/backend/backend.hpp>
#include <weft/core/dtype.hpp>

namespace weft::grad::detail {
template <backend B, element T>
class device_sync;
}  // namespace weft::grad::detail

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <exception>
#include <utility>
#include <vector>

#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/nccl/detail/policy.hpp>
#include <weft/core/error.hpp>
#include <weft/core/reduce_op.hpp>
#include <weft/grad/comm_hook.hpp>
#include <weft/grad/detail/device_timeline.hpp>
#include <weft/grad/detail/sync_core.hpp>
#include <weft/grad/param_gather.hpp>
#include <weft/grad/step_report.hpp>

namespace weft::grad::detail {

template <backend B, element T>
class device_sync : public sync_core<B, T> {
  using core = sync_core<B, T>;

 public:
  using typename core::request;

  /// The stream backward (and the optimizer) run on; reductions are ordered after the work queued
  /// on it, and it is made to wait for them at finish(). Default: the default stream.
  void set_compute_stream(cudaStream_t stream) {
    if (this->schedule_.in_window())
      fail(this->where() + ": set_compute_stream() inside an accumulation window; set it between optimizer steps");
    // What follows on the new stream (the optimizer step) must still see the reductions that
    // the old one was made to wait for.
    if (stream != compute_) {
      cuda::device_guard on(this->group().native().device());
      cuda::wait_for_stream(stream, compute_);
    }
    compute_ = stream;
  }
  cudaStream_t compute_stream() const noexcept { return compute_; }

 protected:
  device_sync(communicator<B>& group, sync_options options) : core(group, options) {}
  ~device_sync() = default;

  // ---- what synchronizer<B, T> calls -------------------------------------------------------

  /// The gradient buffer, on the group's device (not the calling thread's).
  typename core::buffer_type make_grads() {
    return typename core::buffer_type(this->plan_, this->group().native().device());
  }

  void prepare_space(std::size_t buckets) {
    timeline_ = device_timeline(buckets, this->group().native().device());
    next_complete_ = 0;
  }

  void zero_buffer() { this->grads_.zero(compute_); }

  /// The start of a micro-step; on the reducing one, the events of two steps ago are about to
  /// be reused: they are read first.
  void begin_space_micro_step() {
    if (!reduces()) return;
    poll_retired();
    // Their reductions are waited for through their requests, which notice a failed peer (an
    // event wait would not).
    if (timeline_.next_set_unread(this->steps_)) {
      if (this->steps_ >= 2) wait_retired_through(this->steps_ - 2);
      step_report old = summarize(timeline_.read(this->steps_, *this->plan_, event_waiter()));
      if (this->report_.buckets.empty() || old.step >= this->report_.step) this->report_ = std::move(old);
    }
    timeline_.begin(this->steps_, compute_);
  }

  void bucket_ready(std::size_t b) { timeline_.bucket_ready(b, compute_); }

  /// The newest step's GPU timings, once its reductions have run.
  void refresh_report() {
    if (!timeline_.newest_unread()) return;
    drain_retired();
    this->report_ = summarize(timeline_.read_newest(*this->plan_, event_waiter()));
  }

  /// The updated shards were written on the compute stream: the gathers follow it, and the
  /// compute stream is the one that waits for them.
  void* gather_consumer() {
    cuda::device_guard on(this->group().native().device());
    cuda::wait_for_stream(this->group().native().stream(), compute_);
    return compute_;
  }
  /// The compute stream waits for the gathers; their requests are kept so the host does not.
  void keep_gather(param_gather<B>& gathering) {
    for (request& r : std::move(gathering).take_requests()) retired_.push_back({this->steps_, std::move(r)});
  }

  void issue(std::size_t b) {
    auto t = core::clock::now();
    bucket_job<T>& job = this->prepare_job(b);
    timeline_.bucket_start(b, compute_, this->group().native().stream());
    this->requests_[b] = this->hook_ ? this->hook_->start(this->group(), job) : start_direct(job);
    timeline_.bucket_issued(b, this->group().native().stream());
    this->issue_s_ += std::chrono::duration<double>(core::clock::now() - t).count();
  }

  /// Only failures are looked for: completion is the streams' business.
  void poll() {
    for (std::size_t b = next_complete_; b < this->schedule_.issued_count(); ++b) (void)this->requests_[b].test();
  }

  /// The end of the reducing micro-step, every bucket issued: hooks queue their epilogues, the
  /// compute stream waits for the reductions, and the requests are kept (not waited for) until
  /// they are seen complete, so the host can queue the next step at once. Returns whether some
  /// bucket went out unscaled for want of a token count.
  bool complete_window(bool overlap_expected) {
    for (std::size_t b = next_complete_; b < this->requests_.size(); ++b)
      if (this->hook_) this->hook_->complete(this->group(), this->jobs_[b]);
    next_complete_ = this->requests_.size();
    // Backward's end first: recorded after the waits, it would include them.
    timeline_.end_backward(compute_, overlap_expected, this->issue_s_);
    for (request& r : this->requests_) {
      r.make_stream_wait(compute_);
      retired_.push_back({this->steps_, std::move(r)});
      r = request();
    }
    if (this->hook_) {
      // A hook's epilogue kernels follow the requests' events on the communicator's stream.
      cuda::device_guard on(this->group().native().device());
      cuda::wait_for_stream(compute_, this->group().native().stream());
    }
    poll_retired();
    bool token_count_missing = false;
    for (char d : this->deferred_) token_count_missing = token_count_missing || d != 0;
    return token_count_missing;
  }

  /// A failed reduction's requests stay with their buckets; the streams order what follows.
  void after_failure() noexcept {}
  std::exception_ptr take_poll_failure() noexcept { return nullptr; }
  void end_space_micro_step() noexcept { next_complete_ = 0; }
  /// The report is read from the GPU's events later (refresh_report, or two steps on).
  void report_step(bool, double) {}

 private:
  bool reduces() const noexcept {
    return this->schedule_.micro_step() == this->options_.accumulation_steps - 1;
  }

  /// Waits for a timing event by polling it with the group's NCCL error state and deadline.
  auto event_waiter() {
    return [this](const cuda::event& e) {
      this->group().native().wait_event(e.native(), "reading a step's GPU timings");
    };
  }

  /// The default path: the bucket in its own type. A mean over the group alone is NCCL's `avg`;
  /// any other factor is folded into the reduction kernel (no pass over the bucket of its own).
  /// The kernel applies the factor in T: one T cannot hold accurately is refused (alike on every
  /// rank).
  request start_direct(bucket_job<T>& job) {
    if (job.scale == 1.0 / static_cast<double>(this->group().size()) && this->group().size() > 1) {
      if (job.shard) return this->group().reduce_scatter_in_place_async(job.data, reduce_op::avg);
      return this->group().all_reduce_async(job.data, reduce_op::avg);
    }
    if (job.scale != 1.0) {
      if (const auto fold = weft::detail::nccl::fold_scale_factor(job.scale, dtype_of<T>); !fold.fold)
        fail(this->where() + ": " + weft::detail::nccl::unfoldable_factor_message(job.scale, dtype_of<T>, fold));
      if (job.shard) return this->group().reduce_scatter_in_place_scaled_async(job.data, job.scale);
      return this->group().all_reduce_scaled_async(job.data, job.scale);
    }
    if (job.shard) return this->group().reduce_scatter_in_place_async(job.data, reduce_op::sum);
    return this->group().all_reduce_async(job.data, reduce_op::sum);
  }

  /// Totals from the GPU's own times: the compute stream waits only for the reductions that end
  /// after backward (issuing is host time that the GPU does not see).
  step_report summarize(step_report r) {
    const auto spans = core::spans_of(r);
    r.comm_s = spans.comm_s;
    r.finish_s = spans.last_end_s - r.backward_s;
    r.exposed_s = r.finish_s;
    r.hidden_s = std::min(spans.before_s, spans.comm_s);
    this->warn_if_not_overlapped(r, spans.started_during_backward);
    return r;
  }

  /// Drops the earlier steps' requests that have completed; a failed one throws here.
  void poll_retired() {
    std::size_t done = 0;
    while (done < retired_.size() && retired_[done].pending.test()) ++done;
    retired_.erase(retired_.begin(), retired_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  /// Waits (watching for failed peers) for the retired requests of steps up to `step`.
  void wait_retired_through(std::size_t step) {
    std::size_t done = 0;
    while (done < retired_.size() && retired_[done].step <= step) retired_[done++].pending.wait();
    retired_.erase(retired_.begin(), retired_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  void drain_retired() {
    for (retired_request& r : retired_) r.pending.wait();
    retired_.clear();
  }

  struct retired_request {
    std::size_t step = 0;  ///< the optimizer step that issued it
    request pending;
  };

  cudaStream_t compute_ = nullptr;  ///< the stream gradients are produced on
  device_timeline timeline_;        ///< ordering and timing events
  std::size_t next_complete_ = 0;   ///< buckets before it have had their completion queued
  // Destroyed before the timeline's events and the core's buffer: in-flight requests finish first.
  std::vector<retired_request> retired_;  ///< issued requests not yet seen complete
};

}  // namespace weft::grad::detail

#endif  // WEFT_HAS_CUDA
