#pragma once
/// \file
/// Which groups of a layout stay inside a node, and warnings when the expensive ones do not.
///
/// Ranks are assumed to fill nodes in order: ranks 0..G-1 on the first node, G..2G-1 on the next,
/// where G is the number of GPUs per node (the launcher's local world size). This is what mpirun's
/// default mapping, srun's block distribution and torchrun do.

#include <weft/core/error.hpp>
#include <weft/layout/group_kind.hpp>
#include <weft/layout/layout.hpp>

#include <algorithm>
#include <string>
#include <vector>

namespace weft::layout {

/// How the groups of one kind fall on nodes.
struct group_placement {
  group_kind kind{};
  int group_size = 0;
  int group_count = 0;
  /// Groups whose ranks are on more than one node.
  int crossing = 0;
  /// The most nodes one group of this kind spans.
  int max_nodes = 0;

  bool inside_nodes() const noexcept { return crossing == 0; }
};

/// How a layout falls on nodes of `gpus_per_node` ranks each.
struct node_report {
  int gpus_per_node = 0;
  int node_count = 0;
  /// One entry per kind, in `all_group_kinds` order.
  std::vector<group_placement> groups;
  /// Sentences saying what is likely to be slow and what to change.
  std::vector<std::string> warnings;

  const group_placement& operator[](group_kind kind) const {
    for (const group_placement& p : groups) {
      if (p.kind == kind) return p;
    }
    fail("node_report has no entry for group '" + std::string(to_string(kind)) + "'");
  }
};

/// The node that holds `rank` when ranks fill nodes of `gpus_per_node` in order.
constexpr int node_of(int rank, int gpus_per_node) noexcept { return rank / gpus_per_node; }

namespace detail {

inline std::string crossing_text(const rank_layout& layout, const group_placement& p, int gpus_per_node) {
  return std::to_string(p.crossing) + " of " + std::to_string(p.group_count) + " " + std::string(to_string(p.kind)) +
         " groups (size " + std::to_string(p.group_size) + ") span more than one node of " + std::to_string(gpus_per_node) +
         " GPUs with order " + layout.order().to_string();
}

inline std::string tensor_fix(const rank_layout& layout, int size, int gpus_per_node, std::string_view name) {
  if (size > gpus_per_node) {
    return "lower " + std::string(name) + " to at most " + std::to_string(gpus_per_node) + " (move the rest to pp or dp)";
  }
  if (gpus_per_node % size != 0) {
    return "choose " + std::string(name) + " dividing " + std::to_string(gpus_per_node) + " so that its groups tile the nodes";
  }
  if (layout.order().dims().front() != dim::tp) {
    return "put tp first in the order (for example " + std::string(default_order) + ")";
  }
  return "make the world size a multiple of the GPUs per node";
}

}  // namespace detail

/// Places `layout` on nodes of `gpus_per_node` ranks and reports, per group kind, how many groups
/// cross node boundaries. Warns when a tensor-parallel group crosses nodes (it communicates in
/// every layer), when the order keeps data-parallel groups inside nodes while tensor-parallel
/// groups cross them (the order is the wrong way round), and when the last node is partly filled.
inline node_report place_on_nodes(const rank_layout& layout, int gpus_per_node) {
  if (gpus_per_node < 1) {
    fail("gpus per node " + std::to_string(gpus_per_node) +
         " is invalid: give the number of ranks on each node (the launcher's local world size), at least 1");
  }
  const int world = layout.world_size();
  node_report report;
  report.gpus_per_node = gpus_per_node;
  report.node_count = (world + gpus_per_node - 1) / gpus_per_node;
  std::vector<int> nodes;
  for (group_kind kind : all_group_kinds) {
    group_placement p{.kind = kind, .group_size = layout.group_size(kind), .group_count = layout.group_count(kind)};
    for (const std::vector<int>& ranks : layout.groups(kind)) {
      nodes.clear();
      for (int rank : ranks) nodes.push_back(node_of(rank, gpus_per_node));
      std::sort(nodes.begin(), nodes.end());
      const int spanned = static_cast<int>(std::unique(nodes.begin(), nodes.end()) - nodes.begin());
      p.max_nodes = std::max(p.max_nodes, spanned);
      if (spanned > 1) ++p.crossing;
    }
    report.groups.push_back(p);
  }

  if (world % gpus_per_node != 0) {
    report.warnings.push_back("world size " + std::to_string(world) + " is not a multiple of " + std::to_string(gpus_per_node) +
                              " GPUs per node: the last node holds only " + std::to_string(world % gpus_per_node) +
                              " ranks; check the GPUs per node");
  }
  const group_placement& tp = report[group_kind::tp];
  if (!tp.inside_nodes()) {
    report.warnings.push_back("TP groups span nodes: " + detail::crossing_text(layout, tp, gpus_per_node) +
                              "; tensor parallelism exchanges activations in every layer and needs the links inside a node: " +
                              detail::tensor_fix(layout, layout.tp(), gpus_per_node, "tp"));
  }
  const group_placement& expert_tp = report[group_kind::expert_tp];
  if (!expert_tp.inside_nodes() && (tp.inside_nodes() || layout.groups(group_kind::expert_tp) != layout.groups(group_kind::tp))) {
    report.warnings.push_back("expert TP groups span nodes: " + detail::crossing_text(layout, expert_tp, gpus_per_node) +
                              "; " + detail::tensor_fix(layout, layout.expert_tp(), gpus_per_node, "expert-tp"));
  }
  const group_placement& dp = report[group_kind::dp];
  if (!tp.inside_nodes() && layout.dp() > 1 && dp.inside_nodes()) {
    report.warnings.push_back("the order " + layout.order().to_string() +
                              " keeps DP groups inside nodes while TP groups cross nodes: data parallelism communicates "
                              "once per step, tensor parallelism in every layer; put tp before dp in the order "
                              "(for example " + std::string(default_order) + ")");
  }
  return report;
}

}  // namespace weft::layout
