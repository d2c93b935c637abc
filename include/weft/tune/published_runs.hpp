#pragma once
/// \file
/// Published training runs (tests/tune/data/published_runs.csv) and the checks of the cost model
/// against them: (a) the predicted MFU of each run's own layout against its published MFU, counted
/// the way the source counts FLOPs; (b) the layout the search picks from the model, GPU type and
/// count and global batch alone, against the experts' layout; (c) the fit of the calibration
/// constants, and leave-one-source-out validation (fit without a source, predict it).

#include <cctype>
#include <cmath>
#include <algorithm>
#include <fstream>
#include <istream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/tune/search.hpp>

namespace weft::tune {

/// One row of published_runs.csv, with what it leaves out filled from the source (see
/// software_of) or left free (0 / empty in `published`).
struct published_run {
  std::string source;            ///< N21, MLM24, BLOOM, NEOX, TT-A100
  std::string name;              ///< the model's name
  model_desc model;
  gpu_desc gpu;
  int gpus = 0;
  layout_constraint published;   ///< the published layout; unstated fields are 0 / empty
  int global_batch = 0;
  double published_mfu = 0;      ///< fraction of peak, in the source's own FLOP count
  std::string confidence;
  precision gemm_precision = precision::bf16;  ///< fp8 where the GPU column says so ("H100 (FP8)")
};

namespace detail {

inline std::vector<std::string> split_csv_line(const std::string& line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (char ch : line) {
    if (ch == '"') quoted = !quoted;
    else if (ch == ',' && !quoted) fields.emplace_back();
    else if (ch != '\r') fields.back() += ch;
  }
  return fields;
}

/// The number a field starts with ("64 (FSDP2)" -> 64, "~37.5% of 312" -> 37.5, "local bs 1" -> 1),
/// or 0 when it states none ("?", empty).
inline double leading_number(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size() && !(std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == text.size()) return 0;
  return std::strtod(std::string(text.substr(i)).c_str(), nullptr);
}

inline bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }
inline bool contains(std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; }

}  // namespace detail

/// The training software each source used, as the source describes it. N21: Megatron-LM of 2021
/// (no fused attention, no sequence parallelism, gradients all-reduced after the backward pass, no
/// optimizer sharding, dropout 0.1). MLM24: Megatron-Core of 2024 (fused attention, sequence
/// parallelism, distributed optimizer, data- and tensor-parallel communication overlapped with
/// compute, as its README states). BLOOM and NEOX:
/// Megatron-DeepSpeed / GPT-NeoX of 2022 (ZeRO-1, plain 1F1B, no overlap, no fused attention;
/// BLOOM's bf16 optimizer accumulates gradients in fp32 copies and keeps the bf16 ones too;
/// its partition also balances the end stages, which is not applied: docs/tuning.md, "(d)").
/// MTNLG: DeepSpeed's pipeline of 2021 with Megatron's tensor slicing. LLAMA3: Meta's 4D stack
/// of 2024, with balanced end stages. NEMO4: Megatron-Core, as MLM24.
/// TT: torchtitan of 2024 (FSDP2, fused attention, overlapped).
inline software_desc software_of(std::string_view source) {
  if (source == "N21")
    return {.flash_attention = false, .sequence_parallel = false, .interleaved_schedule = true,
            .context_parallel = false, .overlap_dp = false, .max_sharding = sharding::none,
            .selective_recompute = false, .gradient_bytes = 2};
  if (source == "BLOOM")  // DeepSpeed's bf16 optimizer: bf16 gradients kept beside their fp32 accumulation
    return {.flash_attention = false, .sequence_parallel = false, .interleaved_schedule = false,
            .context_parallel = false, .overlap_dp = false, .max_sharding = sharding::optimizer,
            .selective_recompute = false, .gradient_bytes = 4, .low_precision_gradient_bytes = 2};
  if (source == "NEOX")
    return {.flash_attention = false, .sequence_parallel = false, .interleaved_schedule = false,
            .context_parallel = false, .overlap_dp = false, .max_sharding = sharding::optimizer,
            .selective_recompute = false, .gradient_bytes = 2};
  // Megatron-Core's MoE runs (its MoE README, 2024; Megatron-Bridge's performance pages, 2025) run
  // the same stack as MLM24, with the distributed optimizer.
  // MT-NLG (2021): Megatron's tensor slicing inside DeepSpeed's pipeline engine, of N21's era and
  // precision, with DeepSpeed's plain 1F1B schedule (no virtual stages) and no overlap.
  if (source == "MTNLG")
    return {.flash_attention = false, .sequence_parallel = false, .interleaved_schedule = false,
            .context_parallel = false, .overlap_dp = false, .max_sharding = sharding::optimizer,
            .selective_recompute = false, .gradient_bytes = 2};
  // Llama 3 (2024): Meta's 4D stack: tp with sequence parallelism, all-gather context parallelism,
  // interleaved 1F1B, and FSDP that keeps the weights gathered between forward and backward
  // (ZeRO-2 at most).
  if (source == "LLAMA3")
    return {.flash_attention = true, .sequence_parallel = true, .interleaved_schedule = true, .context_parallel = true,
            .overlap_dp = true, .max_sharding = sharding::gradients, .balanced_end_stages = true};
  // Nemotron-4 340B (2024) was trained with Megatron-Core, the same stack as MLM24.
  if (source == "MLM24" || source == "NEMO4" || source == "MCORE-MOE" || detail::starts_with(source, "MB"))
    return {.flash_attention = true, .sequence_parallel = true, .interleaved_schedule = true, .overlap_dp = true,
            .overlap_tp = true, .max_sharding = sharding::optimizer};
  return {.flash_attention = true, .sequence_parallel = true, .interleaved_schedule = true, .context_parallel = false,
          .overlap_dp = true, .max_sharding = sharding::full};
}

