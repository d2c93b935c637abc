// The pure parts of context parallelism, in one process: the load-balanced causal split (every
// position exactly once, chunks i and 2·cp−1−i, shard/unshard, the refusals with their numbers),
// and the CPU reference attention against the naive full-row attention, including the online
// merge of key blocks and the per-block backward.
#include <catch2/catch.hpp>

#include <weft/cp/attention_reference.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ulysses.hpp>

#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

#include "naive_attention.hpp"

using Catch::Contains;
namespace cp = weft::cp;

TEST_CASE("the load-balanced split holds every position exactly once, chunks i and 2cp-1-i", "[cp][split]") {
  for (int n = 1; n <= 8; ++n) {
    for (std::int64_t per_chunk : {1, 3, 5}) {
      const cp::sequence_split s{.seq = 2 * n * per_chunk, .cp = n, .kind = cp::split_kind::load_balanced};
      std::vector<int> seen(static_cast<std::size_t>(s.seq), 0);
      for (int r = 0; r < n; ++r) {
        auto segs = cp::segments(s, r);
        REQUIRE(segs.size() == 2);
        CHECK(segs[0].begin == r * per_chunk);
        CHECK(segs[1].begin == (2 * n - 1 - r) * per_chunk);
        CHECK(segs[0].length == per_chunk);
        auto pos = cp::positions(s, r);
        REQUIRE(static_cast<std::int64_t>(pos.size()) == cp::local_tokens(s));
        for (std::int64_t p : pos) ++seen[static_cast<std::size_t>(p)];
        // Equal causal work: the sum of (position + 1) over a rank's tokens is the same everywhere.
        std::int64_t work = 0;
        for (std::int64_t p : pos) work += p + 1;
        CHECK(work == per_chunk * (2 * n * per_chunk + 1));
      }
      for (int c : seen) CHECK(c == 1);
    }
  }
}

TEST_CASE("the contiguous split gives each rank one block in order", "[cp][split]") {
  const cp::sequence_split s{.seq = 12, .cp = 3, .kind = cp::split_kind::contiguous};
  CHECK(cp::positions(s, 1) == std::vector<std::int64_t>{4, 5, 6, 7});
}

TEST_CASE("shard and unshard are inverse and place rows by position", "[cp][split]") {
  const cp::sequence_split s{.seq = 16, .cp = 4, .kind = cp::split_kind::load_balanced};
  const std::size_t row = 3;
  std::vector<int> full(16 * row);
  std::iota(full.begin(), full.end(), 0);
  std::vector<int> back(full.size(), -1);
  for (int r = 0; r < 4; ++r) {
    std::vector<int> local(4 * row);
    cp::shard<int>(s, r, full, row, local);
    auto pos = cp::positions(s, r);
    for (std::size_t t = 0; t < pos.size(); ++t)
      CHECK(local[t * row] == static_cast<int>(static_cast<std::size_t>(pos[t]) * row));
    cp::unshard<int>(s, r, local, row, back);
  }
  CHECK(back == full);
}

TEST_CASE("a sequence that does not split is refused with the nearest valid lengths", "[cp][split]") {
  CHECK_THROWS_WITH(cp::validate({.seq = 30, .cp = 4, .kind = cp::split_kind::load_balanced}),
                    Contains("30 tokens") && Contains("cp=4") && Contains("multiple of 2·cp = 8") &&
                        Contains("nearest valid lengths are 24 or 32"));
  CHECK_THROWS_WITH(cp::validate({.seq = 5, .cp = 4, .kind = cp::split_kind::load_balanced}),
                    Contains("nearest valid lengths are 8"));
  CHECK_THROWS_WITH(cp::validate({.seq = 10, .cp = 4, .kind = cp::split_kind::contiguous}),
                    Contains("multiple of cp = 4") && Contains("8 or 12"));
  CHECK_THROWS_WITH(cp::validate({.seq = 8, .cp = 0}), Contains("cp=0"));
  CHECK_NOTHROW(cp::validate({.seq = 32, .cp = 4, .kind = cp::split_kind::load_balanced}));
}

TEST_CASE("the nearest head counts for Ulysses are divisors of heads around cp", "[cp][ulysses]") {
  CHECK(cp::nearest_head_divisors(12, 5) == std::pair<std::size_t, std::size_t>{4, 6});
  CHECK(cp::nearest_head_divisors(6, 4) == std::pair<std::size_t, std::size_t>{3, 6});
  CHECK(cp::nearest_head_divisors(3, 8) == std::pair<std::size_t, std::size_t>{3, 0});
}

namespace {

struct problem {
  std::size_t seq = 12, heads = 2, dim = 4;
  std::vector<double> q, k, v, dout;
  problem() {
    const std::size_t n = seq * heads * dim;
    q = cp_test::random_tensor(n, 1);
    k = cp_test::random_tensor(n, 2);
    v = cp_test::random_tensor(n, 3);
    dout = cp_test::random_tensor(n, 4);
  }
  std::vector<std::int64_t> positions() const {
    std::vector<std::int64_t> p(seq);
    std::iota(p.begin(), p.end(), 0);
    return p;
  }
};

}  // namespace

