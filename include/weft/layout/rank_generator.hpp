#pragma once
/// \file
/// World ranks as points of a mixed-radix grid, and the groups that vary some of its axes.
///
/// With sizes s0, s1, ... in order (first fastest), rank r has coordinate (r / (s0*...*s(i-1))) % si
/// on axis i. A group kind is a set of axes (its mask): each group holds the ranks that share every
/// coordinate outside the mask. Groups are numbered by their coordinates outside the mask and ranks
/// inside a group by their coordinates inside it, both mixed-radix with the first axis of the order
/// fastest. This is Megatron-Core's `RankGenerator` scheme, so the same degrees and order give the
/// same groups, in the same order, with the same rank order inside each group.

#include <weft/layout/dim_order.hpp>
#include <weft/layout/dimension.hpp>

#include <vector>

namespace weft::layout {

class rank_generator {
 public:
  /// `sizes` is indexed by dimension; every size must be at least 1 and their product must fit in
  /// an int (`rank_layout` checks both before building one).
  rank_generator(const dim_order& order, const per_dim<int>& sizes) : order_(order), sizes_(sizes) {
    int stride = 1;
    for (dim d : order_.dims()) {
      strides_[index_of(d)] = stride;
      stride *= sizes_[index_of(d)];
    }
    world_size_ = stride;
  }

  int world_size() const noexcept { return world_size_; }
  const dim_order& order() const noexcept { return order_; }
  int size(dim d) const noexcept { return sizes_[index_of(d)]; }
  /// Distance in world ranks between neighbours along `d`.
  int stride(dim d) const noexcept { return strides_[index_of(d)]; }

  /// The coordinate of `rank` along `d`.
  int coordinate(int rank, dim d) const noexcept { return (rank / stride(d)) % size(d); }

  /// All coordinates of `rank`, indexed by dimension.
  per_dim<int> coordinates(int rank) const noexcept {
    per_dim<int> coords{};
    for (dim d : all_dims) coords[index_of(d)] = coordinate(rank, d);
    return coords;
  }

  /// The rank at the given coordinates (indexed by dimension).
  int rank_of(const per_dim<int>& coords) const noexcept {
    int rank = 0;
    for (dim d : all_dims) rank += coords[index_of(d)] * stride(d);
    return rank;
  }

  /// Ranks per group of the kind `mask`.
  int group_size(dim_set mask) const noexcept {
    int n = 1;
    for (dim d : all_dims) {
      if (mask.contains(d)) n *= size(d);
    }
    return n;
  }

  /// Number of groups of the kind `mask`; together they partition the world.
  int group_count(dim_set mask) const noexcept { return world_size_ / group_size(mask); }

  /// Number of the group of kind `mask` that holds `rank` (from its coordinates outside the mask).
  int group_index(dim_set mask, int rank) const noexcept { return mixed_radix(rank, mask, false); }

  /// Place of `rank` in its group of kind `mask` (from its coordinates inside the mask).
  int position_in_group(dim_set mask, int rank) const noexcept { return mixed_radix(rank, mask, true); }

  /// The ranks of group `index` of kind `mask`, in group order.
  std::vector<int> group(dim_set mask, int index) const {
    // The fixed part: coordinates outside the mask, decoded from the group number.
    int base = 0;
    int rest = index;
    for (dim d : order_.dims()) {
      if (mask.contains(d)) continue;
      base += (rest % size(d)) * stride(d);
      rest /= size(d);
    }
    const int n = group_size(mask);
    std::vector<int> ranks;
    ranks.reserve(static_cast<std::size_t>(n));
    for (int position = 0; position < n; ++position) {
      int rank = base;
      int digits = position;
      for (dim d : order_.dims()) {
        if (!mask.contains(d)) continue;
        rank += (digits % size(d)) * stride(d);
        digits /= size(d);
      }
      ranks.push_back(rank);
    }
    return ranks;
  }

  /// Every group of kind `mask`, in group order.
  std::vector<std::vector<int>> groups(dim_set mask) const {
    std::vector<std::vector<int>> all;
    const int count = group_count(mask);
    all.reserve(static_cast<std::size_t>(count));
    for (int index = 0; index < count; ++index) all.push_back(group(mask, index));
    return all;
  }

 private:
  // The coordinates of `rank` inside (or outside) the mask read as one mixed-radix number.
  int mixed_radix(int rank, dim_set mask, bool inside) const noexcept {
    int value = 0;
    int weight = 1;
    for (dim d : order_.dims()) {
      if (mask.contains(d) != inside) continue;
      value += coordinate(rank, d) * weight;
      weight *= size(d);
    }
    return value;
  }

  dim_order order_;
  per_dim<int> sizes_{};
  per_dim<int> strides_{};
  int world_size_ = 1;
};

}  // namespace weft::layout
