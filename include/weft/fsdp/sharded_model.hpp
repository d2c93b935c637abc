#pragma once
/// \file
/// `weft::fsdp::sharded_model<B, Param>`: ZeRO-3 / FSDP and ZeRO-2 over a data-parallel group, and
/// hybrid sharding (HSDP: shard inside a group, replicate across groups), in units the trainer
/// chooses (a layer, or a group of layers), as FSDP2's `fully_shard` applied per layer.
///
/// Use:
///   1. `add_unit(name, {{param, count}, ...})` for every unit, in forward order; `freeze()`
///      (collective: plans the shards and checks that every rank planned the same ones);
///   2. give the initial values: `load_whole(unit, param, values)` (every rank passes the whole
///      tensor; each keeps its part), or `reshard_from_whole(checkpoint)`;
///   3. each micro-step: for u = 0..n-1 `{ auto s = model.forward(u); ... s.param(p) ... }`, then
///      for u = n-1..0 `{ auto s = model.backward(u); ... s.param(p), add into s.grad(p) ... }`,
///      then `finish()` (with `enclosing_root`, unit 0's scope stays open around the others': see
///      fsdp_options); when it returns true, the gradient shards hold the window's scaled,
///      reduced gradients: step the optimizer on `shard_params(u)` / `shard_grads(u)` (e.g.
///      fsdp::shard_adamw), then `zero_grad()`.
///
/// Forward of unit u waits for its all-gather and issues unit u+1's (prefetch), so the gather of
/// the next unit runs while this one computes; backward of unit u does the same for unit u-1.
/// Once a unit's backward ends, its gradients are reduce-scattered (in `reduce_dtype`) while the
/// next unit's backward runs, and its reduced shard is added into the master-type gradient shard.
/// ZeRO-3 frees a unit's gathered parameters after its backward (and after its forward, with
/// reshard_after_forward); ZeRO-2 keeps every unit gathered and gathers again only units whose
/// shards the optimizer changed. Every rank issues the same collectives in the same order, since
/// units run in registration order forward and in reverse backward (anything else is refused).
///
/// Memory: on a host-memory backend (MPI) every buffer is host memory. On a GPU backend (NCCL)
/// shards, gathered parameters and gradients are device memory (spans of it: pass them to kernels,
/// never read them on the host); forward, backward and the optimizer run on one compute stream
/// (`set_compute_stream`, default: the default stream), which waits for a unit's gather without
/// the host waiting, and every gather and reduction waits for the compute queued before it. On
/// a GPU, parameters are gathered and gradients reduced in the master type (float or double; a
/// bfloat16 gather would need a conversion kernel, which weft does not ship), and each reduction
/// writes the sum straight into the gradient shard: this rank's block of the unit's gradient
/// buffer starts as the shard accumulated so far, instead of an addition after the reduction.
/// The mean (or 1/tokens) is folded into the window's last reduction, so with
/// scaling::token_count call set_token_count() before that micro-step's backward.
///
/// The code: the shards are planned by fsdp/unit_plan.hpp (pure); the state both memory spaces
/// share is fsdp/detail/model_core.hpp; host memory (MPI) is fsdp/detail/host_units.hpp, device
/// memory ordered by CUDA streams (NCCL) fsdp/detail/device_units.hpp. This file is the flow of
/// a micro-step and the checks, the same for both.

#include <cstddef>
#include <cstdint>
#include <exception>
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
#include <weft/fsdp/detail/device_units.hpp>
#include <weft/fsdp/detail/host_units.hpp>
#include <weft/fsdp/detail/model_core.hpp>
#include <weft/fsdp/detail/unit_buffer.hpp>
#include <weft/fsdp/options.hpp>
#include <weft/fsdp/schedule.hpp>
#include <weft/fsdp/unit_plan.hpp>
#include <weft/fsdp/whole_tensor.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/detail/fingerprint.hpp>
#include <weft/grad/options.hpp>

namespace weft::fsdp {

namespace detail {
/// The part of a sharded model that handles its backend's memory space.
template <backend B, element Param>
using model_part =
    std::conditional_t<buffer_memory_v<B> == memory_space::device, device_units<B, Param>, host_units<B, Param>>;
}  // namespace detail

/// `Param` is FSDP2's param_dtype: the type parameters are gathered in and gradients are produced
/// in (float, double, or weft::bfloat16).
///
/// On a GPU backend it also has `set_compute_stream(cudaStream_t)` and `compute_stream()`
/// (fsdp/detail/device_units.hpp).
template <backend B, element Param = float>
  requires(is_floating(dtype_of<Param>))
class sharded_model : public detail::model_part<B, Param> {
  using part = detail::model_part<B, Param>;

