#pragma once
/// \file
/// Ring attention on the cp group: every rank keeps the queries of its tokens, and the key/value
/// blocks of all ranks pass around the ring (rank r sends to r+1 and receives from r−1), one hop
/// per step, for cp steps. While a rank attends to the block it holds, the next block is already
/// on its way (one grouped send/receive posted with `batch().run_async()` before the local
/// computation, waited for after it). Partial results are folded together with the online-softmax
/// merge (running LSE and rescaled output), so no rank ever holds more than two K/V blocks.
///
/// Causal masking uses the global positions of the split (causal_split.hpp); with the
/// load-balanced split each rank's tokens are two chunks, and the computation runs per (query
/// chunk, key chunk) pair: pairs that are entirely masked are skipped, pairs entirely visible are
/// computed without a mask, and only the diagonal pairs are masked.
///
/// Backward: the same ring pass of K/V, with the dK/dV accumulators of each block travelling with
/// it; after the last step each accumulator makes one more hop, home to its owner. The K/V
/// transfer of the next step overlaps the local computation; the accumulator's hop follows it.
///
/// The local computation is a kernel object (attention_reference.hpp): the CPU reference by
/// default, a trainer's own (device) kernel otherwise. The kernel must work on the memory of the
/// backend's buffers; the CPU reference with the NCCL backend is refused at compile time.
///
/// Each transfer is waited for before the computation that reads what it received (and before
/// the slots it used are reused). By default the host waits. A kernel whose work runs in an
/// order of its own (a GPU kernel on its compute stream, the communicator on another) can say so
/// with `before_transfer(group)` and `after_transfer(request)` (orders_transfers below): then each
/// transfer is queued after the kernel's work and the kernel's later work waits for it, the host
/// waiting for nothing, so a transfer runs beside the computation on the block in use.
///
/// Collective: every rank of the cp group calls the same members in the same order.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/error.hpp>
#include <weft/cp/attention_reference.hpp>
#include <weft/cp/causal_split.hpp>

namespace weft::cp {

/// A kernel that orders the ring's transfers with its own work, without the host:
/// `before_transfer(group)` makes the group's next operations wait for the work the kernel has
/// queued (the data they send written, the buffers they receive into no longer read), and
/// `after_transfer(request)` makes the kernel's later work wait for that operation.
template <class K, class B>
concept orders_transfers = requires(const K& kernel, communicator<B>& group, typename B::request& r) {
  kernel.before_transfer(group);
  kernel.after_transfer(r);
};

namespace detail {

/// One number for a configuration every rank of the group must share.
inline std::uint64_t configuration_fingerprint(const sequence_split& split, attention_shape shape,
                                               attention_options options) {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  mix(static_cast<std::uint64_t>(split.seq));
  mix(static_cast<std::uint64_t>(split.cp));
  mix(static_cast<std::uint64_t>(split.kind));
  mix(shape.heads);
  mix(shape.head_dim);
  mix(options.causal ? 1u : 0u);
  mix(std::bit_cast<std::uint64_t>(options.scale));
  return h;
}

}  // namespace detail

template <backend B, class Kernel = reference_attention>
class ring_attention {
  static_assert(kernel_runs_on<Kernel, B>,
                "weft::cp::ring_attention: the attention kernel must work on the memory this backend's buffers "
                "live in; the CPU reference (reference_attention) works on host memory only, so with the NCCL "
                "backend pass a device kernel whose `memory` is memory_space::device");

 public:
  using backend_type = B;

  /// Collective over `group` (one small all-gather): every rank must pass the same split, shape and
  /// options; the split's cp must be the group's size. Throws on every rank otherwise, before
  /// anything else is sent.
  ring_attention(communicator<B>& group, sequence_split split, attention_shape shape, attention_options options = {},
                 Kernel kernel = {})
      : group_(group.ref()), split_(split), shape_(shape), options_(options), kernel_(std::move(kernel)) {
    group.expect_same_on_all_ranks("the ring attention configuration (sequence length, split, heads, head_dim, "
                                   "causal, scale)",
                                   detail::configuration_fingerprint(split, shape, options));
    if (split.cp != group.size())
      fail(where(group) + ": the sequence split is for cp=" + std::to_string(split.cp) + " but the group has " +
           std::to_string(group.size()) + " ranks; build the split with cp = the cp group's size");
    validate(split_);
    if (shape.heads == 0 || shape.head_dim == 0)
      fail(where(group) + ": heads=" + std::to_string(shape.heads) + " and head_dim=" +
           std::to_string(shape.head_dim) + " must both be positive");
    for (int r = 0; r < split.cp; ++r) {
      segments_.push_back(cp::segments(split_, r));
      positions_.push_back(cp::positions(split_, r));
    }
  }

