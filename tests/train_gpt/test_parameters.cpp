// The pure description of train_gpt's parameters: which rank holds what, and how local parts map
// to whole tensors (what checkpoints, --init-from and --dump-grads rely on).
#include <catch2/catch.hpp>

#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "checkpoint_io.hpp"
#include "gpt_config.hpp"
#include "parameters.hpp"
#include "planning.hpp"

using namespace train_gpt;

namespace {
gpt_config shape() { return gpt_config{4, 64, 4, 256, 64, 32}; }
}  // namespace

TEST_CASE("every whole element is held by exactly one tp rank, or by all of them when replicated") {
  const gpt_config m = shape();
  for (int tp : {1, 2, 4}) {
    for (const param_spec& whole_spec : whole_parameters(m)) {
      const std::size_t n = static_cast<std::size_t>(elements_of(whole_spec.whole));
      std::vector<int> held(n, 0);
      std::size_t local_total = 0;
      for (int r = 0; r < tp; ++r) {
        model_place at{.tp_rank = r, .tp = tp};
        auto specs = rank_parameters(m, at);
        auto it = std::find_if(specs.begin(), specs.end(), [&](const param_spec& p) { return p.name == whole_spec.name; });
        REQUIRE(it != specs.end());
        local_total += it->local_elements;
        for_each_local_run(*it, r, tp, [&](std::size_t w, std::size_t, std::size_t count) {
          for (std::size_t i = w; i < w + count; ++i) ++held[i];
        });
      }
      const int want = whole_spec.split == tp_split::replicated ? tp : 1;
      INFO(whole_spec.name << " tp " << tp);
      CHECK(std::all_of(held.begin(), held.end(), [&](int h) { return h == want; }));
      // The embedding's blocks also hold the padding: 256 tokens padded to a multiple of 128 x tp.
      const std::size_t padding = whole_spec.split == tp_split::vocab_rows ? (static_cast<std::size_t>(128 * tp) - 256 % (128 * tp)) % (128 * tp) * 64 : 0;
      CHECK(local_total == n * static_cast<std::size_t>(want) + padding);
    }
  }
}

TEST_CASE("tensor parallelism gives each rank the q, k and v columns of its own heads") {
  const gpt_config m = shape();  // 4 heads of 16
  const int tp = 2;
  model_place at{.tp_rank = 1, .tp = tp};
  auto specs = rank_parameters(m, at);
  const param_spec& qkv = *std::find_if(specs.begin(), specs.end(), [](const param_spec& p) {
    return p.name == "h.0.attn.c_attn.weight";
  });
  const std::size_t c = 64;
  std::vector<float> whole(c * 3 * c);
  std::iota(whole.begin(), whole.end(), 0.0f);  // element value = its whole index
  std::vector<float> local(qkv.local_elements);
  cut_local(qkv, 1, tp, whole, local);
  // Local row 5, local column j: q heads 2-3 are whole columns 32..63, k 96..127, v 160..191.
  const std::size_t lc = 3 * c / tp;
  for (std::size_t j = 0; j < lc; ++j) {
    const std::size_t block = j / (c / tp), offset = j % (c / tp);
    const std::size_t whole_col = block * c + (c / tp) + offset;
    REQUIRE(local[5 * lc + j] == whole[5 * 3 * c + whole_col]);
  }
  // And back: placing the local part reproduces those elements and nothing else.
  std::vector<float> rebuilt(whole.size(), -1.0f);
  place_local(qkv, 1, tp, local, rebuilt);
  std::size_t placed = 0;
  for (std::size_t i = 0; i < whole.size(); ++i)
    if (rebuilt[i] != -1.0f) {
      ++placed;
      REQUIRE(rebuilt[i] == whole[i]);
    }
  CHECK(placed == qkv.local_elements);
}

