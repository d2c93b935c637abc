#pragma once
/// \file
/// A parallel layout: world size, degrees and order in; every process group out (pure maths).
///
/// Two grids share the world ranks, as in Megatron-Core:
///  - the dense grid, tp x cp x dp x pp (ep has size 1 on it), for every layer that is not an
///    expert layer: its groups are tp, cp, dp, pp and their combinations;
///  - the expert grid, expert_tp x ep x expert_dp x pp (cp has size 1 on it), for the experts of
///    mixture-of-experts layers: expert_dp = world / (expert_tp x ep x pp).
/// Both grids use the same order string. Expert parallelism is thus carved out of the ranks that
/// dense layers spend on tp, cp and dp, so ep > 1 and cp > 1 may be used together; a rank must
/// hold the same pipeline stage on both grids, which `validate` checks.

#include <weft/core/error.hpp>
#include <weft/layout/detail/arithmetic.hpp>
#include <weft/layout/detail/fnv1a.hpp>
#include <weft/layout/dim_order.hpp>
#include <weft/layout/dimension.hpp>
#include <weft/layout/group_kind.hpp>
#include <weft/layout/rank_generator.hpp>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace weft::layout {

/// What a user says about a layout. Degrees default to 1; dp = 0 derives it from the world size;
/// expert_tp = 0 means "same as tp". `virtual_stages` is the number of model chunks each pipeline
/// rank holds under an interleaved schedule (1: plain 1F1B); it changes no group, but every rank
/// must agree on it, so it is part of the layout. This is also what the tuner chooses
/// (`weft::tune::plan::layout()`), so a plan becomes process groups in one step.
struct layout_spec {
  int world_size = 0;
  int tp = 1;
  int cp = 1;
  int ep = 1;
  int pp = 1;
  int dp = 0;
  int expert_tp = 0;
  std::string order{default_order};
  int virtual_stages = 1;
};

/// Where one rank sits on both grids.
struct rank_coordinates {
  int tp = 0;
  int cp = 0;
  int dp = 0;
  int pp = 0;
  int ep = 0;
  int expert_tp = 0;
  int expert_dp = 0;
  bool operator==(const rank_coordinates&) const = default;
};

/// One rank's view of one group kind.
struct rank_group {
  group_kind kind{};
  /// Number of the group of this kind that holds the rank, or -1 if the rank is in none (only
  /// possible for the embedding kinds). Suitable as the colour of a communicator split.
  int index = -1;
  /// The rank's place in that group (its rank inside the group's communicator), or -1.
  int position = -1;
  /// The group's world ranks in group order; empty when the rank is in none.
  std::vector<int> ranks;

  bool member() const noexcept { return index >= 0; }
  std::string_view name() const noexcept { return to_string(kind); }
};

namespace detail {

inline std::string degree_text(std::string_view name, std::int64_t value) {
  return std::string(name) + "=" + std::to_string(value);
}

/// Suggestions when the product of `factors` does not divide `world`: for each factor above 1,
/// the values that would make it divide with the others kept.
inline std::string divisibility_hint(std::int64_t world,
                                     const std::vector<std::pair<std::string_view, std::int64_t>>& factors) {
  std::string hint;
  for (std::size_t i = 0; i < factors.size(); ++i) {
    if (factors[i].second <= 1) continue;
    std::int64_t others = 1;
    std::string kept;
    for (std::size_t j = 0; j < factors.size(); ++j) {
      if (j == i) continue;
      others = saturating_product(others, factors[j].second);
      if (!kept.empty()) kept += ", ";
      kept += degree_text(factors[j].first, factors[j].second);
    }
    if (world % others != 0) continue;
    hint += hint.empty() ? "valid choices: " : "; or ";
    hint += std::string(factors[i].first) + " in " + brace_list(divisors(world / others));
    if (!kept.empty()) hint += " (keeping " + kept + ")";
  }
  if (hint.empty()) hint = "choose degrees whose product divides " + std::to_string(world) + ", whose divisors are " + brace_list(divisors(world));
  return hint;
}

inline std::string product_text(const std::vector<std::pair<std::string_view, std::int64_t>>& factors) {
  std::string text;
  std::int64_t product = 1;
  for (const auto& [name, value] : factors) {
    if (!text.empty()) text += " x ";
    text += degree_text(name, value);
    product = saturating_product(product, value);
  }
  return text + " = " + std::to_string(product);
}

}  // namespace detail