 public:
  using request = typename B::request;
  using master_type = master_t<Param>;
  /// Where shards, gathered parameters and gradients live: the backend's buffer memory.
  static constexpr memory_space memory = buffer_memory_v<B>;
  static constexpr bool on_device = memory == memory_space::device;
  static_assert(!on_device || std::is_same_v<Param, master_type>,
                "weft::fsdp::sharded_model on a GPU backend gathers parameters in the master type (float or "
                "double): a bfloat16 gather from fp32 shards needs a conversion kernel, which weft does not ship; "
                "use sharded_model<B, float> and cast inside your kernels");

  class unit_scope;

  /// Shards over `shard_group` (the dp group; the group must outlive the model).
  explicit sharded_model(communicator<B>& shard_group, fsdp_options options = {})
      : part(shard_group, options) {
    validate_options();
  }

  /// Hybrid sharding: shards over `shard_group` (e.g. the ranks of a node) and replicates over
  /// `replicate_group` (the ranks with the same position in the other shard groups): gradients are
  /// reduce-scattered inside the shard group, then all-reduced across replicas. See
  /// fsdp/hybrid_groups.hpp for the groups made from dp by node placement.
  sharded_model(communicator<B>& shard_group, communicator<B>& replicate_group, fsdp_options options = {})
      : part(shard_group, replicate_group, options) {
    validate_options();
  }

  sharded_model(const sharded_model&) = delete;
  sharded_model& operator=(const sharded_model&) = delete;
  /// Waits for the communication still in flight (its requests do), so no buffer dies under it;
  /// device memory is given back after the compute and communication queued so far.
  ~sharded_model() = default;

  // ---- registration ------------------------------------------------------------------------

  /// Registers a unit (its parameters in forward order) and returns its index (0, 1, ... in call
  /// order). Register units in forward order.
  std::size_t add_unit(std::string name, std::vector<grad::param_spec> params) {
    return add_unit(unit_spec{std::move(name), std::move(params)});
  }
  /// Registers a unit as planned, e.g. by fsdp::group_layers (several layers in one unit).
  std::size_t add_unit(unit_spec unit) {
    if (frozen())
      fail(where() + ": add_unit('" + unit.name + "') after freeze(); register every unit before freeze()");
    for (const grad::param_spec& p : unit.params)
      if (p.count == 0)
        fail(where() + ": parameter '" + p.name + "' of unit '" + unit.name + "' has 0 elements; register only "
             "parameters with values");
    specs_.push_back(std::move(unit));
    return specs_.size() - 1;
  }

  /// Plans the shards, allocates them (zeroed), and checks (collectively, on the shard group and
  /// the replicate group) that every rank planned the same shards with the same options.
  void freeze() {
    if (frozen()) fail(where() + ": freeze() called twice");
    plan_ = unit_plan(specs_, dtype_of<Param>, options_.pad_elements, shard_group().size());
    shard_group().expect_same_on_all_ranks(
        "the fsdp shard layout (units, their parameters' names, sizes and order, parameter type, padding)",
        plan_.fingerprint());
    shard_group().expect_same_on_all_ranks("the fsdp options (level, resharding, prefetch, accumulation, scaling, "
                                           "reduce type)", options_fingerprint());
    if (replicate_) {
      replicate_group().expect_same_on_all_ranks("the fsdp shard layout across replicas", plan_.fingerprint());
      replicate_group().expect_same_on_all_ranks("the fsdp options across replicas", options_fingerprint());
      replicate_group().expect_same_on_all_ranks("the shard group's size across replicas",
                                                 static_cast<std::uint64_t>(shard_group().size()));
    }
    units_.resize(plan_.size());
    for (std::size_t u = 0; u < plan_.size(); ++u) {
      units_[u].master.assign_zeros(plan_.unit(u).shard_elements(), streams());
      units_[u].grads.assign_zeros(plan_.unit(u).shard_elements(), streams());
    }
    next_backward_ = units_.size() - 1;
    frozen_ = true;
    account();
  }

  bool frozen() const noexcept { return frozen_; }
  const unit_plan& plan() const {
    checked("plan()");
    return plan_;
  }
  std::size_t unit_count() const noexcept { return specs_.size(); }
  const fsdp_options& options() const noexcept { return options_; }
  communicator<B>& shard_group() const { return part::shard_group(); }
  communicator<B>& replicate_group() const { return part::replicate_group(); }
  bool hybrid() const noexcept { return part::hybrid(); }
  /// Ranks a gradient is averaged over: the shard group's size times the replicas'.
  int data_parallel_size() const { return part::data_parallel_size(); }

