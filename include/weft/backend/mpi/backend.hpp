#pragma once
/// \file
/// The MPI backend: host buffers, any MPI with MPI_THREAD_MULTIPLE for overlap.
///
/// Blocking operations call MPI directly on the caller's thread when nothing is pending on the
/// communicator, so they cost what the raw MPI call costs. Async operations go to the
/// communicator's progress thread (see detail/progress_thread.hpp for why), which runs them in
/// issue order; a blocking call issued while async work is pending queues behind it.
/// Without MPI_THREAD_MULTIPLE, async operations complete before they return (correct, no overlap)
/// and a warning says so once.
///
/// A communicator must not be used from several threads at once (as with NCCL communicators).
///
/// For the flight recorder and the watchdog (weft/trace/), a communicator reports when its async
/// operations start and finish (attach_recorder), can be aborted from the watchdog's thread
/// (abort_action: MPI_Abort, which ends the job), and knows its members' world ranks. Once
/// MPI_Finalize has begun it makes no MPI call: operations throw, destruction skips
/// MPI_Comm_free, and pending point-to-point requests are dropped with a message.

#include <weft/config.hpp>

#if !WEFT_HAS_MPI
#error "weft: this build has no MPI backend, which multi-rank work on CPU (and the NCCL bootstrap) needs. Link weft::mpi (or weft::weft) from a weft configured with MPI found (WEFT_WITH_MPI=ON or AUTO; on Debian: apt-get install libopenmpi-dev openmpi-bin). Without CMake, define WEFT_HAS_MPI=1 (and OMPI_SKIP_MPICXX=1) and compile with MPI's flags: mpicxx -std=c++20 -DWEFT_HAS_MPI=1 -DOMPI_SKIP_MPICXX=1 -I weft/include."
#endif

#include <mpi.h>

#include <array>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/backend/mpi/check.hpp>
#include <weft/backend/mpi/datatypes.hpp>
#include <weft/backend/mpi/detail/finalize_watch.hpp>
#include <weft/backend/mpi/detail/progress_thread.hpp>
#include <weft/backend/mpi/detail/watched_call.hpp>
#include <weft/core/timeout.hpp>
#include <weft/trace/abort_action.hpp>
#include <weft/trace/flight_recorder.hpp>


namespace weft {

namespace detail::mpi {
/// Statuses for MPI_Waitall / MPI_Testall (on the stack for the usual few requests), kept only so
/// that a failure reports the transfer's own error (MPI_ERR_TRUNCATE) rather than MPI_ERR_IN_STATUS.
class statuses {
 public:
  explicit statuses(std::size_t n) {
    if (n > small_.size()) large_.resize(n);
  }
  MPI_Status* data() noexcept { return large_.empty() ? small_.data() : large_.data(); }
  /// The first failed transfer's error when `code` is MPI_ERR_IN_STATUS, else `code`.
  int error_of(int code) const noexcept {
    if (code != MPI_ERR_IN_STATUS) return code;
    for (const MPI_Status& s : large_.empty() ? std::span<const MPI_Status>(small_) : std::span<const MPI_Status>(large_))
      if (s.MPI_ERROR != MPI_SUCCESS && s.MPI_ERROR != MPI_ERR_PENDING) return s.MPI_ERROR;
    return code;
  }

 private:
  std::array<MPI_Status, 4> small_{};
  std::vector<MPI_Status> large_;
};

/// A failure of the operation `recorder` holds as `sequence`, named as weft names operations
/// ("all_reduce on group 'tp' (rank 1 of 2, 1000 x float) failed: ...").
[[gnu::cold, gnu::noinline]] inline backend_error failed_operation(const backend_error& e,
                                                                   const trace::flight_recorder& recorder,
                                                                   std::uint64_t sequence) {
  if (const auto r = recorder.read(sequence))
    return e.during(weft::detail::operation_text(trace::to_string(r->op), recorder.group(), recorder.rank(),
                                                 recorder.size(), r->count, to_string(r->type),
                                                 trace::is_collective(r->op) ? "root" : "peer", r->peer));
  return e.during(weft::detail::operation_text("an operation", recorder.group(), recorder.rank(), recorder.size(), 0, {}));
}
}  // namespace detail::mpi

struct mpi_backend {
  static constexpr std::string_view name = "mpi";
  /// Buffers are host memory.
  static constexpr memory_space buffers = memory_space::host;