TEST_CASE("pipeline stages and virtual stages hold every layer once; the last stage a copy of the embedding") {
  const gpt_config m = shape();  // 4 layers
  for (auto [pp, vp] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 1}, {2, 2}}) {
    std::map<std::string, int> count;
    for (int r = 0; r < pp; ++r)
      for (const param_spec& p : rank_parameters(m, model_place{.pp_rank = r, .pp = pp, .vp = vp})) ++count[p.name];
    INFO("pp " << pp << " vp " << vp);
    for (const param_spec& p : whole_parameters(m)) CHECK(count[p.name] == (p.name == "wte.weight" && pp > 1 ? 2 : 1));
    CHECK(count.size() == whole_parameters(m).size());
  }
  // Interleaving: rank 1 of pp 2 with 2 chunks holds layers 1 and 3 (virtual stages 1 and 3).
  std::set<int> layers;
  for (const param_spec& p : rank_parameters(m, model_place{.pp_rank = 1, .pp = 2, .vp = 2}))
    if (p.layer >= 0) layers.insert(p.layer);
  CHECK(layers == std::set<int>{1, 3});
  // The last stage registers its embedding copy first (it is final only after the pipeline step).
  CHECK(rank_parameters(m, model_place{.pp_rank = 1, .pp = 2}).front().name == "wte.weight");
}

namespace {
weft::tune::layout_choice layout(int tp, int pp, int cp, int vp = 1, bool sp = false, int micro_batch = 1) {
  weft::tune::layout_choice c;
  c.parallel = {.tp = tp, .cp = cp, .pp = pp, .dp = 1, .virtual_stages = vp};
  c.sequence_parallel = sp;
  c.micro_batch = micro_batch;
  return c;
}
bool has(const std::vector<std::string>& problems, const std::string& text) {
  return std::any_of(problems.begin(), problems.end(),
                     [&](const std::string& s) { return s.find(text) != std::string::npos; });
}
}  // namespace

TEST_CASE("shape problems: weft's divisibility rules and GPT-2's own, each naming the fix") {
  gpt_config m = shape();  // 4 layers, 4 heads, seq 32, 64 positions
  CHECK(shape_problems(m, layout(1, 1, 1)).empty());
  CHECK(has(shape_problems(m, layout(3, 1, 1)), "4 attention heads do not divide over tp=3"));
  CHECK(has(shape_problems(m, layout(1, 3, 1)), "4 layers do not divide over pp=3"));
  CHECK(has(shape_problems(m, layout(1, 2, 1, 4)), "4 layers do not divide over pp=2 x virtual stages=4"));
  CHECK(has(shape_problems(m, layout(1, 1, 3)), "does not split into 2 x cp=6 equal chunks"));
  CHECK(shape_problems(m, layout(2, 1, 1, 1, true)).empty());  // 32 tokens over tp 2
  m.seq = 20;  // cp 2 gives each rank 10 tokens, which tp 4 cannot slice; 2 sequences per micro-batch can
  CHECK(has(shape_problems(m, layout(4, 1, 2, 1, true)), "does not divide them"));
  CHECK(shape_problems(m, layout(4, 1, 2, 1, true, 2)).empty());
  m.seq = 100;
  CHECK(has(shape_problems(m, layout(1, 1, 1)), "--seq 100 is longer than the model's 64 positions"));
  m = shape();
  m.hidden = 66;
  CHECK(has(shape_problems(m, layout(1, 1, 1)), "--hidden 66 is not divisible by --heads 4"));
  CHECK(gpt_config{12, 768, 12, 50257, 1024, 1024}.parameter_count() == 124'439'808);  // GPT-2 small, as published
}

