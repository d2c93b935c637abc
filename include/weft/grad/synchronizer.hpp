#pragma once
/// \file
/// `weft::grad::synchronizer<B, T>`: bucketed, accumulation-aware, overlapped reduction of a
/// model's gradients over a data-parallel group, for any backend.
///
/// Use:
///   1. `add_param(name, count)` for every parameter, in model order (forward order);
///   2. `freeze()` (collective): plans the buckets, allocates the flat gradient buffer, and checks
///      that every rank of the group planned the same buckets;
///   3. each micro-step: backward adds each gradient into `grad(p)` and calls `mark_ready(p)` (or
///      `mark_ready(p, gradient)`, which adds it for you), then `finish()`; trainers without
///      per-parameter hooks call `reduce_all()` instead of the marks and `finish()`;
///   4. when `finish()` returns true, the buffer holds the scaled, reduced gradients: step the
///      optimizer, then `zero_grad()`.
///
/// On the last micro-step of an accumulation window, a bucket's reduction is issued as soon as all
/// of its parameters are marked and every earlier bucket has been issued: reductions go out in
/// bucket order, the same on every rank, whatever order the ranks' backward passes mark
/// parameters in. On the other micro-steps nothing is communicated.
///
/// On a GPU backend (NCCL) the buffer is device memory and nothing waits on the host: backward
/// runs on a compute stream (`set_compute_stream`, default the default stream); a ready bucket's
/// reduction is queued on the communicator's own stream behind an event recorded on the compute
/// stream, so it reads the gradients only after the kernels that wrote them and runs beside the
/// rest of backward; scaling is folded into the reduction (NCCL's pre-multiplied sum); finish()
/// makes the compute stream wait for the reductions and returns at once, so the optimizer step
/// queued next reads reduced gradients. Gradients are added into grad(p) by the trainer's own
/// kernels.
///
/// The code: what is reduced when (pure) is grad/reduction_schedule.hpp; the state both memory
/// spaces share is grad/detail/sync_core.hpp; host buffers (MPI) are grad/detail/host_sync.hpp,
/// device buffers ordered by CUDA streams and events (NCCL) grad/detail/device_sync.hpp. This
/// file is the step's flow, the same for both.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/bucket_sizing.hpp>
#include <weft/grad/comm_hook.hpp>
#include <weft/grad/detail/convert.hpp>
#include <weft/grad/detail/device_sync.hpp>
#include <weft/grad/detail/fingerprint.hpp>
#include <weft/grad/detail/host_sync.hpp>
#include <weft/grad/flat_buffer.hpp>
#include <weft/grad/options.hpp>
#include <weft/grad/param_gather.hpp>
#include <weft/grad/reduction_schedule.hpp>
#include <weft/grad/step_report.hpp>

namespace weft::grad {

namespace detail {
/// The part of a synchronizer that handles its backend's memory space.
template <backend B, element T>
using sync_part = std::conditional_t<buffer_memory_v<B> == memory_space::device, device_sync<B, T>, host_sync<B, T>>;
}  // namespace detail

/// `T` is the gradients' type: float, double, weft::half or weft::bfloat16.
///
/// On a GPU backend it also has `set_compute_stream(cudaStream_t)` and `compute_stream()`
/// (grad/detail/device_sync.hpp).
template <backend B, element T = float>
  requires(is_floating(dtype_of<T>))
class synchronizer : public detail::sync_part<B, T> {
  using part = detail::sync_part<B, T>;

 public:
  using request = typename B::request;
  using clock = std::chrono::steady_clock;
  /// Whether gradients live in device memory (a GPU backend) rather than host memory.
  static constexpr bool on_device = buffer_memory_v<B> == memory_space::device;
  using buffer_type = flat_buffer<T, buffer_memory_v<B>>;

