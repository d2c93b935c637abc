// process_groups on real communicators: every group's communicator connects exactly the ranks the
// layout computed, in the computed order, for many layouts and orders; disagreeing ranks fail
// together with a message instead of hanging.
#include <catch2/catch.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/layout/process_groups.hpp>

#include <string>
#include <vector>

using mpi_comm = weft::communicator<weft::mpi_backend>;
using weft::layout::group_kind;
using Catch::Matchers::Contains;

namespace {

mpi_comm world() { return mpi_comm(weft::mpi_backend::comm::world(), "world"); }

std::vector<weft::layout::layout_spec> layouts_for(int world_size) {
  std::vector<weft::layout::layout_spec> specs;
  const char* orders[] = {"tp-cp-ep-dp-pp", "tp-dp-pp", "dp-tp-pp", "cp-tp-dp-pp", "tp-pp-dp", "pp-dp-tp"};
  for (int tp = 1; tp <= world_size; tp *= 2)
    for (int cp = 1; cp <= world_size / tp; cp *= 2)
      for (int pp = 1; pp <= world_size / (tp * cp); pp *= 2)
        for (int ep : {1, 2})
          for (const char* order : orders) {
            weft::layout::layout_spec spec{.world_size = world_size, .tp = tp, .cp = cp, .ep = ep, .pp = pp, .order = order};
            if (weft::layout::validate(spec).empty()) specs.push_back(spec);
          }
  return specs;
}

}  // namespace

TEST_CASE("each group communicator connects exactly the computed ranks, in group order") {
  auto comm = world();
  auto specs = layouts_for(comm.size());
  REQUIRE(specs.size() >= 10);
  for (const auto& spec : specs) {
    weft::layout::rank_layout layout(spec);
    INFO(layout.canonical_text());
    weft::process_groups<weft::mpi_backend> groups(comm, layout);
    CHECK(groups.coordinates() == layout.coordinates(comm.rank()));
    for (group_kind kind : weft::layout::all_group_kinds) {
      INFO("group " << weft::layout::to_string(kind));
      const auto& expected = groups.group(kind);
      REQUIRE(groups.has(kind) == expected.member());
      if (!groups.has(kind)) continue;
      auto& group_comm = groups.get(kind);
      CHECK(group_comm.name() == std::string(weft::layout::to_string(kind)));
      REQUIRE(group_comm.size() == static_cast<int>(expected.ranks.size()));
      CHECK(group_comm.rank() == expected.position);
      std::vector<int> mine{comm.rank()};
      std::vector<int> members(expected.ranks.size());
      group_comm.all_gather(mine, members);
      CHECK(members == expected.ranks);
    }
  }
}

TEST_CASE("named accessors return the groups of their kind") {
  auto comm = world();
  weft::layout::rank_layout layout({.world_size = comm.size(), .tp = 2});
  weft::process_groups<weft::mpi_backend> groups(comm, layout);
  CHECK(groups.tp().size() == 2);
  CHECK(groups.dp().size() == comm.size() / 2);
  CHECK(groups.pp().size() == 1);
  CHECK(groups.find("dp-cp") == &groups.dp_cp());
  CHECK(groups.find("no-such-group") == nullptr);
  // A reduction over tp sums the two tensor-parallel ranks only (adjacent under the default order).
  std::vector<int> value{comm.rank()};
  groups.tp().all_reduce(value);
  CHECK(value[0] == 2 * (comm.rank() / 2 * 2) + 1);
}

TEST_CASE("get(name) returns the named group, and a misspelt name lists the names there are") {
  auto comm = world();
  weft::layout::rank_layout layout({.world_size = comm.size(), .tp = 2});
  weft::process_groups<weft::mpi_backend> groups(comm, layout);
  CHECK(&groups.get("tp") == &groups.tp());
  CHECK(&groups.get("dp-cp") == &groups.dp_cp());
  CHECK(groups.find("embeding") == nullptr);
  std::string message;
  try {
    groups.get("embeding");
  } catch (const weft::error& e) {
    message = e.what();
  }
  CHECK_THAT(message, Contains("no kind of group is named 'embeding'"));
  for (group_kind kind : weft::layout::all_group_kinds) CHECK_THAT(message, Contains(std::string(weft::layout::to_string(kind))));
}

TEST_CASE("a rank with a different layout makes every rank fail with a message, not hang") {
  auto comm = world();
  // Rank 0 believes in tp=2, the others in tp=1.
  weft::layout::rank_layout layout({.world_size = comm.size(), .tp = comm.rank() == 0 ? 2 : 1});
  CHECK_THROWS_WITH((weft::process_groups<weft::mpi_backend>(comm, layout)),
                    Contains("ranks disagree about the parallel layout") && Contains("tp="));
  // The world communicator is still usable afterwards.
  std::vector<int> one{1};
  comm.all_reduce(one);
  CHECK(one[0] == comm.size());
}

TEST_CASE("a layout for another world size is refused with what to do") {
  auto comm = world();
  weft::layout::rank_layout layout({.world_size = comm.size() * 2, .tp = 2});
  CHECK_THROWS_WITH((weft::process_groups<weft::mpi_backend>(comm, layout)),
                    Contains("the layout is for a world of " + std::to_string(comm.size() * 2)) && Contains("launch"));
}