TEST_CASE("the reference kernel on the whole sequence matches the naive attention", "[cp][reference]") {
  problem p;
  const auto pos = p.positions();
  const cp::attention_shape shape{p.heads, p.dim};
  cp::reference_attention kernel;
  for (bool causal : {true, false}) {
    auto want = cp_test::naive_attention(p.q, p.k, p.v, p.dout, p.seq, p.heads, p.dim, causal);
    std::vector<double> out(p.q.size()), lse(p.seq * p.heads), dq(p.q.size(), 0), dk(p.q.size(), 0),
        dv(p.q.size(), 0);
    kernel.forward<double>(p.q, pos, p.k, p.v, pos, shape, {.causal = causal}, out, lse);
    kernel.backward<double>(p.q, pos, p.k, p.v, pos, shape, {.causal = causal}, out, lse, p.dout, dq, dk, dv);
    CHECK(cp_test::relative_error(out, want.out) < 1e-13);
    CHECK(cp_test::relative_error(lse, want.lse) < 1e-13);
    CHECK(cp_test::relative_error(dq, want.dq) < 1e-13);
    CHECK(cp_test::relative_error(dk, want.dk) < 1e-13);
    CHECK(cp_test::relative_error(dv, want.dv) < 1e-13);
  }
}

TEST_CASE("merging key blocks with the online softmax equals attending to all keys", "[cp][reference]") {
  problem p;
  const auto pos = p.positions();
  const cp::attention_shape shape{p.heads, p.dim};
  const std::size_t row = shape.row();
  cp::reference_attention kernel;
  auto want = cp_test::naive_attention(p.q, p.k, p.v, p.dout, p.seq, p.heads, p.dim, true);
  // Keys in three blocks, visited last block first (as a ring visits them): the first block a late
  // query sees may be entirely masked for early queries (lse = -inf rows).
  const std::size_t cuts[] = {0, 5, 9, 12};
  std::vector<double> out(p.q.size(), 0), lse(p.seq * p.heads, -std::numeric_limits<double>::infinity());
  std::vector<double> bo(out.size()), bl(lse.size()), dq(out.size(), 0), dk(out.size(), 0), dv(out.size(), 0);
  const std::span<const double> q(p.q), k(p.k), v(p.v);
  for (int b = 2; b >= 0; --b) {
    const std::size_t k0 = cuts[b], nk = cuts[b + 1] - cuts[b];
    kernel.forward<double>(q, pos, k.subspan(k0 * row, nk * row), v.subspan(k0 * row, nk * row),
                           std::span<const std::int64_t>(pos).subspan(k0, nk), shape, {.causal = true}, bo, bl);
    kernel.merge<double>(out, lse, bo, bl);
  }
  CHECK(cp_test::relative_error(out, want.out) < 1e-13);
  CHECK(cp_test::relative_error(lse, want.lse) < 1e-13);
  for (int b = 0; b < 3; ++b) {
    const std::size_t k0 = cuts[b], nk = cuts[b + 1] - cuts[b];
    kernel.backward<double>(q, pos, k.subspan(k0 * row, nk * row), v.subspan(k0 * row, nk * row),
                            std::span<const std::int64_t>(pos).subspan(k0, nk), shape, {.causal = true}, out, lse,
                            p.dout, dq, std::span<double>(dk).subspan(k0 * row, nk * row),
                            std::span<double>(dv).subspan(k0 * row, nk * row));
  }
  CHECK(cp_test::relative_error(dq, want.dq) < 1e-13);
  CHECK(cp_test::relative_error(dk, want.dk) < 1e-13);
  CHECK(cp_test::relative_error(dv, want.dv) < 1e-13);
}

TEST_CASE("the naive gradients agree with finite differences", "[cp][reference]") {
  // The test reference itself: d(sum(out ∘ dout))/dx by central differences, for a few elements.
  problem p;
  auto loss = [&](const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v) {
    auto r = cp_test::naive_attention(q, k, v, p.dout, p.seq, p.heads, p.dim, true);
    double s = 0;
    for (std::size_t i = 0; i < r.out.size(); ++i) s += r.out[i] * p.dout[i];
    return s;
  };
  auto g = cp_test::naive_attention(p.q, p.k, p.v, p.dout, p.seq, p.heads, p.dim, true);
  const double h = 1e-6;
  for (std::size_t i : {0u, 7u, 33u, 90u}) {
    for (int which = 0; which < 3; ++which) {
      auto q = p.q, k = p.k, v = p.v;
      auto& x = which == 0 ? q : which == 1 ? k : v;
      x[i] += h;
      const double up = loss(q, k, v);
      x[i] -= 2 * h;
      const double down = loss(q, k, v);
      const double analytic = which == 0 ? g.dq[i] : which == 1 ? g.dk[i] : g.dv[i];
      CHECK(std::abs((up - down) / (2 * h) - analytic) < 1e-7);
    }
  }
}
