// The cost model against the published formulas it implements, each recomputed here by hand.

#include <catch2/catch.hpp>

#include <weft/tune/cost_model.hpp>
#include <weft/tune/report.hpp>

using namespace weft::tune;
using Catch::Detail::Approx;

namespace {

// GPT-3 2.7B-like shape with dropout and no fused attention: the setting of Korthikanti et al.
const model_desc gpt{.layers = 32, .hidden = 2560, .heads = 32, .vocab = 51200, .seq = 2048, .tied_embeddings = true,
                     .dropout = true};
const software_desc megatron_2021{.flash_attention = false, .sequence_parallel = true, .overlap_dp = false};

detail::layer_costs costs_of(const model_desc& m, int tp, bool sp, int b, const software_desc& sw = megatron_2021) {
  const detail::evaluator ev(m, dgx_cluster(*gpu_preset("A100-80GB"), 4), {.global_batch = 64}, sw, default_calibration);
  return ev.costs(tp, 1, sp, b);
}

}  // namespace

TEST_CASE("model FLOPs per token follow Korthikanti et al.'s 72 l h^2 (1 + s/6h + V/12lh)") {
  const double l = gpt.layers, h = gpt.hidden, s = gpt.seq, v = gpt.vocab;
  const double per_sequence = 72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h));
  CHECK(model_flops_per_token(gpt) == Approx(per_sequence / s).epsilon(1e-12));
}

TEST_CASE("parameter counts of published models come out of their shapes") {
  // GPT-3 175B: 174.6 B (Brown et al. 2020); Llama 3 8B: 8.03 B and 70B: 70.6 B (Meta's model cards).
  CHECK(param_count(*model_preset("gpt3-175b")) == Approx(174.6e9).epsilon(0.01));
  CHECK(param_count(*model_preset("llama3-8b")) == Approx(8.03e9).epsilon(0.005));
  CHECK(param_count(*model_preset("llama3-70b")) == Approx(70.6e9).epsilon(0.005));
  CHECK(param_count(*model_preset("llama2-7b")) == Approx(6.74e9).epsilon(0.005));
}

TEST_CASE("activation memory per layer follows Korthikanti et al. for each recomputation mode") {
  const double s = gpt.seq, h = gpt.hidden, a = gpt.heads, b = 2;
  SECTION("no parallelism: s b h (34 + 5 a s / h)") {
    const auto c = costs_of(gpt, 1, false, 2);
    CHECK(c.act_none == Approx(s * b * h * (34 + 5 * a * s / h)));
    CHECK(c.act_selective == Approx(s * b * h * 34));
    CHECK(c.act_full == Approx(2 * s * b * h));
  }
  SECTION("tensor parallel without sequence parallelism: s b h (10 + 24/t + 5 a s / h t)") {
    const double t = 4;
    const auto c = costs_of(gpt, 4, false, 2);
    CHECK(c.act_none == Approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t))));
  }
  SECTION("tensor + sequence parallel: s b h (34/t + 5 a s / h t), selective 34 s b h / t") {
    const double t = 8;
    const auto c = costs_of(gpt, 8, true, 2);
    CHECK(c.act_none == Approx(s * b * h * (34 / t + 5 * a * s / (h * t))));
    CHECK(c.act_selective == Approx(34 * s * b * h / t));
    CHECK(c.act_full == Approx(2 * s * b * h / t));
  }
  SECTION("fused attention stores no attention scores") {
    const auto c = costs_of(gpt, 1, false, 2, software_desc{});
    CHECK(c.act_none == Approx(s * b * h * 34));
  }
}

TEST_CASE("training state is 18 bytes per parameter, 6 + 12/d with a distributed optimizer") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("H100"), 4);
  const model_desc m = *model_preset("llama2-7b");
  const double per_gpu = param_count(m) / 2;  // tp = 2, one stage
  auto state = [](const plan& p) { return p.memory.weights + p.memory.gradients + p.memory.optimizer; };
  const plan plain = evaluate(m, cluster, {.global_batch = 64}, {.parallel = {.tp = 2, .dp = 16}, .sequence_parallel = true});
  CHECK(state(plain) == Approx(18 * per_gpu));
  const plan sharded = evaluate(m, cluster, {.global_batch = 64},
                                {.parallel = {.tp = 2, .dp = 16}, .sharding_mode = sharding::optimizer, .sequence_parallel = true});
  CHECK(state(sharded) == Approx((6 + 12.0 / 16) * per_gpu));
  const plan fsdp = evaluate(m, cluster, {.global_batch = 64},
                             {.parallel = {.tp = 2, .dp = 16}, .sharding_mode = sharding::full, .sequence_parallel = true});
  const double gathered = 2 * 2 * layer_params(m) / 2;  // two bf16 layers being gathered
  CHECK(state(fsdp) == Approx(18 * per_gpu / 16 + gathered));
}

