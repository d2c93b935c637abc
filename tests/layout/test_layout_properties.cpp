// Properties every valid layout must have, checked over many random layouts and orders.
#include <catch2/catch.hpp>

#include <weft/layout/layout.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace wl = weft::layout;
using wl::group_kind;

namespace {

std::vector<int> divisors_of(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(d);
  }
  return out;
}

// Random specs, valid or not; the tests keep the valid ones.
std::vector<wl::layout_spec> random_specs(int count, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<int> worlds{1, 2, 4, 6, 8, 12, 16, 24, 30, 32, 48, 64, 72, 96, 128};
  auto pick = [&](const std::vector<int>& v) { return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)]; };
  std::vector<wl::layout_spec> specs;
  for (int i = 0; i < count; ++i) {
    wl::layout_spec spec;
    spec.world_size = pick(worlds);
    int left = spec.world_size;
    for (int* degree : {&spec.tp, &spec.pp, &spec.cp}) {
      *degree = pick(divisors_of(left));
      left /= *degree;
    }
    if (rng() % 2 == 0) spec.ep = pick(divisors_of(spec.world_size));
    if (rng() % 3 == 0) spec.expert_tp = pick(divisors_of(spec.world_size));
    if (rng() % 4 == 0) spec.dp = left;
    std::vector<std::string> names{"tp", "cp", "ep", "dp", "pp"};
    std::shuffle(names.begin(), names.end(), rng);
    spec.order.clear();
    for (const std::string& name : names) {
      if (rng() % 8 == 0) continue;  // left out: valid only when its size is 1
      if (!spec.order.empty()) spec.order += '-';
      spec.order += name;
    }
    specs.push_back(spec);
  }
  return specs;
}

// The dimensions each kind varies, and the degree product that is its size, written out
// independently of the library's tables.
struct kind_facts {
  std::vector<std::string> dims;
  bool expert;
};

const std::map<group_kind, kind_facts>& facts() {
  static const std::map<group_kind, kind_facts> table{
      {group_kind::tp, {{"tp"}, false}},
      {group_kind::cp, {{"cp"}, false}},
      {group_kind::dp, {{"dp"}, false}},
      {group_kind::pp, {{"pp"}, false}},
      {group_kind::dp_cp, {{"dp", "cp"}, false}},
      {group_kind::tp_cp, {{"tp", "cp"}, false}},
      {group_kind::tp_pp, {{"tp", "pp"}, false}},
      {group_kind::tp_dp, {{"tp", "dp"}, false}},
      {group_kind::tp_dp_cp, {{"tp", "dp", "cp"}, false}},
      {group_kind::ep, {{"ep"}, true}},
      {group_kind::expert_tp, {{"tp"}, true}},
      {group_kind::expert_dp, {{"dp"}, true}},
      {group_kind::expert_tp_ep, {{"tp", "ep"}, true}},
      {group_kind::expert_tp_ep_pp, {{"tp", "ep", "pp"}, true}},
  };
  return table;
}

std::map<std::string, int> coordinates_by_name(const wl::rank_coordinates& c, bool expert) {
  if (expert) return {{"tp", c.expert_tp}, {"cp", 0}, {"ep", c.ep}, {"dp", c.expert_dp}, {"pp", c.pp}};
  return {{"tp", c.tp}, {"cp", c.cp}, {"ep", 0}, {"dp", c.dp}, {"pp", c.pp}};
}

std::map<std::string, int> sizes_by_name(const wl::rank_layout& l, bool expert) {
  if (expert) return {{"tp", l.expert_tp()}, {"cp", 1}, {"ep", l.ep()}, {"dp", l.expert_dp()}, {"pp", l.pp()}};
  return {{"tp", l.tp()}, {"cp", l.cp()}, {"ep", 1}, {"dp", l.dp()}, {"pp", l.pp()}};
}

std::set<int> as_set(const std::vector<int>& v) { return {v.begin(), v.end()}; }

}  // namespace