TEST_CASE("the embedding is split by vocabulary rows, padded to a multiple of 128 x tp; the padding is in no file") {
  gpt_config m = shape();
  m.vocab = 250;  // 256 rows at tp 2 (128 each; rank 1 holds 122 real rows), 512 at tp 4 (rank 2 holds 0)
  const std::size_t c = 64;
  for (int tp : {1, 2, 4}) {
    std::vector<float> whole(250 * c);
    std::iota(whole.begin(), whole.end(), 1.0f);
    std::vector<float> rebuilt(whole.size(), 0.0f);
    const std::size_t per = (tp == 4 ? 512u : 256u) / static_cast<std::size_t>(tp);
    for (int r = 0; r < tp; ++r) {
      const auto specs = rank_parameters(m, model_place{.tp_rank = r, .tp = tp});
      const param_spec& wte = specs.front();
      REQUIRE(wte.name == "wte.weight");
      CHECK(wte.split == tp_split::vocab_rows);
      CHECK(wte.whole == std::vector<std::int64_t>{250, 64});
      CHECK(wte.local_elements == per * c);
      std::vector<float> local(wte.local_elements, 0.0f);
      cut_local(wte, r, tp, whole, local);
      // Local row i is token r * per + i; padded rows stay zero.
      for (std::size_t i = 0; i < per; ++i) {
        const std::size_t token = static_cast<std::size_t>(r) * per + i;
        INFO("tp " << tp << " rank " << r << " row " << i);
        REQUIRE(local[i * c] == (token < 250 ? whole[token * c] : 0.0f));
      }
      place_local(wte, r, tp, local, rebuilt);
    }
    CHECK(rebuilt == whole);
  }
  // --make-vocab-size-divisible-by changes the multiple.
  m.vocab_divisible_by = 1;
  CHECK(rank_parameters(m, model_place{.tp_rank = 0, .tp = 2}).front().local_elements == 125 * c);
}

TEST_CASE("a tp slice, or a shard of one, as boxes of the whole tensor: q, k and v apart, no padding") {
  gpt_config m = shape();
  m.vocab = 250;  // padded rows at every tp
  for (int tp : {1, 2, 4})
    for (int r = 0; r < tp; ++r)
      for (const param_spec& p : rank_parameters(m, model_place{.tp_rank = r, .tp = tp})) {
        // The whole index of each local element, from the run description (padding: -1).
        std::vector<std::int64_t> expected(p.local_elements, -1);
        for_each_local_run(p, r, tp, [&](std::size_t w, std::size_t l, std::size_t n) {
          for (std::size_t i = 0; i < n; ++i) expected[l + i] = static_cast<std::int64_t>(w + i);
        });
        const auto n = static_cast<std::int64_t>(p.local_elements);
        // The whole part, and shards that start and end inside rows and inside q, k, v blocks.
        for (const auto& [begin, end] : std::vector<std::pair<std::int64_t, std::int64_t>>{
                 {0, n}, {0, n / 3 + 5}, {n / 3 + 5, 2 * n / 3 + 1}, {2 * n / 3 + 1, n}, {7, 8}, {n - 1, n}}) {
          INFO(p.name << " tp " << tp << " rank " << r << " elements [" << begin << ", " << end << ")");
          std::vector<int> seen(p.local_elements, 0);
          const auto boxes = whole_boxes(p, r, tp, begin, end);
          for (const held_box& box : boxes) {
            REQUIRE(weft::checkpoint::element_count(box.local) == weft::checkpoint::element_count(box.whole));
            // Both boxes row-major, element by element.
            std::vector<std::int64_t> local, whole;
            for_each_box_run(local_shape(p, tp), box.local, [&](std::int64_t flat, std::int64_t, std::int64_t k) {
              for (std::int64_t i = 0; i < k; ++i) local.push_back(flat + i);
            });
            for_each_box_run(p.whole, box.whole, [&](std::int64_t flat, std::int64_t, std::int64_t k) {
              for (std::int64_t i = 0; i < k; ++i) whole.push_back(flat + i);
            });
            REQUIRE(local.size() == whole.size());
            std::size_t wrong = 0;
            for (std::size_t i = 0; i < local.size(); ++i) {
              if (local[i] < begin || local[i] >= end) {
                ++wrong;
                continue;
              }
              wrong += expected[static_cast<std::size_t>(local[i])] != whole[i];
              ++seen[static_cast<std::size_t>(local[i])];
            }
            REQUIRE(wrong == 0);
          }
          std::size_t miscounted = 0;  // real elements of the range once, padding never
          for (std::int64_t i = begin; i < end; ++i)
            miscounted += seen[static_cast<std::size_t>(i)] != (expected[static_cast<std::size_t>(i)] >= 0 ? 1 : 0);
          CHECK(miscounted == 0);
          // A whole tp slice of c_attn is one box per block (q, k, v), each contiguous in the whole tensor's columns.
          if (begin == 0 && end == n && p.role == param_role::attn_w) CHECK(boxes.size() == 3);
        }
      }
}

