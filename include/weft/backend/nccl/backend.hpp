#pragma once
/// \file
/// The NCCL backend: device buffers, one GPU per rank.
///
/// Every operation is enqueued on the communicator's CUDA stream (a non-blocking stream of its
/// own, or one the caller chooses), followed by a CUDA event; the returned request wraps that
/// event (see request.hpp: waiting polls the event and NCCL's async error, so a failed peer is an
/// error, not a hang). Blocking forms enqueue, then wait. To consume a result on a compute stream
/// without blocking the host, use `request::make_stream_wait(stream)`.
///
/// Conventions are the MPI backend's (and NCCL's): all_gather is in place when
/// send == recv + rank·n; reduce_scatter is in place when recv == send + rank·n; all_reduce,
/// reduce, broadcast and all_to_all are in place when send == recv. Avg is ncclAvg.
///
/// A communicator must not be used from several threads at once. Destroying it waits for its
/// pending work (aborting the NCCL communicator if that work failed), then destroys it.

#include <weft/config.hpp>

#if !WEFT_HAS_NCCL
#error "weft: this build has no NCCL backend (GPU collectives). Link weft::nccl (or weft::weft) from a weft configured with CUDA and NCCL found (WEFT_WITH_NCCL=ON or AUTO; NCCL under CUDA's prefix, or NCCL_ROOT), or use weft::mpi_backend on CPU."
#else

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <weft/backend/backend.hpp>
#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/cuda/stream.hpp>
#include <weft/backend/nccl/check.hpp>
#include <weft/backend/nccl/datatypes.hpp>
#include <weft/backend/nccl/detail/premul_sum.hpp>
#include <weft/backend/nccl/detail/shared_state.hpp>
#include <weft/backend/nccl/detail/stream_buffer.hpp>
#include <weft/backend/nccl/group_guard.hpp>
#include <weft/backend/nccl/request.hpp>
#include <weft/core/error.hpp>

namespace weft {

namespace detail::nccl {

/// Why joining a communicator may have failed, as far as this process can tell: most often there
/// is no usable GPU (no driver, none visible), which NCCL reports only as "unhandled cuda error".
inline std::string init_failure_context(int ranks, int rank) {
  std::string joining = "joining an NCCL communicator as rank " + std::to_string(rank) + " of " +
                        std::to_string(ranks) + " failed";
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess)
    return joining + ": no usable GPU: cudaGetDeviceCount returned " + std::to_string(static_cast<int>(status)) +
           " (" + cuda_error_text(status) +
           "); run on a machine with an NVIDIA GPU and its driver loaded, visible to this process "
           "(check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  if (count == 0)
    return joining + ": no GPU is visible to this process (check nvidia-smi and CUDA_VISIBLE_DEVICES)";
  int device = -1;
  cudaGetDevice(&device);
  return joining + " on CUDA device " + std::to_string(device) + " of " + std::to_string(count) +
         ": every rank must pass the same unique id and rank count, and use a GPU of its own "
         "(NCCL_DEBUG=WARN shows NCCL's view)";
}

}  // namespace detail::nccl

struct nccl_backend {
  static constexpr std::string_view name = "nccl";
  /// Buffers are device memory of the communicator's GPU.
  static constexpr memory_space buffers = memory_space::device;

  using request = nccl::request;

  class comm {
   public:
    /// An invalid communicator (what split() returns to a rank that is left out).
    comm() = default;

    /// Joins a new communicator of `ranks` ranks as `rank`, on the current CUDA device. Collective:
    /// every rank passes the id one of them made with ncclGetUniqueId (see weft/launch/nccl_bootstrap.hpp).
    /// Operations go on a new stream of the communicator's own, or on `stream` if given.
    static comm init_rank(int ranks, const ncclUniqueId& id, int rank,
                          std::optional<cudaStream_t> stream = std::nullopt) {
      if (ranks <= 0 || rank < 0 || rank >= ranks)
        fail("NCCL communicator: rank " + std::to_string(rank) + " is not within 0.." + std::to_string(ranks - 1) +
             "; pass this process's rank and the number of ranks");
      ncclComm_t handle = nullptr;
      ncclResult_t result = ncclCommInitRank(&handle, ranks, id, rank);
      if (result != ncclSuccess)
        detail::throw_nccl_error(result, nullptr, "ncclCommInitRank(&handle, ranks, id, rank)",
                                 std::source_location::current(), detail::nccl::init_failure_context(ranks, rank));
      return adopt(handle, stream);
    }