  /// Move-only handle on an operation; an empty request is a completed one. It holds either a
  /// task of the progress thread (collectives) or posted MPI requests (point to point).
  class request {
   public:
    request() = default;
    explicit request(std::shared_ptr<detail::mpi::task> item) : task_(std::move(item)) {}
    explicit request(std::vector<MPI_Request> posted) : posted_(std::move(posted)) {}
    /// Posted requests whose completion goes into `recorder` as operation `sequence`.
    request(std::vector<MPI_Request> posted, std::shared_ptr<trace::flight_recorder> recorder, std::uint64_t sequence)
        : posted_(std::move(posted)), recorder_(std::move(recorder)), sequence_(sequence) {}
    request(request&& other) noexcept
        : task_(std::move(other.task_)),
          posted_(std::move(other.posted_)),
          recorder_(std::move(other.recorder_)),
          sequence_(std::exchange(other.sequence_, 0)) {
      other.posted_.clear();
    }
    request& operator=(request&& other) noexcept {
      if (this != &other) {
        finish_quietly();
        task_ = std::move(other.task_);
        posted_ = std::move(other.posted_);
        recorder_ = std::move(other.recorder_);
        sequence_ = std::exchange(other.sequence_, 0);
        other.posted_.clear();
      }
      return *this;
    }
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    /// Waits for an unfinished operation: the buffers it uses stay valid while it runs.
    ~request() {
      if (task_ || !posted_.empty()) finish_quietly();
    }

    /// Blocks until the operation is complete; rethrows its failure.
    void wait() {
      if (!task_ && posted_.empty()) return;  // the blocking path's empty request: nothing to do
      wait_pending();
    }

    /// True when the operation is complete (then rethrows its failure, if any).
    bool test() {
      if (!posted_.empty()) {
        if (detail::mpi::finalize_started().load(std::memory_order_relaxed)) [[unlikely]]
          drop_after_finalize();
        int flag = 0;
        detail::mpi::statuses statuses(posted_.size());
        const int code = MPI_Testall(static_cast<int>(posted_.size()), posted_.data(), &flag, statuses.data());
        if (code != MPI_SUCCESS) [[unlikely]]
          fail_posted(statuses.error_of(code), "MPI_Testall");
        if (!flag) return false;
        posted_.clear();
        record_end(true);
      }
      if (!task_) return true;
      if (!task_->done.load(std::memory_order_acquire)) return false;
      consume();
      return true;
    }

