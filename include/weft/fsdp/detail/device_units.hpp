#pragma once
/// \file
/// A sharded model's device part (GPU backends: NCCL). Shards, gathered parameters and gradients
/// are device memory; forward, backward and the optimizer run on one compute stream
/// (`set_compute_stream`, default: the default stream), which waits for a unit's gather without
/// the host waiting, and every gather and reduction waits for the compute queued before it.
/// Parameters are gathered and gradients reduced in the master type (float or double; a bfloat16
/// gather would need a conversion kernel, which weft does not ship), and each reduction writes the
/// sum straight into the gradient shard: this rank's block of the unit's gradient buffer starts as
/// the shard accumulated so far, instead of an addition after the reduction. The mean (or
/// 1/tokens) is folded into the window's last reductions. Nothing in a step waits on the host:
/// finish() makes the compute stream wait for the reductions (events) and returns, and requests
/// that are no longer needed (a gather the compute stream now waits for, a reduction finish()
/// ordered it after) are kept aside and polled instead of waited for, so replacing one never
/// blocks; a failure among them is reported by the next finish(). The shared state:
/// fsdp/detail/model_core.hpp; the memory: fsdp/detail/device_unit_buffer.hpp.

#include <weft/config.hpp>

#include <weft/backend/backend.hpp>
#include <weft/core/dtype.hpp>

namespace weft::fsdp::detail {
template <backend B, element Param>
class device_units;
}  // namespace weft::fsdp::detail

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <cstddef>
#include <exception>
#include <utility>
#include <vector>

#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/core/error.hpp>
#include <weft/fsdp/detail/model_core.hpp>
#include <weft/fsdp/detail/unit_buffer.hpp>
#include <weft/fsdp/schedule.hpp>
#include <weft/grad/options.hpp>

namespace weft::fsdp::detail {

template <element Param>
struct reduction_staging<Param, memory_space::device> {
  std::size_t bytes() const noexcept { return 0; }
  void release() noexcept {}
};

template <backend B, element Param>
class device_units : public model_core<B, Param> {
  using core = model_core<B, Param>;

 public:
  /// The stream forward, backward and the optimizer run on. Gathers and reductions are ordered
  /// after the work queued on it; it waits for a unit's gather when the unit begins. Default: the
  /// default stream. The stream must outlive the model, whose memory is given back in its order.
  void set_compute_stream(cudaStream_t stream) {
    if (this->frozen_ && this->in_micro_step())
      fail(this->where() + ": set_compute_stream() in the middle of a micro-step; set it between micro-steps");
    if (stream != compute_) {
      cuda::device_guard on(this->shard_group().native().device());
      cuda::wait_for_stream(stream, compute_);  // what follows sees what the old stream did
    }
    compute_ = stream;
  }
  cudaStream_t compute_stream() const noexcept { return compute_; }

 protected:
  using typename core::master_type;
  using typename core::unit_state;

  using core::core;
  /// Device memory is given back after the compute and communication queued so far.
  ~device_units() {
    try {
      for (unit_state& s : this->units_) {
        s.work.release(streams_of());
        s.gathered.release(streams_of());
        s.master.release(streams_of());
        s.grads.release(streams_of());
      }
    } catch (...) {  // a destructor cannot throw; the memory goes back when the process ends
    }
  }

  // ---- what sharded_model<B, Param> calls --------------------------------------------------

  /// The device, the compute stream, the shard group's stream and (HSDP) the replicate group's,
  /// whose all-reduce writes the gradient shards: memory is given back after all of them.
  streams<memory_space::device> streams_of() const {
    return {this->shard_group().native().device(), compute_, this->shard_group().native().stream(),
            this->replicate_ ? this->replicate_group().native().stream() : nullptr};
  }

  /// The token count is folded into the window's last reductions: it must be known before them.
  void check_backward_can_begin() const {
    if (this->options_.scale == grad::scaling::token_count && this->last_micro_step() && !this->token_count_)
      fail(this->where() + ": scaling::token_count, but set_token_count() was not called before the backward of the "
           "window's last micro-step; on a GPU backend the division is folded into the reductions, so the count "
           "must be known when the first one is issued");
  }
  /// The division is folded into each unit's reduction as it is issued: a count changed during the
  /// window's last backward would scale some units and not others (the synchronizer refuses it too).
  void check_token_count_can_change() const {
    if (this->last_micro_step() && this->during_ == pass::backward)
      fail(this->where() + ": set_token_count() during the window's last backward; on a GPU backend the division is "
           "folded into each unit's reduction, so set the count before that micro-step's first backward(u)");
  }

