// The cost model against published training runs (tests/tune/data/published_runs.csv): predictions
// are compared with the published numbers. The model's five fitted constants were fitted on these
// same runs (docs/tuning.md, "Calibration"), so the fitted bounds guard against regressions; the
// leave-one-source-out test measures how well it predicts a source it was not fitted on.

#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <iterator>
#include <sstream>

#include <weft/tune/published_runs.hpp>
#include <weft/tune/report.hpp>

using namespace weft::tune;
using Catch::Detail::Approx;

namespace {

// The file is part of the repository: its absence is a failure, not a skip.
bool have_data() {
  INFO("published runs expected at " WEFT_PUBLISHED_RUNS " (tests/tune/data in the repository)");
  REQUIRE(std::filesystem::exists(WEFT_PUBLISHED_RUNS));
  return true;
}

}  // namespace

TEST_CASE("the published-runs reader understands the file's notes and blanks") {
  std::istringstream in(
      "source,model,params_b,layers,hidden,heads,kv_heads,seq,vocab,gpu,n_gpus,tp,pp,dp,cp,vp,micro_batch,global_batch,"
      "recompute,tflops_per_gpu,mfu,tokens_per_s_per_gpu,confidence\n"
      "X,M,7,32,4096,32,8,8192,,A100-80GB,64,1,1,64 (FSDP2),1,,local bs 1,64,selective op,,\"56.8% (6N, BF16 312)\",2904,E\n"
      "Y,N,1.7,24,2048,16,16,4096,131072,H100 (BF16 assumed),48,1,1,48,1,?,?,192,?,408.8,41%,~36259,E\n");
  const auto runs = read_published_runs(in);
  REQUIRE(runs.size() == 2);
  CHECK(runs[0].published.sharding_mode == sharding::full);
  CHECK(runs[0].published.micro_batch == 1);
  CHECK(runs[0].published.recompute_mode == recompute::selective);
  CHECK(runs[0].published_mfu == Catch::Detail::Approx(0.568));
  CHECK(runs[1].gpu.name == "H100");
  CHECK(runs[1].published.vp == 1);  // pp = 1: no virtual stages
  CHECK(runs[1].published.micro_batch == 0);
  CHECK_FALSE(runs[1].published.recompute_mode);
  std::istringstream broken("source,model\nX,Y\n");
  CHECK_THROWS_AS(read_published_runs(broken), weft::error);
}

TEST_CASE("every published layout fits the memory model") {
  if (!have_data()) return;
  for (const published_run& run : read_published_runs(WEFT_PUBLISHED_RUNS)) {
    INFO(run.source << " " << run.name);
    CHECK_NOTHROW(check_run(run));
  }
}

TEST_CASE("predicted MFU of the published layouts: mean error <= 10 %, worst <= 25 %") {
  if (!have_data()) return;
  const auto runs = read_published_runs(WEFT_PUBLISHED_RUNS);
  REQUIRE(runs.size() >= 20);
  double sum = 0, worst = 0;
  for (const published_run& run : runs) {
    const run_check c = check_run(run);
    INFO(run.source << " " << run.name << ": published " << run.published_mfu << ", predicted " << c.predicted_mfu);
    CHECK(std::abs(c.error) <= 0.25);
    sum += std::abs(c.error);
    worst = std::max(worst, std::abs(c.error));
  }
  const double mean = sum / static_cast<double>(runs.size());
  INFO("mean |error| " << mean << ", worst " << worst);
  CHECK(mean <= 0.10);
}