  const sequence_split& split() const noexcept { return split_; }
  attention_shape shape() const noexcept { return shape_; }
  /// Tokens this rank holds (local tokens); tensors are [local tokens, heads, head_dim].
  std::size_t local_tokens() const noexcept { return static_cast<std::size_t>(cp::local_tokens(split_)); }
  /// The global positions of this rank's tokens.
  std::span<const std::int64_t> positions() const { return positions_[static_cast<std::size_t>(group_.get().rank())]; }

  /// out, lse: the attention of this rank's queries to the keys of the whole sequence, and the
  /// LSE of each query row ([local tokens, heads]; keep it for backward).
  template <class T>
    requires attention_kernel<Kernel, T>
  void forward(std::type_identity_t<std::span<const T>> q, std::type_identity_t<std::span<const T>> k,
               std::type_identity_t<std::span<const T>> v, std::type_identity_t<std::span<T>> out,
               std::type_identity_t<std::span<T>> lse) {
    communicator<B>& group = group_.get();
    const std::size_t n_tok = local_tokens() * shape_.row();
    expect(group, "forward", "q", q.size(), n_tok);
    expect(group, "forward", "k", k.size(), n_tok);
    expect(group, "forward", "v", v.size(), n_tok);
    expect(group, "forward", "out", out.size(), n_tok);
    expect(group, "forward", "lse", lse.size(), local_tokens() * shape_.heads);

    const int n = group.size(), rank = group.rank();
    const int next = (rank + 1) % n, prev = (rank - 1 + n) % n;
    retire_completed();
    kernel_.fill(out, T(0));
    kernel_.fill(lse, static_cast<T>(-std::numeric_limits<double>::infinity()));
    auto block_out = kernel_.template allocate<T>(n_tok);
    auto block_lse = kernel_.template allocate<T>(local_tokens() * shape_.heads);
    if (n == 1) {
      attend(q, k, v, 0, out, lse, block_out, block_lse);
      return;
    }
    // Two slots for the K/V block in flight and the one in use.
    auto k_slot = std::array{kernel_.template allocate<T>(n_tok), kernel_.template allocate<T>(n_tok)};
    auto v_slot = std::array{kernel_.template allocate<T>(n_tok), kernel_.template allocate<T>(n_tok)};
    std::span<const T> cur_k = k, cur_v = v;
    for (int step = 0; step < n; ++step) {
      const int owner = (rank - step + n) % n;
      typename B::request incoming;
      const bool more = step + 1 < n;
      auto& next_k = k_slot[static_cast<std::size_t>(step % 2)];
      auto& next_v = v_slot[static_cast<std::size_t>(step % 2)];
      if (more) {
        before_transfer(group);
        incoming = group.batch()
                       .send(cur_k, next)
                       .send(cur_v, next)
                       .recv(std::span<T>(next_k), prev)
                       .recv(std::span<T>(next_v), prev)
                       .run_async();
      }
      attend(q, cur_k, cur_v, owner, out, lse, block_out, block_lse);
      if (more) {
        consume(std::move(incoming));
        cur_k = std::span<const T>(next_k);
        cur_v = std::span<const T>(next_v);
      }
    }
  }

