// Distributed checkpoints on real ranks (MPI, 4 ranks): saved as 2 x 2 shards, loaded on the same
// layout (bit-exact), on 2 ranks and on 1; and the memory a rank uses while it saves and loads,
// counted by this program's operator new, against the size of the model.
#include <catch2/catch.hpp>

#include <weft/backend/mpi/backend.hpp>
#include <weft/checkpoint/distributed.hpp>
#include <weft/checkpoint/exchange.hpp>
#include <weft/comm/communicator.hpp>

#include "distributed_model.hpp"

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <new>

namespace {

// Every allocation of this program, counted: the bytes live now and the most there were.
std::atomic<std::int64_t> live_bytes{0};
std::atomic<std::int64_t> peak_bytes{0};
constexpr std::size_t header_bytes = 16;  // keeps the caller's memory 16-byte aligned

void* counted_allocation(std::size_t size) {
  void* block = std::malloc(size + header_bytes);
  if (block == nullptr) throw std::bad_alloc();
  std::memcpy(block, &size, sizeof size);
  const std::int64_t now = live_bytes.fetch_add(static_cast<std::int64_t>(size)) + static_cast<std::int64_t>(size);
  std::int64_t peak = peak_bytes.load();
  while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
  }
  return static_cast<char*>(block) + header_bytes;
}

void counted_release(void* memory) noexcept {
  if (memory == nullptr) return;
  void* block = static_cast<char*>(memory) - header_bytes;
  std::size_t size = 0;
  std::memcpy(&size, block, sizeof size);
  live_bytes.fetch_sub(static_cast<std::int64_t>(size));
  std::free(block);
}

}  // namespace

void* operator new(std::size_t size) { return counted_allocation(size); }
void* operator new[](std::size_t size) { return counted_allocation(size); }
void operator delete(void* memory) noexcept { counted_release(memory); }
void operator delete[](void* memory) noexcept { counted_release(memory); }
void operator delete(void* memory, std::size_t) noexcept { counted_release(memory); }
void operator delete[](void* memory, std::size_t) noexcept { counted_release(memory); }
// The nothrow forms too (std::stable_sort's buffer): a sanitizer's runtime defines its own, which
// would hand the sized delete above memory without the header.
void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  try {
    return counted_allocation(size);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t size, const std::nothrow_t& tag) noexcept { return operator new(size, tag); }
void operator delete(void* memory, const std::nothrow_t&) noexcept { counted_release(memory); }
void operator delete[](void* memory, const std::nothrow_t&) noexcept { counted_release(memory); }