TEST_CASE("layouts chosen from the model, GPU type and count and batch alone, against the experts'") {
  if (!have_data()) return;
  const auto runs = read_published_runs(WEFT_PUBLISHED_RUNS);
  int same_tp = 0, pp_within_2 = 0;
  for (const published_run& run : runs) {
    const run_check c = check_run(run);
    INFO(run.source << " " << run.name << ": chosen tp " << c.chosen.config.parallel.tp << " pp " << c.chosen.config.parallel.pp);
    // The search can always pick the published layout (or one the model rates higher).
    CHECK(c.not_worse);
    same_tp += c.same_tp;
    pp_within_2 += c.pp_within_2;
  }
  const double n = static_cast<double>(runs.size());
  // The model picks a lower TP than the experts for the mid-size models of the two weak-scaling
  // tables (N21, MLM24) and a higher one for BLOOM-176B and torchtitan's FSDP-only Llama 3 70B
  // (docs/tuning.md, "Why the TP target is not met"): 16 of 24 same TP, 23 of 24 PP within 2x.
  // These bounds guard against regressions; the 80 % same-TP target is not met.
  WARN("same TP: " << same_tp << " of " << runs.size() << "; PP within 2x: " << pp_within_2);
  CHECK(same_tp / n >= 0.6);
  CHECK(pp_within_2 / n >= 0.8);
}

TEST_CASE("leave-one-source-out: a fold's constants do not depend on the source it leaves out") {
  if (!have_data()) return;
  const auto runs = read_published_runs(WEFT_PUBLISHED_RUNS);
  // A coarse grid keeps this quick; the property does not depend on the grid.
  calibration_grid grid;
  grid.gemm_half_size = {128, 256, 512};
  grid.elementwise_passes = {1, 2};
  grid.link_efficiency = {0.9};
  grid.gemm_efficiency_ampere = calibration_grid::steps(0.65, 0.05, 5);
  grid.gemm_efficiency_hopper = calibration_grid::steps(0.50, 0.05, 5);
  // Distort the left-out source's published MFUs by half: if the fold saw them, its fit would move.
  auto distorted = runs;
  for (published_run& r : distorted)
    if (r.source == "TT-A100") r.published_mfu *= 0.5;
  const auto folds = leave_one_source_out(runs, default_calibration, grid);
  const auto folds_distorted = leave_one_source_out(distorted, default_calibration, grid);
  REQUIRE(folds.size() == 5);
  for (std::size_t i = 0; i < folds.size(); ++i) {
    INFO(folds[i].source);
    if (folds[i].source != "TT-A100") continue;
    CHECK(folds[i].fitted.gemm_efficiency_ampere == folds_distorted[i].fitted.gemm_efficiency_ampere);
    CHECK(folds[i].fitted.gemm_half_size == folds_distorted[i].fitted.gemm_half_size);
    CHECK(folds[i].fitted.elementwise_passes == folds_distorted[i].fitted.elementwise_passes);
    // ...while its error on the distorted runs is that of predictions twice the published values.
    for (std::size_t k = 0; k < folds[i].errors.size(); ++k)
      CHECK(folds_distorted[i].errors[k] == Catch::Detail::Approx(2 * (folds[i].errors[k] + 1) - 1));
  }
  // Only the fold that leaves out the one Hopper source has no Hopper run to fit on: it borrows
  // the Ampere efficiency (docs/tuning.md, "Leave one source out").
  for (const source_holdout& fold : folds)
    if (fold.source == "MLM24") CHECK(fold.fitted.gemm_efficiency_hopper == fold.fitted.gemm_efficiency_ampere);
}

TEST_CASE("leave-one-source-out errors, as documented in docs/tuning.md") {
  if (!have_data()) return;
  const auto folds = leave_one_source_out(read_published_runs(WEFT_PUBLISHED_RUNS));
  double sum = 0, worst = 0;
  int count = 0;
  for (const source_holdout& fold : folds) {
    INFO(fold.source << ": left-out mean " << fold.left_out.mean << ", max " << fold.left_out.worst);
    // Each source, predicted from the others, within the 25 % target (the H100 source too, with
    // no run of its generation to fit on: the GEMM half size follows the ridge point).
    CHECK(fold.left_out.worst <= 0.25);
    for (double e : fold.errors) {
      sum += std::abs(e);
      worst = std::max(worst, std::abs(e));
      ++count;
    }
  }
  WARN("leave-one-source-out over " << count << " runs: mean " << sum / count << ", max " << worst);
  CHECK(count == 24);
  CHECK(sum / count <= 0.10);  // target; documented: 8.8 %
  CHECK(worst <= 0.25);        // target; documented: 19.0 % (MLM24 GPT-70B)
}

