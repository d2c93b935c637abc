#pragma once
/// \file
/// A sharded model's host part (host-memory backends: MPI). Every operation on a unit's memory is
/// complete when it returns; the host waits for a gather before the unit's scope begins. A unit's
/// parameters are gathered in `Param` from its master shard (converted in place), its gradients
/// reduce-scattered in `reduce_dtype` (a converted copy when that differs), then all-reduced
/// across replicas once the reduce-scatter is seen complete, and the reduced shard is added into
/// the master-type gradient shard; the window's scale is applied to the shards at its end. The
/// shared state: fsdp/detail/model_core.hpp.

#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/core/dtype.hpp>
#include <weft/fsdp/detail/accumulate.hpp>
#include <weft/fsdp/detail/model_core.hpp>
#include <weft/fsdp/detail/unit_buffer.hpp>
#include <weft/grad/detail/convert.hpp>

namespace weft::fsdp::detail {

template <element Param>
struct reduction_staging<Param, memory_space::host> {
  std::vector<float> wire_f32;  ///< the gradients converted for the wire
  std::vector<bfloat16> wire_bf16;
  bool replicating = false;  ///< the reduce-scatter is done; the all-reduce across replicas runs

  std::size_t bytes() const noexcept {
    return wire_f32.capacity() * sizeof(float) + wire_bf16.capacity() * sizeof(bfloat16);
  }
  void release() noexcept {
    std::vector<float>().swap(wire_f32);
    std::vector<bfloat16>().swap(wire_bf16);
  }
};

template <backend B, element Param>
class host_units : public model_core<B, Param> {
  using core = model_core<B, Param>;

 protected:
  using typename core::master_type;
  using typename core::param_state;
  using typename core::unit_state;

  using core::core;
  ~host_units() = default;

  // ---- what sharded_model<B, Param> calls --------------------------------------------------

  /// Nothing orders host memory: every operation is complete when it returns.
  streams<memory_space::host> streams_of() const { return {}; }

  /// Nothing to check before a backward, or before a token count changes (it is applied at the
  /// window's end).
  void check_backward_can_begin() const {}
  void check_token_count_can_change() const {}

  /// Unit u's gathered buffer starts zeroed; the reduction's result is added into the shard later.
  void seed_gradients(std::size_t) {}

  /// Converts this rank's master shard into its block of the gathered buffer and gathers the rest.
  void issue_gather(unit_state& s, const unit_layout& layout) {
    const std::size_t at = layout.shard_offset(this->shard_group().rank());
    grad::detail::convert_scaled<Param, master_type>(std::as_const(s.master).span(),
                                                      s.gathered.span().subspan(at, s.master.size()), 1.0);
    s.gather = this->shard_group().all_gather_in_place_async(s.gathered.span());
  }
  /// The unit's scope begins: the host waits for its gather.
  void order_after_gather(unit_state& s) { s.gather.wait(); }
  /// A prefetched gather may still write into the buffer about to be freed.
  void before_free_params(unit_state& s) { s.gather.wait(); }

  /// Reduce-scatters the unit's gradients in the wire type; the all-reduce across replicas is
  /// issued by advance_reduction once this is seen complete.
  void issue_reduce_of(std::size_t u) {
    unit_state& s = this->units_[u];
    with_wire_type([&]<class Wire>() {
      if constexpr (!std::is_same_v<Wire, Param>) {
        std::vector<Wire>& converted = converted_wire<Wire>(s);
        converted.resize(s.work.size());
        grad::detail::convert_scaled<Wire, Param>(std::as_const(s.work).span(), std::span<Wire>(converted), 1.0);
        s.work.release(streams_of());  // only the wire copy is needed from here on
      }
      s.reduce = this->shard_group().reduce_scatter_in_place_async(wire_of<Wire>(s));
    });
    s.staging.replicating = false;
  }

  /// Advances unit u's reduction: waits for (or, with `wait` false, only tests) its
  /// reduce-scatter, issues its all-reduce across replicas, and once everything is done adds the
  /// shard into the gradient shard and frees its buffers. Returns whether it finished.
  bool advance_reduction(std::size_t u, bool wait) {
    unit_state& s = this->units_[u];
    bool done = false;
    with_wire_type([&]<class Wire>() {
      const unit_layout& layout = this->plan_.unit(u);
      std::span<Wire> mine =
          wire_of<Wire>(s).subspan(layout.shard_offset(this->shard_group().rank()), layout.shard_elements());
      if (!s.staging.replicating) {
        if (wait)
          s.reduce.wait();
        else if (!s.reduce.test())
          return;
        if (this->replicate_) {
          s.replicate = this->replicate_group().all_reduce_async(mine);
          s.staging.replicating = true;
        }
      }
      if (s.staging.replicating) {
        if (wait)
          s.replicate.wait();
        else if (!s.replicate.test())
          return;
      }
      add_converted<master_type, Wire>(mine, s.grads.span());
      if constexpr (!std::is_same_v<Wire, Param>) s.staging.release();
      s.work.release(streams_of());
      done = true;
    });
    return done;
  }

  /// The end of a micro-step: the host waits for what the unit still has in flight.
  void settle_requests(unit_state& s) {
    s.gather.wait();
    s.reduce.wait();
    s.replicate.wait();
  }
  /// Nothing is set aside on the host: every request is waited for where it is.
  void poll_retired() {}

  /// The window's reductions are summed in the shards: scale them.
  void apply_window_scale(double factor) {
    if (factor == 1.0) return;
    for (unit_state& s : this->units_) grad::detail::scale_in_place<master_type>(s.grads.span(), factor);
  }

 private:
  /// The unit's gradients as they go on the wire: the gradient buffer itself, or its copy
  /// converted to Wire.
  template <class Wire>
  std::span<Wire> wire_of(unit_state& s) {
    if constexpr (std::is_same_v<Wire, Param>)
      return s.work.span();
    else
      return converted_wire<Wire>(s);
  }
  template <class Wire>
  std::vector<Wire>& converted_wire(unit_state& s) {
    if constexpr (std::is_same_v<Wire, float>)
      return s.staging.wire_f32;
    else
      return s.staging.wire_bf16;
  }

  /// Calls f.template operator()<Wire>() with the type gradients are reduced in.
  template <class F>
  void with_wire_type(F&& f) {
    if (this->options_.reduce_dtype == dtype_of<Param>)
      f.template operator()<Param>();
    else if (this->options_.reduce_dtype == dtype::float32)
      f.template operator()<float>();
    else
      f.template operator()<bfloat16>();
  }
};

}  // namespace weft::fsdp::detail
