// The order of a sharded model's communication: the next unit's all-gather is issued before the
// current unit's is waited for (forward order in forward, reverse order in backward), a unit's
// gradients are reduce-scattered as soon as its backward ends, gathered copies are freed when the
// options say, and ZeRO-2 gathers only after the optimizer changed the shards. Each expected
// sequence is written out by hand from those rules.
#include <catch2/catch.hpp>

#include "training.hpp"

#include <vector>

using namespace fsdp_test;
using weft::fsdp::fsdp_options;
using weft::fsdp::pass;
using weft::fsdp::schedule_kind;
using weft::tune::sharding;

namespace {

using namespace fsdp_test::events;

std::vector<schedule_step> run_one_micro_step(model_t<double>& model) {
  model.clear_schedule();
  micro_step(model, samples_of(0, 0, 1, model.shard_group().rank(), model.shard_group().size()));
  auto out = issued(model.schedule());
  // Every reduction issued was also seen complete, once, by finish().
  std::size_t issued_reductions = 0;
  for (const auto& s : out) issued_reductions += s.kind == reduce;
  model.finish();
  std::size_t done = 0;
  for (const auto& e : model.schedule()) done += e.kind == schedule_kind::reduce_done;
  REQUIRE(done == issued_reductions);
  return out;
}

}  // namespace

TEST_CASE("ZeRO-3 prefetches the next unit's gather in forward and backward order", "[fsdp][schedule]") {
  auto dp = dp_world();
  model_t<double> model(dp, {.level = sharding::full, .record_schedule = true});
  register_units(model);
  load_initial(model);
  REQUIRE(model.unit_count() == 4);
  const std::vector<schedule_step> expected = {
      // forward: unit u's gather waited for after unit u+1's was issued; freed after its forward
      {F, issue, 0}, {F, issue, 1}, {F, waited, 0}, {F, freed, 0},
      {F, issue, 2}, {F, waited, 1}, {F, freed, 1},
      {F, issue, 3}, {F, waited, 2}, {F, freed, 2},
      {F, waited, 3},  // the last unit stays gathered: its backward follows at once
      // backward: unit u-1's gather issued before unit u computes; u's gradients reduced after it
      {Bk, issue, 2}, {Bk, reduce, 3}, {Bk, freed, 3},
      {Bk, issue, 1}, {Bk, waited, 2}, {Bk, reduce, 2}, {Bk, freed, 2},
      {Bk, issue, 0}, {Bk, waited, 1}, {Bk, reduce, 1}, {Bk, freed, 1},
      {Bk, waited, 0}, {Bk, reduce, 0}, {Bk, freed, 0}};
  const auto first = run_one_micro_step(model);
  INFO(text(first));
  REQUIRE(text(first) == text(expected));
  // The next micro-step does the same (nothing left gathered, nothing left in flight).
  REQUIRE(text(run_one_micro_step(model)) == text(expected));
}

TEST_CASE("ZeRO-3 without prefetch waits for each gather right after issuing it", "[fsdp][schedule]") {
  auto dp = dp_world();
  model_t<double> model(dp, {.level = sharding::full, .reshard_after_forward = false, .prefetch = false,
                             .record_schedule = true});
  register_units(model);
  load_initial(model);
  const std::vector<schedule_step> expected = {
      {F, issue, 0}, {F, waited, 0}, {F, issue, 1}, {F, waited, 1},
      {F, issue, 2}, {F, waited, 2}, {F, issue, 3}, {F, waited, 3},
      // kept after forward: backward gathers nothing
      {Bk, reduce, 3}, {Bk, freed, 3}, {Bk, reduce, 2}, {Bk, freed, 2},
      {Bk, reduce, 1}, {Bk, freed, 1}, {Bk, reduce, 0}, {Bk, freed, 0}};
  const auto got = run_one_micro_step(model);
  INFO(text(got));
  REQUIRE(text(got) == text(expected));
}

TEST_CASE("ZeRO-2 gathers once after each optimizer step, and only the units that changed", "[fsdp][schedule]") {
  auto dp = dp_world();
  model_t<double> model(dp, {.level = sharding::gradients, .record_schedule = true});
  register_units(model);
  load_initial(model);
  const std::vector<schedule_step> first_expected = {
      {F, issue, 0}, {F, issue, 1}, {F, waited, 0}, {F, issue, 2}, {F, waited, 1},
      {F, issue, 3}, {F, waited, 2}, {F, waited, 3},
      {Bk, reduce, 3}, {Bk, reduce, 2}, {Bk, reduce, 1}, {Bk, reduce, 0}};
  auto got = run_one_micro_step(model);
  INFO(text(got));
  REQUIRE(text(got) == text(first_expected));
  // No optimizer step: the parameters are current, nothing is gathered.
  const std::vector<schedule_step> steady = {{Bk, reduce, 3}, {Bk, reduce, 2}, {Bk, reduce, 1}, {Bk, reduce, 0}};
  REQUIRE(text(run_one_micro_step(model)) == text(steady));
  // The optimizer changed units 1 and 3 only: they are gathered again, with prefetch.
  (void)model.shard_params(1);
  (void)model.shard_params(3);
  const std::vector<schedule_step> after_update = {
      {F, issue, 1}, {F, waited, 1}, {F, issue, 3}, {F, waited, 3},
      {Bk, reduce, 3}, {Bk, reduce, 2}, {Bk, reduce, 1}, {Bk, reduce, 0}};
  got = run_one_micro_step(model);
  INFO(text(got));
  REQUIRE(text(got) == text(after_update));
}
