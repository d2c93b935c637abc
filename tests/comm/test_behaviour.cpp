// What the communicator promises beyond correct values: clear errors, agreement checks that turn
// mismatched calls into errors on every rank, async work that progresses while the caller is busy,
// requests that wait when dropped, and split.
#include <catch2/catch.hpp>

#include "world.hpp"

#include <atomic>
#include <chrono>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

using namespace weft_test;
using Catch::Matchers::Contains;

TEST_CASE("mismatched buffer sizes are rejected locally, naming the group, rank and sizes") {
  auto comm = world();
  std::vector<float> send(10), recv(12);
  CHECK_THROWS_WITH(comm.all_reduce(send, recv),
                    Contains("all_reduce on group 'world'") && Contains("send has 10 elements but recv has 12"));
  std::vector<float> gathered(10 * static_cast<std::size_t>(comm.size()) + 1);
  CHECK_THROWS_WITH(comm.all_gather(send, gathered), Contains("all_gather") && Contains("recv has"));
  CHECK_THROWS_WITH(comm.broadcast(send, comm.size()), Contains("root " + std::to_string(comm.size()) + " is not a rank"));
  CHECK_THROWS_WITH(comm.send(send, comm.rank()), Contains("is not another rank"));
  std::vector<float> odd(static_cast<std::size_t>(comm.size()) * 3 + 1);
  CHECK_THROWS_WITH(comm.reduce_scatter_in_place(odd), Contains("not a multiple of the group size"));
  // Nothing was sent by the failed calls: the communicator still works.
  std::vector<int> one{comm.rank()};
  comm.all_reduce(one);
  CHECK(one[0] == comm.size() * (comm.size() - 1) / 2);
}

TEST_CASE("with communication checks, ranks calling different shapes all get an error instead of a hang") {
  auto comm = world();
  comm.set_checks(weft::check_level::communication);
  // The last rank passes a different count: without the check this would corrupt or hang.
  std::size_t n = comm.rank() == comm.size() - 1 ? 5 : 4;
  std::vector<double> data(n, 1.0);
  CHECK_THROWS_WITH(comm.all_reduce(data), Contains("called different operations or shapes") &&
                                               Contains("rank " + std::to_string(comm.size() - 1) + ": all_reduce of 5"));
  // A rank calling a different collective is reported too.
  std::vector<double> block(2, 1.0), out(2 * static_cast<std::size_t>(comm.size()));
  if (comm.rank() == 0)
    CHECK_THROWS_WITH(comm.all_gather(block, out), Contains("rank 0: all_gather") && Contains("all_reduce"));
  else
    CHECK_THROWS_WITH(comm.all_reduce(block), Contains("rank 0: all_gather"));
  // Agreeing calls pass through the check and compute the right answer.
  std::vector<double> same(4, 2.0);
  comm.all_reduce(same);
  CHECK(same[0] == 2.0 * comm.size());
}

TEST_CASE("at the default check level, sizes that differ across ranks are one error on every rank") {
  // No check level is set: what a program gets without WEFT_CHECK_LEVEL. The last rank passes 5
  // elements (or blocks of 5) where the others pass 4. Without the agreement, MPI returned wrong
  // data on some ranks, MPI_ERR_TRUNCATE on others, or hung.
  auto comm = world();
  REQUIRE(comm.checks() == weft::check_level::agreement);
  comm.set_timeout(std::chrono::seconds(30));  // a hang fails with the watchdog's message
  const std::size_t ranks = static_cast<std::size_t>(comm.size());
  const std::size_t n = comm.rank() == comm.size() - 1 ? 5 : 4;
  const std::string last = std::to_string(comm.size() - 1);
  auto expect_error = [&](const std::string& operation, auto&& call) {
    INFO(operation << " on rank " << comm.rank());
    std::string message;
    try {
      call();
    } catch (const weft::error& e) {
      message = e.what();
    }
    // This rank's call, the group, and every rank's size.
    CHECK_THAT(message, Contains(operation + " on group 'world' (rank " + std::to_string(comm.rank()) + " of " +
                                 std::to_string(comm.size()) + ", " + std::to_string(n) + " x"));
    CHECK_THAT(message, Contains("the ranks of the group passed different sizes"));
    CHECK_THAT(message, Contains("rank 0: " + operation + " of 4 x") &&
                            Contains("rank " + last + ": " + operation + " of 5 x"));
  };
  std::vector<float> data(n, 1.0f), out(n * ranks, 0.0f), blocks(n * ranks, 1.0f);
  expect_error("all_reduce", [&] { comm.all_reduce(data); });
  expect_error("all_reduce", [&] { comm.all_reduce_async(data).wait(); });
  expect_error("reduce", [&] { comm.reduce(data, 0); });
  expect_error("broadcast", [&] { comm.broadcast(data, 0); });
  expect_error("all_gather", [&] { comm.all_gather(data, out); });
  expect_error("reduce_scatter", [&] { comm.reduce_scatter(blocks, data); });
  expect_error("all_to_all", [&] { comm.all_to_all(blocks); });
  expect_error("all_gather", [&] { comm.all_gather_async(data, out).wait(); });
  // Agreeing calls pass and compute the right answer: the communicator still works.
  std::vector<double> same(4, 2.0);
  comm.all_reduce(same);
  CHECK(same[3] == 2.0 * comm.size());
}