   private:
    [[gnu::noinline]] void wait_pending() {
      if (!posted_.empty()) {
        if (detail::mpi::finalize_started().load(std::memory_order_relaxed)) [[unlikely]]
          drop_after_finalize();
        auto posted = std::move(posted_);
        posted_.clear();
        detail::mpi::statuses statuses(posted.size());
        const int code = MPI_Waitall(static_cast<int>(posted.size()), posted.data(), statuses.data());
        if (code != MPI_SUCCESS) [[unlikely]]
          fail_posted(statuses.error_of(code), "MPI_Waitall");
        record_end(true);
      }
      if (!task_) return;
      task_->done.wait(false, std::memory_order_acquire);
      consume();
    }
    void consume() {
      auto item = std::move(task_);
      item->rethrow_failure();
    }
    /// The posted transfers failed: the error names the operation when it was recorded.
    [[noreturn, gnu::cold, gnu::noinline]] void fail_posted(int code, const char* call,
                                                            std::source_location location = std::source_location::current()) {
      const std::shared_ptr<trace::flight_recorder> recorder = recorder_;
      const std::uint64_t sequence = sequence_;
      record_end(false);
      try {
        detail::throw_mpi_error(code, call, location);
      } catch (const backend_error& e) {
        if (recorder) throw detail::mpi::failed_operation(e, *recorder, sequence);
        throw;
      }
    }
    void record_end(bool ok) noexcept {
      if (recorder_) std::exchange(recorder_, nullptr)->finish(std::exchange(sequence_, 0), ok);
    }
    /// MPI is finalized: the posted requests can no longer be waited for or freed.
    [[noreturn, gnu::cold]] void drop_after_finalize() {
      posted_.clear();
      record_end(false);
      detail::mpi::used_after_finalize("waiting for a point-to-point request");
    }
    void finish_quietly() noexcept {
      if (!task_ && posted_.empty()) return;
      try {
        wait();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "weft: an operation whose request was dropped failed: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "weft: an operation whose request was dropped failed\n");
      }
    }
    std::shared_ptr<detail::mpi::task> task_;
    std::vector<MPI_Request> posted_;
    std::shared_ptr<trace::flight_recorder> recorder_;  ///< posted point to point only
    std::uint64_t sequence_ = 0;
  };

  class comm {
   public:
    comm() = default;

    /// A private duplicate of `parent` (weft's traffic never matches the caller's own messages),
    /// with errors returned to weft instead of aborting. Collective over `parent`, and held to
    /// `timeout` (default: WEFT_COMM_TIMEOUT's) like any operation: a rank that never joins ends
    /// the job through the watchdog (detail/watched_call.hpp).
    static comm duplicate(MPI_Comm parent, std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
      MPI_Comm handle = MPI_COMM_NULL;
      detail::mpi::watched_call(parent, parent == MPI_COMM_WORLD  ? "MPI_COMM_WORLD"
                                : parent == MPI_COMM_SELF ? "MPI_COMM_SELF"
                                                          : "the parent MPI communicator",
                                trace::operation::dup, dtype::uint8, 0,
                                timeout ? *timeout : comm_timeout_from_environment(),
                                [&] { WEFT_CHECK_MPI(MPI_Comm_dup(parent, &handle)); });
      return comm(handle);
    }
    /// Needs MPI initialised (weft::mpi_environment); before that, or after MPI_Finalize, a
    /// weft::error says so instead of MPI aborting the process.
    static comm world(std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
      detail::mpi::expect_initialized("mpi_backend::comm::world()");
      return duplicate(MPI_COMM_WORLD, timeout);
    }
    /// A communicator of this rank alone; creating it involves no other rank.
    static comm self() {
      detail::mpi::expect_initialized("mpi_backend::comm::self()");
      return duplicate(MPI_COMM_SELF);
    }

    comm(comm&& other) noexcept { *this = std::move(other); }
    comm& operator=(comm&& other) noexcept {
      if (this != &other) {
        release();
        handle_ = std::exchange(other.handle_, MPI_COMM_NULL);
        rank_ = other.rank_;
        size_ = other.size_;
        threads_ok_ = other.threads_ok_;
        agree_ = other.agree_;
        progress_ = std::move(other.progress_);
        recorder_ = std::move(other.recorder_);
      }
      return *this;
    }
    comm(const comm&) = delete;
    comm& operator=(const comm&) = delete;
    ~comm() { release(); }

    bool valid() const noexcept { return handle_ != MPI_COMM_NULL; }
    int rank() const noexcept { return rank_; }
    int size() const noexcept { return size_; }
    MPI_Comm native() const noexcept { return handle_; }

    /// With `on`, every collective first agrees with the group's ranks on its call (operation,
    /// count, dtype, reduction, root) in one small MPI_Allreduce, run in the same place as the
    /// collective (inline, or on the progress thread for async calls), so the caller never waits
    /// for it. Ranks that disagree all fail with the same message listing each rank's call,
    /// instead of MPI returning wrong data on some ranks, truncating on others or hanging.
    /// (weft::check_level::agreement, the default; see weft/comm/communicator.hpp.)
    void agree_on_calls(bool on) noexcept { agree_ = on; }
    bool agrees_on_calls() const noexcept { return agree_; }

