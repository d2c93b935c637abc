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

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/config.hpp>

#if WEFT_HAS_CUDA
#include <cuda_runtime_api.h>

#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/nccl/detail/policy.hpp>
#endif

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/core/reduce_op.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/bucket_sizing.hpp>
#include <weft/grad/comm_hook.hpp>
#include <weft/grad/detail/convert.hpp>
#include <weft/grad/detail/device_timeline.hpp>
#include <weft/grad/detail/fingerprint.hpp>
#include <weft/grad/flat_buffer.hpp>
#include <weft/grad/options.hpp>
#include <weft/grad/param_gather.hpp>
#include <weft/grad/step_report.hpp>

namespace weft::grad {

/// A run of one parameter's elements that belongs to this rank's shard (ZeRO-1).
struct shard_segment {
  std::size_t param = 0;          ///< registration index
  std::size_t buffer_offset = 0;  ///< first element in the flat buffer
  std::size_t param_offset = 0;   ///< first element within the parameter
  std::size_t count = 0;
};

/// This rank's shard of one bucket, padding included: [offset, offset + count) of the flat buffer.
struct shard_range {
  std::size_t bucket = 0;
  std::size_t offset = 0;
  std::size_t count = 0;
};

/// `T` is the gradients' type: float, double, weft::half or weft::bfloat16.
template <backend B, element T = float>
  requires(is_floating(dtype_of<T>))
class synchronizer {
 public:
  using request = typename B::request;
  using clock = std::chrono::steady_clock;
  /// Whether gradients live in device memory (a GPU backend) rather than host memory.
  static constexpr bool on_device = buffer_memory_v<B> == memory_space::device;
  using buffer_type = flat_buffer<T, buffer_memory_v<B>>;

  /// A synchronizer over `group` (the dp or dp-cp group); the group must outlive it, and may move.
  explicit synchronizer(communicator<B>& group, sync_options options = {}) : group_(group.ref()), options_(options) {
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
      bucket_choice_ = measure_bucket_bytes();
      plan = plan_with_cap(bucket_choice_.bucket_bytes);
    } else {
      bucket_choice_ = bucket_size_choice{};
      bucket_choice_.bucket_bytes = options_.bucket_bytes;
    }
    plan_ = std::move(plan);
    grads_ = make_grads();
    const std::size_t buckets = plan_->buckets().size();
    marked_.assign(specs_.size(), 0);
    pending_.assign(buckets, 0);
    requests_.clear();
    requests_.resize(buckets);
    prologues_.clear();
    prologues_.resize(buckets);
    epilogues_.clear();
    epilogues_.resize(buckets);
    completed_in_epilogue_.assign(buckets, 0);
    jobs_.assign(buckets, {});
    deferred_.assign(buckets, 0);
    timings_.assign(buckets, {});
    reset_pending();
    build_shards();
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      timeline_ = detail::device_timeline(buckets, group().native().device());
#endif
    } else if (options_.precision == reduce_precision::fp32 && detail::is_16bit_float_v<T>) {
      hook_ = std::make_shared<cast_hook<B, T, float>>();
    }
    prepare_hook();
  }

  bool frozen() const noexcept { return plan_ != nullptr; }

  /// Replaces how buckets go on the wire (before the first step; the same hook on every rank).
  void set_comm_hook(std::shared_ptr<comm_hook<B, T>> hook) {
    if (in_window())
      fail(where() + ": set_comm_hook() inside an accumulation window; set it between optimizer steps");
    if (options_.precision == reduce_precision::fp32 && detail::is_16bit_float_v<T>)
      fail(where() + ": a comm hook replaces precision = fp32; use precision = own with a hook that reduces in "
           "float (cast_hook<B, T, float>)");
    hook_ = std::move(hook);
    prepare_hook();
  }

  // ---- the buffer --------------------------------------------------------------------------

  const bucket_plan& plan() const { return *checked_plan("plan()"); }
  /// The bucket cap the plan uses and, when it was measured, the curve it was chosen from.
  const bucket_size_choice& bucket_choice() const {
    checked_plan("bucket_choice()");
    return bucket_choice_;
  }
  std::shared_ptr<const bucket_plan> shared_plan() const { return checked_plan("shared_plan()"); }
  buffer_type& grads() {
    checked_plan("grads()");
    return grads_;
  }
  /// The gradient of parameter `param`: backward adds into it (device memory on a GPU backend).
  std::span<T> grad(std::size_t param) {
    checked_plan("grad()");
    check_param(param, "grad");
    return grads_.view(param);
  }
  /// The registration index of the parameter called `name`.
  std::size_t find(std::string_view name) const {
    for (std::size_t i = 0; i < specs_.size(); ++i)
      if (specs_[i].name == name) return i;
    fail(where() + ": no parameter named '" + std::string(name) + "' is registered");
  }
  /// The group; it may have moved since construction, but must still exist.
  communicator<B>& group() const { return group_.get(); }
  const sync_options& options() const noexcept { return options_; }