  /// dq, dk, dv: the gradients of this rank's q, k and v, given the forward's out and lse and the
  /// gradient of out (dout). Overwrites dq, dk, dv.
  template <class T>
    requires attention_kernel<Kernel, T>
  void backward(std::type_identity_t<std::span<const T>> q, std::type_identity_t<std::span<const T>> k,
                std::type_identity_t<std::span<const T>> v, std::type_identity_t<std::span<const T>> out,
                std::type_identity_t<std::span<const T>> lse, std::type_identity_t<std::span<const T>> dout,
                std::type_identity_t<std::span<T>> dq, std::type_identity_t<std::span<T>> dk,
                std::type_identity_t<std::span<T>> dv) {
    communicator<B>& group = group_.get();
    const std::size_t n_tok = local_tokens() * shape_.row();
    using sized = std::pair<const char*, std::size_t>;
    for (auto [name, size] : {sized{"q", q.size()}, sized{"k", k.size()}, sized{"v", v.size()},
                              sized{"out", out.size()}, sized{"dout", dout.size()}, sized{"dq", dq.size()},
                              sized{"dk", dk.size()}, sized{"dv", dv.size()}})
      expect(group, "backward", name, size, n_tok);
    expect(group, "backward", "lse", lse.size(), local_tokens() * shape_.heads);

    const int n = group.size(), rank = group.rank();
    const int next = (rank + 1) % n, prev = (rank - 1 + n) % n;
    retire_completed();
    kernel_.fill(dq, T(0));
    if (n == 1) {
      kernel_.fill(dk, T(0));
      kernel_.fill(dv, T(0));
      attend_backward(q, k, v, 0, out, lse, dout, dq, dk, dv);
      return;
    }
    auto k_slot = std::array{kernel_.template allocate<T>(n_tok), kernel_.template allocate<T>(n_tok)};
    auto v_slot = std::array{kernel_.template allocate<T>(n_tok), kernel_.template allocate<T>(n_tok)};
    auto dk_slot = std::array{kernel_.template allocate<T>(n_tok), kernel_.template allocate<T>(n_tok)};
    auto dv_slot = std::array{kernel_.template allocate<T>(n_tok), kernel_.template allocate<T>(n_tok)};
    kernel_.fill(std::span<T>(dk_slot[0]), T(0));
    kernel_.fill(std::span<T>(dv_slot[0]), T(0));
    std::span<const T> cur_k = k, cur_v = v;
    std::size_t acc = 0;  // the accumulator slot of the block in use
    for (int step = 0; step < n; ++step) {
      const int owner = (rank - step + n) % n;
      const bool more = step + 1 < n;
      const auto slot = static_cast<std::size_t>(step % 2);
      typename B::request kv_incoming;
      if (more) {
        before_transfer(group);
        kv_incoming = group.batch()
                          .send(cur_k, next)
                          .send(cur_v, next)
                          .recv(std::span<T>(k_slot[slot]), prev)
                          .recv(std::span<T>(v_slot[slot]), prev)
                          .run_async();
      }
      attend_backward(q, cur_k, cur_v, owner, out, lse, dout, dq, std::span<T>(dk_slot[acc]),
                      std::span<T>(dv_slot[acc]));
      // The accumulators go on with their block. After the last step each goes home: the block
      // the previous rank held last is this rank's own, and its accumulators land in dk and dv.
      std::span<T> in_dk = more ? std::span<T>(dk_slot[1 - acc]) : dk;
      std::span<T> in_dv = more ? std::span<T>(dv_slot[1 - acc]) : dv;
      before_transfer(group);
      consume(group.batch()
                  .send(std::span<const T>(dk_slot[acc]), next)
                  .send(std::span<const T>(dv_slot[acc]), next)
                  .recv(in_dk, prev)
                  .recv(in_dv, prev)
                  .run_async());
      acc = 1 - acc;
      if (more) {
        consume(std::move(kv_incoming));
        cur_k = std::span<const T>(k_slot[slot]);
        cur_v = std::span<const T>(v_slot[slot]);
      }
    }
  }

 private:
  static constexpr bool kernel_orders_transfers = orders_transfers<Kernel, B>;

  /// Queues the group's next transfer after the kernel's work (nothing to do when the host waits).
  void before_transfer(communicator<B>& group) {
    if constexpr (kernel_orders_transfers) kernel_.before_transfer(group);
  }
  /// Makes what follows wait for `r`: the kernel's later work (r then kept until it is seen
  /// complete), or the host.
  void consume(typename B::request r) {
    if constexpr (kernel_orders_transfers) {
      kernel_.after_transfer(r);
      in_flight_.push_back(std::move(r));
    } else {
      r.wait();
    }
  }
  /// Lets go of the transfers seen complete; never blocks (a failed one throws here).
  void retire_completed() {
    std::erase_if(in_flight_, [](typename B::request& r) { return r.test(); });
  }

  static std::string where(const communicator<B>& group) {
    return "ring attention on group '" + group.name() + "' (rank " + std::to_string(group.rank()) + " of " +
           std::to_string(group.size()) + ")";
  }
  void expect(const communicator<B>& group, const char* call, const char* what, std::size_t got,
              std::size_t want) const {
    if (got != want)
      fail(where(group) + ", " + call + ": " + what + " has " + std::to_string(got) + " elements; expected " +
           std::to_string(want) + " (" + std::to_string(local_tokens()) + " local tokens of " +
           std::to_string(split_.seq) + " x " + std::to_string(shape_.heads) + " heads" +
           (std::string_view(what) == "lse" ? "" : " x head_dim " + std::to_string(shape_.head_dim)) +
           "); nothing was sent");
  }