/// FLOPs per token as the source counts them (see the data README): N21 and MLM24 count model
/// FLOPs as Korthikanti et al. (72 l h^2 (1 + s/6h + V/12lh) per sequence token), BLOOM 6 N,
/// torchtitan 6 N + 12 l h s; GPT-NeoX's figure is taken as the same count as N21's.
inline double source_flops_per_token(const published_run& run) {
  if (run.source == "BLOOM") return 6 * param_count(run.model);
  if (detail::starts_with(run.source, "TT"))
    return 6 * param_count(run.model) + 12.0 * run.model.layers * run.model.hidden * run.model.seq;
  return model_flops_per_token(run.model);
}

/// Parses published_runs.csv. Fields the file leaves blank that are facts of the model (Llama 3's
/// gated MLP, its MLP sizes and vocabulary) are filled from the model's public configuration;
/// tied embeddings and dropout follow each source's recipe. Throws weft::error on a malformed file.
inline std::vector<published_run> read_published_runs(std::istream& in) {
  std::string line;
  if (!std::getline(in, line)) fail("tune: published runs: empty file");
  const std::vector<std::string> header = detail::split_csv_line(line);
  constexpr std::size_t absent = static_cast<std::size_t>(-1);
  auto optional_column = [&](std::string_view name) -> std::size_t {
    for (std::size_t i = 0; i < header.size(); ++i)
      if (header[i] == name) return i;
    return absent;
  };
  auto column = [&](std::string_view name) -> std::size_t {
    const std::size_t i = optional_column(name);
    if (i == absent) fail("tune: published runs: no column '" + std::string(name) + "'");
    return i;
  };
  // Mixtures of experts (published_runs_moe.csv): the expert layout and the model's MoE shape.
  const std::size_t c_ep = optional_column("ep"), c_etp = optional_column("expert_tp"),
                    c_experts = optional_column("experts"), c_top_k = optional_column("top_k"),
                    c_every = optional_column("moe_every"), c_expert_ffn = optional_column("expert_ffn"),
                    c_ffn = optional_column("ffn"), c_head_dim = optional_column("head_dim"),
                    c_tokens = optional_column("tokens_per_s_per_gpu");
  const std::size_t c_source = column("source"), c_model = column("model"), c_params = column("params_b"),
                    c_layers = column("layers"), c_hidden = column("hidden"), c_heads = column("heads"),
                    c_kv = column("kv_heads"), c_seq = column("seq"), c_vocab = column("vocab"), c_gpu = column("gpu"),
                    c_gpus = column("n_gpus"), c_tp = column("tp"), c_pp = column("pp"), c_dp = column("dp"),
                    c_cp = column("cp"), c_vp = column("vp"), c_mb = column("micro_batch"),
                    c_gb = column("global_batch"), c_rc = column("recompute"), c_mfu = column("mfu"),
                    c_conf = column("confidence");
  std::vector<published_run> runs;
  while (std::getline(in, line)) {
    if (line.empty() || line == "\r") continue;
    const std::vector<std::string> f = detail::split_csv_line(line);
    if (f.size() < header.size()) fail("tune: published runs: short row: " + line);
    auto num = [&](std::size_t c) { return c == absent ? 0.0 : detail::leading_number(f[c]); };
    auto integer = [&](std::size_t c) { return static_cast<int>(std::lround(num(c))); };
    published_run r;
    r.source = f[c_source];
    r.name = f[c_model];
    r.confidence = f[c_conf];
    model_desc& m = r.model;
    m.layers = integer(c_layers);
    m.hidden = integer(c_hidden);
    m.heads = integer(c_heads);
    m.kv_heads = integer(c_kv);
    m.seq = integer(c_seq);
    m.vocab = integer(c_vocab);
    m.params = num(c_params) * 1e9;
    m.dropout = r.source == "N21";
    m.tied_embeddings = r.source == "N21" || r.source == "BLOOM";
    if (detail::starts_with(r.name, "Llama 3")) {  // Meta's published Llama 3 configuration
      m.swiglu = true;
      m.ffn = m.hidden == 4096 ? 14336 : m.hidden == 16384 ? 53248 : 28672;
      if (m.vocab == 0) m.vocab = 128256;
      m.params = 0;  // derived from the full shape
    }
    if (detail::starts_with(r.name, "Llama 2")) {  // Meta's published Llama 2 configuration (7B, 13B, 70B)
      m.swiglu = true;
      m.ffn = m.hidden == 4096 ? 11008 : m.hidden == 5120 ? 13824 : 28672;
      m.params = 0;
    }
    if (c_experts != absent && num(c_experts) > 0) {  // the model's public configuration, as the row gives it
      m.experts = integer(c_experts);
      m.top_k = integer(c_top_k);
      m.moe_every = std::max(1, integer(c_every));
      m.expert_ffn = integer(c_expert_ffn);
      m.ffn = integer(c_ffn);
      m.head_dim = integer(c_head_dim);
      m.swiglu = true;  // every MoE model in the file has gated experts
      m.params = 0;     // derived from the full shape
    }
    const std::string& gpu = f[c_gpu];
    if (detail::contains(gpu, "FP8")) r.gemm_precision = precision::fp8;
    for (const gpu_desc& g : gpu_presets)
      if (detail::starts_with(gpu, g.name)) r.gpu = g;
    if (r.gpu.name.empty()) fail("tune: published runs: unknown GPU '" + gpu + "'");
    r.gpus = integer(c_gpus);
    layout_constraint& l = r.published;
    l.tp = integer(c_tp);
    l.pp = integer(c_pp);
    l.dp = integer(c_dp);
    l.cp = std::max(1, integer(c_cp));
    l.vp = integer(c_vp);
    l.micro_batch = integer(c_mb);
    l.ep = c_ep == absent ? 0 : integer(c_ep);
    l.expert_tp = c_etp == absent ? 0 : integer(c_etp);
    if (f[c_rc] == "no" || f[c_rc] == "none") l.recompute_mode = recompute::none;
    if (detail::starts_with(f[c_rc], "full")) l.recompute_mode = recompute::full;
    if (detail::starts_with(f[c_rc], "selective")) l.recompute_mode = recompute::selective;
    if (detail::contains(f[c_dp], "FSDP")) l.sharding_mode = sharding::full;
    if (detail::contains(f[c_rc], "ZeRO-1")) l.sharding_mode = sharding::optimizer;
    if (l.pp == 1 && l.vp == 0) l.vp = 1;
    r.global_batch = integer(c_gb);
    r.published_mfu = num(c_mfu) / 100;
    // Sources that give tokens/s and not MFU: the MFU in the tuner's own count (the error is then
    // the ratio of tokens/s, whatever the count), over the bf16 peak.
    if (r.published_mfu <= 0 && num(c_tokens) > 0)
      r.published_mfu = num(c_tokens) * model_flops_per_token(r.model) / r.gpu.peak_bf16;
    if (r.model.layers <= 0 || r.gpus <= 0 || l.tp <= 0 || l.pp <= 0 || l.dp <= 0 || r.global_batch <= 0 ||
        r.published_mfu <= 0)
      fail("tune: published runs: incomplete row: " + line);
    runs.push_back(r);
  }
  return runs;
}

