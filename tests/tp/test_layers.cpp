// The reference column- and row-parallel layers, the column -> row MLP (f and g conjugates), with
// sequence parallelism off and on, and the collective matmul, each against the same computation
// on one rank (serial_linear, written out in tp_test_support.hpp): forward outputs, input
// gradients, weight and bias gradients.
#include <catch2/catch.hpp>

#include <weft/tp/collective_matmul.hpp>
#include <weft/tp/linear.hpp>

#include "tp_test_support.hpp"

#include <random>
#include <string>
#include <vector>

using namespace tp_test;
using Catch::Contains;

namespace {

// tokens, hidden, ffn: tokens and ffn divide by 2, 3 and 4.
constexpr std::size_t T = 12, H = 8, F = 24;

using span_c = std::span<const float>;
using span_m = std::span<float>;

}  // namespace

TEST_CASE("column-parallel linear matches one rank (plain, gathered output, sequence parallel)", "[tp][linear]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  const serial_linear serial{H, F};
  const auto x = values(T * H, 1), w = values(F * H, 2), b = values(F, 3), dy = values(T * F, 4);
  const auto y_ref = serial.forward(x, w, b);
  std::vector<float> dx_ref, dw_ref, db_ref;
  serial.backward(x, w, dy, dx_ref, dw_ref, db_ref);
  const std::size_t fl = F / p;
  const auto w_shard = rows(w, H, r * fl, fl), b_shard = rows(b, 1, r * fl, fl);

  for (int mode = 0; mode < 3; ++mode) {
    const bool gather = mode == 1, sp = mode == 2;
    CAPTURE(gather, sp);
    weft::tp::column_parallel_linear<weft::mpi_backend, float> layer(tp, H, F,
                                                                    {.sequence_parallel = sp, .gather_output = gather});
    const auto x_in = sp ? rows(x, H, r * T / p, T / p) : x;
    std::vector<float> y(T * (gather ? F : fl));
    layer.forward(span_c(x_in), span_c(w_shard), span_c(b_shard), span_m(y));
    CHECK(close(y, gather ? y_ref : columns(y_ref, F, r * fl, fl)));

    const auto dy_in = gather ? dy : columns(dy, F, r * fl, fl);
    std::vector<float> dx(x_in.size()), dw(w_shard.size()), db(fl);
    layer.backward(span_c(dy_in), span_c(w_shard), span_m(dx), span_m(dw), span_m(db));
    CHECK(close(dx, sp ? rows(dx_ref, H, r * T / p, T / p) : dx_ref));
    CHECK(close(dw, rows(dw_ref, H, r * fl, fl)));
    CHECK(close(db, rows(db_ref, 1, r * fl, fl)));
  }
}

TEST_CASE("row-parallel linear matches one rank (parallel input or not, sequence parallel)", "[tp][linear]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  const serial_linear serial{F, H};
  const auto x = values(T * F, 5), w = values(H * F, 6), b = values(H, 7), dy = values(T * H, 8);
  const auto y_ref = serial.forward(x, w, b);
  std::vector<float> dx_ref, dw_ref, db_ref;
  serial.backward(x, w, dy, dx_ref, dw_ref, db_ref);
  const std::size_t fl = F / p;
  const auto w_shard = columns(w, F, r * fl, fl);

  for (int mode = 0; mode < 3; ++mode) {
    const bool whole_input = mode == 1, sp = mode == 2;
    CAPTURE(whole_input, sp);
    weft::tp::row_parallel_linear<weft::mpi_backend, float> layer(
        tp, F, H, {.sequence_parallel = sp, .input_is_parallel = !whole_input});
    const auto x_in = whole_input ? x : columns(x, F, r * fl, fl);
    std::vector<float> y(sp ? T / p * H : T * H);
    layer.forward(span_c(x_in), span_c(w_shard), span_c(b), span_m(y));
    CHECK(close(y, sp ? rows(y_ref, H, r * T / p, T / p) : y_ref));

    const auto dy_in = sp ? rows(dy, H, r * T / p, T / p) : dy;
    std::vector<float> dx(x_in.size()), dw(w_shard.size()), db(H);
    layer.backward(span_c(dy_in), span_c(w_shard), span_m(dx), span_m(dw), span_m(db));
    CHECK(close(dx, whole_input ? dx_ref : columns(dx_ref, F, r * fl, fl)));
    CHECK(close(dw, columns(dw_ref, F, r * fl, fl)));
    CHECK(close(db, db_ref));
  }
}