namespace {

using namespace ckpt_test;
namespace fs = std::filesystem;
using comm_t = weft::communicator<weft::mpi_backend>;

comm_t world() { return comm_t(weft::mpi_backend::comm::world(), "world"); }

fs::path fresh_root(comm_t& group, const std::string& name) {
  const fs::path root = fs::path("distributed_checkpoint_mpi") / name;
  if (group.rank() == 0) {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  group.barrier();
  return root;
}

}  // namespace

TEST_CASE("saved by 4 ranks as 2 x 2 shards, loaded on 4, 2 and 1 ranks", "[checkpoint][distributed][mpi]") {
  auto group = world();
  REQUIRE(group.size() == 4);
  const fs::path root = fresh_root(group, "layouts");
  const int rank = group.rank();
  const auto mine = layout_pieces(2, 2, rank, 3);
  {
    ckpt::distributed_saver saver(rank, 4, ckpt::exchange_over(group), root);
    REQUIRE(saver.save({.step = 3, .data_position = {{"sample", 24}}, .layout = {{"tp", 2}, {"dp", 2}}, .model = "test"},
                       local_pieces(mine)));
    saver.wait();  // on rank 0, the index is written when this returns
  }
  group.barrier();

  ckpt::distributed_checkpoint checkpoint(root);
  REQUIRE(checkpoint.index().step == 3);
  REQUIRE(checkpoint.index().data_position.at("sample") == 24);
  REQUIRE(checkpoint.tensor("b").pieces.size() == 1);  // replicated on 4 ranks, written once
  // Every rank wrote its own file.
  for (int r = 0; r < 4; ++r) REQUIRE(fs::exists(root / "3" / ckpt::rank_file_name(r)));
  // The same layout: each rank gets its own bytes back exactly.
  REQUIRE(first_mismatch(checkpoint, mine).empty());
  // 2 ranks (tp 2, and dp 2) and 1 rank: the slices they need, from the files of other ranks.
  if (rank < 2) {
    REQUIRE(first_mismatch(checkpoint, layout_pieces(2, 1, rank, 3)).empty());
    REQUIRE(first_mismatch(checkpoint, layout_pieces(1, 2, rank, 3)).empty());
  }
  if (rank == 0) {
    REQUIRE(first_mismatch(checkpoint, layout_pieces(1, 1, 0, 3)).empty());
    REQUIRE(checkpoint.verify().empty());
  }
  group.barrier();
}

TEST_CASE("a rank's memory while saving and loading stays near its own shard, far below the model", "[checkpoint][distributed][mpi][memory]") {
  auto group = world();
  const fs::path root = fresh_root(group, "memory");
  const int rank = group.rank();
  const int ranks = group.size();
  const std::vector<std::int64_t> shape{512, 256};  // 1 MiB of F64
  const std::int64_t model_bytes = 512 * 256 * 8;
  // Saved as rows split over the ranks.
  const auto [row, rows] = split(512, ranks, rank);
  const ckpt::region saved_part{{row, 0}, {rows, 256}};
  const auto values = values_of_region("big", weft::dtype::float64, shape, saved_part);
  const std::int64_t shard_bytes = static_cast<std::int64_t>(values.size());
  const std::int64_t slack = 96 * 1024;  // headers, JSON, names, file paths
  {
    ckpt::distributed_saver saver(rank, ranks, ckpt::exchange_over(group), root);
    const std::vector<ckpt::local_piece> pieces{{"big", weft::dtype::float64, shape, saved_part, values}};
    group.barrier();
    const std::int64_t base = live_bytes.load();
    peak_bytes.store(base);
    REQUIRE(saver.save({.step = 1, .data_position = {}, .layout = {}, .model = "big"}, pieces));
    saver.wait();
    const std::int64_t extra = peak_bytes.load() - base;
    INFO("rank " << rank << ": " << extra << " bytes more at the peak of the save; shard " << shard_bytes << ", model " << model_bytes);
    REQUIRE(extra >= shard_bytes);  // the snapshot copy: the counter sees it
    REQUIRE(extra <= shard_bytes + slack);
  }
  group.barrier();

  // Loaded as columns split over the ranks: every rank reads a part of every saved piece.
  const auto [column, columns] = split(256, ranks, rank);
  const ckpt::region wanted{{0, column}, {512, columns}};
  const std::int64_t chunk = 64 * 1024;
  ckpt::distributed_checkpoint checkpoint(root, {.chunk_bytes = static_cast<std::size_t>(chunk)});
  const std::int64_t base = live_bytes.load();
  peak_bytes.store(base);
  const std::vector<double> loaded = checkpoint.read<double>("big", wanted);
  const std::int64_t extra = peak_bytes.load() - base;
  const std::int64_t wanted_bytes = 512 * columns * 8;
  INFO("rank " << rank << ": " << extra << " bytes more at the peak of the load; its part " << wanted_bytes << ", model " << model_bytes);
  REQUIRE(extra <= wanted_bytes + chunk + slack);
  if (ranks > 1) REQUIRE(extra < model_bytes / 2);
  const auto expected = values_of_region("big", weft::dtype::float64, shape, wanted);
  REQUIRE(std::memcmp(loaded.data(), expected.data(), expected.size()) == 0);
  group.barrier();
}
