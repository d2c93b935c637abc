// Compiled by nvcc: the NCCL backend, the typed communicator and the NCCL bootstrap must be usable
// from CUDA translation units (a trainer's kernels live next to its communication code).
#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/dtype.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/launch/device.hpp>
#include <weft/launch/resolve.hpp>
#if WEFT_HAS_MPI
#include <weft/launch/nccl_bootstrap.hpp>
#endif

#include <cstdio>
#include <cstring>

static_assert(weft::backend<weft::nccl_backend>);
static_assert(sizeof(weft::half) == 2 && sizeof(weft::bfloat16) == 2);
static_assert(weft::dtype_of<weft::half> == weft::dtype::float16);

__global__ void scale(float* data, float factor, int n) {
  int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) data[i] *= factor;
}

using world_type = weft::communicator<weft::nccl_backend>;

// Every member of the device synchronizer compiles under nvcc.
template class weft::grad::synchronizer<weft::nccl_backend, float>;
template class weft::grad::synchronizer<weft::nccl_backend, weft::bfloat16>;

int main() {
  // Host code only: this test runs without a GPU. It checks that host logic compiled by nvcc
  // behaves as when compiled by the C++ compiler.
  weft::environment_map env{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}};
  weft::launch_info info = weft::resolve_launch(env);
  int device = weft::device_for_local_rank(info.local_rank, info.local_world_size, 2);
  weft::nccl_backend::request done;
  if (info.rank != 3 || info.node != 1 || device != 1 || !done.test() ||
      std::strcmp(weft::nccl_backend::name.data(), "nccl") != 0) {
    std::printf("nvcc-compiled weft gave wrong results\n");
    return 1;
  }
  std::printf("weft %s backend compiled by nvcc: ok\n", weft::nccl_backend::name.data());
  return 0;
}
