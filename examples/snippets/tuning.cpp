// docs/tuning.md's examples as one program: the tuner's search and explanation (rank 0 prints
// them), then the best plan for this job's ranks turned into process groups. Rank 0 prints
// "tuning: ok" when the groups have the plan's sizes on every rank.
#include <weft/tune/report.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/layout/process_groups.hpp>
#include <weft/tune/search.hpp>

#include <weft/launch/mpi_environment.hpp>

#include <cstdio>
#include <vector>

namespace {

bool print_plans() {
  using namespace weft::tune;
  const search_result r = search(*model_preset("llama3-70b"), large_reference_cluster(16),
                                 {.global_batch = 512}, {.top = 5});
  std::puts(format_table(r.plans).c_str());
  std::puts(to_text(explain(r.plans.front(), *model_preset("llama3-70b"), large_reference_cluster(16),
                            {.global_batch = 512})).c_str());
  return r.plans.size() == 5;
}

/// Llama 2 7B on this job's ranks as GPUs of the small reference cluster (A100 80 GB).
bool groups_from_plan(weft::communicator<weft::mpi_backend>& world) {
  const weft::tune::model_desc model = *weft::tune::model_preset("llama2-7b");
  weft::tune::cluster_desc cluster = weft::tune::small_reference_cluster(1);
  cluster.node.gpus_per_node = world.size();

  const weft::tune::plan plan = weft::tune::best(model, cluster, {.global_batch = 512});  // throws if nothing fits
  weft::process_groups<weft::mpi_backend> groups(world, plan.layout());
  // plan.config.micro_batch, .recompute_mode, .sharding_mode, .sequence_parallel: how each replica trains

  if (world.rank() == 0)
    std::printf("the plan for %d ranks: tp %d, pp %d, dp %d, micro-batch %d\n", world.size(), plan.config.parallel.tp,
                plan.config.parallel.pp, plan.config.parallel.dp, plan.config.micro_batch);
  return groups.tp().size() == plan.config.parallel.tp && groups.pp().size() == plan.config.parallel.pp &&
         groups.dp().size() == plan.config.parallel.dp &&
         plan.config.parallel.tp * plan.config.parallel.pp * plan.config.parallel.dp == world.size();
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  bool ok = world.rank() != 0 || print_plans();
  ok = groups_from_plan(world) && ok;
  std::vector<int> failed{ok ? 0 : 1};
  world.all_reduce(failed);
  if (world.rank() == 0) std::printf(failed[0] == 0 ? "tuning: ok\n" : "tuning: FAILED\n");
  return failed[0] == 0 ? 0 : 1;
}
