// Mixture of experts on 2 and 4 ranks (ep2, ep4): the all_to_allv against MPI_Alltoallv; the
// router, the load-balancing and z losses and every gradient of the layer against a reference
// written out in moe_test_support.hpp (and its finite differences); the layer over the ep group
// against the same layer on one rank with every expert, with a rank and an expert that receive no
// tokens, a rank with no tokens, capacity mode and sequences split over a cp group; bad sizes.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <weft/moe/layer.hpp>
#include <weft/trace/flight_recorder.hpp>

#include "moe_test_support.hpp"
#if WEFT_TEST_CBLAS
#include "blas_gemm.hpp"  // examples/common: train_gpt's adapter
#endif

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

using namespace moe_test;
using Catch::Contains;

// The MPI calls this program makes, counted through MPI's profiling interface: how many call
// agreements (each one MPI_Allreduce) a dispatch and combine pay.
struct mpi_call_counts {
  int allreduce = 0, alltoall = 0, alltoallv = 0, allgather = 0;
};
static mpi_call_counts mpi_calls;

extern "C" {
int MPI_Allreduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  ++mpi_calls.allreduce;
  return PMPI_Allreduce(send, recv, count, type, op, comm);
}
int MPI_Alltoall(const void* send, int send_count, MPI_Datatype send_type, void* recv, int recv_count,
                 MPI_Datatype recv_type, MPI_Comm comm) {
  ++mpi_calls.alltoall;
  return PMPI_Alltoall(send, send_count, send_type, recv, recv_count, recv_type, comm);
}
int MPI_Alltoallv(const void* send, const int send_counts[], const int send_displs[], MPI_Datatype send_type, void* recv,
                  const int recv_counts[], const int recv_displs[], MPI_Datatype recv_type, MPI_Comm comm) {
  ++mpi_calls.alltoallv;
  return PMPI_Alltoallv(send, send_counts, send_displs, send_type, recv, recv_counts, recv_displs, recv_type, comm);
}
int MPI_Allgather(const void* send, int send_count, MPI_Datatype send_type, void* recv, int recv_count,
                  MPI_Datatype recv_type, MPI_Comm comm) {
  ++mpi_calls.allgather;
  return PMPI_Allgather(send, send_count, send_type, recv, recv_count, recv_type, comm);
}
}