    /// Takes ownership of an NCCL communicator made elsewhere (destroyed with this object).
    static comm adopt(ncclComm_t handle, std::optional<cudaStream_t> stream = std::nullopt) {
      comm result;
      try {
        result.state_ = std::make_shared<detail::nccl::shared_state>();
        WEFT_CHECK_NCCL(ncclCommCount(handle, &result.state_->size), handle);
        WEFT_CHECK_NCCL(ncclCommUserRank(handle, &result.state_->rank), handle);
        WEFT_CHECK_NCCL(ncclCommCuDevice(handle, &result.state_->device), handle);
        result.state_->timeout = detail::nccl::timeout_from_environment();
        result.rank_ = result.state_->rank;
        result.size_ = result.state_->size;
        result.state_->handle.store(handle, std::memory_order_release);
        result.use_stream(stream);
      } catch (...) {
        if (result.state_) result.state_->handle.store(nullptr, std::memory_order_release);
        result.state_.reset();
        ncclCommAbort(handle);
        throw;
      }
      return result;
    }

    comm(comm&& other) noexcept { take(other); }
    comm& operator=(comm&& other) noexcept {
      if (this != &other) {
        release();
        take(other);
      }
      return *this;
    }
    comm(const comm&) = delete;
    comm& operator=(const comm&) = delete;
    ~comm() { release(); }

    /// False for a default-constructed, moved-from, split-out or aborted communicator.
    bool valid() const noexcept { return state_ && state_->handle.load(std::memory_order_acquire) != nullptr; }
    int rank() const noexcept { return rank_; }
    int size() const noexcept { return size_; }
    /// The CUDA device the communicator lives on.
    int device() const noexcept { return state_ ? state_->device : -1; }
    ncclComm_t native() const noexcept { return state_ ? state_->handle.load(std::memory_order_acquire) : nullptr; }
    /// The stream operations are enqueued on.
    cudaStream_t stream() const noexcept { return stream_; }

    /// Enqueues later operations on `s` (or, with nullopt, on the communicator's own stream).
    /// Work already enqueued stays ordered before them.
    void use_stream(std::optional<cudaStream_t> s) {
      check_live("use_stream");
      cuda::device_guard on(state_->device);
      cudaStream_t next = nullptr;
      if (s) {
        next = *s;
      } else {
        if (!own_stream_) own_stream_ = cuda::stream::create();
        next = own_stream_.native();
      }
      if (has_stream_ && next == stream_) return;
      if (has_stream_) cuda::wait_for_stream(next, stream_);
      stream_ = next;
      has_stream_ = true;
      borrowed_stream_ = s.has_value();
    }

    /// How long wait() waits before throwing (0: no limit). Defaults to WEFT_NCCL_TIMEOUT seconds.
    void set_timeout(std::chrono::milliseconds timeout) {
      check_live("set_timeout");
      state_->timeout = timeout;
    }

    request all_reduce(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, completion how) {
      auto on = enter("all_reduce");
      ncclComm_t h = handle();
      WEFT_CHECK_NCCL(ncclAllReduce(send, recv, n, nccl_type(t), nccl_op(op), h, stream_), h);
      return finish("all_reduce", how);
    }

    /// `recv` matters on the root only (it may be null elsewhere).
    request reduce(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, int root, completion how) {
      auto on = enter("reduce");
      ncclComm_t h = handle();
      WEFT_CHECK_NCCL(ncclReduce(send, recv, n, nccl_type(t), nccl_op(op), root, h, stream_), h);
      return finish("reduce", how);
    }