    /// Async operations claim the sequence number the communicator offers and report to
    /// `recorder` when they start and finish (see weft/trace/flight_recorder.hpp).
    void attach_recorder(std::shared_ptr<trace::flight_recorder> recorder) noexcept { recorder_ = std::move(recorder); }

    /// What the watchdog does to abort this communicator: MPI_Abort on MPI_COMM_WORLD (MPI has no
    /// way to abort one communicator alone), which ends every rank of the job with `status`
    /// (detail::mpi::abort_job: below MPI_THREAD_MULTIPLE it ends this process instead).
    trace::abort_action abort_action() const { return detail::mpi::abort_job(); }

    /// The world rank of each member, in this communicator's rank order.
    std::vector<int> world_ranks() const {
      std::vector<int> world(static_cast<std::size_t>(size_));
      if (handle_ == MPI_COMM_NULL || detail::mpi::mpi_finalized()) return {};
      MPI_Group mine = MPI_GROUP_NULL, everyone = MPI_GROUP_NULL;
      std::vector<int> ranks(world.size());
      for (std::size_t i = 0; i < ranks.size(); ++i) ranks[i] = static_cast<int>(i);
      WEFT_CHECK_MPI(MPI_Comm_group(handle_, &mine));
      WEFT_CHECK_MPI(MPI_Comm_group(MPI_COMM_WORLD, &everyone));
      WEFT_CHECK_MPI(MPI_Group_translate_ranks(mine, size_, ranks.data(), everyone, world.data()));
      MPI_Group_free(&mine);
      MPI_Group_free(&everyone);
      return world;
    }

    request all_reduce(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, completion how) {
      MPI_Comm c = handle_;
      int ranks = size_;
      int count = checked_count(n);
      detail::mpi::expect_mpi_alive("all_reduce");
      const call_shape shape = shape_of(trace::operation::all_reduce, n, t, op, -1);
      // The hot path of every trainer: a blocking call with nothing pending is the raw call.
      if (how == completion::blocking && (!progress_ || progress_->idle())) [[likely]] {
        agree(shape, c);
        do_all_reduce(send, recv, count, t, op, c, ranks);
        return {};
      }
      return run(how, [=] {
        agree(shape, c);
        do_all_reduce(send, recv, count, t, op, c, ranks);
      });
    }

    request reduce(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, int root, completion how) {
      MPI_Comm c = handle_;
      int ranks = size_;
      bool is_root = rank_ == root;
      int count = checked_count(n);
      const call_shape shape = shape_of(trace::operation::reduce, n, t, op, root);
      return run(how, [=] {
        agree(shape, c);
        const void* source = (send == recv && is_root) ? MPI_IN_PLACE : send;
        WEFT_CHECK_MPI(
            MPI_Reduce(source, recv, count, detail::mpi::datatype_of(t), detail::mpi::op_of(t, op), root, c));
        if (op == reduce_op::avg && is_root) detail::mpi::divide_in_place(recv, n, t, ranks);
      });
    }

    request broadcast(const void* send, void* recv, std::size_t n, dtype t, int root, completion how) {
      MPI_Comm c = handle_;
      bool is_root = rank_ == root;
      int count = checked_count(n);
      const call_shape shape = shape_of(trace::operation::broadcast, n, t, reduce_op::sum, root);
      return run(how, [=] {
        agree(shape, c);
        if (is_root && send != recv) std::memcpy(recv, send, n * size_of(t));
        WEFT_CHECK_MPI(MPI_Bcast(recv, count, detail::mpi::datatype_of(t), root, c));
      });
    }