namespace {

// Elements rank `from` sends rank `to`: ragged, with zeros (rank 0 sends nothing, the last rank
// receives nothing).
std::size_t ragged(int from, int to, int ranks) {
  if (from == 0 || to == ranks - 1) return 0;
  return static_cast<std::size_t>((from * 3 + to * 5) % 4);
}

template <class T>
void check_all_to_allv_against_mpi(comm_t& world, MPI_Datatype type) {
  const int P = world.size(), r = world.rank();
  std::vector<std::size_t> send_counts(P), recv_counts(P);
  std::vector<int> sc(P), sd(P), rc(P), rd(P);
  std::size_t sent = 0, received = 0;
  for (int j = 0; j < P; ++j) {
    send_counts[j] = ragged(r, j, P), recv_counts[j] = ragged(j, r, P);
    sc[j] = static_cast<int>(send_counts[j]), sd[j] = static_cast<int>(sent);
    rc[j] = static_cast<int>(recv_counts[j]), rd[j] = static_cast<int>(received);
    sent += send_counts[j], received += recv_counts[j];
  }
  std::vector<T> send(sent);
  for (std::size_t i = 0; i < sent; ++i) send[i] = static_cast<T>(1000 * r + static_cast<int>(i));
  std::vector<T> expected(received), got(received, T(-1)), got_async(received, T(-1));
  MPI_Alltoallv(send.data(), sc.data(), sd.data(), type, expected.data(), rc.data(), rd.data(), type, MPI_COMM_WORLD);
  world.all_to_allv(send, std::span<const std::size_t>(send_counts), got, std::span<const std::size_t>(recv_counts));
  world.all_to_allv_async(send, std::span<const std::size_t>(send_counts), got_async,
                          std::span<const std::size_t>(recv_counts))
      .wait();
  CHECK(got == expected);
  CHECK(got_async == expected);
}

// y, dh and the gradients of one layer run.
struct layer_run {
  std::vector<float> y, dh;
  weft::moe::moe_losses losses;
  gradients grads;
  std::vector<std::size_t> per_expert;
};

constexpr weft::moe::loss_gradients scales{.aux = 0.3, .z = 0.2};

template <class Gemm = weft::moe::reference_gemm>
layer_run run_layer(comm_t& group, const model& m, const std::vector<float>& h, std::size_t S,
                    const std::vector<float>& dy, weft::moe::moe_options options,
                    std::vector<weft::communicator_ref<weft::mpi_backend>> sequence_groups = {}) {
  weft::moe::moe_layer<weft::mpi_backend, Gemm> layer(group, m.shape(), options, std::move(sequence_groups));
  layer_run out{std::vector<float>(h.size()), std::vector<float>(h.size()), {}, gradients(m, layer.local_experts()), {}};
  const auto weights = m.tensors(layer.first_expert(), layer.local_experts());
  out.losses = layer.forward(h, S, weights, out.y);
  layer.backward(dy, scales, weights, out.grads.tensors(), out.dh);
  out.per_expert = layer.last_permutation().per_expert;
  return out;
}

void sum_over(comm_t& world, std::vector<float>& v) { world.all_reduce(v); }

// The layer over the ep group (world) equals the layer on one rank with every expert (forward,
// losses, dh, router gradients; expert gradients summed over the ranks' tokens), and y and the
// losses equal the reference in double.
void check_ep_against_one_rank(comm_t& world, const model& m, const std::vector<float>& h, std::size_t S,
                               weft::moe::moe_options options = {}) {
  const auto dy = values(h.size(), 500 + static_cast<unsigned>(world.rank()));
  layer_run ep = run_layer(world, m, h, S, dy, options);
  comm_t self = self_group();
  layer_run one = run_layer(self, m, h, S, dy, options);
  const naive_result naive = naive_forward(h, S, m, options.capacity_factor);
  CHECK(close(ep.y, naive.y, 1e-5));
  CHECK(close(ep.losses.aux, naive.aux, 1e-6));
  CHECK(close(ep.losses.z, naive.z, 1e-6));
  CHECK(ep.losses.dropped == naive.dropped);
  CHECK(close(ep.y, one.y, 1e-5));
  CHECK(close(ep.dh, one.dh, 1e-5));
  CHECK(close(ep.grads.router, one.grads.router, 1e-5));
  const std::size_t local = m.E / static_cast<std::size_t>(world.size()),
                    first = local * static_cast<std::size_t>(world.rank());
  for (std::size_t e = 0; e < m.E; ++e) {
    sum_over(world, one.grads.fc_w[e]), sum_over(world, one.grads.fc_b[e]);
    sum_over(world, one.grads.pj_w[e]), sum_over(world, one.grads.pj_b[e]);
  }
  for (std::size_t e = 0; e < local; ++e) {
    CAPTURE(first + e);
    CHECK(close(ep.grads.fc_w[e], one.grads.fc_w[first + e], 1e-4));
    CHECK(close(ep.grads.fc_b[e], one.grads.fc_b[first + e], 1e-4));
    CHECK(close(ep.grads.pj_w[e], one.grads.pj_w[first + e], 1e-4));
    CHECK(close(ep.grads.pj_b[e], one.grads.pj_b[first + e], 1e-4));
  }
}

constexpr std::size_t C = 6, F = 8, E = 8, K = 2, S = 2, L = 5;  // E divides over 2 and 4 ranks

}  // namespace

TEST_CASE("all_to_allv matches MPI_Alltoallv on ragged counts with zeros, and is recorded", "[moe][comm]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  check_all_to_allv_against_mpi<float>(world, MPI_FLOAT);
  check_all_to_allv_against_mpi<std::int64_t>(world, MPI_INT64_T);
  bool recorded = false;
  for (const auto& record : world.recorder().snapshot())
    recorded = recorded || (record.op == weft::trace::operation::all_to_allv && record.state == weft::trace::op_state::completed);
  CHECK(recorded);

  // The count exchange: block j for rank j, block i from rank i (two counts a block).
  const int P = world.size(), r = world.rank();
  std::vector<std::int64_t> mine(2 * P), theirs(2 * P, -1), expected(2 * P);
  for (int j = 0; j < P; ++j) {
    mine[2 * j] = static_cast<std::int64_t>(ragged(r, j, P)), mine[2 * j + 1] = 10 * r + j;
    expected[2 * j] = static_cast<std::int64_t>(ragged(j, r, P)), expected[2 * j + 1] = 10 * j + r;
  }
  world.exchange_counts(mine, theirs);
  CHECK(theirs == expected);
}