  // ---- shards --------------------------------------------------------------------------------

  /// This rank's master shard of unit `u` (padding included, zeros there), for the optimizer to
  /// update between finish() and the next forward. Taking it writable marks the unit's gathered
  /// copy out of date (ZeRO-2 gathers it again before the next forward).
  std::span<master_type> shard_params(std::size_t u) {
    checked("shard_params()");
    check_unit(u, "shard_params");
    if (in_micro_step())
      fail(where() + ": shard_params(" + unit_name(u) + ") writable in the middle of a micro-step; update the shards "
           "after finish() and before the next forward (use shard_params_view() to read)");
    units_[u].stale = true;
    return units_[u].master.span();
  }
  std::span<const master_type> shard_params_view(std::size_t u) const {
    checked("shard_params_view()");
    check_unit(u, "shard_params_view");
    return units_[u].master.span();
  }
  /// This rank's shard of unit `u`'s accumulated gradients (master type; valid after a finish()
  /// that returned true).
  std::span<const master_type> shard_grads(std::size_t u) const {
    checked("shard_grads()");
    check_unit(u, "shard_grads");
    return units_[u].grads.span();
  }
  /// The runs of parameters in this rank's shard of unit `u` (for optimizers that treat
  /// parameters differently).
  std::vector<shard_run> shard_runs(std::size_t u) const { return plan().unit(u).runs(shard_group().rank()); }

  /// Zeroes the gradient shards (after the optimizer step; on a GPU, in the compute stream's order).
  void zero_grad() {
    checked("zero_grad()");
    if (in_micro_step()) fail(where() + ": zero_grad() in the middle of a micro-step; call it after finish()");
    for (unit_state& s : units_) s.grads.zero(streams());
  }

  /// Sets parameter `param` of unit `u` from its whole value: this rank keeps its part. Every rank
  /// of the shard group must pass the same values (e.g. the same seeded initialisation).
  void load_whole(std::size_t u, std::size_t index, std::span<const master_type> whole) {
    checked("load_whole()");
    check_unit(u, "load_whole");
    const unit_layout& layout = plan_.unit(u);
    if (index >= layout.params().size())
      fail(where() + ": load_whole: unit " + unit_name(u) + " has " + std::to_string(layout.params().size()) +
           " parameters; there is no parameter " + std::to_string(index));
    if (whole.size() != layout.params()[index].count)
      fail(where() + ": load_whole: parameter '" + layout.params()[index].name + "' of unit " + unit_name(u) + " has " +
           std::to_string(layout.params()[index].count) + " elements; " + std::to_string(whole.size()) + " were given");
    std::span<master_type> shard = shard_params(u);
    for (const shard_run& run : layout.runs(shard_group().rank()))
      if (run.param == index)
        detail::copy_from_host(shard.subspan(run.shard_offset, run.count), whole.subspan(run.param_offset, run.count),
                               streams());
  }

  // ---- whole tensors (checkpoints) -----------------------------------------------------------

  /// Gathers a sharded state laid out like the master shards (`shard_of(u)` returns this rank's
  /// shard of unit u, in the backend's memory: the master shards, or an optimizer's moments) into
  /// whole tensors (host memory) named "<prefix><unit>.<param>", on every rank. Collective over
  /// the shard group; on a GPU, after the compute queued so far.
  template <class ShardOf>
  std::vector<whole_tensor<master_type>> gather_whole(ShardOf&& shard_of, std::string_view prefix = "") {
    checked("gather_whole()");
    if (in_micro_step()) fail(where() + ": gather_whole() in the middle of a micro-step; call it after finish()");
    std::vector<whole_tensor<master_type>> out;
    detail::unit_buffer<master_type, memory> gathered;
    for (std::size_t u = 0; u < plan_.size(); ++u) {
      const unit_layout& layout = plan_.unit(u);
      std::span<const master_type> shard = shard_of(u);
      if (shard.size() != layout.shard_elements())
        fail(where() + ": gather_whole: the shard given for unit " + unit_name(u) + " has " +
             std::to_string(shard.size()) + " elements; this rank's shard has " +
             std::to_string(layout.shard_elements()));
      gathered.allocate(layout.padded_elements(), streams());
      detail::order_communication_after_compute(streams());
      shard_group().all_gather(shard, gathered.span());
      const std::vector<master_type> host = detail::copy_to_host<master_type>(std::as_const(gathered).span(), streams());
      append_whole<master_type>(layout, host, prefix, out);
    }
    gathered.release(streams());
    return out;
  }
  /// The master parameters as whole tensors ("<unit>.<param>"), on every rank.
  std::vector<whole_tensor<master_type>> gather_whole_params() {
    return gather_whole([this](std::size_t u) { return shard_params_view(u); });
  }