/// Reads published_runs.csv from `path`; throws weft::error if it cannot be opened.
inline std::vector<published_run> read_published_runs(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail("tune: cannot open published runs file '" + path + "'");
  return read_published_runs(in);
}

/// The cluster a run used: DGX-like nodes of its GPU (8 per node, NVSwitch, one InfiniBand port
/// per GPU), the shape of the systems the sources ran on.
inline cluster_desc cluster_of(const published_run& run) {
  return dgx_cluster(run.gpu, (run.gpus + 7) / 8);
}

/// One run checked against the model.
struct run_check {
  plan published;            ///< the published layout as the model predicts it (unstated fields chosen by the model)
  double predicted_mfu = 0;  ///< the prediction in the source's own FLOP count
  double error = 0;          ///< predicted_mfu / published_mfu - 1
  plan chosen;               ///< the search's choice from the model, GPU type and count and batch alone
  plan with_published_tp;    ///< the search's best when held to the published TP degree
  bool same_tp = false;
  bool pp_within_2 = false;
  bool not_worse = false;    ///< the choice's predicted throughput is at least the published layout's
};

/// Checks one run: (a) with its published layout and (b) with a free search.
inline run_check check_run(const published_run& run, const calibration& calib = default_calibration) {
  const cluster_desc cluster = cluster_of(run);
  const job_desc job{.global_batch = run.global_batch, .gemm_precision = run.gemm_precision};
  search_options options{.top = 1, .fixed = run.published, .software = software_of(run.source), .calib = calib};
  // BLOOM's 70 layers on 12 stages; unstated virtual stages must still divide the layers.
  options.allow_uneven_stages = run.model.layers % run.published.pp != 0;
  options.max_vp = std::max(options.max_vp, run.published.vp);  // MB25's 24 virtual stages
  search_result own = search(run.model, cluster, job, options);
  if (own.plans.empty()) fail("tune: the published layout of " + run.name + " does not fit the memory model");
  run_check c;
  c.published = own.plans.front();
  c.predicted_mfu = c.published.tokens_per_s / run.gpus * source_flops_per_token(run) / run.gpu.peak_bf16;
  c.error = c.predicted_mfu / run.published_mfu - 1;
  search_options free{.top = 1, .software = software_of(run.source), .calib = calib};
  search_result chosen = search(run.model, cluster, job, free);
  if (chosen.plans.empty()) {  // e.g. BLOOM: no pipeline depth divides both its 70 layers and 384 GPUs
    free.allow_uneven_stages = true;
    chosen = search(run.model, cluster, job, free);
  }
  if (chosen.plans.empty()) fail("tune: no layout fits for " + run.name);
  c.chosen = chosen.plans.front();
  free.fixed.tp = run.published.tp;
  const search_result same_tp = search(run.model, cluster, job, free);
  c.with_published_tp = same_tp.plans.empty() ? c.published : same_tp.plans.front();
  c.same_tp = c.chosen.config.parallel.tp == run.published.tp;
  c.pp_within_2 = c.chosen.config.parallel.pp * 2 >= run.published.pp && c.chosen.config.parallel.pp <= 2 * run.published.pp;
  c.not_worse = c.chosen.tokens_per_s >= c.published.tokens_per_s * (1 - 1e-9);
  return c;
}

