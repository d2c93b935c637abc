// A communicator's reference follows it through moves and names the group once it is gone; every
// operation passes the flight recorder with a sequence number, shape and state; the watchdog
// writes the dump on demand and on SIGUSR1.
#include <catch2/catch.hpp>

#include "world.hpp"

#include <weft/trace/flight_dump.hpp>
#include <weft/trace/watchdog.hpp>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <span>
#include <thread>
#include <vector>

using namespace weft_test;
using Catch::Matchers::Contains;

TEST_CASE("communicator_ref follows its communicator through moves and names the group once destroyed") {
  std::optional<mpi_comm> first(world());
  weft::communicator_ref<weft::mpi_backend> ref = first->ref();
  CHECK(ref.alive());
  CHECK(&ref.get() == &*first);
  std::vector<mpi_comm> moved;
  moved.push_back(std::move(*first));
  CHECK(&ref.get() == &moved.front());
  mpi_comm assigned = world();
  assigned = std::move(moved.front());
  CHECK(&ref.get() == &assigned);
  std::vector<int> one{1};
  ref.get().all_reduce(one);
  CHECK(one[0] == assigned.size());
  {
    mpi_comm last = std::move(assigned);
    CHECK(&ref.get() == &last);
  }
  CHECK_FALSE(ref.alive());
  CHECK_THROWS_WITH(ref.get(), Contains("communicator 'world'") && Contains("after it was destroyed"));
  CHECK_THROWS_WITH(weft::communicator_ref<weft::mpi_backend>().get(), Contains("empty communicator_ref"));
}

TEST_CASE("a p2p batch built before its communicator moved still runs, and fails clearly once it is gone") {
  std::optional<mpi_comm> comm(world());
  const int right = (comm->rank() + 1) % comm->size();
  const int left = (comm->rank() + comm->size() - 1) % comm->size();
  std::vector<int> out{comm->rank()}, in{-1};
  auto batch = comm->batch();
  batch.send(out, right).recv(in, left);
  mpi_comm moved = std::move(*comm);
  comm.reset();
  batch.run();
  CHECK(in[0] == left);
  auto orphan = moved.batch();
  { mpi_comm gone = std::move(moved); }
  CHECK_THROWS_WITH(orphan.send(out, right), Contains("communicator 'world'") && Contains("destroyed"));
}

TEST_CASE("the flight recorder numbers every operation and records its shape and state") {
  auto comm = world();
  const auto& recorder = comm.recorder();
  CHECK(recorder.issued() == 0);
  std::vector<float> data(8, 1.0f);
  comm.all_reduce(data, weft::reduce_op::max);
  comm.broadcast(data, 0);
  auto pending = comm.all_reduce_async(data);
  pending.wait();
  const int right = (comm.rank() + 1) % comm.size();
  const int left = (comm.rank() + comm.size() - 1) % comm.size();
  std::vector<double> out(3, 1.0), in(3);
  auto receive = comm.recv_async(in, left);
  comm.send(out, right);
  receive.wait();
  comm.barrier();

  const auto records = recorder.snapshot();
  REQUIRE(records.size() == 6);
  for (std::size_t i = 0; i < records.size(); ++i) {
    CHECK(records[i].sequence == i + 1);
    CHECK(records[i].state == weft::trace::op_state::completed);
    CHECK(records[i].issued_ns > 0);
    CHECK(records[i].ended_ns >= records[i].issued_ns);
  }
  CHECK(records[0].op == weft::trace::operation::all_reduce);
  CHECK(records[0].type == weft::dtype::float32);
  CHECK(records[0].count == 8);
  CHECK(records[0].reduction == static_cast<int>(weft::reduce_op::max));
  CHECK(records[1].op == weft::trace::operation::broadcast);
  CHECK(records[1].peer == 0);
  CHECK(records[2].op == weft::trace::operation::all_reduce);
  CHECK(records[3].op == weft::trace::operation::recv);
  CHECK(records[3].peer == left);
  CHECK(records[3].type == weft::dtype::float64);
  CHECK(records[4].op == weft::trace::operation::send);
  CHECK(records[5].op == weft::trace::operation::barrier);
  CHECK(recorder.collectives() == 4);
  CHECK(recorder.members().size() == static_cast<std::size_t>(comm.size()));
  CHECK(recorder.members()[static_cast<std::size_t>(comm.rank())] == comm.rank());  // world: identity
}