  /// Cuts whole tensors (from a checkpoint saved on any number of ranks) into this rank's shards of
  /// a state laid out like the master shards (`shard_of(u)` returns a writable span in the
  /// backend's memory). Local: no communication; every rank needs the whole tensors.
  template <class ShardOf>
  void reshard_from_whole(std::span<const whole_tensor<master_type>> whole, ShardOf&& shard_of,
                          std::string_view prefix = "") {
    checked("reshard_from_whole()");
    std::vector<master_type> cut;
    for (std::size_t u = 0; u < plan_.size(); ++u) {
      cut.assign(plan_.unit(u).shard_elements(), master_type{});
      cut_shard<master_type>(plan_.unit(u), shard_group().rank(), whole, prefix, std::span<master_type>(cut));
      std::span<master_type> shard = shard_of(u);
      if (shard.size() != cut.size())
        fail(where() + ": reshard_from_whole: the shard given for unit " + unit_name(u) + " has " +
             std::to_string(shard.size()) + " elements; this rank's shard has " + std::to_string(cut.size()));
      detail::copy_from_host(shard, std::span<const master_type>(cut), streams());
    }
  }
  /// Sets the master parameters from whole tensors named "<unit>.<param>".
  void reshard_params_from_whole(std::span<const whole_tensor<master_type>> whole) {
    reshard_from_whole(whole, [this](std::size_t u) { return shard_params(u); });
  }

  // ---- the micro-step ------------------------------------------------------------------------

  /// Begins unit `u`'s forward: waits for its parameters (issuing their gather unless a prefetch
  /// did), and issues the next unit's gather. Units run forward in registration order.
  unit_scope forward(std::size_t u) {
    begin_forward(u);
    return unit_scope(*this, u, pass::forward);
  }
  /// Begins unit `u`'s backward: waits for its parameters, issues the previous unit's gather, and
  /// gives a zeroed gradient buffer. Units run backward in reverse registration order.
  unit_scope backward(std::size_t u) {
    begin_backward(u);
    return unit_scope(*this, u, pass::backward);
  }

  void begin_forward(std::size_t u) {
    checked("forward()");
    check_unit(u, "forward");
    check_no_open_scope(u, "forward");
    if (u != next_forward_) {
      if (next_forward_ == units_.size())
        fail(where() + ": forward of unit " + unit_name(u) + " after every unit's forward in micro-step " +
             std::to_string(micro_) + "; run the backward of every unit and finish() first");
      fail(where() + ": forward of unit " + unit_name(u) + " out of order: unit " + unit_name(next_forward_) +
           " is next; run units forward in the order they were registered (the prefetch and every rank's "
           "collectives follow that order)");
    }
    during_ = pass::forward;
    ensure_gathered(u);
    if (options_.prefetch && u + 1 < units_.size()) ensure_gathered(u + 1);
    wait_gather(u);
    if (is_root(u)) {
      root_open_ = pass::forward;
      ++next_forward_;  // the other units' forwards run inside the root's
      return;
    }
    open_ = u;
    open_pass_ = pass::forward;
  }

  void end_forward(std::size_t u) {
    if (is_root(u)) {
      check_root_open(pass::forward, "end_forward");
      if (next_forward_ != units_.size())
        fail(where() + ": end_forward of the root unit " + unit_name(u) + " before the forward of unit " +
             unit_name(next_forward_) + "; the root's forward encloses every other unit's: end it last");
      root_open_.reset();  // kept gathered: its backward uses it
      return;
    }
    check_open(u, pass::forward, "end_forward");
    open_.reset();
    ++next_forward_;
    const bool last = u + 1 == units_.size();
    if (full_sharding() && options_.reshard_after_forward && !last) free_params(u);
  }

