// The NCCL backend on GPUs (label gpu: `ctest -L gpu` on a machine with one GPU per rank).
// Every collective x dtype x in-place/out-of-place x blocking/async, checked against values each
// rank computes independently from the formula that generated every rank's input; then point to
// point, barrier, split, agreement checks, streams, destruction with pending work, deadlines (in
// waits, destructors, unwinding, destruction, init and split), abort from another thread, two
// ranks on one GPU, CUDA graph capture.
#include <catch2/catch.hpp>

#include "gpu_test_support.hpp"

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/launch/nccl_bootstrap.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

using weft::reduce_op;
using Catch::Contains;

namespace {

using weft_test::cuda_ok;
using weft_test::nccl_comm;
using weft_test::world;

using weft_test::device_array;

template <class T>
constexpr bool is_16_bit_float = std::is_same_v<T, weft::half> || std::is_same_v<T, weft::bfloat16>;

template <class T>
T make(double v) {
  if constexpr (is_16_bit_float<T>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
double value(T v) {
  if constexpr (is_16_bit_float<T>)
    return static_cast<double>(float(v));
  else
    return static_cast<double>(v);
}

// Input of `rank` at index i: small integers, so every dtype holds every exact result for up to 8 ranks.
double input(int rank, std::size_t i, reduce_op op) {
  if (op == reduce_op::prod) return 1.0 + static_cast<double>((static_cast<std::size_t>(rank) + i) % 2);
  return 1.0 + static_cast<double>((static_cast<std::size_t>(rank) * 7 + i * 3) % 5);
}

template <class T>
std::vector<T> inputs(int rank, std::size_t n, reduce_op op, std::size_t offset = 0) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = make<T>(input(rank, i + offset, op));
  return v;
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
  if (op == reduce_op::avg) return std::is_integral_v<T> ? std::floor(acc / ranks) : acc / ranks;
  return acc;
}

// Averages of floating types are rounded in the type (NCCL may scale before summing); all else is exact.
template <class T>
double tolerance(reduce_op op) {
  if (op != reduce_op::avg || std::is_integral_v<T>) return 0.0;
  if constexpr (std::is_same_v<T, weft::bfloat16>) return 2e-2;
  if constexpr (std::is_same_v<T, weft::half>) return 4e-3;
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  return 1e-12;
}

template <class T>
void check_reduced(const std::vector<T>& got, int ranks, reduce_op op, std::size_t offset = 0) {
  const double tol = tolerance<T>(op);
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("index " << i << " op " << weft::to_string(op) << " ranks " << ranks);
    const double want = expected_reduction<T>(ranks, i + offset, op);
    if (tol == 0.0)
      REQUIRE(value(got[i]) == want);
    else
      REQUIRE(value(got[i]) == Approx(want).epsilon(tol));
  }
}

// Value of element k of the block that `from` sends to `to` (all_to_all, gathers, broadcasts).
double tagged(int from, int to, std::size_t k) {
  return static_cast<double>((from * 5 + to * 3 + static_cast<int>(k % 7)) % 11);
}

constexpr reduce_op all_ops[] = {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg};
constexpr std::size_t counts[] = {1, 3, 1000, 4099};

enum class mode { blocking, async };
constexpr mode both_modes[] = {mode::blocking, mode::async};

}  // namespace

#define WEFT_ALL_TYPES float, double, weft::half, weft::bfloat16, std::int32_t, std::int64_t, std::uint8_t

TEMPLATE_TEST_CASE("NCCL all_reduce: every op, in and out of place, blocking and async", "[nccl][gpu]",
                   WEFT_ALL_TYPES) {
  auto& comm = world();
  const int p = comm.size();
  for (reduce_op op : all_ops)
    for (std::size_t n : counts)
      for (mode m : both_modes) {
        const auto mine = inputs<TestType>(comm.rank(), n, op);
        device_array<TestType> send(mine), recv(n);
        if (m == mode::blocking)
          comm.all_reduce(send.span(), recv.span(), op);
        else
          comm.all_reduce_async(send.span(), recv.span(), op).wait();
        check_reduced(recv.download(), p, op);
        REQUIRE(send.download() == mine);  // out of place leaves the input alone

        device_array<TestType> inout(mine);
        if (m == mode::blocking)
          comm.all_reduce(inout.span(), op);
        else
          comm.all_reduce_async(inout.span(), op).wait();
        check_reduced(inout.download(), p, op);
      }
}

