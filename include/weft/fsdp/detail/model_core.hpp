#pragma once
/// \file
/// The state a sharded model shares between its host and device parts: the groups, the options,
/// the units and their plan (fsdp/unit_plan.hpp, pure), where the micro-step is (which unit's
/// forward or backward comes next, the open scopes), each unit's memory and requests, and the
/// reductions in flight. The host part (fsdp/detail/host_units.hpp) and the device part
/// (fsdp/detail/device_units.hpp) derive from it; sharded_model<B, Param> derives from the part
/// its backend's memory space selects.

#include <algorithm>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/fsdp/detail/unit_buffer.hpp>
#include <weft/fsdp/options.hpp>
#include <weft/fsdp/schedule.hpp>
#include <weft/fsdp/unit_plan.hpp>
#include <weft/grad/options.hpp>
#include <weft/grad/reduction_schedule.hpp>

namespace weft::fsdp {

/// The type master shards and accumulated gradients are kept in: float, or double for double
/// parameters.
template <class Param>
using master_t = std::conditional_t<std::is_same_v<Param, double>, double, float>;

namespace detail {

/// What a unit's reduction needs besides its gradient buffer: on the host the gradients converted
/// for the wire (fsdp/detail/host_units.hpp); nothing on a device.
template <element Param, memory_space M>
struct reduction_staging;

template <backend B, element Param>
class model_core {
 public:
  using request = typename B::request;
  using master_type = master_t<Param>;
  /// Where shards, gathered parameters and gradients live: the backend's buffer memory.
  static constexpr memory_space memory = buffer_memory_v<B>;
  static constexpr bool on_device = memory == memory_space::device;

  model_core(const model_core&) = delete;
  model_core& operator=(const model_core&) = delete;

  communicator<B>& shard_group() const { return shard_.get(); }
  communicator<B>& replicate_group() const {
    if (!replicate_) fail(where() + ": replicate_group(): this model has no replicate group (not hybrid)");
    return replicate_->get();
  }
  bool hybrid() const noexcept { return replicate_.has_value(); }
  /// Ranks a gradient is averaged over: the shard group's size times the replicas'.
  int data_parallel_size() const { return shard_group().size() * (replicate_ ? replicate_group().size() : 1); }

 protected:
  model_core(communicator<B>& shard_group, fsdp_options options) : shard_(shard_group.ref()), options_(options) {}
  model_core(communicator<B>& shard_group, communicator<B>& replicate_group, fsdp_options options)
      : shard_(shard_group.ref()), replicate_(replicate_group.ref()), options_(options) {}
  ~model_core() = default;

  enum class param_state { freed, gathering, gathered };

  struct unit_state {
    unit_buffer<master_type, memory> master;  ///< this rank's master shard (padding included)
    unit_buffer<master_type, memory> grads;   ///< this rank's accumulated gradient shard
    unit_buffer<Param, memory> gathered;      ///< the whole unit's parameters while gathered
    param_state params = param_state::freed;
    bool stale = true;                 ///< the gathered copy is older than the master shard
    unit_buffer<Param, memory> work;   ///< the unit's gradients during its backward and reduction
    reduction_staging<Param, memory> staging;
    bool backward_done = false;        ///< its reduction was issued in this micro-step
    // Last: destroyed first, so nothing is in flight when the buffers go.
    request gather;
    request reduce;
    request replicate;
  };

  std::string where() const { return "fsdp model on group '" + shard_group().name() + "'"; }
  std::string unit_name(std::size_t u) const {
    return u < specs_.size() ? "'" + specs_[u].name + "' (" + std::to_string(u) + ")" : std::to_string(u);
  }

  bool full_sharding() const noexcept { return options_.level == tune::sharding::full; }
  bool in_micro_step() const noexcept { return next_forward_ != 0 || open_.has_value() || root_open_.has_value(); }
  bool last_micro_step() const noexcept { return micro_ == options_.accumulation_steps - 1; }

  /// The factor the window's reduced sum is multiplied by, if known now.
  std::optional<double> scale_factor() const {
    return grad::window_scale_factor(options_.scale, data_parallel_size(), options_.accumulation_steps, token_count_);
  }

  void log(schedule_kind kind, std::size_t u) {
    if (options_.record_schedule) schedule_.push_back({kind, u, during_, micro_});
  }

  void account() noexcept {
    std::size_t n = 0;
    for (const unit_state& s : units_)
      n += s.master.bytes() + s.grads.bytes() + s.gathered.bytes() + s.work.bytes() + s.staging.bytes();
    held_ = n;
    peak_ = std::max(peak_, n);
  }

  communicator_ref<B> shard_;
  std::optional<communicator_ref<B>> replicate_;
  fsdp_options options_;
  std::vector<unit_spec> specs_;
  unit_plan plan_;
  bool frozen_ = false;

  std::size_t next_forward_ = 0;   ///< the unit whose forward comes next (unit_count(): all done)
  std::size_t next_backward_ = 0;  ///< the unit whose backward comes next
  std::optional<std::size_t> open_;  ///< the open scope of a unit other than an enclosing root
  pass open_pass_ = pass::forward;
  std::optional<pass> root_open_;    ///< the enclosing root's open scope
  pass during_ = pass::between;
  int micro_ = 0;
  std::size_t steps_ = 0;
  std::optional<double> token_count_;
  std::exception_ptr failure_;  ///< a reduction's failure seen during backward, rethrown by finish()

  std::size_t held_ = 0;
  std::size_t peak_ = 0;
  std::vector<schedule_event> schedule_;

  // Last: destroyed first, so their requests finish while the rest still exists.
  std::vector<std::size_t> reducing_;  ///< units whose reduction is in flight, in issue order
  std::vector<unit_state> units_;
};

}  // namespace detail
}  // namespace weft::fsdp