  /// A synchronizer over `group` (the dp or dp-cp group); the group must outlive it, and may move.
  explicit synchronizer(communicator<B>& group, sync_options options = {}) : part(group, options) {
    if (options_.accumulation_steps < 1)
      fail(where() + ": accumulation_steps is " + std::to_string(options_.accumulation_steps) +
           "; it must be at least 1 (1: reduce every step)");
    if (options_.bucket_bytes == 0 || options_.first_bucket_bytes == 0)
      fail(where() + ": bucket_bytes and first_bucket_bytes must be positive");
    if (on_device && options_.precision == reduce_precision::fp32 && detail::is_16bit_float_v<T>)
      fail(where() + ": precision = fp32 converts 16-bit gradients on the host, but this backend's buffer is device "
           "memory; keep the gradient buffer in float (synchronizer<B, float>) and let backward add its 16-bit "
           "gradients into it, or reduce in the gradients' own type (precision = own)");
  }

  synchronizer(const synchronizer&) = delete;
  synchronizer& operator=(const synchronizer&) = delete;
  /// Waits for reductions still in flight (their requests do), so the buffer outlives them.
  ~synchronizer() = default;

  // ---- registration ------------------------------------------------------------------------

  /// Registers a parameter of `count` elements and returns its index (0, 1, ... in call order).
  /// Register in forward order: buckets are formed from the last parameter backwards.
  std::size_t add_param(std::string name, std::size_t count) {
    if (frozen())
      fail(where() + ": add_param('" + name + "') after freeze(): the bucket plan is frozen; register every "
           "parameter before freeze()");
    if (count == 0) fail(where() + ": parameter '" + name + "' has 0 elements; register only parameters with gradients");
    specs_.push_back({std::move(name), count});
    return specs_.size() - 1;
  }

  /// Plans the buckets, allocates the zeroed gradient buffer, and checks (collectively) that every
  /// rank of the group has the same plan: call it on every rank, after the last add_param().
  void freeze() {
    if (frozen()) fail(where() + ": freeze() called twice");
    if (specs_.empty()) fail(where() + ": freeze() with no parameters registered");
    const bool measure = options_.bucket_bytes == measured_bucket_bytes;
    auto plan_with_cap = [&](std::size_t cap) {
      return std::make_shared<const bucket_plan>(specs_, dtype_of<T>,
                                                 plan_options{.bucket_bytes = cap,
                                                              .first_bucket_bytes = options_.first_bucket_bytes,
                                                              .pad_elements = options_.pad_elements,
                                                              .dp = group().size()});
    };
    // The parameters are compared before the probe, whose sizes follow from them (a measured
    // cap is compared as "measured": the probe's result is the same on every rank by construction).
    auto plan = plan_with_cap(measure ? options_.first_bucket_bytes : options_.bucket_bytes);
    std::uint64_t mode = static_cast<std::uint64_t>(options_.shard_optimizer_state) |
                         static_cast<std::uint64_t>(options_.accumulation_steps) << 1 |
                         static_cast<std::uint64_t>(options_.scale) << 32 |
                         static_cast<std::uint64_t>(options_.precision) << 40 | static_cast<std::uint64_t>(measure) << 48;
    group().expect_same_on_all_ranks(
        "the gradient bucket plan (parameter names, sizes and order, element type, bucket options)",
        plan->fingerprint());
    detail::fingerprint_builder settings;
    settings.add(mode);
    if (measure) {
      const probe_options& p = options_.probe;
      settings.add(p.smallest_bytes).add(p.largest_bytes).add(std::bit_cast<std::uint64_t>(p.budget_s));
      settings.add(static_cast<std::uint64_t>(p.repeats)).add(std::bit_cast<std::uint64_t>(p.tolerance)).add(p.run_bytes);
    }
    group().expect_same_on_all_ranks(
        "the synchronizer options (sharding, accumulation, scaling, precision, measured or given bucket cap, "
        "probe options)",
        settings.value());
    if (measure) {
      this->bucket_choice_ = measure_bucket_bytes();
      plan = plan_with_cap(this->bucket_choice_.bucket_bytes);
    } else {
      this->bucket_choice_ = bucket_size_choice{};
      this->bucket_choice_.bucket_bytes = options_.bucket_bytes;
    }
    plan_ = std::move(plan);
    this->grads_ = this->make_grads();
    const std::size_t buckets = plan_->buckets().size();
    schedule_ = reduction_schedule(*plan_, specs_.size(), options_.accumulation_steps);
    this->requests_.clear();
    this->requests_.resize(buckets);
    this->jobs_.assign(buckets, {});
    this->deferred_.assign(buckets, 0);
    this->timings_.assign(buckets, {});
    if (options_.shard_optimizer_state) {
      this->shard_ranges_ = shard_ranges_of(*plan_, group().rank(), group().size());
      this->shard_segments_ = shard_segments_of(*plan_, specs_, group().rank(), group().size());
    }
    this->prepare_space(buckets);
    prepare_hook();
  }

