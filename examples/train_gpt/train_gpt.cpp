// train_gpt: GPT-2 trained on any tp x pp x dp x cp layout with weft (see docs/train_gpt.md).
//
//   srun -n 4 ./train_gpt --tp 2 --steps 100
//   mpirun -n 4 ./train_gpt --pp 2 --schedule 1f1b --global-batch 8
//
// Exit statuses: 0 done; 1 a mistake in the flags or files (one message, from rank 0); 2 any
// other failure (the rank that failed says why, and the job is aborted so no rank waits).

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include "checkpoint_io.hpp"
#include "command_line.hpp"
#include "options.hpp"
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
    const int given = flag == "--layers" ? o.model.layers : flag == "--hidden" ? o.model.hidden
                    : flag == "--heads"  ? o.model.heads  : flag == "--vocab"  ? o.model.vocab
                    : flag == "--positions" ? o.model.positions : -1;
    const int file = flag == "--layers" ? m.layers : flag == "--hidden" ? m.hidden
                   : flag == "--heads"  ? m.heads  : flag == "--vocab"  ? m.vocab
                   : flag == "--positions" ? m.positions : -1;
    if (given != file)
      throw input_error(flag + " " + std::to_string(given) + " disagrees with '" + *o.init_from + "', whose model has " +
                        std::to_string(file) + ": drop the flag to take the file's shape");
  }
  return m;
}

int run(const train_gpt::options& o) {
  using B = weft::mpi_backend;
  weft::communicator<B> world(B::comm::world(), "world");
  if (o.comm_timeout) world.set_timeout(*o.comm_timeout);
  // Every rank checks the flags and files alike, so a mistake stops every rank with one message
  // (from rank 0) before any collective call.
  train_gpt::gpt_config m;
  train_gpt::run_layout layout;
  std::optional<train_gpt::corpus> data;
  try {
    m = model_shape(o);
    layout = train_gpt::resolve_layout(o, m, world.size());
    data = train_gpt::corpus::load(o.data.value_or(WEFT_TRAIN_GPT_DEFAULT_DATA), m.seq, m.vocab);
  } catch (const std::runtime_error& e) {
    throw input_error(e.what());
  }
  train_gpt::trainer<B> trainer(world, o, m, layout, *data);
  if (world.rank() == 0)
    std::printf("train_gpt: %d layers, hidden %d, %d heads, vocab %d, seq %d (%.2f M parameters) on %d ranks: tp %d "
                "pp %d dp %d cp %d%s%s, %s schedule, global batch %d = %d micro-batch(es) of %d per dp rank\n",
                m.layers, m.hidden, m.heads, m.vocab, m.seq, static_cast<double>(m.parameter_count()) / 1e6,
                world.size(), layout.degrees.tp, layout.degrees.pp, layout.degrees.dp, layout.degrees.cp,
                layout.degrees.vp > 1 ? (" vp " + std::to_string(layout.degrees.vp)).c_str() : "",
                o.sequence_parallel && o.tp > 1 ? " +sp" : "", o.schedule.c_str(), layout.global_batch,
                layout.micro_batches, o.micro_batch);
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

int main(int argc, char** argv) {
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
