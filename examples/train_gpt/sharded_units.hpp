#pragma once
// ZeRO-2, ZeRO-3 and hybrid sharding (HSDP) for train_gpt, on either memory: the rank's
// parameters as units of a weft::fsdp::sharded_model over the dp x cp group (every rank of it
// holds the same tp part of the same layers), the way FSDP2 wraps a GPT: one unit per transformer
// block, and the root unit (token and position embeddings, final norm) around them, since the
// tied embedding is used at both ends of the model. The model announces each parameter group's
// use (scope_event); here that opens and closes the units' scopes, and the owner binds the
// gathered parameters and gradient buffers. What differs between the CPU trainer
// (fully_sharded.hpp) and the GPU trainer (cuda/trainer.cpp) is only where the optimizer's state
// lives and how AdamW runs on the shards. Needs pp = 1 (the units of one micro-batch run forward
// in order, then backward in reverse) and a schedule that ends each micro-batch's backward before
// the next forward.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/comm/communicator.hpp>
#include <weft/fsdp/hybrid_groups.hpp>
#include <weft/fsdp/sharded_model.hpp>
#include <weft/fsdp/unit_grouping.hpp>
#include <weft/fsdp/unit_sizing.hpp>
#include <weft/fsdp/whole_tensor.hpp>
#include <weft/layout/layout.hpp>
#include <weft/layout/node_placement.hpp>
#include <weft/tune/layout.hpp>

#include "parameters.hpp"

namespace train_gpt {

/// Whether `level` runs on weft::fsdp (ZeRO-2, ZeRO-3, HSDP) rather than the gradient
/// synchronizer (none, ZeRO-1).
constexpr bool runs_fully_sharded(weft::tune::sharding level) noexcept {
  return level == weft::tune::sharding::gradients || level == weft::tune::sharding::full;
}

/// Why hybrid sharding cannot split the dp x cp groups of `layout` by the nodes that hold their
/// ranks (`node_of_rank[r]`: world rank r's node; every node must hold as many ranks of a group as
/// every other node that holds any), or nothing. `nodes` says where the node numbers come from.
/// Pure, so every rank finds the same answer before any group is split.
inline std::optional<std::string> hybrid_shard_problem(const weft::layout::rank_layout& layout,
                                                       std::span<const int> node_of_rank, std::string_view nodes) {
  for (const std::vector<int>& group : layout.groups(weft::layout::group_kind::dp_cp)) {
    std::map<int, int> per_node;
    for (int rank : group) ++per_node[node_of_rank[static_cast<std::size_t>(rank)]];
    std::string ranks;
    for (int rank : group) ranks += (ranks.empty() ? "" : ", ") + std::to_string(rank);
    for (const auto& [node, count] : per_node)
      if (count != per_node.begin()->second)
        return "--sharding hsdp: with " + std::string(nodes) + " the dp x cp group of ranks " + ranks + " has " +
               std::to_string(per_node.begin()->second) + " ranks on node " + std::to_string(per_node.begin()->first) +
               " but " + std::to_string(count) + " on node " + std::to_string(node) +
               "; hybrid sharding needs equal shard groups: launch whole nodes of dp x cp ranks, or give "
               "--ranks-per-node a divisor of dp x cp";
  }
  return std::nullopt;
}

/// HSDP's node of every world rank: blocks of `ranks_per_node` consecutive ranks (nodes simulated
/// on one host), or with 0 where the launcher put each rank as MPI confirms it (`launch_node`:
/// this rank's, weft::resolve_launch_with_mpi().node), gathered over `world`, which follows any
/// placement (`srun -m cyclic` deals ranks to nodes in turn). Collective over `world` with 0.
template <weft::backend B>
std::vector<int> node_of_ranks(weft::communicator<B>& world, int ranks_per_node, int launch_node) {
  std::vector<int> nodes(static_cast<std::size_t>(world.size()));
  if (ranks_per_node > 0) {
    for (int rank = 0; rank < world.size(); ++rank)
      nodes[static_cast<std::size_t>(rank)] = weft::layout::node_of(rank, ranks_per_node);
    return nodes;
  }
  const std::int64_t mine = launch_node;
  std::vector<std::int64_t> all(nodes.size());
  world.host_all_gather(std::span<const std::int64_t>(&mine, 1), all);
  std::copy(all.begin(), all.end(), nodes.begin());
  return nodes;
}

/// Where the --ranks-per-node nodes come from, for hybrid_shard_problem's message.
inline std::string node_source(int ranks_per_node) {
  return ranks_per_node > 0 ? std::to_string(ranks_per_node) + " ranks per node" : "the nodes the launcher put the ranks on";
}

template <weft::backend B>
class sharded_units {
  using comm = weft::communicator<B>;
  using clock = std::chrono::steady_clock;