    /// `send` may point at recv + rank·n (in place).
    request all_gather(const void* send, void* recv, std::size_t n, dtype t, completion how) {
      MPI_Comm c = handle_;
      int count = checked_count(n);
      checked_count(n * static_cast<std::size_t>(size_));
      bool in_place = send == static_cast<const char*>(recv) + static_cast<std::size_t>(rank_) * n * size_of(t);
      const call_shape shape = shape_of(trace::operation::all_gather, n, t, reduce_op::sum, -1);
      return run(how, [=] {
        agree(shape, c);
        MPI_Datatype type = detail::mpi::datatype_of(t);
        WEFT_CHECK_MPI(MPI_Allgather(in_place ? MPI_IN_PLACE : send, count, type, recv, count, type, c));
      });
    }

    /// `recv` may point at send + rank·n (in place: the result lands in this rank's block).
    request reduce_scatter(const void* send, void* recv, std::size_t n, dtype t, reduce_op op, completion how) {
      MPI_Comm c = handle_;
      int ranks = size_;
      int count = checked_count(n);
      checked_count(n * static_cast<std::size_t>(size_));
      std::size_t block_bytes = n * size_of(t);
      bool in_place = recv == static_cast<const char*>(send) + static_cast<std::size_t>(rank_) * block_bytes;
      const call_shape shape = shape_of(trace::operation::reduce_scatter, n, t, op, -1);
      return run(how, [=] {
        agree(shape, c);
        MPI_Datatype type = detail::mpi::datatype_of(t);
        MPI_Op mpi_op = detail::mpi::op_of(t, op);
        if (in_place) {
          // MPI leaves an in-place result at the start of the buffer; weft's convention (NCCL's)
          // is this rank's block, so move it there.
          void* buffer = const_cast<void*>(send);
          WEFT_CHECK_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, buffer, count, type, mpi_op, c));
          if (recv != buffer) std::memmove(recv, buffer, block_bytes);
        } else {
          WEFT_CHECK_MPI(MPI_Reduce_scatter_block(send, recv, count, type, mpi_op, c));
        }
        if (op == reduce_op::avg) detail::mpi::divide_in_place(recv, n, t, ranks);
      });
    }

    request all_to_all(const void* send, void* recv, std::size_t n, dtype t, completion how) {
      MPI_Comm c = handle_;
      int count = checked_count(n);
      checked_count(n * static_cast<std::size_t>(size_));
      const call_shape shape = shape_of(trace::operation::all_to_all, n, t, reduce_op::sum, -1);
      return run(how, [=] {
        agree(shape, c);
        MPI_Datatype type = detail::mpi::datatype_of(t);
        WEFT_CHECK_MPI(MPI_Alltoall(send == recv ? MPI_IN_PLACE : send, count, type, recv, count, type, c));
      });
    }

    /// Block j of `send` (send_counts[j] elements) goes to rank j; block i of `recv`
    /// (recv_counts[i] elements) comes from rank i; blocks lie back to back in rank order. Zero
    /// counts are fine (a rank may send or receive nothing). Not in place.
    request all_to_allv(const void* send, std::span<const std::size_t> send_counts, void* recv,
                        std::span<const std::size_t> recv_counts, dtype t, completion how) {
      MPI_Comm c = handle_;
      std::vector<int> layout(4 * static_cast<std::size_t>(size_));  // send counts, send displs, recv counts, recv displs
      const std::size_t ranks = static_cast<std::size_t>(size_);
      std::size_t send_at = 0, recv_at = 0;
      for (std::size_t r = 0; r < ranks; ++r) {
        layout[r] = checked_count(send_counts[r]);
        layout[ranks + r] = checked_count(send_at);
        layout[2 * ranks + r] = checked_count(recv_counts[r]);
        layout[3 * ranks + r] = checked_count(recv_at);
        send_at += send_counts[r];
        recv_at += recv_counts[r];
      }
      const call_shape shape = shape_of(trace::operation::all_to_allv, ranks, t, reduce_op::sum, -1);
      return run(how, [=, layout = std::move(layout)] {
        agree(shape, c);
        MPI_Datatype type = detail::mpi::datatype_of(t);
        const int* at = layout.data();
        WEFT_CHECK_MPI(MPI_Alltoallv(send, at, at + ranks, type, recv, at + 2 * ranks, at + 3 * ranks, type, c));
      });
    }