#if WEFT_HAS_CUDA
  /// The stream backward (and the optimizer) run on; reductions are ordered after the work queued
  /// on it, and it is made to wait for them at finish(). Default: the default stream.
  void set_compute_stream(cudaStream_t stream)
    requires on_device
  {
    if (in_window())
      fail(where() + ": set_compute_stream() inside an accumulation window; set it between optimizer steps");
    // What follows on the new stream (the optimizer step) must still see the reductions that
    // the old one was made to wait for.
    if (stream != compute_) {
      cuda::device_guard on(group().native().device());
      cuda::wait_for_stream(stream, compute_);
    }
    compute_ = stream;
  }
  cudaStream_t compute_stream() const noexcept
    requires on_device
  {
    return compute_;
  }
#endif

  /// Zeroes the gradient buffer (after the optimizer step, before the next window); on a GPU
  /// backend, in the compute stream's order.
  void zero_grad() {
    checked_plan("zero_grad()");
    if (marked_count_ != 0)
      fail(where() + ": zero_grad() in the middle of a backward (" + std::to_string(marked_count_) +
           " parameters already marked ready); call it after finish()");
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      grads_.zero(compute_);
#endif
    } else {
      grads_.zero();
    }
  }

  // ---- accumulation ------------------------------------------------------------------------

  /// The micro-step the current (or next) backward belongs to: 0 .. accumulation_steps - 1.
  int micro_step() const noexcept { return micro_; }
  /// Whether the current (or next) backward is the one that reduces.
  bool reduces_this_micro_step() const noexcept { return micro_ == options_.accumulation_steps - 1; }
  /// Optimizer steps whose gradients have been reduced.
  std::size_t steps() const noexcept { return steps_; }

  /// With scaling::token_count: the number of tokens in this optimizer step's global batch (over
  /// every rank and micro-step). Set it before the last micro-step's backward to fold the
  /// division into the reduction; set later (before finish()), it costs one more pass.
  void set_token_count(double tokens) {
    if (options_.scale != scaling::token_count)
      fail(where() + ": set_token_count() needs scaling::token_count (the synchronizer uses another scaling)");
    if (!(tokens > 0)) fail(where() + ": set_token_count(" + std::to_string(tokens) + "): the count must be positive");
    // On a GPU the division is folded into each reduction: a count arriving mid-backward would
    // scale some buckets and not others, differently on ranks that mark in different orders.
    if (on_device && reduces_this_micro_step() && marked_count_ != 0)
      fail(where() + ": set_token_count() during the window's last backward; on a GPU backend set it before that "
           "backward's first mark_ready()");
    token_count_ = tokens;
  }

  // ---- the step ----------------------------------------------------------------------------

  /// Parameter `param`'s gradient for this micro-step is complete in grad(param).
  void mark_ready(std::size_t param) {
    checked_plan("mark_ready()");
    check_param(param, "mark_ready");
    if (marked_[param])
      fail(where() + ": parameter '" + specs_[param].name + "' was marked ready twice in micro-step " +
           std::to_string(micro_) + "; mark each parameter once per backward, then call finish()");
    if (marked_count_ == 0) begin_micro_step();
    marked_[param] = 1;
    ++marked_count_;
    if (reduces_this_micro_step() && options_.overlap) {
      std::size_t b = plan_->bucket_of(param);
      if (--pending_[b] == 0) {
        timings_[b].ready_s = since_start();
        if constexpr (on_device) {
#if WEFT_HAS_CUDA
          timeline_.bucket_ready(b, compute_);
#endif
        }
        issue_in_order();
      }
      poll();
    }
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
    if (marked_[param]) mark_ready(param);  // reports the double mark before touching the buffer
    detail::add_in_place<T>(grads_.view(param), gradient);
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
    if (marked_count_ == 0) begin_micro_step();
    for (std::size_t p = 0; p < specs_.size(); ++p) {
      if (marked_[p]) continue;
      marked_[p] = 1;
      ++marked_count_;
      --pending_[plan_->bucket_of(p)];
    }
    return end_micro_step(false);
  }

  /// The timing of the last reduced optimizer step. On a GPU backend the times are the GPU's own
  /// (events on the compute and communication streams), and asking waits until that step's
  /// reductions have run.
  const step_report& last_report() {
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      if (timeline_.newest_unread()) {
        drain_retired();
        report_ = summarize(timeline_.read_newest(*plan_, event_waiter()));
      }
#endif
    }
    return report_;
  }

  // ---- sharded optimizer state (ZeRO-1) ----------------------------------------------------

  /// This rank's shard of every bucket (padding included), in bucket order.
  std::span<const shard_range> shard_ranges() const {
    check_sharded("shard_ranges()");
    return shard_ranges_;
  }
  /// This rank's shard as runs of parameters (padding excluded), in buffer order.
  std::span<const shard_segment> shard_segments() const {
    check_sharded("shard_segments()");
    return shard_segments_;
  }
  /// Elements of this rank's shard, padding excluded (the size of its optimizer state).
  std::size_t shard_elements() const {
    check_sharded("shard_elements()");
    std::size_t n = 0;
    for (const shard_segment& s : shard_segments_) n += s.count;
    return n;
  }

  /// Starts gathering every rank's updated shard of `params` (a flat buffer with this
  /// synchronizer's plan) into every rank, bucket by bucket in forward order. Wait for a parameter
  /// with `wait_for(p)` before the next forward reads it. On a GPU backend the gathers are queued
  /// after the work on the compute stream (the optimizer step), and `wait_for(p)` makes the
  /// compute stream wait, not the host.
  param_gather<B> gather_params_async(buffer_type& params) {
    check_sharded("gather_params_async()");
    if (!params.shared_plan() || params.all().size() != grads_.all().size() ||
        params.plan().fingerprint() != plan_->fingerprint())
      fail(where() + ": gather_params: the parameter buffer was not laid out by this synchronizer's plan; "
           "make it with flat_buffer<T>(sync.shared_plan())");
    if (marked_count_ != 0) fail(where() + ": gather_params during a backward; call it after finish()");
    const std::size_t buckets = plan_->buckets().size();
    std::vector<request> requests(buckets);
    void* consumer = nullptr;
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      // The updated shards were written on the compute stream.
      cuda::device_guard on(group().native().device());
      cuda::wait_for_stream(group().native().stream(), compute_);
      consumer = compute_;
#endif
    }
    for (std::size_t b = buckets; b-- > 0;) requests[b] = group().all_gather_in_place_async(params.bucket_slice(b));
    return param_gather<B>(plan_, std::move(requests), consumer);
  }
  /// Gathers every rank's updated shard of `params` and waits (on a GPU backend: the compute
  /// stream waits).
  void gather_params(buffer_type& params) {
    param_gather<B> gathering = gather_params_async(params);
    gathering.wait();
    // On a GPU the compute stream now waits; keep the requests so the host does not.
    if constexpr (on_device)
      for (request& r : std::move(gathering).take_requests()) retired_.push_back({steps_, std::move(r)});
  }

 private:
  std::string where() const { return "gradient synchronizer on group '" + group().name() + "'"; }

  /// Times this group's reduction at growing sizes (up to the gradients' size) and takes the
  /// largest as fast per byte as the best; the same on every rank (weft/grad/bucket_sizing.hpp).
  bucket_size_choice measure_bucket_bytes() {
    std::size_t elements = 0;
    for (const param_spec& p : specs_) elements += p.count;
    const std::size_t bytes = elements * sizeof(T);
    double spent = 0;
    std::vector<curve_point> curve =
        probe_reduction<T>(group(), bytes, options_.shard_optimizer_state, options_.probe, &spent);
    // Gradients smaller than the smallest probed size: one bucket holds them all.
    if (curve.empty()) {
      bucket_size_choice whole;
      whole.bucket_bytes = whole.best_bytes = std::max<std::size_t>(bytes, 1);
      return whole;
    }
    bucket_size_choice choice = choose_bucket_bytes(curve, options_.probe.tolerance);
    choice.seconds_spent = spent;
    return choice;
  }

  /// The gradient buffer; on a GPU backend on the group's device, not the calling thread's.
  buffer_type make_grads() {
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      return buffer_type(plan_, group().native().device());
#endif
    }
    return buffer_type(plan_);
  }

