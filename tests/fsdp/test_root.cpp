// An enclosing root unit (fsdp_options::enclosing_root): unit 0 holds parameters used at both ends
// of the model, as a tied embedding and output layer are in a language model. Here the root holds
// the layer stack's first and last layers, and units 1 and 2 the two middle ones; forward runs
// layer 0 and layer 3 inside the root's scope, around the middle units' scopes, and backward does
// the same in reverse. After several AdamW steps the parameters equal unsharded data parallel's
// (weft's gradient synchronizer) to an absolute 1e-12 per element in double, for ZeRO-3 and ZeRO-2,
// with and without accumulation; the communication order is the hand-written one; wrong nesting is
// refused.
#include <catch2/catch.hpp>

#include "training.hpp"

#include <string>
#include <vector>

using namespace fsdp_test;
using weft::fsdp::fsdp_options;
using weft::fsdp::pass;
using weft::fsdp::schedule_kind;
using weft::tune::sharding;

namespace {


constexpr std::size_t root = 0;

/// Unit 0: layers 0 and 3 (params 0-1: layer 0's weight, bias; 2-3: layer 3's); units 1, 2:
/// layers 1, 2.
void register_rooted(model_t<double>& model) {
  const layer_stack& net = test_stack();
  REQUIRE(net.layers() == 4);
  model.add_unit("ends", {{"layer0.weight", net.weight_count(0)}, {"layer0.bias", net.bias_count(0)},
                          {"layer3.weight", net.weight_count(3)}, {"layer3.bias", net.bias_count(3)}});
  model.add_unit("layer1", {{"weight", net.weight_count(1)}, {"bias", net.bias_count(1)}});
  model.add_unit("layer2", {{"weight", net.weight_count(2)}, {"bias", net.bias_count(2)}});
  model.freeze();
  auto load = [&](std::size_t unit, std::size_t first_param, std::size_t l) {
    std::vector<double> w(net.weight_count(l)), b(net.bias_count(l));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = net.initial_weight(l, i);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = net.initial_bias(l, i);
    model.load_whole(unit, first_param, w);
    model.load_whole(unit, first_param + 1, b);
  };
  load(root, 0, 0);
  load(root, 2, 3);
  load(1, 0, 1);
  load(2, 0, 2);
}

void rooted_micro_step(model_t<double>& model, const std::vector<std::size_t>& samples) {
  const layer_stack& net = test_stack();
  auto acts = net.begin(samples);
  std::vector<double> dy;
  {
    auto ends = model.forward(root);
    net.forward<double>(0, ends.param(0), ends.param(1), acts);
    for (std::size_t u = 1; u <= 2; ++u) {
      auto scope = model.forward(u);
      net.forward<double>(u, scope.param(0), scope.param(1), acts);
    }
    net.forward<double>(3, ends.param(2), ends.param(3), acts);
  }
  dy = net.output_gradient(samples, acts, 1.0 / static_cast<double>(samples.size()));
  auto ends = model.backward(root);
  dy = net.backward<double, double>(3, ends.param(2), acts, dy, ends.grad(2), ends.grad(3));
  for (std::size_t u = 2; u >= 1; --u) {
    auto scope = model.backward(u);
    dy = net.backward<double, double>(u, scope.param(0), acts, dy, scope.grad(0), scope.grad(1));
  }
  net.backward<double, double>(0, ends.param(0), acts, dy, ends.grad(0), ends.grad(1));
}

/// Whole parameters in train_ddp's order (layer by layer, weight then bias).
std::vector<double> rooted_whole(model_t<double>& model) {
  const auto whole = model.gather_whole_params();  // ends (layer 0, layer 3), layer1, layer2
  REQUIRE(whole.size() == 8);
  std::vector<double> out;
  for (std::size_t t : {0, 1, 4, 5, 6, 7, 2, 3}) out.insert(out.end(), whole[t].values.begin(), whole[t].values.end());
  return out;
}

}  // namespace

