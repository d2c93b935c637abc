// Refits the cost model's calibration constants on the published runs (fit_calibration: a grid
// search over the relative error of predicted MFU, each run's own layout, each source's own FLOP
// count) and validates them leaving one source out (fit without it, predict it). Prints both as
// the tables of docs/tuning.md. Usage: tune_fit [runs.csv...]; several files are validated as one
// set (docs/tuning.md's wider table: published_runs.csv published_runs_scale.csv).

#include <algorithm>
#include <cstdio>
#include <string>

#include <weft/tune/published_runs.hpp>

using namespace weft::tune;

int main(int argc, char** argv) {
  std::vector<published_run> runs;
  for (int i = 1; i < std::max(argc, 2); ++i) {
    const std::vector<published_run> file = read_published_runs(std::string(argc > 1 ? argv[i] : WEFT_PUBLISHED_RUNS));
    runs.insert(runs.end(), file.begin(), file.end());
  }
  const mfu_error current = mfu_error_of(runs, default_calibration);
  std::printf("current constants, fitted on all runs: mean %.2f%% max %.2f%%\n", 100 * current.mean, 100 * current.worst);
  const calibration best = fit_calibration(runs);
  const mfu_error fitted = mfu_error_of(runs, best);
  std::printf("refit on all runs: gemm_efficiency_ampere %.3f gemm_efficiency_hopper %.3f gemm_half_size %.0f "
              "elementwise_passes %.1f link_efficiency %.2f -> mean %.2f%% max %.2f%%\n\n",
              best.gemm_efficiency_ampere, best.gemm_efficiency_hopper, best.gemm_half_size, best.elementwise_passes,
              best.link_efficiency, 100 * fitted.mean, 100 * fitted.worst);

  std::printf("| left out | runs | fitted on the others: e_ampere, e_hopper, D_half, passes, link | left-out mean | left-out max | "
              "per run |\n|---|---|---|---|---|---|\n");
  double sum = 0, worst = 0;
  int count = 0;
  for (const source_holdout& fold : leave_one_source_out(runs)) {
    std::string per_run;
    for (double e : fold.errors) {
      char text[32];
      std::snprintf(text, sizeof text, "%s%+.1f", per_run.empty() ? "" : ", ", 100 * e);
      per_run += text;
      sum += std::abs(e);
      worst = std::max(worst, std::abs(e));
      ++count;
    }
    std::printf("| %s | %d | %.3f, %.3f, %.0f, %.1f, %.2f | %.1f %% | %.1f %% | %s |\n", fold.source.c_str(), fold.runs,
                fold.fitted.gemm_efficiency_ampere, fold.fitted.gemm_efficiency_hopper, fold.fitted.gemm_half_size,
                fold.fitted.elementwise_passes, fold.fitted.link_efficiency, 100 * fold.left_out.mean,
                100 * fold.left_out.worst, per_run.c_str());
  }
  std::printf("\nleave-one-source-out over %d runs: mean %.1f %%, max %.1f %%\n", count, 100 * sum / count, 100 * worst);
}