    /// `send` matters on the root only (it may be null elsewhere).
    request broadcast(const void* send, void* recv, std::size_t n, dtype t, int root, completion how) {
      auto on = enter("broadcast");
      ncclComm_t h = handle();
      const void* source = rank_ == root ? send : recv;  // NCCL reads send on the root only
      WEFT_CHECK_NCCL(ncclBroadcast(source, recv, n, nccl_type(t), root, h, stream_), h);
      return finish("broadcast", how);
    }

    /// In place when send == recv + rank·n.
    request all_gather(const void* send, void* recv, std::size_t n, dtype t, completion how) {
      auto on = enter("all_gather");
      ncclComm_t h = handle();
      WEFT_CHECK_NCCL(ncclAllGather(send, recv, n, nccl_type(t), h, stream_), h);
      return finish("all_gather", how);
    }

    /// In place when recv == send + rank·n (the result lands in this rank's block).
    request reduce_scatter(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, completion how) {
      auto on = enter("reduce_scatter");
      ncclComm_t h = handle();
      WEFT_CHECK_NCCL(ncclReduceScatter(send, recv, n, nccl_type(t), nccl_op(op), h, stream_), h);
      return finish("reduce_scatter", how);
    }

    /// The sum over ranks of `factor` x each rank's values (floating-point types): the scaling
    /// runs inside the reduction kernel, with no pass over memory of its own. In place when
    /// send == recv.
    request all_reduce_scaled(const void* send, void* recv, std::size_t n, dtype t, double factor, completion how) {
      auto on = enter("all_reduce_scaled");
      ncclComm_t h = handle();
      detail::nccl::premul_sum op(factor, t, h);
      WEFT_CHECK_NCCL(ncclAllReduce(send, recv, n, nccl_type(t), op.op(), h, stream_), h);
      return finish("all_reduce_scaled", how);
    }

    /// reduce_scatter of `factor` x each rank's values; in place when recv == send + rank·n.
    request reduce_scatter_scaled(const void* send, void* recv, std::size_t n, dtype t, double factor,
                                  completion how) {
      auto on = enter("reduce_scatter_scaled");
      ncclComm_t h = handle();
      detail::nccl::premul_sum op(factor, t, h);
      WEFT_CHECK_NCCL(ncclReduceScatter(send, recv, n, nccl_type(t), op.op(), h, stream_), h);
      return finish("reduce_scatter_scaled", how);
    }

    /// `n` elements per peer. Grouped send/recv (what NCCL's own all-to-all does, and available in
    /// every NCCL version); in place goes through a stream-ordered copy of the input.
    request all_to_all(const void* send, void* recv, std::size_t n, dtype t, completion how) {
      auto on = enter("all_to_all");
      ncclComm_t h = handle();
      const std::size_t block = n * size_of(t);
      const std::size_t total = block * static_cast<std::size_t>(size_);
      std::optional<detail::nccl::stream_buffer> copy;
      const char* source = static_cast<const char*>(send);
      if (send == recv && total > 0) {
        copy.emplace(total, stream_);
        WEFT_CHECK_CUDA(cudaMemcpyAsync(copy->data(), send, total, cudaMemcpyDeviceToDevice, stream_));
        source = copy->data();
      }
      char* target = static_cast<char*>(recv);
      nccl::group_guard group;
      for (int peer = 0; peer < size_; ++peer) {
        const std::size_t offset = static_cast<std::size_t>(peer) * block;
        WEFT_CHECK_NCCL(ncclSend(source + offset, n, nccl_type(t), peer, h, stream_), h);
        WEFT_CHECK_NCCL(ncclRecv(target + offset, n, nccl_type(t), peer, h, stream_), h);
      }
      group.end();
      return finish("all_to_all", how);
    }

    request send(const void* buffer, std::size_t n, dtype t, int peer, completion how) {
      auto on = enter("send");
      ncclComm_t h = handle();
      WEFT_CHECK_NCCL(ncclSend(buffer, n, nccl_type(t), peer, h, stream_), h);
      return finish("send", how);
    }

