// Mixtures of experts in the tuner: the cost terms of an MoE layer against hand computation for a
// small model (FLOPs with top-k of E experts active, the all-to-all's bytes and time, expert weights
// and optimizer state per rank), Megatron-Core's expert-parallel rules in the search, bad input,
// and the published MoE runs (tests/tune/data/published_runs_moe.csv) within the documented error.

#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>

#include <weft/tune/published_runs.hpp>
#include <weft/tune/report.hpp>

using namespace weft::tune;
using Catch::Detail::Approx;

namespace {

// 4 experts of a plain (ungated) MLP, top-2, every layer an MoE layer.
const model_desc small_moe{.layers = 2, .hidden = 64, .heads = 4, .ffn = 128, .vocab = 100, .seq = 32,
                           .experts = 4, .top_k = 2};

// 8 GPUs in nodes of `per_node`, H100-like, with round numbers for the links.
cluster_desc cluster_of_nodes(int per_node, int gpus = 8) {
  return {.gpu = *gpu_preset("H100"),
          .node = {.gpus_per_node = per_node, .intra_bandwidth = 400e9, .intra_latency = 1e-6,
                   .network_bandwidth = 25e9, .network_latency = 4e-6},
          .nodes = gpus / per_node};
}

}  // namespace

TEST_CASE("MoE FLOPs count the router and the top-k experts a token runs, not the others") {
  const double h = 64, f = 128, e = 4, k = 2, s = 32, v = 100, l = 2;
  // Per token and layer, forward: Q, K, V, output (4 h^2), router (h e), k experts of 2 h f.
  const double layer = 2 * (4 * h * h + h * e + k * 2 * h * f);
  CHECK(layer_matmul_flops_per_token(small_moe) == Approx(layer));
  CHECK(model_flops_per_token(small_moe) == Approx(3 * (l * (layer + 4 * s * h) + 2 * h * v)));
  // Parameters hold every expert: 4 h^2 + h e + e 2 h f + 4 h per layer, embedding and output.
  CHECK(param_count(small_moe) == Approx(l * (4 * h * h + h * e + e * 2 * h * f + 4 * h) + 2 * v * h));
  CHECK(expert_params_per_layer(small_moe) == Approx(e * 2 * h * f));

  // Every other layer an MoE layer (i % 2 == 0: layers 0 and 2 of 4), gated experts of 32, one
  // shared expert: the dense layers keep their MLP of 128.
  model_desc mixed = small_moe;
  mixed.layers = 4;
  mixed.moe_every = 2;
  mixed.swiglu = true;
  mixed.expert_ffn = 32;
  mixed.shared_experts = 1;
  CHECK(moe_layer_count(mixed) == 2);
  const double dense = 2 * (4 * h * h + 3 * h * f);
  const double moe = 2 * (4 * h * h + h * e + (k + 1) * 3 * h * 32);
  CHECK(layer_matmul_flops_per_token(mixed) == Approx((2 * dense + 2 * moe) / 4));
  mixed.layers = 5;  // layers 0, 2, 4
  CHECK(moe_layer_count(mixed) == 3);
}