TEST_CASE("column -> row MLP (f and g) matches one rank, with and without sequence parallelism", "[tp][mlp][sp]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  const serial_linear up{H, F}, down{F, H};
  const auto x = values(T * H, 11), w1 = values(F * H, 12), b1 = values(F, 13);
  const auto w2 = values(H * F, 14), b2 = values(H, 15), dy = values(T * H, 16);
  const auto h_ref = up.forward(x, w1, b1);
  const auto y_ref = down.forward(h_ref, w2, b2);
  std::vector<float> dh_ref, dw2_ref, db2_ref, dx_ref, dw1_ref, db1_ref;
  down.backward(h_ref, w2, dy, dh_ref, dw2_ref, db2_ref);
  up.backward(x, w1, dh_ref, dx_ref, dw1_ref, db1_ref);

  const std::size_t fl = F / p, tl = T / p;
  const auto w1_shard = rows(w1, H, r * fl, fl), b1_shard = rows(b1, 1, r * fl, fl);
  const auto w2_shard = columns(w2, F, r * fl, fl);
  for (bool sp : {false, true}) {
    CAPTURE(sp);
    weft::tp::column_parallel_linear<weft::mpi_backend, float> first(tp, H, F, {.sequence_parallel = sp});
    weft::tp::row_parallel_linear<weft::mpi_backend, float> second(tp, F, H, {.sequence_parallel = sp});
    const auto x_in = sp ? rows(x, H, r * tl, tl) : x;
    std::vector<float> h(T * fl), y(sp ? tl * H : T * H);
    first.forward(span_c(x_in), span_c(w1_shard), span_c(b1_shard), span_m(h));
    second.forward(span_c(h), span_c(w2_shard), span_c(b2), span_m(y));
    CHECK(close(y, sp ? rows(y_ref, H, r * tl, tl) : y_ref));

    const auto dy_in = sp ? rows(dy, H, r * tl, tl) : dy;
    std::vector<float> dh(h.size()), dw2(w2_shard.size()), db2(H), dx(x_in.size()), dw1(w1_shard.size()), db1(fl);
    second.backward(span_c(dy_in), span_c(w2_shard), span_m(dh), span_m(dw2), span_m(db2));
    first.backward(span_c(dh), span_c(w1_shard), span_m(dx), span_m(dw1), span_m(db1));
    CHECK(close(dx, sp ? rows(dx_ref, H, r * tl, tl) : dx_ref));
    CHECK(close(dw1, rows(dw1_ref, H, r * fl, fl)));
    CHECK(close(db1, rows(db1_ref, 1, r * fl, fl)));
    CHECK(close(dw2, columns(dw2_ref, F, r * fl, fl)));
    CHECK(close(db2, db2_ref));
  }
}

TEST_CASE("layer errors name the layer, the group and the fix", "[tp][errors]") {
  comm_t tp = tp_group();
  using column = weft::tp::column_parallel_linear<weft::mpi_backend, float>;
  using row = weft::tp::row_parallel_linear<weft::mpi_backend, float>;
  CHECK_THROWS_WITH(column(tp, 8, 5), Contains("column_parallel_linear on group 'tp'") &&
                                          Contains("out_features = 5 does not divide by the tp size"));
  CHECK_THROWS_WITH(row(tp, 7, 8), Contains("in_features = 7 does not divide by the tp size"));
  column layer(tp, H, F);
  std::vector<float> x(T * H), w(3), b(F / static_cast<std::size_t>(tp.size())), y(T * F);
  CHECK_THROWS_WITH(layer.forward(span_c(x), span_c(w), span_c(b), span_m(y)),
                    Contains("weight has 3 elements but must have"));
}

namespace {

std::vector<float> random_values(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& e : v) e = dist(gen);
  return v;
}

auto reference_gemm = [](const float* a, const float* b, float* c, std::size_t m, std::size_t n, std::size_t k) {
  weft::tp::reference::matmul_nt(a, b, c, m, n, k);
};

}  // namespace