/// Every problem with `spec`, each a sentence saying what is wrong and what to do; empty when the
/// layout is valid.
inline std::vector<std::string> validate(const layout_spec& spec) {
  std::vector<std::string> problems;
  const std::int64_t world = spec.world_size;
  if (world < 1) {
    problems.push_back("world size " + std::to_string(world) + " is invalid: it is the number of ranks in the job and must be at least 1");
    return problems;
  }
  const std::initializer_list<std::pair<std::string_view, int>> degrees{{"tp", spec.tp}, {"cp", spec.cp}, {"ep", spec.ep}, {"pp", spec.pp}};
  for (const auto& [name, value] : degrees) {
    if (value < 1) problems.push_back(detail::degree_text(name, value) + " is invalid: every degree must be at least 1 (1 turns the dimension off)");
  }
  if (spec.dp < 0) problems.push_back(detail::degree_text("dp", spec.dp) + " is invalid: give dp >= 1, or leave it out (0) to derive it from the world size");
  if (spec.expert_tp < 0) problems.push_back(detail::degree_text("expert-tp", spec.expert_tp) + " is invalid: give expert-tp >= 1, or leave it out (0) to use tp");
  if (spec.virtual_stages < 1)
    problems.push_back("virtual stages " + std::to_string(spec.virtual_stages) + " is invalid: use 1 for no interleaving, or more");
  else if (spec.virtual_stages > 1 && spec.pp == 1)
    problems.push_back("virtual stages " + std::to_string(spec.virtual_stages) +
                       " need pipeline parallelism, but pp=1: set pp > 1 or use 1 virtual stage");
  std::string order_problem;
  std::optional<dim_order> order = dim_order::try_parse(spec.order, &order_problem);
  if (!order) problems.push_back(order_problem);
  if (!problems.empty()) return problems;

  // Dense grid: tp x cp x dp x pp = world.
  const std::int64_t tp = spec.tp, cp = spec.cp, ep = spec.ep, pp = spec.pp;
  std::vector<std::pair<std::string_view, std::int64_t>> dense_factors{{"tp", tp}, {"cp", cp}, {"pp", pp}};
  const std::int64_t model = detail::saturating_product(detail::saturating_product(tp, cp), pp);
  std::int64_t dp = spec.dp;
  bool dense_ok = true;
  if (spec.dp == 0) {
    if (world % model != 0) {
      problems.push_back(detail::product_text(dense_factors) + " does not divide the world size " + std::to_string(world) +
                         ", so dp (= world size / (tp x cp x pp)) cannot be derived; " + detail::divisibility_hint(world, dense_factors));
      dense_ok = false;
    } else {
      dp = world / model;
    }
  } else {
    auto all_factors = dense_factors;
    all_factors.emplace_back("dp", dp);
    if (detail::saturating_product(model, dp) != world) {
      std::string fix = world % model == 0
                            ? "leave dp out to derive it (it would be " + std::to_string(world / model) + ")"
                            : detail::divisibility_hint(world, dense_factors);
      problems.push_back(detail::product_text(all_factors) + " but the world size is " + std::to_string(world) +
                         ": the product of the degrees must equal the world size; " + fix);
      dense_ok = false;
    }
  }

  // Expert grid: expert_tp x ep x expert_dp x pp = world.
  const std::int64_t expert_tp = spec.expert_tp == 0 ? tp : spec.expert_tp;
  std::int64_t expert_dp = 0;
  bool expert_ok = true;
  {
    std::vector<std::pair<std::string_view, std::int64_t>> expert_factors{{"expert-tp", expert_tp}, {"ep", ep}, {"pp", pp}};
    const std::int64_t expert_model = detail::saturating_product(detail::saturating_product(expert_tp, ep), pp);
    if (world % expert_model != 0) {
      expert_ok = false;
      // With ep = 1 and expert-tp = tp this only repeats the dense problem.
      if (ep != 1 || expert_tp != tp || dense_ok) {
        problems.push_back(detail::product_text(expert_factors) + " does not divide the world size " + std::to_string(world) +
                           ", so expert-dp (= world size / (expert-tp x ep x pp)) cannot be derived; " +
                           detail::divisibility_hint(world, expert_factors));
      }
    } else {
      expert_dp = world / expert_model;
    }
  }

  // Every dimension of size > 1 on either grid must be placed by the order.
  const std::string written = spec.order;
  auto require_written = [&](dim d, const std::string& why) {
    if (order->written(d)) return;
    problems.push_back(why + " but the order '" + written + "' does not name " + std::string(to_string(d)) +
                       ": add it (for example '" + (written.empty() ? "" : written + "-") + std::string(to_string(d)) +
                       "'), or use the default order " + std::string(default_order));
  };
  if (tp > 1) require_written(dim::tp, detail::degree_text("tp", tp));
  else if (expert_tp > 1) require_written(dim::tp, detail::degree_text("expert-tp", expert_tp));
  if (cp > 1) require_written(dim::cp, detail::degree_text("cp", cp));
  if (ep > 1) require_written(dim::ep, detail::degree_text("ep", ep));
  if (dense_ok && dp > 1) require_written(dim::dp, detail::degree_text("dp", dp));
  else if (expert_ok && expert_dp > 1) require_written(dim::dp, detail::degree_text("expert-dp", expert_dp) + " (world size / (expert-tp x ep x pp))");
  if (pp > 1) require_written(dim::pp, detail::degree_text("pp", pp));
  if (!problems.empty()) return problems;

  // Each rank holds one pipeline stage for dense and expert layers alike.
  const per_dim<int> dense_sizes{static_cast<int>(tp), static_cast<int>(cp), 1, static_cast<int>(dp), static_cast<int>(pp)};
  const per_dim<int> expert_sizes{static_cast<int>(expert_tp), 1, static_cast<int>(ep), static_cast<int>(expert_dp), static_cast<int>(pp)};
  const rank_generator dense(*order, dense_sizes);
  const rank_generator expert(*order, expert_sizes);
  if (pp > 1 && order->last_written() != dim::pp && expert_dp != dp) {
    problems.push_back("with pp not last in the order '" + written + "', dense and expert layers must have the same data-parallel size, but dp=" +
                       std::to_string(dp) + " and expert-dp=" + std::to_string(expert_dp) +
                       " (world size / (expert-tp x ep x pp)); put pp last in the order (for example " + std::string(default_order) +
                       "), or make expert-tp x ep equal tp x cp");
  }
  if (pp > 1 && dense.stride(dim::pp) != expert.stride(dim::pp)) {
    auto stage_text = [](const rank_generator& g) {
      std::string text = "{";
      for (int stage = 0; stage < g.size(dim::pp); ++stage) {
        if (stage != 0) text += ", ";
        text += std::to_string(stage * g.stride(dim::pp));
      }
      return text + "}";
    };
    problems.push_back("with order '" + written + "' the pipeline groups of dense layers (rank 0's is " + stage_text(dense) +
                       ") and of expert layers (rank 0's is " + stage_text(expert) +
                       ") differ, but every rank holds one stage for both; put pp last in the order "
                       "(for example " + std::string(default_order) + ")");
  }
  return problems;
}