TEMPLATE_TEST_CASE("NCCL reduce: result on the root only", "[nccl][gpu]", WEFT_ALL_TYPES) {
  auto& comm = world();
  const int p = comm.size();
  const int root = p - 1;
  const bool is_root = comm.rank() == root;
  for (reduce_op op : all_ops)
    for (std::size_t n : {std::size_t{3}, std::size_t{4099}})
      for (mode m : both_modes) {
        const auto mine = inputs<TestType>(comm.rank(), n, op);
        device_array<TestType> send(mine), recv(is_root ? n : 0);  // non-roots pass no recv buffer
        if (m == mode::blocking)
          comm.reduce(send.span(), recv.span(), root, op);
        else
          comm.reduce_async(send.span(), recv.span(), root, op).wait();
        if (is_root) check_reduced(recv.download(), p, op);

        device_array<TestType> inout(mine);
        if (m == mode::blocking)
          comm.reduce(inout.span(), root, op);
        else
          comm.reduce_async(inout.span(), root, op).wait();
        if (is_root)
          check_reduced(inout.download(), p, op);
        else
          REQUIRE(inout.download() == mine);
      }
}

TEMPLATE_TEST_CASE("NCCL broadcast from a root that is not rank 0 when possible", "[nccl][gpu]", WEFT_ALL_TYPES) {
  auto& comm = world();
  const int p = comm.size();
  const int root = p > 1 ? 1 : 0;
  const bool is_root = comm.rank() == root;
  for (std::size_t n : counts)
    for (mode m : both_modes) {
      std::vector<TestType> from_root(n);
      for (std::size_t k = 0; k < n; ++k) from_root[k] = make<TestType>(tagged(root, 0, k));
      device_array<TestType> send(is_root ? from_root : std::vector<TestType>{}), recv(n);
      if (m == mode::blocking)
        comm.broadcast(send.span(), recv.span(), root);
      else
        comm.broadcast_async(send.span(), recv.span(), root).wait();
      REQUIRE(recv.download() == from_root);

      device_array<TestType> inout(is_root ? from_root : std::vector<TestType>(n, make<TestType>(0)));
      if (m == mode::blocking)
        comm.broadcast(inout.span(), root);
      else
        comm.broadcast_async(inout.span(), root).wait();
      REQUIRE(inout.download() == from_root);
    }
}

TEMPLATE_TEST_CASE("NCCL all_gather in and out of place", "[nccl][gpu]", WEFT_ALL_TYPES) {
  auto& comm = world();
  const int p = comm.size();
  const auto P = static_cast<std::size_t>(p);
  for (std::size_t n : counts)
    for (mode m : both_modes) {
      std::vector<TestType> mine(n), want(n * P);
      for (std::size_t k = 0; k < n; ++k) mine[k] = make<TestType>(tagged(comm.rank(), 0, k));
      for (int r = 0; r < p; ++r)
        for (std::size_t k = 0; k < n; ++k)
          want[static_cast<std::size_t>(r) * n + k] = make<TestType>(tagged(r, 0, k));

      device_array<TestType> send(mine), recv(n * P);
      if (m == mode::blocking)
        comm.all_gather(send.span(), recv.span());
      else
        comm.all_gather_async(send.span(), recv.span()).wait();
      REQUIRE(recv.download() == want);

      std::vector<TestType> own_block_only(n * P, make<TestType>(0));
      std::copy(mine.begin(), mine.end(), own_block_only.begin() + static_cast<std::ptrdiff_t>(comm.rank() * n));
      device_array<TestType> inout(own_block_only);
      if (m == mode::blocking)
        comm.all_gather_in_place(inout.span());
      else
        comm.all_gather_in_place_async(inout.span()).wait();
      REQUIRE(inout.download() == want);
    }
}

