// The pipeline executor compiles for NCCL (every member, on device buffers the caller allocates);
// the multi-rank tests run it over MPI, the same template.
#include <catch2/catch.hpp>

#include <weft/backend/nccl/backend.hpp>
#include <weft/core/float16.hpp>
#include <weft/pipeline/executor.hpp>

#include <type_traits>

template class weft::pipeline::executor<weft::nccl_backend, float>;
template class weft::pipeline::executor<weft::nccl_backend, weft::bfloat16>;

TEST_CASE("the pipeline executor is instantiated for NCCL", "[pipeline][nccl]") {
  using exec = weft::pipeline::executor<weft::nccl_backend, float>;
  STATIC_REQUIRE(!std::is_copy_constructible_v<exec>);
  STATIC_REQUIRE(std::is_move_constructible_v<exec>);
  // Buffers come from the caller (device memory): the option is there for NCCL.
  weft::pipeline::executor_options<float> options{.elements = 8};
  REQUIRE(!options.allocate);
}