/// A validated layout. Constructing one from an invalid spec throws `weft::error` listing every
/// problem `validate` finds.
class rank_layout {
 public:
  explicit rank_layout(const layout_spec& spec) : rank_layout(checked(spec), 0) { virtual_stages_ = spec.virtual_stages; }

  int world_size() const noexcept { return dense_.world_size(); }
  int tp() const noexcept { return dense_.size(dim::tp); }
  int cp() const noexcept { return dense_.size(dim::cp); }
  int dp() const noexcept { return dense_.size(dim::dp); }
  int pp() const noexcept { return dense_.size(dim::pp); }
  int ep() const noexcept { return expert_.size(dim::ep); }
  int expert_tp() const noexcept { return expert_.size(dim::tp); }
  int expert_dp() const noexcept { return expert_.size(dim::dp); }
  /// Model chunks per pipeline rank (interleaved 1F1B); 1 without interleaving.
  int virtual_stages() const noexcept { return virtual_stages_; }
  /// The full order, every dimension named.
  const dim_order& order() const noexcept { return dense_.order(); }

  /// The grid of dense layers (ep has size 1) and the grid of expert layers (cp has size 1).
  const rank_generator& dense_grid() const noexcept { return dense_; }
  const rank_generator& expert_grid() const noexcept { return expert_; }

  /// Ranks per group of `kind` (the same for every group of a kind).
  int group_size(group_kind kind) const noexcept {
    if (kind == group_kind::embedding) return pp() > 1 ? 2 : 1;
    if (kind == group_kind::position_embedding) return 1;
    return grid(kind).group_size(mask_of(kind));
  }

  /// Number of groups of `kind`. Groups of a kind are disjoint; all but the embedding kinds cover
  /// the world.
  int group_count(group_kind kind) const noexcept { return grid(kind).group_count(mask_of(kind)); }

  /// Every group of `kind`, in group order, each in group order.
  std::vector<std::vector<int>> groups(group_kind kind) const {
    std::vector<std::vector<int>> all = grid(kind).groups(mask_of(kind));
    if (is_embedding(kind)) {
      for (std::vector<int>& stages : all) stages = embedding_ranks(kind, stages);
    }
    return all;
  }