TEST_CASE("all_gather_matmul equals all-gather then GEMM, bit for bit", "[tp][collective_matmul]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  const std::size_t m = 5, k = 13, n = 7;
  const auto x = random_values(m * k, 100u + static_cast<unsigned>(tp.rank()));
  const auto w = random_values(n * k, 7u);
  std::vector<float> plain(m * p * n), overlapped(m * p * n, -1.0f), one_rank(m * p * n);
  weft::tp::all_gather_matmul(tp, span_c(x), span_c(w), span_m(plain), m, n, k, reference_gemm, {.decompose = false});
  for (std::size_t slices : {std::size_t{1}, std::size_t{3}, std::size_t{16}}) {
    weft::tp::all_gather_matmul(tp, span_c(x), span_c(w), span_m(overlapped), m, n, k, reference_gemm,
                                {.progress_slices = slices});
    CHECK(overlapped == plain);
  }
  // The same on one rank: every rank's x regenerated here, one GEMM.
  std::vector<float> all_x;
  for (std::size_t q = 0; q < p; ++q) {
    const auto xq = random_values(m * k, 100u + static_cast<unsigned>(q));
    all_x.insert(all_x.end(), xq.begin(), xq.end());
  }
  weft::tp::reference::matmul_nt(all_x.data(), w.data(), one_rank.data(), m * p, n, k);
  CHECK(overlapped == one_rank);
  CHECK_THROWS_WITH(weft::tp::all_gather_matmul(tp, span_c(x), span_c(w), span_m(plain).first(3), m, n, k,
                                                reference_gemm),
                    Contains("all_gather_matmul on group 'tp'") && Contains("y has 3 elements"));
}

TEST_CASE("matmul_reduce_scatter equals GEMM then reduce-scatter (fixed ring order)", "[tp][collective_matmul]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  const std::size_t m = 12, k = 11, n = 6, rows_per_rank = m / p;
  auto x_of = [&](std::size_t q) { return random_values(m * k, 200u + static_cast<unsigned>(q)); };
  auto w_of = [&](std::size_t q) { return random_values(n * k, 300u + static_cast<unsigned>(q)); };
  const auto x = x_of(r), w = w_of(r);
  std::vector<float> plain(rows_per_rank * n), overlapped(rows_per_rank * n);
  weft::tp::matmul_reduce_scatter(tp, span_c(x), span_c(w), span_m(plain), m, n, k, reference_gemm,
                                  {.decompose = false});
  weft::tp::matmul_reduce_scatter(tp, span_c(x), span_c(w), span_m(overlapped), m, n, k, reference_gemm);

  // One rank: every rank's partial product, summed in the documented ring order for block r:
  // P_{r+1} + P_{r+2} + ... + P_r.
  std::vector<std::vector<float>> partial(p, std::vector<float>(m * n));
  for (std::size_t q = 0; q < p; ++q) {
    const auto xq = x_of(q), wq = w_of(q);
    weft::tp::reference::matmul_nt(xq.data(), wq.data(), partial[q].data(), m, n, k);
  }
  std::vector<float> ring(rows_per_rank * n);
  for (std::size_t i = 0; i < ring.size(); ++i) {
    float s = partial[(r + 1) % p][r * rows_per_rank * n + i];
    for (std::size_t step = 2; step <= p; ++step) s = s + partial[(r + step) % p][r * rows_per_rank * n + i];
    ring[i] = s;
  }
  CHECK(overlapped == ring);  // bit for bit: same order
  // Against the library's reduce-scatter: bit for bit on 2 ranks, within rounding on more.
  if (p == 2) CHECK(overlapped == plain);
  for (std::size_t i = 0; i < plain.size(); ++i) {
    float bound = 0;
    for (std::size_t q = 0; q < p; ++q) bound += std::fabs(partial[q][r * rows_per_rank * n + i]);
    CHECK(std::fabs(overlapped[i] - plain[i]) <= static_cast<float>(p - 1) * 0x1p-23f * bound);
  }
  CHECK_THROWS_WITH(weft::tp::matmul_reduce_scatter(tp, span_c(x).first(7 * k), span_c(w), span_m(plain), 7, n, k,
                                                    reference_gemm),
                    Contains("m = 7 rows do not divide by the group size"));
}