  bool frozen() const noexcept { return plan_ != nullptr; }

  /// Replaces how buckets go on the wire (before the first step; the same hook on every rank).
  void set_comm_hook(std::shared_ptr<comm_hook<B, T>> hook) {
    if (schedule_.in_window())
      fail(where() + ": set_comm_hook() inside an accumulation window; set it between optimizer steps");
    if (options_.precision == reduce_precision::fp32 && detail::is_16bit_float_v<T>)
      fail(where() + ": a comm hook replaces precision = fp32; use precision = own with a hook that reduces in "
           "float (cast_hook<B, T, float>)");
    this->hook_ = std::move(hook);
    prepare_hook();
  }

  // ---- the buffer --------------------------------------------------------------------------

  const bucket_plan& plan() const { return *checked_plan("plan()"); }
  /// The bucket cap the plan uses and, when it was measured, the curve it was chosen from.
  const bucket_size_choice& bucket_choice() const {
    checked_plan("bucket_choice()");
    return this->bucket_choice_;
  }
  std::shared_ptr<const bucket_plan> shared_plan() const { return checked_plan("shared_plan()"); }
  buffer_type& grads() {
    checked_plan("grads()");
    return this->grads_;
  }
  /// The gradient of parameter `param`: backward adds into it (device memory on a GPU backend).
  std::span<T> grad(std::size_t param) {
    checked_plan("grad()");
    check_param(param, "grad");
    return this->grads_.view(param);
  }
  /// The registration index of the parameter called `name`.
  std::size_t find(std::string_view name) const {
    for (std::size_t i = 0; i < specs_.size(); ++i)
      if (specs_[i].name == name) return i;
    fail(where() + ": no parameter named '" + std::string(name) + "' is registered");
  }
  /// The group; it may have moved since construction, but must still exist.
  communicator<B>& group() const { return part::group(); }
  const sync_options& options() const noexcept { return options_; }

  /// Zeroes the gradient buffer (after the optimizer step, before the next window); on a GPU
  /// backend, in the compute stream's order.
  void zero_grad() {
    checked_plan("zero_grad()");
    if (schedule_.marked_count() != 0)
      fail(where() + ": zero_grad() in the middle of a backward (" + std::to_string(schedule_.marked_count()) +
           " parameters already marked ready); call it after finish()");
    this->zero_buffer();
  }

  // ---- accumulation ------------------------------------------------------------------------

  /// The micro-step the current (or next) backward belongs to: 0 .. accumulation_steps - 1.
  int micro_step() const noexcept { return schedule_.micro_step(); }
  /// Whether the current (or next) backward is the one that reduces.
  bool reduces_this_micro_step() const noexcept { return micro_step() == options_.accumulation_steps - 1; }
  /// Optimizer steps whose gradients have been reduced.
  std::size_t steps() const noexcept { return this->steps_; }

