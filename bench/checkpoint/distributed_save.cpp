// Distributed checkpoint saves against the disk they write to, measured in one run:
//
//   1. the disk's sequential write: rank 0 alone writes the whole checkpoint's bytes to one file
//      (write + fsync), as `dd conv=fsync` would;
//   2. every rank writing its share to a file of its own at once (write + fsync), no checkpoint
//      code: what the ranks together get from the disk;
//   3. distributed_saver: from save() to the checkpoint complete (rank 0's wait() returns: every
//      rank's file durable and the index renamed into place);
//   4. the time a training step is blocked by a save: steps of about --step-ms of arithmetic on
//      the training thread, a save every --save-every steps never waited for; each save() call's
//      time (the slowest rank's, after a barrier that keeps the ranks' skew out), against the
//      median step without a save.
//
//   mpirun -n 4 weft_bench_checkpoint [--megabytes-per-rank 64] [--repeats 3] [--steps 12]
//                                     [--save-every 4] [--step-ms 400] [--dir DIR]
//
// Targets (issue 22): save throughput >= 70 % of the disk's sequential write; a step blocked
// <= 5 % of its time.
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/checkpoint/exchange.hpp>
#include <weft/comm/communicator.hpp>

#include "command_line.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace {

namespace ckpt = weft::checkpoint;
using comm_t = weft::communicator<weft::mpi_backend>;
using clock_type = std::chrono::steady_clock;

constexpr const char* usage_text =
    "usage: weft_bench_checkpoint [--megabytes-per-rank N] [--repeats N] [--steps N] [--save-every N] [--step-ms N] [--dir DIR]\n";

double seconds_since(clock_type::time_point start) { return std::chrono::duration<double>(clock_type::now() - start).count(); }

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

/// write + fsync of `bytes` to a new file; throws on failure.
void plain_write(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  ckpt::detail::file_descriptor out(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!out.is_open()) throw std::runtime_error("cannot create '" + path.string() + "'");
  if (ckpt::detail::write_all(out.get(), bytes) != 0 || ::fsync(out.get()) != 0) throw std::runtime_error("writing '" + path.string() + "' failed");
}

/// The slowest rank's value.
double slowest(comm_t& world, double value) {
  std::vector<double> v{value};
  std::vector<double> all(static_cast<std::size_t>(world.size()));
  world.all_gather(v, all);
  return *std::max_element(all.begin(), all.end());
}

/// Arithmetic on the training thread for about `ms` milliseconds (a fixed amount of work, so a
/// step slowed by the writer threads shows it).
double compute(std::vector<float>& data, std::size_t rounds) {
  double sum = 0;
  for (std::size_t r = 0; r < rounds; ++r) {
    for (float& x : data) x = x * 0.999f + 0.001f;
    sum += data[r % data.size()];
  }
  return sum;
}

