// The search: its rules, its agreement with brute force, and the rules of thumb it should
// reproduce without being told them.

#include <catch2/catch.hpp>

#include <weft/tune/report.hpp>
#include <weft/tune/search.hpp>

using namespace weft::tune;

namespace {

const model_desc gpt_1b{.layers = 24, .hidden = 2048, .heads = 16, .vocab = 50257, .seq = 2048};
const model_desc model_13b{.layers = 40, .hidden = 5120, .heads = 40, .vocab = 32000, .seq = 4096};

}  // namespace

TEST_CASE("every plan the search returns obeys the layout rules and fits, best first") {
  const cluster_desc cluster = large_reference_cluster(8);
  const model_desc m = *model_preset("llama3-70b");
  const job_desc job{.global_batch = 256};
  const search_result r = search(m, cluster, job, {.top = 20});
  REQUIRE(r.plans.size() == 20);
  for (std::size_t i = 0; i < r.plans.size(); ++i) {
    const plan& p = r.plans[i];
    const layout& l = p.config;
    CHECK(l.tp * l.cp * l.pp * l.dp == 64);
    CHECK(l.tp <= 8);
    CHECK(m.heads % l.tp == 0);
    CHECK(kv_heads_of(m) % l.tp == 0);
    CHECK(m.layers % (l.pp * l.vp) == 0);
    CHECK(256 % (l.dp * l.micro_batch) == 0);
    CHECK((l.pp == 1 || p.micro_batches >= l.pp));
    CHECK(p.memory.total <= p.memory.usable);
    if (i > 0) CHECK(p.tokens_per_s <= r.plans[i - 1].tokens_per_s);
  }
}

TEST_CASE("the search finds the best layout a brute-force enumeration finds") {
  const cluster_desc cluster = small_reference_cluster(2);
  const model_desc m = *model_preset("llama2-7b");
  const job_desc job{.global_batch = 64};
  const search_result r = search(m, cluster, job);
  REQUIRE_FALSE(r.plans.empty());
  // Enumerate everything through the public evaluate(), independently of the search's pruning.
  double best = 1e300;
  for (int tp : {1, 2, 4})
    for (int cp : {1, 2, 4, 8})
      for (int pp : {1, 2, 4, 8})
        for (int vp : {1, 2, 4, 8})
          for (int mb : {1, 2, 4, 8, 16, 32, 64})
            for (auto rc : {recompute::none, recompute::full})
              for (auto sh : {sharding::none, sharding::optimizer, sharding::gradients, sharding::full}) {
                if (tp * cp * pp > 8) continue;
                const layout l{.tp = tp, .cp = cp, .pp = pp, .dp = 8 / (tp * cp * pp), .vp = vp, .micro_batch = mb,
                               .recompute_mode = rc, .sharding_mode = sh, .sequence_parallel = tp > 1};
                if (!layout_problem(m, cluster, job, l).empty()) continue;
                if (sh != sharding::none && l.dp * l.cp == 1) continue;
                const plan p = evaluate(m, cluster, job, l);
                if (p.memory.fits()) best = std::min(best, p.time.step);
              }
  CHECK(r.plans.front().time.step == Catch::Detail::Approx(best).epsilon(1e-12));
}

TEST_CASE("fixed fields are kept") {
  const search_result r = search(*model_preset("llama2-7b"), large_reference_cluster(2), {.global_batch = 128},
                                 {.top = 10, .fixed = {.tp = 4, .pp = 2, .recompute_mode = recompute::full}});
  REQUIRE_FALSE(r.plans.empty());
  for (const plan& p : r.plans) {
    CHECK(p.config.tp == 4);
    CHECK(p.config.pp == 2);
    CHECK(p.config.recompute_mode == recompute::full);
  }
}

TEST_CASE("rule of thumb: small models train data parallel") {
  for (const cluster_desc& cluster : {small_reference_cluster(1), small_reference_cluster(2), large_reference_cluster(16)}) {
    for (const model_desc& m : {gpt_1b, *model_preset("llama2-7b")}) {
      const plan best = search(m, cluster, {.global_batch = 512}).plans.at(0);
      CHECK(best.config.tp == 1);
      CHECK(best.config.pp == 1);
    }
  }
}

