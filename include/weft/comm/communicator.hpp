#pragma once
/// \file
/// `weft::communicator<Backend>`: typed collectives and point-to-point on contiguous ranges, the
/// same for every backend. It checks what one rank can check (sizes, roots, peers) and says what
/// is wrong in terms of the group, the rank and the sizes. By default on MPI
/// (`check_level::agreement`) every collective first agrees across the group's ranks on its call
/// (operation, count, dtype, reduction, root) in one small all-reduce run with the collective, so
/// sizes that differ across ranks are an error on every rank, never a hang or silently wrong
/// data; with `check_level::communication` the same comparison runs before each collective on the
/// calling thread (one small extra all-gather). Then it dispatches to the backend, which does the
/// work.
///
/// Every operation passes one choke point (`dispatch`), which records it in the communicator's
/// flight recorder (weft/trace/flight_recorder.hpp) under a per-communicator sequence number and
/// a deadline that the process's watchdog enforces (WEFT_COMM_TIMEOUT, default 10 minutes;
/// weft/trace/watchdog.hpp).
///
/// Every operation has a blocking form (`all_reduce`) and an async form (`all_reduce_async`)
/// returning the backend's move-only request. Out-of-place forms take (send, recv); in-place forms
/// take one buffer. For buffers of device memory (NCCL), spans over device pointers are fine.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/buffer.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/error.hpp>
#include <weft/core/timeout.hpp>
#include <weft/trace/fingerprint.hpp>
#include <weft/trace/flight_recorder.hpp>
#include <weft/trace/operation.hpp>
#include <weft/trace/watchdog.hpp>

namespace weft {

/// How much a communicator checks before each operation.
enum class check_level {
  local,          ///< sizes, roots and peers on this rank (always on; costs nothing measurable)
  agreement,      ///< also that all ranks agree on the call, inside the collective (backends that can fold
                  ///< it in: MPI, one small all-reduce in the collective's place; elsewhere as `communication`)
  communication,  ///< also that all ranks agree on the call (one extra small all-gather per collective)
  fingerprint,    ///< every N-th collective (WEFT_CHECK_INTERVAL, default 1), that all ranks' rolling
                  ///< fingerprints of their collectives agree; a mismatch names the first divergent call
};

/// Counters for what a communicator has issued (for tests, traces and benchmarks).
struct comm_stats {
  std::uint64_t operations = 0;
  std::uint64_t bytes = 0;  ///< payload bytes this rank contributed (send side)
};

/// WEFT_CHECK_LEVEL's level (`local`, `agreement`, `communication`, `fingerprint`); nullopt when unset.
inline std::optional<check_level> check_level_from_environment() {
  const char* value = std::getenv("WEFT_CHECK_LEVEL");
  if (value == nullptr || *value == '\0') return std::nullopt;
  if (std::string_view(value) == "local") return check_level::local;
  if (std::string_view(value) == "agreement") return check_level::agreement;
  if (std::string_view(value) == "communication") return check_level::communication;
  if (std::string_view(value) == "fingerprint") return check_level::fingerprint;
  throw error(std::string("weft: WEFT_CHECK_LEVEL='") + value +
              "' is not a check level; use local, agreement, communication or fingerprint");
}

/// The default check level: WEFT_CHECK_LEVEL's, else `agreement` for backends whose buffers are
/// host memory (MPI: the check rides in the collective's own place) and `local` for device
/// backends (NCCL), where any agreement would make the host wait for the GPU at every collective.
inline check_level default_check_level(memory_space buffers = memory_space::host) {
  return check_level_from_environment().value_or(buffers == memory_space::host ? check_level::agreement
                                                                                 : check_level::local);
}

/// A backend that can fold the agreement on each collective's call into the collective itself
/// (check_level::agreement without a separate exchange on the calling thread).
template <class B>
concept folds_call_agreement = requires(typename B::comm& c) { c.agree_on_calls(true); };

/// How many collectives apart check_level::fingerprint compares: WEFT_CHECK_INTERVAL, default 1
/// (before every collective, so a mismatched call fails before it can hang or corrupt).
inline std::uint64_t check_interval_from_environment() {
  const char* value = std::getenv("WEFT_CHECK_INTERVAL");
  if (value == nullptr || *value == '\0') return 1;
  char* end = nullptr;
  const unsigned long long parsed = std::strtoull(value, &end, 10);
  if (end == value || *end != '\0' || parsed < 1 || parsed > (1u << 20))
    throw error(std::string("weft: WEFT_CHECK_INTERVAL='") + value +
                "' is not a number of collectives from 1 to 1048576; the default is 1");
  return parsed;
}

template <backend B>
class communicator;

/// The element counts of an all_to_allv and of its inverse (send and receive swapped), made by
/// communicator::exchange_counts from counts of rows: rank i sends rank j the rows of its block j,
/// each `row_elements` elements of `type`, and receives from rank j the rows that rank j's block i
/// counts, so rank i's send count to j is rank j's receive count from i by construction. At
/// check_level::agreement the exchange that made them also agreed on the row shape across the
/// group, so an all_to_allv of these counts issued next on that group (and its inverse right
/// after) needs no call agreement of its own (communicator::all_to_allv).
class paired_counts {
 public:
  paired_counts() = default;
  std::span<const std::size_t> send() const noexcept { return send_; }  ///< elements for each rank
  std::span<const std::size_t> recv() const noexcept { return recv_; }  ///< elements from each rank
  dtype type() const noexcept { return type_; }
  std::size_t row_elements() const noexcept { return row_elements_; }
  std::size_t sent() const noexcept { return sent_; }          ///< elements sent in all
  std::size_t received() const noexcept { return received_; }  ///< elements received in all
  /// The inverse exchange (a combine after a dispatch): what was received goes back.
  paired_counts inverse() const {
    paired_counts back = *this;
    std::swap(back.send_, back.recv_);
    std::swap(back.sent_, back.received_);
    return back;
  }

 private:
  template <backend>
  friend class communicator;
  std::vector<std::size_t> send_, recv_;
  dtype type_ = dtype::float32;
  std::size_t row_elements_ = 0, sent_ = 0, received_ = 0;
  const void* exchanged_on_ = nullptr;  ///< the flight recorder of the group whose exchange made them
  std::uint64_t exchange_ = 0;          ///< which of that group's count exchanges (0: none agreed)
};

template <backend B>
class communicator {
 public:
  using backend_type = B;
  using native_type = typename B::comm;
  using request = typename B::request;

  /// `timeout`: the deadline of each operation; by default WEFT_COMM_TIMEOUT's (10 minutes when
  /// unset; 0: none).
  communicator(native_type native, std::string name, check_level checks = default_check_level(buffer_memory_v<B>),
               std::optional<std::chrono::milliseconds> timeout = std::nullopt)
      : native_(std::move(native)), name_(std::move(name)), checks_(checks) {
    if (!native_.valid()) fail("communicator '" + name_ + "' was given an invalid native communicator");
    if (checks_ == check_level::fingerprint) check_interval_ = check_interval_from_environment();
    fold_agreement();
    recorder_ = std::make_shared<trace::flight_recorder>(name_, rank(), size(),
                                                         trace::flight_recorder_capacity_from_environment(),
                                                         timeout ? *timeout : comm_timeout_from_environment());
    if constexpr (keeps_own_deadline<B>) native_.set_timeout(recorder_->timeout());
    if constexpr (knows_world_ranks<B>) recorder_->set_members(native_.world_ranks());
    if constexpr (reports_async_completion<B>) native_.attach_recorder(recorder_);
    trace::abort_action abort;
    if constexpr (aborts_from_any_thread<B>) abort = native_.abort_action();
    watch_ = trace::watchdog::instance().watch(recorder_, std::move(abort));
  }

