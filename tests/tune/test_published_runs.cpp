// The cost model against published training runs (shared/data/published_runs.csv): predictions
// are compared with the published numbers. The model's five fitted constants were fitted on these
// same runs (docs/tuning.md, "Calibration"; there is no held-out set), so these bounds guard
// against regressions rather than measure how well the model predicts runs it has not seen.

#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <sstream>

#include <weft/tune/published_runs.hpp>

using namespace weft::tune;

namespace {

bool have_data() {
  if (std::filesystem::exists(WEFT_PUBLISHED_RUNS)) return true;
  WARN("skipped: published runs not found at " WEFT_PUBLISHED_RUNS " (the shared data folder next to the repository)");
  return false;
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
    INFO(run.source << " " << run.name << ": chosen tp " << c.chosen.config.tp << " pp " << c.chosen.config.pp);
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