TEST_CASE("expect_same_on_all_ranks names the ranks that disagree") {
  auto comm = world();
  comm.expect_same_on_all_ranks("the layout", 42);
  std::uint64_t fingerprint = comm.rank() == 1 ? 7 : 42;
  CHECK_THROWS_WITH(comm.expect_same_on_all_ranks("the bucket plan", fingerprint),
                    Contains("ranks disagree about the bucket plan: ranks 1 differ"));
}

TEST_CASE("async all_reduce completes while the caller is busy and never calls MPI") {
  auto comm = world();
  // Large enough that the reduction takes a while, small enough for 8 ranks on 2 cores.
  std::vector<float> data(1 << 20, 1.0f);
  auto request = comm.all_reduce_async(data);
  // The caller stays out of MPI entirely: it only polls a clock and test(), which for a queued
  // collective reads an atomic flag. If progress depended on the caller entering MPI (as with
  // MPI_Iallreduce in Open MPI), this loop would time out.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool done = false;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    done = request.test();
  }
  REQUIRE(done);
  CHECK(data.front() == static_cast<float>(comm.size()));
  CHECK(data.back() == static_cast<float>(comm.size()));
}

TEST_CASE("async operations complete in issue order, and a blocking call queues behind them") {
  auto comm = world();
  std::vector<std::int64_t> a(1000, comm.rank()), b(1000, 1);
  auto r1 = comm.all_reduce_async(a, weft::reduce_op::max);
  auto r2 = comm.all_reduce_async(b);
  std::vector<std::int64_t> c(3, 2);
  comm.all_reduce(c, weft::reduce_op::prod);  // blocking, issued after two pending ones
  CHECK(r1.test());  // FIFO: everything issued before the blocking call is complete
  CHECK(r2.test());
  CHECK(a[999] == comm.size() - 1);
  CHECK(b[0] == comm.size());
  CHECK(c[0] == (std::int64_t{1} << comm.size()));
}

TEST_CASE("run_in_order runs host work between the operations issued around it, and reports its failure") {
  auto comm = world();
  std::vector<float> data(1 << 18, 1.0f);
  auto reduced = comm.all_reduce_async(data);
  // Queued behind the reduction: sees its result, and is seen by the reduction queued after it.
  std::atomic<float> seen{0.0f};
  auto epilogue = comm.native().run_in_order([&] {
    seen = data[7];
    for (float& x : data) x *= 0.5f;
  });
  auto again = comm.all_reduce_async(data);
  again.wait();
  CHECK(epilogue.test());
  CHECK(reduced.test());
  CHECK(seen.load() == static_cast<float>(comm.size()));
  CHECK(data[7] == 0.5f * static_cast<float>(comm.size() * comm.size()));
  auto failing = comm.native().run_in_order([] { throw weft::error("epilogue failed on purpose"); });
  CHECK_THROWS_WITH(failing.wait(), Contains("epilogue failed on purpose"));
  std::vector<int> one{1};
  comm.all_reduce(one);  // the communicator still works
  CHECK(one[0] == comm.size());
}

TEST_CASE("a dropped request waits for its operation, so buffers stay valid") {
  auto comm = world();
  std::vector<double> data(1 << 16, 1.0);
  {
    auto request = comm.all_reduce_async(data);
    // request goes out of scope unfinished: its destructor must wait, not leak or abandon.
  }
  CHECK(data[12345] == static_cast<double>(comm.size()));
  auto moved_from = comm.all_reduce_async(data);
  auto target = std::move(moved_from);
  target.wait();
  CHECK(data[0] == static_cast<double>(comm.size() * comm.size()));
}

TEST_CASE("split forms groups by color ordered by key, and leaves out negative colors") {
  auto comm = world();
  const int p = comm.size();
  // Two groups: even and odd world ranks, ordered by descending world rank.
  auto half_group = comm.split(comm.rank() % 2, p - comm.rank(), "parity");
  REQUIRE(half_group.has_value());
  CHECK(half_group->name() == "parity");
  std::vector<int> mine{comm.rank()};
  std::vector<int> members(static_cast<std::size_t>(half_group->size()));
  half_group->all_gather(mine, members);
  std::vector<int> expected;
  for (int r = p - 1; r >= 0; --r)
    if (r % 2 == comm.rank() % 2) expected.push_back(r);
  CHECK(members == expected);

  auto only_first = comm.split(comm.rank() == 0 ? 0 : -1, 0, "first");
  CHECK(only_first.has_value() == (comm.rank() == 0));
  if (only_first) CHECK(only_first->size() == 1);
}

TEST_CASE("stats count operations and payload bytes") {
  auto comm = world();
  std::vector<float> data(256);
  comm.all_reduce(data);
  auto request = comm.all_reduce_async(data);
  request.wait();
  CHECK(comm.stats().operations == 2);
  CHECK(comm.stats().bytes == 2 * 256 * sizeof(float));
}