TEST_CASE("pipeline bubble is (p - 1) / (v m) of the ideal time") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("H100"), 4);
  const model_desc m = *model_preset("llama2-7b");
  for (int vp : {1, 2, 4}) {
    const plan p = evaluate(m, cluster, {.global_batch = 128}, {.parallel = {.pp = 4, .dp = 8, .virtual_stages = vp}, .micro_batch = 1});
    const double micro_batches = 128 / 8;
    REQUIRE(p.micro_batches == 16);
    // With tp = cp = 1 a micro-batch's time is its compute, so the bubble is an exact fraction.
    CHECK(p.time.bubble / p.time.compute == Approx(3.0 / (vp * micro_batches)));
  }
}

TEST_CASE("balanced end stages: the first and last stages take a layer fewer (Llama 3, section 3.3.2)") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("H100"), 4);
  const job_desc job{.global_batch = 128};
  const layout_choice pp4{.parallel = {.pp = 4, .dp = 8}, .micro_batch = 1};
  const software_desc plain{}, balanced{.balanced_end_stages = true};
  // Per micro-batch of the busiest stage without balancing: ceil(l / 4) layers L plus the output
  // layer G (the last stage). 14 layers: 4 L + G; 10 and 12 layers: 3 L + G.
  for (const int vocab : {1024, 1 << 20}) {  // the output layer lighter, then heavier, than a layer
    model_desc m = *model_preset("llama2-7b");
    m.vocab = vocab;
    auto compute = [&](int layers, const software_desc& sw) {
      m.layers = layers;
      return evaluate(m, cluster, job, pp4, sw, default_calibration, true).time.compute;
    };
    const double L = compute(14, plain) - compute(10, plain), G = compute(12, plain) - 3 * L;
    CHECK(compute(14, plain) == Approx(4 * L + G));
    // Balanced, 14 = 4 x 4 - 2: the end stages take 3 layers, the middle ones 4 and no output layer.
    CHECK(compute(14, balanced) == Approx(std::max(4 * L, 3 * L + G)));
    // 15 layers leave one place empty: nothing to balance.
    CHECK(compute(15, balanced) == Approx(compute(15, plain)));
  }
  // Memory: stage 0 holds 3 layers x 4 micro-batches in flight, stage 1 4 layers x 3 (1F1B), where
  // every layer of 4 stages held 4: three quarters of the activations.
  model_desc m = *model_preset("llama2-7b");
  m.layers = 14;
  const plan p = evaluate(m, cluster, job, pp4, plain, default_calibration, true);
  const plan q = evaluate(m, cluster, job, pp4, balanced, default_calibration, true);
  CHECK(q.memory.activations == Approx(0.75 * p.memory.activations));
}

TEST_CASE("tensor parallelism costs 4 all-reduces of b s h per layer per micro-batch, 6 with full recomputation") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("A100-80GB"), 1);
  const model_desc m = *model_preset("llama2-7b");
  const int tp = 4, b = 2, batch = 32;
  const double bytes = 2.0 * b * m.seq * m.hidden;  // bf16
  const double bandwidth = 600e9 / 2 * default_calibration.link_efficiency;
  const double one = 2.0 * (tp - 1) / tp * bytes / bandwidth + 2.0 * (tp - 1) * cluster.node.intra_latency;
  const double steps = batch / (2.0 * b);  // micro-batches per step with dp = 2
  const plan none = evaluate(m, cluster, {.global_batch = batch}, {.parallel = {.tp = tp, .dp = 2}, .micro_batch = b, .sequence_parallel = true});
  CHECK(none.time.tp_comm == Approx(steps * m.layers * 4 * one));
  const plan full = evaluate(m, cluster, {.global_batch = batch},
                             {.parallel = {.tp = tp, .dp = 2}, .micro_batch = b, .recompute_mode = recompute::full, .sequence_parallel = true});
  CHECK(full.time.tp_comm == Approx(steps * m.layers * 6 * one));
}

