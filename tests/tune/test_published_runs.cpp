// The cost model against published training runs (tests/tune/data/published_runs.csv): predictions
// are compared with the published numbers. The model's five fitted constants were fitted on these
// same runs (docs/tuning.md, "Calibration"), so the fitted bounds guard against regressions; the
// leave-one-source-out test measures how well it predicts a source it was not fitted on.

#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <sstream>

#include <weft/tune/published_runs.hpp>

using namespace weft::tune;

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
