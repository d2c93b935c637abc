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