 public:
  using sharded = weft::fsdp::sharded_model<B, float>;

  struct settings {
    weft::tune::sharding level = weft::tune::sharding::full;
    /// HSDP: shard over the dp x cp ranks of one node, replicate across nodes; `node` is the
    /// index of this rank's node.
    bool hybrid = false;
    int node = 0;
    int micro_batches = 1;
    /// tp's sequence parallelism: the replicated parameters' gradients are partial sums over tp.
    bool sequence_parallel = false;
    /// ZeRO-3 and HSDP: the most bytes of blocks one unit gathers; by default measured on the
    /// shard group (weft::fsdp::choose_unit_bytes). ZeRO-2 keeps one unit per block.
    std::size_t unit_bytes = weft::grad::measured_bucket_bytes;
  };
  /// Called after a unit's scope begins: point the model's parameters of unit `u` at the gathered
  /// values (`model().param(u, j)`) and, in backward, its gradients at `model().grad(u, j)`.
  using binder = std::function<void(std::size_t u, bool backward)>;

  /// `specs`: the rank's parameters (rank_parameters, pp = 1). Collective over dp x cp and tp
  /// (ZeRO-3 and HSDP measure the unit cap there).
  sharded_units(comm& dp_cp, comm& tp, std::vector<param_spec> specs, settings s, binder bind)
      : specs_(std::move(specs)), s_(s), bind_(std::move(bind)) {
    const weft::fsdp::fsdp_options options{.level = s.level,
                                           .enclosing_root = true,
                                           .accumulation_steps = s.micro_batches,
                                           .scale = weft::grad::scaling::sum,  // the loss is scaled by 1 / global tokens
                                           .reduce_dtype = weft::dtype::float32};
    if (s.hybrid) {
      groups_.emplace(weft::fsdp::split_by_node(dp_cp, s.node));
      model_ = std::make_unique<sharded>(groups_->shard, groups_->replicate, options);
    } else {
      model_ = std::make_unique<sharded>(dp_cp, options);
    }
    // Root first: everything outside the blocks; then the blocks, one unit each or, under ZeRO-3
    // and HSDP, consecutive blocks in one unit up to the cap the shard group's all-gather and
    // reduce-scatter measure (a unit's collectives cost per call, and past some size the library
    // turns slower: weft/fsdp/unit_grouping.hpp).
    int layers = 0;
    for (const param_spec& p : specs_) layers = std::max(layers, p.layer + 1);
    std::vector<std::size_t> root;
    std::vector<std::vector<std::size_t>> block_specs(static_cast<std::size_t>(layers));
    for (std::size_t i = 0; i < specs_.size(); ++i)
      (specs_[i].layer < 0 ? root : block_specs[static_cast<std::size_t>(specs_[i].layer)]).push_back(i);
    std::vector<weft::fsdp::unit_spec> blocks;
    for (std::size_t l = 0; l < block_specs.size(); ++l) {
      blocks.push_back({"h." + std::to_string(l), {}});
      for (std::size_t i : block_specs[l]) blocks.back().params.push_back({specs_[i].name, specs_[i].local_elements});
    }
    std::size_t unit_cap = 1;  // smaller than any block: one unit per block
    if (s.level == weft::tune::sharding::full && !blocks.empty()) {
      unit_cap = weft::fsdp::choose_unit_bytes<float>(s.hybrid ? groups_->shard : dp_cp,
                                                      std::span<const weft::fsdp::unit_spec>(blocks), s.unit_bytes)
                     .bucket_bytes;
      // Every rank must group alike: tp peers open and close their scopes together (sequence
      // parallelism sums over tp inside them), and HSDP's replicas reduce unit by unit. Each
      // group measured its own cap, so all take the smallest: over dp x cp, then over tp (with
      // pp = 1 the two span every rank).
      unit_cap = smallest_on_all_ranks(tp, smallest_on_all_ranks(dp_cp, unit_cap));
    }
    place_.resize(specs_.size());
    units_.push_back(root);
    model_->add_unit("root", params_of(root));
    for (std::size_t j = 0; j < root.size(); ++j) place_[root[j]] = {0, j};
    if (!blocks.empty()) {
      const weft::fsdp::layer_grouping grouping =
          weft::fsdp::group_layers(std::span<const weft::fsdp::unit_spec>(blocks), weft::dtype::float32, unit_cap);
      for (const weft::fsdp::unit_spec& unit : grouping.units) model_->add_unit(unit);
      units_.resize(1 + grouping.units.size());
      for (std::size_t l = 0; l < block_specs.size(); ++l) {
        const std::size_t u = 1 + grouping.layers[l].unit;
        for (std::size_t k = 0; k < block_specs[l].size(); ++k) {
          place_[block_specs[l][k]] = {u, grouping.layers[l].first_param + k};
          units_[u].push_back(block_specs[l][k]);
        }
        layer_unit_.push_back(u);
      }
    }
    std::size_t offset = 0;
    for (const param_spec& p : specs_) packed_.push_back(offset), offset += p.local_elements;
    packed_elements_ = offset;
  }

