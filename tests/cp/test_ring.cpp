// Ring attention on 2, 3 and 4 ranks against the naive attention over the whole sequence on one
// rank: forward output and LSE, and the gradients dq, dk, dv, each gathered from every rank and
// unsharded, for the causal mask (load-balanced and contiguous splits) and without it; in double
// (tight) and in float (looser, see the tolerances below); and the refusals.
//
// Tolerances, as the largest error relative to the largest magnitude of the reference tensor:
//  - double: 1e-12. The reference kernel carries its arithmetic in double; the ring only changes
//    the order of summation (blocks merged by the online softmax, dk/dv accumulated over ranks),
//    which moves results by a few ulps (~1e-16) times the number of terms (≤ 48 here).
//  - float: 2e-5. Each block's output, LSE and the dk/dv accumulators are rounded to float
//    (ε = 6e-8) after every merge or accumulation: up to 2·cp merges per row and one rounding per
//    (query chunk, key chunk) contribution to dk/dv (≤ 2·cp·2 here), each ≤ ε relative to the
//    running magnitude, plus float inputs rounded from the double ones the reference uses:
//    ≤ ~20 roundings → ~1e-6 (measured: ≤ 4e-7); 2e-5 leaves a margin for cancellation in the
//    gradients and for other inputs.
#include <catch2/catch.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/cp/attention_reference.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ring_attention.hpp>

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

template <class T>
void check_against_naive(comm_t& group, cp::split_kind kind, bool causal, double tolerance) {
  const int n = group.size();
  const std::size_t heads = 2, dim = 4;
  const cp::sequence_split split{.seq = 48, .cp = n, .kind = kind};
  const cp::attention_shape shape{heads, dim};
  const std::size_t row = shape.row(), size = static_cast<std::size_t>(split.seq) * row;
  const auto q = cp_test::random_tensor(size, 11), k = cp_test::random_tensor(size, 12),
             v = cp_test::random_tensor(size, 13), dout = cp_test::random_tensor(size, 14);
  // The reference sees the same (rounded to T) inputs as the ring.
  auto rounded = [](const std::vector<double>& x) {
    auto t = cp_test::cast<T>(x);
    return std::vector<double>(t.begin(), t.end());
  };
  const auto want = cp_test::naive_attention(rounded(q), rounded(k), rounded(v), rounded(dout),
                                             static_cast<std::size_t>(split.seq), heads, dim, causal);

  cp::ring_attention<weft::mpi_backend> ring(group, split, shape, {.causal = causal});
  const std::size_t local = ring.local_tokens() * row;
  auto shard = [&](const std::vector<double>& full) {
    auto t = cp_test::cast<T>(full);
    std::vector<T> mine(local);
    cp::shard<T>(split, group.rank(), t, row, mine);
    return mine;
  };
  const auto lq = shard(q), lk = shard(k), lv = shard(v), ldout = shard(dout);
  std::vector<T> out(local), lse(ring.local_tokens() * heads), dq(local), dk(local), dv(local);
  ring.forward<T>(lq, lk, lv, out, lse);
  ring.backward<T>(lq, lk, lv, out, lse, ldout, dq, dk, dv);

  INFO("cp=" << n << ", split " << cp::to_string(kind) << ", causal " << causal);
  CHECK(cp_test::relative_error(gather_full(group, split, out, row), want.out) < tolerance);
  CHECK(cp_test::relative_error(gather_full(group, split, lse, heads), want.lse) < tolerance);
  CHECK(cp_test::relative_error(gather_full(group, split, dq, row), want.dq) < tolerance);
  CHECK(cp_test::relative_error(gather_full(group, split, dk, row), want.dk) < tolerance);
  CHECK(cp_test::relative_error(gather_full(group, split, dv, row), want.dv) < tolerance);
}

}  // namespace

TEST_CASE("ring attention in double matches one rank's attention, forward and backward", "[cp][ring]") {
  auto group = cp_group();
  SECTION("causal, load-balanced split") { check_against_naive<double>(group, cp::split_kind::load_balanced, true, 1e-12); }
  SECTION("causal, contiguous split") { check_against_naive<double>(group, cp::split_kind::contiguous, true, 1e-12); }
  SECTION("not causal, contiguous split") { check_against_naive<double>(group, cp::split_kind::contiguous, false, 1e-12); }
  SECTION("not causal, load-balanced split") {
    check_against_naive<double>(group, cp::split_kind::load_balanced, false, 1e-12);
  }
}

TEST_CASE("ring attention in float matches within float's rounding", "[cp][ring]") {
  auto group = cp_group();
  SECTION("causal, load-balanced split") { check_against_naive<float>(group, cp::split_kind::load_balanced, true, 2e-5); }
  SECTION("not causal") { check_against_naive<float>(group, cp::split_kind::contiguous, false, 2e-5); }
}

