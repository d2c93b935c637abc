#pragma once
// ZeRO-2, ZeRO-3 and hybrid sharding (HSDP) for the CPU trainer: the units of sharded_units.hpp
// bound to gpt_model's parameters as it opens and closes its groups' scopes, and AdamW on this
// rank's shards with its moments in host memory, weight decay per parameter as in the unsharded
// path.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

#include <weft/comm/communicator.hpp>

#include "cpu_kernels.hpp"
#include "model.hpp"
#include "parameters.hpp"
#include "sharded_units.hpp"

namespace train_gpt {

template <weft::backend B>
class fully_sharded {
  using comm = weft::communicator<B>;
  using sharded = typename sharded_units<B>::sharded;

 public:
  using settings = typename sharded_units<B>::settings;

  /// `specs`: the rank's parameters (rank_parameters, pp = 1).
  fully_sharded(comm& dp_cp, comm& tp, std::vector<param_spec> specs, settings s)
      : tp_(tp),
        units_(dp_cp, tp, std::move(specs), s, [this](std::size_t u, bool backward) { bind(u, backward); }) {
    units_.model().freeze();
    for (std::size_t u = 0; u < units_.unit_count(); ++u) {
      m1_.emplace_back(units_.model().shard_params_view(u).size(), 0.0f);
      m2_.emplace_back(units_.model().shard_params_view(u).size(), 0.0f);
    }
  }

  /// Sets parameter i (rank_parameters order) from its local (tp) part; every rank of the shard
  /// group passes the same values and keeps its shard.
  void load_param(std::size_t i, std::span<const float> local) { units_.load_param(i, local); }

  /// Opens and closes the units' scopes as `model` uses its parameter groups.
  void attach(gpt_model<B>& model) {
    model_view_ = &model;
    model.on_scope([this](int group, scope_event e) {
      units_.on_scope(group, e, [this](std::size_t, std::span<float> grad) { tp_.all_reduce(grad); });
    });
  }

  /// True once the last micro-batch of the step has finished: the gradient shards hold the
  /// step's reduced gradients.
  bool step_ready() const noexcept { return units_.step_ready(); }
  /// Seconds this rank waited for gathers and reductions since the last call.
  double take_exposed_seconds() noexcept { return units_.take_exposed_seconds(); }

  /// AdamW on this rank's shards (after step_ready()), then the gradient shards are zeroed.
  void step(const cpu_kernels::adamw_settings& adamw, std::int64_t step) {
    if (!units_.step_ready())
      throw std::logic_error("train_gpt: the sharded optimizer step before the gradients were reduced");
    sharded& model = units_.model();
    for (std::size_t u = 0; u < units_.unit_count(); ++u) {
      std::span<float> p = model.shard_params(u);
      std::span<const float> g = model.shard_grads(u);
      for (const weft::fsdp::shard_run& run : model.shard_runs(u))
        cpu_kernels::adamw(p.data() + run.shard_offset, g.data() + run.shard_offset, m1_[u].data() + run.shard_offset,
                           m2_[u].data() + run.shard_offset, run.count, step, adamw,
                           units_.specs()[units_.unit(u)[run.param]].decay);
    }
    model.zero_grad();
    units_.stepped();
  }

  // ---- whole values, for checkpoints and gradient dumps (sharded_units' "packed" form) ------

  std::span<const std::size_t> packed_offsets() const noexcept { return units_.packed_offsets(); }
  std::size_t packed_elements() const noexcept { return units_.packed_elements(); }

  enum class state { params, grads, exp_avg, exp_avg_sq };
  /// A state gathered from the shards into packed form (collective over the shard group).
  std::vector<float> packed(state which) {
    return units_.packed([&](std::size_t u) { return shard_of(which, u); });
  }
  /// Sets a state (params or moments) from packed values; every rank of the shard group passes
  /// the same values and keeps its shards.
  void load_packed(state which, std::span<const float> values) {
    units_.load_packed(values, [&](std::size_t u) { return writable_shard(which, u); });
  }

  /// This rank's shards of a state (params or moments) as runs of parameters, for distributed
  /// checkpoints: each rank saves and loads its own shard, with no gather.
  std::vector<param_run<const float>> shard_runs(state which) const {
    std::vector<param_run<const float>> out;
    for (std::size_t u = 0; u < units_.unit_count(); ++u)
      for (const weft::fsdp::shard_run& run : units_.model().shard_runs(u))
        out.push_back({units_.unit(u)[run.param], run.param_offset, shard_of(which, u).subspan(run.shard_offset, run.count)});
    return out;
  }
  /// The same, writable (params: the units are gathered again before the next forward).
  std::vector<param_run<float>> writable_shard_runs(state which) {
    std::vector<param_run<float>> out;
    for (std::size_t u = 0; u < units_.unit_count(); ++u) {
      const std::span<float> shard = writable_shard(which, u);
      for (const weft::fsdp::shard_run& run : units_.model().shard_runs(u))
        out.push_back({units_.unit(u)[run.param], run.param_offset, shard.subspan(run.shard_offset, run.count)});
    }
    return out;
  }

  /// The most bytes of training state this rank has held: the sharded model's (master and
  /// gradient shards, gathered units, gradient buffers in flight) and the AdamW moments.
  std::size_t peak_state_bytes() const noexcept {
    std::size_t moments = 0;
    for (std::size_t u = 0; u < m1_.size(); ++u) moments += (m1_[u].size() + m2_[u].size()) * sizeof(float);
    return units_.model().peak_bytes() + moments;
  }

 private:
  std::span<const float> shard_of(state which, std::size_t u) const {
    switch (which) {
      case state::params: return units_.model().shard_params_view(u);
      case state::grads: return units_.model().shard_grads(u);
      case state::exp_avg: return m1_[u];
      case state::exp_avg_sq: return m2_[u];
    }
    return {};
  }
  std::span<float> writable_shard(state which, std::size_t u) {
    switch (which) {
      case state::params: return units_.model().shard_params(u);
      case state::exp_avg: return m1_[u];
      case state::exp_avg_sq: return m2_[u];
      case state::grads: break;
    }
    throw std::logic_error("train_gpt: gradient shards are not loaded");
  }

  void bind(std::size_t u, bool backward) {
    for (std::size_t j = 0; j < units_.unit(u).size(); ++j) {
      model_view_->bind_param(units_.unit(u)[j], units_.model().param(u, j));
      if (backward) model_view_->bind_grad(units_.unit(u)[j], units_.model().grad(u, j));
    }
  }

  comm& tp_;
  sharded_units<B> units_;
  std::vector<std::vector<float>> m1_, m2_;  // AdamW moments, laid out like the shards
  gpt_model<B>* model_view_ = nullptr;
};

}  // namespace train_gpt
