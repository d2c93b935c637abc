#pragma once
// The data-parallel group the gradient tests run on: the world, named "dp".
#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>

using comm_t = weft::communicator<weft::mpi_backend>;

inline comm_t dp_group() { return comm_t(weft::mpi_backend::comm::world(), "dp"); }