TEST_CASE("splits, agreements and the checks of a check level run as recorded operations, under the deadline") {
  auto comm = world();
  const auto& recorder = comm.recorder();
  auto half = comm.split(comm.rank() % 2, comm.rank(), "half");
  comm.expect_same_on_all_ranks("a test value", 42);
  const std::int64_t mine[2] = {comm.rank(), 7};
  std::vector<std::int64_t> all(2 * static_cast<std::size_t>(comm.size()));
  comm.host_all_gather(mine, all);
  for (int r = 0; r < comm.size(); ++r) CHECK(all[2 * static_cast<std::size_t>(r)] == r);
  // Under a check level the check's exchange runs inside the collective's own record: one record
  // per collective, as at the default level.
  std::vector<float> data(8, 1.0f);
  for (weft::check_level level : {weft::check_level::communication, weft::check_level::fingerprint}) {
    comm.set_checks(level);
    comm.all_reduce(data);
    auto pending = comm.all_reduce_async(data);
    pending.wait();
  }
  comm.set_checks(weft::check_level::local);
  const auto records = recorder.snapshot();
  REQUIRE(records.size() == 7);
  const weft::trace::operation expected[] = {weft::trace::operation::split,      weft::trace::operation::all_gather,
                                             weft::trace::operation::all_gather, weft::trace::operation::all_reduce,
                                             weft::trace::operation::all_reduce, weft::trace::operation::all_reduce,
                                             weft::trace::operation::all_reduce};
  for (std::size_t i = 0; i < records.size(); ++i) {
    INFO("record " << i);
    CHECK(records[i].op == expected[i]);
    CHECK(records[i].state == weft::trace::op_state::completed);
  }
  CHECK(records[1].type == weft::dtype::int64);
  CHECK(records[1].count == 1);
  CHECK(records[2].count == 2);
  CHECK(records[3].count == 8);
  CHECK(recorder.collectives() == 7);
  CHECK(data[0] == static_cast<float>(std::pow(comm.size(), 4)));
}

TEST_CASE("an async operation stays in flight until it completes, then is marked completed") {
  auto comm = world();
  std::vector<float> data(16, 1.0f);
  std::optional<mpi_comm::request> pending;
  if (comm.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others wait for rank 0
  pending.emplace(comm.all_reduce_async(data));
  if (comm.rank() != 0) CHECK(comm.recorder().oldest_unfinished().has_value());
  pending->wait();
  // Marked by the progress thread before the request completes.
  CHECK_FALSE(comm.recorder().oldest_unfinished().has_value());
  CHECK(comm.recorder().snapshot().back().state == weft::trace::op_state::completed);
}

TEST_CASE("timeouts come from WEFT_COMM_TIMEOUT, the constructor or set_timeout, and splits inherit them") {
  auto comm = world();
  CHECK(comm.timeout() == weft::comm_timeout_from_environment());
  comm.set_timeout(std::chrono::seconds(5));
  CHECK(comm.recorder().timeout() == std::chrono::seconds(5));
  auto half = comm.split(comm.rank() % 2, comm.rank(), "half");
  REQUIRE(half);
  CHECK(half->timeout() == std::chrono::seconds(5));
  CHECK(half->recorder().group() == "half");
  mpi_comm explicit_deadline(weft::mpi_backend::comm::world(), "short", weft::check_level::local,
                             std::chrono::milliseconds(1500));
  CHECK(explicit_deadline.timeout() == std::chrono::milliseconds(1500));
}

namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TEST_CASE("dumps on demand and on SIGUSR1 hold every communicator of the rank") {
  auto comm = world();
  auto other = world();
  std::vector<int> data(4, 1);
  comm.all_reduce(data);
  std::vector<int> gathered(static_cast<std::size_t>(comm.size()));
  other.all_gather(std::span<const int>(data.data(), 1), gathered);
  const auto dir = std::filesystem::temp_directory_path() /
                   ("weft-trace-test-" + std::to_string(static_cast<long>(getppid())) + "-" + std::to_string(comm.rank()));
  std::filesystem::create_directories(dir);
  setenv("WEFT_TRACE_DIR", dir.c_str(), 1);
  const std::string path = weft::trace::dump_flight_recorders();
  CHECK(path == (dir / ("weft-flight-" + std::to_string(comm.rank()) + ".json")).string());
  auto dump = weft::trace::parse_flight_dump(read_file(path));
  CHECK(dump.rank == comm.rank());
  CHECK(dump.reason == "request");
  bool found = false;
  for (const auto& group : dump.groups) {
    if (group.issued == 1 && group.entries.size() == 1 && group.entries[0].op == weft::trace::operation::all_reduce) found = true;
  }
  CHECK(found);

  std::filesystem::remove(path);
  std::raise(SIGUSR1);
  for (int i = 0; i < 200 && !std::filesystem::exists(path); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE(std::filesystem::exists(path));
  CHECK(weft::trace::parse_flight_dump(read_file(path)).reason == "signal");
  unsetenv("WEFT_TRACE_DIR");
  std::filesystem::remove_all(dir);
}