    /// Blocking point to point runs in order with the queue; async point to point is posted at
    /// once with MPI_Isend / MPI_Irecv (a FIFO thread would deadlock a ring of async receives
    /// queued before their sends), and message matching keeps it apart from collectives.
    request send(const void* buffer, std::size_t n, dtype t, int peer, completion how) {
      const p2p_op op{p2p_op::kind::send, const_cast<void*>(buffer), n, t, peer};
      return group_p2p(std::span<const p2p_op>(&op, 1), how);
    }

    request recv(void* buffer, std::size_t n, dtype t, int peer, completion how) {
      const p2p_op op{p2p_op::kind::recv, buffer, n, t, peer};
      return group_p2p(std::span<const p2p_op>(&op, 1), how);
    }

    /// All sends and receives of the batch are posted together, then completed together.
    request group_p2p(std::span<const p2p_op> ops, completion how) {
      for (const p2p_op& op : ops) checked_count(op.count);
      detail::mpi::expect_mpi_alive("point to point");
      if (how == completion::async) {
        const std::uint64_t sequence = recorder_ ? recorder_->claim() : 0;
        if (sequence == 0) return request(post(handle_, ops));
        recorder_->start(sequence);
        return request(post(handle_, ops), recorder_, sequence);
      }
      MPI_Comm c = handle_;
      if (!progress_ || progress_->idle()) {
        request(post(c, ops)).wait();
        return {};
      }
      std::vector<p2p_op> batch(ops.begin(), ops.end());
      return run(how, [c, batch = std::move(batch)] { request(post(c, batch)).wait(); });
    }

    request barrier(completion how) {
      MPI_Comm c = handle_;
      return run(how, [=] { WEFT_CHECK_MPI(MPI_Barrier(c)); });
    }

    /// Collective over this communicator; a negative color leaves this rank out (invalid result).
    comm split(int color, int key) {
      detail::mpi::expect_mpi_alive("split");
      wait_all();
      MPI_Comm handle = MPI_COMM_NULL;
      WEFT_CHECK_MPI(MPI_Comm_split(handle_, color < 0 ? MPI_UNDEFINED : color, key, &handle));
      return comm(handle);
    }

    void host_all_gather(std::span<const std::int64_t> local, std::span<std::int64_t> gathered) {
      int count = checked_count(local.size());
      MPI_Comm c = handle_;
      run(completion::blocking, [=] {
        WEFT_CHECK_MPI(MPI_Allgather(local.data(), count, MPI_INT64_T, gathered.data(), count, MPI_INT64_T, c));
      });
    }

    /// Runs `work` after every operation issued on this communicator before it, on the progress
    /// thread (inline when MPI lacks MPI_THREAD_MULTIPLE), so its cost overlaps the caller's
    /// work: the prologue or epilogue of an async collective (scaling, dtype conversion). `work`
    /// must not use this communicator. The request completes when `work` has run and rethrows
    /// what it threw.
    request run_in_order(std::function<void()> work) { return run(completion::async, std::move(work)); }

    /// Blocks until every operation issued on this communicator has finished.
    void wait_all() {
      if (progress_) progress_->drain();
    }

   private:
    static constexpr int p2p_tag = 7000;

    explicit comm(MPI_Comm handle) : handle_(handle) {
      if (handle_ == MPI_COMM_NULL) return;
      detail::mpi::watch_for_finalize();
      WEFT_CHECK_MPI(MPI_Comm_set_errhandler(handle_, MPI_ERRORS_RETURN));
      WEFT_CHECK_MPI(MPI_Comm_rank(handle_, &rank_));
      WEFT_CHECK_MPI(MPI_Comm_size(handle_, &size_));
      int level = MPI_THREAD_SINGLE;
      WEFT_CHECK_MPI(MPI_Query_thread(&level));
      threads_ok_ = level == MPI_THREAD_MULTIPLE;
    }