TEST_CASE("all_to_allv with counts that do not pair up: the same error on every rank", "[moe][comm]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep", weft::check_level::communication);
  const int P = world.size();
  std::vector<std::size_t> send_counts(P, 1), recv_counts(P, 1);
  if (world.rank() == 0) recv_counts[1] = 2;  // rank 1 sends rank 0 one element
  std::vector<float> send(P, 1.0f), recv(P + 1);
  REQUIRE_THROWS_WITH(world.all_to_allv(send, std::span<const std::size_t>(send_counts), recv,
                                        std::span<const std::size_t>(recv_counts)),
                      Contains("do not pair up") && Contains("rank 1 sends 1 to rank 0, which expects 2"));
  // The refused call is recorded as failed, not left pending for the watchdog.
  for (const auto& record : world.recorder().snapshot()) CHECK(weft::trace::finished(record.state));
  world.all_to_allv(send, std::span<const std::size_t>(send_counts), recv,
                    std::span<const std::size_t>(std::vector<std::size_t>(P, 1)));  // still usable
}

namespace {

// Rows rank `source` sends expert e: ragged, with zeros; row i of them holds value(source, e, i, c).
std::size_t rows_for(std::size_t source, std::size_t e) { return (source + 2 * e) % 3; }
float row_value(std::size_t source, std::size_t e, std::size_t i, std::size_t c) {
  return static_cast<float>(10000 * source + 100 * e + 10 * i + c);
}

// This rank's rows for the experts, grouped by expert (what the dispatcher sends), width w.
std::vector<float> rows_grouped(std::size_t source, std::size_t w, std::vector<std::size_t>& per_expert) {
  per_expert.assign(E, 0);
  std::vector<float> rows;
  for (std::size_t e = 0; e < E; ++e) {
    per_expert[e] = rows_for(source, e);
    for (std::size_t i = 0; i < per_expert[e]; ++i)
      for (std::size_t c = 0; c < w; ++c) rows.push_back(row_value(source, e, i, c));
  }
  return rows;
}

}  // namespace

TEST_CASE("dispatch and combine at the default check level: one call agreement, carried by the count exchange",
          "[moe][comm]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  REQUIRE(world.checks() == weft::check_level::agreement);
  const std::size_t P = static_cast<std::size_t>(world.size()), r = static_cast<std::size_t>(world.rank()), w = 3;
  weft::moe::token_dispatcher<weft::mpi_backend> dispatcher(world, E);
  std::vector<std::size_t> per_expert;
  const std::vector<float> rows = rows_grouped(r, w, per_expert);
  std::vector<float> received, back(rows.size());
  auto round_trip = [&] {
    dispatcher.plan(per_expert, w);
    received.assign(dispatcher.rows_received() * w, -1.0f);
    dispatcher.dispatch(std::span<const float>(rows), std::span<float>(received));
    dispatcher.combine(std::span<const float>(received), std::span<float>(back));
  };
  const mpi_call_counts before = mpi_calls;
  round_trip();
  // The agreement's all-reduce before the count exchange, and none before the two all-to-allvs.
  CHECK(mpi_calls.allreduce - before.allreduce == 1);
  CHECK(mpi_calls.alltoall - before.alltoall == 1);
  CHECK(mpi_calls.alltoallv - before.alltoallv == 2);
  // Each source's rows for each local expert arrived where the plan says, and all came back.
  const std::size_t local = E / P;
  for (std::size_t source = 0; source < P; ++source)
    for (std::size_t e = 0; e < local; ++e) {
      const auto segment = dispatcher.received_segment(source, e);
      REQUIRE(segment.rows == rows_for(source, r * local + e));
      for (std::size_t i = 0; i < segment.rows; ++i)
        for (std::size_t c = 0; c < w; ++c)
          CHECK(received[(segment.first + i) * w + c] == row_value(source, r * local + e, i, c));
    }
  CHECK(back == rows);

  // Another collective between: the plan's next dispatch agrees on its call again.
  std::vector<double> one{1.0};
  world.all_reduce(one);
  const mpi_call_counts later = mpi_calls;
  dispatcher.dispatch(std::span<const float>(rows), std::span<float>(received));
  CHECK(mpi_calls.allreduce - later.allreduce == 1);

  // At check_level::local nothing agrees; at communication every all_to_allv still compares its
  // counts (an all-gather each), the exchange carrying nothing.
  world.set_checks(weft::check_level::local);
  const mpi_call_counts unchecked = mpi_calls;
  round_trip();
  CHECK(mpi_calls.allreduce - unchecked.allreduce == 0);
  CHECK(back == rows);
  world.set_checks(weft::check_level::communication);
  const mpi_call_counts checked = mpi_calls;
  round_trip();
  CHECK(mpi_calls.allgather - checked.allgather == 5);  // the exchange's call, each all_to_allv's call and counts
  CHECK(back == rows);
}