  /// References (ref()) follow the communicator to its new place.
  communicator(communicator&& other) noexcept
      : recorder_(std::move(other.recorder_)),
        watch_(std::move(other.watch_)),
        native_(std::move(other.native_)),
        name_(std::move(other.name_)),
        checks_(other.checks_),
        check_interval_(other.check_interval_),
        stats_(other.stats_),
        count_exchanges_(other.count_exchanges_),
        carried_exchange_(std::exchange(other.carried_exchange_, 0)),
        carried_at_(other.carried_at_),
        anchor_(std::move(other.anchor_)) {
    if (anchor_) anchor_->target = this;
  }
  /// References to the communicator assigned over see it as destroyed; references to `other`
  /// follow it here.
  communicator& operator=(communicator&& other) noexcept {
    if (this != &other) {
      if (anchor_) anchor_->target = nullptr;
      native_ = std::move(other.native_);
      name_ = std::move(other.name_);
      checks_ = other.checks_;
      check_interval_ = other.check_interval_;
      stats_ = other.stats_;
      count_exchanges_ = other.count_exchanges_;
      carried_exchange_ = std::exchange(other.carried_exchange_, 0);
      carried_at_ = other.carried_at_;
      recorder_ = std::move(other.recorder_);
      watch_ = std::move(other.watch_);
      anchor_ = std::move(other.anchor_);
      if (anchor_) anchor_->target = this;
    }
    return *this;
  }
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  ~communicator() {
    if (anchor_) anchor_->target = nullptr;
  }

  /// A reference that follows this communicator through moves and throws (naming the group) once
  /// it is destroyed: what long-lived users of a group should hold instead of a pointer.
  communicator_ref<B> ref() {
    if (!anchor_) anchor_ = std::make_shared<detail::communicator_anchor<B>>(detail::communicator_anchor<B>{this, name_});
    return communicator_ref<B>(anchor_);
  }

  /// The deadline of each operation (0: none), enforced by the process's watchdog and, on a
  /// backend with a deadline of its own (NCCL), by the backend too: one value for both, which a
  /// split passes on to its groups.
  std::chrono::milliseconds timeout() const noexcept { return recorder_->timeout(); }
  void set_timeout(std::chrono::milliseconds timeout) noexcept {
    recorder_->set_timeout(timeout);
    if constexpr (keeps_own_deadline<B>)
      if (native_.valid()) native_.set_timeout(timeout);  // an aborted communicator keeps no deadline
  }
  /// The recent operations of this communicator (weft::trace::dump_flight_recorders() writes them
  /// with every other communicator's to weft-flight-<rank>.json).
  const trace::flight_recorder& recorder() const noexcept { return *recorder_; }

  int rank() const noexcept { return native_.rank(); }
  int size() const noexcept { return native_.size(); }
  /// The group's name ("world", "tp", "dp", ...), used in every error and trace.
  const std::string& name() const noexcept { return name_; }
  native_type& native() noexcept { return native_; }
  const comm_stats& stats() const noexcept { return stats_; }
  check_level checks() const noexcept { return checks_; }
  void set_checks(check_level level) noexcept {
    checks_ = level;
    carried_exchange_ = 0;  // an agreement made at another level carries nothing
    fold_agreement();
  }

  // ---- all_reduce ------------------------------------------------------------------------
  template <buffer S, mutable_buffer R>
  request all_reduce_async(S&& send, R&& recv, reduce_op op = reduce_op::sum) {
    auto [s, r] = same_typed("all_reduce", send, recv);
    expect_equal("all_reduce", "send", s.size(), "recv", r.size());
    agree_on_call(trace::operation::all_reduce, r.size(), dtype_of<buffer_element_t<R>>, op, -1);
    account(r.size_bytes());
    return dispatch(completion::async, trace::operation::all_reduce, dtype_of<buffer_element_t<R>>, r.size(), -1,
                    static_cast<int>(op), [&](completion how) {
                      return native_.all_reduce(s.data(), r.data(), r.size(), dtype_of<buffer_element_t<R>>, op, how);
                    });
  }
  template <mutable_buffer R>
  request all_reduce_async(R&& inout, reduce_op op = reduce_op::sum) {
    return all_reduce_async(std::as_const(inout), inout, op);
  }
  template <buffer S, mutable_buffer R>
  void all_reduce(S&& send, R&& recv, reduce_op op = reduce_op::sum) {
    auto [s, r] = same_typed("all_reduce", send, recv);
    expect_equal("all_reduce", "send", s.size(), "recv", r.size());
    agree_on_call(trace::operation::all_reduce, r.size(), dtype_of<buffer_element_t<R>>, op, -1);
    account(r.size_bytes());
    dispatch(completion::blocking, trace::operation::all_reduce, dtype_of<buffer_element_t<R>>, r.size(), -1,
             static_cast<int>(op), [&](completion how) {
               return native_.all_reduce(s.data(), r.data(), r.size(), dtype_of<buffer_element_t<R>>, op, how);
             });
  }
  template <mutable_buffer R>
  void all_reduce(R&& inout, reduce_op op = reduce_op::sum) {
    all_reduce(std::as_const(inout), inout, op);
  }