TEST_CASE("the all-to-all moves the routed copies to the other ep - 1 ranks, over NVLink or the network") {
  const int b = 2, ep = 4;
  const double routed = 2.0 * 32 * 2;  // b s k copies of a token on this GPU (tp = 1)
  const double sent = 2 * routed * 64 * (ep - 1) / ep;  // bf16, all but the own share
  SECTION("inside a node") {
    const cluster_desc c = cluster_of_nodes(8);
    const detail::evaluator ev(small_moe, c, {.global_batch = 16}, {}, default_calibration);
    const detail::layer_costs costs = ev.costs(1, 1, false, b, ep, 1);
    CHECK(costs.all_to_all_bytes == Approx(sent));
    const double nvlink = 400e9 / 2 * default_calibration.link_efficiency;
    CHECK(costs.all_to_all == Approx(sent / nvlink + (ep - 1) * 1e-6));
    // 4 per MoE layer and micro-batch, on the critical path: 2 layers x 4 micro-batches (dp 2).
    const plan p = evaluate(small_moe, c, {.global_batch = 16},
                            {.parallel = {.ep = ep, .dp = 8}, .micro_batch = 1});
    const detail::layer_costs one = ev.costs(1, 1, false, 1, ep, 1);
    CHECK(p.time.ep_comm == Approx(2 * 4 * one.all_to_all * 2));
    CHECK(p.time.step == Approx(p.time.compute + p.time.tp_comm + p.time.cp_comm + p.time.ep_comm + p.time.pp_comm +
                                p.time.bubble + p.time.dp_comm + p.time.optimizer));
  }
  SECTION("across nodes of 2: two of the three other members are in other nodes") {
    const cluster_desc c = cluster_of_nodes(2);
    const detail::evaluator ev(small_moe, c, {.global_batch = 16}, {}, default_calibration);
    const detail::layer_costs costs = ev.costs(1, 1, false, b, ep, 1);
    const double nvlink = 400e9 / 2 * default_calibration.link_efficiency;
    const double network = 25e9 * default_calibration.link_efficiency;
    CHECK(costs.all_to_all == Approx(std::max(sent / 3 / nvlink, sent * 2 / 3 / network) + (ep - 1) * 4e-6));
  }
  SECTION("no expert parallelism, no all-to-all") {
    const detail::evaluator ev(small_moe, cluster_of_nodes(8), {.global_batch = 16}, {}, default_calibration);
    CHECK(ev.costs(1, 1, false, b, 1, 1).all_to_all == 0);
  }
}

TEST_CASE("expert weights and their optimizer state per rank: split by ep x expert-tp, sharded over expert dp") {
  const cluster_desc c = cluster_of_nodes(8);
  const double h = 64, f = 128, e = 4;
  const double experts = 2 * e * 2 * h * f;                       // both layers' routed experts
  const double dense = param_count(small_moe) - experts;          // everything else
  auto state = [](const plan& p) { return p.memory.weights + p.memory.gradients + p.memory.optimizer; };
  // ep 4 of dp 8: each rank holds a quarter of the experts; expert dp = 8 / 4 = 2.
  const plan none = evaluate(small_moe, c, {.global_batch = 16}, {.parallel = {.ep = 4, .dp = 8}});
  CHECK(state(none) == Approx(18 * (dense + experts / 4)));
  const plan zero1 = evaluate(small_moe, c, {.global_batch = 16},
                              {.parallel = {.ep = 4, .dp = 8}, .sharding_mode = sharding::optimizer});
  CHECK(state(zero1) == Approx((6 + 12.0 / 8) * dense + (6 + 12.0 / 2) * experts / 4));
  // tp 2 with the experts folded to expert-tp 1: ep 4 x 1 of tp x dp = 8, expert dp 2.
  const plan folded = evaluate(small_moe, c, {.global_batch = 16},
                               {.parallel = {.tp = 2, .ep = 4, .dp = 4, .expert_tp = 1}, .sequence_parallel = true});
  CHECK(state(folded) == Approx(18 * (dense / 2 + experts / 4)));
  // MoE activations: each routed copy keeps its expert input and intermediates (tokens x k).
  const detail::evaluator ev(small_moe, c, {.global_batch = 16}, {}, default_calibration);
  const double tokens = 32;
  const double per_token_h = 8 + (4 + 4) + 2 * (2 + 4 * f / h) + 4 * e / h;
  CHECK(ev.costs(1, 1, false, 1, 4, 1).act_selective == Approx(tokens * h * per_token_h));
}