  /// The group of `kind` that holds `rank`, with the rank's place in it.
  rank_group group_of(group_kind kind, int rank) const {
    check_rank(rank);
    const rank_generator& g = grid(kind);
    const dim_set mask = mask_of(kind);
    rank_group result;
    result.kind = kind;
    if (is_embedding(kind)) {
      const int stage = g.coordinate(rank, dim::pp);
      const bool first = stage == 0;
      const bool last = stage == pp() - 1;
      if (!first && !(last && kind == group_kind::embedding)) return result;
      result.index = g.group_index(mask, rank);
      result.position = first ? 0 : 1;
      result.ranks = embedding_ranks(kind, g.group(mask, result.index));
      return result;
    }
    result.index = g.group_index(mask, rank);
    result.position = g.position_in_group(mask, rank);
    result.ranks = g.group(mask, result.index);
    return result;
  }

  /// The rank's view of every group kind, in `all_group_kinds` order: the same order on every rank,
  /// which is the order in which communicators for them must be created.
  std::vector<rank_group> rank_groups(int rank) const {
    std::vector<rank_group> all;
    all.reserve(all_group_kinds.size());
    for (group_kind kind : all_group_kinds) all.push_back(group_of(kind, rank));
    return all;
  }

  /// Where `rank` sits on both grids.
  rank_coordinates coordinates(int rank) const {
    check_rank(rank);
    return {.tp = dense_.coordinate(rank, dim::tp),
            .cp = dense_.coordinate(rank, dim::cp),
            .dp = dense_.coordinate(rank, dim::dp),
            .pp = dense_.coordinate(rank, dim::pp),
            .ep = expert_.coordinate(rank, dim::ep),
            .expert_tp = expert_.coordinate(rank, dim::tp),
            .expert_dp = expert_.coordinate(rank, dim::dp)};
  }

  /// The rank at the given dense coordinates (tp, cp, dp, pp; the expert ones are ignored).
  int rank_of(const rank_coordinates& c) const noexcept { return dense_.rank_of({c.tp, c.cp, 0, c.dp, c.pp}); }

  /// A one-line text that determines the layout: equal texts, equal groups.
  std::string canonical_text() const {
    return "weft.layout.v1 world=" + std::to_string(world_size()) + " order=" + order().to_string() +
           " tp=" + std::to_string(tp()) + " cp=" + std::to_string(cp()) + " dp=" + std::to_string(dp()) +
           " pp=" + std::to_string(pp()) + " ep=" + std::to_string(ep()) +
           " expert-tp=" + std::to_string(expert_tp()) + " expert-dp=" + std::to_string(expert_dp()) +
           // Only when interleaved, so that the text (and fingerprint) of every other layout is unchanged.
           (virtual_stages_ > 1 ? " vp=" + std::to_string(virtual_stages_) : std::string());
  }

  /// A 64-bit hash of `canonical_text()`, the same on every platform: ranks compare it before
  /// creating groups, so a rank started with a different layout is an error, not a hang.
  std::uint64_t fingerprint() const noexcept { return detail::fnv1a_64(canonical_text()); }

 private:
  struct grids {
    rank_generator dense;
    rank_generator expert;
  };

  rank_layout(grids g, int) : dense_(g.dense), expert_(g.expert) {}

  static grids checked(const layout_spec& spec) {
    std::vector<std::string> problems = validate(spec);
    if (!problems.empty()) {
      std::string message = "invalid layout (world size " + std::to_string(spec.world_size) + "): " + problems.front();
      for (std::size_t i = 1; i < problems.size(); ++i) message += "; also, " + problems[i];
      fail(message);
    }
    const dim_order order = dim_order::parse(spec.order);
    const int dp = spec.dp == 0 ? spec.world_size / (spec.tp * spec.cp * spec.pp) : spec.dp;
    const int expert_tp = spec.expert_tp == 0 ? spec.tp : spec.expert_tp;
    const int expert_dp = spec.world_size / (expert_tp * spec.ep * spec.pp);
    return {rank_generator(order, {spec.tp, spec.cp, 1, dp, spec.pp}),
            rank_generator(order, {expert_tp, 1, spec.ep, expert_dp, spec.pp})};
  }

  const rank_generator& grid(group_kind kind) const noexcept { return is_expert(kind) ? expert_ : dense_; }

  static std::vector<int> embedding_ranks(group_kind kind, const std::vector<int>& stages) {
    if (kind == group_kind::position_embedding) return {stages.front()};
    if (stages.size() == 1) return stages;
    return {stages.front(), stages.back()};
  }

  void check_rank(int rank) const {
    if (rank < 0 || rank >= world_size()) {
      fail("rank " + std::to_string(rank) + " is outside the layout's world of " + std::to_string(world_size()) +
           " ranks (valid ranks are 0.." + std::to_string(world_size() - 1) + ")");
    }
  }

  rank_generator dense_;
  rank_generator expert_;
  int virtual_stages_ = 1;
};

}  // namespace weft::layout