  // ---- scaled sums: backends that fold a factor into the reduction (NCCL's pre-multiplied sum)
  /// In place: the sum over ranks of `factor` x each rank's values (floating-point types), with
  /// the multiplication inside the reduction instead of a pass over the buffer of its own.
  template <mutable_buffer R>
    requires requires(native_type& c, void* p, std::size_t n, dtype t) {
      c.all_reduce_scaled(p, p, n, t, 1.0, completion::async);
    }
  request all_reduce_scaled_async(R&& inout, double factor) {
    std::span data(inout);
    agree_on_call(trace::operation::all_reduce, data.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(data.size_bytes());
    return dispatch(completion::async, trace::operation::all_reduce, dtype_of<buffer_element_t<R>>, data.size(), -1,
                    static_cast<int>(reduce_op::sum), [&](completion how) {
                      return native_.all_reduce_scaled(data.data(), data.data(), data.size(),
                                                       dtype_of<buffer_element_t<R>>, factor, how);
                    });
  }
  /// In place, as reduce_scatter_in_place_async: this rank's block receives the sum over ranks of
  /// `factor` x their blocks.
  template <mutable_buffer R>
    requires requires(native_type& c, void* p, std::size_t n, dtype t) {
      c.reduce_scatter_scaled(p, p, n, t, 1.0, completion::async);
    }
  request reduce_scatter_in_place_scaled_async(R&& buffer, double factor) {
    std::span data(buffer);
    auto block = own_block("reduce_scatter", data);
    agree_on_call(trace::operation::reduce_scatter, block.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(data.size_bytes());
    return dispatch(completion::async, trace::operation::reduce_scatter, dtype_of<buffer_element_t<R>>, block.size(),
                    -1, static_cast<int>(reduce_op::sum), [&](completion how) {
                      return native_.reduce_scatter_scaled(data.data(),
                                                           const_cast<void*>(static_cast<const void*>(block.data())),
                                                           block.size(), dtype_of<buffer_element_t<R>>, factor, how);
                    });
  }

  /// As reduce_scatter_async: `recv` receives the sum over ranks of `factor` x their blocks of `send`.
  template <buffer S, mutable_buffer R>
    requires requires(native_type& c, const void* s, void* r, std::size_t n, dtype t) {
      c.reduce_scatter_scaled(s, r, n, t, 1.0, completion::async);
    }
  request reduce_scatter_scaled_async(S&& send, R&& recv, double factor) {
    auto [s, r] = same_typed("reduce_scatter", send, recv);
    expect_equal("reduce_scatter", "send", s.size(), "recv x group size", r.size() * static_cast<std::size_t>(size()));
    agree_on_call(trace::operation::reduce_scatter, r.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(s.size_bytes());
    return dispatch(completion::async, trace::operation::reduce_scatter, dtype_of<buffer_element_t<R>>, r.size(), -1,
                    static_cast<int>(reduce_op::sum), [&](completion how) {
                      return native_.reduce_scatter_scaled(s.data(), const_cast<void*>(static_cast<const void*>(r.data())),
                                                           r.size(), dtype_of<buffer_element_t<R>>, factor, how);
                    });
  }

  // ---- reduce (result on root only; recv is ignored elsewhere and may be empty) -------------
  template <buffer S, mutable_buffer R>
  request reduce_async(S&& send, R&& recv, int root, reduce_op op = reduce_op::sum) {
    return reduce_impl(send, recv, root, op, completion::async);
  }
  template <mutable_buffer R>
  request reduce_async(R&& inout, int root, reduce_op op = reduce_op::sum) {
    return reduce_impl(std::as_const(inout), inout, root, op, completion::async);
  }
  template <buffer S, mutable_buffer R>
  void reduce(S&& send, R&& recv, int root, reduce_op op = reduce_op::sum) {
    reduce_impl(send, recv, root, op, completion::blocking).wait();
  }
  template <mutable_buffer R>
  void reduce(R&& inout, int root, reduce_op op = reduce_op::sum) {
    reduce_impl(std::as_const(inout), inout, root, op, completion::blocking).wait();
  }

  // ---- broadcast (send is read on root only and may be empty elsewhere) --------------------
  template <buffer S, mutable_buffer R>
  request broadcast_async(S&& send, R&& recv, int root) {
    return broadcast_impl(send, recv, root, completion::async);
  }
  template <mutable_buffer R>
  request broadcast_async(R&& inout, int root) {
    return broadcast_impl(std::as_const(inout), inout, root, completion::async);
  }
  template <buffer S, mutable_buffer R>
  void broadcast(S&& send, R&& recv, int root) {
    broadcast_impl(send, recv, root, completion::blocking).wait();
  }
  template <mutable_buffer R>
  void broadcast(R&& inout, int root) {
    broadcast_impl(std::as_const(inout), inout, root, completion::blocking).wait();
  }

  // ---- all_gather: recv holds size() blocks of send.size() elements, in rank order ---------
  template <buffer S, mutable_buffer R>
  request all_gather_async(S&& send, R&& recv) {
    return all_gather_impl(send, recv, completion::async);
  }
  /// In place: this rank's block is already at offset rank()·(buffer.size()/size()).
  template <mutable_buffer R>
  request all_gather_in_place_async(R&& buffer) {
    return all_gather_impl(own_block("all_gather", std::span(buffer)), buffer, completion::async);
  }
  template <buffer S, mutable_buffer R>
  void all_gather(S&& send, R&& recv) {
    all_gather_impl(send, recv, completion::blocking).wait();
  }
  template <mutable_buffer R>
  void all_gather_in_place(R&& buffer) {
    all_gather_impl(own_block("all_gather", std::span(buffer)), buffer, completion::blocking).wait();
  }

  // ---- reduce_scatter: send holds size() blocks; rank i receives the reduction of block i ---
  template <buffer S, mutable_buffer R>
  request reduce_scatter_async(S&& send, R&& recv, reduce_op op = reduce_op::sum) {
    return reduce_scatter_impl(send, recv, op, completion::async);
  }
  /// In place: the result is left in this rank's block, at offset rank()·(buffer.size()/size()).
  template <mutable_buffer R>
  request reduce_scatter_in_place_async(R&& buffer, reduce_op op = reduce_op::sum) {
    return reduce_scatter_impl(std::as_const(buffer), own_block("reduce_scatter", std::span(buffer)), op,
                               completion::async);
  }
  template <buffer S, mutable_buffer R>
  void reduce_scatter(S&& send, R&& recv, reduce_op op = reduce_op::sum) {
    reduce_scatter_impl(send, recv, op, completion::blocking).wait();
  }
  template <mutable_buffer R>
  void reduce_scatter_in_place(R&& buffer, reduce_op op = reduce_op::sum) {
    reduce_scatter_impl(std::as_const(buffer), own_block("reduce_scatter", std::span(buffer)), op,
                        completion::blocking)
        .wait();
  }

  // ---- all_to_all: block j of send goes to rank j; block i of recv comes from rank i -------
  template <buffer S, mutable_buffer R>
  request all_to_all_async(S&& send, R&& recv) {
    return all_to_all_impl(send, recv, completion::async);
  }
  template <mutable_buffer R>
  request all_to_all_async(R&& inout) {
    return all_to_all_impl(std::as_const(inout), inout, completion::async);
  }
  template <buffer S, mutable_buffer R>
  void all_to_all(S&& send, R&& recv) {
    all_to_all_impl(send, recv, completion::blocking).wait();
  }
  template <mutable_buffer R>
  void all_to_all(R&& inout) {
    all_to_all_impl(std::as_const(inout), inout, completion::blocking).wait();
  }

  // ---- all_to_allv: ragged blocks (MoE token dispatch and combine) ---------------------------
  /// Block j of `send` (send_counts[j] elements) goes to rank j; block i of `recv` (recv_counts[i]
  /// elements) comes from rank i; blocks lie back to back in rank order, and any count may be 0.
  /// Rank i's send_counts[j] must equal rank j's recv_counts[i]: get the receive counts with
  /// exchange_counts first. At check_level::agreement the ranks agree on the call (operation and
  /// dtype) inside the collective; at check_level::communication every pair's counts are
  /// compared too, so a mismatch is the same error on every rank. Not in place. The forms taking
  /// paired_counts use counts from exchange_counts of rows, which pair by construction.
  template <buffer S, mutable_buffer R>
    requires requires(native_type& c, const void* s, void* r, std::span<const std::size_t> n, dtype t) {
      c.all_to_allv(s, n, r, n, t, completion::async);
    }
  request all_to_allv_async(S&& send, std::span<const std::size_t> send_counts, R&& recv,
                            std::span<const std::size_t> recv_counts) {
    return all_to_allv_impl(send, send_counts, recv, recv_counts, completion::async);
  }
  template <buffer S, mutable_buffer R>
    requires requires(native_type& c, const void* s, void* r, std::span<const std::size_t> n, dtype t) {
      c.all_to_allv(s, n, r, n, t, completion::blocking);
    }
  void all_to_allv(S&& send, std::span<const std::size_t> send_counts, R&& recv,
                   std::span<const std::size_t> recv_counts) {
    all_to_allv_impl(send, send_counts, recv, recv_counts, completion::blocking).wait();
  }
  /// With counts from exchange_counts of rows (`counts.inverse()` for the way back). At
  /// check_level::agreement on a backend that folds the agreement (MPI), the count exchange's
  /// agreement carries this call's: issued on this group right after the exchange, or right
  /// after another all_to_allv of the same counts, with no other collective between, it runs
  /// without an agreement of its own (the exchange agreed on the element type and row length,
  /// and the counts pair); otherwise it agrees on its call as any all_to_allv.
  template <buffer S, mutable_buffer R>
    requires requires(native_type& c, const void* s, void* r, std::span<const std::size_t> n, dtype t) {
      c.all_to_allv(s, n, r, n, t, completion::async);
    }
  request all_to_allv_async(S&& send, R&& recv, const paired_counts& counts) {
    return all_to_allv_paired(send, recv, counts, completion::async);
  }
  template <buffer S, mutable_buffer R>
    requires requires(native_type& c, const void* s, void* r, std::span<const std::size_t> n, dtype t) {
      c.all_to_allv(s, n, r, n, t, completion::blocking);
    }
  void all_to_allv(S&& send, R&& recv, const paired_counts& counts) {
    all_to_allv_paired(send, recv, counts, completion::blocking).wait();
  }

  /// The count exchange before an all_to_allv: `send` holds size() blocks of equal length, block
  /// j for rank j; `recv` (the same length) receives block i from rank i. Host values on every
  /// backend: an all_to_all where buffers are host memory, an all-gather of the (small) count
  /// blocks through the backend's host path on device backends. Recorded and held to the
  /// deadline like any collective.
  void exchange_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv) {
    expect_equal("exchange_counts", "send", send.size(), "recv", recv.size());
    if (send.size() % static_cast<std::size_t>(size()) != 0)
      fail(where("exchange_counts") + ": " + std::to_string(send.size()) +
           " counts do not split into equal blocks for " + std::to_string(size()) + " ranks");
    if constexpr (buffer_memory_v<B> == memory_space::host) {
      all_to_all_impl(send, recv, completion::blocking).wait();
    } else {
      const std::size_t block = send.size() / static_cast<std::size_t>(size());
      std::vector<std::int64_t> all(send.size() * static_cast<std::size_t>(size()));
      host_all_gather(send, all);
      for (std::size_t from = 0; from < static_cast<std::size_t>(size()); ++from)
        std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(from * send.size() + static_cast<std::size_t>(rank()) * block),
                    block, recv.begin() + static_cast<std::ptrdiff_t>(from * block));
    }
  }

  /// The count exchange of an all_to_allv of rows and of its inverse (MoE dispatch and combine):
  /// as exchange_counts above, where each count is a number of rows of `row_elements` elements
  /// of `type`, and block j of `send` counts the rows for rank j (in any subdivision: one count
  /// per expert of rank j). Each rank's row shape travels with its counts and every rank compares
  /// all of them, so rows that differ across ranks are the same error on every rank here, before
  /// any row moves. Returns the element counts both ways; at check_level::agreement on MPI this
  /// exchange's call agreement also stands for the all_to_allvs of the result that follow it
  /// directly (all_to_allv with paired_counts): one agreement for a dispatch and its combine.
  paired_counts exchange_counts(std::span<const std::int64_t> send, std::span<std::int64_t> recv, dtype type,
                                std::size_t row_elements) {
    expect_equal("exchange_counts", "send", send.size(), "recv", recv.size());
    const std::size_t ranks = static_cast<std::size_t>(size());
    if (send.size() % ranks != 0)
      fail(where("exchange_counts") + ": " + std::to_string(send.size()) +
           " counts do not split into equal blocks for " + std::to_string(ranks) + " ranks");
    // Each block carries the sender's row shape after its counts.
    const std::size_t block = send.size() / ranks, wide = block + 2;
    std::vector<std::int64_t> out(ranks * wide), in(ranks * wide);
    for (std::size_t j = 0; j < ranks; ++j) {
      std::copy_n(send.begin() + static_cast<std::ptrdiff_t>(j * block), block,
                  out.begin() + static_cast<std::ptrdiff_t>(j * wide));
      out[j * wide + block] = static_cast<std::int64_t>(type);
      out[j * wide + block + 1] = static_cast<std::int64_t>(row_elements);
    }
    exchange_counts(out, in);
    bool same_rows = true;
    for (std::size_t i = 0; i < ranks; ++i)
      same_rows = same_rows && in[i * wide + block] == in[block] && in[i * wide + block + 1] == in[block + 1];
    if (!same_rows) [[unlikely]]
      rows_differ(in, wide, block);
    paired_counts counts;
    counts.send_.assign(ranks, 0);
    counts.recv_.assign(ranks, 0);
    for (std::size_t j = 0; j < ranks; ++j) {
      std::size_t out_rows = 0, in_rows = 0;
      for (std::size_t q = 0; q < block; ++q) {
        out_rows += static_cast<std::size_t>(out[j * wide + q]);
        in_rows += static_cast<std::size_t>(in[j * wide + q]);
        recv[j * block + q] = in[j * wide + q];
      }
      counts.send_[j] = out_rows * row_elements, counts.recv_[j] = in_rows * row_elements;
      counts.sent_ += counts.send_[j], counts.received_ += counts.recv_[j];
    }
    counts.type_ = type;
    counts.row_elements_ = row_elements;
    if (agreement_folded()) {
      counts.exchanged_on_ = recorder_.get();
      counts.exchange_ = carried_exchange_ = ++count_exchanges_;
      carried_at_ = recorder_->collectives();
    }
    return counts;
  }

  // ---- point to point ----------------------------------------------------------------------
  template <buffer S>
  request send_async(S&& data, int peer) {
    return send_impl(data, peer, completion::async);
  }
  template <buffer S>
  void send(S&& data, int peer) {
    send_impl(data, peer, completion::blocking).wait();
  }
  template <mutable_buffer R>
  request recv_async(R&& data, int peer) {
    return recv_impl(data, peer, completion::async);
  }
  template <mutable_buffer R>
  void recv(R&& data, int peer) {
    recv_impl(data, peer, completion::blocking).wait();
  }

  /// A batch of sends and receives posted together (pipeline stage exchange): build it with
  /// `send`/`recv`, then `run()` or `run_async()`. The buffers must outlive the run. The batch
  /// follows its communicator through moves and throws, naming the group, if it was destroyed.
  class p2p_batch {
   public:
    template <buffer S>
    p2p_batch& send(S&& data, int peer) {
      auto s = std::span(data);
      owner_.get().check_peer("send", peer);
      ops_.push_back({p2p_op::kind::send, const_cast<void*>(static_cast<const void*>(s.data())), s.size(),
                      dtype_of<buffer_element_t<S>>, peer});
      return *this;
    }
    template <mutable_buffer R>
    p2p_batch& recv(R&& data, int peer) {
      auto r = std::span(data);
      owner_.get().check_peer("recv", peer);
      ops_.push_back({p2p_op::kind::recv, static_cast<void*>(r.data()), r.size(), dtype_of<buffer_element_t<R>>, peer});
      return *this;
    }
    request run_async() { return owner_.get().group_p2p_impl(ops_, completion::async); }
    void run() { owner_.get().group_p2p_impl(ops_, completion::blocking).wait(); }
    std::span<const p2p_op> ops() const noexcept { return ops_; }

   private:
    friend class communicator;
    explicit p2p_batch(communicator_ref<B> owner) : owner_(std::move(owner)) {}
    communicator_ref<B> owner_;
    std::vector<p2p_op> ops_;
  };
  p2p_batch batch() { return p2p_batch(ref()); }

  // ---- synchronisation, groups, agreement --------------------------------------------------
  request barrier_async() { return barrier_impl(completion::async); }
  void barrier() { barrier_impl(completion::blocking); }

  /// Splits this communicator (collective): ranks with the same color form a group, ordered by
  /// key. A negative color leaves this rank out and returns nothing. The split is recorded and
  /// held to the deadline like any collective.
  std::optional<communicator> split(int color, int key, std::string name) {
    std::optional<native_type> child;
    watched(trace::operation::split, dtype::uint8, 0, [&] { child.emplace(native_.split(color, key)); });
    if (!child->valid()) return std::nullopt;
    return communicator(std::move(*child), std::move(name), checks_, timeout());
  }

  /// A small blocking all-gather of host values (agreement on a configuration): `gathered` holds
  /// size() blocks of local.size() values, in rank order. Recorded and held to the deadline like
  /// any collective; on device backends it stages through device memory.
  void host_all_gather(std::span<const std::int64_t> local, std::span<std::int64_t> gathered) {
    watched(trace::operation::all_gather, dtype::int64, local.size(), [&] { native_.host_all_gather(local, gathered); });
  }

  /// Checks (collectively) that every rank passed the same value; otherwise throws on every rank
  /// an error naming `what` and the ranks that disagree. Use it before work that would hang or
  /// corrupt if ranks disagreed (layouts, bucket plans).
  void expect_same_on_all_ranks(std::string_view what, std::uint64_t fingerprint) {
    std::vector<std::int64_t> all(static_cast<std::size_t>(size()));
    std::int64_t mine = static_cast<std::int64_t>(fingerprint);
    host_all_gather(std::span<const std::int64_t>(&mine, 1), all);
    std::string differing;
    for (int r = 0; r < size(); ++r) {
      if (all[static_cast<std::size_t>(r)] != all[0]) differing += (differing.empty() ? "" : ", ") + std::to_string(r);
    }
    if (!differing.empty())
      fail("group '" + name_ + "': ranks disagree about " + std::string(what) + ": ranks " + differing +
           " differ from rank 0 of the group (this is rank " + std::to_string(rank()) +
           "); every rank must be configured identically");
  }

 private:
  static constexpr std::string_view kind_name(trace::operation kind) { return trace::to_string(kind); }

  static constexpr bool reduces(trace::operation kind) noexcept {
    return kind == trace::operation::all_reduce || kind == trace::operation::reduce ||
           kind == trace::operation::reduce_scatter;
  }

  /// The one choke point every operation passes: it records the operation in the flight recorder
  /// (sequence number, shape, times, state), then calls the backend. Blocking operations are
  /// marked finished when the call returns; async ones by the backend when they complete
  /// (reports_async_completion), or recorded as untracked by backends that cannot say.
  template <class Call>
  request dispatch(completion how, trace::operation kind, dtype type, std::size_t count, int peer, int reduction,
                   Call&& call) {
    // A collective checked across ranks (check_call) was recorded before its check.
    const std::uint64_t checked = std::exchange(checked_sequence_, 0);
    if (how == completion::blocking) {
      std::uint64_t sequence = checked;
      if (sequence == 0) [[likely]] sequence = recorder_->issue(kind, type, count, peer, reduction, /*started=*/true);
      else recorder_->start(sequence);
      finish_recorded(sequence, [&] {
        try {
          call(completion::blocking).wait();
        } catch (const backend_error& e) {
          throw e.during(operation_text(kind, type, count, peer));
        }
      });
      return request{};
    }
    const std::uint64_t sequence = checked != 0 ? checked : recorder_->issue(kind, type, count, peer, reduction);
    recorder_->offer(sequence);
    try {
      request pending = call(completion::async);
      if (recorder_->claim() != 0) recorder_->untracked(sequence);  // the backend did not take it
      return pending;
    } catch (const backend_error& e) {
      recorder_->claim();
      recorder_->finish(sequence, false);
      throw e.during(operation_text(kind, type, count, peer));
    } catch (...) {
      recorder_->claim();
      recorder_->finish(sequence, false);
      throw;
    }
  }

  /// A failed operation in the words of weft's messages (a backend's failure names it, not the
  /// backend's call): "all_reduce on group 'tp' (rank 1 of 2, 1000 x float)".
  [[gnu::cold]] std::string operation_text(trace::operation kind, dtype type, std::size_t count, int peer) const {
    return detail::operation_text(kind_name(kind), name_, rank(), size(), count, to_string(type),
                                  trace::is_collective(kind) ? "root" : "peer", peer);
  }

  /// Runs `work`, a blocking call of this rank, as the recorded operation `sequence`: marked
  /// completed when it returns, failed when it throws.
  template <class Work>
  void finish_recorded(std::uint64_t sequence, Work&& work) {
    try {
      work();
    } catch (...) {
      recorder_->finish(sequence, false);
      throw;
    }
    recorder_->finish(sequence);
  }

  /// A blocking exchange that is not one of the typed operations (split, agreement), recorded as
  /// `kind` so that the watchdog holds it to the deadline: a rank that never joins times the
  /// others out with the usual message and dump.
  template <class Work>
  void watched(trace::operation kind, dtype type, std::size_t count, Work&& work) {
    finish_recorded(recorder_->issue(kind, type, count, -1, -1, /*started=*/true), std::forward<Work>(work));
  }

  request barrier_impl(completion how) {
    agree_on_call(trace::operation::barrier, 0, dtype::uint8, reduce_op::sum, -1);
    return dispatch(how, trace::operation::barrier, dtype::uint8, 0, -1, -1,
                    [&](completion mode) { return native_.barrier(mode); });
  }

  std::string where(std::string_view operation) const {
    return std::string(operation) + " on group '" + name_ + "' (rank " + std::to_string(rank()) + " of " +
           std::to_string(size()) + ")";
  }

  template <class S, class R>
  auto same_typed(std::string_view, S& send, R& recv) {
    static_assert(std::is_same_v<buffer_element_t<S>, buffer_element_t<R>>,
                  "weft: send and recv buffers must have the same element type");
    return std::pair{std::span(send), std::span(recv)};
  }

  void expect_equal(std::string_view operation, std::string_view a_name, std::size_t a, std::string_view b_name,
                    std::size_t b) const {
    if (a != b) [[unlikely]]
      sizes_differ(operation, a_name, a, b_name, b);
  }

  [[noreturn, gnu::cold, gnu::noinline]] void sizes_differ(std::string_view operation, std::string_view a_name,
                                                           std::size_t a, std::string_view b_name, std::size_t b) const {
      fail(where(operation) + ": " + std::string(a_name) + " has " + std::to_string(a) + " elements but " +
           std::string(b_name) + " has " + std::to_string(b) + "; pass buffers of the sizes the operation needs");
  }

  void check_root(std::string_view operation, int root) const {
    if (root < 0 || root >= size())
      fail(where(operation) + ": root " + std::to_string(root) + " is not a rank of the group (0.." +
           std::to_string(size() - 1) + ")");
  }

  void check_peer(std::string_view operation, int peer) const {
    if (peer < 0 || peer >= size() || peer == rank())
      fail(where(operation) + ": peer " + std::to_string(peer) + " is not another rank of the group (0.." +
           std::to_string(size() - 1) + ", not " + std::to_string(rank()) + ")");
  }

  template <class T>
  std::span<const T> own_block(std::string_view operation, std::span<T> whole) const {
    if (whole.size() % static_cast<std::size_t>(size()) != 0)
      fail(where(operation) + " in place: the buffer has " + std::to_string(whole.size()) +
           " elements, not a multiple of the group size " + std::to_string(size()));
    std::size_t n = whole.size() / static_cast<std::size_t>(size());
    return std::span<const T>(whole.data() + static_cast<std::size_t>(rank()) * n, n);
  }

  void account(std::size_t bytes) noexcept {
    ++stats_.operations;
    stats_.bytes += bytes;
  }

  /// With check_level::communication: all ranks exchange (call, count, dtype, op, root) and
  /// compare, so a mismatch is an error on every rank instead of a hang or corruption. With
  /// check_level::fingerprint: every N-th collective, all ranks compare the rolling fingerprint of
  /// their collectives, this one included.
  void agree_on_call(trace::operation kind, std::size_t count, dtype type, reduce_op op, int root) {
    if (checks_ != check_level::local && !(folds_call_agreement<B> && checks_ == check_level::agreement)) [[unlikely]]
      check_call(kind, count, type, op, root);
  }

  /// check_level::agreement on a backend that folds it into each collective: switch it on there
  /// (also under fingerprint, which compares only every N-th collective); off at the levels
  /// that check nothing across ranks or check before each collective already.
  void fold_agreement() noexcept {
    if constexpr (folds_call_agreement<B>)
      native_.agree_on_calls(checks_ == check_level::agreement || checks_ == check_level::fingerprint);
  }

  /// The collective is recorded first and its check's exchange runs inside that record, so the
  /// check has the collective's deadline: a rank that never arrives times the others out naming
  /// the collective, as at check_level::local. dispatch() then runs the call under this record.
  [[gnu::noinline]] void check_call(trace::operation kind, std::size_t count, dtype type, reduce_op op, int root) {
    const int reduction = reduces(kind) ? static_cast<int>(op) : -1;
    const std::uint64_t sequence = recorder_->issue(kind, type, count, root, reduction);
    try {
      if (checks_ != check_level::fingerprint) agree_on_call_across_ranks(kind, count, type, op, root);
      else compare_fingerprints(kind, count, type, reduction, root, sequence);
    } catch (...) {
      recorder_->finish(sequence, false);
      throw;
    }
    checked_sequence_ = sequence;
  }

  /// `sequence`: this collective's record, already issued (and folded into the fingerprint).
  void compare_fingerprints(trace::operation kind, std::size_t count, dtype type, int reduction, int root,
                            std::uint64_t sequence) {
    const std::uint64_t index = recorder_->collectives();
    if (index % check_interval_ != 0) return;
    const std::uint64_t next = recorder_->fingerprint();
    const std::int64_t mine[2] = {static_cast<std::int64_t>(index), static_cast<std::int64_t>(next)};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(size()));
    native_.host_all_gather(std::span<const std::int64_t>(mine, 2), all);
    bool same = true;
    for (std::size_t i = 0; i < all.size(); ++i) same = same && all[i] == all[i % 2];
    if (!same) report_divergence(kind, count, type, reduction, root, index, sequence);
  }