  /// With scaling::token_count: the number of tokens in this optimizer step's global batch (over
  /// every rank and micro-step). Set it before the last micro-step's backward to fold the
  /// division into the reduction; set later (before finish()), it costs one more pass.
  void set_token_count(double tokens) {
    if (options_.scale != scaling::token_count)
      fail(where() + ": set_token_count() needs scaling::token_count (the synchronizer uses another scaling)");
    if (!(tokens > 0)) fail(where() + ": set_token_count(" + std::to_string(tokens) + "): the count must be positive");
    // On a GPU the division is folded into each reduction: a count arriving mid-backward would
    // scale some buckets and not others, differently on ranks that mark in different orders.
    if (on_device && reduces_this_micro_step() && schedule_.marked_count() != 0)
      fail(where() + ": set_token_count() during the window's last backward; on a GPU backend set it before that "
           "backward's first mark_ready()");
    this->token_count_ = tokens;
  }

  // ---- the step ----------------------------------------------------------------------------

  /// Parameter `param`'s gradient for this micro-step is complete in grad(param).
  void mark_ready(std::size_t param) {
    checked_plan("mark_ready()");
    check_param(param, "mark_ready");
    if (schedule_.marked(param))
      fail(where() + ": parameter '" + specs_[param].name + "' was marked ready twice in micro-step " +
           std::to_string(micro_step()) + "; mark each parameter once per backward, then call finish()");
    if (schedule_.marked_count() == 0) begin_micro_step();
    const bool issues_now = reduces_this_micro_step() && options_.overlap;
    if (schedule_.mark(param, issues_now)) {
      const std::size_t b = plan_->bucket_of(param);
      this->timings_[b].ready_s = this->since_start();
      this->bucket_ready(b);
      issue_in_order();
    }
    if (issues_now) this->poll();
  }

  /// Adds `gradient` into grad(param), then marks it ready. Host buffers only: on a GPU backend,
  /// backward's kernels add into grad(param) themselves.
  void mark_ready(std::size_t param, std::span<const T> gradient)
    requires(!on_device)
  {
    checked_plan("mark_ready()");
    check_param(param, "mark_ready");
    if (gradient.size() != specs_[param].count)
      fail(where() + ": the gradient given for parameter '" + specs_[param].name + "' has " +
           std::to_string(gradient.size()) + " elements, but the parameter was registered with " +
           std::to_string(specs_[param].count));
    if (schedule_.marked(param)) mark_ready(param);  // reports the double mark before touching the buffer
    detail::add_in_place<T>(this->grads_.view(param), gradient);
    mark_ready(param);
  }

  /// Ends the micro-step. On the last micro-step of the window, waits until every bucket is
  /// reduced and scaled in place and returns true (step the optimizer now); otherwise returns
  /// false at once. Throws, naming them, if some parameters were not marked ready; the buckets
  /// are still reduced first, so the other ranks do not hang.
  bool finish() { return end_micro_step(options_.overlap); }

  /// Marks every parameter not yet marked and finishes: for trainers without per-parameter hooks.
  bool reduce_all() {
    checked_plan("reduce_all()");
    if (schedule_.marked_count() == 0) begin_micro_step();
    for (std::size_t p = 0; p < specs_.size(); ++p)
      if (!schedule_.marked(p)) schedule_.mark(p, true);
    return end_micro_step(false);
  }

  /// The timing of the last reduced optimizer step. On a GPU backend the times are the GPU's own
  /// (events on the compute and communication streams), and asking waits until that step's
  /// reductions have run.
  const step_report& last_report() {
    this->refresh_report();
    return this->report_;
  }

  // ---- sharded optimizer state (ZeRO-1) ----------------------------------------------------

