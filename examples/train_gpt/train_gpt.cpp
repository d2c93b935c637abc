// train_gpt: GPT-2 trained on any tp x pp x dp x cp layout with weft (see docs/train_gpt.md).
//
//   srun -n 4 ./train_gpt --tp 2 --steps 100
//   mpirun -n 4 ./train_gpt --pp 2 --schedule 1f1b --global-batch 8
//
// Exit statuses: 0 done; 1 a mistake in the flags or files (one message, from rank 0); 2 any
// other failure (the rank that failed says why, and the job is aborted so no rank waits).

#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>
#include <optional>
#include <span>
#include <string>

#include <weft/backend/mpi/backend.hpp>
#include <weft/checkpoint/distributed.hpp>
#include <weft/checkpoint/exchange.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/launch/mpi_cross_check.hpp>
#include <weft/launch/resolve.hpp>

#include "checkpoint_io.hpp"
#include "command_line.hpp"
#include "device.hpp"
#include "device_support.hpp"
#include "options.hpp"
#include "planning.hpp"
#include "trainer.hpp"

namespace {

using train_gpt::input_error;

/// The model's shape: the flags', or the file's when initialising from one (flags that are
/// given must agree with it).
train_gpt::gpt_config model_shape(const train_gpt::options& o) {
  if (!o.init_from) return o.model;
  weft::checkpoint::checkpoint_file f;
  try {
    f = weft::checkpoint::read_safetensors(*o.init_from);
  } catch (const std::exception& e) {
    throw input_error(e.what());
  }
  train_gpt::gpt_config m;
  try {
    const bool heads_given =
        std::find(o.model_flags.begin(), o.model_flags.end(), "--heads") != o.model_flags.end();
    m = train_gpt::config_from_file(f, *o.init_from, o.model.seq,
                                    heads_given ? std::optional<int>(o.model.heads) : std::nullopt);
  } catch (const std::exception& e) {
    throw input_error(e.what());
  }
  for (const std::string& flag : o.model_flags) {
    auto field = [&](const train_gpt::gpt_config& c) {
      return flag == "--layers" ? c.layers : flag == "--hidden" ? c.hidden : flag == "--heads" ? c.heads
           : flag == "--vocab" ? c.vocab : flag == "--positions" ? c.positions : flag == "--moe-experts" ? c.moe_experts
           : flag == "--moe-top-k" ? c.moe_top_k : flag == "--moe-every" ? c.moe_every : -1;
    };
    const int given = field(o.model), file = field(m);
    if (given != file)
      throw input_error(flag + " " + std::to_string(given) + " disagrees with '" + *o.init_from + "', whose model has " +
                        std::to_string(file) + ": drop the flag to take the file's shape");
  }
  m.vocab_divisible_by = o.vocab_divisible_by;  // padding is the run's, not the file's (files hold the true vocabulary)
  return m;
}

/// Where checkpoints go, checked before the first step, not at the first save steps later (collective
/// over `world`): --save-dir by every rank (each writes its part), --save's folder by rank 0 (it
/// writes the whole file); an input_error alike on every rank.
void check_checkpoint_folders(const train_gpt::options& o, weft::communicator<weft::mpi_backend>& world) {
  try {
    const auto exchange = weft::checkpoint::exchange_over(world);
    if (o.save_dir) weft::checkpoint::check_writable(world.rank(), world.size(), exchange, *o.save_dir);
    if (o.save) {
      const std::filesystem::path folder = std::filesystem::path(*o.save).parent_path();
      weft::checkpoint::check_writable(world.rank(), world.size(), exchange, folder.empty() ? "." : folder,
                                       world.rank() == 0);
    }
  } catch (const std::runtime_error& e) {  // weft::error included: every rank alike
    throw input_error(e.what());
  }
}

/// --device and --precision against what the job has: whether the trainer on the GPU takes the
/// run (its layout and flags), and whether every rank sees a GPU (each rank probes its own CUDA
/// runtime; the counts are all-reduced, so every rank decides alike and a refusal stops every rank
/// with one message). Where the answer cannot be CUDA whatever the machine has (--device cpu, or
/// auto in fp32 for a run the GPU trainer does not take: tp, pp, cp, sharding, --save-dir, ...),
/// nothing is probed and nothing exchanged, so the CPU run starts as it always has.
train_gpt::device_kind job_device(const train_gpt::options& o, const train_gpt::run_layout& layout,
                                  weft::communicator<weft::mpi_backend>& world) {
  using train_gpt::device_kind;
  train_gpt::cuda_availability job = train_gpt::probe_cuda(/*count_devices=*/false);
  job.trainer_refusal = train_gpt::cuda_trainer_refusal(o, layout.degrees(), world.size());
  const bool machine_decides =
      job.runtime && (o.device == device_kind::cuda ||
                      (o.device == device_kind::automatic &&
                       (!job.trainer_refusal || o.precision == train_gpt::precision_kind::bf16)));
  if (!machine_decides) return train_gpt::choose_device(o.device, o.precision, job);
  const train_gpt::cuda_availability here = train_gpt::probe_cuda(/*count_devices=*/true);
  // The fewest GPUs of any rank, and the first rank that sees none (world.size(): none lacks one).
  int counts[2] = {here.gpus, here.gpus > 0 ? world.size() : world.rank()};
  world.all_reduce(std::span<int>(counts), weft::reduce_op::min);
  job.gpus = counts[0];
  job.rank_without = counts[1] < world.size() ? counts[1] : -1;
  if (counts[1] == world.rank()) job.detail = here.detail;  // the first such rank's own words
  return train_gpt::choose_device(o.device, o.precision, job);
}

int run(const train_gpt::options& o) {
  using B = weft::mpi_backend;
  // The launcher's variables (Slurm's, Open MPI's, torchrun's) against MPI's own view: variables
  // left from another launch, or a launcher that started separate MPI worlds, stop here with a
  // message naming them, instead of training N unrelated models.
  weft::resolve_launch_with_mpi();
  weft::communicator<B> world(B::comm::world(), "world");
  if (o.comm_timeout) world.set_timeout(*o.comm_timeout);
  // Every rank checks the flags and files alike, so a mistake stops every rank with one message
  // (from rank 0) before any collective call.
  train_gpt::gpt_config m;
  train_gpt::run_layout layout;
  std::optional<train_gpt::corpus> data, val_data;
  std::optional<weft::tune::measured_hardware> hardware;
  train_gpt::options run_options = o;
  try {
    m = model_shape(o);
    if (o.hardware) {
      hardware = weft::tune::read_hardware(*o.hardware);
      const int measured = hardware->ranks_per_node * hardware->nodes;
      if (measured != world.size())
        throw input_error("the hardware description '" + *o.hardware + "' was measured on " + std::to_string(measured) +
                          " ranks, but this run has " + std::to_string(world.size()) +
                          ": probe with `weft-plan --probe` under the same launch");
    }
    if (o.plan) {
      const int global_batch = o.global_batch > 0 ? o.global_batch : 2 * world.size();
      const train_gpt::planned_layout chosen = train_gpt::plan_layout(m, *hardware, global_batch);
      if (world.rank() == 0) std::printf("train_gpt --plan: the tuner's choice for %d ranks of this hardware:\n%s\n",
                                         world.size(), chosen.report.c_str());
      const weft::tune::layout_choice& c = chosen.layout;
      run_options.tp = c.parallel.tp, run_options.pp = c.parallel.pp, run_options.cp = c.parallel.cp;
      run_options.dp = c.parallel.dp, run_options.vp = c.parallel.virtual_stages, run_options.ep = c.parallel.ep;
      run_options.micro_batch = c.micro_batch, run_options.sequence_parallel = c.sequence_parallel;
      run_options.sharding = c.sharding_mode;
      run_options.recompute = c.recompute_mode;
      run_options.zero1 = c.sharding_mode == weft::tune::sharding::optimizer;
      run_options.schedule = run_options.vp > 1 ? "interleaved" : "1f1b";
      run_options.global_batch = global_batch;
    }
    layout = train_gpt::resolve_layout(train_gpt::layout_from_flags(run_options), run_options.global_batch,
                                       run_options.schedule, m, world.size());
    data = train_gpt::corpus::load(o.data.value_or(WEFT_TRAIN_GPT_DEFAULT_DATA), m.seq, m.vocab, o.format);
    if (o.val_data) val_data = train_gpt::corpus::load(*o.val_data, m.seq, m.vocab, o.format);
  } catch (const std::runtime_error& e) {
    throw input_error(e.what());
  }
  if (job_device(run_options, layout, world) == train_gpt::device_kind::cuda) {
    check_checkpoint_folders(o, world);
    return train_gpt::train_on_cuda(run_options, m, layout, *data);
  }
  std::optional<double> predicted;
  if (hardware) {
    weft::tune::layout_choice choice = layout.choice;
    choice.parallel.world_size = world.size();
    predicted = train_gpt::predicted_step_seconds(m, *hardware, choice, layout.global_batch);
  }
  train_gpt::trainer<B> trainer(world, run_options, m, layout, *data, predicted);
  if (val_data) trainer.set_validation(*val_data);
  if (world.rank() == 0)
    std::printf("train_gpt: %d layers, hidden %d, %d heads, vocab %d, seq %d (%.2f M parameters) on %d ranks: tp %d "
                "pp %d dp %d cp %d%s%s%s%s, %s schedule, global batch %d = %d micro-batch(es) of %d per dp rank\n",
                m.layers, m.hidden, m.heads, m.vocab, m.seq, static_cast<double>(m.parameter_count()) / 1e6,
                world.size(), layout.degrees().tp, layout.degrees().pp, layout.degrees().dp, layout.degrees().cp,
                layout.degrees().virtual_stages > 1 ? (" vp " + std::to_string(layout.degrees().virtual_stages)).c_str() : "",
                layout.sequence_parallel() ? " +sp" : "", train_gpt::sharding_text(run_options).c_str(),
                run_options.recompute == weft::tune::recompute::none
                    ? ""
                    : (" +recompute " + std::string(weft::tune::to_string(run_options.recompute))).c_str(),
                run_options.schedule.c_str(), layout.global_batch, layout.micro_batches,
                layout.choice.micro_batch);
  if (m.moe_experts > 0 && world.rank() == 0)
    std::printf("mixture of experts: %d experts, top %d, every %d block(s) from block 0, ep %d%s\n", m.moe_experts,
                m.moe_top_k, m.moe_every, layout.degrees().ep,
                o.moe_capacity_factor > 0 ? (", capacity factor " + std::to_string(o.moe_capacity_factor)).c_str()
                                          : ", dropless");
  if (predicted && world.rank() == 0)
    std::printf("the tuner predicts %.1f ms per step for this layout on '%s'\n", *predicted * 1e3, o.hardware->c_str());
  check_checkpoint_folders(o, world);
  try {
    if (o.resume) {
      trainer.resume(*o.resume);
    } else {
      trainer.initialize(o.init_from);
    }
  } catch (const std::runtime_error& e) {  // the files' problems (weft::error included): every rank alike
    throw input_error(e.what());
  }
  return trainer.run();
}

}  // namespace

/// Before MPI starts: settings that depend on how the job sits on this machine.
void prepare_process() {
  // More ranks on this node than cores (a laptop, a CI box): let ranks that wait for a message
  // give the core away instead of spinning on it, or the ranks that have work run at a fraction
  // of their speed. The launcher's own setting wins.
  try {
    const weft::launch_info here = weft::resolve_launch();
    const unsigned cores = std::thread::hardware_concurrency();
    if (cores > 0 && static_cast<unsigned>(here.local_world_size) > cores)
      setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  } catch (const std::exception&) {
    // contradictory launcher variables: MPI start-up reports them
  }
  // Activations and temporaries are freed and allocated again every micro-batch: keep freed
  // memory in the heap instead of returning it to the system and faulting it in again.
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

int main(int argc, char** argv) {
  prepare_process();
  return weft_programs::mpi_main(
      "train_gpt", train_gpt::usage_text, argc, argv,
      [&](int rank) {
        const train_gpt::options o = train_gpt::parse_options(argc, argv);
        if (o.help) {
          if (rank == 0) std::printf("%s", train_gpt::usage_text);
          return 0;
        }
        return run(o);
      },
      2);
}