  void begin_backward(std::size_t u) {
    checked("backward()");
    check_unit(u, "backward");
    check_no_open_scope(u, "backward");
    if (next_forward_ != units_.size())
      fail(where() + ": backward of unit " + unit_name(u) + " before the forward of unit " +
           unit_name(next_forward_) + "; run every unit's forward first");
    if (root_open_ == pass::forward)
      fail(where() + ": backward of unit " + unit_name(u) + " inside the root unit's forward; end the forward of "
           "unit " + unit_name(0) + " first");
    // The unit whose gather to issue while this one computes: the previous one, or for an
    // enclosing root (whose backward comes first) the last one.
    std::optional<std::size_t> next;
    if (is_root(u)) {
      const std::size_t last = units_.size() - 1;
      if (root_open_ || next_backward_ != last || units_[last].backward_done)
        fail(where() + ": backward of the root unit " + unit_name(u) + " after another unit's backward began (or "
             "twice); the root's backward encloses the others': begin it first, end it last");
      if (last > 0) next = last;
    } else {
      if (options_.enclosing_root && root_open_ != pass::backward)
        fail(where() + ": backward of unit " + unit_name(u) + " outside the root unit's backward; begin the backward "
             "of unit " + unit_name(0) + " first (it encloses the others')");
      if (next_backward_ >= units_.size() || u != next_backward_)
        fail(where() + ": backward of unit " + unit_name(u) + " out of order" +
             (next_backward_ < units_.size() ? ": unit " + unit_name(next_backward_) + " is next" : ": every unit's backward ran") +
             "; run units backward in reverse registration order, each once per micro-step, then finish()");
      if (u > 0) next = u - 1;
    }
    this->check_backward_can_begin();
    during_ = pass::backward;
    ensure_gathered(u);
    if (options_.prefetch && next) ensure_gathered(*next);
    wait_gather(u);
    // Reductions issued before this unit's gather have completed with it (the group runs its
    // operations in issue order): free their buffers before this unit's gradients are allocated.
    poll();
    prepare_gradients(u);
    if (is_root(u)) {
      root_open_ = pass::backward;
    } else {
      open_ = u;
      open_pass_ = pass::backward;
    }
  }

  void end_backward(std::size_t u) {
    if (is_root(u)) {
      check_root_open(pass::backward, "end_backward");
      if (next_backward_ != 0)
        fail(where() + ": end_backward of the root unit " + unit_name(u) + " before the backward of unit " +
             unit_name(next_backward_) + "; the root's backward encloses every other unit's: end it last");
      root_open_.reset();
    } else {
      check_open(u, pass::backward, "end_backward");
    }
    open_.reset();
    issue_reduce(u);
    units_[u].backward_done = true;
    if (full_sharding()) free_params(u);
    next_backward_ = u == 0 ? units_.size() : u - 1;
    poll();
  }

  /// Unit `u`'s gathered parameter `param`: only inside that unit's forward or backward scope.
  std::span<const Param> param(std::size_t u, std::size_t index) const {
    check_access(u, index, "param");
    const unit_layout& layout = plan_.unit(u);
    return units_[u].gathered.span().subspan(layout.offset_of(index), layout.params()[index].count);
  }
  /// Unit `u`'s gradient of parameter `param` (zeroed when the backward began; add into it): only
  /// inside that unit's backward scope.
  std::span<Param> grad(std::size_t u, std::size_t index) {
    check_access(u, index, "grad");
    if ((is_root(u) && root_open_ ? *root_open_ : open_pass_) != pass::backward)
      fail(where() + ": grad(" + unit_name(u) + ", " + std::to_string(index) + ") in the unit's forward; gradients "
           "exist only inside backward(u)");
    const unit_layout& layout = plan_.unit(u);
    return units_[u].work.span().subspan(layout.offset_of(index), layout.params()[index].count);
  }

  /// With scaling::token_count: the tokens of this optimizer step's global batch (every rank and
  /// micro-step), set before the window's last finish().
  void set_token_count(double tokens) {
    if (options_.scale != grad::scaling::token_count)
      fail(where() + ": set_token_count() needs scaling::token_count (the model uses another scaling)");
    if (!(tokens > 0)) fail(where() + ": set_token_count(" + std::to_string(tokens) + "): the count must be positive");
    this->check_token_count_can_change();
    token_count_ = tokens;
  }