  /// Visits the (query chunk, key chunk) pairs of this rank's queries and `owner`'s keys that
  /// are not entirely masked: f(q_row, q_rows, k_row, k_rows, needs_mask).
  template <class F>
  void for_each_visible_pair(int owner, F&& f) const {
    const int rank = group_.get().rank();
    std::size_t q_row = 0;
    for (const segment& a : segments_[static_cast<std::size_t>(rank)]) {
      std::size_t k_row = 0;
      for (const segment& b : segments_[static_cast<std::size_t>(owner)]) {
        const bool masked = options_.causal && b.begin > a.last();
        const bool needs_mask = options_.causal && b.last() > a.begin;
        if (!masked)
          f(q_row, static_cast<std::size_t>(a.length), k_row, static_cast<std::size_t>(b.length), needs_mask);
        k_row += static_cast<std::size_t>(b.length);
      }
      q_row += static_cast<std::size_t>(a.length);
    }
  }

  template <class T, class Scratch>
  void attend(std::span<const T> q, std::span<const T> k, std::span<const T> v, int owner, std::span<T> out,
              std::span<T> lse, Scratch& block_out, Scratch& block_lse) {
    const std::size_t row = shape_.row(), H = shape_.heads;
    const auto& q_pos = positions_[static_cast<std::size_t>(group_.get().rank())];
    const auto& k_pos = positions_[static_cast<std::size_t>(owner)];
    std::span<T> bo(block_out), bl(block_lse);
    for_each_visible_pair(owner, [&](std::size_t qr, std::size_t nq, std::size_t kr, std::size_t nk, bool mask) {
      attention_options o = options_;
      o.causal = mask;
      kernel_.forward(q.subspan(qr * row, nq * row), std::span<const std::int64_t>(q_pos).subspan(qr, nq),
                      k.subspan(kr * row, nk * row), v.subspan(kr * row, nk * row),
                      std::span<const std::int64_t>(k_pos).subspan(kr, nk), shape_, o, bo.subspan(qr * row, nq * row),
                      bl.subspan(qr * H, nq * H));
      kernel_.merge(out.subspan(qr * row, nq * row), lse.subspan(qr * H, nq * H),
                    std::span<const T>(bo.subspan(qr * row, nq * row)), std::span<const T>(bl.subspan(qr * H, nq * H)));
    });
  }

  template <class T>
  void attend_backward(std::span<const T> q, std::span<const T> k, std::span<const T> v, int owner,
                       std::span<const T> out, std::span<const T> lse, std::span<const T> dout, std::span<T> dq,
                       std::span<T> dk, std::span<T> dv) {
    const std::size_t row = shape_.row(), H = shape_.heads;
    const auto& q_pos = positions_[static_cast<std::size_t>(group_.get().rank())];
    const auto& k_pos = positions_[static_cast<std::size_t>(owner)];
    for_each_visible_pair(owner, [&](std::size_t qr, std::size_t nq, std::size_t kr, std::size_t nk, bool mask) {
      attention_options o = options_;
      o.causal = mask;
      kernel_.backward(q.subspan(qr * row, nq * row), std::span<const std::int64_t>(q_pos).subspan(qr, nq),
                       k.subspan(kr * row, nk * row), v.subspan(kr * row, nk * row),
                       std::span<const std::int64_t>(k_pos).subspan(kr, nk), shape_, o,
                       out.subspan(qr * row, nq * row), lse.subspan(qr * H, nq * H), dout.subspan(qr * row, nq * row),
                       dq.subspan(qr * row, nq * row), dk.subspan(kr * row, nk * row), dv.subspan(kr * row, nk * row));
    });
  }

  communicator_ref<B> group_;
  sequence_split split_;
  attention_shape shape_;
  attention_options options_;
  Kernel kernel_;
  std::vector<std::vector<segment>> segments_;
  std::vector<std::vector<std::int64_t>> positions_;
  /// With a kernel that orders transfers: the transfers its work waits for, until seen complete
  /// (a pending one is waited for when the ring is destroyed).
  std::vector<typename B::request> in_flight_;
};

}  // namespace weft::cp
