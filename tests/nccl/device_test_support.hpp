#pragma once
// What the device-memory GPU tests of the parallelism layers share (tp, cp, pipeline on NCCL):
// (device arrays: gpu_test_support.hpp), a wait for the communicator's stream,
// a kernel that is slow to produce its output, and an exact comparison that names the first
// differing element.
#include <catch2/catch.hpp>

#include "gpu_test_support.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace weft_test {

// Waits until everything queued on the communicator's stream has finished (polling NCCL's error
// state and the deadline, so a lost peer is an error, not a hang).
inline void settle(nccl_comm& comm) { comm.native().wait_all(); }

// Spins about `cycles` GPU clock cycles, then copies n elements: a producer that is still running
// long after the host queued it (about 50 ms at 1e8 cycles).
template <class T>
__global__ void spin_then_copy(T* dst, const T* src, long n, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

inline constexpr long long slow_producer_cycles = 100'000'000;

// got == want element by element (exact: the tests use small integers, exact in their type). On a
// difference: the first differing index, both values, and how many differ, under `what`.
template <class T>
void check_exact(const std::string& what, const std::vector<T>& got, const std::vector<double>& want) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  std::size_t wrong = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (static_cast<double>(static_cast<float>(got[i])) != want[i]) {
      if (wrong == 0) first = i;
      ++wrong;
    }
  if (wrong != 0) {
    INFO(wrong << " of " << got.size() << " elements differ; the first at index " << first << ": got "
               << static_cast<double>(static_cast<float>(got[first])) << ", expected " << want[first]);
    CHECK(wrong == 0);
  }
}

}  // namespace weft_test