TEST_CASE("rows of another length on one rank: one error at the count exchange on every rank", "[moe][comm]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  world.set_timeout(std::chrono::seconds(30));  // a hang fails with the watchdog's message
  const std::size_t r = static_cast<std::size_t>(world.rank()), last = static_cast<std::size_t>(world.size() - 1);
  const std::size_t w = r == last ? 5 : 4;  // the last rank's rows are longer: MPI_ERR_TRUNCATE at its peers
  weft::moe::token_dispatcher<weft::mpi_backend> dispatcher(world, E);
  std::vector<std::size_t> per_expert;
  const std::vector<float> rows = rows_grouped(r, w, per_expert);
  std::string message;
  try {
    dispatcher.plan(per_expert, w);
    std::vector<float> received(dispatcher.rows_received() * w), back(rows.size());
    dispatcher.dispatch(std::span<const float>(rows), std::span<float>(received));
    dispatcher.combine(std::span<const float>(received), std::span<float>(back));
  } catch (const weft::error& e) {
    message = e.what();
  }
  CHECK_THAT(message, Contains("exchange_counts on group 'ep' (rank " + std::to_string(r)) &&
                          Contains("the ranks exchange rows of different shapes") &&
                          Contains("rank 0: rows of 4 x float") &&
                          Contains("rank " + std::to_string(last) + ": rows of 5 x float"));
  // The group still works: the same rows on every rank go and come back.
  const std::vector<float> same = rows_grouped(r, 4, per_expert);
  dispatcher.plan(per_expert, 4);
  std::vector<float> received(dispatcher.rows_received() * 4), back(same.size());
  dispatcher.dispatch(std::span<const float>(same), std::span<float>(received));
  dispatcher.combine(std::span<const float>(received), std::span<float>(back));
  CHECK(back == same);
}

TEST_CASE("router: fp32 softmax, top-k with ties to the lower index, normalised weights", "[moe][router]") {
  const std::size_t c = 3, e = 5;
  std::vector<float> router = values(e * c, 3);
  for (std::size_t q = 0; q < c; ++q) router[1 * c + q] = router[3 * c + q] = 2.0f;  // experts 1 and 3 tie, on top
  const std::vector<float> h = {0.5f, 0.25f, 0.125f};
  weft::moe::routing r;
  weft::moe::route(weft::moe::reference_gemm{}, h, router, {.hidden = c, .ffn = 1, .experts = e, .top_k = 2}, r);
  CHECK(r.expert == std::vector<std::int32_t>{1, 3});
  CHECK(r.weight == std::vector<float>{0.5f, 0.5f});
  double sum = 0;
  std::vector<double> logit(e);
  for (std::size_t x = 0; x < e; ++x) {
    for (std::size_t q = 0; q < c; ++q) logit[x] += static_cast<double>(h[q]) * router[x * c + q];
    sum += std::exp(logit[x]);
  }
  for (std::size_t x = 0; x < e; ++x) CHECK(r.probs[x] == Approx(std::exp(logit[x]) / sum).epsilon(1e-6));
  CHECK(r.lse[0] == Approx(std::log(sum)).epsilon(1e-6));
  weft::moe::route(weft::moe::reference_gemm{}, h, router, {.hidden = c, .ffn = 1, .experts = e, .top_k = 1}, r);
  CHECK(r.expert == std::vector<std::int32_t>{1});
}

