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
/// Communicators are created non-blocking (ncclConfig_t::blocking = 0), so joining, splitting,
/// enqueueing and destroying all return at once and are then polled under the deadline
/// (WEFT_COMM_TIMEOUT, 10 minutes by default): nothing waits on a peer forever, and another thread
/// may abort() meanwhile. A communicator must otherwise not be used from several threads at once.
/// Destroying it waits for its pending work (aborting the NCCL communicator if that work failed or
/// passed the deadline), then destroys it.

#include <weft/config.hpp>

#if !WEFT_HAS_NCCL
#error "weft: this build has no NCCL backend (GPU collectives). Link weft::nccl (or weft::weft) from a weft configured with CUDA and NCCL found (WEFT_WITH_NCCL=ON or AUTO; NCCL under CUDA's prefix, or NCCL_ROOT), or use weft::mpi_backend on CPU. Without CMake, define WEFT_HAS_NCCL=1 and WEFT_HAS_CUDA=1 and link CUDA's runtime and NCCL (-lcudart -lnccl)."
#else

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/trace/abort_action.hpp>
#include <weft/backend/cuda/check.hpp>
#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/backend/cuda/stream.hpp>
#include <weft/backend/nccl/check.hpp>
#include <weft/backend/nccl/datatypes.hpp>
#include <weft/backend/nccl/detail/policy.hpp>
#include <weft/backend/nccl/detail/premul_sum.hpp>
#include <weft/backend/nccl/detail/shared_state.hpp>
#include <weft/backend/nccl/detail/stream_buffer.hpp>
#include <weft/backend/nccl/group_guard.hpp>
#include <weft/backend/nccl/request.hpp>
#include <weft/core/error.hpp>

/// An NCCL call inside a use of the communicator's handle (see use_scope): ncclInProgress from a
/// non-blocking communicator is noted and settled later; any other failure throws.
#define WEFT_NCCL_ENQUEUE(use, call) (use).check((call), #call, std::source_location::current())

