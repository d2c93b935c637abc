#pragma once
/// \file
/// `weft::communicator<Backend>`: typed collectives and point-to-point on contiguous ranges, the
/// same for every backend. It checks what one rank can check (sizes, roots, peers) and says what
/// is wrong in terms of the group, the rank and the sizes; with `check_level::communication` it
/// also checks, before each collective, that every rank of the group called the same operation
/// with the same shape (one small extra all-gather), turning a hang or silent corruption into an
/// error on every rank. Then it dispatches to the backend, which does the work.
///
/// Every operation has a blocking form (`all_reduce`) and an async form (`all_reduce_async`)
/// returning the backend's move-only request. Out-of-place forms take (send, recv); in-place forms
/// take one buffer. For buffers of device memory (NCCL), spans over device pointers are fine.

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/buffer.hpp>
#include <weft/core/error.hpp>

namespace weft {

/// How much a communicator checks before each operation.
enum class check_level {
  local,          ///< sizes, roots and peers on this rank (always on; costs nothing measurable)
  communication,  ///< also that all ranks agree on the call (one extra small all-gather per collective)
};

/// Counters for what a communicator has issued (for tests, traces and benchmarks).
struct comm_stats {
  std::uint64_t operations = 0;
  std::uint64_t bytes = 0;  ///< payload bytes this rank contributed (send side)
};

/// The default check level: `local`, or `communication` when WEFT_CHECK_LEVEL=communication.
inline check_level default_check_level() {
  const char* value = std::getenv("WEFT_CHECK_LEVEL");
  return value != nullptr && std::string_view(value) == "communication" ? check_level::communication
                                                                         : check_level::local;
}

template <backend B>
class communicator {
 public:
  using backend_type = B;
  using native_type = typename B::comm;
  using request = typename B::request;

  communicator(native_type native, std::string name, check_level checks = default_check_level())
      : native_(std::move(native)), name_(std::move(name)), checks_(checks) {
    if (!native_.valid()) fail("communicator '" + name_ + "' was given an invalid native communicator");
  }

  communicator(communicator&&) noexcept = default;
  communicator& operator=(communicator&&) noexcept = default;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;

  int rank() const noexcept { return native_.rank(); }
  int size() const noexcept { return native_.size(); }
  /// The group's name ("world", "tp", "dp", ...), used in every error and trace.
  const std::string& name() const noexcept { return name_; }
  native_type& native() noexcept { return native_; }
  const comm_stats& stats() const noexcept { return stats_; }
  check_level checks() const noexcept { return checks_; }
  void set_checks(check_level level) noexcept { checks_ = level; }