int body(int argc, char** argv) {
  comm_t world(weft::mpi_backend::comm::world(), "world");
  std::size_t megabytes = 64, repeats = 3, steps = 12, save_every = 4, step_ms = 400;
  std::filesystem::path dir = "weft_bench_checkpoint";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw weft_programs::usage_error(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--megabytes-per-rank") megabytes = weft_programs::parse_integer<std::size_t>(flag, value(), 1, 100000);
    else if (flag == "--repeats") repeats = weft_programs::parse_integer<std::size_t>(flag, value(), 1, 1000);
    else if (flag == "--steps") steps = weft_programs::parse_integer<std::size_t>(flag, value(), 1, 100000);
    else if (flag == "--save-every") save_every = weft_programs::parse_integer<std::size_t>(flag, value(), 1, 100000);
    else if (flag == "--step-ms") step_ms = weft_programs::parse_integer<std::size_t>(flag, value(), 1, 100000);
    else if (flag == "--dir") dir = value();
    else throw weft_programs::unknown_option(flag, usage_text);
  }
  const int rank = world.rank(), ranks = world.size();
  const std::size_t bytes_per_rank = megabytes << 20;
  const double total_mb = static_cast<double>(bytes_per_rank) * ranks / 1e6;
  if (rank == 0) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  world.barrier();

  // The rank's model shard: 4 tensors of F32 rows, split over the ranks by rows (as dp shards).
  const std::int64_t columns = 1024;
  const std::int64_t rows_per_rank = static_cast<std::int64_t>(bytes_per_rank / 4 / 4 / columns);
  std::vector<std::vector<float>> shards(4, std::vector<float>(static_cast<std::size_t>(rows_per_rank * columns)));
  for (std::size_t t = 0; t < shards.size(); ++t) {
    for (std::size_t i = 0; i < shards[t].size(); ++i) shards[t][i] = static_cast<float>((i * 7 + t + rank) % 1000) * 0.01f;
  }
  std::vector<ckpt::local_piece> pieces;
  for (std::size_t t = 0; t < shards.size(); ++t) {
    pieces.push_back(ckpt::piece_of<float>("layer" + std::to_string(t) + ".weight", {rows_per_rank * ranks, columns},
                                           {{rows_per_rank * rank, 0}, {rows_per_rank, columns}}, shards[t]));
  }
  std::vector<std::byte> plain(bytes_per_rank * (rank == 0 ? static_cast<std::size_t>(ranks) : 1), std::byte{1});

  std::vector<double> sequential, parallel, saves;
  for (std::size_t r = 0; r < repeats; ++r) {
    world.barrier();
    if (rank == 0) {
      const auto t0 = clock_type::now();
      plain_write(dir / "sequential.bin", plain);
      sequential.push_back(seconds_since(t0));
      std::filesystem::remove(dir / "sequential.bin");
    }
    world.barrier();
    auto t0 = clock_type::now();
    plain_write(dir / ("parallel-" + std::to_string(rank) + ".bin"), std::span(plain).first(bytes_per_rank));
    world.barrier();
    parallel.push_back(seconds_since(t0));
    std::filesystem::remove(dir / ("parallel-" + std::to_string(rank) + ".bin"));
    world.barrier();
    ckpt::distributed_saver saver(rank, ranks, ckpt::exchange_over(world), dir / "ckpt", {.keep = 1});
    t0 = clock_type::now();
    saver.save({.step = static_cast<std::int64_t>(r), .data_position = {}, .layout = {{"dp", ranks}}, .model = "bench"}, pieces);
    saver.wait();
    world.barrier();
    saves.push_back(seconds_since(t0));
  }

  // Steps with saves in the background.
  std::vector<float> work(1 << 16, 1.0f);
  std::size_t rounds = 1;
  {  // calibrate the step's work to about step_ms on this machine, now
    const auto t0 = clock_type::now();
    compute(work, 64);
    const double per_round = seconds_since(t0) / 64;
    rounds = std::max<std::size_t>(1, static_cast<std::size_t>(static_cast<double>(step_ms) / 1e3 / per_round));
  }
  world.barrier();
  ckpt::distributed_saver saver(rank, ranks, ckpt::exchange_over(world), dir / "steps", {.keep = 1});
  std::vector<double> plain_steps, blocked, steps_with_save;
  std::size_t skipped = 0;
  double sink = 0;
  for (std::size_t s = 1; s <= steps; ++s) {
    world.barrier();
    const auto t0 = clock_type::now();
    sink += compute(work, rounds);
    double save_seconds = 0;
    if (s % save_every == 0) {
      // The ranks' steps end at different times on a loaded machine; a trainer's own collectives
      // absorb that, so the skew is kept out of the save's time.
      world.barrier();
      const auto t1 = clock_type::now();
      if (!saver.save({.step = static_cast<std::int64_t>(s), .data_position = {}, .layout = {{"dp", ranks}}, .model = "bench"}, pieces)) ++skipped;
      save_seconds = seconds_since(t1);
    }
    const double step = slowest(world, seconds_since(t0));
    const double save_time = slowest(world, save_seconds);
    if (s % save_every == 0) {
      blocked.push_back(save_time);
      steps_with_save.push_back(step);
    } else {
      plain_steps.push_back(step);
    }
  }
  saver.wait();
  world.barrier();

  if (rank == 0) {
    const double seq = median(sequential), par = median(parallel), save = median(saves);
    std::printf("distributed checkpoint bench: %d ranks, %zu MiB per rank (%.1f MB in all), %zu repeats, medians\n", ranks,
                megabytes, total_mb, repeats);
    std::printf("  disk, one sequential writer (write + fsync):   %.3f s  %.1f MB/s\n", seq, total_mb / seq);
    std::printf("  every rank its own file (write + fsync):        %.3f s  %.1f MB/s\n", par, total_mb / par);
    std::printf("  distributed_saver, save() to complete:          %.3f s  %.1f MB/s  (%.0f %% of the sequential writer)\n", save,
                total_mb / save, 100.0 * seq / save);
    const double step = median(plain_steps);
    double worst = 0;
    for (double b : blocked) worst = std::max(worst, b);
    std::printf("  steps: median %.1f ms without a save, %.1f ms with one; save() held the training thread %.1f ms median, %.1f ms at most (%.1f %% of a step); %zu of %zu saves skipped (previous still writing)\n",
                step * 1e3, median(steps_with_save) * 1e3, median(blocked) * 1e3, worst * 1e3, 100.0 * median(blocked) / step,
                skipped, blocked.size());
  }
  return sink == 12345.678 ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  return weft_programs::mpi_main("weft_bench_checkpoint", usage_text, argc, argv, [&](int) { return body(argc, argv); });
}