TEST_CASE("an enclosing root unit trains like unsharded data parallel", "[fsdp][root]") {
  auto dp = dp_world();
  const int steps = 4;
  for (int k : {1, 2}) {
    const auto reference = train_ddp(dp, steps, k);
    for (sharding level : {sharding::full, sharding::gradients}) {
      DYNAMIC_SECTION(weft::tune::to_string(level) << ", accumulation " << k) {
        model_t<double> model(dp, {.level = level, .enclosing_root = true, .accumulation_steps = k,
                                   .reduce_dtype = weft::dtype::float64});
        register_rooted(model);
        weft::fsdp::shard_adamw<double> adam(model, test_adam());
        for (int step = 0; step < steps; ++step) {
          for (int j = 0; j < k; ++j) {
            rooted_micro_step(model, samples_of(step, j, k, dp.rank(), dp.size()));
            REQUIRE(model.finish() == (j == k - 1));
          }
          adam.step(model);
          model.zero_grad();
        }
        const auto sharded = rooted_whole(model);
        require_within(sharded, reference, 1e-12);
      }
    }
  }
}

TEST_CASE("the root stays gathered around the other units, which prefetch as usual", "[fsdp][root][schedule]") {
  auto dp = dp_world();
  model_t<double> model(dp, {.level = sharding::full, .enclosing_root = true, .record_schedule = true});
  register_rooted(model);
  using namespace fsdp_test::events;
  const std::vector<schedule_step> expected = {
      // forward: the root first (prefetching unit 1), then units 1 and 2 inside it; the root is
      // not freed after its forward, unit 2 (the last) neither
      {F, issue, 0}, {F, issue, 1}, {F, waited, 0},
      {F, issue, 2}, {F, waited, 1}, {F, freed, 1},
      {F, waited, 2},
      // backward: the root begins first (unit 2 is still gathered, nothing to prefetch), unit 2
      // prefetches unit 1, unit 1 finds the root gathered; the root's gradients reduce last
      {Bk, issue, 1}, {Bk, reduce, 2}, {Bk, freed, 2},
      {Bk, waited, 1}, {Bk, reduce, 1}, {Bk, freed, 1},
      {Bk, reduce, 0}, {Bk, freed, 0}};
  for (int micro = 0; micro < 2; ++micro) {
    model.clear_schedule();
    rooted_micro_step(model, samples_of(0, micro, 2, dp.rank(), dp.size()));
    const std::string got = text(issued(model.schedule()));
    INFO(got);
    REQUIRE(got == text(expected));
    model.finish();
  }
}

TEST_CASE("the root's scope must enclose the others'", "[fsdp][root][errors]") {
  auto dp = dp_world();
  model_t<double> model(dp, {.level = sharding::full, .enclosing_root = true});
  register_rooted(model);
  REQUIRE_THROWS_WITH(model.forward(1), Catch::Contains("out of order: unit 'ends' (0) is next"));
  {
    auto ends = model.forward(root);
    REQUIRE(ends.param(0).size() == test_stack().weight_count(0));
    {
      auto one = model.forward(1);
      REQUIRE_THROWS_WITH(model.end_forward(root), Catch::Contains("end theirs first"));
    }
    REQUIRE_THROWS_WITH(model.end_forward(root), Catch::Contains("before the forward of unit 'layer2' (2)"));
    REQUIRE_THROWS_WITH(model.finish(), Catch::Contains("scope of the root unit"));
    model.forward(2).end();
    REQUIRE_THROWS_WITH(model.backward(2), Catch::Contains("inside the root unit's forward"));
  }
  REQUIRE_THROWS_WITH(model.backward(2), Catch::Contains("begin the backward of unit 'ends' (0) first"));
  {
    auto ends = model.backward(root);
    REQUIRE(ends.grad(0).size() == test_stack().weight_count(0));
    model.backward(2).end();
    REQUIRE_THROWS_WITH(model.end_backward(root), Catch::Contains("before the backward of unit 'layer1' (1)"));
    model.backward(1).end();
  }
  REQUIRE_THROWS_WITH(model.backward(root), Catch::Contains("or twice"));
  REQUIRE(model.finish());
  // A model without the option keeps units from nesting.
  model_t<double> flat(dp, {.level = sharding::full});
  register_units(flat);
  load_initial(flat);
  auto first = flat.forward(0);
  REQUIRE_THROWS_WITH(flat.forward(1), Catch::Contains("units do not nest"));
}