TEMPLATE_TEST_CASE("NCCL reduce_scatter in and out of place", "[nccl][gpu]", WEFT_ALL_TYPES) {
  auto& comm = world();
  const int p = comm.size();
  const auto P = static_cast<std::size_t>(p);
  const std::size_t own = static_cast<std::size_t>(comm.rank());
  for (reduce_op op : all_ops)
    for (std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{1001}})
      for (mode m : both_modes) {
        const auto mine = inputs<TestType>(comm.rank(), n * P, op);
        device_array<TestType> send(mine), recv(n);
        if (m == mode::blocking)
          comm.reduce_scatter(send.span(), recv.span(), op);
        else
          comm.reduce_scatter_async(send.span(), recv.span(), op).wait();
        check_reduced(recv.download(), p, op, own * n);

        device_array<TestType> inout(mine);
        if (m == mode::blocking)
          comm.reduce_scatter_in_place(inout.span(), op);
        else
          comm.reduce_scatter_in_place_async(inout.span(), op).wait();
        auto all = inout.download();
        check_reduced(std::vector<TestType>(all.begin() + static_cast<std::ptrdiff_t>(own * n),
                                            all.begin() + static_cast<std::ptrdiff_t>((own + 1) * n)),
                      p, op, own * n);
      }
}

TEMPLATE_TEST_CASE("NCCL all_to_all in and out of place", "[nccl][gpu]", WEFT_ALL_TYPES) {
  auto& comm = world();
  const int p = comm.size();
  const auto P = static_cast<std::size_t>(p);
  for (std::size_t n : {std::size_t{1}, std::size_t{5}, std::size_t{1001}})
    for (mode m : both_modes) {
      std::vector<TestType> mine(n * P), want(n * P);
      for (int peer = 0; peer < p; ++peer)
        for (std::size_t k = 0; k < n; ++k) {
          mine[static_cast<std::size_t>(peer) * n + k] = make<TestType>(tagged(comm.rank(), peer, k));
          want[static_cast<std::size_t>(peer) * n + k] = make<TestType>(tagged(peer, comm.rank(), k));
        }
      device_array<TestType> send(mine), recv(n * P);
      if (m == mode::blocking)
        comm.all_to_all(send.span(), recv.span());
      else
        comm.all_to_all_async(send.span(), recv.span()).wait();
      REQUIRE(recv.download() == want);
      REQUIRE(send.download() == mine);

      device_array<TestType> inout(mine);
      if (m == mode::blocking)
        comm.all_to_all(inout.span());
      else
        comm.all_to_all_async(inout.span()).wait();
      REQUIRE(inout.download() == want);
    }
}

TEST_CASE("NCCL all_to_allv on ragged counts with zeros, and the count exchange", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size(), r = comm.rank();
  // Elements `from` sends `to`: rank 0 sends nothing, the last rank receives nothing.
  auto count = [p](int from, int to) -> std::size_t {
    return from == 0 || to == p - 1 ? 0 : static_cast<std::size_t>((from * 3 + to * 5) % 4 + 1);
  };
  std::vector<std::size_t> send_counts, recv_counts;
  std::vector<float> mine, want;
  std::vector<std::int64_t> counts_out, counts_in(static_cast<std::size_t>(p), -1), counts_want;
  for (int peer = 0; peer < p; ++peer) {
    send_counts.push_back(count(r, peer));
    recv_counts.push_back(count(peer, r));
    counts_out.push_back(static_cast<std::int64_t>(count(r, peer)));
    counts_want.push_back(static_cast<std::int64_t>(count(peer, r)));
    for (std::size_t k = 0; k < count(r, peer); ++k) mine.push_back(make<float>(tagged(r, peer, k)));
    for (std::size_t k = 0; k < count(peer, r); ++k) want.push_back(make<float>(tagged(peer, r, k)));
  }
  comm.exchange_counts(counts_out, counts_in);
  REQUIRE(counts_in == counts_want);
  for (mode m : both_modes) {
    device_array<float> send(mine), recv(want.size());
    if (m == mode::blocking)
      comm.all_to_allv(send.span(), std::span<const std::size_t>(send_counts), recv.span(),
                       std::span<const std::size_t>(recv_counts));
    else
      comm.all_to_allv_async(send.span(), std::span<const std::size_t>(send_counts), recv.span(),
                             std::span<const std::size_t>(recv_counts))
          .wait();
    REQUIRE(recv.download() == want);
  }
}