TEST_CASE("a box's elements are consecutive in the tensor only when it is a run of rows or part of one row") {
  const std::vector<std::int64_t> shape{4, 6};
  CHECK(contiguous_start(shape, {{1, 0}, {2, 6}}) == std::optional<std::int64_t>(6));
  CHECK(contiguous_start(shape, {{2, 1}, {1, 3}}) == std::optional<std::int64_t>(13));
  CHECK(!contiguous_start(shape, {{0, 0}, {2, 3}}).has_value());
  std::vector<std::int64_t> runs;
  for_each_box_run(shape, {{1, 2}, {2, 3}}, [&](std::int64_t flat, std::int64_t packed, std::int64_t n) {
    runs.insert(runs.end(), {flat, packed, n});
  });
  CHECK(runs == std::vector<std::int64_t>{8, 0, 3, 14, 3, 3});
}

namespace {
// Two ranks of a small CPU-like machine (numbers of the order weft-plan --probe measures here).
weft::tune::measured_hardware two_ranks(double memory_bytes) {
  weft::tune::measured_hardware hw;
  hw.name = "test";
  hw.ranks_per_node = 2;
  hw.memory_bytes = memory_bytes;
  hw.memory_bandwidth = 5e9;
  hw.gemm_peak_flops = 5e10;
  hw.gemm_half_size = 32;
  hw.gemm_samples = {{64, 3e10}, {256, 4.5e10}};
  hw.intra_node = {2e9, 2e9, 2e9, 5e-6, {}};
  hw.across_nodes = hw.intra_node;
  hw.p2p_bandwidth = 2e9;
  hw.p2p_latency = 5e-6;
  return hw;
}
// The least memory any layout of `mode` needs (the search's closest layout when nothing fits).
double least_memory(const gpt_config& m, weft::tune::recompute mode) {
  const auto hw = two_ranks(1);
  weft::tune::search_options o{.top = 1, .software = tuner_software(), .calib = weft::tune::calibration_of(hw)};
  o.fixed.recompute_mode = mode;
  const auto r = weft::tune::search(tuner_model(m), weft::tune::cluster_of(hw), {.global_batch = 4}, o);
  REQUIRE(r.smallest.has_value());
  return r.smallest->memory.total;
}
}  // namespace

TEST_CASE("the tuner is told train_gpt runs selective and full recomputation, so --plan may choose them") {
  const weft::tune::software_desc sw = tuner_software();
  CHECK(sw.selective_recompute);
  gpt_config m{4, 256, 4, 256, 512, 512};  // long sequences: activations dominate the memory
  const double none = least_memory(m, weft::tune::recompute::none);
  const double full = least_memory(m, weft::tune::recompute::full);
  REQUIRE(full < none);
  // Memory between the two: only recomputation fits, and the plan says so.
  const double headroom = 1 - weft::tune::calibration_of(two_ranks(1)).memory_headroom;
  const planned_layout chosen = plan_layout(m, two_ranks((none + full) / 2 / headroom), 4);
  CHECK(chosen.layout.recompute_mode != weft::tune::recompute::none);
  CHECK_THAT(chosen.report, Catch::Contains("recompute=full") || Catch::Contains("recompute=selective"));
  // With memory to spare it keeps every activation (recomputation only costs time).
  CHECK(plan_layout(m, two_ranks(1e12), 4).layout.recompute_mode == weft::tune::recompute::none);
}

