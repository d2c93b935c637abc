// NCCL start-up over MPI, the parts that need no GPU: the unique-id exchange, and every rank
// failing together (never hanging) when no GPU is usable. On a GPU machine the failure cases
// are skipped with a warning (the gpu-labelled tests cover the working path).
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <weft/launch/nccl_bootstrap.hpp>

#include <cstring>
#include <string>
#include <vector>

using Catch::Contains;

namespace {

int mpi_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int mpi_size() {
  int s = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

// Every rank's id, gathered with plain MPI (independently of the exchange under test).
std::vector<ncclUniqueId> gather_ids(const ncclUniqueId& mine) {
  std::vector<ncclUniqueId> all(static_cast<std::size_t>(mpi_size()));
  MPI_Allgather(&mine, sizeof(ncclUniqueId), MPI_BYTE, all.data(), sizeof(ncclUniqueId), MPI_BYTE, MPI_COMM_WORLD);
  return all;
}

bool same(const ncclUniqueId& a, const ncclUniqueId& b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

bool gpu_usable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace

TEST_CASE("every rank gets the root's NCCL unique id", "[nccl][bootstrap]") {
  const int p = mpi_size();
  ncclUniqueId from_first = weft::exchange_unique_id(MPI_COMM_WORLD);
  auto all = gather_ids(from_first);
  for (int r = 0; r < p; ++r) CHECK(same(all[static_cast<std::size_t>(r)], all[0]));
  ncclUniqueId zero{};
  CHECK_FALSE(same(from_first, zero));

  // Another root, another id: each exchange carries a fresh one.
  ncclUniqueId from_last = weft::exchange_unique_id(MPI_COMM_WORLD, p - 1);
  auto again = gather_ids(from_last);
  for (int r = 0; r < p; ++r) CHECK(same(again[static_cast<std::size_t>(r)], again[0]));
  CHECK_FALSE(same(from_last, from_first));
}

TEST_CASE("without a GPU, joining over MPI fails on every rank, before the rendezvous", "[nccl][bootstrap][nogpu]") {
  if (gpu_usable()) {
    WARN("a GPU is present: the no-GPU errors are not checked here");
    return;
  }
  // Checked before ncclCommInitRank, so no rank is left waiting in NCCL's rendezvous.
  try {
    weft::nccl_comm_over(MPI_COMM_WORLD);
    FAIL("no exception");
  } catch (const weft::backend_error& e) {
    CHECK(e.library() == weft::backend_library::cuda);
    CHECK(e.call() == "cudaGetDeviceCount(&count)");
    CHECK_THAT(std::string(e.what()), Contains("no usable GPU"));
  }
}

TEST_CASE("without a GPU, nccl_world fails on every rank at GPU selection", "[nccl][bootstrap][nogpu]") {
  if (gpu_usable()) {
    WARN("a GPU is present: the no-GPU errors are not checked here");
    return;
  }
  try {
    auto world = weft::nccl_world();
    FAIL("no exception");
  } catch (const weft::backend_error& e) {
    CHECK(e.library() == weft::backend_library::cuda);
    CHECK(e.call() == "cudaGetDeviceCount(&count)");
    CHECK(e.rank() == mpi_rank());
    CHECK_THAT(std::string(e.what()), Contains("no usable GPU"));
  }
}