  /// The fingerprints differ: every rank sends its recent collectives (this one last), and all
  /// throw the same error naming the first collective where the ranks' calls differ.
  [[noreturn, gnu::cold, gnu::noinline]] void report_divergence(trace::operation kind, std::size_t count, dtype type,
                                                               int reduction, int root, std::uint64_t index,
                                                               std::uint64_t this_sequence) {
    constexpr std::size_t fields = 7;  // collective index, sequence, operation, dtype, count, reduction, root
    const std::size_t window = static_cast<std::size_t>(std::min<std::uint64_t>({check_interval_, 256, index}));
    std::vector<std::int64_t> mine(window * fields, 0);
    auto put = [&](std::size_t row, std::uint64_t collective, std::uint64_t sequence, trace::operation op, dtype t,
                   std::uint64_t n, int red, int rt) {
      std::int64_t* f = &mine[row * fields];
      f[0] = static_cast<std::int64_t>(collective);
      f[1] = static_cast<std::int64_t>(sequence);
      f[2] = static_cast<std::int64_t>(op);
      f[3] = static_cast<std::int64_t>(t);
      f[4] = static_cast<std::int64_t>(n);
      f[5] = red;
      f[6] = rt;
    };
    put(window - 1, index, this_sequence, kind, type, count, reduction, root);
    const std::vector<trace::flight_record> history = recorder_->snapshot();
    std::uint64_t collective = index - 1;
    std::size_t row = window - 1;
    for (auto r = history.rbegin(); r != history.rend() && row > 0 && collective > 0; ++r) {
      if (!trace::is_collective(r->op) || r->sequence >= this_sequence) continue;
      --row;
      put(row, collective--, r->sequence, r->op, r->type, r->count, r->reduction, r->peer);
    }
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size()));
    native_.host_all_gather(mine, all);
    auto at = [&](int rank_in_group, std::size_t row_index) {
      return &all[(static_cast<std::size_t>(rank_in_group) * window + row_index) * fields];
    };
    std::size_t first = window - 1;
    for (std::size_t r = 0; r < window; ++r) {
      bool differ = false;
      for (int other = 1; other < size() && !differ; ++other)
        for (std::size_t f = 0; f < fields; ++f)
          if (f != 1 && at(other, r)[f] != at(0, r)[f]) differ = true;
      if (differ) {
        first = r;
        break;
      }
    }
    std::string detail;
    for (int other = 0; other < size(); ++other) {
      const std::int64_t* f = at(other, first);
      detail += "\n  rank " + std::to_string(other) + ": ";
      if (f[0] == 0) {
        detail += "(no record)";
        continue;
      }
      detail += std::string(trace::to_string(static_cast<trace::operation>(f[2]))) + " #" + std::to_string(f[1]) +
                " of " + std::to_string(f[4]) + " x " + std::string(to_string(static_cast<dtype>(f[3])));
      if (f[5] >= 0) detail += ", op " + std::string(to_string(static_cast<reduce_op>(f[5])));
      if (f[6] >= 0) detail += ", root " + std::to_string(f[6]);
    }
    fail("group '" + name_ + "' (rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
         "): the ranks' collectives diverged at collective " + std::to_string(at(0, first)[0]) +
         " of the group (fingerprints compared every " + std::to_string(check_interval_) +
         " collectives; # is each rank's sequence number):" + detail +
         "\nevery rank of a group must issue the same collectives, with the same shapes, in the same order");
  }

  [[gnu::noinline]] void agree_on_call_across_ranks(trace::operation kind, std::size_t count, dtype type, reduce_op op,
                                                    int root) {
    constexpr std::size_t fields = 5;
    std::int64_t mine[fields] = {static_cast<std::int64_t>(kind), static_cast<std::int64_t>(count),
                                 static_cast<std::int64_t>(type), static_cast<std::int64_t>(op), root};
    std::vector<std::int64_t> all(fields * static_cast<std::size_t>(size()));
    native_.host_all_gather(std::span<const std::int64_t>(mine, fields), all);
    bool same = true;
    for (std::size_t i = 0; i < all.size(); ++i) same = same && all[i] == all[i % fields];
    if (same) return;
    std::string detail;
    for (int r = 0; r < size(); ++r) {
      const std::int64_t* f = &all[static_cast<std::size_t>(r) * fields];
      detail += "\n  rank " + std::to_string(r) + ": " + std::string(kind_name(static_cast<trace::operation>(f[0]))) +
                " of " + std::to_string(f[1]) + " x " + std::string(to_string(static_cast<dtype>(f[2]))) +
                ", op " + std::string(to_string(static_cast<reduce_op>(f[3]))) + ", root " + std::to_string(f[4]);
    }
    fail(where(kind_name(kind)) + ": the ranks of the group called different operations or shapes:" + detail);
  }

  template <class S, class R>
  request reduce_impl(S&& send, R&& recv, int root, reduce_op op, completion how) {
    auto [s, r] = same_typed("reduce", send, recv);
    check_root("reduce", root);
    if (rank() == root) expect_equal("reduce", "send", s.size(), "recv (on the root)", r.size());
    agree_on_call(trace::operation::reduce, s.size(), dtype_of<buffer_element_t<R>>, op, root);
    account(s.size_bytes());
    return dispatch(how, trace::operation::reduce, dtype_of<buffer_element_t<R>>, s.size(), root, static_cast<int>(op),
                    [&](completion mode) {
                      return native_.reduce(s.data(), r.data(), s.size(), dtype_of<buffer_element_t<R>>, op, root, mode);
                    });
  }

  template <class S, class R>
  request broadcast_impl(S&& send, R&& recv, int root, completion how) {
    auto [s, r] = same_typed("broadcast", send, recv);
    check_root("broadcast", root);
    if (rank() == root) expect_equal("broadcast", "send (on the root)", s.size(), "recv", r.size());
    agree_on_call(trace::operation::broadcast, r.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, root);
    account(rank() == root ? r.size_bytes() : 0);
    return dispatch(how, trace::operation::broadcast, dtype_of<buffer_element_t<R>>, r.size(), root, -1,
                    [&](completion mode) {
                      return native_.broadcast(s.data(), r.data(), r.size(), dtype_of<buffer_element_t<R>>, root, mode);
                    });
  }

  template <class S, class R>
  request all_gather_impl(S&& send, R&& recv, completion how) {
    auto [s, r] = same_typed("all_gather", send, recv);
    expect_equal("all_gather", "recv", r.size(), "send x group size", s.size() * static_cast<std::size_t>(size()));
    agree_on_call(trace::operation::all_gather, s.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(s.size_bytes());
    return dispatch(how, trace::operation::all_gather, dtype_of<buffer_element_t<R>>, s.size(), -1, -1,
                    [&](completion mode) {
                      return native_.all_gather(s.data(), r.data(), s.size(), dtype_of<buffer_element_t<R>>, mode);
                    });
  }

  template <class S, class R>
  request reduce_scatter_impl(S&& send, R&& recv, reduce_op op, completion how) {
    auto [s, r] = same_typed("reduce_scatter", send, recv);
    expect_equal("reduce_scatter", "send", s.size(), "recv x group size", r.size() * static_cast<std::size_t>(size()));
    agree_on_call(trace::operation::reduce_scatter, r.size(), dtype_of<buffer_element_t<R>>, op, -1);
    account(s.size_bytes());
    return dispatch(how, trace::operation::reduce_scatter, dtype_of<buffer_element_t<R>>, r.size(), -1,
                    static_cast<int>(op), [&](completion mode) {
                      return native_.reduce_scatter(s.data(), const_cast<void*>(static_cast<const void*>(r.data())),
                                                    r.size(), dtype_of<buffer_element_t<R>>, op, mode);
                    });
  }

  template <class S, class R>
  request all_to_all_impl(S&& send, R&& recv, completion how) {
    auto [s, r] = same_typed("all_to_all", send, recv);
    expect_equal("all_to_all", "send", s.size(), "recv", r.size());
    if (s.size() % static_cast<std::size_t>(size()) != 0)
      fail(where("all_to_all") + ": buffers of " + std::to_string(s.size()) +
           " elements do not split into equal blocks for " + std::to_string(size()) + " ranks");
    std::size_t block = s.size() / static_cast<std::size_t>(size());
    agree_on_call(trace::operation::all_to_all, block, dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(s.size_bytes());
    return dispatch(how, trace::operation::all_to_all, dtype_of<buffer_element_t<R>>, block, -1, -1,
                    [&](completion mode) {
                      return native_.all_to_all(s.data(), r.data(), block, dtype_of<buffer_element_t<R>>, mode);
                    });
  }

  /// check_level::agreement folded into each collective by the backend (MPI).
  bool agreement_folded() const noexcept { return folds_call_agreement<B> && checks_ == check_level::agreement; }

  /// The ranks' row shapes differ (every rank holds all of them, so all throw this).
  [[noreturn, gnu::cold, gnu::noinline]] void rows_differ(const std::vector<std::int64_t>& in, std::size_t wide,
                                                         std::size_t block) const {
    std::string detail;
    for (std::size_t i = 0; i < static_cast<std::size_t>(size()); ++i)
      detail += "\n  rank " + std::to_string(i) + ": rows of " + std::to_string(in[i * wide + block + 1]) + " x " +
                std::string(to_string(static_cast<dtype>(in[i * wide + block])));
    fail(where("exchange_counts") + ": the ranks exchange rows of different shapes:" + detail +
         "\nevery rank of the group must move rows of the same element type and length");
  }

  template <class S, class R>
  request all_to_allv_paired(S&& send, R&& recv, const paired_counts& counts, completion how) {
    if (counts.send_.size() != static_cast<std::size_t>(size()))
      fail(where("all_to_allv") + ": the counts hold " + std::to_string(counts.send_.size()) +
           " ranks, not this group's; pass counts from this group's exchange_counts");
    if (dtype_of<buffer_element_t<R>> != counts.type_)
      fail(where("all_to_allv") + ": the counts were exchanged for rows of " +
           std::string(to_string(counts.type_)) + " but the buffers hold " +
           std::string(to_string(dtype_of<buffer_element_t<R>>)));
    // The exchange's agreement carries this call's only while nothing else ran on the group
    // since: then every rank of a correct program decides alike, from the same calls.
    const bool carried = agreement_folded() && counts.exchange_ != 0 && counts.exchanged_on_ == recorder_.get() &&
                         counts.exchange_ == carried_exchange_ && recorder_->collectives() == carried_at_;
    request pending = all_to_allv_impl(send, counts.send(), recv, counts.recv(), how, carried);
    if (carried) carried_at_ = recorder_->collectives();
    return pending;
  }

  template <class S, class R>
  request all_to_allv_impl(S&& send, std::span<const std::size_t> send_counts, R&& recv,
                           std::span<const std::size_t> recv_counts, completion how, bool agreed = false) {
    auto [s, r] = same_typed("all_to_allv", send, recv);
    const std::size_t ranks = static_cast<std::size_t>(size());
    expect_equal("all_to_allv", "send_counts", send_counts.size(), "the group", ranks);
    expect_equal("all_to_allv", "recv_counts", recv_counts.size(), "the group", ranks);
    std::size_t sent = 0, received = 0;
    for (std::size_t i = 0; i < ranks; ++i) sent += send_counts[i], received += recv_counts[i];
    if (s.size() < sent || r.size() < received)
      fail(where("all_to_allv") + ": the counts need " + std::to_string(sent) + " elements to send and " +
           std::to_string(received) + " to receive, but send has " + std::to_string(s.size()) + " and recv " +
           std::to_string(r.size()) + "; pass buffers at least as long as the counts' sums");
    if (sent > 0 && received > 0 && static_cast<const void*>(s.data()) == static_cast<const void*>(r.data()))
      fail(where("all_to_allv") + ": send and recv are the same buffer; all_to_allv is not in place");
    if (!agreed) agree_on_call(trace::operation::all_to_allv, ranks, dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    if (checks_ == check_level::communication) [[unlikely]] {
      try {
        agree_on_counts(send_counts, recv_counts);
      } catch (...) {
        recorder_->finish(std::exchange(checked_sequence_, 0), false);  // the call check recorded it
        throw;
      }
    }
    account(sent * sizeof(buffer_element_t<R>));
    // Recorded with the group size as its count: the counts differ across ranks, and the
    // recorder's fingerprint and weft-trace-diff compare counts across ranks.
    return dispatch(how, trace::operation::all_to_allv, dtype_of<buffer_element_t<R>>, ranks, -1, -1,
                    [&](completion mode) {
                      if constexpr (folds_call_agreement<B>) {
                        if (agreed) {
                          // The backend reads the setting when the call is made, even for async calls.
                          native_.agree_on_calls(false);
                          struct refold {
                            communicator& self;
                            ~refold() { self.fold_agreement(); }
                          } restore{*this};
                          return native_.all_to_allv(s.data(), send_counts, r.data(), recv_counts,
                                                     dtype_of<buffer_element_t<R>>, mode);
                        }
                      }
                      return native_.all_to_allv(s.data(), send_counts, r.data(), recv_counts,
                                                 dtype_of<buffer_element_t<R>>, mode);
                    });
  }

  /// check_level::communication on an all_to_allv: every rank gathers every rank's send and
  /// receive counts, so that all see the same pairs that disagree and throw the same error.
  [[gnu::noinline]] void agree_on_counts(std::span<const std::size_t> send_counts,
                                         std::span<const std::size_t> recv_counts) {
    const std::size_t ranks = static_cast<std::size_t>(size());
    std::vector<std::int64_t> mine(2 * ranks), all(2 * ranks * ranks);
    for (std::size_t i = 0; i < ranks; ++i)
      mine[i] = static_cast<std::int64_t>(send_counts[i]), mine[ranks + i] = static_cast<std::int64_t>(recv_counts[i]);
    host_all_gather(mine, all);
    std::string pairs;
    for (std::size_t from = 0; from < ranks; ++from)
      for (std::size_t to = 0; to < ranks; ++to) {
        const std::int64_t sends = all[from * 2 * ranks + to], expects = all[to * 2 * ranks + ranks + from];
        if (sends != expects)
          pairs += "\n  rank " + std::to_string(from) + " sends " + std::to_string(sends) + " to rank " +
                   std::to_string(to) + ", which expects " + std::to_string(expects);
      }
    if (!pairs.empty())
      fail(where("all_to_allv") + ": the ranks' counts do not pair up:" + pairs +
           "\nrank i's send_counts[j] must equal rank j's recv_counts[i]; exchange the counts first (exchange_counts)");
  }

  template <class S>
  request send_impl(S&& data, int peer, completion how) {
    auto s = std::span(data);
    check_peer("send", peer);
    account(s.size_bytes());
    return dispatch(how, trace::operation::send, dtype_of<buffer_element_t<S>>, s.size(), peer, -1,
                    [&](completion mode) { return native_.send(s.data(), s.size(), dtype_of<buffer_element_t<S>>, peer, mode); });
  }

  template <class R>
  request recv_impl(R&& data, int peer, completion how) {
    auto r = std::span(data);
    check_peer("recv", peer);
    return dispatch(how, trace::operation::recv, dtype_of<buffer_element_t<R>>, r.size(), peer, -1,
                    [&](completion mode) { return native_.recv(r.data(), r.size(), dtype_of<buffer_element_t<R>>, peer, mode); });
  }

  request group_p2p_impl(std::span<const p2p_op> ops, completion how) {
    std::size_t elements = 0;
    for (const p2p_op& op : ops) {
      if (op.direction == p2p_op::kind::send) account(op.count * size_of(op.type));
      elements += op.count;
    }
    // One entry for the batch: its element count over all transfers, the first one's dtype.
    return dispatch(how, trace::operation::p2p_batch, ops.empty() ? dtype::uint8 : ops.front().type, elements, -1, -1,
                    [&](completion mode) { return native_.group_p2p(ops, mode); });
  }

  // The recorder and the watch are declared before the native communicator, so they are destroyed
  // after it: work it still has queued, which its destruction waits for, stays under the deadline.
  std::shared_ptr<trace::flight_recorder> recorder_;
  trace::watchdog::registration watch_;
  native_type native_;
  std::string name_;
  check_level checks_;
  std::uint64_t check_interval_ = 1;
  std::uint64_t checked_sequence_ = 0;  ///< set by check_call, taken by the next dispatch
  comm_stats stats_;
  std::uint64_t count_exchanges_ = 0;   ///< exchanges of rows made at check_level::agreement
  std::uint64_t carried_exchange_ = 0;  ///< the one whose agreement carries the next all_to_allv (0: none)
  std::uint64_t carried_at_ = 0;        ///< ... while the group's collectives number this many
  std::shared_ptr<detail::communicator_anchor<B>> anchor_;
};

}  // namespace weft