TEST_CASE("train_gpt's --plan for a mixture of experts: a layout the tuner ranks first for the MoE model, experts over ep") {
  // The description train_gpt_vs_torch.moe.np4 plans its --plan layout with, and that test's model.
  const weft::tune::measured_hardware hw = weft::tune::read_hardware(WEFT_TRAIN_GPT_TEST_DIR "/moe_plan_hardware.json");
  gpt_config m = shape();  // 4 layers, hidden 64, 4 heads, vocabulary 256, sequences of 32
  m.moe_experts = 4, m.moe_top_k = 2, m.moe_every = 2;
  // The tuner's own words for this model: GPT-2 whose blocks 0 and 2 route each token to 2 of 4
  // experts of GPT-2's MLP.
  const weft::tune::model_desc moe{.layers = 4, .hidden = 64, .heads = 4, .vocab = 256, .seq = 32,
                                   .tied_embeddings = true, .experts = 4, .top_k = 2, .moe_every = 2};
  const weft::tune::search_options options{.top = 8, .software = tuner_software(true), .calib = weft::tune::calibration_of(hw)};
  const weft::tune::search_result ranked = weft::tune::search(moe, weft::tune::cluster_of(hw), {.global_batch = 4}, options);
  REQUIRE(!ranked.plans.empty());
  const planned_layout chosen = plan_layout(m, hw, 4);
  bool first = false;  // plans tied with the first are first too
  for (const weft::tune::plan& p : ranked.plans)
    first = first || (p.time.step == ranked.plans.front().time.step && p.config.parallel.tp == chosen.layout.parallel.tp &&
                      p.config.parallel.cp == chosen.layout.parallel.cp && p.config.parallel.pp == chosen.layout.parallel.pp &&
                      p.config.parallel.dp == chosen.layout.parallel.dp && p.config.parallel.ep == chosen.layout.parallel.ep &&
                      p.config.parallel.virtual_stages == chosen.layout.parallel.virtual_stages &&
                      p.config.micro_batch == chosen.layout.micro_batch &&
                      p.config.sharding_mode == chosen.layout.sharding_mode &&
                      p.config.recompute_mode == chosen.layout.recompute_mode);
  CHECK(first);
  CHECK(chosen.layout.parallel.ep == 4);  // on this description the experts spread over every rank
  // Experts held by their ep rank alone: ZeRO-2, ZeRO-3 and HSDP are refused with them, so no
  // plan of an MoE model shards more than the optimizer state (a dense model's may).
  for (const weft::tune::plan& p : ranked.plans) CHECK(p.config.sharding_mode <= weft::tune::sharding::optimizer);
  CHECK(tuner_software(false).max_sharding == weft::tune::sharding::full);
  CHECK_THAT(chosen.report, Catch::Contains("ep=4"));
  // train_gpt runs each expert whole on every tp rank: the tuner is told not to fold expert-tp
  // below tp (software that folds gets such layouts from the same search).
  weft::tune::search_options folded = options;
  folded.fixed.tp = 2, folded.fixed.expert_tp = 1;
  CHECK(weft::tune::search(moe, weft::tune::cluster_of(hw), {.global_batch = 4}, folded).plans.empty());
  folded.software.expert_tp_folding = true;
  CHECK(!weft::tune::search(moe, weft::tune::cluster_of(hw), {.global_batch = 4}, folded).plans.empty());
}