#if WEFT_HAS_CUDA
  /// Waits for a timing event by polling it with the group's NCCL error state and deadline.
  auto event_waiter() {
    return [this](const cuda::event& e) { group().native().wait_event(e.native(), "reading a step's GPU timings"); };
  }
#endif

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

  bool in_window() const noexcept { return micro_ != 0 || marked_count_ != 0; }

  /// Lets the hook size its per-bucket state before any bucket is in flight (it is told again
  /// when set after freeze()).
  void prepare_hook() {
    if (!hook_ || !plan_) return;
    std::vector<std::size_t> elements(plan_->buckets().size());
    for (std::size_t b = 0; b < elements.size(); ++b) elements[b] = grads_.bucket_slice(b).size();
    hook_->prepare(elements);
  }

  double since_start() const { return std::chrono::duration<double>(clock::now() - start_).count(); }

  void begin_micro_step() {
    start_ = clock::now();
    issue_s_ = 0;
    for (bucket_timing& t : timings_) t = {};
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      if (!reduces_this_micro_step()) return;
      poll_retired();
      // The events of two steps ago are about to be reused: read them first. Their reductions
      // are waited for through their requests, which notice a failed peer (an event wait would not).
      if (timeline_.next_set_unread(steps_)) {
        if (steps_ >= 2) wait_retired_through(steps_ - 2);
        step_report old = summarize(timeline_.read(steps_, *plan_, event_waiter()));
        if (report_.buckets.empty() || old.step >= report_.step) report_ = std::move(old);
      }
      timeline_.begin(steps_, compute_);
#endif
    }
  }

  void reset_pending() {
    for (std::size_t b = 0; b < pending_.size(); ++b) pending_[b] = plan_->buckets()[b].params.size();
    next_issue_ = 0;
    next_complete_ = 0;
  }

  /// The factor the reduced sum is multiplied by, if known now.
  std::optional<double> scale_factor() const {
    switch (options_.scale) {
      case scaling::mean:
        return 1.0 / (static_cast<double>(group().size()) * static_cast<double>(options_.accumulation_steps));
      case scaling::sum: return 1.0;
      case scaling::token_count:
        if (token_count_) return 1.0 / *token_count_;
        return std::nullopt;
    }
    return 1.0;
  }

  void issue_in_order() {
    while (next_issue_ < pending_.size() && pending_[next_issue_] == 0) {
      issue(next_issue_);
      ++next_issue_;  // only once issued: a bucket whose issue threw is not counted as in flight
    }
  }

  void issue(std::size_t b) {
    auto t = clock::now();
    std::optional<double> factor = scale_factor();
    deferred_[b] = factor ? 0 : 1;
    bucket_job<T>& job = jobs_[b];
    job = {.index = b, .data = grads_.bucket_slice(b), .scale = factor.value_or(1.0),
           .shard = options_.shard_optimizer_state, .caller_waits = issuing_in_finish_};
    timings_[b].bucket = b;
    timings_[b].bytes = job.data.size_bytes();
    timings_[b].start_s = since_start();
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      timeline_.bucket_start(b, compute_, group().native().stream());
#endif
    }
    requests_[b] = hook_ ? hook_->start(group(), job) : start_direct(job);
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      timeline_.bucket_issued(b, group().native().stream());
#endif
    }
    completed_in_epilogue_[b] = 0;
    if constexpr (runs_host_work_in_order<B>) {
      // The hook's epilogue and the end time, on the progress thread right after the reduction:
      // the time is exact, and a conversion back runs beside the caller's backward.
      if (!job.caller_waits && (!hook_ || hook_->complete_is_local())) {
        completed_in_epilogue_[b] = 1;
        epilogues_[b] = group().native().run_in_order([this, b] {
          if (hook_) hook_->complete(group(), jobs_[b]);
          timings_[b].end_s = since_start();
        });
      }
    }
    issue_s_ += std::chrono::duration<double>(clock::now() - t).count();
  }

  /// The default path: the bucket in its own type. A mean over the group alone is the backend's
  /// `avg` (NCCL divides in the kernel, MPI on its progress thread); any other factor is applied
  /// before the sum, which also keeps 16-bit sums in range.
  request start_direct(bucket_job<T>& job) {
    reduce_op op = reduce_op::sum;
    if (job.scale == 1.0 / static_cast<double>(group().size()) && group().size() > 1) {
      op = reduce_op::avg;
    } else if (job.scale != 1.0) {
      if constexpr (on_device) {
        // Folded into the reduction kernel: no pass over the bucket of its own. The kernel
        // applies the factor in T: one T cannot hold accurately is refused (alike on every rank).
#if WEFT_HAS_CUDA
        if (const auto fold = weft::detail::nccl::fold_scale_factor(job.scale, dtype_of<T>); !fold.fold)
          fail(where() + ": " + weft::detail::nccl::unfoldable_factor_message(job.scale, dtype_of<T>, fold));
#endif
        if (job.shard) return group().reduce_scatter_in_place_scaled_async(job.data, job.scale);
        return group().all_reduce_scaled_async(job.data, job.scale);
      } else {
        std::span<T> data = job.data;
        const double factor = job.scale;
        detail::run_before_reduction(group(), job, prologues_[job.index],
                                     [data, factor] { detail::scale_in_place<T>(data, factor); });
      }
    }
    if (job.shard) return group().reduce_scatter_in_place_async(job.data, op);
    return group().all_reduce_async(job.data, op);
  }

  /// The slice of bucket b that holds a result on this rank.
  std::span<T> result_of(std::size_t b) {
    std::span<T> data = grads_.bucket_slice(b);
    if (!options_.shard_optimizer_state) return data;
    auto [offset, count] = plan_->buckets()[b].shard(group().rank(), group().size());
    return grads_.all().subspan(offset, count);
  }

  void complete(std::size_t b) {
    if (completed_in_epilogue_[b]) return;
    if (hook_) hook_->complete(group(), jobs_[b]);
    timings_[b].end_s = since_start();
  }

  /// Whether bucket b's reduction, with its prologue and epilogue, is done (rethrows a failure).
  /// They run in order, so once the epilogue is done the others are.
  bool bucket_done(std::size_t b) {
    if (!epilogues_[b].test()) return false;
    return prologues_[b].test() && requests_[b].test();
  }
  void bucket_wait(std::size_t b) {
    epilogues_[b].wait();
    prologues_[b].wait();
    requests_[b].wait();
  }

  /// Records buckets that have finished, oldest first (they finish in issue order). On a GPU
  /// backend only failures are looked for: completion is the streams' business.
  void poll() {
    if constexpr (on_device) {
      for (std::size_t b = next_complete_; b < next_issue_; ++b) (void)requests_[b].test();
    } else {
      // A failure seen here is kept for finish(): thrown in the middle of backward, it would stop
      // this rank from issuing the buckets its peers are already waiting in.
      while (next_complete_ < next_issue_) {
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

  bool end_micro_step(bool overlap_expected) {
    checked_plan("finish()");
    const bool last = reduces_this_micro_step();
    if (marked_count_ == 0) begin_micro_step();  // an empty backward still ends the micro-step
    const double backward_end = since_start();
    std::vector<std::size_t> unmarked;
    for (std::size_t p = 0; p < specs_.size(); ++p)
      if (!marked_[p]) unmarked.push_back(p);

    bool token_count_missing = false;
    // A reduction that fails (a dead peer, a hook that throws) still ends the micro-step: the
    // marks are cleared and every bucket already issued is waited for, so the next step starts
    // clean instead of reporting parameters "marked twice". The first failure is rethrown below.
    std::exception_ptr failure;
    try {
      if (last && on_device) {
        issue_remaining();
        end_reduction_on_device(overlap_expected);
        for (char d : deferred_) token_count_missing = token_count_missing || d != 0;
      } else if (last) {
        // Issue every bucket, including those with unmarked parameters, so that the other ranks'
        // collectives find their partners; the error is raised after.
        issue_remaining();
        wait_and_complete_issued();
        for (std::size_t b = 0; b < deferred_.size(); ++b) {
          if (!deferred_[b]) continue;
          if (!token_count_) {
            token_count_missing = true;
            continue;
          }
          detail::scale_in_place<T>(result_of(b), 1.0 / *token_count_);
        }
      }
    } catch (...) {
      failure = std::current_exception();
      if constexpr (!on_device) wait_issued_ignoring_failures();
    }
    if (failure_) {
      // Seen earlier, during backward: it happened first.
      failure = failure_;
      failure_ = nullptr;
    }

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

    const int finished_micro = micro_;
    std::fill(marked_.begin(), marked_.end(), 0);
    marked_count_ = 0;
    reset_pending();
    micro_ = last ? 0 : micro_ + 1;
    if (failure) {
      // The window's gradients are lost with the failed reduction: the next backward starts a new one.
      micro_ = 0;
      token_count_.reset();
      std::rethrow_exception(failure);
    }
    if (last) {
      if constexpr (!on_device) build_report(overlap_expected, backward_end);
      ++steps_;
      token_count_.reset();
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

  /// Waits for every issued bucket in order and runs its completion (host buffers).
  void wait_and_complete_issued() {
    for (; next_complete_ < next_issue_; ++next_complete_) {
      const std::size_t b = next_complete_;
      auto t = clock::now();
      bucket_wait(b);
      timings_[b].exposed_s = std::chrono::duration<double>(clock::now() - t).count();
      complete(b);
    }
  }

  /// After a failure: waits for what is still in flight so no reduction outlives the step that
  /// issued it; further failures are the same fault seen again and are dropped.
  void wait_issued_ignoring_failures() noexcept {
    for (std::size_t b = 0; b < next_issue_; ++b) {
      for (request* r : {&epilogues_[b], &prologues_[b], &requests_[b]}) {
        try {
          r->wait();
        } catch (...) {
        }
      }
    }
  }

  /// Issues every bucket not issued yet; the caller waits for them next.
  void issue_remaining() {
    struct flag_guard {
      bool& flag;
      explicit flag_guard(bool& f) : flag(f) { flag = true; }
      ~flag_guard() { flag = false; }
    } waiting(issuing_in_finish_);
    while (next_issue_ < pending_.size()) {
      issue(next_issue_);
      ++next_issue_;
    }
  }

  /// The end of a reducing micro-step on a GPU backend: hooks queue their epilogues, the compute
  /// stream waits for the reductions, and the requests are kept (not waited for) until they are
  /// seen complete, so the host can queue the next step at once.
  void end_reduction_on_device(bool overlap_expected) {
#if WEFT_HAS_CUDA
    if constexpr (on_device) {
      for (std::size_t b = next_complete_; b < requests_.size(); ++b)
        if (hook_) hook_->complete(group(), jobs_[b]);
      next_complete_ = requests_.size();
      // Backward's end first: recorded after the waits, it would include them.
      timeline_.end_backward(compute_, overlap_expected, issue_s_);
      for (request& r : requests_) {
        r.make_stream_wait(compute_);
        retired_.push_back({steps_, std::move(r)});
        r = request();
      }
      if (hook_) {
        // A hook's epilogue kernels follow the requests' events on the communicator's stream.
        cuda::device_guard on(group().native().device());
        cuda::wait_for_stream(compute_, group().native().stream());
      }
      poll_retired();
    }
#else
    (void)overlap_expected;
#endif
  }

  void build_report(bool overlap_expected, double backward_end) {
    step_report r;
    r.step = steps_;
    r.overlap_expected = overlap_expected;
    r.backward_s = backward_end;
    r.issue_s = issue_s_;
    r.finish_s = since_start() - backward_end;
    r.buckets = timings_;
    report_ = summarize(std::move(r));
  }

  /// Totals and the overlap warning, from the per-bucket timings. On the host the caller paid for
  /// issuing and for finish(); on a GPU the compute stream waits only for the reductions that
  /// end after backward (issuing is host time that the GPU does not see).
  step_report summarize(step_report r) {
    const double backward_end = r.backward_s;
    std::vector<std::pair<double, double>> spans;
    std::size_t started_during_backward = 0;
    double last_end = backward_end;
    for (const bucket_timing& t : r.buckets) {
      spans.emplace_back(t.start_s, t.end_s);
      if (t.start_s < backward_end) ++started_during_backward;
      last_end = std::max(last_end, t.end_s);
    }
    auto [comm, before] = detail::union_length(spans, backward_end);
    r.comm_s = comm;
    if constexpr (on_device) {
      r.finish_s = last_end - backward_end;
      r.exposed_s = r.finish_s;
      r.hidden_s = std::min(before, comm);
    } else {
      r.exposed_s = r.issue_s + r.finish_s;
      r.hidden_s = std::max(0.0, std::min(before - r.issue_s, comm));
    }
    const bool overlap_expected = r.overlap_expected;
    if (overlap_expected && r.exposed_s > 1e-3 && r.hidden_s < 0.05 * r.comm_s) {
      if (started_during_backward == 0)
        r.warning = "overlap is on but hid no communication: every bucket started after backward ended; call "
                    "mark_ready() as backward produces each gradient (or set overlap = false and call reduce_all())";
      else
        r.warning = "overlap is on but hid almost no communication: " + std::to_string(started_during_backward) +
                    " of " + std::to_string(timings_.size()) +
                    " buckets started during backward, yet the communication ran after it (backward too short, or a "
                    "backend without asynchronous progress, e.g. MPI initialised without MPI_THREAD_MULTIPLE)";
      if (options_.warn_if_not_overlapped && !warned_) {
        warned_ = true;
        std::fprintf(stderr, "weft: %s: %s\n", where().c_str(), r.warning.c_str());
      }
    }
    return r;
  }

  void build_shards() {
    shard_ranges_.clear();
    shard_segments_.clear();
    if (!options_.shard_optimizer_state) return;
    const auto buckets = plan_->buckets();
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      auto [offset, count] = buckets[b].shard(group().rank(), group().size());
      shard_ranges_.push_back({b, offset, count});
      for (std::size_t p : buckets[b].params) {
        std::size_t lo = std::max(offset, plan_->offset_of(p));
        std::size_t hi = std::min(offset + count, plan_->offset_of(p) + specs_[p].count);
        if (lo < hi) shard_segments_.push_back({p, lo, lo - plan_->offset_of(p), hi - lo});
      }
    }
  }

  communicator_ref<B> group_;  ///< follows the communicator if it moves
  sync_options options_;
  std::vector<param_spec> specs_;
  std::shared_ptr<const bucket_plan> plan_;
  bucket_size_choice bucket_choice_;
  buffer_type grads_;
  std::shared_ptr<comm_hook<B, T>> hook_;

  // the current micro-step
  std::vector<char> marked_;
  std::size_t marked_count_ = 0;
  std::vector<std::size_t> pending_;  ///< unmarked parameters per bucket
  std::size_t next_issue_ = 0;        ///< buckets are issued strictly in order
  std::size_t next_complete_ = 0;
  std::vector<bucket_job<T>> jobs_;
  std::vector<char> deferred_;  ///< scaled after completion (token count unknown at issue)
  int micro_ = 0;
  std::size_t steps_ = 0;
  std::optional<double> token_count_;

  // timing
  clock::time_point start_{};
  double issue_s_ = 0;
  std::vector<bucket_timing> timings_;
  step_report report_;
  bool warned_ = false;

  std::vector<shard_range> shard_ranges_;
  std::vector<shard_segment> shard_segments_;

#if WEFT_HAS_CUDA
  cudaStream_t compute_ = nullptr;    ///< GPU backends: the stream gradients are produced on
  detail::device_timeline timeline_;  ///< GPU backends: ordering and timing events
#endif

  bool issuing_in_finish_ = false;  ///< the caller waits for what is issued now
  std::exception_ptr failure_;      ///< a bucket's failure seen while polling, rethrown by finish()
  std::vector<char> completed_in_epilogue_;  ///< the bucket's hook epilogue and end time ran on the progress thread

  struct retired_request {
    std::size_t step = 0;  ///< the optimizer step that issued it
    request pending;
  };

  // Last: destroyed first, so in-flight requests finish while the buffer and hook still exist.
  std::vector<retired_request> retired_;  ///< GPU backends: issued requests not yet seen complete
  std::vector<request> prologues_;  ///< per bucket: scaling queued before the reduction
  std::vector<request> requests_;   ///< per bucket: the reduction
  std::vector<request> epilogues_;  ///< per bucket: the hook's completion and the end time, after the reduction
};

}  // namespace weft::grad
