#include <catch2/catch.hpp>

#include <weft/core/error.hpp>

#include <cstdlib>

TEST_CASE("backend_error carries library, code, message, call, location, rank and host") {
  setenv("OMPI_COMM_WORLD_RANK", "7", 1);
  int line = 0;
  try {
    line = __LINE__ + 1;
    throw weft::backend_error(weft::backend_library::nccl, 5, "invalid usage", "ncclAllReduce(x)", std::source_location::current(), "group 'tp'");
  } catch (const weft::backend_error& e) {
    CHECK(e.library() == weft::backend_library::nccl);
    CHECK(e.code() == 5);
    CHECK(e.call() == "ncclAllReduce(x)");
    CHECK(e.rank() == 7);
    CHECK(e.location().line() == static_cast<unsigned>(line));
    CHECK(!e.host().empty());
    std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("NCCL error 5 (invalid usage)"));
    CHECK_THAT(what, Catch::Contains("on rank 7"));
    CHECK_THAT(what, Catch::Contains("test_errors.cpp"));
    CHECK_THAT(what, Catch::Contains("group 'tp'"));
  }
  unsetenv("OMPI_COMM_WORLD_RANK");
}

TEST_CASE("weft::fail prefixes the rank when known") {
  weft::detail::known_world_rank().store(3);
  CHECK_THROWS_WITH(weft::fail("bad sizes"), "weft: rank 3: bad sizes");
  weft::detail::known_world_rank().store(-1);
}

TEST_CASE("backend_error::during names the operation in weft's words and keeps the innermost one") {
  weft::detail::known_world_rank().store(1);
  const weft::backend_error raw(weft::backend_library::mpi, 15, "MPI_ERR_TRUNCATE: message truncated",
                                "MPI_Allreduce(source, recv, count, ...)", std::source_location::current());
  const std::string operation = weft::detail::operation_text("all_reduce", "tp", 1, 2, 1000, "float");
  CHECK(operation == "all_reduce on group 'tp' (rank 1 of 2, 1000 x float)");
  const weft::backend_error named = raw.during(operation);
  const std::string what = named.what();
  CHECK_THAT(what, Catch::StartsWith("weft: rank 1: all_reduce on group 'tp' (rank 1 of 2, 1000 x float) failed: "
                                     "MPI_ERR_TRUNCATE: message truncated (MPI error 15, host "));
  CHECK_THAT(what, !Catch::Contains("MPI_Allreduce") && !Catch::Contains("test_errors.cpp"));
  CHECK(named.call() == raw.call());
  CHECK(named.code() == 15);
  CHECK(named.operation() == operation);
  // An outer wrapper does not rename what the inner one named.
  CHECK(std::string(named.during("barrier on group 'world' (rank 1 of 2)").what()) == what);
  CHECK(weft::detail::operation_text("send", "pp", 0, 2, 5, "half", "peer", 1) ==
        "send on group 'pp' (rank 0 of 2, 5 x half, peer 1)");
  CHECK(weft::detail::operation_text("barrier", "world", 0, 4, 0, "uint8") == "barrier on group 'world' (rank 0 of 4)");
  weft::detail::known_world_rank().store(-1);
}
