// What a sharded model refuses, with the way out in the message: parameters touched outside a
// unit's scope, a prefetched unit used before its gather completed, units out of order, nested
// scopes, shard layouts or options that differ across ranks (checked by fingerprint), sharding
// levels it does not run, a unit skipped in backward. After each refusal the model is still usable
// (every rank issued the same collectives), which the tests show by finishing a clean step.
#include <catch2/catch.hpp>

#include "training.hpp"

using namespace fsdp_test;
using weft::fsdp::fsdp_options;
using weft::tune::sharding;

namespace {


void clean_step(model_t<double>& model) {
  micro_step(model, samples_of(0, 0, 1, model.shard_group().rank(), model.shard_group().size()));
  REQUIRE(model.finish());
}

}  // namespace

TEST_CASE("parameters touched outside their unit's scope are refused", "[fsdp][errors]") {
  auto dp = dp_world();
  model_t<double> model(dp, {});
  register_units(model);
  load_initial(model);
  REQUIRE_THROWS_WITH(model.param(0, 0), Catch::Contains("touched outside the unit's forward or backward scope") &&
                                             Catch::Contains("sharded now"));
  {
    auto scope = model.forward(0);
    REQUIRE(scope.param(0).size() == test_stack().weight_count(0));
    // Unit 1 was prefetched: its gather is in flight until its own scope waits for it.
    REQUIRE_THROWS_WITH(model.param(1, 0), Catch::Contains("used before its all-gather completed"));
    REQUIRE_THROWS_WITH(scope.grad(0), Catch::Contains("gradients exist only inside backward"));
  }
  // Unit 0 was freed after its forward.
  REQUIRE_THROWS_WITH(model.param(0, 1), Catch::Contains("touched outside"));
  for (std::size_t u = 1; u < 4; ++u) model.forward(u).end();
  for (std::size_t u = 4; u-- > 0;) model.backward(u).end();
  REQUIRE(model.finish());
  clean_step(model);
}

TEST_CASE("units out of order, nested scopes and misplaced calls are refused", "[fsdp][errors]") {
  auto dp = dp_world();
  model_t<double> model(dp, {});
  register_units(model);
  load_initial(model);
  REQUIRE_THROWS_WITH(model.forward(1), Catch::Contains("out of order: unit 'layer0' (0) is next"));
  REQUIRE_THROWS_WITH(model.backward(3), Catch::Contains("run every unit's forward first"));
  {
    auto scope = model.forward(0);
    REQUIRE_THROWS_WITH(model.forward(1), Catch::Contains("units do not nest"));
    REQUIRE_THROWS_WITH(model.finish(), Catch::Contains("end the scope first"));
    REQUIRE_THROWS_WITH(model.shard_params(0), Catch::Contains("in the middle of a micro-step"));
    REQUIRE_THROWS_WITH(model.zero_grad(), Catch::Contains("after finish()"));
  }
  for (std::size_t u = 1; u < 4; ++u) model.forward(u).end();
  REQUIRE_THROWS_WITH(model.forward(0), Catch::Contains("after every unit's forward"));
  REQUIRE_THROWS_WITH(model.backward(1), Catch::Contains("out of order: unit 'layer3' (3) is next"));
  for (std::size_t u = 4; u-- > 0;) model.backward(u).end();
  REQUIRE(model.finish());
  clean_step(model);
}

TEST_CASE("a unit skipped in backward is reduced as zeros and named", "[fsdp][errors]") {
  auto dp = dp_world();
  model_t<double> model(dp, {.level = sharding::full});
  register_units(model);
  load_initial(model);
  for (std::size_t u = 0; u < 4; ++u) model.forward(u).end();
  model.backward(3).end();
  model.backward(2).end();
  REQUIRE_THROWS_WITH(model.finish(), Catch::Contains("2 of 4 units not run backward") &&
                                          Catch::Contains("'layer1' (1), 'layer0' (0)"));
  for (double g : model.shard_grads(0)) REQUIRE(g == 0.0);
  model.zero_grad();
  clean_step(model);
}