    request recv(void* buffer, std::size_t n, dtype t, int peer, completion how) {
      auto on = enter("recv");
      ncclComm_t h = handle();
      WEFT_CHECK_NCCL(ncclRecv(buffer, n, nccl_type(t), peer, h, stream_), h);
      return finish("recv", how);
    }

    /// All sends and receives of the batch in one NCCL group, so they progress together.
    request group_p2p(std::span<const p2p_op> ops, completion how) {
      auto on = enter("group_p2p");
      ncclComm_t h = handle();
      nccl::group_guard group;
      for (const p2p_op& op : ops) {
        if (op.direction == p2p_op::kind::send)
          WEFT_CHECK_NCCL(ncclSend(op.buffer, op.count, nccl_type(op.type), op.peer, h, stream_), h);
        else
          WEFT_CHECK_NCCL(ncclRecv(op.buffer, op.count, nccl_type(op.type), op.peer, h, stream_), h);
      }
      group.end();
      return finish("group_p2p", how);
    }

    /// NCCL has no barrier: a one-element all-reduce stands in. Its blocking form returns once
    /// every rank has reached it and this rank's earlier operations have finished.
    request barrier(completion how) {
      auto on = enter("barrier");
      ncclComm_t h = handle();
      detail::nccl::stream_buffer word(sizeof(std::int32_t), stream_);
      WEFT_CHECK_CUDA(cudaMemsetAsync(word.data(), 0, sizeof(std::int32_t), stream_));
      WEFT_CHECK_NCCL(ncclAllReduce(word.data(), word.data(), 1, ncclInt32, ncclSum, h, stream_), h);
      return finish("barrier", how);
    }

    /// Collective over this communicator (ncclCommSplit): ranks with the same color form a group,
    /// ordered by key; a negative color leaves this rank out (invalid result). The child uses the
    /// parent's stream if the caller chose it, otherwise a stream of its own.
    comm split(int color, int key) {
      check_live("split");
      cuda::device_guard on(state_->device);
      ncclComm_t h = handle();
      ncclComm_t child = nullptr;
      WEFT_CHECK_NCCL(ncclCommSplit(h, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr), h);
      if (child == nullptr) return comm();
      comm result = adopt(child, borrowed_stream_ ? std::optional<cudaStream_t>(stream_) : std::nullopt);
      result.state_->timeout = state_->timeout;
      return result;
    }

    /// A small all-gather of host values (agreement checks), through a temporary device buffer.
    /// Blocking; waits for this rank's earlier operations too.
    void host_all_gather(std::span<const std::int64_t> local, std::span<std::int64_t> gathered) {
      if (gathered.size() != local.size() * static_cast<std::size_t>(size_))
        fail("NCCL host_all_gather: " + std::to_string(gathered.size()) + " slots for " + std::to_string(size_) +
             " ranks of " + std::to_string(local.size()) + " values; pass size() x local.size() slots");
      auto on = enter("host_all_gather");
      if (local.empty()) return;  // every rank passes the same size: nothing to exchange anywhere
      ncclComm_t h = handle();
      const std::size_t bytes = local.size_bytes();
      detail::nccl::stream_buffer staging(bytes * static_cast<std::size_t>(size_), stream_);
      char* mine = staging.data() + static_cast<std::size_t>(rank_) * bytes;
      // Copies between device and pageable host memory may block the host until the stream gets
      // there, without watching for NCCL errors: let the stream drain by polling before each copy.
      finish("host_all_gather", completion::blocking);
      WEFT_CHECK_CUDA(cudaMemcpyAsync(mine, local.data(), bytes, cudaMemcpyHostToDevice, stream_));
      WEFT_CHECK_NCCL(ncclAllGather(mine, staging.data(), local.size(), ncclInt64, h, stream_), h);
      finish("host_all_gather", completion::blocking);
      WEFT_CHECK_CUDA(
          cudaMemcpyAsync(gathered.data(), staging.data(), gathered.size_bytes(), cudaMemcpyDeviceToHost, stream_));
      WEFT_CHECK_CUDA(cudaStreamSynchronize(stream_));
    }