    static std::vector<MPI_Request> post(MPI_Comm c, std::span<const p2p_op> ops) {
      std::vector<MPI_Request> posted(ops.size(), MPI_REQUEST_NULL);
      for (std::size_t i = 0; i < ops.size(); ++i) {
        const p2p_op& op = ops[i];
        int count = static_cast<int>(op.count);
        MPI_Datatype type = detail::mpi::datatype_of(op.type);
        if (op.direction == p2p_op::kind::send)
          WEFT_CHECK_MPI(MPI_Isend(op.buffer, count, type, op.peer, p2p_tag, c, &posted[i]));
        else
          WEFT_CHECK_MPI(MPI_Irecv(op.buffer, count, type, op.peer, p2p_tag, c, &posted[i]));
      }
      return posted;
    }

    /// A collective's call as the agreement compares it; `on` false: no agreement (one branch).
    struct call_shape {
      bool on = false;
      std::int64_t fields[5] = {};  // operation, count, dtype, reduction, root
    };
    call_shape shape_of(trace::operation kind, std::size_t n, dtype t, reduce_op op, int root) const noexcept {
      if (!agree_ || size_ < 2) [[likely]] return {};
      const bool reduces = kind == trace::operation::all_reduce || kind == trace::operation::reduce ||
                           kind == trace::operation::reduce_scatter;
      return {true, {static_cast<std::int64_t>(kind), static_cast<std::int64_t>(n), static_cast<std::int64_t>(t),
                     reduces ? static_cast<std::int64_t>(op) : -1, root}};
    }

