// docs/checkpoint.md's distributed example as a program: every rank holds a column slice of one
// tensor (as tensor parallelism splits it) and a ZeRO shard of another (a run of the flattened
// tensor), saves them to its own file in the background, and then reads its slice back and the
// whole of both tensors (from the other ranks' files), compared value by value with what the
// ranks held. Prints "distributed_checkpoint: ok" on rank 0 when all match. Files go to the
// working directory.
#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/launch/mpi_environment.hpp>

#include <weft/checkpoint/exchange.hpp>
namespace ckpt = weft::checkpoint;

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <span>
#include <vector>

namespace {

using comm_t = weft::communicator<weft::mpi_backend>;
constexpr std::int64_t C = 8;

float value(std::int64_t index) { return static_cast<float>(index) * 0.5f - 7.0f; }

void save(comm_t& world, std::int64_t step, std::int64_t next_sample) {
  const std::int64_t rank = world.rank(), ranks = world.size();
  std::vector<float> slice;  // columns [rank * 4C / ranks, ...) of every row
  for (std::int64_t row = 0; row < C; ++row) {
    for (std::int64_t column = rank * 4 * C / ranks; column < (rank + 1) * 4 * C / ranks; ++column) slice.push_back(value(row * 4 * C + column));
  }
  const std::vector<std::int64_t> wte_shape{50, C};
  const std::int64_t shard_begin = 50 * C * rank / ranks, shard_end = 50 * C * (rank + 1) / ranks;
  std::vector<float> shard;
  for (std::int64_t i = shard_begin; i < shard_end; ++i) shard.push_back(value(i));

  // Each rank: the regions of the global tensors it holds, row-major values within the region.
  std::vector<ckpt::local_piece> pieces;
  pieces.push_back(ckpt::piece_of<float>("h.0.mlp.c_fc.weight", {C, 4 * C}, {{0, rank * 4 * C / ranks}, {C, 4 * C / ranks}}, slice));
  std::int64_t at = shard_begin;  // a ZeRO shard: elements [shard_begin, shard_end) of the flattened tensor
  for (ckpt::region& part : ckpt::regions_of_flat_range(ckpt::whole_region(wte_shape), shard_begin, shard_end)) {
    const auto count = static_cast<std::size_t>(ckpt::element_count(part));
    pieces.push_back(ckpt::piece_of<float>("wte.weight", wte_shape, part, std::span(shard).subspan(at - shard_begin, count)));
    at += ckpt::element_count(part);
  }
  ckpt::distributed_saver saver(world.rank(), world.size(), ckpt::exchange_over(world), "snippet_distributed_checkpoint", {.keep = 3});
  saver.save({.step = step, .data_position = {{"sample", next_sample}}, .layout = {{"tp", ranks}}, .model = "gpt2"}, pieces);
  // ... train on; a save() while the previous one is still written returns false ...
  saver.wait();                                   // before exiting: this rank's files (rank 0: the index) are durable
}

bool load(comm_t& world) {
  const std::int64_t rank = world.rank(), ranks = world.size();
  const ckpt::region my_region{{0, rank * 4 * C / ranks}, {C, 4 * C / ranks}};
  ckpt::distributed_checkpoint checkpoint("snippet_distributed_checkpoint");   // the newest complete step, or a step directory
  std::vector<float> mine = checkpoint.read<float>("h.0.mlp.c_fc.weight", my_region);
  std::vector<float> whole = checkpoint.read<float>("h.0.mlp.c_fc.weight");
  std::vector<float> wte = checkpoint.read<float>("wte.weight");
  bool same = checkpoint.index().step == 20 && checkpoint.index().data_position.at("sample") == 640;
  for (std::int64_t i = 0; i < C * 4 * C; ++i) same = same && whole[static_cast<std::size_t>(i)] == value(i);
  for (std::int64_t i = 0; i < 50 * C; ++i) same = same && wte[static_cast<std::size_t>(i)] == value(i);
  for (std::int64_t row = 0; row < C; ++row) {
    for (std::int64_t j = 0; j < 4 * C / ranks; ++j) {
      same = same && mine[static_cast<std::size_t>(row * 4 * C / ranks + j)] == value(row * 4 * C + rank * 4 * C / ranks + j);
    }
  }
  return same;
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  comm_t world(weft::mpi_backend::comm::world(), "world");
  if (world.rank() == 0) std::filesystem::remove_all("snippet_distributed_checkpoint");
  world.barrier();
  save(world, 20, 640);
  world.barrier();  // rank 0's wait() returned: the checkpoint is complete
  std::vector<int> failed{load(world) ? 0 : 1};
  world.all_reduce(failed);
  if (failed[0] != 0) {
    if (world.rank() == 0) std::fprintf(stderr, "distributed_checkpoint: FAILED: the values read back differ from those saved\n");
    return 1;
  }
  if (world.rank() == 0) std::printf("distributed_checkpoint: ok\n");
  return 0;
}