TEST_CASE("NCCL point to point: a ring, single and batched, blocking and async", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  if (p < 2) {
    WARN("point to point needs two ranks");
    return;
  }
  const int r = comm.rank();
  const int next = (r + 1) % p;
  const int prev = (r + p - 1) % p;
  const std::size_t n = 777;
  auto block = [n](int from, int to) {
    std::vector<std::int64_t> v(n);
    for (std::size_t k = 0; k < n; ++k) v[k] = static_cast<std::int64_t>(tagged(from, to, k)) + 1000 * from;
    return v;
  };

  SECTION("batched, both directions at once") {
    for (mode m : both_modes) {
      device_array<std::int64_t> to_next(block(r, next)), to_prev(block(r, prev)), from_prev(n), from_next(n);
      auto batch = comm.batch();
      batch.send(to_next.span(), next).send(to_prev.span(), prev).recv(from_prev.span(), prev).recv(from_next.span(),
                                                                                                  next);
      if (m == mode::blocking)
        batch.run();
      else
        batch.run_async().wait();
      REQUIRE(from_prev.download() == block(prev, r));
      REQUIRE(from_next.download() == block(next, r));
    }
  }

  SECTION("a ring posted receive first, as one async batch (unpaired async p2p is refused)") {
    device_array<std::int64_t> out(block(r, next)), in(n);
    // On their own, a receive posted before its send would hold the stream forever: refused.
    CHECK_THROWS_WITH(comm.recv_async(in.span(), prev), Contains("batch()"));
    CHECK_THROWS_WITH(comm.send_async(out.span(), next), Contains("batch()"));
    auto ring = comm.batch();
    ring.recv(in.span(), prev).send(out.span(), next);
    auto pending = ring.run_async();
    pending.wait();
    REQUIRE(in.download() == block(prev, r));
  }

  SECTION("blocking pairs: even ranks send first") {
    if (p % 2 != 0) {
      WARN("blocking pairs need an even rank count");
      return;
    }
    const int partner = r % 2 == 0 ? r + 1 : r - 1;
    device_array<std::int64_t> out(block(r, partner)), in(n);
    if (r % 2 == 0) {
      comm.send(out.span(), partner);
      comm.recv(in.span(), partner);
    } else {
      comm.recv(in.span(), partner);
      comm.send(out.span(), partner);
    }
    REQUIRE(in.download() == block(partner, r));
  }
}