TEST_CASE("rule of thumb: never 8-way TP on a 7B model, and the explanation says why in numbers") {
  const cluster_desc cluster = large_reference_cluster(8);
  const model_desc m = *model_preset("llama2-7b");
  const job_desc job{.global_batch = 512};
  const plan best = search(m, cluster, job).plans.at(0);
  const plan tp8 = search(m, cluster, job, {.fixed = {.tp = 8, .pp = 1}}).plans.at(0);
  CHECK(best.tokens_per_s > 1.2 * tp8.tokens_per_s);
  CHECK(tp8.time.tp_comm / tp8.time.step > 0.15);
  const explanation e = explain(best, m, cluster, job);
  bool mentioned = false;
  for (const alternative& a : e.alternatives)
    if (a.name.find("8-way TP") != std::string::npos) {
      mentioned = true;
      CHECK_THAT(a.verdict, Catch::Contains("slower") && Catch::Contains("TP collectives take"));
    }
  CHECK(mentioned);
}

TEST_CASE("rule of thumb: when TP is used it is the smallest degree that pays, inside a node") {
  const cluster_desc cluster = large_reference_cluster(16);
  const plan best = search(*model_preset("llama3-70b"), cluster, {.global_batch = 512}).plans.at(0);
  CHECK(best.config.tp > 1);
  CHECK(best.config.tp <= cluster.node.gpus_per_node);
}

TEST_CASE("rule of thumb: pipeline parallelism only when memory forces it") {
  const cluster_desc cluster = large_reference_cluster(16);
  const job_desc job{.global_batch = 512};
  // Models whose state fits without a pipeline get none.
  for (const model_desc& m : {gpt_1b, *model_preset("llama2-7b"), model_13b, *model_preset("llama3-70b")})
    CHECK(search(m, cluster, job).plans.at(0).config.pp == 1);
  // GPT-3 175B gets a pipeline, and without one it fits only by recomputing or sharding beyond ZeRO-1.
  const model_desc gpt3 = *model_preset("gpt3-175b");
  CHECK(search(gpt3, cluster, job).plans.at(0).config.pp > 1);
  search_options no_pipeline{.fixed = {.pp = 1, .recompute_mode = recompute::none}};
  no_pipeline.software.max_sharding = sharding::optimizer;
  CHECK(search(gpt3, cluster, job, no_pipeline).plans.empty());
}

TEST_CASE("a model that fits nowhere yields no plan and the layout that came closest") {
  const search_result r = search(*model_preset("llama3-405b"), dgx_cluster(*gpu_preset("A100-40GB"), 1), {.global_batch = 64});
  CHECK(r.plans.empty());
  REQUIRE(r.smallest);
  CHECK(r.smallest->memory.total > r.smallest->memory.usable);
  CHECK(r.layouts_valid > 0);
}

TEST_CASE("bad models and jobs are refused") {
  const cluster_desc cluster = large_reference_cluster(1);
  CHECK_THROWS_WITH(search({.layers = 0, .hidden = 64, .heads = 1, .vocab = 10, .seq = 8}, cluster, {.global_batch = 8}),
                    Catch::Contains("layer count"));
  CHECK_THROWS_WITH(search(gpt_1b, cluster, {}), Catch::Contains("global batch"));
  CHECK_THROWS_WITH(search({.layers = 2, .hidden = 64, .heads = 4, .kv_heads = 3, .vocab = 10, .seq = 8}, cluster,
                           {.global_batch = 8}),
                    Catch::Contains("key/value head"));
}

TEST_CASE("the full search for a 405B model on 16,384 GPUs runs and keeps TP inside a node") {
  cluster_desc cluster = large_reference_cluster(2048);
  const search_result r = search(*model_preset("llama3-405b"), cluster, {.global_batch_tokens = 2048 * 8192.0},
                                 {.allow_uneven_stages = true});
  REQUIRE_FALSE(r.plans.empty());
  CHECK(r.plans.front().config.tp == 8);
  CHECK(r.plans.front().config.pp > 1);
  CHECK(r.layouts_valid > 1000);
}

TEST_CASE("the search proposes selective recomputation only where the software has it") {
  // Without fused attention and with little memory, selective recomputation is attractive.
  const cluster_desc cluster = dgx_cluster(*gpu_preset("A100-40GB"), 2);
  software_desc with{.flash_attention = false, .sequence_parallel = false, .context_parallel = false};
  software_desc without = with;
  without.selective_recompute = false;
  const job_desc job{.global_batch = 256};
  const search_result a = search(model_13b, cluster, job, {.top = 64, .software = with});
  const search_result b = search(model_13b, cluster, job, {.top = 64, .software = without});
  REQUIRE(!a.plans.empty());
  REQUIRE(!b.plans.empty());
  bool any_selective = false;
  for (const plan& p : a.plans) any_selective = any_selective || p.config.recompute_mode == recompute::selective;
  CHECK(any_selective);
  for (const plan& p : b.plans) CHECK(p.config.recompute_mode != recompute::selective);
  CHECK(b.plans.front().time.step >= a.plans.front().time.step * (1 - 1e-12));  // fewer choices, never faster
}