  /// The sharded model; freeze() it (after setting a GPU's compute stream) before use.
  sharded& model() noexcept { return *model_; }
  const sharded& model() const noexcept { return *model_; }
  std::size_t unit_count() const noexcept { return units_.size(); }
  /// Unit u's parameters: their indices in rank_parameters order.
  const std::vector<std::size_t>& unit(std::size_t u) const { return units_.at(u); }
  const std::vector<param_spec>& specs() const noexcept { return specs_; }

  /// Sets parameter i (rank_parameters order) from its local (tp) part; every rank of the shard
  /// group passes the same values and keeps its shard.
  void load_param(std::size_t i, std::span<const float> local) { model_->load_whole(place_[i].first, place_[i].second, local); }

  /// True once the last micro-batch of the step has finished: the gradient shards hold the
  /// step's reduced gradients. `stepped()` after the optimizer step.
  bool step_ready() const noexcept { return ready_; }
  void stepped() noexcept { ready_ = false; }
  /// Seconds this rank waited for gathers and reductions since the last call.
  double take_exposed_seconds() noexcept { return std::exchange(exposed_, 0.0); }

  // ---- whole values, for checkpoints and gradient dumps -------------------------------------
  // "Packed": the rank's local (tp) part of every parameter, in rank_parameters order, one after
  // another, as the unsharded path's buffers hold them.

  std::span<const std::size_t> packed_offsets() const noexcept { return packed_; }
  std::size_t packed_elements() const noexcept { return packed_elements_; }

  /// A state laid out like the master shards (`shard_of(u)`: this rank's shard of unit u in the
  /// backend's memory), gathered into packed form on the host (collective over the shard group).
  template <class ShardOf>
  std::vector<float> packed(ShardOf&& shard_of) {
    const auto whole = model_->gather_whole(std::forward<ShardOf>(shard_of));
    std::vector<float> out(packed_elements_);
    std::size_t t = 0;
    for (const std::vector<std::size_t>& unit : units_)
      for (std::size_t i : unit) {
        const std::vector<float>& v = whole.at(t++).values;
        std::copy(v.begin(), v.end(), out.begin() + static_cast<std::ptrdiff_t>(packed_[i]));
      }
    return out;
  }
  /// Sets a state laid out like the master shards (`writable_shard_of(u)`) from packed values;
  /// every rank of the shard group passes the same values and keeps its shards.
  template <class ShardOf>
  void load_packed(std::span<const float> values, ShardOf&& writable_shard_of) {
    std::vector<weft::fsdp::whole_tensor<float>> whole;
    for (std::size_t u = 0; u < units_.size(); ++u)
      for (std::size_t j = 0; j < units_[u].size(); ++j) {
        const std::size_t i = units_[u][j];
        const auto first = values.begin() + static_cast<std::ptrdiff_t>(packed_[i]);
        whole.push_back({weft::fsdp::whole_name("", model_->plan().unit(u), j),
                         std::vector<float>(first, first + static_cast<std::ptrdiff_t>(specs_[i].local_elements))});
      }
    model_->reshard_from_whole(std::span<const weft::fsdp::whole_tensor<float>>(whole),
                               std::forward<ShardOf>(writable_shard_of));
  }

