#pragma once
// What the fault and dump programs' ranks do while a fault is planted in one of them: small
// all-reduces for `seconds`, with a pause between them that leaves the cores to the test harness
// and the other ranks.

#include <algorithm>
#include <chrono>
#include <vector>

#include <unistd.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

namespace weft_tests {

inline void all_reduce_loop(weft::communicator<weft::mpi_backend>& world, double seconds) {
  std::vector<float> data(256, 1.0f);
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    world.all_reduce(data);
    std::fill(data.begin(), data.end(), 1.0f);
    usleep(1000);
  }
}

}  // namespace weft_tests