  /// This rank's shard of every bucket (padding included), in bucket order.
  std::span<const shard_range> shard_ranges() const {
    check_sharded("shard_ranges()");
    return this->shard_ranges_;
  }
  /// This rank's shard as runs of parameters (padding excluded), in buffer order.
  std::span<const shard_segment> shard_segments() const {
    check_sharded("shard_segments()");
    return this->shard_segments_;
  }
  /// Elements of this rank's shard, padding excluded (the size of its optimizer state).
  std::size_t shard_elements() const {
    check_sharded("shard_elements()");
    std::size_t n = 0;
    for (const shard_segment& s : this->shard_segments_) n += s.count;
    return n;
  }

  /// Starts gathering every rank's updated shard of `params` (a flat buffer with this
  /// synchronizer's plan) into every rank, bucket by bucket in forward order. Wait for a parameter
  /// with `wait_for(p)` before the next forward reads it. On a GPU backend the gathers are queued
  /// after the work on the compute stream (the optimizer step), and `wait_for(p)` makes the
  /// compute stream wait, not the host.
  param_gather<B> gather_params_async(buffer_type& params) {
    check_sharded("gather_params_async()");
    if (!params.shared_plan() || params.all().size() != this->grads_.all().size() ||
        params.plan().fingerprint() != plan_->fingerprint())
      fail(where() + ": gather_params: the parameter buffer was not laid out by this synchronizer's plan; "
           "make it with flat_buffer<T>(sync.shared_plan())");
    if (schedule_.marked_count() != 0) fail(where() + ": gather_params during a backward; call it after finish()");
    const std::size_t buckets = plan_->buckets().size();
    std::vector<request> requests(buckets);
    void* consumer = this->gather_consumer();
    for (std::size_t b = buckets; b-- > 0;) requests[b] = group().all_gather_in_place_async(params.bucket_slice(b));
    return param_gather<B>(plan_, std::move(requests), consumer);
  }
  /// Gathers every rank's updated shard of `params` and waits (on a GPU backend: the compute
  /// stream waits).
  void gather_params(buffer_type& params) {
    param_gather<B> gathering = gather_params_async(params);
    gathering.wait();
    this->keep_gather(gathering);
  }

 private:
  using part::options_;
  using part::plan_;
  using part::schedule_;
  using part::specs_;
  using part::where;

  /// Times this group's reduction at growing sizes (up to the gradients' size) and takes the
  /// largest as fast per byte as the best; the same on every rank (weft/grad/bucket_sizing.hpp).
  bucket_size_choice measure_bucket_bytes() {
    std::size_t elements = 0;
    for (const param_spec& p : specs_) elements += p.count;
    // Gradients smaller than the smallest probed size: one bucket holds them all, nothing timed.
    return probe_reduction_choice<T>(group(), elements * sizeof(T), options_.shard_optimizer_state, options_.probe);
  }

  const std::shared_ptr<const bucket_plan>& checked_plan(std::string_view what) const {
    if (!plan_)
      fail(where() + ": " + std::string(what) + " before freeze(); register every parameter, then call freeze()");
    return plan_;
  }

  void check_param(std::size_t param, std::string_view what) const {
    if (param >= specs_.size())
      fail(where() + ": " + std::string(what) + "(" + std::to_string(param) + "): no such parameter (" +
           std::to_string(specs_.size()) + " registered)");
  }

  void check_sharded(std::string_view what) const {
    checked_plan(what);
    if (!options_.shard_optimizer_state)
      fail(where() + ": " + std::string(what) + " needs shard_optimizer_state = true");
  }

  /// Lets the hook size its per-bucket state before any bucket is in flight (it is told again
  /// when set after freeze()).
  void prepare_hook() {
    if (!this->hook_ || !plan_) return;
    std::vector<std::size_t> elements(plan_->buckets().size());
    for (std::size_t b = 0; b < elements.size(); ++b) elements[b] = this->grads_.bucket_slice(b).size();
    this->hook_->prepare(elements);
  }

  void begin_micro_step() {
    this->start_ = clock::now();
    this->issue_s_ = 0;
    for (bucket_timing& t : this->timings_) t = {};
    this->begin_space_micro_step();
  }

