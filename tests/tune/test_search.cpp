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
    const layout_choice& l = p.config;
    CHECK(l.parallel.tp * l.parallel.cp * l.parallel.pp * l.parallel.dp == 64);
    CHECK(l.parallel.tp <= 8);
    CHECK(m.heads % l.parallel.tp == 0);
    CHECK(kv_heads_of(m) % l.parallel.tp == 0);
    CHECK(m.layers % (l.parallel.pp * l.parallel.virtual_stages) == 0);
    CHECK(256 % (l.parallel.dp * l.micro_batch) == 0);
    CHECK((l.parallel.pp == 1 || p.micro_batches >= l.parallel.pp));
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
                const layout_choice l{.parallel = {.tp = tp, .cp = cp, .pp = pp, .dp = 8 / (tp * cp * pp), .virtual_stages = vp}, .micro_batch = mb, .recompute_mode = rc, .sharding_mode = sh, .sequence_parallel = tp > 1};
                if (!layout_problem(m, cluster, job, l).empty()) continue;
                if (sh != sharding::none && l.parallel.dp * l.parallel.cp == 1) continue;
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
    CHECK(p.config.parallel.tp == 4);
    CHECK(p.config.parallel.pp == 2);
    CHECK(p.config.recompute_mode == recompute::full);
  }
}

TEST_CASE("one degree fixed alone (my batch fixes dp): the search splits the rest, as well as any split at that dp") {
  // "My batch fixes dp = 16, how do I split the rest?" on 128 H100s.
  const model_desc m = *model_preset("llama3-70b");
  const cluster_desc cluster = large_reference_cluster(16);
  const job_desc job{.global_batch = 512};
  const search_result fixed = search(m, cluster, job, {.top = 10, .fixed = {.dp = 16}});
  REQUIRE_FALSE(fixed.plans.empty());
  for (const plan& p : fixed.plans) CHECK(p.config.parallel.dp == 16);
  // Independently: every tp x cp x pp split of the other 8 GPUs (with the usual micro-batch,
  // interleaving, recomputation and sharding choices) evaluated through evaluate(); none beats it.
  double best = 1e300;
  int splits_tried = 0;
  for (int tp : {1, 2, 4, 8})
    for (int cp : {1, 2, 4, 8})
      for (int pp : {1, 2, 4, 8}) {
        if (tp * cp * pp != 8) continue;
        for (int vp : {1, 2, 4, 5})  // the search tries up to 8
          for (int mb : {1, 2, 4, 8})
            for (auto rc : {recompute::none, recompute::full})
              for (auto sh : {sharding::none, sharding::optimizer, sharding::gradients, sharding::full}) {
                const layout_choice l{.parallel = {.tp = tp, .cp = cp, .pp = pp, .dp = 16, .virtual_stages = vp},
                                      .micro_batch = mb, .recompute_mode = rc, .sharding_mode = sh,
                                      .sequence_parallel = tp > 1};
                if (!layout_problem(m, cluster, job, l).empty()) continue;
                ++splits_tried;
                const plan p = evaluate(m, cluster, job, l);
                if (p.memory.fits()) best = std::min(best, p.time.step);
              }
      }
  CHECK(splits_tried > 50);
  CHECK(fixed.plans.front().time.step <= best * (1 + 1e-12));
}

TEST_CASE("the tuner's layout rules are weft::layout's: what layout_problem refuses, check_model_shape refuses") {
  const cluster_desc cluster = large_reference_cluster(4);  // 32 GPUs
  const model_desc m{.layers = 24, .hidden = 3072, .heads = 24, .kv_heads = 6, .vocab = 32000, .seq = 1000};
  const job_desc job{.global_batch = 256};
  int refused = 0, accepted = 0;
  for (int tp : {1, 2, 3, 4, 8})
    for (int cp : {1, 2, 4})
      for (int pp : {1, 2, 4})
        for (int vp : {1, 2, 3, 4}) {
          if (32 % (tp * cp * pp) != 0 || (vp > 1 && pp == 1)) continue;
          const layout_choice l{.parallel = {.world_size = 32, .tp = tp, .cp = cp, .pp = pp, .dp = 32 / (tp * cp * pp),
                                             .virtual_stages = vp}};
          const weft::layout::rank_layout groups(l.parallel);
          const bool shape_ok = weft::layout::check_model_shape(
                                    groups, {.heads = m.heads, .kv_heads = m.kv_heads, .layers = m.layers, .seq_length = m.seq})
                                    .empty();
          // Independent arithmetic: heads and kv heads over tp, sequence in 2 cp chunks, layers over pp x vp.
          const bool by_hand = m.heads % tp == 0 && m.kv_heads % tp == 0 && (cp == 1 || m.seq % (2 * cp) == 0) &&
                               m.layers % (pp * vp) == 0;
          INFO("tp " << tp << " cp " << cp << " pp " << pp << " vp " << vp);
          CHECK(shape_ok == by_hand);
          if (!by_hand) CHECK_FALSE(layout_problem(m, cluster, job, l).empty());
          (by_hand ? accepted : refused) += 1;
          // The plan's layout is exactly these degrees.
          CHECK(groups.tp() == tp);
          CHECK(groups.virtual_stages() == vp);
        }
  CHECK(refused > 10);
  CHECK(accepted > 5);
}