TEST_CASE("held-out published runs (never fitted on): predicted MFU, as documented in docs/tuning.md") {
  INFO("held-out runs expected at " WEFT_HELDOUT_RUNS);
  REQUIRE(std::filesystem::exists(WEFT_HELDOUT_RUNS));
  const auto runs = read_published_runs(WEFT_HELDOUT_RUNS);
  REQUIRE(runs.size() == 5);
  double sum = 0, worst = 0;
  int checked = 0, unfit = 0;
  for (const published_run& run : runs) {
    INFO(run.name << " " << (run.published.recompute_mode ? to_string(*run.published.recompute_mode) : "?"));
    const double mfu = predicted_published_mfu(run);
    if (mfu <= 0) {  // Llama 2 70B with torchtitan's "selective op" checkpointing (see the docs)
      ++unfit;
      continue;
    }
    const double error = std::abs(mfu / run.published_mfu - 1);
    CHECK(error <= 0.25);
    sum += error;
    worst = std::max(worst, error);
    ++checked;
  }
  WARN("held-out: " << checked << " runs, mean " << sum / checked << ", max " << worst << "; " << unfit
                    << " published layout(s) not fitting the memory model");
  CHECK(unfit == 1);
  CHECK(sum / checked <= 0.12);  // documented: 10.7 %
  CHECK(worst <= 0.17);          // documented: 16.7 %
}

TEST_CASE("published runs at 1536 to 16384 GPUs: each row error as documented in docs/tuning.md") {
  INFO("runs expected at " WEFT_SCALE_RUNS);
  REQUIRE(std::filesystem::exists(WEFT_SCALE_RUNS));
  const auto runs = read_published_runs(WEFT_SCALE_RUNS);
  // docs/tuning.md, "Published runs at scale": predicted / published - 1 with the fitted constants,
  // in file order. Llama 3 is predicted low (full recomputation forced), MT-NLG high.
  const double documented[] = {-0.239, -0.253, -0.412, +0.178, +0.188, +0.223, +0.042, +0.043, +0.052};
  REQUIRE(runs.size() == std::size(documented));
  // The layouts the sources state, as read: Llama 3's cp 16 row and MT-NLG's 35 stages.
  CHECK(runs[2].published.cp == 16);
  CHECK(runs[2].model.seq == 131072);
  CHECK(runs[2].model.ffn == 53248);
  CHECK(runs[3].published.pp == 35);
  CHECK(ffn_of(runs[6].model) == 4 * 18432);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    INFO(runs[i].source << " " << runs[i].name << " on " << runs[i].gpus << " GPUs");
    const double mfu = predicted_published_mfu(runs[i]);
    REQUIRE(mfu > 0);
    CHECK(mfu / runs[i].published_mfu - 1 == Approx(documented[i]).margin(0.02));
  }
}

namespace {

// The values of `all` next to `value` (itself and one step either way), for a grid around a fit.
std::vector<double> neighbours(const std::vector<double>& all, double value) {
  std::vector<double> out;
  for (std::size_t i = 0; i < all.size(); ++i)
    if (std::abs(all[i] - value) < 1e-9) {
      if (i > 0) out.push_back(all[i - 1]);
      out.push_back(all[i]);
      if (i + 1 < all.size()) out.push_back(all[i + 1]);
    }
  return out;
}

}  // namespace