// A last micro-step that fails (a unit skipped in backward) still ends the window as it does on a
// GPU, where the scale is folded into the reductions: the shards hold the scaled sums, and the
// token count is used up, so the next window cannot run on a stale one.
TEST_CASE("a failed last micro-step scales the shards and uses up the token count", "[fsdp][errors]") {
  auto dp = dp_world();
  const int rank = dp.rank();
  const int ranks = dp.size();
  const layer_stack& net = test_stack();
  // Forward of every unit, backward of units 3 and 2 only.
  auto failed_step = [&](model_t<double>& model) {
    register_units(model);
    load_initial(model);
    const std::vector<std::size_t> samples = samples_of(0, 0, 1, rank, ranks);
    auto acts = net.begin(samples);
    for (std::size_t l = 0; l < net.layers(); ++l) {
      auto scope = model.forward(l);
      net.forward<double>(l, scope.param(0), scope.param(1), acts);
    }
    auto dy = net.output_gradient(samples, acts, 1.0 / static_cast<double>(samples.size()));
    for (std::size_t l : {std::size_t{3}, std::size_t{2}}) {
      auto scope = model.backward(l);
      dy = net.backward<double, double>(l, scope.param(0), acts, dy, scope.grad(0), scope.grad(1));
    }
    REQUIRE_THROWS_WITH(model.finish(), Catch::Contains("2 of 4 units not run backward"));
  };
  model_t<double> sums(dp, {.scale = weft::grad::scaling::sum});
  failed_step(sums);
  model_t<double> per_token(dp, {.scale = weft::grad::scaling::token_count});
  per_token.set_token_count(8);
  failed_step(per_token);
  // Whole gradients (the same on every rank: a rank's shard may be padding alone).
  const auto sum = sums.gather_whole([&](std::size_t u) { return sums.shard_grads(u); });
  const auto scaled = per_token.gather_whole([&](std::size_t u) { return per_token.shard_grads(u); });
  REQUIRE(scaled.size() == sum.size());
  bool nonzero = false;
  for (std::size_t t = 0; t < sum.size(); ++t) {
    REQUIRE(scaled[t].values.size() == sum[t].values.size());
    for (std::size_t i = 0; i < sum[t].values.size(); ++i) {
      nonzero = nonzero || sum[t].values[i] != 0.0;
      REQUIRE(scaled[t].values[i] == sum[t].values[i] / 8);  // 1/8 is exact in double
    }
  }
  REQUIRE(nonzero);
  per_token.zero_grad();
  micro_step(per_token, samples_of(1, 0, 1, rank, ranks));
  REQUIRE_THROWS_WITH(per_token.finish(), Catch::Contains("set_token_count() was not called"));
  per_token.set_token_count(4);
  micro_step(per_token, samples_of(2, 0, 1, rank, ranks));
  REQUIRE(per_token.finish());
}

TEST_CASE("an exception inside a unit's scope closes it without communicating", "[fsdp][errors]") {
  auto dp = dp_world();
  model_t<double> model(dp, {});
  register_units(model);
  load_initial(model);
  for (std::size_t u = 0; u < 4; ++u) model.forward(u).end();
  REQUIRE_THROWS_WITH(([&] {
                        auto scope = model.backward(3);
                        throw std::runtime_error("backward kernel failed");
                      }()),
                      "backward kernel failed");
  // Unit 3's reduction was never issued; finish() reduces zeros for every skipped unit and says so.
  REQUIRE_THROWS_WITH(model.finish(), Catch::Contains("4 of 4 units not run backward"));
  model.zero_grad();
  clean_step(model);
}

TEST_CASE("shard layouts or options that differ across ranks are refused on every rank", "[fsdp][errors]") {
  auto dp = dp_world();
  {
    model_t<double> model(dp, {});
    model.add_unit("a", {{"w", dp.rank() == 0 ? std::size_t{10} : std::size_t{11}}});
    REQUIRE_THROWS_WITH(model.freeze(), Catch::Contains("ranks disagree about the fsdp shard layout") &&
                                            Catch::Contains("ranks 1"));
  }
  {
    model_t<double> model(dp, {.reshard_after_forward = dp.rank() != 0});
    model.add_unit("a", {{"w", 10}});
    REQUIRE_THROWS_WITH(model.freeze(), Catch::Contains("ranks disagree about the fsdp options"));
  }
}

TEST_CASE("sharding levels and types the model does not run are refused", "[fsdp][errors]") {
  auto dp = dp_world();
  REQUIRE_THROWS_WITH(model_t<double>(dp, {.level = sharding::optimizer}),
                      Catch::Contains("weft::grad::synchronizer for none and optimizer"));
  REQUIRE_THROWS_WITH(model_t<double>(dp, {.level = sharding::none}), Catch::Contains("sharding::full (ZeRO-3)"));
  REQUIRE_THROWS_WITH(model_t<float>(dp, {.reduce_dtype = weft::dtype::float16}),
                      Catch::Contains("reduce_dtype = half is not offered"));
  REQUIRE_THROWS_WITH(model_t<double>(dp, {.accumulation_steps = 0}), Catch::Contains("at least 1"));
  model_t<double> model(dp, {});
  REQUIRE_THROWS_WITH(model.forward(0), Catch::Contains("before freeze()"));
  model.add_unit("a", {{"w", 4}});
  model.freeze();
  REQUIRE_THROWS_WITH(model.add_unit("b", {{"w", 4}}), Catch::Contains("after freeze()"));
  REQUIRE_THROWS_WITH(model.load_whole(0, 0, std::vector<double>(5)), Catch::Contains("has 4 elements; 5 were given"));
  REQUIRE_THROWS_WITH(model.set_token_count(10), Catch::Contains("needs scaling::token_count"));
}