/// The predicted MFU of `run`'s own layout (unstated fields chosen by the search under the
/// source's software), in the source's FLOP count; 0 when the layout does not fit the memory model.
inline double predicted_published_mfu(const published_run& run, const calibration& calib = default_calibration) {
  // Uneven stages only where the published layout has them (BLOOM's 70 layers on 12 stages).
  search_options options{.top = 1, .fixed = run.published, .software = software_of(run.source), .calib = calib,
                         .allow_uneven_stages = run.model.layers % run.published.pp != 0};
  options.max_vp = std::max(options.max_vp, run.published.vp);
  const search_result r =
      search(run.model, cluster_of(run), {.global_batch = run.global_batch, .gemm_precision = run.gemm_precision}, options);
  if (r.plans.empty()) return 0;
  return r.plans.front().tokens_per_s / run.gpus * source_flops_per_token(run) / run.gpu.peak_bf16;
}

/// Mean and worst absolute relative error of predicted MFU over some runs.
struct mfu_error {
  double mean = 1e9;
  double worst = 1e9;
};

/// The MFU error of `calib` on `runs` (both 1e9 when a published layout does not fit).
inline mfu_error mfu_error_of(const std::vector<published_run>& runs, const calibration& calib) {
  mfu_error e{0, 0};
  if (runs.empty()) return e;
  for (const published_run& run : runs) {
    const double mfu = predicted_published_mfu(run, calib);
    if (mfu <= 0) return {};
    const double error = std::abs(mfu / run.published_mfu - 1);
    e.mean += error / static_cast<double>(runs.size());
    e.worst = std::max(e.worst, error);
  }
  return e;
}

