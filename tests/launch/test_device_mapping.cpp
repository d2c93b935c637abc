// GPU choice by local rank (the pure mapping; the CUDA side is in tests/nccl).
#include <catch2/catch.hpp>

#include <weft/launch/device.hpp>

using weft::device_for_local_rank;
using Catch::Contains;

TEST_CASE("local rank i uses device i when the node shows enough devices", "[launch][device]") {
  CHECK(device_for_local_rank(0, 4, 4) == 0);
  CHECK(device_for_local_rank(3, 4, 4) == 3);
  CHECK(device_for_local_rank(2, 3, 8) == 2);
}

TEST_CASE("one visible device per rank (per-task binding) is that device", "[launch][device]") {
  CHECK(device_for_local_rank(0, 1, 1) == 0);
  CHECK(device_for_local_rank(5, 8, 1) == 0);
}

TEST_CASE("too few devices, none, or a bad local rank are errors that say so", "[launch][device]") {
  CHECK_THROWS_WITH(device_for_local_rank(5, 8, 4),
                    Contains("local rank 5 of 8 on this node has no GPU of its own: 4 are visible"));
  CHECK_THROWS_WITH(device_for_local_rank(0, 2, 0), Contains("no GPU is visible to this process"));
  CHECK_THROWS_WITH(device_for_local_rank(2, 2, 4), Contains("local rank 2 is not within 0..1"));
}