TEST_CASE("every gradient of the layer (router, aux, z, experts, input) matches finite differences", "[moe][grad]") {
  const std::size_t c = 4, f = 6, e = 4, k = 2, s = 2, t = 6;
  const model base(c, f, e, k, 21);
  const auto h = values(t * c, 22), dy = values(t * c, 23);
  for (double factor : {0.0, 0.75}) {
    CAPTURE(factor);
    comm_t self = self_group();
    layer_run run = run_layer(self, base, h, s, dy, {.capacity_factor = factor});
    auto loss = [&](const model& m, const std::vector<float>& x) {
      const naive_result n = naive_forward(x, s, m, factor);
      double l = 0;
      for (std::size_t i = 0; i < n.y.size(); ++i) l += n.y[i] * dy[i];
      for (std::size_t q = 0; q < s; ++q) l += scales.aux * n.aux[q] + scales.z * n.z[q];
      return l;
    };
    // Central differences of the double reference, over the float value actually stored.
    auto numeric = [&](std::function<float&(model&, std::vector<float>&)> at) {
      model m = base;
      std::vector<float> x = h;
      const float v = at(m, x);
      at(m, x) = v + 1e-3f;
      const float up = at(m, x);
      const double l_up = loss(m, x);
      at(m, x) = v - 1e-3f;
      const float down = at(m, x);
      return (l_up - loss(m, x)) / (static_cast<double>(up) - down);
    };
    auto expect = [&](double analytic, double numeric_value) {
      CHECK(std::fabs(analytic - numeric_value) <= 2e-3 * std::max(1.0, std::fabs(numeric_value)));
    };
    for (std::size_t i = 0; i < h.size(); ++i)
      expect(run.dh[i], numeric([i](model&, std::vector<float>& x) -> float& { return x[i]; }));
    for (std::size_t i = 0; i < base.router.size(); ++i)
      expect(run.grads.router[i], numeric([i](model& m, std::vector<float>&) -> float& { return m.router[i]; }));
    for (std::size_t x = 0; x < e; ++x) {
      for (std::size_t i = 0; i < c * f; ++i) {
        expect(run.grads.fc_w[x][i], numeric([x, i](model& m, std::vector<float>&) -> float& { return m.fc_w[x][i]; }));
        expect(run.grads.pj_w[x][i], numeric([x, i](model& m, std::vector<float>&) -> float& { return m.pj_w[x][i]; }));
      }
      for (std::size_t i = 0; i < f; ++i)
        expect(run.grads.fc_b[x][i], numeric([x, i](model& m, std::vector<float>&) -> float& { return m.fc_b[x][i]; }));
      for (std::size_t i = 0; i < c; ++i)
        expect(run.grads.pj_b[x][i], numeric([x, i](model& m, std::vector<float>&) -> float& { return m.pj_b[x][i]; }));
    }
  }
}

TEST_CASE("the layer over the ep group equals one rank with every expert (dropless)", "[moe][ep]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  const model m(C, F, E, K, 31);
  check_ep_against_one_rank(world, m, values(S * L * C, 40 + static_cast<unsigned>(world.rank())), S);
}

TEST_CASE("a rank whose experts are routed no tokens, and an expert that receives none", "[moe][ep][empty]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  auto h = values(S * L * C, 50 + static_cast<unsigned>(world.rank()));
  for (std::size_t t = 0; t < S * L; ++t) h[t * C] = 3.0f;  // a constant input the router weights can steer
  const std::size_t local = E / static_cast<std::size_t>(world.size());

  SECTION("rank 1's experts") {
    model m(C, F, E, K, 32);
    for (std::size_t e = local; e < 2 * local; ++e) m.router[e * C] = -10.0f;
    check_ep_against_one_rank(world, m, h, S);
    weft::moe::moe_layer<weft::mpi_backend> layer(world, m.shape());
    std::vector<float> y(h.size());
    layer.forward(h, S, m.tensors(layer.first_expert(), local), y);
    for (std::size_t e = local; e < 2 * local; ++e) CHECK(layer.last_permutation().per_expert[e] == 0);
  }
  SECTION("expert 0") {
    model m(C, F, E, K, 33);
    m.router[0] = -10.0f;
    check_ep_against_one_rank(world, m, h, S);
    weft::moe::moe_layer<weft::mpi_backend> layer(world, m.shape());
    std::vector<float> y(h.size());
    layer.forward(h, S, m.tensors(layer.first_expert(), local), y);
    CHECK(layer.last_permutation().per_expert[0] == 0);
  }
}