TEST_CASE("ring attention refuses what it cannot do, on every rank, before sending", "[cp][ring]") {
  auto group = cp_group();
  const int n = group.size();
  const cp::attention_shape shape{2, 4};
  SECTION("a sequence that does not cut into 2·cp chunks") {
    const std::int64_t seq = 2 * n * 3 + 1;
    const std::string numbers = "a multiple of 2·cp = " + std::to_string(2 * n);
    const std::string nearest =
        "nearest valid lengths are " + std::to_string(2 * n * 3) + " or " + std::to_string(2 * n * 4);
    CHECK_THROWS_WITH((cp::ring_attention<weft::mpi_backend>(group, {.seq = seq, .cp = n}, shape)),
                      Contains(std::to_string(seq) + " tokens") && Contains(numbers) && Contains(nearest));
  }
  SECTION("a split for another group size") {
    CHECK_THROWS_WITH((cp::ring_attention<weft::mpi_backend>(group, {.seq = 8 * (n + 1), .cp = n + 1}, shape)),
                      Contains("group 'cp'") && Contains("split is for cp=" + std::to_string(n + 1)) &&
                          Contains("has " + std::to_string(n) + " ranks"));
  }
  SECTION("ranks that disagree about the configuration") {
    const std::int64_t seq = group.rank() == 0 ? 4 * n : 8 * n;
    CHECK_THROWS_WITH((cp::ring_attention<weft::mpi_backend>(group, {.seq = seq, .cp = n}, shape)),
                      Contains("ranks disagree about the ring attention configuration"));
  }
  SECTION("tensors of the wrong size") {
    cp::ring_attention<weft::mpi_backend> ring(group, {.seq = 4 * n, .cp = n}, shape);
    const std::uint64_t before = group.stats().operations;
    std::vector<double> ok(ring.local_tokens() * shape.row()), short_k(ok.size() - 1), lse(ring.local_tokens() * 2);
    CHECK_THROWS_WITH(ring.forward<double>(ok, short_k, ok, ok, lse),
                      Contains("group 'cp'") && Contains("k has " + std::to_string(short_k.size()) + " elements") &&
                          Contains("nothing was sent"));
    CHECK(group.stats().operations == before);
  }
  group.barrier();  // and the group is still usable
}

namespace {

/// The CPU reference with the ordering members of weft::cp::orders_transfers, counting their
/// calls; after_transfer waits on the host, where this kernel's later work runs.
struct ordered_reference : cp::reference_attention {
  struct calls {
    int before = 0, after = 0;
  };
  calls* seen = nullptr;
  void before_transfer(comm_t&) const { ++seen->before; }
  void after_transfer(weft::mpi_backend::request& r) const {
    ++seen->after;
    r.wait();
  }
};
static_assert(cp::orders_transfers<ordered_reference, weft::mpi_backend>);
static_assert(!cp::orders_transfers<cp::reference_attention, weft::mpi_backend>);

}  // namespace

TEST_CASE("ring attention with a kernel that orders its transfers gives the host-waited results", "[cp][ring]") {
  auto group = cp_group();
  const int n = group.size();
  const cp::sequence_split split{.seq = 8 * n, .cp = n, .kind = cp::split_kind::load_balanced};
  const cp::attention_shape shape{2, 4};
  ordered_reference::calls seen;
  cp::ring_attention<weft::mpi_backend> plain(group, split, shape);
  ordered_reference kernel;
  kernel.seen = &seen;
  cp::ring_attention<weft::mpi_backend, ordered_reference> ordered(group, split, shape, {}, kernel);
  const std::size_t local = plain.local_tokens() * shape.row(), lse_size = plain.local_tokens() * shape.heads;
  const auto q = cp_test::random_tensor(local, 21 + group.rank()), k = cp_test::random_tensor(local, 31 + group.rank()),
             v = cp_test::random_tensor(local, 41 + group.rank()), dout = cp_test::random_tensor(local, 51 + group.rank());
  struct results {
    std::vector<double> out, lse, dq, dk, dv;
  };
  auto run = [&](auto& ring) {
    results r{std::vector<double>(local), std::vector<double>(lse_size), std::vector<double>(local),
              std::vector<double>(local), std::vector<double>(local)};
    for (int pass = 0; pass < 2; ++pass) {  // twice: the second starts with the first's transfers retired
      ring.template forward<double>(q, k, v, r.out, r.lse);
      ring.template backward<double>(q, k, v, r.out, r.lse, dout, r.dq, r.dk, r.dv);
    }
    return r;
  };
  const results want = run(plain), got = run(ordered);
  // The same operations in the same order: equal to the bit.
  CHECK(got.out == want.out);
  CHECK(got.lse == want.lse);
  CHECK(got.dq == want.dq);
  CHECK(got.dk == want.dk);
  CHECK(got.dv == want.dv);
  // Per pass: forward's n - 1 hops of K/V; backward's n - 1 of K/V and n of the accumulators.
  CHECK(seen.before == (n == 1 ? 0 : 2 * ((n - 1) + (n - 1) + n)));
  CHECK(seen.after == seen.before);
}