  // ---- all_reduce ------------------------------------------------------------------------
  template <buffer S, mutable_buffer R>
  request all_reduce_async(S&& send, R&& recv, reduce_op op = reduce_op::sum) {
    auto [s, r] = same_typed("all_reduce", send, recv);
    expect_equal("all_reduce", "send", s.size(), "recv", r.size());
    agree_on_call(call_kind::all_reduce, r.size(), dtype_of<buffer_element_t<R>>, op, -1);
    account(r.size_bytes());
    return native_.all_reduce(s.data(), r.data(), r.size(), dtype_of<buffer_element_t<R>>, op, completion::async);
  }
  template <mutable_buffer R>
  request all_reduce_async(R&& inout, reduce_op op = reduce_op::sum) {
    return all_reduce_async(std::as_const(inout), inout, op);
  }
  template <buffer S, mutable_buffer R>
  void all_reduce(S&& send, R&& recv, reduce_op op = reduce_op::sum) {
    auto [s, r] = same_typed("all_reduce", send, recv);
    expect_equal("all_reduce", "send", s.size(), "recv", r.size());
    agree_on_call(call_kind::all_reduce, r.size(), dtype_of<buffer_element_t<R>>, op, -1);
    account(r.size_bytes());
    native_.all_reduce(s.data(), r.data(), r.size(), dtype_of<buffer_element_t<R>>, op, completion::blocking).wait();
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
    agree_on_call(call_kind::all_reduce, data.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(data.size_bytes());
    return native_.all_reduce_scaled(data.data(), data.data(), data.size(), dtype_of<buffer_element_t<R>>, factor,
                                     completion::async);
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
    agree_on_call(call_kind::reduce_scatter, block.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(data.size_bytes());
    return native_.reduce_scatter_scaled(data.data(), const_cast<void*>(static_cast<const void*>(block.data())),
                                         block.size(), dtype_of<buffer_element_t<R>>, factor, completion::async);
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
  /// `send`/`recv`, then `run()` or `run_async()`. The buffers must outlive the run.
  class p2p_batch {
   public:
    template <buffer S>
    p2p_batch& send(S&& data, int peer) {
      auto s = std::span(data);
      owner_->check_peer("send", peer);
      ops_.push_back({p2p_op::kind::send, const_cast<void*>(static_cast<const void*>(s.data())), s.size(),
                      dtype_of<buffer_element_t<S>>, peer});
      return *this;
    }
    template <mutable_buffer R>
    p2p_batch& recv(R&& data, int peer) {
      auto r = std::span(data);
      owner_->check_peer("recv", peer);
      ops_.push_back({p2p_op::kind::recv, static_cast<void*>(r.data()), r.size(), dtype_of<buffer_element_t<R>>, peer});
      return *this;
    }
    request run_async() { return owner_->group_p2p_impl(ops_, completion::async); }
    void run() { owner_->group_p2p_impl(ops_, completion::blocking).wait(); }
    std::span<const p2p_op> ops() const noexcept { return ops_; }

   private:
    friend class communicator;
    explicit p2p_batch(communicator* owner) : owner_(owner) {}
    communicator* owner_;
    std::vector<p2p_op> ops_;
  };
  p2p_batch batch() { return p2p_batch(this); }

  // ---- synchronisation, groups, agreement --------------------------------------------------
  request barrier_async() {
    agree_on_call(call_kind::barrier, 0, dtype::uint8, reduce_op::sum, -1);
    return native_.barrier(completion::async);
  }
  void barrier() {
    agree_on_call(call_kind::barrier, 0, dtype::uint8, reduce_op::sum, -1);
    native_.barrier(completion::blocking).wait();
  }

  /// Splits this communicator (collective): ranks with the same color form a group, ordered by
  /// key. A negative color leaves this rank out and returns nothing.
  std::optional<communicator> split(int color, int key, std::string name) {
    native_type child = native_.split(color, key);
    if (!child.valid()) return std::nullopt;
    return communicator(std::move(child), std::move(name), checks_);
  }

  /// Checks (collectively) that every rank passed the same value; otherwise throws on every rank
  /// an error naming `what` and the ranks that disagree. Use it before work that would hang or
  /// corrupt if ranks disagreed (layouts, bucket plans).
  void expect_same_on_all_ranks(std::string_view what, std::uint64_t fingerprint) {
    std::vector<std::int64_t> all(static_cast<std::size_t>(size()));
    std::int64_t mine = static_cast<std::int64_t>(fingerprint);
    native_.host_all_gather(std::span<const std::int64_t>(&mine, 1), all);
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
  enum class call_kind : std::int64_t {
    all_reduce = 1, reduce, broadcast, all_gather, reduce_scatter, all_to_all, barrier
  };

  static constexpr std::string_view kind_name(call_kind kind) {
    switch (kind) {
      case call_kind::all_reduce: return "all_reduce";
      case call_kind::reduce: return "reduce";
      case call_kind::broadcast: return "broadcast";
      case call_kind::all_gather: return "all_gather";
      case call_kind::reduce_scatter: return "reduce_scatter";
      case call_kind::all_to_all: return "all_to_all";
      case call_kind::barrier: return "barrier";
    }
    return "?";
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
  /// compare, so a mismatch is an error on every rank instead of a hang or corruption.
  void agree_on_call(call_kind kind, std::size_t count, dtype type, reduce_op op, int root) {
    if (checks_ == check_level::communication) [[unlikely]]
      agree_on_call_across_ranks(kind, count, type, op, root);
  }

  [[gnu::noinline]] void agree_on_call_across_ranks(call_kind kind, std::size_t count, dtype type, reduce_op op,
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
      detail += "\n  rank " + std::to_string(r) + ": " + std::string(kind_name(static_cast<call_kind>(f[0]))) +
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
    agree_on_call(call_kind::reduce, s.size(), dtype_of<buffer_element_t<R>>, op, root);
    account(s.size_bytes());
    return native_.reduce(s.data(), r.data(), s.size(), dtype_of<buffer_element_t<R>>, op, root, how);
  }

  template <class S, class R>
  request broadcast_impl(S&& send, R&& recv, int root, completion how) {
    auto [s, r] = same_typed("broadcast", send, recv);
    check_root("broadcast", root);
    if (rank() == root) expect_equal("broadcast", "send (on the root)", s.size(), "recv", r.size());
    agree_on_call(call_kind::broadcast, r.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, root);
    account(rank() == root ? r.size_bytes() : 0);
    return native_.broadcast(s.data(), r.data(), r.size(), dtype_of<buffer_element_t<R>>, root, how);
  }

  template <class S, class R>
  request all_gather_impl(S&& send, R&& recv, completion how) {
    auto [s, r] = same_typed("all_gather", send, recv);
    expect_equal("all_gather", "recv", r.size(), "send x group size", s.size() * static_cast<std::size_t>(size()));
    agree_on_call(call_kind::all_gather, s.size(), dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(s.size_bytes());
    return native_.all_gather(s.data(), r.data(), s.size(), dtype_of<buffer_element_t<R>>, how);
  }

  template <class S, class R>
  request reduce_scatter_impl(S&& send, R&& recv, reduce_op op, completion how) {
    auto [s, r] = same_typed("reduce_scatter", send, recv);
    expect_equal("reduce_scatter", "send", s.size(), "recv x group size", r.size() * static_cast<std::size_t>(size()));
    agree_on_call(call_kind::reduce_scatter, r.size(), dtype_of<buffer_element_t<R>>, op, -1);
    account(s.size_bytes());
    return native_.reduce_scatter(s.data(), const_cast<void*>(static_cast<const void*>(r.data())), r.size(),
                                  dtype_of<buffer_element_t<R>>, op, how);
  }

  template <class S, class R>
  request all_to_all_impl(S&& send, R&& recv, completion how) {
    auto [s, r] = same_typed("all_to_all", send, recv);
    expect_equal("all_to_all", "send", s.size(), "recv", r.size());
    if (s.size() % static_cast<std::size_t>(size()) != 0)
      fail(where("all_to_all") + ": buffers of " + std::to_string(s.size()) +
           " elements do not split into equal blocks for " + std::to_string(size()) + " ranks");
    std::size_t block = s.size() / static_cast<std::size_t>(size());
    agree_on_call(call_kind::all_to_all, block, dtype_of<buffer_element_t<R>>, reduce_op::sum, -1);
    account(s.size_bytes());
    return native_.all_to_all(s.data(), r.data(), block, dtype_of<buffer_element_t<R>>, how);
  }

  template <class S>
  request send_impl(S&& data, int peer, completion how) {
    auto s = std::span(data);
    check_peer("send", peer);
    account(s.size_bytes());
    return native_.send(s.data(), s.size(), dtype_of<buffer_element_t<S>>, peer, how);
  }

  template <class R>
  request recv_impl(R&& data, int peer, completion how) {
    auto r = std::span(data);
    check_peer("recv", peer);
    return native_.recv(r.data(), r.size(), dtype_of<buffer_element_t<R>>, peer, how);
  }

  request group_p2p_impl(std::span<const p2p_op> ops, completion how) {
    for (const p2p_op& op : ops)
      if (op.direction == p2p_op::kind::send) account(op.count * size_of(op.type));
    return native_.group_p2p(ops, how);
  }

  native_type native_;
  std::string name_;
  check_level checks_;
  comm_stats stats_;
};

}  // namespace weft