TEST_CASE("NCCL barrier, blocking and async", "[nccl][gpu]") {
  auto& comm = world();
  comm.barrier();
  auto pending = comm.barrier_async();
  pending.wait();
  CHECK_FALSE(pending.pending());
  // After a blocking barrier every rank has passed the previous one: MPI sees them all.
  comm.barrier();
  int one = 1, sum = 0;
  MPI_Allreduce(&one, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK(sum == comm.size());
}

// NCCL polls its waits against a deadline of its own; the communicator's is the watchdog's. They
// are one value: from the constructor, set_timeout (3600 s is honoured, 0 turns both off) and split.
TEST_CASE("NCCL deadline: the backend's is the communicator's, through set_timeout and split", "[nccl][gpu]") {
  using std::chrono::milliseconds;
  auto& comm = world();
  const milliseconds before = comm.timeout();
  CHECK(comm.native().timeout() == before);  // the constructor's (WEFT_COMM_TIMEOUT here)
  comm.set_timeout(std::chrono::hours(1));
  CHECK(comm.native().timeout() == milliseconds(3600000));
  auto child = comm.split(0, comm.rank(), "deadline");
  REQUIRE(child);
  CHECK(child->timeout() == milliseconds(3600000));
  CHECK(child->native().timeout() == milliseconds(3600000));
  comm.set_timeout(milliseconds(0));
  CHECK(comm.native().timeout() == milliseconds(0));
  CHECK(child->native().timeout() == milliseconds(3600000));  // its own from now on
  comm.set_timeout(before);
}

TEST_CASE("NCCL split: groups by color ordered by key; left-out ranks get nothing", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  const int r = comm.rank();
  const int color = r % 2;
  auto child = comm.split(color, p - r, "parity");  // key p - r: reverse order
  REQUIRE(child.has_value());
  int members = 0, position = 0;
  for (int q = 0; q < p; ++q)
    if (q % 2 == color) {
      ++members;
      if (q > r) ++position;
    }
  CHECK(child->size() == members);
  CHECK(child->rank() == position);
  CHECK(child->name() == "parity");

  device_array<std::int64_t> x(std::vector<std::int64_t>{r});
  child->all_reduce(x.span());
  std::int64_t want = 0;
  for (int q = 0; q < p; ++q)
    if (q % 2 == color) want += q;
  CHECK(x.download()[0] == want);

  auto without_last = comm.split(r == p - 1 ? -1 : 0, r, "without_last");
  CHECK(without_last.has_value() == (r != p - 1));
}

TEST_CASE("NCCL agreement checks go through host_all_gather", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  CHECK_NOTHROW(comm.expect_same_on_all_ranks("a layout", 42));
  if (p > 1) {
    CHECK_THROWS_WITH(comm.expect_same_on_all_ranks("a layout", comm.rank() == p - 1 ? 7 : 42),
                      Contains("ranks disagree about a layout: ranks " + std::to_string(p - 1)));
    auto checked = comm.split(0, comm.rank(), "checked");
    REQUIRE(checked.has_value());
    checked->set_checks(weft::check_level::communication);
    device_array<float> x(comm.rank() == 0 ? 3 : 4);
    CHECK_THROWS_WITH(checked->all_reduce(x.span()), Contains("called different operations or shapes"));
    device_array<float> y(std::vector<float>(4, 1.0f));
    checked->all_reduce(y.span());  // agreeing calls still work
    CHECK(y.download() == std::vector<float>(4, static_cast<float>(p)));
  }
}

TEST_CASE("NCCL streams: a compute stream waits on a request without the host", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  const std::size_t n = 1 << 20;
  cudaStream_t compute = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  float* pinned = nullptr;
  cuda_ok(cudaMallocHost(reinterpret_cast<void**>(&pinned), n * sizeof(float)));

  SECTION("make_stream_wait orders the compute stream after the operation") {
    device_array<float> x(std::vector<float>(n, 1.0f));
    auto pending = comm.all_reduce_async(x.span());
    pending.make_stream_wait(compute);
    cuda_ok(cudaMemcpyAsync(pinned, x.span().data(), n * sizeof(float), cudaMemcpyDeviceToHost, compute));
    cuda_ok(cudaStreamSynchronize(compute));
    CHECK(pinned[0] == static_cast<float>(p));
    CHECK(pinned[n - 1] == static_cast<float>(p));
    pending.wait();
  }

  SECTION("operations can go on the caller's stream, and back") {
    auto& native = comm.native();
    cudaStream_t own = native.stream();
    native.use_stream(compute);
    CHECK(native.stream() == compute);
    device_array<float> x(std::vector<float>(n, 2.0f));
    comm.all_reduce_async(x.span()).wait();
    CHECK(x.download()[n / 2] == 2.0f * static_cast<float>(p));
    native.use_stream(std::nullopt);
    CHECK(native.stream() == own);
  }

  cudaFreeHost(pinned);
  cudaStreamDestroy(compute);
}

TEST_CASE("NCCL: destroying a communicator waits for its pending work", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  device_array<double> x(std::vector<double>(1 << 22, 0.5));
  nccl_comm::request pending;
  {
    auto child = comm.split(0, comm.rank(), "short_lived");
    REQUIRE(child.has_value());
    pending = child->all_reduce_async(x.span());
  }  // the child is destroyed here, with the all-reduce possibly still running
  pending.wait();  // completes without touching the destroyed communicator
  CHECK(x.download().back() == 0.5 * p);
}

// NCCL connects two peers on their first exchange, on the host (in ncclGroupEnd, which weft polls
// under the deadline): ranks 0 and 1 exchange once first, so that an unmatched receive posted
// afterwards is enqueued and then stuck on the GPU. Without it, the receive's own connection
// setup waits for the peer and times out inside run_async(), before any request exists.
namespace {
void connect_ranks_0_and_1(nccl_comm& c, device_array<float>& scratch) {
  if (c.size() < 2 || c.rank() > 1) return;
  device_array<float> out(std::vector<float>(scratch.size(), 1.0f));
  c.batch().send(out.span(), 1 - c.rank()).recv(scratch.span(), 1 - c.rank()).run();
}
}  // namespace

TEST_CASE("NCCL abort: a stuck operation ends, its request throws, the communicator is unusable",
          "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  auto doomed = comm.split(0, comm.rank(), "doomed");
  REQUIRE(doomed.has_value());
  device_array<float> buffer(16);
  connect_ranks_0_and_1(*doomed, buffer);
  if (p > 1 && comm.rank() == 0) {
    // A receive nobody will match: it never completes by itself.
    auto stuck = doomed->batch().recv(buffer.span(), 1).run_async();
    CHECK_FALSE(stuck.test());
    doomed->native().set_timeout(std::chrono::milliseconds(200));
    const auto start = std::chrono::steady_clock::now();
    // The deadline aborts the communicator (the kernel stops) before the request lets go.
    CHECK_THROWS_WITH(stuck.wait(), Contains("group_p2p did not complete within the deadline of 0.2 s"));
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
    CHECK_FALSE(stuck.pending());
    CHECK_FALSE(doomed->native().valid());
    CHECK_THROWS_WITH(doomed->batch().recv(buffer.span(), 1).run_async(), Contains("aborted"));
  } else {
    doomed->native().abort();
  }
  CHECK_FALSE(doomed->native().valid());
  CHECK_THROWS_WITH(doomed->all_reduce(buffer.span()), Contains("the communicator was aborted"));
  comm.barrier();  // the world communicator is unaffected
}

TEST_CASE("NCCL timeout: the message names rank, host, group, operation and the wait", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  auto doomed = comm.split(0, comm.rank(), "timeout_message");
  REQUIRE(doomed.has_value());
  device_array<float> buffer(16);
  if (p > 1 && comm.rank() == 0) {
    doomed->native().set_timeout(std::chrono::milliseconds(300));
    try {
      doomed->batch().recv(buffer.span(), 1).run();  // blocking: waits under the deadline
      FAIL("no timeout");
    } catch (const weft::error& e) {
      const std::string what = e.what();
      CHECK_THAT(what, Contains("rank 0 of " + std::to_string(p) + " on host " + weft::detail::host_name()));
      CHECK_THAT(what, Contains("group '"));
      CHECK_THAT(what, Contains("group_p2p did not complete within the deadline of 0.3 s (waited"));
      CHECK_THAT(what, Contains("aborted"));
    }
    CHECK_FALSE(doomed->native().valid());
  } else {
    doomed->native().abort();  // its peer aborted: do not wait for it at destruction
  }
  comm.barrier();
}

TEST_CASE("NCCL timeout: dropping a stuck request (a destructor, unwinding) does not wait forever", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  auto doomed = comm.split(0, comm.rank(), "dropped");
  REQUIRE(doomed.has_value());
  device_array<float> buffer(16);
  connect_ranks_0_and_1(*doomed, buffer);
  if (p > 1 && comm.rank() == 0) {
    doomed->native().set_timeout(std::chrono::milliseconds(300));
    const auto start = std::chrono::steady_clock::now();
    try {
      auto stuck = doomed->batch().recv(buffer.span(), 1).run_async();
      throw std::runtime_error("unwinding past a pending request");
    } catch (const std::runtime_error&) {
    }
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
    CHECK_FALSE(doomed->native().valid());  // the deadline aborted it
  } else {
    doomed->native().abort();
  }
  {
    // Destroying a communicator whose work never completes: bounded by the deadline too.
    auto gone = comm.split(0, comm.rank(), "destroyed_stuck");
    REQUIRE(gone.has_value());
    connect_ranks_0_and_1(*gone, buffer);
    if (p > 1 && comm.rank() == 0) {
      gone->native().set_timeout(std::chrono::milliseconds(300));
      auto stuck = gone->batch().recv(buffer.span(), 1).run_async();
      const auto start = std::chrono::steady_clock::now();
      gone.reset();  // waits for its work under the deadline, then aborts
      CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
      CHECK_THROWS_WITH(stuck.wait(), Contains("aborted") || Contains("destroyed"));
    } else {
      gone->native().abort();
    }
  }
  comm.barrier();
}

TEST_CASE("NCCL abort from a watchdog thread while the owner waits", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  auto doomed = comm.split(0, comm.rank(), "watched");
  REQUIRE(doomed.has_value());
  device_array<float> buffer(16);
  connect_ranks_0_and_1(*doomed, buffer);
  if (p > 1 && comm.rank() == 0) {
    doomed->native().set_timeout(std::chrono::milliseconds(0));  // only the watchdog ends the wait
    auto stuck = doomed->batch().recv(buffer.span(), 1).run_async();
    auto& native = doomed->native();
    std::thread watchdog([&native] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      native.abort();
      native.abort();  // twice is harmless
    });
    CHECK_THROWS_WITH(stuck.wait(), Contains("aborted"));
    watchdog.join();
    CHECK_FALSE(doomed->native().valid());
  } else {
    doomed->native().abort();
  }
  comm.barrier();
}