namespace weft {

namespace detail::nccl {

/// The PCI bus id of the current device ("0000:3b:00.0"), or "unknown".
inline std::string current_bus_id() {
  int device = -1;
  char id[32] = {};
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetPCIBusId(id, sizeof(id), device) != cudaSuccess)
    return "unknown";
  return id;
}

/// Why joining a communicator may have failed, as far as this process can tell: two ranks on one
/// GPU (NCCL says only "Duplicate GPU"), or most often no usable GPU (no driver, none visible),
/// which NCCL reports only as "unhandled cuda error".
inline std::string init_failure_context(int ranks, int rank, ncclResult_t result = ncclSuccess,
                                        const std::string& nccl_text = {}) {
  if (result == ncclInvalidUsage && is_duplicate_gpu(nccl_text))
    return duplicate_gpu_message(rank, ranks, host_name(), current_bus_id(), nccl_text);
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

/// The loaded NCCL's version code (ncclGetVersion: 22809 for 2.28.9).
inline int runtime_version() {
  static const int version = [] {
    int v = 0;
    return ncclGetVersion(&v) == ncclSuccess ? v : 0;
  }();
  return version;
}

/// NCCL's last error text ("" when none).
inline std::string last_error_text(ncclComm_t comm) {
  const char* text = ncclGetLastError(comm);
  return text != nullptr ? text : "";
}

/// A new communicator's configuration: non-blocking, so that joining and splitting can be polled
/// under the deadline and aborted; named (NCCL's logs show the name) when `name` is not empty.
inline ncclConfig_t nonblocking_config(const std::string& name) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  if (!name.empty()) config.commName = name.c_str();
  return config;
}

/// Polls a communicator being created (`state` holds its handle) until NCCL has finished with it;
/// returns the outcome (ncclSuccess or an error). Past the deadline the handle is aborted and
/// the timeout thrown.
inline ncclResult_t settle_creation(shared_state& state, ncclResult_t result, const char* operation) {
  if (result != ncclInProgress) return result;
  state.poll_until(
      [&] {
        std::lock_guard lock(state.use);
        ncclComm_t h = state.handle.load(std::memory_order_acquire);
        if (h == nullptr) state.throw_gone(operation);
        ncclResult_t queried = ncclCommGetAsyncError(h, &result);
        if (queried != ncclSuccess) result = queried;
        return result != ncclInProgress;
      },
      operation);
  return result;
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
    /// Operations go on a new stream of the communicator's own, or on `stream` if given. `name`
    /// (the group's) appears in errors and in NCCL's logs. Joining is polled under the deadline:
    /// a rank that never joins makes the others fail with a timeout, not hang.
    static comm init_rank(int ranks, const ncclUniqueId& id, int rank,
                          std::optional<cudaStream_t> stream = std::nullopt, std::string group = {}) {
      if (ranks <= 0 || rank < 0 || rank >= ranks)
        fail("NCCL communicator: rank " + std::to_string(rank) + " is not within 0.." + std::to_string(ranks - 1) +
             "; pass this process's rank and the number of ranks");
      auto state = std::make_shared<detail::nccl::shared_state>();
      state->rank = rank;
      state->size = ranks;
      state->name = group;
      state->config_name = std::move(group);
      state->timeout = detail::nccl::timeout_from_environment();
      state->device = cuda::current_device_or(-1);
      ncclConfig_t config = detail::nccl::nonblocking_config(state->config_name);
      ncclComm_t handle = nullptr;
      ncclResult_t result = ncclCommInitRankConfig(&handle, ranks, id, rank, &config);
      if (handle != nullptr) state->handle.store(handle, std::memory_order_release);
      if (handle != nullptr) result = detail::nccl::settle_creation(*state, result, "joining the communicator");
      if (result != ncclSuccess) {
        const std::string text = detail::nccl::last_error_text(handle);
        std::string context = detail::nccl::init_failure_context(ranks, rank, result, text);
        state->abort();  // frees what NCCL made (non-blocking init leaves a handle behind)
        throw backend_error(backend_library::nccl, static_cast<int>(result), detail::nccl_error_text(result, nullptr),
                            "ncclCommInitRankConfig(&handle, ranks, id, rank, &config)",
                            std::source_location::current(), std::move(context));
      }
      comm joined = from_state(std::move(state), stream);
      joined.learn_world_ranks();
      return joined;
    }

    /// Takes ownership of an NCCL communicator made elsewhere (destroyed with this object). A
    /// non-blocking one must have finished initialising.
    static comm adopt(ncclComm_t handle, std::optional<cudaStream_t> stream = std::nullopt, std::string group = {}) {
      auto state = std::make_shared<detail::nccl::shared_state>();
      state->name = std::move(group);
      state->handle.store(handle, std::memory_order_release);
      try {
        state->timeout = detail::nccl::timeout_from_environment();
      } catch (...) {
        state->abort();
        throw;
      }
      return from_state(std::move(state), stream);
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

    /// The world rank of each member, in this communicator's rank order (for flight-recorder
    /// dumps, which line groups up by their members): learnt when the communicator is made by
    /// init_rank or split, with one all-gather of each rank's world rank under the deadline.
    /// Empty when unknown: adopted communicators, or ranks that do not know their world rank.
    std::vector<int> world_ranks() const { return world_ranks_; }
    ncclComm_t native() const noexcept { return state_ ? state_->handle.load(std::memory_order_acquire) : nullptr; }
    /// The stream operations are enqueued on.
    cudaStream_t stream() const noexcept { return stream_; }
    /// The group's name used in messages ("" when unnamed).
    std::string name() const { return state_ ? state_->name : std::string(); }
    /// Names the group in messages (a communicator wrapping this one passes its name).
    void set_name(std::string group) {
      check_live("set_name");
      state_->name = std::move(group);
    }

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

    /// The deadline of every wait on this communicator (0: none). Defaults to WEFT_COMM_TIMEOUT
    /// seconds (10 minutes when unset; WEFT_NCCL_TIMEOUT is a deprecated alias).
    void set_timeout(std::chrono::milliseconds timeout) {
      check_live("set_timeout");
      state_->timeout = timeout;
    }
    std::chrono::milliseconds timeout() const noexcept {
      return state_ ? state_->timeout : std::chrono::milliseconds(0);
    }

    request all_reduce(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, completion how) {
      auto use = enter("all_reduce");
      WEFT_NCCL_ENQUEUE(use, ncclAllReduce(send, recv, n, nccl_type(t), nccl_op(op), use.handle(), stream_));
      reduce_one_rank_tail(use, "all_reduce", n, t, op == reduce_op::avg, [&](std::size_t at, std::size_t count) {
        WEFT_NCCL_ENQUEUE(use, ncclAllReduce(element(send, at, t), element(recv, at, t), count, nccl_type(t),
                                             nccl_op(op), use.handle(), stream_));
      });
      return finish(use, "all_reduce", how);
    }

    /// `recv` matters on the root only (it may be null elsewhere).
    request reduce(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, int root, completion how) {
      auto use = enter("reduce");
      WEFT_NCCL_ENQUEUE(use, ncclReduce(send, recv, n, nccl_type(t), nccl_op(op), root, use.handle(), stream_));
      reduce_one_rank_tail(use, "reduce", n, t, op == reduce_op::avg, [&](std::size_t at, std::size_t count) {
        WEFT_NCCL_ENQUEUE(use, ncclReduce(element(send, at, t), element(recv, at, t), count, nccl_type(t), nccl_op(op),
                                          root, use.handle(), stream_));
      });
      return finish(use, "reduce", how);
    }

    /// `send` matters on the root only (it may be null elsewhere).
    request broadcast(const void* send, void* recv, std::size_t n, dtype t, int root, completion how) {
      auto use = enter("broadcast");
      const void* source = rank_ == root ? send : recv;  // NCCL reads send on the root only
      WEFT_NCCL_ENQUEUE(use, ncclBroadcast(source, recv, n, nccl_type(t), root, use.handle(), stream_));
      return finish(use, "broadcast", how);
    }

    /// In place when send == recv + rank·n.
    request all_gather(const void* send, void* recv, std::size_t n, dtype t, completion how) {
      auto use = enter("all_gather");
      WEFT_NCCL_ENQUEUE(use, ncclAllGather(send, recv, n, nccl_type(t), use.handle(), stream_));
      return finish(use, "all_gather", how);
    }

    /// In place when recv == send + rank·n (the result lands in this rank's block).
    request reduce_scatter(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, completion how) {
      auto use = enter("reduce_scatter");
      WEFT_NCCL_ENQUEUE(use, ncclReduceScatter(send, recv, n, nccl_type(t), nccl_op(op), use.handle(), stream_));
      reduce_one_rank_tail(use, "reduce_scatter", n, t, op == reduce_op::avg, [&](std::size_t at, std::size_t count) {
        WEFT_NCCL_ENQUEUE(use, ncclReduceScatter(element(send, at, t), element(recv, at, t), count, nccl_type(t),
                                                 nccl_op(op), use.handle(), stream_));
      });
      return finish(use, "reduce_scatter", how);
    }

    /// The sum over ranks of `factor` x each rank's values (floating-point types): the scaling
    /// runs inside the reduction kernel, with no pass over memory of its own. In place when
    /// send == recv. A factor the element type cannot hold accurately (see fold_scale_factor) is
    /// refused before anything is enqueued, on every rank alike.
    request all_reduce_scaled(const void* send, void* recv, std::size_t n, dtype t, double factor, completion how) {
      auto use = enter("all_reduce_scaled");
      detail::nccl::premul_sum op(factor, t, *state_);
      WEFT_NCCL_ENQUEUE(use, ncclAllReduce(send, recv, n, nccl_type(t), op.op(), use.handle(), stream_));
      reduce_one_rank_tail(use, "all_reduce_scaled", n, t, true, [&](std::size_t at, std::size_t count) {
        WEFT_NCCL_ENQUEUE(use, ncclAllReduce(element(send, at, t), element(recv, at, t), count, nccl_type(t), op.op(),
                                             use.handle(), stream_));
      });
      use.settle("all_reduce_scaled");
      return finish(use, "all_reduce_scaled", how);
    }

    /// reduce_scatter of `factor` x each rank's values; in place when recv == send + rank·n.
    request reduce_scatter_scaled(const void* send, void* recv, std::size_t n, dtype t, double factor,
                                  completion how) {
      auto use = enter("reduce_scatter_scaled");
      detail::nccl::premul_sum op(factor, t, *state_);
      WEFT_NCCL_ENQUEUE(use, ncclReduceScatter(send, recv, n, nccl_type(t), op.op(), use.handle(), stream_));
      reduce_one_rank_tail(use, "reduce_scatter_scaled", n, t, true, [&](std::size_t at, std::size_t count) {
        WEFT_NCCL_ENQUEUE(use, ncclReduceScatter(element(send, at, t), element(recv, at, t), count, nccl_type(t),
                                                 op.op(), use.handle(), stream_));
      });
      use.settle("reduce_scatter_scaled");
      return finish(use, "reduce_scatter_scaled", how);
    }

    /// `n` elements per peer. Grouped send/recv (what NCCL's own all-to-all does, and available in
    /// every NCCL version); in place goes through a stream-ordered copy of the input.
    request all_to_all(const void* send, void* recv, std::size_t n, dtype t, completion how) {
      auto use = enter("all_to_all");
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
        WEFT_NCCL_ENQUEUE(use, ncclSend(source + offset, n, nccl_type(t), peer, use.handle(), stream_));
        WEFT_NCCL_ENQUEUE(use, ncclRecv(target + offset, n, nccl_type(t), peer, use.handle(), stream_));
      }
      use.note(group.end());
      return finish(use, "all_to_all", how);
    }

    /// Ragged blocks, back to back in rank order: block j of `send` (send_counts[j] elements)
    /// goes to rank j, block i of `recv` (recv_counts[i]) comes from rank i. NCCL has no
    /// all-to-allv: grouped send/recv, as all_to_all; zero-count blocks post nothing. Not in place.
    request all_to_allv(const void* send, std::span<const std::size_t> send_counts, void* recv,
                        std::span<const std::size_t> recv_counts, dtype t, completion how) {
      auto use = enter("all_to_allv");
      const std::size_t element_bytes = size_of(t);
      const char* source = static_cast<const char*>(send);
      char* target = static_cast<char*>(recv);
      nccl::group_guard group;
      std::size_t send_at = 0, recv_at = 0;
      for (int peer = 0; peer < size_; ++peer) {
        const std::size_t out = send_counts[static_cast<std::size_t>(peer)];
        const std::size_t in = recv_counts[static_cast<std::size_t>(peer)];
        if (out > 0)
          WEFT_NCCL_ENQUEUE(use, ncclSend(source + send_at * element_bytes, out, nccl_type(t), peer, use.handle(), stream_));
        if (in > 0)
          WEFT_NCCL_ENQUEUE(use, ncclRecv(target + recv_at * element_bytes, in, nccl_type(t), peer, use.handle(), stream_));
        send_at += out;
        recv_at += in;
      }
      use.note(group.end());
      return finish(use, "all_to_allv", how);
    }

    /// Blocking only: an async send or receive on its own (outside a group) holds the stream
    /// until its partner arrives, so a receive posted before its send deadlocks. Use batch().
    request send(const void* buffer, std::size_t n, dtype t, int peer, completion how) {
      if (how == completion::async) refuse_unpaired("send_async");
      auto use = enter("send");
      WEFT_NCCL_ENQUEUE(use, ncclSend(buffer, n, nccl_type(t), peer, use.handle(), stream_));
      return finish(use, "send", how);
    }

    /// Blocking only, as send().
    request recv(void* buffer, std::size_t n, dtype t, int peer, completion how) {
      if (how == completion::async) refuse_unpaired("recv_async");
      auto use = enter("recv");
      WEFT_NCCL_ENQUEUE(use, ncclRecv(buffer, n, nccl_type(t), peer, use.handle(), stream_));
      return finish(use, "recv", how);
    }

    /// All sends and receives of the batch in one NCCL group, so they progress together: the way
    /// to post p2p asynchronously on NCCL.
    request group_p2p(std::span<const p2p_op> ops, completion how) {
      auto use = enter("group_p2p");
      nccl::group_guard group;
      for (const p2p_op& op : ops) {
        if (op.direction == p2p_op::kind::send)
          WEFT_NCCL_ENQUEUE(use, ncclSend(op.buffer, op.count, nccl_type(op.type), op.peer, use.handle(), stream_));
        else
          WEFT_NCCL_ENQUEUE(use, ncclRecv(op.buffer, op.count, nccl_type(op.type), op.peer, use.handle(), stream_));
      }
      use.note(group.end());
      return finish(use, "group_p2p", how);
    }

    /// NCCL has no barrier: a one-element all-reduce stands in. Its blocking form returns once
    /// every rank has reached it and this rank's earlier operations have finished.
    request barrier(completion how) {
      auto use = enter("barrier");
      detail::nccl::stream_buffer word(sizeof(std::int32_t), stream_);
      WEFT_CHECK_CUDA(cudaMemsetAsync(word.data(), 0, sizeof(std::int32_t), stream_));
      WEFT_NCCL_ENQUEUE(use, ncclAllReduce(word.data(), word.data(), 1, ncclInt32, ncclSum, use.handle(), stream_));
      return finish(use, "barrier", how);
    }

    /// Collective over this communicator (ncclCommSplit, non-blocking and polled under the
    /// deadline): ranks with the same color form a group, ordered by key; a negative color leaves
    /// this rank out (invalid result). The child uses the parent's stream if the caller chose it,
    /// otherwise a stream of its own. `group` names the child in messages and NCCL's logs (default:
    /// derived from the parent's).
    comm split(int color, int key, std::string group = {}) {
      auto use = enter("split");
      if (group.empty())
        group = (state_->name.empty() ? std::string("unnamed") : state_->name) + "/split(color " +
               std::to_string(color) + ")";
      auto state = std::make_shared<detail::nccl::shared_state>();
      state->name = group;
      state->config_name = std::move(group);
      state->device = state_->device;
      state->rank = rank_;  // the parent's, until the child can say (for messages)
      state->size = size_;
      state->timeout = state_->timeout;
      ncclConfig_t config = detail::nccl::nonblocking_config(state->config_name);
      ncclComm_t child = nullptr;
      // NCCL writes `child` from its own thread once the child is made; read it only after that.
      auto made = [&child] { return std::atomic_ref<ncclComm_t>(child).load(std::memory_order_acquire); };
      WEFT_NCCL_ENQUEUE(use, ncclCommSplit(use.handle(), color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config));
      // On a non-blocking parent, ncclCommSplit returns ncclSuccess (not ncclInProgress) while the
      // child is still being made (NCCL 2.28): wait for the parent in every case, or `child` is
      // still null here and the parent's next call fails ("Attempt to use communicator before the
      // previous operation returned ncclSuccess").
      use.note(ncclInProgress);
      try {
        use.settle("split");
      } catch (...) {
        // A timeout aborted the parent, which ends NCCL's thread: a half-made child is ours to free.
        if (ncclComm_t half_made = made(); half_made != nullptr) {
          state->handle.store(half_made, std::memory_order_release);
          state->abort();
        }
        throw;
      }
      use.unlock();
      child = made();
      if (child == nullptr) return comm();
      state->handle.store(child, std::memory_order_release);
      ncclResult_t result = detail::nccl::settle_creation(*state, ncclInProgress, "splitting the communicator");
      if (result != ncclSuccess) {
        const std::string text = detail::nccl::last_error_text(child);
        state->abort();
        throw backend_error(backend_library::nccl, static_cast<int>(result), detail::nccl_error_text(result, nullptr),
                            "ncclCommSplit(comm, color, key, &child, &config)", std::source_location::current(),
                            state_->describe() + ": splitting '" + state_->name + "' failed" +
                                (text.empty() ? std::string() : ": " + text));
      }
      comm made_child = from_state(std::move(state), borrowed_stream_ ? std::optional<cudaStream_t>(stream_) : std::nullopt);
      made_child.learn_world_ranks();
      return made_child;
    }

    /// A small all-gather of host values (agreement checks), through a temporary device buffer.
    /// Blocking; waits for this rank's earlier operations too.
    void host_all_gather(std::span<const std::int64_t> local, std::span<std::int64_t> gathered) {
      if (gathered.size() != local.size() * static_cast<std::size_t>(size_))
        fail("NCCL host_all_gather: " + std::to_string(gathered.size()) + " slots for " + std::to_string(size_) +
             " ranks of " + std::to_string(local.size()) + " values; pass size() x local.size() slots");
      auto use = enter("host_all_gather");
      if (local.empty()) return;  // every rank passes the same size: nothing to exchange anywhere
      const std::size_t bytes = local.size_bytes();
      detail::nccl::stream_buffer staging(bytes * static_cast<std::size_t>(size_), stream_);
      char* mine = staging.data() + static_cast<std::size_t>(rank_) * bytes;
      // Copies between device and pageable host memory may block the host until the stream gets
      // there, without watching for NCCL errors: let the stream drain by polling before each copy.
      drain(use, "host_all_gather");
      WEFT_CHECK_CUDA(cudaMemcpyAsync(mine, local.data(), bytes, cudaMemcpyHostToDevice, stream_));
      WEFT_NCCL_ENQUEUE(use, ncclAllGather(mine, staging.data(), local.size(), ncclInt64, use.handle(), stream_));
      use.settle("host_all_gather");
      drain(use, "host_all_gather");
      WEFT_CHECK_CUDA(
          cudaMemcpyAsync(gathered.data(), staging.data(), gathered.size_bytes(), cudaMemcpyDeviceToHost, stream_));
      drain(use, "host_all_gather");
    }

    /// Blocks until every operation enqueued on this communicator's stream has finished.
    void wait_all() {
      auto use = enter("wait_all");
      finish(use, "wait_all", completion::blocking);
    }

    /// Waits for `e` (an event recorded after this communicator's work, or after work that waits
    /// for it) by polling it with NCCL's error state and the deadline, as requests do: the way to
    /// wait for such events without cudaEventSynchronize, which would wait forever on a lost peer.
    void wait_event(cudaEvent_t e, const char* operation) {
      check_live(operation);
      state_->wait_event(e, operation);
    }

    /// NCCL's asynchronous error state (ncclSuccess while healthy, ncclInProgress while a
    /// non-blocking call is still being carried out).
    ncclResult_t async_error() const {
      if (!state_) return ncclSuccess;
      std::lock_guard lock(state_->use);
      ncclComm_t h = state_->handle.load(std::memory_order_acquire);
      if (h == nullptr) return ncclSuccess;
      ncclResult_t async = ncclSuccess;
      WEFT_CHECK_NCCL(ncclCommGetAsyncError(h, &async), h);
      return async;
    }

    /// Tears the communicator down at once (ncclCommAbort), even with operations stuck on a failed
    /// peer: their kernels stop, their requests throw on wait, and the communicator becomes
    /// invalid. The way out after an error; every rank must then build a new communicator. Safe
    /// to call from another thread (a watchdog) while the owner waits on or polls a request.
    void abort() noexcept {
      if (state_) state_->abort();
    }

    /// How the process's watchdog aborts this communicator from its own thread when an operation
    /// passes its deadline (weft/trace/watchdog.hpp): the kernels stop, the owner's waits throw.
    trace::abort_action abort_action() const {
      std::weak_ptr<detail::nccl::shared_state> state = state_;
      return {[state](int) {
                if (auto alive = state.lock()) alive->abort();
              },
              false};
    }

   private:
    /// The use of the handle by one call: the communicator's device made current and the handle
    /// held (abort() from another thread waits until the call has been enqueued). Non-blocking
    /// calls that return ncclInProgress are settled, with the lock let go, before the next step.
    class use_scope {
     public:
      use_scope(detail::nccl::shared_state& state, const char* operation)
          : state_(state), on_(state.device), lock_(state.use), handle_(state.handle.load(std::memory_order_acquire)) {
        if (handle_ == nullptr) state_.throw_gone(operation);
      }
      ncclComm_t handle() const noexcept { return handle_; }

      /// A call's result: ncclInProgress is noted (settled later), any other failure thrown.
      void check(ncclResult_t result, const char* call, std::source_location where) {
        if (result == ncclSuccess) return;
        if (result == ncclInProgress) {
          in_progress_ = true;
          return;
        }
        detail::throw_nccl_error(result, handle_, call, where, state_.describe());
      }
      void note(ncclResult_t result) {
        if (result == ncclInProgress) in_progress_ = true;
      }

      /// Waits (lock let go, under the deadline) until the calls noted in progress are carried out.
      void settle(const char* operation) {
        if (!in_progress_) return;
        in_progress_ = false;
        lock_.unlock();
        state_.settle(operation);
        lock_.lock();
        if (state_.handle.load(std::memory_order_acquire) != handle_) state_.throw_gone(operation);
      }
      void unlock() {
        if (lock_.owns_lock()) lock_.unlock();
      }
      void relock(const char* operation) {
        if (!lock_.owns_lock()) lock_.lock();
        if (state_.handle.load(std::memory_order_acquire) != handle_) state_.throw_gone(operation);
      }

     private:
      detail::nccl::shared_state& state_;
      cuda::device_guard on_;
      std::unique_lock<std::recursive_mutex> lock_;
      ncclComm_t handle_;
      bool in_progress_ = false;
    };

    static ncclDataType_t nccl_type(dtype t) noexcept { return detail::nccl::datatype_of(t); }
    static ncclRedOp_t nccl_op(reduce_op op) noexcept { return detail::nccl::op_of(op); }

    static comm from_state(std::shared_ptr<detail::nccl::shared_state> state, std::optional<cudaStream_t> stream) {
      comm result;
      ncclComm_t handle = state->handle.load(std::memory_order_acquire);
      try {
        WEFT_CHECK_NCCL(ncclCommCount(handle, &state->size), handle);
        WEFT_CHECK_NCCL(ncclCommUserRank(handle, &state->rank), handle);
        WEFT_CHECK_NCCL(ncclCommCuDevice(handle, &state->device), handle);
        result.state_ = state;
        result.rank_ = state->rank;
        result.size_ = state->size;
        result.use_stream(stream);
      } catch (...) {
        result.state_.reset();
        state->abort();
        throw;
      }
      return result;
    }

    /// `p` advanced by `i` elements of `t` (null stays null: a non-root's reduce output).
    template <class P>
    static P* element(P* p, std::size_t i, dtype t) noexcept {
      using byte = std::conditional_t<std::is_const_v<P>, const char, char>;
      return p == nullptr ? p : reinterpret_cast<P*>(reinterpret_cast<byte*>(p) + i * size_of(t));
    }

    /// On a communicator of one rank, NCCL before 2.29.7 leaves the last elements of a scaled
    /// reduction (`scaled`: avg or a pre-multiplied sum) of a floating type unwritten (see
    /// one_rank_scaled_written): `call_on(at, count)` reduces them with another call.
    template <class Call>
    void reduce_one_rank_tail(use_scope& use, const char* operation, std::size_t n, dtype t, bool scaled,
                              Call&& call_on) {
      if (size_ != 1 || !scaled || !is_floating(t)) return;
      const int version = detail::nccl::runtime_version();
      std::size_t done = detail::nccl::one_rank_scaled_written(n, size_of(t), version);
      while (done < n) {
        use.settle(operation);  // a non-blocking communicator takes the next call once the last is carried out
        call_on(done, n - done);
        done += detail::nccl::one_rank_scaled_written(n - done, size_of(t), version);
      }
    }

    [[noreturn]] static void refuse_unpaired(const char* operation) {
      fail(std::string("NCCL ") + operation +
           ": an asynchronous send or receive on its own holds the communicator's stream until its partner "
           "arrives, so a receive posted before its send (on any rank) deadlocks the GPU. Post them together "
           "in one NCCL group: comm.batch().send(out, next).recv(in, prev).run_async() (or run()), or use the "
           "blocking send()/recv() in an order that pairs them");
    }

    void check_live(const char* operation) const {
      if (valid()) return;
      if (state_ && state_->aborted.load(std::memory_order_acquire))
        fail(std::string("NCCL ") + operation + ": the communicator was aborted; build a new one");
      fail(std::string("NCCL ") + operation + ": the communicator is not valid (default-constructed, moved from, "
                                              "or this rank was left out of a split)");
    }

    /// Checks the communicator is usable, makes its device current and holds its handle.
    use_scope enter(const char* operation) {
      check_live(operation);
      return use_scope(*state_, operation);
    }

    /// Polls until the work queued on the stream so far has finished (lock let go meanwhile).
    void drain(use_scope& use, const char* operation) {
      cuda::event mark = state_->take_event();
      mark.record(stream_);
      use.unlock();
      state_->wait_event(mark.native(), operation);
      state_->give_back(std::move(mark));
      use.relock(operation);
    }

    /// Records the completion event after the enqueued operation; waits for it if blocking. On a
    /// stream being captured into a CUDA graph, the request completes in graph order (querying
    /// its event during capture would invalidate the graph).
    request finish(use_scope& use, const char* operation, completion how) {
      use.settle(operation);
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      WEFT_CHECK_CUDA(cudaStreamIsCapturing(stream_, &capture));
      const bool captured = capture != cudaStreamCaptureStatusNone;
      cuda::event done = captured ? cuda::event::create() : state_->take_event();
      done.record(stream_);
      use.unlock();
      request pending(state_, std::move(done), operation, captured);
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
      world_ranks_ = std::move(other.world_ranks_);
      other.world_ranks_.clear();
    }

    /// NCCL knows no world ranks: each rank brings its own (the launcher's) to one all-gather.
    /// Any rank that does not know its own leaves the list empty on every rank.
    void learn_world_ranks() {
      const std::int64_t mine = weft::detail::world_rank_for_messages();
      std::vector<std::int64_t> all(static_cast<std::size_t>(size_));
      host_all_gather(std::span<const std::int64_t>(&mine, 1), all);
      world_ranks_.clear();
      if (std::any_of(all.begin(), all.end(), [](std::int64_t r) { return r < 0; })) return;
      for (std::int64_t r : all) world_ranks_.push_back(static_cast<int>(r));
    }

    /// Waits for pending work, then finalizes and destroys the NCCL communicator, every wait
    /// polled under the deadline; aborts instead if the work failed or a wait timed out.
    void release() noexcept {
      if (!state_) return;
      if (valid()) {
        bool healthy = true;
        try {
          wait_all();
          {
            auto use = enter("destroying the communicator");
            use.note(ncclCommFinalize(use.handle()));
            use.settle("destroying the communicator (ncclCommFinalize)");
          }
          healthy = async_error() == ncclSuccess;
        } catch (const std::exception& e) {
          std::fprintf(stderr, "weft: NCCL %s: pending work failed while the communicator was destroyed: %s\n",
                       state_->describe().c_str(), e.what());
          healthy = false;
        }
        if (!healthy) {
          state_->abort();
        } else if (ncclComm_t h = state_->take_handle(); h != nullptr) {
          if (ncclResult_t r = ncclCommDestroy(h); r != ncclSuccess)
            std::fprintf(stderr, "weft: NCCL %s: ncclCommDestroy failed: %s\n", state_->describe().c_str(),
                         ncclGetErrorString(r));
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
    std::vector<int> world_ranks_;
  };
};

static_assert(backend<nccl_backend>);

}  // namespace weft

#endif  // !WEFT_HAS_NCCL