TEST_CASE("leave-one-source-out on the wider set: each fold as documented in docs/tuning.md") {
  std::vector<published_run> runs = read_published_runs(WEFT_PUBLISHED_RUNS);
  const std::vector<published_run> scale = read_published_runs(WEFT_SCALE_RUNS);
  runs.insert(runs.end(), scale.begin(), scale.end());
  struct documented_fold {
    const char* source;
    double e_ampere, e_hopper, half, passes, link;
    std::vector<double> errors;  // left out, in file order
  };
  // docs/tuning.md, "(d) Leave one source out on the wider set" (tune_fit on both files).
  const documented_fold folds[] = {
      {"N21", 0.600, 0.625, 64, 3.0, 0.90, {-.213, -.191, -.184, -.149, -.163, -.115, -.149, -.147, -.203, -.201}},
      {"MLM24", 0.650, 0.625, 64, 1.5, 0.90, {+.245, +.152, +.128, +.188, +.207, -.021, +.121, +.035, +.049}},
      {"BLOOM", 0.700, 0.650, 128, 1.5, 0.90, {-.019}},
      {"NEOX", 0.700, 0.650, 128, 1.5, 0.90, {-.023}},
      {"TT-A100", 0.700, 0.650, 128, 1.5, 0.90, {+.130, +.103, -.007}},
      {"LLAMA3", 0.725, 0.700, 384, 0.0, 0.80, {-.279, -.293, -.529}},
      {"MTNLG", 0.675, 0.625, 64, 2.0, 0.90, {+.163, +.173, +.208}},
      {"NEMO4", 0.700, 0.650, 128, 1.5, 0.90, {+.081, +.081, +.090}},
  };
  const calibration_grid full;
  double sum = 0, worst = 0;
  int count = 0;
  for (const documented_fold& f : folds) {
    INFO("left out: " << f.source);
    std::vector<published_run> train, test;
    for (const published_run& r : runs) (r.source == f.source ? test : train).push_back(r);
    REQUIRE(test.size() == f.errors.size());
    calibration documented = default_calibration;
    documented.gemm_efficiency_ampere = f.e_ampere;
    documented.gemm_efficiency_hopper = f.e_hopper;
    documented.gemm_half_size = f.half;
    documented.elementwise_passes = f.passes;
    documented.link_efficiency = f.link;
    // The full grid takes tune_fit about 80 s of CPU for the eight folds; here the fit runs over
    // each documented value and its neighbours on that grid (at most 243 points), so a fold whose
    // documented constants are not the fit's choice around them fails.
    const calibration_grid around{.gemm_half_size = neighbours(full.gemm_half_size, f.half),
                                  .elementwise_passes = neighbours(full.elementwise_passes, f.passes),
                                  .link_efficiency = neighbours(full.link_efficiency, f.link),
                                  .gemm_efficiency_ampere = neighbours(full.gemm_efficiency_ampere, f.e_ampere),
                                  .gemm_efficiency_hopper = neighbours(full.gemm_efficiency_hopper, f.e_hopper)};
    const calibration fitted = fit_calibration(train, documented, around);
    CHECK(fitted.gemm_efficiency_ampere == Approx(f.e_ampere));
    CHECK(fitted.gemm_efficiency_hopper == Approx(f.e_hopper));
    CHECK(fitted.gemm_half_size == Approx(f.half));
    CHECK(fitted.elementwise_passes == Approx(f.passes));
    CHECK(fitted.link_efficiency == Approx(f.link));
    for (std::size_t i = 0; i < test.size(); ++i) {
      const double error = predicted_published_mfu(test[i], documented) / test[i].published_mfu - 1;
      CHECK(error == Approx(f.errors[i]).margin(0.02));
      sum += std::abs(error);
      worst = std::max(worst, std::abs(error));
      ++count;
    }
  }
  CHECK(count == 33);
  // The targets (mean <= 10 %, max <= 25 %) are missed; docs/tuning.md says by how much and why.
  CHECK(sum / count == Approx(0.153).margin(0.005));
  CHECK(worst == Approx(0.529).margin(0.005));
}

TEST_CASE("the sources --explain names as erring one way are those of the data") {
  const auto runs = read_published_runs(WEFT_SCALE_RUNS);
  for (const systematic_error& e : systematic_errors) {
    INFO(e.source);
    double low = 1e9, high = -1e9;
    for (const published_run& r : runs)
      if (r.source == e.source) {
        const double error = predicted_published_mfu(r) / r.published_mfu - 1;
        low = std::min(low, error);
        high = std::max(high, error);
      }
    CHECK(low == Approx(e.low).margin(0.01));
    CHECK(high == Approx(e.high).margin(0.01));
    CHECK((high < -0.15 || low > 0.15));  // all one way, by more than 15 %
  }
}
