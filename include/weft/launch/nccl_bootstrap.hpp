#pragma once
/// \file
/// Bringing up NCCL from MPI: one rank makes the NCCL unique id, MPI broadcasts it, every rank
/// joins with ncclCommInitRank. `nccl_world()` does the whole start-up: layout from the launcher
/// (checked against MPI), GPU by local rank, then the world communicator.
///
/// Failures are agreed before anyone blocks: if one rank cannot make the id or find its GPU,
/// every rank throws, instead of the others waiting forever inside NCCL's rendezvous.

#include <weft/config.hpp>

#if WEFT_HAS_NCCL && WEFT_HAS_MPI

#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <cstring>
#include <exception>
#include <source_location>
#include <optional>
#include <string>
#include <utility>

#include <weft/backend/mpi/check.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/backend/nccl/check.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/error.hpp>
#include <weft/launch/device.hpp>
#include <weft/launch/mpi_cross_check.hpp>
#include <weft/launch/resolve.hpp>

namespace weft {

namespace detail::launch {

/// Throws on every rank of `comm` if any rank has a `failure` (collective): a failed rank rethrows
/// its own exception, the others say that another rank failed at `step`.
inline void agree_on_failure(const std::exception_ptr& failure, MPI_Comm comm, const char* step) {
  int failed = failure ? 1 : 0;
  int any_failed = 0;
  WEFT_CHECK_MPI(launch_call(comm, trace::operation::all_reduce, dtype::int32, 1,
                             [&] { return MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, comm); }));
  if (failure) std::rethrow_exception(failure);
  if (any_failed) fail(std::string(step) + " failed on another rank (see that rank's error)");
}

}  // namespace detail::launch

/// An NCCL unique id made by `root` and broadcast over `comm` (collective): every rank returns
/// root's id. If root cannot make one, every rank throws.
inline ncclUniqueId exchange_unique_id(MPI_Comm comm, int root = 0) {
  int rank = 0;
  WEFT_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  // One message: root's result code, then the id, so a failure reaches the other ranks too.
  unsigned char message[sizeof(int) + sizeof(ncclUniqueId)] = {};
  ncclResult_t made = ncclSuccess;
  if (rank == root) {
    ncclUniqueId id{};
    made = ncclGetUniqueId(&id);
    int code = static_cast<int>(made);
    std::memcpy(message, &code, sizeof(int));
    std::memcpy(message + sizeof(int), &id, sizeof(id));
  }
  WEFT_CHECK_MPI(detail::launch::launch_call(comm, trace::operation::broadcast, dtype::uint8, sizeof(message), [&] {
    return MPI_Bcast(message, static_cast<int>(sizeof(message)), MPI_BYTE, root, comm);
  }));
  if (made != ncclSuccess) detail::throw_nccl_error(made, nullptr, "ncclGetUniqueId(&id)", std::source_location::current());
  int code = 0;
  std::memcpy(&code, message, sizeof(int));
  if (code != static_cast<int>(ncclSuccess))
    fail("NCCL bootstrap: rank " + std::to_string(root) + " could not make the NCCL unique id (" +
         ncclGetErrorString(static_cast<ncclResult_t>(code)) + "; see that rank's error)");
  ncclUniqueId id{};
  std::memcpy(&id, message + sizeof(int), sizeof(id));
  return id;
}

/// An NCCL communicator over the same ranks as `comm`, in the same order, on each rank's current
/// CUDA device (collective). Operations go on a stream of its own, or on `stream`; `group` names
/// it in messages and in NCCL's logs.
inline nccl_backend::comm nccl_comm_over(MPI_Comm comm, std::optional<cudaStream_t> stream = std::nullopt,
                                         std::string group = {}) {
  int rank = 0;
  int size = 0;
  WEFT_CHECK_MPI(MPI_Comm_rank(comm, &rank));
  WEFT_CHECK_MPI(MPI_Comm_size(comm, &size));
  // A rank without a usable GPU fails inside ncclCommInitRank while the others wait for it in
  // NCCL's rendezvous: find that out first, and fail everywhere.
  std::exception_ptr failure;
  try {
    visible_device_count();
  } catch (...) {
    failure = std::current_exception();
  }
  detail::launch::agree_on_failure(failure, comm, "finding a usable GPU");
  ncclUniqueId id = exchange_unique_id(comm);
  return nccl_backend::comm::init_rank(size, id, rank, stream, std::move(group));
}

/// How nccl_world() starts.
struct nccl_world_options {
  MPI_Comm bootstrap = MPI_COMM_WORLD;        ///< the ranks, and the channel for the unique id
  bool select_device = true;                  ///< cudaSetDevice by local rank (else: current device)
  std::optional<cudaStream_t> stream;         ///< nullopt: the communicator's own stream
  check_level checks = default_check_level(memory_space::device);
};

/// The world communicator over NCCL: resolves the layout from the launcher, checks it against
/// MPI, selects this rank's GPU, exchanges the unique id and joins (collective over
/// `options.bootstrap`; MPI must be initialised, e.g. by a weft::mpi_environment). The
/// communicator's ranks are the bootstrap communicator's.
inline communicator<nccl_backend> nccl_world(const nccl_world_options& options = {}) {
  int initialized = 0;
  WEFT_CHECK_MPI(MPI_Initialized(&initialized));
  if (!initialized) fail("nccl_world: MPI is not initialised; create a weft::mpi_environment first");
  // Launcher variables describe the MPI world; for a smaller bootstrap group MPI's own layout of
  // that group is the only one that applies.
  int same = MPI_UNEQUAL;
  WEFT_CHECK_MPI(MPI_Comm_compare(options.bootstrap, MPI_COMM_WORLD, &same));
  launch_info info = same == MPI_IDENT || same == MPI_CONGRUENT ? resolve_launch_with_mpi(options.bootstrap)
                                                                : detail::launch::mpi_layout(options.bootstrap);
  if (options.select_device) {
    std::exception_ptr failure;
    try {
      select_device(info);
    } catch (...) {
      failure = std::current_exception();
    }
    detail::launch::agree_on_failure(failure, options.bootstrap, "GPU selection");
  }
  return communicator<nccl_backend>(nccl_comm_over(options.bootstrap, options.stream, "world"), "world",
                                    options.checks);
}

}  // namespace weft

#endif  // WEFT_HAS_NCCL && WEFT_HAS_MPI