  /// The model's parameter groups as units: a unit of blocks opens with its first block in
  /// forward (its last in backward) and closes with its last (first); the root's scope opens with
  /// the embeddings (forward) or the head (backward) and closes with the other end. With sequence
  /// parallelism, `sum_over_tp(i, grad)` is called for each replicated parameter i (rank_parameters
  /// order) of a unit whose backward ends, before its reduction: the model sums over tp in place
  /// what each tp rank computed from its rows alone (which parameters those are is the model's).
  void on_scope(int group, scope_event e, const std::function<void(std::size_t, std::span<float>)>& sum_over_tp) {
    const bool root_group = group < 0;
    const bool embedding = group == embedding_group;
    const std::size_t u = root_group ? 0 : unit_of(group);
    const auto t0 = clock::now();
    switch (e) {
      case scope_event::enter_forward:
        if (root_group && !embedding) return;  // the head: the root has been open since the embeddings
        if (!root_group && !first_of_unit(group)) return;
        model_->begin_forward(u);
        bind_(u, false);
        break;
      case scope_event::leave_forward:
        if (embedding) return;
        if (!root_group && !last_of_unit(group)) return;
        model_->end_forward(u);
        break;
      case scope_event::enter_backward:
        if (embedding) return;  // the root has been open since the head
        if (!root_group && !last_of_unit(group)) return;
        model_->begin_backward(u);
        bind_(u, true);
        break;
      case scope_event::leave_backward:
        if (root_group && !embedding) return;
        if (!root_group && !first_of_unit(group)) return;
        if (s_.sequence_parallel)
          for (std::size_t j = 0; j < units_[u].size(); ++j)
            if (specs_[units_[u][j]].split == tp_split::replicated && !moe_param(specs_[units_[u][j]]))
              sum_over_tp(units_[u][j], model_->grad(u, j));
        model_->end_backward(u);
        if (u == 0) ready_ = model_->finish();  // the root closes the micro-batch
        break;
    }
    exposed_ += std::chrono::duration<double>(clock::now() - t0).count();
  }

 private:
  std::size_t unit_of(int layer) const noexcept { return layer < 0 ? 0 : layer_unit_[static_cast<std::size_t>(layer)]; }
  /// Whether block `layer` is the first (forward order) or the last of its unit's blocks.
  bool first_of_unit(int layer) const noexcept { return layer == 0 || unit_of(layer - 1) != unit_of(layer); }
  bool last_of_unit(int layer) const noexcept {
    return static_cast<std::size_t>(layer) + 1 == layer_unit_.size() || unit_of(layer + 1) != unit_of(layer);
  }

  /// The smallest of every rank's `value` in `group` (collective).
  static std::size_t smallest_on_all_ranks(comm& group, std::size_t value) {
    const std::int64_t mine = static_cast<std::int64_t>(value);
    std::vector<std::int64_t> all(static_cast<std::size_t>(group.size()));
    group.host_all_gather(std::span<const std::int64_t>(&mine, 1), all);
    return static_cast<std::size_t>(*std::min_element(all.begin(), all.end()));
  }

  std::vector<weft::grad::param_spec> params_of(const std::vector<std::size_t>& spec_indices) const {
    std::vector<weft::grad::param_spec> out;
    for (std::size_t i : spec_indices) out.push_back({specs_[i].name, specs_[i].local_elements});
    return out;
  }

  std::vector<param_spec> specs_;
  settings s_;
  binder bind_;
  std::optional<weft::fsdp::hybrid_groups<B>> groups_;
  std::unique_ptr<sharded> model_;
  std::vector<std::vector<std::size_t>> units_;  // spec indices of each unit
  std::vector<std::size_t> layer_unit_;          // block -> its unit
  std::vector<std::pair<std::size_t, std::size_t>> place_;  // spec index -> (unit, index in the unit)
  std::vector<std::size_t> packed_;
  std::size_t packed_elements_ = 0;
  bool ready_ = false;
  double exposed_ = 0;
};

}  // namespace train_gpt