TEST_CASE("NCCL init and split are non-blocking: a rank that never joins is a timeout", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  const char* saved = std::getenv("WEFT_COMM_TIMEOUT");
  const std::string previous = saved != nullptr ? saved : "";
  setenv("WEFT_COMM_TIMEOUT", "1", 1);
  // Rank 0 of 2 of a communicator nobody else joins: this process alone, on every rank.
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(weft::nccl_backend::comm::init_rank(2, id, 0, std::nullopt, "lonely"),
                    Contains("joining the communicator did not complete within the deadline of 1.0 s") &&
                        Contains("group 'lonely'"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
  if (saved != nullptr)
    setenv("WEFT_COMM_TIMEOUT", previous.c_str(), 1);
  else
    unsetenv("WEFT_COMM_TIMEOUT");

  // A split only rank 0 joins times out on rank 0 (and aborts the communicator it split).
  auto parent = comm.split(0, comm.rank(), "split_parent");
  REQUIRE(parent.has_value());
  if (p > 1 && comm.rank() == 0) {
    parent->native().set_timeout(std::chrono::milliseconds(500));
    CHECK_THROWS_WITH(parent->split(0, 0, "never"), Contains("split") && Contains("deadline"));
    CHECK_FALSE(parent->native().valid());
  } else if (p > 1) {
    parent->native().abort();
  }
  comm.barrier();
}

TEST_CASE("NCCL: two ranks on one GPU fail with the ranks, host, bus id and NCCL_HOSTID", "[nccl][gpu]") {
  // Two threads of this process join one communicator on the same device: NCCL's duplicate-GPU
  // check refuses it (threads share the host id, so a per-process NCCL_HOSTID does not help).
  const char* saved = std::getenv("WEFT_COMM_TIMEOUT");
  const std::string previous = saved != nullptr ? saved : "";
  setenv("WEFT_COMM_TIMEOUT", "60", 1);
  ncclUniqueId id{};
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  const int device = world().native().device();
  std::string messages[2];
  bool joined[2] = {false, false};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      cudaSetDevice(device);
      try {
        auto c = weft::nccl_backend::comm::init_rank(2, id, r);
        joined[r] = true;
        c.abort();
      } catch (const std::exception& e) {
        messages[r] = e.what();
      }
    });
  for (std::thread& t : ranks) t.join();
  if (saved != nullptr)
    setenv("WEFT_COMM_TIMEOUT", previous.c_str(), 1);
  else
    unsetenv("WEFT_COMM_TIMEOUT");
  char bus[32] = {};
  cuda_ok(cudaDeviceGetPCIBusId(bus, sizeof(bus), device));
  bool explained = false;
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << messages[r]);
    CHECK_FALSE(joined[r]);
    if (messages[r].find("on the same GPU") == std::string::npos) continue;
    explained = true;
    CHECK_THAT(messages[r], Contains(bus) && Contains(weft::detail::host_name()) && Contains("NCCL_HOSTID"));
  }
  CHECK(explained);
}

