// Ulysses (all-to-all) context parallelism on 2 and 4 ranks: the exchanges themselves (exact
// placement, round trip), attention forward and backward against the naive attention over the
// whole sequence on one rank (double: tolerance 1e-12, as in test_ring.cpp; the exchanges move
// data without arithmetic, and each head's attention runs whole on one rank), and the refusals.
#include <catch2/catch.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ulysses.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "cp_test_support.hpp"
#include "naive_attention.hpp"

using Catch::Contains;
using cp_test::comm_t;
namespace cp = weft::cp;

namespace {

using cp_test::cp_group;
using cp_test::gather_full;

}  // namespace

TEST_CASE("to_heads gives each rank its heads of every token, and to_sequence undoes it", "[cp][ulysses]") {
  auto group = cp_group();
  const int n = group.size();
  const cp::attention_shape shape{static_cast<std::size_t>(2 * n), 3};
  for (auto kind : {cp::split_kind::contiguous, cp::split_kind::load_balanced}) {
    const cp::sequence_split split{.seq = 4 * n, .cp = n, .kind = kind};
    cp::ulysses<weft::mpi_backend> u(group, split, shape);
    // Element (position t, head h, d) has the value t·1000 + h·10 + d.
    std::vector<double> mine(u.sequence_sharded_size());
    const auto pos = cp::positions(split, group.rank());
    for (std::size_t t = 0; t < pos.size(); ++t)
      for (std::size_t h = 0; h < shape.heads; ++h)
        for (std::size_t d = 0; d < shape.head_dim; ++d)
          mine[(t * shape.heads + h) * shape.head_dim + d] = static_cast<double>(pos[t] * 1000) + double(h * 10 + d);
    std::vector<double> heads(u.head_sharded_size());
    u.to_heads<double>(mine, heads);
    const std::size_t hp = u.heads_per_rank(), first = static_cast<std::size_t>(group.rank()) * hp;
    bool placed = true;
    for (std::size_t t = 0; t < static_cast<std::size_t>(split.seq); ++t)
      for (std::size_t h = 0; h < hp; ++h)
        for (std::size_t d = 0; d < shape.head_dim; ++d)
          placed = placed && heads[(t * hp + h) * shape.head_dim + d] ==
                                 static_cast<double>(u.positions()[t] * 1000) + double((first + h) * 10 + d);
    CHECK(placed);
    std::vector<double> back(mine.size(), -1);
    u.to_sequence<double>(heads, back);
    CHECK(back == mine);
  }
}

TEST_CASE("Ulysses attention matches one rank's attention, forward and backward", "[cp][ulysses]") {
  auto group = cp_group();
  const int n = group.size();
  const std::size_t heads = static_cast<std::size_t>(2 * n), dim = 4;
  const cp::attention_shape shape{heads, dim};
  for (auto [kind, causal] : {std::pair{cp::split_kind::load_balanced, true}, std::pair{cp::split_kind::contiguous, true},
                              std::pair{cp::split_kind::contiguous, false}}) {
    INFO("cp=" << n << ", split " << cp::to_string(kind) << ", causal " << causal);
    const cp::sequence_split split{.seq = 48, .cp = n, .kind = kind};
    const std::size_t row = shape.row(), size = static_cast<std::size_t>(split.seq) * row;
    const auto q = cp_test::random_tensor(size, 21), k = cp_test::random_tensor(size, 22),
               v = cp_test::random_tensor(size, 23), dout = cp_test::random_tensor(size, 24);
    const auto want = cp_test::naive_attention(q, k, v, dout, static_cast<std::size_t>(split.seq), heads, dim, causal);

    cp::ulysses<weft::mpi_backend> u(group, split, shape);
    auto shard = [&](const std::vector<double>& full) {
      std::vector<double> mine(u.sequence_sharded_size());
      cp::shard<double>(split, group.rank(), full, row, mine);
      return mine;
    };
    const auto lq = shard(q), lk = shard(k), lv = shard(v), ldout = shard(dout);
    std::vector<double> out(lq.size()), lse(static_cast<std::size_t>(split.seq) * u.heads_per_rank());
    std::vector<double> dq(lq.size()), dk(lq.size()), dv(lq.size());
    u.forward<double>(lq, lk, lv, out, lse, {.causal = causal});
    u.backward<double>(lq, lk, lv, out, lse, ldout, dq, dk, dv, {.causal = causal});

    CHECK(cp_test::relative_error(gather_full(group, split, out, row), want.out) < 1e-12);
    CHECK(cp_test::relative_error(gather_full(group, split, dq, row), want.dq) < 1e-12);
    CHECK(cp_test::relative_error(gather_full(group, split, dk, row), want.dk) < 1e-12);
    CHECK(cp_test::relative_error(gather_full(group, split, dv, row), want.dv) < 1e-12);
    // lse rows are positions() of this rank's heads.
    bool lse_ok = true;
    for (std::size_t r = 0; r < static_cast<std::size_t>(split.seq); ++r)
      for (std::size_t h = 0; h < u.heads_per_rank(); ++h) {
        const std::size_t global_head = static_cast<std::size_t>(group.rank()) * u.heads_per_rank() + h;
        const double expected = want.lse[static_cast<std::size_t>(u.positions()[r]) * heads + global_head];
        lse_ok = lse_ok && std::abs(lse[r * u.heads_per_rank() + h] - expected) < 1e-12;
      }
    CHECK(lse_ok);
  }
}

TEST_CASE("Ulysses refuses heads that do not divide over cp, naming the nearest cp, before sending", "[cp][ulysses]") {
  auto group = cp_group();
  const int n = group.size();
  const std::uint64_t before = group.stats().operations;
  // cp=2: 3 heads (nearest cp 1 or 3); cp=4: 6 heads (nearest cp 3 or 6).
  const std::size_t heads = n == 2 ? 3 : 6;
  const std::string nearest = n == 2 ? "cp=1 or cp=3" : "cp=3 or cp=6";
  CHECK_THROWS_WITH((cp::ulysses<weft::mpi_backend>(group, {.seq = 8 * n, .cp = n}, {heads, 4})),
                    Contains("group 'cp'") &&
                        Contains(std::to_string(heads) + " attention heads do not divide over cp=" + std::to_string(n)) &&
                        Contains(nearest));
  CHECK(group.stats().operations == before);
  CHECK_THROWS_WITH((cp::ulysses<weft::mpi_backend>(group, {.seq = 8 * n + 2, .cp = n}, {static_cast<std::size_t>(n), 4})),
                    Contains("does not split"));
  group.barrier();  // and the group is still usable
}