TEST_CASE("the search keeps Megatron-Core's expert-parallel rules") {
  // 8 experts on 16 GPUs (2 nodes of 8): every plan's ep divides the experts, ep x expert-tp
  // divides tp x cp x dp, and ep > 1 with tp > 1 runs sequence parallel.
  model_desc m{.layers = 4, .hidden = 256, .heads = 8, .ffn = 512, .vocab = 1000, .seq = 256, .experts = 8, .top_k = 2};
  const cluster_desc c = dgx_cluster(*gpu_preset("H100"), 2);
  const search_result r = search(m, c, {.global_batch = 64}, {.top = 64});
  REQUIRE(r.plans.size() == 64);
  bool some_ep = false, some_folded = false;
  for (const plan& p : r.plans) {
    const auto& d = p.config.parallel;
    const int etp = d.expert_tp > 0 ? d.expert_tp : d.tp;
    INFO(describe(p.config));
    CHECK(m.experts % d.ep == 0);
    CHECK((d.tp * d.cp * d.dp) % (d.ep * etp) == 0);
    if (d.ep > 1 && d.tp > 1) CHECK(p.config.sequence_parallel);
    CHECK(layout_problem(m, c, {.global_batch = 64}, p.config).empty());
    some_ep = some_ep || d.ep > 1;
    some_folded = some_folded || etp != d.tp;
  }
  CHECK(some_ep);
  // Fixed fields are kept: ep 4 and expert-tp 1 at tp 2.
  const search_result fixed = search(m, c, {.global_batch = 64}, {.top = 8, .fixed = {.tp = 2, .ep = 4, .expert_tp = 1}});
  REQUIRE_FALSE(fixed.plans.empty());
  for (const plan& p : fixed.plans) {
    CHECK(p.config.parallel.ep == 4);
    CHECK(p.config.parallel.expert_tp == 1);
  }
  // A dense model has one expert layout: ep = 1.
  m.experts = 0;
  m.top_k = 0;
  for (const plan& p : search(m, c, {.global_batch = 64}, {.top = 64}).plans) CHECK(p.config.parallel.ep == 1);
}

TEST_CASE("bad MoE input gives one message saying what to change") {
  const cluster_desc c = dgx_cluster(*gpu_preset("H100"), 1);
  const job_desc job{.global_batch = 16};
  // E not divisible by ep.
  model_desc m = small_moe;
  m.experts = 6;
  CHECK_THAT(layout_problem(m, c, job, {.parallel = {.ep = 4, .dp = 8}}),
             Catch::Equals("6 experts do not divide over ep=4: choose ep in {1, 2, 3, 6}"));
  // ep x expert-tp not dividing tp x cp x dp (here: the ranks of a pipeline stage, 4).
  CHECK_THAT(layout_problem(small_moe, c, job, {.parallel = {.ep = 4, .pp = 2, .dp = 4, .expert_tp = 2}}),
             Catch::Contains("expert-tp=2 x ep=4 x pp=2 = 16 does not divide the world size 8"));
  // ep with tp needs sequence parallelism.
  CHECK_THAT(layout_problem(small_moe, c, job, {.parallel = {.tp = 2, .ep = 2, .dp = 4}}),
             Catch::Contains("needs sequence parallelism"));
  // A dense model has no experts to split.
  model_desc dense = small_moe;
  dense.experts = 0;
  dense.top_k = 0;
  CHECK_THAT(layout_problem(dense, c, job, {.parallel = {.ep = 2, .dp = 8}}), Catch::Contains("has no experts"));
  // top-k > E.
  m = small_moe;
  m.top_k = 5;
  CHECK_THROWS_WITH(check_model(m), "weft: tune: top-k = 5 is more than the 4 experts: a token is routed to at most every "
                                    "expert; give --moe-top-k from 1 to 4");
  CHECK_THROWS_AS(search(m, c, job), weft::error);
  m.top_k = 0;  // the default, 2
  CHECK_NOTHROW(check_model(m));
}

TEST_CASE("published MoE runs: predicted against published throughput, as documented in docs/tuning.md") {
  INFO("MoE runs expected at " WEFT_MOE_RUNS);
  REQUIRE(std::filesystem::exists(WEFT_MOE_RUNS));
  const auto runs = read_published_runs(WEFT_MOE_RUNS);
  REQUIRE(runs.size() == 5);
  // Signed errors of predicted MFU (= predicted / published tokens/s - 1), the table of
  // docs/tuning.md ("Mixtures of experts"); a change of the model that moves one by more than 2
  // points must update the table.
  const double documented[] = {-0.067, +0.624, -0.206, +1.291, -0.226};
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const published_run& run = runs[i];
    INFO(run.source << " " << run.name);
    const double mfu = predicted_published_mfu(run);
    REQUIRE(mfu > 0);
    CHECK(mfu / run.published_mfu - 1 == Approx(documented[i]).margin(0.02));
  }
  // The bf16 run (Megatron-Core's Mixtral 8x7B) within the dense models' 10 %.
  CHECK(std::abs(predicted_published_mfu(runs[0]) / runs[0].published_mfu - 1) <= 0.10);
}