TEST_CASE("best() returns the search's first plan, and its layout() is what process_groups takes") {
  const model_desc m = *model_preset("llama3-70b");
  const cluster_desc cluster = large_reference_cluster(16);
  const plan p = best(m, cluster, {.global_batch = 512});
  const plan first = search(m, cluster, {.global_batch = 512}).plans.at(0);
  CHECK(p.time.step == first.time.step);
  const weft::layout::rank_layout l = p.layout();
  CHECK(l.world_size() == 128);
  CHECK(l.tp() == p.config.parallel.tp);
  CHECK(l.pp() == p.config.parallel.pp);
  CHECK(l.dp() == p.config.parallel.dp);
  CHECK(l.cp() == p.config.parallel.cp);
  CHECK(l.virtual_stages() == p.config.parallel.virtual_stages);
  CHECK_THROWS_WITH(best(*model_preset("llama3-405b"), dgx_cluster(*gpu_preset("A100-40GB"), 1), {.global_batch = 64}),
                    Catch::Contains("no layout of 8 GPUs fits") && Catch::Contains("GB per GPU"));
}

TEST_CASE("of layouts the model cannot tell apart, the simpler ranks first") {
  // Llama-2-7B on 64 H100s: cp = 2 and 4 hide their exchange completely and tie with cp = 1.
  const search_result r = search(*model_preset("llama2-7b"), dgx_cluster(*gpu_preset("H100"), 8), {.global_batch = 1024},
                                 {.top = 10});
  int ties = 0;
  for (std::size_t i = 1; i < r.plans.size(); ++i) {
    if (r.plans[i].time.step != r.plans[0].time.step) continue;
    ++ties;
    const auto& a = r.plans[0].config.parallel;
    const auto& b = r.plans[i].config.parallel;
    CHECK(a.tp * a.cp * a.pp <= b.tp * b.cp * b.pp);
  }
  CHECK(ties >= 1);
  CHECK(r.plans[0].config.parallel.cp == 1);
}

TEST_CASE("rule of thumb: small models train data parallel") {
  for (const cluster_desc& cluster : {small_reference_cluster(1), small_reference_cluster(2), large_reference_cluster(16)}) {
    for (const model_desc& m : {gpt_1b, *model_preset("llama2-7b")}) {
      const plan best = search(m, cluster, {.global_batch = 512}).plans.at(0);
      CHECK(best.config.parallel.tp == 1);
      CHECK(best.config.parallel.pp == 1);
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
  CHECK(best.config.parallel.tp > 1);
  CHECK(best.config.parallel.tp <= cluster.node.gpus_per_node);
}

TEST_CASE("rule of thumb: pipeline parallelism only when memory forces it") {
  const cluster_desc cluster = large_reference_cluster(16);
  const job_desc job{.global_batch = 512};
  // Models whose state fits without a pipeline get none.
  for (const model_desc& m : {gpt_1b, *model_preset("llama2-7b"), model_13b, *model_preset("llama3-70b")})
    CHECK(search(m, cluster, job).plans.at(0).config.parallel.pp == 1);
  // GPT-3 175B gets a pipeline, and without one it fits only by recomputing or sharding beyond ZeRO-1.
  const model_desc gpt3 = *model_preset("gpt3-175b");
  CHECK(search(gpt3, cluster, job).plans.at(0).config.parallel.pp > 1);
  search_options no_pipeline{.fixed = {.pp = 1, .recompute_mode = recompute::none}};
  no_pipeline.software.max_sharding = sharding::optimizer;
  CHECK(search(gpt3, cluster, job, no_pipeline).plans.empty());
}

TEST_CASE("software whose full sharding cannot run under a pipeline never gets both") {
  // GPT-3 175B on 128 GPUs: the best plans shard beyond ZeRO-1 and use a pipeline.
  const cluster_desc cluster = large_reference_cluster(16);
  const model_desc gpt3 = *model_preset("gpt3-175b");
  const job_desc job{.global_batch = 512};
  auto deep_and_piped = [](const search_result& r) {
    int n = 0;
    for (const plan& p : r.plans)
      n += p.config.sharding_mode >= sharding::gradients && p.config.parallel.pp > 1;
    return n;
  };
  search_options any{.top = 50};
  REQUIRE(deep_and_piped(search(gpt3, cluster, job, any)) > 0);  // otherwise the check below says nothing
  search_options apart{.top = 50};
  apart.software.sharding_with_pipeline = false;
  const search_result r = search(gpt3, cluster, job, apart);
  REQUIRE(!r.plans.empty());
  CHECK(deep_and_piped(r) == 0);
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
  CHECK(r.plans.front().config.parallel.tp == 8);
  CHECK(r.plans.front().config.parallel.pp > 1);
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
