#pragma once
/// \file
/// What a backend is. A backend is a type (`mpi_backend`, `nccl_backend`) with a native
/// communicator type `comm` and a move-only `request` type. The backend works on untyped
/// buffers (pointer, count, dtype); `weft::communicator<Backend>` adds the types, the checks and
/// the bookkeeping on top, once for every backend.
///
/// A backend that lacks an operation fails `weft::backend` at compile time, and the error names
/// the requirement that is not met.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include <weft/core/dtype.hpp>
#include <weft/core/reduce_op.hpp>
#include <weft/trace/flight_recorder.hpp>
#include <weft/trace/abort_action.hpp>

namespace weft {

/// Whether an operation must be complete when the call returns (blocking) or may still be running
/// (async: completion is observed through the returned request).
enum class completion { blocking, async };

/// One point-to-point transfer inside a grouped exchange (pipeline stages send and receive
/// activations in one batch, so that neither side waits for the other to post first).
struct p2p_op {
  enum class kind { send, recv };
  kind direction;
  void* buffer;  ///< read for send, written for recv
  std::size_t count;
  dtype type;
  int peer;  ///< rank within the communicator
};

/// A handle on an operation that may still be running: move-only; `wait()` blocks until it is
/// complete (and rethrows its failure); `test()` says whether it is complete without blocking.
template <class R>
concept backend_request = std::movable<R> && !std::copyable<R> && std::default_initializable<R> &&
                          requires(R& r) {
                            { r.wait() } -> std::same_as<void>;
                            { r.test() } -> std::same_as<bool>;
                          };

/// The native communicator of a backend and the operations weft needs from it.
template <class C, class R>
concept backend_comm =
    std::movable<C> &&
    requires(C& c, const C& cc, const void* send, void* recv, std::size_t n, dtype t, reduce_op op, int root,
             completion how, std::span<const p2p_op> ops, std::span<const std::int64_t> local,
             std::span<std::int64_t> gathered) {
      { cc.rank() } -> std::same_as<int>;
      { cc.size() } -> std::same_as<int>;
      { c.all_reduce(send, recv, n, t, op, how) } -> std::same_as<R>;
      { c.reduce(send, recv, n, t, op, root, how) } -> std::same_as<R>;
      { c.broadcast(send, recv, n, t, root, how) } -> std::same_as<R>;
      { c.all_gather(send, recv, n, t, how) } -> std::same_as<R>;
      { c.reduce_scatter(send, recv, n, t, op, how) } -> std::same_as<R>;
      { c.all_to_all(send, recv, n, t, how) } -> std::same_as<R>;
      { c.send(send, n, t, root, how) } -> std::same_as<R>;
      { c.recv(recv, n, t, root, how) } -> std::same_as<R>;
      { c.group_p2p(ops, how) } -> std::same_as<R>;
      { c.barrier(how) } -> std::same_as<R>;
      { c.split(root, root) } -> std::same_as<C>;
      { cc.valid() } -> std::same_as<bool>;
      // A small host-side all-gather, for agreement checks (layouts, bucket plans, call shapes).
      { c.host_all_gather(local, gathered) } -> std::same_as<void>;
    };

/// Where a backend's buffers live: host memory (MPI) or the memory of the communicator's GPU
/// (NCCL). Code that owns buffers for a backend (the gradient synchronizer's flat buffer) asks
/// this instead of the backend's name.
enum class memory_space { host, device };

/// A backend's memory space: `B::buffers` if it declares one, host memory otherwise.
template <class B>
constexpr memory_space buffer_memory_v = [] {
  if constexpr (requires { B::buffers; })
    return B::buffers;
  else
    return memory_space::host;
}();

/// A backend whose communicator can run host work in issue order with its operations
/// (`comm.run_in_order(work)`, the MPI backend's progress thread): what an async collective's
/// prologue or epilogue (scaling, conversion) can use to keep off the caller's thread.
template <class B>
concept runs_host_work_in_order = requires(typename B::comm& c, std::function<void()> work) {
  { c.run_in_order(std::move(work)) } -> std::same_as<typename B::request>;
};

// ---- optional hooks for the flight recorder and the watchdog (weft/trace/) -----------------

/// A backend whose communicator reports when its async operations start and finish: after
/// `c.attach_recorder(recorder)`, each async operation claims the sequence number the
/// communicator offered (`recorder->claim()`) and marks it started and finished. Without this,
/// async operations are recorded as `untracked` and no deadline applies to them.
template <class B>
concept reports_async_completion = requires(typename B::comm& c, std::shared_ptr<trace::flight_recorder> recorder) {
  c.attach_recorder(recorder);
};

/// A backend whose communicator can be aborted from the watchdog's thread while another thread
/// is inside one of its operations (`abort_action().run(status)`).
template <class B>
concept aborts_from_any_thread = requires(const typename B::comm& c) {
  { c.abort_action() } -> std::same_as<trace::abort_action>;
};

/// A backend whose communicator enforces a deadline of its own (NCCL polls its waits against it
/// and aborts): `weft::communicator` sets it whenever it sets the recorder's, from the constructor,
/// `set_timeout` and `split`, so the watchdog and the backend hold one deadline.
template <class B>
concept keeps_own_deadline = requires(typename B::comm& c, std::chrono::milliseconds timeout) {
  c.set_timeout(timeout);
};

/// A backend whose communicator knows its members' world ranks (for dumps that line up groups).
template <class B>
concept knows_world_ranks = requires(const typename B::comm& c) {
  { c.world_ranks() } -> std::same_as<std::vector<int>>;
};

/// A backend: a tag type naming its communicator and request types.
template <class B>
concept backend = requires {
  typename B::comm;
  typename B::request;
  { B::name } -> std::convertible_to<std::string_view>;
} && backend_request<typename B::request> && backend_comm<typename B::comm, typename B::request>;

}  // namespace weft