/// The values the fit tries for each fitted constant (the memory reserve and headroom are not fitted).
struct calibration_grid {
  std::vector<double> gemm_half_size{64, 128, 192, 256, 384, 512, 768};
  std::vector<double> elementwise_passes{0, 0.5, 1, 1.5, 2, 3, 4};
  std::vector<double> link_efficiency{0.6, 0.7, 0.8, 0.9};
  std::vector<double> gemm_efficiency_ampere = steps(0.55, 0.025, 17);
  std::vector<double> gemm_efficiency_hopper = steps(0.40, 0.025, 17);

  static std::vector<double> steps(double first, double step, int count) {
    std::vector<double> v;
    for (int i = 0; i < count; ++i) v.push_back(first + step * i);
    return v;
  }
};

/// Whether error `a` is better than `b` for the fit: both targets matter, so it minimises the
/// larger of mean / 10 % and worst / 25 %, then the mean.
inline bool better_fit(const mfu_error& a, const mfu_error& b) noexcept {
  const double ka = std::max(a.mean / 0.10, a.worst / 0.25), kb = std::max(b.mean / 0.10, b.worst / 0.25);
  return ka < kb - 1e-12 || (std::abs(ka - kb) <= 1e-12 && a.mean < b.mean);
}

/// Fits the calibration constants on `runs` by a grid search over `grid`, starting from (and
/// keeping the unfitted fields of) `start`. A GPU generation without a run in `runs` gets the
/// other generation's fitted efficiency: nothing in the data says otherwise, and keeping `start`'s
/// value would carry over what was fitted on the runs left out.
inline calibration fit_calibration(const std::vector<published_run>& runs, const calibration& start = default_calibration,
                                   const calibration_grid& grid = {}) {
  bool ampere = false, hopper = false;
  for (const published_run& r : runs) {
    const bool h = r.gpu.architecture == gpu_architecture::hopper || r.gpu.architecture == gpu_architecture::blackwell;
    (h ? hopper : ampere) = true;
  }
  const std::vector<double> keep_ampere{start.gemm_efficiency_ampere}, keep_hopper{start.gemm_efficiency_hopper};
  calibration best = start;
  mfu_error best_error = mfu_error_of(runs, best);
  for (double half : grid.gemm_half_size)
    for (double passes : grid.elementwise_passes)
      for (double link : grid.link_efficiency)
        for (double a : ampere ? grid.gemm_efficiency_ampere : keep_ampere)
          for (double h : hopper ? grid.gemm_efficiency_hopper : keep_hopper) {
            calibration c = start;
            c.gemm_half_size = half;
            c.elementwise_passes = passes;
            c.link_efficiency = link;
            c.gemm_efficiency_ampere = a;
            c.gemm_efficiency_hopper = h;
            const mfu_error e = mfu_error_of(runs, c);
            if (better_fit(e, best_error)) {
              best_error = e;
              best = c;
            }
          }
  if (!hopper) best.gemm_efficiency_hopper = best.gemm_efficiency_ampere;
  if (!ampere) best.gemm_efficiency_ampere = best.gemm_efficiency_hopper;
  return best;
}

/// One fold of leave-one-source-out validation: the constants fitted without `source`, and the
/// errors they give on its runs, which the fit never saw.
struct source_holdout {
  std::string source;
  int runs = 0;
  calibration fitted{};
  mfu_error left_out{};             ///< on the source's runs
  std::vector<double> errors;       ///< signed, per run of the source, in file order
};

/// Leave-one-source-out validation: for each source, fit on the others and predict it.
inline std::vector<source_holdout> leave_one_source_out(const std::vector<published_run>& runs,
                                                        const calibration& start = default_calibration,
                                                        const calibration_grid& grid = {}) {
  std::vector<std::string> sources;
  for (const published_run& r : runs)
    if (std::find(sources.begin(), sources.end(), r.source) == sources.end()) sources.push_back(r.source);
  std::vector<source_holdout> folds;
  for (const std::string& source : sources) {
    std::vector<published_run> train, test;
    for (const published_run& r : runs) (r.source == source ? test : train).push_back(r);
    source_holdout fold;
    fold.source = source;
    fold.runs = static_cast<int>(test.size());
    fold.fitted = fit_calibration(train, start, grid);
    fold.left_out = mfu_error_of(test, fold.fitted);
    for (const published_run& r : test) fold.errors.push_back(predicted_published_mfu(r, fold.fitted) / r.published_mfu - 1);
    folds.push_back(std::move(fold));
  }
  return folds;
}

}  // namespace weft::tune
