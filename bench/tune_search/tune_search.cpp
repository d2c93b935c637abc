// How long the tuner's full search takes, so a trainer can call it at start-up: a 405B model on
// 16,384 H100s (the target is 50 ms), and smaller everyday cases.

#include <benchmark/benchmark.h>

#include <weft/tune/search.hpp>

namespace {

using namespace weft::tune;

void run_search(benchmark::State& state, const model_desc& model, const cluster_desc& cluster, const job_desc& job,
                const search_options& options) {
  long long valid = 0;
  for (auto _ : state) {
    search_result r = search(model, cluster, job, options);
    benchmark::DoNotOptimize(r.plans.data());
    valid = r.layouts_valid;
  }
  state.counters["layouts"] = static_cast<double>(valid);
}

// Llama 3 405B, 16M-token batches (2048 x 8192), 2048 nodes of 8 H100. Its 126 layers divide only
// by pipeline depths 1 and 2 that also divide 16,384, so the second case allows uneven stages,
// which multiplies the layouts to consider.
void search_405b_16384_gpus(benchmark::State& state) {
  run_search(state, *model_preset("llama3-405b"), large_reference_cluster(2048), {.global_batch = 2048}, {});
}
void search_405b_16384_gpus_uneven_stages(benchmark::State& state) {
  run_search(state, *model_preset("llama3-405b"), large_reference_cluster(2048), {.global_batch = 2048},
             {.allow_uneven_stages = true});
}
void search_70b_128_gpus(benchmark::State& state) {
  run_search(state, *model_preset("llama3-70b"), large_reference_cluster(16), {.global_batch = 512}, {});
}
void search_7b_8_gpus(benchmark::State& state) {
  run_search(state, *model_preset("llama2-7b"), small_reference_cluster(2), {.global_batch = 512}, {});
}

}  // namespace

BENCHMARK(search_405b_16384_gpus)->Unit(benchmark::kMillisecond);
BENCHMARK(search_405b_16384_gpus_uneven_stages)->Unit(benchmark::kMillisecond);
BENCHMARK(search_70b_128_gpus)->Unit(benchmark::kMillisecond);
BENCHMARK(search_7b_8_gpus)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
