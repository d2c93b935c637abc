#pragma once
// weft-plan's command line: read and checked without printing or exiting, so the program and the
// fuzzing harness (tests/fuzz) call the same code. Every number has a range, named when refused.

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/tune/hardware_file.hpp>
#include <weft/tune/report.hpp>

#include "command_line.hpp"

namespace weft_plan {

using namespace weft::tune;

inline constexpr const char* usage = R"(usage: weft-plan [model] [cluster] [job] [options]
model:   --model NAME (gpt3-175b, llama2-7b, llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b,
         mixtral-8x22b, qwen3-30b-a3b, qwen3-235b-a22b) or
         --layers L --hidden H --heads A [--kv-heads K] [--head-dim D] [--ffn F] [--swiglu] --seq S
         --vocab V [--params P] [--tied-embeddings] [--dropout]   (fields given after --model override it)
         mixture of experts: --moe-experts E [--moe-top-k K (2)] [--moe-every N (1: layers i with
         i % N == 0 are MoE)] [--moe-ffn F (one expert's MLP size; --ffn)] [--moe-shared-experts S]
cluster: --gpu NAME (A100-40GB, A100-80GB, H100, H200, B200, L40S) --gpus N [--gpus-per-node G]
         or --cluster small|large --gpus N (the reference clusters: 4 x A100 80GB nodes with
         200 Gb/s per node, or 8 x H100 nodes with 400 Gb/s per GPU; --gpu is then optional)
         [--nvlink-gbytes X] [--network-gbits X] [--oversubscription X]
         or --hardware FILE [--gpus N]: a description written by --probe (N defaults to its ranks)
job:     --global-batch B (sequences) | --global-batch-tokens T; [--tokens T] [--price P per GPU-hour]
         [--fp8]   numbers accept K, M, B/G, T suffixes (1T = 1e12)
layout (evaluate instead of search; unset fields are searched):
         --tp --pp --dp --cp --vp --micro-batch N --recompute none|selective|full
         --sharding none|optimizer|gradients|full --ep --expert-tp (mixtures of experts)
options: --top K (5) --explain --json --uneven-stages
         --no-flash --no-sequence-parallel --no-interleaving --no-context-parallel --no-overlap
         --max-sharding none|optimizer|gradients|full
         --claim-days D   check a claimed training time for --tokens: implied MFU and the model's days
         --validate CSV   compare the model with published runs (docs/tuning.md)
         --probe FILE     measure the ranks this runs on (under mpiexec / srun, with the model's
                          flags: GEMMs at its shapes) and write the description --hardware reads
limits:  GPUs and degrees up to 1048576, 1024 GPUs per node, layers and heads up to 65536, hidden,
         FFN, sequence and vocabulary up to 16777216 (16M), global batch up to 16M sequences
exit status: 0 ok, 1 an unexpected failure (one line), 2 bad input or invalid layout,
             3 nothing fits in memory
)";

/// Bad input: the message, one line, exit status 2.
[[noreturn]] inline void bad_input(const std::string& message) { throw weft_programs::usage_error(message); }

// Numbers take a decimal suffix: 7B parameters, 15T tokens, 32K sequences.
inline constexpr weft_programs::unit_suffix decimal_suffixes[] = {{"K", 1e3}, {"k", 1e3}, {"M", 1e6},
                                                                  {"B", 1e9}, {"G", 1e9}, {"T", 1e12}};

/// The ranges: far above any cluster or model trained, far below where the cost model's
/// arithmetic or the search's enumeration would overflow or run for long.
inline constexpr double max_gpus = 1 << 20;
inline constexpr double max_gpus_per_node = 1024;
inline constexpr double max_layers = 1 << 16;
inline constexpr double max_width = 1 << 24;  ///< hidden, FFN, sequence, vocabulary
inline constexpr double max_global_batch = 1 << 24;

inline double parse_number(std::string_view flag, const std::string& text, double low, double high) {
  return weft_programs::parse_real(flag, text, low, high, decimal_suffixes);
}

/// A whole number from `low` to `high`, suffixes allowed ("4K").
inline int parse_count(std::string_view flag, const std::string& text, double high, double low = 1) {
  const double v = parse_number(flag, text, low, high);
  if (v != std::floor(v)) bad_input(std::string(flag) + " needs a whole number, got '" + text + "'");
  return static_cast<int>(v);
}

/// The nearest valid spelling of `text` among the names of a list such as gpu_preset_names.
inline std::string suggestion(std::string_view text, std::string_view names) {
  return weft_programs::did_you_mean(text, weft_programs::listed_words(names));
}

struct arguments {
  std::map<std::string, std::string, std::less<>> values;
  std::map<std::string, bool, std::less<>> flags;
  bool has(std::string_view k) const { return values.count(k) > 0; }
  const std::string& get(std::string_view k) const { return values.find(k)->second; }
};

inline arguments parse(int argc, const char* const* argv) {
  static const std::vector<std::string_view> with_value = {
      "--model", "--cluster", "--layers", "--hidden", "--heads", "--kv-heads", "--head-dim", "--ffn", "--seq", "--vocab",
      "--params", "--moe-experts", "--moe-top-k", "--moe-every", "--moe-ffn", "--moe-shared-experts", "--ep", "--expert-tp",
      "--gpu",
      "--gpus", "--gpus-per-node", "--nvlink-gbytes", "--network-gbits", "--oversubscription", "--global-batch",
      "--global-batch-tokens", "--tokens", "--price", "--tp", "--pp", "--dp", "--cp", "--vp", "--micro-batch",
      "--recompute", "--sharding", "--top", "--claim-days", "--validate", "--max-sharding", "--probe", "--hardware"};
  static const std::vector<std::string_view> switches = {
      "--swiglu", "--tied-embeddings", "--dropout", "--fp8", "--explain", "--json", "--uneven-stages", "--no-flash",
      "--no-sequence-parallel", "--no-interleaving", "--no-context-parallel", "--no-overlap", "--help", "-h"};
  arguments a;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    bool known = false;
    for (std::string_view s : switches)
      if (arg == s) a.flags[std::string(arg)] = known = true;
    for (std::string_view v : with_value)
      if (arg == v) {
        if (i + 1 >= argc) bad_input(std::string(arg) + " needs a value");
        a.values[std::string(arg)] = argv[++i];
        known = true;
      }
    if (!known) {
      std::vector<std::string_view> all = with_value;
      all.insert(all.end(), switches.begin(), switches.end());
      bad_input("unknown option '" + std::string(arg) + "'" + weft_programs::did_you_mean(arg, all) + " (see --help)");
    }
  }
  return a;
}

inline model_desc read_model(const arguments& a) {
  model_desc m;
  if (a.has("--model")) {
    auto preset = model_preset(a.get("--model"));
    if (!preset)
      bad_input("unknown model '" + a.get("--model") + "'" + suggestion(a.get("--model"), model_preset_names) +
                "; known: " + std::string(model_preset_names));
    m = *preset;
  }
  if (a.has("--layers")) m.layers = parse_count("--layers", a.get("--layers"), max_layers);
  if (a.has("--hidden")) m.hidden = parse_count("--hidden", a.get("--hidden"), max_width);
  if (a.has("--heads")) m.heads = parse_count("--heads", a.get("--heads"), max_layers);
  if (a.has("--kv-heads")) m.kv_heads = parse_count("--kv-heads", a.get("--kv-heads"), max_layers);
  if (a.has("--ffn")) m.ffn = parse_count("--ffn", a.get("--ffn"), max_width);
  if (a.has("--head-dim")) m.head_dim = parse_count("--head-dim", a.get("--head-dim"), max_width);
  if (a.has("--moe-experts")) m.experts = parse_count("--moe-experts", a.get("--moe-experts"), max_layers);
  if (a.has("--moe-top-k")) m.top_k = parse_count("--moe-top-k", a.get("--moe-top-k"), max_layers);
  if (a.has("--moe-every")) m.moe_every = parse_count("--moe-every", a.get("--moe-every"), max_layers);
  if (a.has("--moe-ffn")) m.expert_ffn = parse_count("--moe-ffn", a.get("--moe-ffn"), max_width);
  if (a.has("--moe-shared-experts"))
    m.shared_experts = parse_count("--moe-shared-experts", a.get("--moe-shared-experts"), max_layers, 0);
  if (a.has("--seq")) m.seq = parse_count("--seq", a.get("--seq"), max_width);
  if (a.has("--vocab")) m.vocab = parse_count("--vocab", a.get("--vocab"), max_width);
  if (a.has("--params")) m.params = parse_number("--params", a.get("--params"), 0, 1e16);
  if (a.flags.count("--swiglu")) m.swiglu = true;
  if (a.flags.count("--tied-embeddings")) m.tied_embeddings = true;
  if (a.flags.count("--dropout")) m.dropout = true;
  try {
    check_model(m);
  } catch (const weft::error& e) {
    bad_input(e.what());
  }
  return m;
}

/// The measured hardware of --hardware FILE, once read.
inline std::optional<measured_hardware> read_measured(const arguments& a) {
  if (!a.has("--hardware")) return std::nullopt;
  if (a.has("--gpu") || a.has("--cluster")) bad_input("--hardware replaces --gpu and --cluster: give one of them");
  try {
    return read_hardware(a.get("--hardware"));
  } catch (const weft::error& e) {
    bad_input(e.what());
  }
}

inline cluster_desc read_cluster(const arguments& a, const std::optional<measured_hardware>& measured) {
  if (measured) {
    cluster_desc c = cluster_of(*measured);
    if (a.has("--gpus")) {
      const int ranks = parse_count("--gpus", a.get("--gpus"), max_gpus);
      if (ranks % c.node.gpus_per_node != 0)
        bad_input("--gpus " + std::to_string(ranks) + " is not a whole number of the description's nodes of " +
                  std::to_string(c.node.gpus_per_node) + " ranks");
      c.nodes = ranks / c.node.gpus_per_node;
    }
    return c;
  }
  cluster_desc c;
  if (a.has("--cluster")) {
    if (a.get("--cluster") == "small") c = small_reference_cluster(1);
    else if (a.get("--cluster") == "large") c = large_reference_cluster(1);
    else bad_input("--cluster must be small or large, got '" + a.get("--cluster") + "'" + suggestion(a.get("--cluster"), "small, large"));
  }
  if (a.has("--gpu") || !a.has("--cluster")) {
    if (!a.has("--gpu")) bad_input("--gpu is required; known: " + std::string(gpu_preset_names));
    auto gpu = gpu_preset(a.get("--gpu"));
    if (!gpu)
      bad_input("unknown GPU '" + a.get("--gpu") + "'" + suggestion(a.get("--gpu"), gpu_preset_names) +
                "; known: " + std::string(gpu_preset_names));
    if (a.has("--cluster")) c.gpu = *gpu;
    else c = dgx_cluster(*gpu, 1);
  }
  if (!a.has("--gpus")) bad_input("--gpus (the number of GPUs) is required");
  const int gpus = parse_count("--gpus", a.get("--gpus"), max_gpus);
  if (a.has("--gpus-per-node"))
    c.node.gpus_per_node = parse_count("--gpus-per-node", a.get("--gpus-per-node"), max_gpus_per_node);
  if (gpus < c.node.gpus_per_node) c.node.gpus_per_node = gpus;  // a partial node
  if (gpus % c.node.gpus_per_node != 0)
    bad_input("--gpus " + std::to_string(gpus) + " is not a whole number of nodes of " +
              std::to_string(c.node.gpus_per_node) + " GPUs; use " +
              std::to_string(gpus / c.node.gpus_per_node * c.node.gpus_per_node) + " or " +
              std::to_string((gpus / c.node.gpus_per_node + 1) * c.node.gpus_per_node));
  c.nodes = gpus / c.node.gpus_per_node;
  // Bandwidths above 1 PB/s or 1 Pb/s are typos; oversubscription above 1000 is no network.
  if (a.has("--nvlink-gbytes"))
    c.node.intra_bandwidth = parse_number("--nvlink-gbytes", a.get("--nvlink-gbytes"), 1e-3, 1e6) * 1e9;
  if (a.has("--network-gbits"))
    c.node.network_bandwidth = parse_number("--network-gbits", a.get("--network-gbits"), 1e-3, 1e6) * 1e9 / 8;
  if (a.has("--oversubscription"))
    c.oversubscription = parse_number("--oversubscription", a.get("--oversubscription"), 1, 1000);
  return c;
}

inline job_desc read_job(const arguments& a) {
  job_desc j;
  if (a.has("--global-batch")) j.global_batch = parse_count("--global-batch", a.get("--global-batch"), max_global_batch);
  if (a.has("--global-batch-tokens"))
    j.global_batch_tokens = parse_number("--global-batch-tokens", a.get("--global-batch-tokens"), 1, max_global_batch * max_width);
  if (j.global_batch <= 0 && j.global_batch_tokens <= 0)
    bad_input("--global-batch (sequences per step) or --global-batch-tokens is required");
  if (a.has("--tokens")) j.tokens = parse_number("--tokens", a.get("--tokens"), 0, 1e18);
  if (a.has("--price")) j.price_per_gpu_hour = parse_number("--price", a.get("--price"), 0, 1e6);
  if (a.flags.count("--fp8")) j.gemm_precision = precision::fp8;
  return j;
}

inline search_options read_options(const arguments& a) {
  search_options o;
  if (a.has("--top")) o.top = parse_count("--top", a.get("--top"), 64);
  o.allow_uneven_stages = a.flags.count("--uneven-stages") > 0;
  software_desc& s = o.software;
  s.flash_attention = !a.flags.count("--no-flash");
  s.sequence_parallel = !a.flags.count("--no-sequence-parallel");
  s.interleaved_schedule = !a.flags.count("--no-interleaving");
  s.context_parallel = !a.flags.count("--no-context-parallel");
  s.overlap_dp = !a.flags.count("--no-overlap");
  constexpr std::string_view sharding_names = "none, optimizer, gradients, full";
  if (a.has("--max-sharding")) {
    auto sh = parse_sharding(a.get("--max-sharding"));
    if (!sh)
      bad_input("--max-sharding must be none, optimizer, gradients or full, got '" + a.get("--max-sharding") + "'" +
                suggestion(a.get("--max-sharding"), sharding_names));
    s.max_sharding = *sh;
  }
  layout_constraint& f = o.fixed;
  if (a.has("--tp")) f.tp = parse_count("--tp", a.get("--tp"), max_gpus);
  if (a.has("--pp")) f.pp = parse_count("--pp", a.get("--pp"), max_gpus);
  if (a.has("--dp")) f.dp = parse_count("--dp", a.get("--dp"), max_gpus);
  if (a.has("--cp")) f.cp = parse_count("--cp", a.get("--cp"), max_gpus);
  if (a.has("--ep")) f.ep = parse_count("--ep", a.get("--ep"), max_gpus);
  if (a.has("--expert-tp")) f.expert_tp = parse_count("--expert-tp", a.get("--expert-tp"), max_gpus);
  if (a.has("--vp")) f.vp = parse_count("--vp", a.get("--vp"), max_layers);
  if (a.has("--micro-batch")) f.micro_batch = parse_count("--micro-batch", a.get("--micro-batch"), max_global_batch);
  if (a.has("--recompute")) {
    f.recompute_mode = parse_recompute(a.get("--recompute"));
    if (!f.recompute_mode)
      bad_input("--recompute must be none, selective or full, got '" + a.get("--recompute") + "'" +
                suggestion(a.get("--recompute"), "none, selective, full"));
  }
  if (a.has("--sharding")) {
    f.sharding_mode = parse_sharding(a.get("--sharding"));
    if (!f.sharding_mode)
      bad_input("--sharding must be none, optimizer, gradients or full, got '" + a.get("--sharding") + "'" +
                suggestion(a.get("--sharding"), sharding_names));
  }
  return o;
}

}  // namespace weft_plan