  void issue_in_order() {
    while (const std::optional<std::size_t> b = schedule_.next_issuable()) {
      this->issue(*b);
      schedule_.issued();
    }
  }

  /// Issues every bucket not issued yet; the caller waits for them next.
  void issue_remaining() {
    struct flag_guard {
      bool& flag;
      explicit flag_guard(bool& f) : flag(f) { flag = true; }
      ~flag_guard() { flag = false; }
    } waiting(this->issuing_in_finish_);
    while (const std::optional<std::size_t> b = schedule_.next_unissued()) {
      this->issue(*b);
      schedule_.issued();
    }
  }

  bool end_micro_step(bool overlap_expected) {
    checked_plan("finish()");
    const bool last = reduces_this_micro_step();
    if (schedule_.marked_count() == 0) begin_micro_step();  // an empty backward still ends the micro-step
    const double backward_end = this->since_start();
    const std::vector<std::size_t> unmarked = schedule_.unmarked();

    bool token_count_missing = false;
    // A reduction that fails (a dead peer, a hook that throws) still ends the micro-step: the
    // marks are cleared and every bucket already issued is waited for (host) or left to the
    // streams (device), so the next step starts clean instead of reporting parameters "marked
    // twice". The first failure is rethrown below.
    std::exception_ptr failure;
    try {
      if (last) {
        // Issue every bucket, including those with unmarked parameters, so that the other ranks'
        // collectives find their partners; the error is raised after.
        issue_remaining();
        token_count_missing = this->complete_window(overlap_expected);
      }
    } catch (...) {
      failure = std::current_exception();
      this->after_failure();
    }
    // Seen earlier, during backward: it happened first.
    if (std::exception_ptr earlier = this->take_poll_failure()) failure = earlier;

    // With communication checks on, every rank learns whether some rank's step was incomplete.
    std::optional<weft::error> disagreement;
    if (!failure && group().checks() == check_level::communication) {
      try {
        group().expect_same_on_all_ranks("whether every parameter was marked ready in this micro-step",
                                         unmarked.size());
      } catch (const weft::error& e) {
        disagreement = e;
      }
    }

    const int finished_micro = micro_step();
    schedule_.end_micro_step(failure != nullptr);
    this->end_space_micro_step();
    if (failure) {
      // The window's gradients are lost with the failed reduction: the next backward starts a new one.
      this->token_count_.reset();
      std::rethrow_exception(failure);
    }
    if (last) {
      this->report_step(overlap_expected, backward_end);
      ++this->steps_;
      this->token_count_.reset();
    }

    if (!unmarked.empty()) {
      std::string names;
      for (std::size_t i = 0; i < unmarked.size() && i < 10; ++i)
        names += (i ? ", '" : "'") + specs_[unmarked[i]].name + "'";
      if (unmarked.size() > 10) names += " and " + std::to_string(unmarked.size() - 10) + " more";
      fail(where() + ": micro-step " + std::to_string(finished_micro) + " finished with " +
           std::to_string(unmarked.size()) + " of " + std::to_string(specs_.size()) +
           " parameters not marked ready: " + names +
           (last ? "; their buckets were reduced with whatever the buffer held, so this step's gradients are wrong"
                 : "") +
           ". Mark every parameter once per backward (mark a parameter that got no gradient too).");
    }
    if (disagreement) throw *disagreement;
    if (token_count_missing && on_device)
      fail(where() + ": scaling::token_count, but set_token_count() was not called before the window's last "
           "backward; on a GPU backend the division is folded into the reduction, so the count must be known "
           "when the first bucket is reduced. The gradients are left unscaled (sums)");
    if (token_count_missing)
      fail(where() + ": scaling::token_count, but set_token_count() was not called before finish() of the "
           "window's last micro-step; the gradients are left unscaled (sums)");
    return last;
  }
};

}  // namespace weft::grad
