#pragma once
/// \file
/// GPU selection by local rank: local rank i uses visible device i. When each rank sees exactly
/// one device (Slurm's --gpus-per-task, or a per-rank CUDA_VISIBLE_DEVICES), that one is used.
/// Anything else (more ranks on the node than visible GPUs) is an error, since NCCL cannot put
/// two ranks of a communicator on one GPU.

#include <weft/config.hpp>

#include <cstdlib>
#include <string>

#include <weft/core/error.hpp>
#include <weft/launch/resolve.hpp>

#if WEFT_HAS_CUDA
#include <cuda_runtime_api.h>

#include <source_location>

#include <weft/backend/cuda/check.hpp>
#endif

namespace weft {

/// The device index for `local_rank` of `local_world_size` ranks on a node that shows
/// `device_count` devices to each process (pure: no CUDA call).
inline int device_for_local_rank(int local_rank, int local_world_size, int device_count) {
  if (local_rank < 0 || local_rank >= local_world_size)
    fail("GPU selection: local rank " + std::to_string(local_rank) + " is not within 0.." +
         std::to_string(local_world_size - 1));
  if (device_count <= 0)
    fail("GPU selection: no GPU is visible to this process (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  if (device_count >= local_world_size) return local_rank;
  if (device_count == 1) return 0;
  fail("GPU selection: local rank " + std::to_string(local_rank) + " of " + std::to_string(local_world_size) +
       " on this node has no GPU of its own: " + std::to_string(device_count) +
       " are visible; run at most one rank per GPU on each node");
}

#if WEFT_HAS_CUDA

/// The number of GPUs this process sees; throws a clear error when there is no usable driver
/// (cudaGetDeviceCount then fails, e.g. with cudaErrorInsufficientDriver, and sets no count).
inline int visible_device_count() {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    detail::throw_cuda_error(status, "cudaGetDeviceCount(&count)", std::source_location::current(),
                             "no usable GPU: this process cannot reach an NVIDIA GPU driver (CUDA_VISIBLE_DEVICES=" +
                                 std::string(visible != nullptr ? visible : "<unset>") +
                                 "); run on a GPU node with the driver loaded (nvidia-smi must list the GPUs)");
  }
  if (count == 0) fail("GPU selection: no GPU is visible to this process (check nvidia-smi and CUDA_VISIBLE_DEVICES)");
  return count;
}

/// Makes this rank's GPU current (cudaSetDevice) and returns its index.
inline int select_device(const launch_info& info) {
  int device = device_for_local_rank(info.local_rank, info.local_world_size, visible_device_count());
  WEFT_CHECK_CUDA(cudaSetDevice(device));
  return device;
}

#endif  // WEFT_HAS_CUDA

}  // namespace weft