    /// One MPI_Allreduce (MAX) of each field and its negation: every rank learns the largest and
    /// the smallest value of each field, so all ranks see a disagreement alike, with no buffer
    /// that grows with the group. Only then is each rank's call gathered, for the message.
    static void agree(const call_shape& shape, MPI_Comm c) {
      if (!shape.on) [[likely]] return;
      constexpr int n = 5;
      std::int64_t bounds[2 * n];
      for (int i = 0; i < n; ++i) bounds[i] = shape.fields[i], bounds[n + i] = -shape.fields[i];
      WEFT_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, bounds, 2 * n, MPI_INT64_T, MPI_MAX, c));
      for (int i = 0; i < n; ++i)
        if (bounds[i] != -bounds[n + i]) [[unlikely]]
          calls_differ(shape, c);
    }

    [[noreturn, gnu::cold, gnu::noinline]] static void calls_differ(const call_shape& shape, MPI_Comm c) {
      int ranks = 0;
      WEFT_CHECK_MPI(MPI_Comm_size(c, &ranks));
      std::vector<std::int64_t> all(5 * static_cast<std::size_t>(ranks));
      WEFT_CHECK_MPI(MPI_Allgather(shape.fields, 5, MPI_INT64_T, all.data(), 5, MPI_INT64_T, c));
      bool only_counts = true;
      for (int r = 1; r < ranks; ++r)
        for (int f : {0, 2, 3, 4}) only_counts = only_counts && all[static_cast<std::size_t>(5 * r + f)] == all[static_cast<std::size_t>(f)];
      std::string text = only_counts ? "the ranks of the group passed different sizes:"
                                     : "the ranks of the group called different operations or shapes:";
      for (int r = 0; r < ranks; ++r) {
        const std::int64_t* f = &all[5 * static_cast<std::size_t>(r)];
        text += (r == 0 ? " rank " : "; rank ") + std::to_string(r) + ": " +
                std::string(trace::to_string(static_cast<trace::operation>(f[0]))) + " of " + std::to_string(f[1]) +
                " x " + std::string(to_string(static_cast<dtype>(f[2])));
        if (f[3] >= 0) text += ", op " + std::string(to_string(static_cast<reduce_op>(f[3])));
        if (f[4] >= 0) text += ", root " + std::to_string(f[4]);
      }
      text += only_counts ? "; every rank must pass the same count" : "; every rank must issue the same call";
      throw backend_error(backend_library::mpi, MPI_ERR_COUNT, std::move(text), "the call agreement before the collective",
                          std::source_location::current());
    }

    static void do_all_reduce(const void* send, void* recv, int count, dtype t, reduce_op op, MPI_Comm c, int ranks) {
      const void* source = send == recv ? MPI_IN_PLACE : send;
      WEFT_CHECK_MPI(MPI_Allreduce(source, recv, count, detail::mpi::datatype_of(t), detail::mpi::op_of(t, op), c));
      if (op == reduce_op::avg) detail::mpi::divide_in_place(recv, static_cast<std::size_t>(count), t, ranks);
    }

    static int checked_count(std::size_t n) {
      if (n > static_cast<std::size_t>(INT_MAX)) [[unlikely]]
        count_too_large(n);
      return static_cast<int>(n);
    }

    [[noreturn, gnu::cold, gnu::noinline]] static void count_too_large(std::size_t n) {
        fail("a single MPI operation of " + std::to_string(n) + " elements exceeds MPI's int count (" +
             std::to_string(INT_MAX) + "); split the buffer into smaller operations");
    }

    template <class F>
    request run(completion how, F&& work) {
      detail::mpi::expect_mpi_alive("a collective");
      // An async operation the communicator recorded: report its start and end (the recorder is
      // shared, so it outlives this communicator if the work does).
      if (how == completion::async && recorder_) {
        if (const std::uint64_t sequence = recorder_->claim(); sequence != 0) {
          return run_unrecorded(how, [recorder = recorder_, sequence, work = std::forward<F>(work)]() mutable {
            // Queued before MPI_Finalize, run after it: fail instead of calling MPI.
            detail::mpi::expect_mpi_alive("an async operation queued before MPI_Finalize");
            recorder->start(sequence);
            try {
              work();
            } catch (const backend_error& e) {
              recorder->finish(sequence, false);
              throw detail::mpi::failed_operation(e, *recorder, sequence);
            } catch (...) {
              recorder->finish(sequence, false);
              throw;
            }
            recorder->finish(sequence);
          });
        }
      }
      return run_unrecorded(how, std::forward<F>(work));
    }

    template <class F>
    request run_unrecorded(completion how, F&& work) {
      if (how == completion::blocking) {
        if (!progress_ || progress_->idle()) {
          work();  // nothing pending: the raw call, on this thread
          return {};
        }
        request pending(progress_->submit(std::forward<F>(work)));
        pending.wait();
        return {};
      }
      if (!threads_ok_) {
        warn_no_overlap_once();
        work();
        return {};
      }
      if (!progress_) progress_ = std::make_unique<detail::mpi::progress_thread>();
      return request(progress_->submit(std::forward<F>(work)));
    }

    static void warn_no_overlap_once() {
      static std::once_flag once;
      std::call_once(once, [] {
        std::fprintf(stderr,
                     "weft: MPI was initialised without MPI_THREAD_MULTIPLE, so async operations complete "
                     "before they return (no overlap with computation). Initialise MPI with "
                     "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let weft::mpi_environment do it.\n");
      });
    }

    void release() noexcept {
      progress_.reset();  // finishes queued work first (after MPI_Finalize, it fails without MPI calls)
      if (handle_ != MPI_COMM_NULL) {
        if (!detail::mpi::mpi_finalized()) MPI_Comm_free(&handle_);
        handle_ = MPI_COMM_NULL;
      }
    }

    MPI_Comm handle_ = MPI_COMM_NULL;
    int rank_ = 0;
    int size_ = 0;
    bool threads_ok_ = false;
    bool agree_ = false;
    std::unique_ptr<detail::mpi::progress_thread> progress_;
    std::shared_ptr<trace::flight_recorder> recorder_;
  };
};

static_assert(backend<mpi_backend>);

}  // namespace weft