  /// The reduction writes its sum straight into the gradient shard, so this rank's block of the
  /// unit's gradient buffer starts as the shard accumulated so far (on one replica only: the
  /// all-reduce across replicas adds the others').
  void seed_gradients(std::size_t u) {
    unit_state& s = this->units_[u];
    const unit_layout& layout = this->plan_.unit(u);
    if (!this->replicate_ || this->replicate_group().rank() == 0)
      copy_in_compute_order(s.work.span().subspan(layout.shard_offset(this->shard_group().rank()),
                                                  layout.shard_elements()),
                            std::as_const(s.grads).span(), streams_of());
  }

  void issue_gather(unit_state& s, const unit_layout&) {
    order_communication_after_compute(streams_of());  // the optimizer's update of the shard
    retire(s.gather);  // assigning over a pending request would wait for it
    s.gather = this->shard_group().all_gather_async(std::as_const(s.master).span(), s.gathered.span());
  }
  /// The unit's kernels wait for its gather; the host goes on (the request is only polled now).
  void order_after_gather(unit_state& s) {
    s.gather.make_stream_wait(compute_);
    retire(s.gather);
  }
  /// The release is ordered after the gather and the kernels that read the parameters.
  void before_free_params(unit_state&) {}

  /// Reduce-scatters the unit's gradients into the gradient shard (the window's scale folded into
  /// its last micro-step's), then all-reduces the shard across replicas on the replicate group's
  /// stream, after the reduce-scatter.
  void issue_reduce_of(std::size_t u) {
    unit_state& s = this->units_[u];
    order_communication_after_compute(streams_of());  // backward's gradient kernels
    std::span<const Param> all = std::as_const(s.work).span();
    std::span<master_type> mine = s.grads.span();
    const double factor = this->last_micro_step() ? this->scale_factor().value_or(1.0) : 1.0;
    retire(s.reduce);
    retire(s.replicate);
    s.reduce = factor == 1.0 ? this->shard_group().reduce_scatter_async(all, mine)
                             : this->shard_group().reduce_scatter_scaled_async(all, mine, factor);
    if (this->replicate_) {
      // A failure here is kept for finish(), as the host part keeps one seen while polling: thrown
      // now, it would leave the unit reduce-scattered but not done, and finish() would
      // reduce-scatter it a second time on this rank alone.
      try {
        s.reduce.make_stream_wait(this->replicate_group().native().stream());
        s.replicate = this->replicate_group().all_reduce_async(mine);
      } catch (...) {
        if (!this->failure_) this->failure_ = std::current_exception();
      }
    }
    s.work.release(streams_of());  // after the reduce-scatter that reads it
  }

  /// The sum is already in the gradient shard (or will be, in stream order): with `wait`, the
  /// compute stream is made to wait for the reduce-scatter and the all-reduce across replicas,
  /// not the host; otherwise the requests are only tested.
  bool advance_reduction(std::size_t u, bool wait) {
    unit_state& s = this->units_[u];
    if (wait) {
      order_compute_after(s.reduce);
      order_compute_after(s.replicate);
      return true;
    }
    return s.reduce.test() && s.replicate.test();
  }

  /// The end of a micro-step: what the unit still has in flight is ordered before the compute
  /// stream's next work and kept aside, not waited for.
  void settle_requests(unit_state& s) {
    order_compute_after(s.reduce);
    order_compute_after(s.replicate);
    retire(s.gather);  // its memory goes back after the shard group's stream
  }

  /// Drops the set-aside requests that have completed; a failed one throws here (once).
  void poll_retired() {
    std::exception_ptr failure;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < retired_.size(); ++i) {
      bool done = true;
      try {
        done = retired_[i].test();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      if (!done) {
        if (kept != i) retired_[kept] = std::move(retired_[i]);
        ++kept;
      }
    }
    retired_.erase(retired_.begin() + static_cast<std::ptrdiff_t>(kept), retired_.end());
    if (failure) std::rethrow_exception(failure);
  }

  /// The window's last reductions applied the scale.
  void apply_window_scale(double) {}

 private:
  using request = typename core::request;

  /// Keeps a pending request aside, to be polled (poll_retired) rather than waited for; the
  /// member is left empty, so assigning a new request over it does not block.
  void retire(request& r) {
    if (r.pending()) retired_.push_back(std::move(r));
    r = request();
  }
  /// The compute stream waits for `r`'s operation; `r` is then only polled.
  void order_compute_after(request& r) {
    r.make_stream_wait(compute_);
    retire(r);
  }

  cudaStream_t compute_ = nullptr;  ///< where forward, backward and the optimizer run
  /// Requests the streams wait for and the host only polls, oldest first. Destroyed before the
  /// units' memory (a derived class's members go first): destroying the model waits for them.
  std::vector<request> retired_;
};

}  // namespace weft::fsdp::detail

#endif  // WEFT_HAS_CUDA
