// Every collective x dtype x in-place/out-of-place x blocking/async, checked against values each
// rank computes independently from the formula that generated every rank's input.
#include <catch2/catch.hpp>

#include "world.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

using namespace weft_test;
using weft::reduce_op;

namespace {

// Input of `rank` at index i for op: small integers, so every dtype (bfloat16 included) holds the
// exact result of reducing up to 8 ranks.
double input(int rank, std::size_t i, reduce_op op) {
  if (op == reduce_op::prod) return 1.0 + static_cast<double>((static_cast<std::size_t>(rank) + i) % 2);
  return 1.0 + static_cast<double>((static_cast<std::size_t>(rank) * 7 + i * 3) % 5);
}

template <class T>
double expected_reduction(int ranks, std::size_t i, reduce_op op) {
  double acc = input(0, i, op);
  for (int r = 1; r < ranks; ++r) {
    double x = input(r, i, op);
    switch (op) {
      case reduce_op::sum:
      case reduce_op::avg: acc += x; break;
      case reduce_op::prod: acc *= x; break;
      case reduce_op::min: acc = std::min(acc, x); break;
      case reduce_op::max: acc = std::max(acc, x); break;
    }
  }
  if (op == reduce_op::avg) {
    if constexpr (std::is_integral_v<T>) return std::floor(acc / ranks);
    else if constexpr (std::is_same_v<T, weft::half> || std::is_same_v<T, weft::bfloat16>)
      return value(T(static_cast<float>(acc) / static_cast<float>(ranks)));
    else return value(static_cast<T>(static_cast<T>(acc) / static_cast<T>(ranks)));
  }
  return acc;
}

template <class T>
std::vector<T> inputs(int rank, std::size_t n, reduce_op op) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(input(rank, i, op));
  return v;
}

constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg};
constexpr std::size_t counts[] = {1, 3, 1000, 4099};

template <class T>
void check_reduced(const std::vector<T>& got, int ranks, reduce_op op, std::size_t offset = 0) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("index " << i << " op " << weft::to_string(op));
    REQUIRE(value(got[i]) == expected_reduction<T>(ranks, i + offset, op));
  }
}

}  // namespace

#define WEFT_ALL_TYPES float, double, weft::half, weft::bfloat16, std::int32_t, std::int64_t, std::uint8_t

TEMPLATE_TEST_CASE("all_reduce: every op, in and out of place, blocking and async", "[collectives]", WEFT_ALL_TYPES) {
  auto comm = world();
  const int p = comm.size();
  for (reduce_op op : all_ops) {
    for (std::size_t n : counts) {
      auto send = inputs<TestType>(comm.rank(), n, op);
      std::vector<TestType> recv(n);
      comm.all_reduce(send, recv, op);
      check_reduced(recv, p, op);
      REQUIRE(send == inputs<TestType>(comm.rank(), n, op));  // out of place leaves the input alone

      auto inout = send;
      comm.all_reduce(inout, op);
      check_reduced(inout, p, op);

      std::vector<TestType> recv2(n);
      auto r1 = comm.all_reduce_async(send, recv2, op);
      auto inout2 = send;
      auto r2 = comm.all_reduce_async(inout2, op);
      r1.wait();
      r2.wait();
      check_reduced(recv2, p, op);
      check_reduced(inout2, p, op);
    }
  }
}

TEMPLATE_TEST_CASE("reduce to every root", "[collectives]", WEFT_ALL_TYPES) {
  auto comm = world();
  const int p = comm.size();
  for (reduce_op op : {reduce_op::sum, reduce_op::max, reduce_op::avg}) {
    for (int root = 0; root < p; ++root) {
      const std::size_t n = 1000;
      auto send = inputs<TestType>(comm.rank(), n, op);
      std::vector<TestType> recv(comm.rank() == root ? n : 0);
      comm.reduce(send, recv, root, op);
      if (comm.rank() == root) check_reduced(recv, p, op);

      auto inout = send;
      auto request = comm.reduce_async(inout, root, op);
      request.wait();
      if (comm.rank() == root) check_reduced(inout, p, op);
    }
  }
}

TEMPLATE_TEST_CASE("broadcast from every root", "[collectives]", WEFT_ALL_TYPES) {
  auto comm = world();
  for (int root = 0; root < comm.size(); ++root) {
    for (std::size_t n : counts) {
      auto root_data = inputs<TestType>(root, n, reduce_op::sum);
      std::vector<TestType> out(n);
      std::vector<TestType> send = comm.rank() == root ? root_data : std::vector<TestType>{};
      comm.broadcast(send, out, root);
      REQUIRE(out == root_data);

      std::vector<TestType> inout = comm.rank() == root ? root_data : std::vector<TestType>(n);
      auto request = comm.broadcast_async(inout, root);
      request.wait();
      REQUIRE(inout == root_data);
    }
  }
}