TEST_CASE("an MoE model's blocks i % moe_every == 0 hold a router and E experts, named as issue 23 writes them") {
  gpt_config m = shape();  // 4 layers, hidden 64
  m.moe_experts = 3, m.moe_top_k = 2, m.moe_every = 2;
  std::map<std::string, std::vector<std::int64_t>> whole;
  for (const param_spec& p : whole_parameters(m)) whole[p.name] = p.whole;
  for (int layer : {0, 2}) {
    const std::string h = "h." + std::to_string(layer) + ".mlp.";
    CHECK(whole.count(h + "c_fc.weight") == 0);
    CHECK(whole.at(h + "router.weight") == std::vector<std::int64_t>{3, 64});
    for (int e = 0; e < 3; ++e) {
      const std::string x = h + "experts." + std::to_string(e) + ".";
      CHECK(whole.at(x + "c_fc.weight") == std::vector<std::int64_t>{64, 256});  // GPT-2's Conv1D: [in, out]
      CHECK(whole.at(x + "c_fc.bias") == std::vector<std::int64_t>{256});
      CHECK(whole.at(x + "c_proj.weight") == std::vector<std::int64_t>{256, 64});
      CHECK(whole.at(x + "c_proj.bias") == std::vector<std::int64_t>{64});
    }
    CHECK(whole.count(h + "experts.3.c_fc.weight") == 0);
  }
  for (int layer : {1, 3}) {  // dense blocks keep GPT-2's MLP
    CHECK(whole.count("h." + std::to_string(layer) + ".mlp.c_fc.weight") == 1);
    CHECK(whole.count("h." + std::to_string(layer) + ".mlp.router.weight") == 0);
  }
  std::int64_t total = 0;
  for (const auto& [name, dims] : whole) total += elements_of(dims);
  CHECK(total == m.parameter_count());
  // Whole on every tp rank (each routes the same rows), and the metadata --init-from reads back.
  for (const param_spec& p : rank_parameters(m, {.tp_rank = 1, .tp = 2}))
    if (moe_param(p)) CHECK((p.split == tp_split::replicated && p.local_elements == static_cast<std::size_t>(elements_of(p.whole))));
  const auto meta = config_metadata(m);
  CHECK(meta.at("num_local_experts") == "3");
  CHECK(meta.at("num_experts_per_tok") == "2");
  CHECK(meta.at("moe_every") == "2");
  weft::checkpoint::checkpoint_file f{meta, {}};
  f.tensors.push_back(weft::checkpoint::make_record<float>("wte.weight", {256, 64}, std::vector<float>(256 * 64)));
  f.tensors.push_back(weft::checkpoint::make_record<float>("wpe.weight", {64, 64}, std::vector<float>(64 * 64)));
  const gpt_config read = config_from_file(f, "moe.safetensors", 32);
  CHECK(read.moe_experts == 3);
  CHECK(read.moe_top_k == 2);
  CHECK(read.moe_every == 2);
  CHECK(config_metadata(shape()).count("num_local_experts") == 0);  // dense files keep GPT-2's names only
}

TEST_CASE("an ep rank holds its E / ep experts of every MoE block alone; the router and the rest on every ep rank") {
  gpt_config m = shape();  // 4 layers, hidden 64
  m.moe_experts = 4, m.moe_top_k = 2, m.moe_every = 2;
  const std::int64_t expert = 64 * 256 + 256 + 256 * 64 + 64;  // c_fc and c_proj, weights and biases
  for (int ep : {1, 2, 4}) {
    std::map<std::string, int> holders;
    for (int r = 0; r < ep; ++r) {
      std::int64_t held = 0;
      for (const param_spec& p : rank_parameters(m, {.ep_rank = r, .ep = ep})) {
        ++holders[p.name];
        held += static_cast<std::int64_t>(p.local_elements);
        // Rank r's experts are weft::moe's: r * E / ep .. (r + 1) * E / ep - 1.
        if (p.expert >= 0) CHECK(p.expert / (4 / ep) == r);
      }
      // The dense part, then 2 MoE blocks of E / ep experts each.
      CHECK(held == m.parameter_count() - 2 * 4 * expert + 2 * (4 / ep) * expert);
    }
    for (const param_spec& p : whole_parameters(m))
      CHECK(holders.at(p.name) == (p.expert >= 0 ? 1 : ep));
  }
}