TEST_CASE("NCCL in a CUDA graph: requests made during capture complete in graph order", "[nccl][gpu]") {
  auto& comm = world();
  const int p = comm.size();
  auto child = comm.split(0, comm.rank(), "graph");
  REQUIRE(child.has_value());
  cudaStream_t capture = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
  child->native().use_stream(capture);
  device_array<float> x(std::vector<float>(1000, 1.0f));
  child->all_reduce(x.span());  // warm-up outside capture (connections are set up on the host)
  x.upload(std::vector<float>(1000, 1.0f));
  cudaGraph_t graph = nullptr;
  cuda_ok(cudaStreamBeginCapture(capture, cudaStreamCaptureModeRelaxed));
  auto pending = child->all_reduce_async(x.span());
  pending.wait();  // does not query the event: that would invalidate the capture
  CHECK(pending.test());
  child->all_reduce(x.span());  // a blocking call during capture does not wait either
  cuda_ok(cudaStreamEndCapture(capture, &graph));
  REQUIRE(graph != nullptr);
  cudaGraphExec_t exec = nullptr;
  cuda_ok(cudaGraphInstantiate(&exec, graph, 0));
  cuda_ok(cudaGraphLaunch(exec, capture));
  cuda_ok(cudaStreamSynchronize(capture));
  CHECK(x.download()[999] == static_cast<float>(p * p));
  // Graphs are destroyed before the communicator their kernels belong to.
  cuda_ok(cudaGraphExecDestroy(exec));
  cuda_ok(cudaGraphDestroy(graph));
  child->native().use_stream(std::nullopt);
  child.reset();
  cuda_ok(cudaStreamDestroy(capture));
}
