#pragma once
// What the GPU tests share: one NCCL world communicator for the whole run (building one costs far
// more than the tests; it lives until the process exits) and a CUDA status check that names the
// error.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/launch/nccl_bootstrap.hpp>

namespace weft_test {

using nccl_comm = weft::communicator<weft::nccl_backend>;

inline nccl_comm& world() {
  static nccl_comm* comm = new nccl_comm(weft::nccl_world());
  return *comm;
}

inline void cuda_ok(cudaError_t status) {
  INFO(cudaGetErrorName(status) << ": " << cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

}  // namespace weft_test