TEST_CASE("data-parallel reduction moves 2 (d - 1) / d of the gradient bytes over NVLink, then the network") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("H100"), 4);  // 32 GPUs
  const model_desc m = *model_preset("llama2-7b");
  const software_desc no_overlap{.overlap_dp = false};
  const plan p = evaluate(m, cluster, {.global_batch = 64}, {.parallel = {.tp = 2, .dp = 16}, .sequence_parallel = true}, no_overlap);
  const double grads = 4 * param_count(m) / 2;  // fp32 gradients of half the model
  const double nvlink = 900e9 / 2 * default_calibration.link_efficiency;
  const double network = 50e9 * default_calibration.link_efficiency;
  // 4 members per node (8 GPUs / tp 2) over 4 nodes: reduce inside the node, then a quarter across.
  const double expected = 2.0 * 3 / 4 * grads / nvlink + 2.0 * 3 * cluster.node.intra_latency +
                          2.0 * 3 / 4 * (grads / 4) / network + 2.0 * 3 * cluster.node.network_latency;
  CHECK(p.time.dp_comm == Approx(expected));
  // Overlapped with the backward pass, most of it disappears.
  const plan overlapped = evaluate(m, cluster, {.global_batch = 64}, {.parallel = {.tp = 2, .dp = 16}, .sequence_parallel = true});
  CHECK(overlapped.time.dp_comm < 0.5 * p.time.dp_comm);
}

TEST_CASE("MFU counts model FLOPs; hardware FLOPs add the recomputed forward (Narayanan et al.'s 96 / 72)") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("A100-80GB"), 4);
  const plan p = evaluate(gpt, cluster, {.global_batch = 64},
                          {.parallel = {.tp = 2, .dp = 16}, .micro_batch = 2, .recompute_mode = recompute::full}, megatron_2021);
  const double l = gpt.layers, h = gpt.hidden, s = gpt.seq, v = gpt.vocab;
  const double model = 72.0 * 64 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h));
  const double hardware = 96.0 * 64 * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h));
  CHECK(p.mfu == Approx(model / (p.time.step * 32 * 312e12)));
  CHECK(p.hfu / p.mfu == Approx(hardware / model));
  CHECK(p.tokens_per_s == Approx(64 * s / p.time.step));
}

TEST_CASE("the step time is the sum of its parts, and days and cost follow from throughput") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("H100"), 2);
  const plan p = evaluate(*model_preset("llama2-7b"), cluster, {.global_batch = 64, .tokens = 1e12, .price_per_gpu_hour = 2},
                          {.parallel = {.tp = 2, .pp = 2, .dp = 4, .virtual_stages = 2}, .micro_batch = 1, .sequence_parallel = true});
  const time_breakdown& t = p.time;
  CHECK(t.step == Approx(t.compute + t.tp_comm + t.cp_comm + t.pp_comm + t.bubble + t.dp_comm + t.optimizer));
  CHECK(p.days == Approx(1e12 / p.tokens_per_s / 86400));
  CHECK(p.cost == Approx(p.days * 24 * 16 * 2));
}

TEST_CASE("invalid layouts are refused with the reason") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("H100"), 1);
  const model_desc m = *model_preset("llama2-7b");
  const job_desc job{.global_batch = 64};
  CHECK_THAT(layout_problem(m, cluster, job, {.parallel = {.tp = 2, .dp = 2}}), Catch::Contains("must equal the world size"));
  CHECK_THAT(layout_problem(m, {.gpu = cluster.gpu, .node = {.gpus_per_node = 6, .intra_bandwidth = 1, .network_bandwidth = 1}},
                            job, {.parallel = {.tp = 3, .dp = 2}}),
             Catch::Contains("do not divide over tp=3"));
  CHECK_THAT(layout_problem(m, cluster, job, {.parallel = {.pp = 8, .dp = 1, .virtual_stages = 3}}), Catch::Contains("layers do not divide over pp=8 x virtual stages=3"));
  CHECK_THAT(layout_problem(m, cluster, {.global_batch = 4}, {.parallel = {.pp = 8}}), Catch::Contains("fewer than the 8 pipeline stages"));
  CHECK_THAT(layout_problem(m, cluster, {.global_batch = 60}, {.parallel = {.dp = 8}}), Catch::Contains("does not divide"));
  CHECK(layout_problem(m, cluster, job, {.parallel = {.tp = 8}, .sequence_parallel = true}).empty());
  CHECK_THROWS_AS(evaluate(m, cluster, job, {.parallel = {.tp = 16}}), weft::error);
  CHECK_THROWS_WITH(check_model({.layers = 2, .hidden = 100, .heads = 3, .vocab = 10, .seq = 8}),
                    Catch::Contains("multiple of the head count"));
}

