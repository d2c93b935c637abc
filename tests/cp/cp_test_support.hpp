#pragma once
// What the multi-rank context-parallel tests share: the cp group, and a rank-local tensor gathered
// from every rank and put back in sequence order (to compare with the one-rank reference).
#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/cp/causal_split.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace cp_test {

using comm_t = weft::communicator<weft::mpi_backend>;

inline comm_t cp_group() { return comm_t(weft::mpi_backend::comm::world(), "cp"); }

// Every rank's local tensor gathered and put back in sequence order.
template <class T>
std::vector<T> gather_full(comm_t& group, const weft::cp::sequence_split& split, const std::vector<T>& local,
                           std::size_t row) {
  std::vector<T> all(local.size() * static_cast<std::size_t>(group.size()));
  group.all_gather(local, all);
  std::vector<T> full(static_cast<std::size_t>(split.seq) * row);
  for (int r = 0; r < group.size(); ++r)
    weft::cp::unshard<T>(split, r,
                         std::span<const T>(all).subspan(static_cast<std::size_t>(r) * local.size(), local.size()),
                         row, full);
  return full;
}

}  // namespace cp_test
