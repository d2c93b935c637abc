// docs/layout.md's examples as one program on 4 ranks: a layout's pure maths ("In C++"), then
// process groups on communicators. Every result is checked against the layout's own rank lists
// or a formula; rank 0 prints "layout: ok" when every check passed on every rank.
#include <weft/layout/layout.hpp>
#include <weft/layout/node_placement.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/layout/process_groups.hpp>

#include <weft/launch/mpi_environment.hpp>

#include <cstdint>
#include <cstdio>
#include <numeric>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "layout: FAILED: %s\n", what);
    ++failures;
  }
}

void pure_maths() {
  const int rank = 5;

  namespace wl = weft::layout;
  const wl::rank_layout layout({.world_size = 64, .tp = 4, .cp = 2, .pp = 2});   // dp = 4
  wl::rank_coordinates me = layout.coordinates(rank);          // tp, cp, dp, pp, ep, expert_tp, expert_dp
  wl::rank_group tp = layout.group_of(wl::group_kind::tp, rank);
  // tp.ranks: world ranks in group order; tp.index: which tp group; tp.position: rank inside it
  for (const wl::rank_group& g : layout.rank_groups(rank)) { /* every kind, in creation order */ expect(g.member() || g.ranks.empty(), "a group's ranks"); }
  std::uint64_t print = layout.fingerprint();                  // same on every rank iff same layout
  wl::node_report nodes = wl::place_on_nodes(layout, 8);

  // Under the default order tp-cp-ep-dp-pp, tp varies fastest: rank 5 is tp 1 of ranks 4..7, cp 1.
  expect(me.tp == 1 && me.cp == 1 && me.dp == 0 && me.pp == 0, "rank 5's coordinates");
  expect(tp.ranks == std::vector<int>{4, 5, 6, 7} && tp.position == 1 && tp.index == 1, "rank 5's tp group");
  expect(print == wl::rank_layout({.world_size = 64, .tp = 4, .cp = 2, .pp = 2}).fingerprint(), "the fingerprint");
  expect(print != wl::rank_layout({.world_size = 64, .tp = 2, .cp = 4, .pp = 2}).fingerprint(),
         "another layout's fingerprint");
  (void)nodes;
}

void process_groups(weft::communicator<weft::mpi_backend>& world) {
  std::vector<float> activations(8, static_cast<float>(world.rank() + 1));
  std::vector<float> tied_grads(4, static_cast<float>(world.rank() + 1));

  weft::layout::rank_layout layout({.world_size = world.size(), .tp = 2, .pp = 2});
  weft::process_groups<weft::mpi_backend> groups(world, layout);   // collective over world
  groups.tp().all_reduce(activations);                              // named "tp" in every error
  if (groups.has(weft::layout::group_kind::embedding)) groups.embedding().all_reduce(tied_grads);

  // Each reduction summed rank + 1 over exactly the members the layout names.
  auto sum_over = [&](weft::layout::group_kind kind) {
    const std::vector<int>& ranks = groups.group(kind).ranks;
    return static_cast<float>(std::accumulate(ranks.begin(), ranks.end(), 0) + static_cast<int>(ranks.size()));
  };
  expect(activations.back() == sum_over(weft::layout::group_kind::tp), "the tp all-reduce");
  expect(groups.has(weft::layout::group_kind::embedding), "every rank is on the first or last of 2 stages");
  expect(tied_grads.back() == sum_over(weft::layout::group_kind::embedding), "the embedding all-reduce");
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  pure_maths();
  process_groups(world);
  std::vector<int> failed{failures};
  world.all_reduce(failed);
  if (world.rank() == 0 && failed[0] == 0) std::printf("layout: ok\n");
  return failed[0] == 0 ? 0 : 1;
}
