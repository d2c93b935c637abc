// Resuming on a different number of ranks: a ZeRO-3 run saves its master parameters and AdamW
// moments as whole tensors (gathered from the shards), a run on half the ranks (or on one rank)
// cuts them into its own shards and goes on; after the same global batches the parameters equal
// those of unsharded data parallel that never stopped (an absolute 1e-12 per element in double).
// Layers grouped into units by a measured or given cap train the same, and their whole tensors
// have the names they have ungrouped.
#include <catch2/catch.hpp>

#include "training.hpp"

#include <weft/fsdp/unit_grouping.hpp>
#include <weft/fsdp/unit_sizing.hpp>

#include <bit>
#include <cstdint>

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

namespace {

// One micro-step of the stack with its layers grouped into units: each unit's scope runs its layers.
void grouped_micro_step(model_t<double>& model, const weft::fsdp::layer_grouping& g,
                        const std::vector<std::size_t>& samples) {
  const layer_stack& net = test_stack();
  auto acts = net.begin(samples);
  for (std::size_t u = 0; u < g.units.size(); ++u) {
    auto scope = model.forward(u);
    const auto [first, last] = g.layers_of(u);
    for (std::size_t l = first; l <= last; ++l) {
      const std::size_t p = g.layers[l].first_param;
      net.forward<double>(l, scope.param(p), scope.param(p + 1), acts);
    }
  }
  auto dy = net.output_gradient(samples, acts, 1.0 / static_cast<double>(samples.size()));
  for (std::size_t u = g.units.size(); u-- > 0;) {
    auto scope = model.backward(u);
    const auto [first, last] = g.layers_of(u);
    for (std::size_t l = last + 1; l-- > first;) {
      const std::size_t p = g.layers[l].first_param;
      dy = net.backward<double, double>(l, scope.param(p), acts, dy, scope.grad(p), scope.grad(p + 1));
    }
  }
}

}  // namespace

TEST_CASE("layers grouped into units by a measured or given cap train as data parallel, under the same names",
          "[fsdp][resume][grouping]") {
  auto dp = dp_world();
  const layer_stack& net = test_stack();
  std::vector<weft::fsdp::unit_spec> layers;
  std::vector<weft::fsdp::whole_tensor<double>> initial;
  for (std::size_t l = 0; l < net.layers(); ++l) {
    layers.push_back({net.name(l), {{"weight", net.weight_count(l)}, {"bias", net.bias_count(l)}}});
    std::vector<double> w(net.weight_count(l)), b(net.bias_count(l));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = net.initial_weight(l, i);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = net.initial_bias(l, i);
    initial.push_back({net.name(l) + ".weight", w});
    initial.push_back({net.name(l) + ".bias", b});
  }
  const int k = 2, steps = 2;
  const auto reference = train_ddp(dp, steps, k);

  // The stack's layers are 504, 560, 512 and 216 bytes of double: sizes from 64 bytes up to the
  // whole 1792 are timed.
  const weft::grad::probe_options probe{.smallest_bytes = 64, .budget_s = 0.05, .repeats = 2, .run_bytes = 1024};
  const auto measured =
      weft::fsdp::choose_unit_bytes<double>(dp, std::span<const weft::fsdp::unit_spec>(layers),
                                            weft::grad::measured_bucket_bytes, probe);
  REQUIRE_FALSE(measured.curve.empty());
  // The rule, checked on the curve: the largest size within 5 % of the best bandwidth.
  double best = 0;
  for (const auto& point : measured.curve) best = std::max(best, point.bandwidth());
  std::size_t largest = 0;
  for (const auto& point : measured.curve)
    if (point.bandwidth() >= 0.95 * best) largest = std::max(largest, point.bytes);
  REQUIRE(measured.bucket_bytes == largest);
  // Every rank holds the same curve (each size's slowest rank), so every rank groups alike.
  std::uint64_t curve_hash = measured.bucket_bytes;
  for (const auto& point : measured.curve)
    curve_hash = curve_hash * 1000003 ^ point.bytes ^ std::bit_cast<std::uint64_t>(point.seconds);
  CHECK_NOTHROW(dp.expect_same_on_all_ranks("the measured unit curve", curve_hash));
  // A given cap is taken as it is, nothing timed: 1100 bytes groups layers 0 + 1 and 2 + 3.
  const auto given = weft::fsdp::choose_unit_bytes<double>(dp, std::span<const weft::fsdp::unit_spec>(layers), 1100);
  REQUIRE(given.curve.empty());
  REQUIRE(given.bucket_bytes == 1100);
  REQUIRE(weft::fsdp::group_layers(layers, weft::dtype::float64, 1100).units.size() == 2);

  for (const std::size_t cap : {given.bucket_bytes, measured.bucket_bytes}) {
    INFO("unit cap " << cap << " bytes");
    const auto g = weft::fsdp::group_layers(layers, weft::dtype::float64, cap);
    model_t<double> model(dp, {.level = sharding::full, .accumulation_steps = k, .reduce_dtype = weft::dtype::float64});
    for (const auto& unit : g.units) model.add_unit(unit);
    model.freeze();
    model.reshard_params_from_whole(initial);
    weft::fsdp::shard_adamw<double> adam(model, test_adam());
    for (int step = 0; step < steps; ++step) {
      for (int j = 0; j < k; ++j) {
        grouped_micro_step(model, g, samples_of(step, j, k, dp.rank(), dp.size()));
        REQUIRE(model.finish() == (j == k - 1));
      }
      adam.step(model);
      model.zero_grad();
    }
    const auto whole = model.gather_whole_params();
    REQUIRE(whole.size() == initial.size());
    for (std::size_t t = 0; t < whole.size(); ++t) REQUIRE(whole[t].name == initial[t].name);
    require_within(whole_params(model), reference, 1e-12);
  }
}
