#pragma once
/// \file
/// `weft::process_groups<Backend>`: one communicator per group of a layout that this rank belongs
/// to, made by splitting the world communicator, each named after its kind ("tp", "dp", "dp-cp",
/// "embedding", ...) so that the name appears in its errors.
///
/// Creation is eager and collective, in `all_group_kinds` order on every rank. Before the first
/// split, every rank compares the layout's fingerprint: a rank started with a different layout
/// makes every rank throw an error that says so, instead of ranks splitting in different orders
/// and hanging. Kinds whose groups have one rank cost no communication (the rank's own
/// communicator is made locally when the backend can, e.g. MPI_COMM_SELF).

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/comm/communicator.hpp>
#include <weft/core/error.hpp>
#include <weft/layout/group_kind.hpp>
#include <weft/layout/layout.hpp>

namespace weft {

template <backend B>
class process_groups {
 public:
  using communicator_type = communicator<B>;

  /// Collective over `world`, whose size must equal the layout's world size.
  process_groups(communicator_type& world, layout::rank_layout layout)
      : layout_(std::move(layout)), rank_(world.rank()) {
    if (world.size() != layout_.world_size())
      fail("process groups: the layout is for a world of " + std::to_string(layout_.world_size()) +
           " ranks but communicator '" + world.name() + "' has " + std::to_string(world.size()) +
           "; launch " + std::to_string(layout_.world_size()) + " ranks or change the degrees");
    world.expect_same_on_all_ranks("the parallel layout (this rank has " + layout_.canonical_text() + ")",
                                   layout_.fingerprint());
    groups_ = layout_.rank_groups(rank_);
    for (std::size_t i = 0; i < groups_.size(); ++i) {
      const layout::rank_group& group = groups_[i];
      const layout::group_kind kind = layout::all_group_kinds[i];
      std::string name(layout::to_string(kind));
      if constexpr (self_is_local) {  // a backend without a local self communicator splits for these too
        if (layout_.group_size(kind) == 1) {
          if (group.member()) comms_[i].emplace(B::comm::self(), std::move(name), world.checks());
          continue;
        }
      }
      comms_[i] = world.split(group.member() ? group.index : -1, group.member() ? group.position : 0, std::move(name));
    }
  }

  const layout::rank_layout& layout() const noexcept { return layout_; }
  /// This rank's world rank and its coordinates on the layout's grids.
  int rank() const noexcept { return rank_; }
  layout::rank_coordinates coordinates() const { return layout_.coordinates(rank_); }

  /// Whether this rank belongs to a group of `kind` (always, except for the embedding kinds).
  bool has(layout::group_kind kind) const noexcept { return comms_[index_of(kind)].has_value(); }

  /// The communicator of this rank's group of `kind`.
  communicator_type& get(layout::group_kind kind) {
    auto& slot = comms_[index_of(kind)];
    if (!slot)
      fail("process groups: rank " + std::to_string(rank_) + " is in no '" + std::string(layout::to_string(kind)) +
           "' group (only the first and last pipeline stages are); check has() first");
    return *slot;
  }
  /// The communicator named `name` ("tp", "dp-cp", ...), or nullptr when this rank is in no such
  /// group or the name is unknown (a misspelt name is nullptr too: get(name) says which names
  /// there are).
  communicator_type* find(std::string_view name) {
    auto kind = layout::parse_group_kind(name);
    if (!kind || !has(*kind)) return nullptr;
    return &get(*kind);
  }
  /// The communicator named `name`; an unknown name throws an error listing the known ones, and a
  /// group this rank is not in throws as get(kind) does.
  communicator_type& get(std::string_view name) {
    const auto kind = layout::parse_group_kind(name);
    if (!kind) unknown_name(name);
    return get(*kind);
  }
  /// This rank's group of `kind`: its world ranks and this rank's place in it.
  const layout::rank_group& group(layout::group_kind kind) const noexcept { return groups_[index_of(kind)]; }

  communicator_type& tp() { return get(layout::group_kind::tp); }
  communicator_type& cp() { return get(layout::group_kind::cp); }
  communicator_type& dp() { return get(layout::group_kind::dp); }
  communicator_type& pp() { return get(layout::group_kind::pp); }
  communicator_type& ep() { return get(layout::group_kind::ep); }
  /// Gradient reduction group under context parallelism (dp x cp).
  communicator_type& dp_cp() { return get(layout::group_kind::dp_cp); }
  /// All ranks that hold one model replica (tp x pp).
  communicator_type& model_parallel() { return get(layout::group_kind::tp_pp); }
  communicator_type& embedding() { return get(layout::group_kind::embedding); }

 private:
  static constexpr bool self_is_local = requires { B::comm::self(); };

  [[noreturn, gnu::cold]] void unknown_name(std::string_view name) const {
    std::string known;
    for (layout::group_kind kind : layout::all_group_kinds)
      known += (known.empty() ? "" : ", ") + std::string(layout::to_string(kind));
    fail("process groups: no kind of group is named '" + std::string(name) + "'; the names are " + known);
  }

  static std::size_t index_of(layout::group_kind kind) noexcept {
    for (std::size_t i = 0; i < layout::all_group_kinds.size(); ++i)
      if (layout::all_group_kinds[i] == kind) return i;
    return 0;
  }

  layout::rank_layout layout_;
  int rank_;
  std::vector<layout::rank_group> groups_;
  std::array<std::optional<communicator_type>, layout::group_kind_count> comms_;
};

}  // namespace weft