TEST_CASE("random layouts: groups partition the world, sizes are the degrees, coordinates round-trip") {
  int checked = 0;
  for (const wl::layout_spec& spec : random_specs(600, 12345)) {
    if (!wl::validate(spec).empty()) continue;
    ++checked;
    const wl::rank_layout layout(spec);
    const int world = spec.world_size;
    INFO("world " << world << " tp " << spec.tp << " cp " << spec.cp << " ep " << spec.ep << " pp " << spec.pp
                  << " expert_tp " << spec.expert_tp << " order '" << spec.order << "'");
    REQUIRE(layout.world_size() == world);
    REQUIRE(static_cast<long>(layout.tp()) * layout.cp() * layout.dp() * layout.pp() == world);
    REQUIRE(static_cast<long>(layout.expert_tp()) * layout.ep() * layout.expert_dp() * layout.pp() == world);

    for (const auto& [kind, fact] : facts()) {
      const auto sizes = sizes_by_name(layout, fact.expert);
      int expected_size = 1;
      for (const std::string& d : fact.dims) expected_size *= sizes.at(d);
      const auto groups = layout.groups(kind);
      REQUIRE(layout.group_size(kind) == expected_size);
      REQUIRE(static_cast<int>(groups.size()) == world / expected_size);
      REQUIRE(layout.group_count(kind) == world / expected_size);
      std::vector<int> seen(static_cast<std::size_t>(world), 0);
      for (std::size_t index = 0; index < groups.size(); ++index) {
        const std::vector<int>& group = groups[index];
        REQUIRE(static_cast<int>(group.size()) == expected_size);
        for (std::size_t position = 0; position < group.size(); ++position) {
          const int rank = group[position];
          REQUIRE(rank >= 0);
          REQUIRE(rank < world);
          ++seen[static_cast<std::size_t>(rank)];
          const wl::rank_group mine = layout.group_of(kind, rank);
          REQUIRE(mine.index == static_cast<int>(index));
          REQUIRE(mine.position == static_cast<int>(position));
          REQUIRE(mine.ranks == group);
        }
        // Inside a group, coordinates outside the kind's dimensions agree, and those inside
        // take every combination exactly once.
        const auto first = coordinates_by_name(layout.coordinates(group.front()), fact.expert);
        std::set<std::vector<int>> inside;
        for (int rank : group) {
          const auto c = coordinates_by_name(layout.coordinates(rank), fact.expert);
          std::vector<int> key;
          for (const auto& [name, value] : c) {
            const bool varies = std::find(fact.dims.begin(), fact.dims.end(), name) != fact.dims.end();
            if (varies) {
              key.push_back(value);
            } else {
              REQUIRE(value == first.at(name));
            }
          }
          inside.insert(key);
        }
        REQUIRE(static_cast<int>(inside.size()) == expected_size);
      }
      REQUIRE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    }

    for (int rank = 0; rank < world; ++rank) {
      const wl::rank_coordinates c = layout.coordinates(rank);
      REQUIRE(layout.rank_of(c) == rank);
      REQUIRE(layout.expert_grid().rank_of({c.expert_tp, 0, c.ep, c.expert_dp, c.pp}) == rank);
      // A rank's place in a single-dimension group is its coordinate along it.
      REQUIRE(layout.group_of(group_kind::tp, rank).position == c.tp);
      REQUIRE(layout.group_of(group_kind::cp, rank).position == c.cp);
      REQUIRE(layout.group_of(group_kind::dp, rank).position == c.dp);
      REQUIRE(layout.group_of(group_kind::pp, rank).position == c.pp);
      REQUIRE(layout.group_of(group_kind::ep, rank).position == c.ep);
      REQUIRE(layout.group_of(group_kind::expert_dp, rank).position == c.expert_dp);

      // Combined groups are the unions of the groups they combine.
      auto union_over = [&](group_kind outer, group_kind inner) {
        std::set<int> all;
        for (int member : layout.group_of(outer, rank).ranks) {
          for (int r : layout.group_of(inner, member).ranks) all.insert(r);
        }
        return all;
      };
      REQUIRE(as_set(layout.group_of(group_kind::dp_cp, rank).ranks) == union_over(group_kind::cp, group_kind::dp));
      REQUIRE(as_set(layout.group_of(group_kind::tp_cp, rank).ranks) == union_over(group_kind::tp, group_kind::cp));
      REQUIRE(as_set(layout.group_of(group_kind::tp_pp, rank).ranks) == union_over(group_kind::pp, group_kind::tp));
      REQUIRE(as_set(layout.group_of(group_kind::tp_dp, rank).ranks) == union_over(group_kind::dp, group_kind::tp));
      REQUIRE(as_set(layout.group_of(group_kind::tp_dp_cp, rank).ranks) == union_over(group_kind::tp, group_kind::dp_cp));
      REQUIRE(as_set(layout.group_of(group_kind::expert_tp_ep, rank).ranks) == union_over(group_kind::ep, group_kind::expert_tp));
      REQUIRE(as_set(layout.group_of(group_kind::expert_tp_ep_pp, rank).ranks) == union_over(group_kind::pp, group_kind::expert_tp_ep));
      // The pipeline is shared: a stage holds the same ranks for dense and expert layers, and the
      // expert groups of one stage cover exactly the dense ranks of that stage.
      REQUIRE(as_set(layout.group_of(group_kind::tp_dp_cp, rank).ranks) == union_over(group_kind::expert_tp_ep, group_kind::expert_dp));

      // Embedding groups: first and last stage of the rank's pipeline.
      const wl::rank_group pp = layout.group_of(group_kind::pp, rank);
      const wl::rank_group embedding = layout.group_of(group_kind::embedding, rank);
      const wl::rank_group position = layout.group_of(group_kind::position_embedding, rank);
      const bool first = c.pp == 0;
      const bool last = c.pp == layout.pp() - 1;
      REQUIRE(embedding.member() == (first || last));
      REQUIRE(position.member() == first);
      if (embedding.member()) {
        const std::vector<int> expected = layout.pp() == 1 ? std::vector<int>{pp.ranks.front()}
                                                           : std::vector<int>{pp.ranks.front(), pp.ranks.back()};
        REQUIRE(embedding.ranks == expected);
        REQUIRE(embedding.ranks[static_cast<std::size_t>(embedding.position)] == rank);
        REQUIRE(embedding.index == pp.index);
      }
      if (position.member()) REQUIRE(position.ranks == std::vector<int>{rank});

      const auto all = layout.rank_groups(rank);
      REQUIRE(all.size() == wl::all_group_kinds.size());
      for (std::size_t i = 0; i < all.size(); ++i) REQUIRE(all[i].kind == wl::all_group_kinds[i]);
    }
  }
  CHECK(checked >= 150);
}

