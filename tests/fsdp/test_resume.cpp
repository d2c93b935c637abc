// Resuming on a different number of ranks: a ZeRO-3 run saves its master parameters and AdamW
// moments as whole tensors (gathered from the shards), a run on half the ranks (or on one rank)
// cuts them into its own shards and goes on; after the same global batches the parameters equal
// those of unsharded data parallel that never stopped (an absolute 1e-12 per element in double).
#include <catch2/catch.hpp>

#include "training.hpp"

using namespace fsdp_test;
using weft::tune::sharding;

TEST_CASE("sharded state saved as whole tensors resumes on a different dp", "[fsdp][resume]") {
  auto dp = dp_world();
  const int k = 2, before = 2, after = 2;
  const auto reference = train_ddp(dp, before + after, k);

  // The first run, on every rank.
  std::vector<weft::fsdp::whole_tensor<double>> saved_params, saved_adam;
  {
    model_t<double> model(dp, {.level = sharding::full, .accumulation_steps = k, .reduce_dtype = weft::dtype::float64});
    register_units(model);
    load_initial(model);
    weft::fsdp::shard_adamw<double> adam(model, test_adam());
    train_steps(model, adam, 0, before, k, dp.rank(), dp.size());
    saved_params = model.gather_whole_params();
    saved_adam = adam.gather_whole(model);
  }
  REQUIRE(saved_params.size() == 2 * test_stack().layers());
  REQUIRE(saved_params[0].name == "layer0.weight");
  REQUIRE(saved_adam.size() == 4 * test_stack().layers() + 1);
  REQUIRE(saved_adam.back().name == "adamw.step");
  REQUIRE(saved_adam.back().values[0] == before);

  // The second run, on the first half of the ranks (at least one), with another shard layout
  // (other padding, too).
  const int resumed_ranks = std::max(1, dp.size() / 2);
  auto half = dp.split(dp.rank() < resumed_ranks ? 0 : -1, dp.rank(), "dp-resumed");
  if (half) {
    REQUIRE(half->size() == resumed_ranks);
    model_t<double> model(*half, {.level = sharding::full, .accumulation_steps = k,
                                  .reduce_dtype = weft::dtype::float64, .pad_elements = 3});
    register_units(model);
    model.reshard_params_from_whole(saved_params);
    weft::fsdp::shard_adamw<double> adam(model, test_adam());
    adam.reshard_from_whole(model, saved_adam);
    REQUIRE(adam.steps() == static_cast<std::size_t>(before));
    // The whole tensors come back unchanged through the new shards.
    const auto again = model.gather_whole_params();
    for (std::size_t t = 0; t < again.size(); ++t) REQUIRE(again[t].values == saved_params[t].values);
    train_steps(model, adam, before, after, k, half->rank(), half->size());
    const auto resumed = whole_params(model);
    require_within(resumed, reference, 1e-12);
  }
}

TEST_CASE("whole tensors that do not fit the model are refused", "[fsdp][resume][errors]") {
  auto dp = dp_world();
  model_t<double> model(dp, {});
  register_units(model);
  auto whole = model.gather_whole_params();
  whole.erase(whole.begin() + 3);
  REQUIRE_THROWS_WITH(model.reshard_params_from_whole(whole), Catch::Contains("no whole tensor named 'layer1.bias'"));
  weft::fsdp::shard_adamw<double> adam(model, test_adam());
  REQUIRE_THROWS_WITH(adam.reshard_from_whole(model, model.gather_whole_params()),
                      Catch::Contains("no whole tensor named 'exp_avg.layer0.weight'"));
}
