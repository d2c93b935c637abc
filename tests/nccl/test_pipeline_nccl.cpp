// The pipeline executor compiles for NCCL (every member, on device buffers the caller allocates),
// and refuses receives posted ahead there; the multi-rank tests run it over MPI, the same template.
#include <catch2/catch.hpp>

#include <weft/backend/nccl/backend.hpp>
#include <weft/core/float16.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/schedules.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

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

namespace {

// What each of two stages contributes to the executor's agreement, for a gpipe table on 2 stages.
std::vector<std::int64_t> agreement(const weft::pipeline::schedule& s, int prefetch_stage0, int prefetch_stage1) {
  namespace d = weft::pipeline::detail;
  std::vector<std::int64_t> all;
  for (int prefetch : {prefetch_stage0, prefetch_stage1}) {
    std::vector<std::int64_t> mine(d::executor_fields, 0);
    mine[d::field_group_size] = 2;
    mine[d::field_kind] = static_cast<std::int64_t>(s.kind);
    mine[d::field_stages] = s.stages;
    mine[d::field_micro_batches] = s.micro_batches;
    mine[d::field_virtual_stages] = s.virtual_stages;
    mine[d::field_split] = s.split_backward ? 1 : 0;
    mine[d::field_fingerprint] = static_cast<std::int64_t>(d::fingerprint(s));
    mine[d::field_elements] = 8;
    mine[d::field_dtype] = static_cast<std::int64_t>(weft::dtype::float32);
    mine[d::field_callbacks] = d::has_forward | d::has_backward;
    mine[d::field_prefetch] = prefetch;
    all.insert(all.end(), mine.begin(), mine.end());
  }
  return all;
}

}  // namespace

TEST_CASE("on NCCL, receives posted ahead are refused: they queue before the stage's later sends",
          "[pipeline][nccl]") {
  namespace wp = weft::pipeline;
  const wp::schedule s = wp::make_schedule({.kind = wp::schedule_kind::gpipe, .stages = 2, .micro_batches = 2});
  // The default on device buffers posts only the current action's receives: accepted.
  CHECK(wp::detail::executor_problems(s, agreement(s, 0, 0), "pp", true).empty());
  // One stage posting ahead is refused, naming the stage and the way out.
  const auto problems = wp::detail::executor_problems(s, agreement(s, 0, 1), "pp", true);
  REQUIRE(problems.size() == 1);
  CHECK_THAT(problems[0], Catch::Contains("stage 1 posts receives 1 action(s) ahead") &&
                              Catch::Contains("prefetch = 0"));
  // Over MPI (progress independent of call order) the same prefetch is fine.
  CHECK(wp::detail::executor_problems(s, agreement(s, 1, 1), "pp", false).empty());
}