TEMPLATE_TEST_CASE("all_gather in and out of place", "[collectives]", WEFT_ALL_TYPES) {
  auto comm = world();
  const int p = comm.size();
  for (std::size_t n : counts) {
    std::vector<TestType> expected;
    for (int r = 0; r < p; ++r) {
      auto block = inputs<TestType>(r, n, reduce_op::sum);
      expected.insert(expected.end(), block.begin(), block.end());
    }
    auto mine = inputs<TestType>(comm.rank(), n, reduce_op::sum);
    std::vector<TestType> out(n * static_cast<std::size_t>(p));
    comm.all_gather(mine, out);
    REQUIRE(out == expected);

    std::vector<TestType> in_place(n * static_cast<std::size_t>(p));
    std::copy(mine.begin(), mine.end(), in_place.begin() + static_cast<std::ptrdiff_t>(n) * comm.rank());
    auto request = comm.all_gather_in_place_async(in_place);
    std::vector<TestType> out2(n * static_cast<std::size_t>(p));
    auto request2 = comm.all_gather_async(mine, out2);
    request.wait();
    request2.wait();
    REQUIRE(in_place == expected);
    REQUIRE(out2 == expected);
  }
}

TEMPLATE_TEST_CASE("reduce_scatter in and out of place", "[collectives]", WEFT_ALL_TYPES) {
  auto comm = world();
  const int p = comm.size();
  for (reduce_op op : all_ops) {
    for (std::size_t n : {std::size_t{1}, std::size_t{777}}) {
      const std::size_t total = n * static_cast<std::size_t>(p);
      const std::size_t offset = n * static_cast<std::size_t>(comm.rank());
      auto send = inputs<TestType>(comm.rank(), total, op);
      std::vector<TestType> recv(n);
      comm.reduce_scatter(send, recv, op);
      check_reduced(recv, p, op, offset);

      auto buffer = send;
      comm.reduce_scatter_in_place(buffer, op);
      std::vector<TestType> own(buffer.begin() + static_cast<std::ptrdiff_t>(offset),
                                buffer.begin() + static_cast<std::ptrdiff_t>(offset + n));
      check_reduced(own, p, op, offset);

      std::vector<TestType> recv2(n);
      auto request = comm.reduce_scatter_async(send, recv2, op);
      request.wait();
      check_reduced(recv2, p, op, offset);
    }
  }
}

TEMPLATE_TEST_CASE("all_to_all in and out of place", "[collectives]", WEFT_ALL_TYPES) {
  auto comm = world();
  const int p = comm.size();
  const std::size_t n = 5;
  // Block j of rank r's send holds the value encoding (r, j); rank i must receive (r, i) from each r.
  auto encode = [](int from, int to, std::size_t k) { return static_cast<double>((from * 11 + to * 3 + static_cast<int>(k)) % 97); };
  std::vector<TestType> send(n * static_cast<std::size_t>(p));
  for (int j = 0; j < p; ++j)
    for (std::size_t k = 0; k < n; ++k) send[static_cast<std::size_t>(j) * n + k] = make<TestType>(encode(comm.rank(), j, k));
  std::vector<TestType> expected(send.size());
  for (int r = 0; r < p; ++r)
    for (std::size_t k = 0; k < n; ++k) expected[static_cast<std::size_t>(r) * n + k] = make<TestType>(encode(r, comm.rank(), k));

  std::vector<TestType> recv(send.size());
  comm.all_to_all(send, recv);
  REQUIRE(recv == expected);
  auto inout = send;
  auto request = comm.all_to_all_async(inout);
  request.wait();
  REQUIRE(inout == expected);
}

TEMPLATE_TEST_CASE("send, recv and batched exchange around a ring", "[p2p]", WEFT_ALL_TYPES) {
  auto comm = world();
  const int p = comm.size();
  const int next = (comm.rank() + 1) % p;
  const int prev = (comm.rank() + p - 1) % p;
  const std::size_t n = 1001;
  auto mine = inputs<TestType>(comm.rank(), n, reduce_op::sum);
  auto from_prev = inputs<TestType>(prev, n, reduce_op::sum);

  // Blocking pairs, ordered so that no rank waits on itself: even ranks send first.
  std::vector<TestType> got(n);
  if (comm.rank() % 2 == 0) {
    comm.send(mine, next);
    comm.recv(got, prev);
  } else {
    comm.recv(got, prev);
    comm.send(mine, next);
  }
  REQUIRE(got == from_prev);

  // Batched: send to next and receive from prev in one group, both directions at once.
  std::vector<TestType> got2(n), got_back(n);
  auto from_next = inputs<TestType>(next, n, reduce_op::sum);
  comm.batch().send(mine, next).recv(got2, prev).send(mine, prev).recv(got_back, next).run();
  REQUIRE(got2 == from_prev);
  REQUIRE(got_back == from_next);

  // Async single send / recv.
  std::vector<TestType> got3(n);
  auto r = comm.recv_async(got3, prev);
  auto s = comm.send_async(mine, next);
  s.wait();
  r.wait();
  REQUIRE(got3 == from_prev);
}
