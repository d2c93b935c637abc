#pragma once
// Shared by the multi-rank communicator tests: the world communicator and value helpers.
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

#include <cstdint>
#include <type_traits>

namespace weft_test {

using mpi_comm = weft::communicator<weft::mpi_backend>;

inline mpi_comm world() { return mpi_comm(weft::mpi_backend::comm::world(), "world"); }

template <class T>
T make(double v) {
  if constexpr (std::is_same_v<T, weft::half> || std::is_same_v<T, weft::bfloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
double value(T v) {
  if constexpr (std::is_same_v<T, weft::half> || std::is_same_v<T, weft::bfloat16>)
    return static_cast<double>(float(v));
  else
    return static_cast<double>(v);
}

}  // namespace weft_test