TEST_CASE("a rank with no tokens at all", "[moe][ep][empty]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  const model m(C, F, E, K, 34);
  const bool empty = world.rank() == 0;
  check_ep_against_one_rank(world, m, empty ? std::vector<float>{} : values(S * L * C, 60 + static_cast<unsigned>(world.rank())),
                            empty ? 0 : S);
}

TEST_CASE("capacity mode drops the same assignments as the reference", "[moe][ep][capacity]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  const model m(C, F, E, K, 35);
  const auto h = values(S * L * C, 70 + static_cast<unsigned>(world.rank()));
  REQUIRE(naive_forward(h, S, m, 0.5).dropped > 0);
  check_ep_against_one_rank(world, m, h, S, {.capacity_factor = 0.5});
}

TEST_CASE("aux and z over whole sequences split across a cp group", "[moe][ep][cp]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  const std::size_t P = static_cast<std::size_t>(world.size()), r = static_cast<std::size_t>(world.rank()), part = 3,
                    full = P * part;  // tokens per sequence: `part` on each rank
  const model m(C, F, E, K, 36);
  const auto h_all = values(S * full * C, 80), dy_all = values(S * full * C, 81);
  auto mine = [&](const std::vector<float>& all) {
    std::vector<float> out;
    for (std::size_t s = 0; s < S; ++s)
      out.insert(out.end(), all.begin() + static_cast<std::ptrdiff_t>((s * full + r * part) * C),
                 all.begin() + static_cast<std::ptrdiff_t>((s * full + (r + 1) * part) * C));
    return out;
  };
  layer_run ep = run_layer(world, m, mine(h_all), S, mine(dy_all), {}, {world.ref()});
  comm_t self = self_group();
  layer_run one = run_layer(self, m, h_all, S, dy_all, {});
  const naive_result naive = naive_forward(h_all, S, m);
  CHECK(close(ep.losses.aux, naive.aux, 1e-6));
  CHECK(close(ep.losses.z, naive.z, 1e-6));
  CHECK(close(ep.y, mine(std::vector<float>(naive.y.begin(), naive.y.end())), 1e-5));
  CHECK(close(ep.dh, mine(one.dh), 1e-5));
  sum_over(world, ep.grads.router);
  CHECK(close(ep.grads.router, one.grads.router, 1e-4));
  const std::size_t local = E / P;
  for (std::size_t e = 0; e < local; ++e) {
    CHECK(close(ep.grads.fc_w[e], one.grads.fc_w[r * local + e], 1e-4));
    CHECK(close(ep.grads.pj_b[e], one.grads.pj_b[r * local + e], 1e-4));
  }
}

TEST_CASE("bad sizes: E not a multiple of ep, top-k above E", "[moe][errors]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  const std::size_t P = static_cast<std::size_t>(world.size());
  const std::string ranks = std::to_string(P);
  REQUIRE_THROWS_WITH((weft::moe::moe_layer<weft::mpi_backend>(world, {.hidden = C, .ffn = F, .experts = P + 1, .top_k = 1})),
                      Contains(std::to_string(P + 1) + " experts do not divide over the " + ranks +
                               " ranks of the ep group"));
  REQUIRE_THROWS_WITH((weft::moe::moe_layer<weft::mpi_backend>(world, {.hidden = C, .ffn = F, .experts = E, .top_k = E + 1})),
                      Contains("top-k 9 is not between 1 and the 8 experts"));
}

#if WEFT_TEST_CBLAS
TEST_CASE("the layer on a CBLAS gemm_kernel equals the reference loops", "[moe][ep][blas]") {
  comm_t world(weft::mpi_backend::comm::world(), "ep");
  const model m(C, F, E, K, 37);
  const auto h = values(S * L * C, 90 + static_cast<unsigned>(world.rank())), dy = values(S * L * C, 91);
  layer_run loops = run_layer(world, m, h, S, dy, {});
  layer_run blas = run_layer<weft_programs::blas_gemm>(world, m, h, S, dy, {});
  CHECK(close(blas.y, loops.y, 1e-5));
  CHECK(close(blas.dh, loops.dh, 1e-5));
  CHECK(close(blas.grads.router, loops.grads.router, 1e-5));
  for (std::size_t e = 0; e < blas.grads.fc_w.size(); ++e) {
    CHECK(close(blas.grads.fc_w[e], loops.grads.fc_w[e], 1e-5));
    CHECK(close(blas.grads.pj_w[e], loops.grads.pj_w[e], 1e-5));
  }
}
#endif