  /// Ends the micro-step: waits for every unit's reduction and adds it into the gradient shards
  /// (on a GPU backend the compute stream waits, not the host, and a failure of the reductions
  /// handed to the streams is reported by a later call). On the window's last micro-step scales the shards and returns true (step the optimizer now);
  /// otherwise returns false. Throws, naming them, if some units had no backward; their
  /// gradients are reduced as zeros first, so ranks that skipped the same units do not hang.
  bool finish() {
    checked("finish()");
    if (open_)
      fail(where() + ": finish() inside the " + std::string(to_string(open_pass_)) + " scope of unit " +
           unit_name(*open_) + "; end the scope first");
    if (root_open_)
      fail(where() + ": finish() inside the " + std::string(to_string(*root_open_)) + " scope of the root unit " +
           unit_name(0) + "; end the scope first");
    std::vector<std::size_t> skipped;
    for (std::size_t u = units_.size(); u-- > 0;)
      if (!units_[u].backward_done) skipped.push_back(u);
    std::exception_ptr failure;
    try {
      for (std::size_t u : skipped) {
        wait_gather_quietly(u);
        prepare_gradients(u);
        issue_reduce(u);
      }
      while (!reducing_.empty()) complete_front(true);
      this->poll_retired();
    } catch (...) {
      failure = std::current_exception();
    }
    if (failure_) {
      failure = failure_;
      failure_ = nullptr;
    }
    // Whatever happened, the next micro-step starts clean.
    for (std::size_t u = 0; u < units_.size(); ++u) {
      unit_state& s = units_[u];
      try {
        this->settle_requests(s);  // the host waits (MPI), or the compute stream does (NCCL)
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      s.backward_done = false;
      try {
        release_buffers(s);
        if (s.params == param_state::gathering) s.params = param_state::gathered;
        if (full_sharding() && s.params != param_state::freed) free_params(u);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    reducing_.clear();
    during_ = pass::between;
    next_forward_ = 0;
    next_backward_ = units_.size() - 1;
    account();
    const bool last = last_micro_step();
    micro_ = last ? 0 : micro_ + 1;
    if (failure) {
      micro_ = 0;
      token_count_.reset();
      std::rethrow_exception(failure);
    }
    // The window's last reductions ran (zeros for skipped units): on a GPU they applied the scale,
    // so it is applied here too, and the count is used up, whether units were skipped or not.
    std::optional<double> factor;
    if (last) {
      factor = scale_factor();
      token_count_.reset();
      if (factor) this->apply_window_scale(*factor);
    }
    if (!skipped.empty()) {
      std::string names;
      for (std::size_t u : skipped) names += (names.empty() ? "" : ", ") + unit_name(u);
      fail(where() + ": finish() with " + std::to_string(skipped.size()) + " of " + std::to_string(units_.size()) +
           " units not run backward: " + names +
           "; their gradients were reduced as zeros. Run backward(u) for every unit in each micro-step.");
    }
    if (!last) return false;
    if (!factor)
      fail(where() + ": scaling::token_count, but set_token_count() was not called before finish() of the window's "
           "last micro-step; the gradient shards are left unscaled (sums)");
    ++steps_;
    return true;
  }

  /// The micro-step the current (or next) backward belongs to.
  int micro_step() const noexcept { return micro_; }
  /// Optimizer steps whose gradients have been reduced.
  std::size_t steps() const noexcept { return steps_; }

  // ---- what it holds and did ---------------------------------------------------------------

  /// Bytes of training state this object holds now: master and gradient shards, gathered
  /// parameters, gradient buffers and reduction staging (not the optimizer's state).
  std::size_t bytes_held() const noexcept { return held_; }
  /// The most bytes_held() has been since the last reset_peak().
  std::size_t peak_bytes() const noexcept { return peak_; }
  void reset_peak() noexcept { peak_ = held_; }

  /// The communication issued and waited for, in order (with record_schedule = true).
  const std::vector<schedule_event>& schedule() const noexcept { return schedule_; }
  void clear_schedule() noexcept { schedule_.clear(); }

  /// Closes a unit's forward or backward when it goes out of scope; gives the unit's parameters
  /// and (in backward) gradients.
  class unit_scope {
   public:
    unit_scope(const unit_scope&) = delete;
    unit_scope& operator=(const unit_scope&) = delete;
    unit_scope(unit_scope&& other) noexcept
        : model_(std::exchange(other.model_, nullptr)), unit_(other.unit_), pass_(other.pass_) {}
    /// Ends the scope unless end() did; when an exception is leaving the scope, only closes it
    /// (no communication is issued for a unit whose computation failed).
    ~unit_scope() noexcept(false) {
      if (!model_) return;
      if (std::uncaught_exceptions() > exceptions_) {
        model_->abandon(unit_);
        return;
      }
      end();
    }
    std::span<const Param> param(std::size_t p) const { return model_->param(unit_, p); }
    std::span<Param> grad(std::size_t p) { return model_->grad(unit_, p); }
    std::size_t unit() const noexcept { return unit_; }
    /// Ends the forward (frees the parameters under reshard_after_forward) or the backward
    /// (issues the gradients' reduce-scatter).
    void end() {
      if (!model_) return;
      sharded_model* m = std::exchange(model_, nullptr);
      if (pass_ == pass::forward)
        m->end_forward(unit_);
      else
        m->end_backward(unit_);
    }

   private:
    friend class sharded_model;
    unit_scope(sharded_model& model, std::size_t unit, pass p) : model_(&model), unit_(unit), pass_(p) {}
    sharded_model* model_ = nullptr;
    std::size_t unit_ = 0;
    pass pass_ = pass::forward;
    int exceptions_ = std::uncaught_exceptions();
  };

 private:
  using typename part::param_state;
  using typename part::unit_state;
  using part::during_;
  using part::frozen_;
  using part::micro_;
  using part::next_backward_;
  using part::next_forward_;
  using part::open_;
  using part::open_pass_;
  using part::options_;
  using part::plan_;
  using part::reducing_;
  using part::replicate_;
  using part::root_open_;
  using part::specs_;
  using part::token_count_;
  using part::units_;
  using part::unit_name;
  using part::where;
  using part::account;
  using part::failure_;
  using part::full_sharding;
  using part::held_;
  using part::in_micro_step;
  using part::last_micro_step;
  using part::log;
  using part::peak_;
  using part::scale_factor;
  using part::schedule_;
  using part::steps_;

  void validate_options() const {
    if (options_.level != tune::sharding::full && options_.level != tune::sharding::gradients)
      fail("fsdp model: level = " + std::string(tune::to_string(options_.level)) +
           " is not a sharding this model runs; use sharding::full (ZeRO-3) or sharding::gradients (ZeRO-2), or "
           "weft::grad::synchronizer for none and optimizer (ZeRO-1)");
    if (options_.accumulation_steps < 1)
      fail("fsdp model: accumulation_steps is " + std::to_string(options_.accumulation_steps) +
           "; it must be at least 1 (1: reduce every step)");
    const dtype r = options_.reduce_dtype;
    if (r != dtype_of<Param> && r != dtype::float32 && r != dtype::bfloat16)
      fail("fsdp model: reduce_dtype = " + std::string(to_string(r)) + " is not offered; reduce in the parameters' "
           "type (" + std::string(to_string(dtype_of<Param>)) + "), float32 or bfloat16");
    if (on_device && r != dtype_of<Param>)
      fail("fsdp model: reduce_dtype = " + std::string(to_string(r)) + " on a GPU backend, where gradients are "
           "reduced in the parameters' type (a conversion would need a kernel weft does not ship); set "
           "reduce_dtype = " + std::string(to_string(dtype_of<Param>)));
  }

  std::uint64_t options_fingerprint() const {
    grad::detail::fingerprint_builder h;
    h.add("weft.fsdp.options.v1").add(static_cast<std::uint64_t>(options_.level));
    h.add(static_cast<std::uint64_t>(options_.reshard_after_forward)).add(static_cast<std::uint64_t>(options_.prefetch));
    h.add(static_cast<std::uint64_t>(options_.accumulation_steps)).add(static_cast<std::uint64_t>(options_.scale));
    h.add(static_cast<std::uint64_t>(options_.reduce_dtype)).add(static_cast<std::uint64_t>(replicate_.has_value()));
    h.add(static_cast<std::uint64_t>(options_.enclosing_root));
    return h.value();
  }

  void checked(std::string_view what) const {
    if (!frozen_) fail(where() + ": " + std::string(what) + " before freeze(); register every unit, then call freeze()");
  }
  void check_unit(std::size_t u, std::string_view what) const {
    if (u >= units_.size())
      fail(where() + ": " + std::string(what) + "(" + std::to_string(u) + "): no such unit (" +
           std::to_string(units_.size()) + " registered)");
  }
  void check_no_open_scope(std::size_t u, std::string_view what) const {
    if (open_)
      fail(where() + ": " + std::string(what) + "(" + unit_name(u) + ") while the " +
           std::string(to_string(open_pass_)) + " scope of unit " + unit_name(*open_) +
           " is open; end one unit's scope before the next begins (units do not nest)");
  }
  void check_open(std::size_t u, pass p, std::string_view what) const {
    if (!open_ || *open_ != u || open_pass_ != p)
      fail(where() + ": " + std::string(what) + "(" + unit_name(u) + ") without the matching begin (" +
           (open_ ? "the open scope is the " + std::string(to_string(open_pass_)) + " of unit " + unit_name(*open_)
                  : std::string("no scope is open")) + ")");
  }
  bool is_root(std::size_t u) const noexcept { return options_.enclosing_root && u == 0; }
  void check_root_open(pass p, std::string_view what) const {
    if (root_open_ != p)
      fail(where() + ": " + std::string(what) + "(" + unit_name(0) + ") without the matching begin (" +
           (root_open_ ? "the root's open scope is its " + std::string(to_string(*root_open_))
                       : std::string("the root's scope is not open")) + ")");
    if (open_)
      fail(where() + ": " + std::string(what) + "(" + unit_name(0) + ") while the " +
           std::string(to_string(open_pass_)) + " scope of unit " + unit_name(*open_) +
           " is open; the root's scope encloses the others': end theirs first");
  }
  void check_access(std::size_t u, std::size_t index, std::string_view what) const {
    checked(what);
    check_unit(u, what);
    if (index >= plan_.unit(u).params().size())
      fail(where() + ": " + std::string(what) + "(" + unit_name(u) + ", " + std::to_string(index) + "): the unit has " +
           std::to_string(plan_.unit(u).params().size()) + " parameters");
    if (open_ && *open_ == u) return;
    if (is_root(u) && root_open_) return;
    if (units_[u].params == param_state::gathering)
      fail(where() + ": unit " + unit_name(u) + " used before its all-gather completed (it was prefetched and is "
           "still in flight); enter the unit's scope with forward(u) or backward(u), which waits for it");
    fail(where() + ": parameters of unit " + unit_name(u) + " touched outside the unit's forward or backward scope" +
         (units_[u].params == param_state::freed ? " (they are sharded now)" : "") +
         "; read them only between forward(u)/backward(u) and the end of that scope");
  }

  /// How work on the units' memory is ordered: nothing to say on the host; on a GPU, the device,
  /// the compute stream and the shard group's stream.
  detail::streams<memory> streams() const { return this->streams_of(); }

  /// Gives back a unit's gradient buffers.
  void release_buffers(unit_state& s) {
    s.work.release(streams());
    s.staging.release();
  }

  /// The zeroed gradient buffer of unit u's backward (on a GPU seeded with the gradient shard).
  void prepare_gradients(std::size_t u) {
    unit_state& s = units_[u];
    s.work.assign_zeros(plan_.unit(u).padded_elements(), streams());
    this->seed_gradients(u);
    this->account();
  }

  /// Issues unit u's all-gather unless its gathered copy is current or on its way.
  void ensure_gathered(std::size_t u) {
    unit_state& s = units_[u];
    if (s.params == param_state::gathering) return;
    if (s.params == param_state::gathered && !s.stale) return;
    const unit_layout& layout = plan_.unit(u);
    s.gathered.allocate(layout.padded_elements(), streams());
    this->issue_gather(s, layout);
    s.params = param_state::gathering;
    s.stale = false;
    log(schedule_kind::gather_issued, u);
    account();
  }

  void wait_gather(std::size_t u) {
    unit_state& s = units_[u];
    if (s.params != param_state::gathering) return;
    this->order_after_gather(s);
    s.params = param_state::gathered;
    log(schedule_kind::gather_waited, u);
  }
  void wait_gather_quietly(std::size_t u) {
    unit_state& s = units_[u];
    this->order_after_gather(s);
    if (s.params == param_state::gathering) s.params = param_state::gathered;
  }

  void free_params(std::size_t u) {
    unit_state& s = units_[u];
    this->before_free_params(s);
    s.gathered.release(streams());
    s.params = param_state::freed;
    log(schedule_kind::params_freed, u);
    account();
  }

  /// An exception left unit u's scope: close it without communicating; finish() reports the unit
  /// as not run backward, after reducing zeros for it.
  void abandon(std::size_t u) noexcept {
    if (open_ && *open_ == u) open_.reset();
    if (is_root(u)) root_open_.reset();
  }

  void issue_reduce(std::size_t u) {
    this->issue_reduce_of(u);
    reducing_.push_back(u);
    this->log(schedule_kind::reduce_issued, u);
    this->account();
  }

  /// Advances the oldest reduction (waits for it, or with `wait` false only tests it); once it
  /// is done, records it. Returns whether it finished.
  bool complete_front(bool wait) {
    const std::size_t u = reducing_.front();
    if (!this->advance_reduction(u, wait)) return false;
    reducing_.erase(reducing_.begin());
    this->log(schedule_kind::reduce_done, u);
    this->account();
    return true;
  }

  /// Records reductions that have finished, oldest first. A failure seen here is kept for
  /// finish(): thrown in the middle of backward, it would stop this rank from issuing the
  /// collectives its peers already wait in.
  void poll() {
    try {
      this->poll_retired();  // requests a GPU's streams wait for
    } catch (...) {
      if (!failure_) failure_ = std::current_exception();
    }
    try {
      while (!reducing_.empty() && complete_front(false)) {
      }
    } catch (...) {
      if (!failure_) failure_ = std::current_exception();
      // The failed unit is dropped from the queue; finish() waits for its requests.
      reducing_.erase(reducing_.begin());
    }
  }
};

}  // namespace weft::fsdp