    /// Blocks until every operation enqueued on this communicator's stream has finished.
    void wait_all() {
      auto on = enter("wait_all");
      finish("wait_all", completion::blocking);
    }

    /// NCCL's asynchronous error state (ncclSuccess while healthy).
    ncclResult_t async_error() const {
      ncclComm_t h = native();
      if (h == nullptr) return ncclSuccess;
      ncclResult_t async = ncclSuccess;
      WEFT_CHECK_NCCL(ncclCommGetAsyncError(h, &async), h);
      return async;
    }

    /// Tears the communicator down at once (ncclCommAbort), even with operations stuck on a failed
    /// peer: their kernels stop, their requests throw on wait, and the communicator becomes
    /// invalid. The way out after an error; every rank must then build a new communicator.
    void abort() {
      if (!valid()) return;
      state_->aborted.store(true, std::memory_order_release);  // before the handle goes: see request::poll
      ncclComm_t h = state_->handle.exchange(nullptr, std::memory_order_acq_rel);
      if (h != nullptr) WEFT_CHECK_NCCL(ncclCommAbort(h), nullptr);
    }

   private:
    static ncclDataType_t nccl_type(dtype t) noexcept { return detail::nccl::datatype_of(t); }
    static ncclRedOp_t nccl_op(reduce_op op) noexcept { return detail::nccl::op_of(op); }

    ncclComm_t handle() const noexcept { return state_->handle.load(std::memory_order_relaxed); }

    void check_live(const char* operation) const {
      if (valid()) return;
      if (state_ && state_->aborted.load(std::memory_order_acquire))
        fail(std::string("NCCL ") + operation + ": the communicator was aborted; build a new one");
      fail(std::string("NCCL ") + operation + ": the communicator is not valid (default-constructed, moved from, "
                                              "or this rank was left out of a split)");
    }

    /// Checks the communicator is usable and makes its device current for the operation.
    cuda::device_guard enter(const char* operation) {
      check_live(operation);
      return cuda::device_guard(state_->device);
    }

    /// Records the completion event after the enqueued operation; waits for it if blocking.
    request finish(const char* operation, completion how) {
      cuda::event done = state_->take_event();
      done.record(stream_);
      request pending(state_, std::move(done), operation);
      if (how == completion::async) return pending;
      pending.wait();
      return {};
    }

    void take(comm& other) noexcept {
      state_ = std::move(other.state_);
      own_stream_ = std::move(other.own_stream_);
      stream_ = std::exchange(other.stream_, nullptr);
      has_stream_ = std::exchange(other.has_stream_, false);
      borrowed_stream_ = std::exchange(other.borrowed_stream_, false);
      rank_ = std::exchange(other.rank_, 0);
      size_ = std::exchange(other.size_, 0);
    }

    void release() noexcept {
      if (!state_) return;
      if (ncclComm_t h = state_->handle.load(std::memory_order_acquire); h != nullptr) {
        bool healthy = true;
        try {
          wait_all();
          healthy = async_error() == ncclSuccess;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "weft: NCCL %s: pending work failed while the communicator was destroyed: %s\n",
                       state_->describe().c_str(), e.what());
          healthy = false;
        }
        state_->handle.store(nullptr, std::memory_order_release);
        if (healthy) {
          if (ncclResult_t r = ncclCommDestroy(h); r != ncclSuccess)
            std::fprintf(stderr, "weft: NCCL %s: ncclCommDestroy failed: %s\n", state_->describe().c_str(),
                         ncclGetErrorString(r));
        } else {
          state_->aborted.store(true, std::memory_order_release);
          ncclCommAbort(h);
        }
      }
      own_stream_ = cuda::stream();
      stream_ = nullptr;
      has_stream_ = false;
      state_.reset();
    }

    std::shared_ptr<detail::nccl::shared_state> state_;
    cuda::stream own_stream_;
    cudaStream_t stream_ = nullptr;
    bool has_stream_ = false;
    bool borrowed_stream_ = false;
    int rank_ = 0;
    int size_ = 0;
  };
};

static_assert(backend<nccl_backend>);

}  // namespace weft

#endif  // !WEFT_HAS_NCCL