TEST_CASE("the fingerprint follows the groups, not the spelling of the spec") {
  const wl::rank_layout derived({.world_size = 64, .tp = 4, .pp = 2});
  const wl::rank_layout spelled({.world_size = 64, .tp = 4, .pp = 2, .dp = 8, .expert_tp = 4, .order = "tp-cp-ep-dp-pp"});
  CHECK(derived.fingerprint() == spelled.fingerprint());
  CHECK(derived.canonical_text() == spelled.canonical_text());
  // Leaving size-1 dimensions out of the order does not change the groups.
  const wl::rank_layout short_order({.world_size = 64, .tp = 4, .pp = 2, .order = "tp-dp-pp"});
  for (group_kind kind : wl::all_group_kinds) CHECK(short_order.groups(kind) == derived.groups(kind));
  // Any change of degrees or order changes it.
  std::set<std::uint64_t> prints{derived.fingerprint()};
  prints.insert(wl::rank_layout({.world_size = 64, .tp = 2, .pp = 4}).fingerprint());
  prints.insert(wl::rank_layout({.world_size = 64, .tp = 4, .pp = 2, .order = "dp-tp-pp"}).fingerprint());
  prints.insert(wl::rank_layout({.world_size = 64, .tp = 4, .ep = 2, .pp = 2}).fingerprint());
  prints.insert(wl::rank_layout({.world_size = 64, .tp = 4, .pp = 2, .expert_tp = 1}).fingerprint());
  prints.insert(wl::rank_layout({.world_size = 128, .tp = 4, .pp = 2}).fingerprint());
  CHECK(prints.size() == 6);
  // The value is pinned so that every platform and compiler computes the same one.
  CHECK(wl::detail::fnv1a_64("") == 0xcbf29ce484222325ull);
  CHECK(wl::detail::fnv1a_64("a") == 0xaf63dc4c8601ec8cull);
  CHECK(wl::detail::fnv1a_64("foobar") == 0x85944171f73967e8ull);
}