TEST_CASE("the blog's 8 x A100 claim for a 7B model needs more than 100 % MFU") {
  const model_desc m = *model_preset("llama2-7b");
  const claim_check a100 = check_claim(m, *gpu_preset("A100-80GB"), 8, 1e12, 120);
  CHECK_FALSE(a100.possible);
  // Independently: 6 N D plus attention is at least 6 N D = 4.0e22 FLOPs; 8 GPUs x 312 TFLOP/s x 120 days = 2.6e22.
  CHECK(a100.implied_mfu > 6 * 6.74e9 * 1e12 / (8 * 312e12 * 120 * 86400));
  const claim_check h100 = check_claim(m, *gpu_preset("H100"), 64, 1e12, 9.4);
  CHECK(h100.possible);
  CHECK(h100.implied_mfu > 0.8);
}

TEST_CASE("fp16 gradient buffers halve the gradient memory and the data-parallel bytes") {
  const cluster_desc cluster = dgx_cluster(*gpu_preset("A100-80GB"), 4);  // 32 GPUs
  const layout_choice l{.parallel = {.tp = 2, .dp = 16}, .micro_batch = 1};
  const software_desc fp32_grads{.flash_attention = false, .sequence_parallel = false, .overlap_dp = false};
  software_desc fp16_grads = fp32_grads;
  fp16_grads.gradient_bytes = 2;
  const plan a = evaluate(gpt, cluster, {.global_batch = 64}, l, fp32_grads);
  const plan b = evaluate(gpt, cluster, {.global_batch = 64}, l, fp16_grads);
  CHECK(b.memory.gradients == Approx(a.memory.gradients / 2));
  CHECK(a.memory.gradients == Approx(4 * param_count(gpt) / 2));  // fp32, half the model per GPU
  // Without overlap the reduction is all exposed; latency aside, it halves with the bytes.
  CHECK(b.time.dp_comm < 0.55 * a.time.dp_comm);
  CHECK(b.time.dp_comm > 0.45 * a.time.dp_comm);
}

TEST_CASE("a bf16 gradient copy kept beside the fp32 accumulation adds 2 bytes per parameter, unsharded") {
  // DeepSpeed's bf16 optimizer (BLOOM): bf16 weights 2 + bf16 gradients 2 + fp32 gradients 4 +
  // 12 / d of master weights and moments, i.e. 8 + 12/d instead of 6 + 12/d.
  const cluster_desc cluster = dgx_cluster(*gpu_preset("A100-80GB"), 4);  // 32 GPUs
  const layout_choice l{.parallel = {.tp = 2, .dp = 16}, .micro_batch = 1, .sharding_mode = sharding::optimizer};
  const software_desc fused{.flash_attention = false, .sequence_parallel = false, .overlap_dp = false};
  software_desc kept = fused;
  kept.low_precision_gradient_bytes = 2;
  const plan a = evaluate(gpt, cluster, {.global_batch = 64}, l, fused);
  const plan b = evaluate(gpt, cluster, {.global_batch = 64}, l, kept);
  const double per_gpu = param_count(gpt) / 2;
  auto state = [](const plan& p) { return p.memory.weights + p.memory.gradients + p.memory.optimizer; };
  CHECK(state(a) == Approx((6 + 12.0 / 16) * per_gpu));
  CHECK(state(b) == Approx((8 + 12.0 / 16) * per_gpu));
  // Sharding the fp32 gradients (ZeRO-2) leaves the kept bf16 copy whole: 2 + 4/d + 2 + 12/d.
  layout_choice z2 = l;
  z2.sharding_mode = sharding::gradients;
  CHECK(state(evaluate(gpt, cluster, {.global_batch = 64}, z2, kept)) == Approx((4 + 16.0 / 16) * per_gpu));
  // Memory only: the reduction still moves the fp32 gradients, and the step time is unchanged.
  CHECK(b.time.step == Approx(a.time.step));
}

TEST_CASE("usable memory: the device minus a fixed reserve, less the fragmentation margin") {
  const cluster_desc small = dgx_cluster(*gpu_preset("A100-40GB"), 1);
  const cluster_desc large = dgx_cluster(*gpu_preset("A100-80GB"), 1);
  const plan a = evaluate(gpt, small, {.global_batch = 8}, {.parallel = {.dp = 8}, .recompute_mode = recompute::full}, megatron_2021);
  const plan b = evaluate(gpt, large, {.global_batch = 8}, {.parallel = {.dp = 8}, .recompute_mode = recompute::full}, megatron_2021);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  calibration c = default_calibration;
  CHECK(a.memory.usable == Approx((40 * gib - c.memory_reserve) * (1 - c.memory_headroom)));
  // A fixed reserve takes a larger share of a smaller device.
  CHECK(a.memory.usable / (40 * gib) < b.memory.usable / (80 * gib));
}
