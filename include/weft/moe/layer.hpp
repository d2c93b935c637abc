#pragma once
/// \file
/// `moe_layer<B>`: a mixture-of-experts MLP over an ep group, forward and backward, with its
/// load-balancing and z losses (the exact semantics are in docs/moe.md):
///
///   route (router.hpp) -> permute by expert (permutation.hpp) -> exchange counts and dispatch
///   (dispatcher.hpp) -> experts (experts.hpp) -> combine -> y[t] = Σ_j w[t][j] · expert_j(h[t])
///
/// Each rank passes its own tokens h [T, C] (the output of ln_2), T = sequences x tokens per
/// sequence, and the weights of the router (replicated) and of its E/ep local experts; it gets y
/// [T, C] and, per sequence, aux and z (the same values on every rank that holds tokens of the
/// sequence: the sums are all-reduced over `sequence_groups`, the cp / sp groups, in order).
/// backward takes dy, dL/daux_s and dL/dz_s (the trainer's α and β over its number of
/// sequences), and gives dh (overwritten) and the gradients of the router and of the local
/// experts (accumulated, +=). The layer keeps what backward needs from forward.
///
/// Host memory only: a device-memory backend is refused at compile time.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/error.hpp>
#include <weft/moe/balance_loss.hpp>
#include <weft/moe/dispatcher.hpp>
#include <weft/moe/experts.hpp>
#include <weft/moe/gemm.hpp>
#include <weft/moe/permutation.hpp>
#include <weft/moe/router.hpp>
#include <weft/moe/shape.hpp>

namespace weft::moe {

/// The tensors of a layer on one rank: the router [E, C] and the rank's local experts in order
/// (E/ep of them, global experts first_expert() ...). `const float` for weights, `float` for
/// gradients.
template <class F>
struct moe_tensors {
  std::span<F> router;
  std::vector<expert_tensors<F>> experts;
};

/// What forward returns for this rank's sequences.
struct moe_losses {
  std::vector<double> aux;  ///< [sequences]: E · Σ_e f_e P_e of each sequence
  std::vector<double> z;    ///< [sequences]: mean_t lse_t² of each sequence
  std::size_t dropped = 0;  ///< this rank's assignments over capacity (0 when dropless)
};

/// The gradient of the training loss with respect to each sequence's aux and z (the same for
/// every sequence: with loss = mean over N sequences of CE + α Σ aux + β Σ z, these are α/N and β/N).
struct loss_gradients {
  double aux = 0;
  double z = 0;
};

template <backend B, gemm_kernel G = reference_gemm>
class moe_layer {
  static_assert(buffer_memory_v<B> == memory_space::host,
                "weft::moe::moe_layer computes on host memory; it does not run on a device-memory backend (NCCL)");

 public:
  /// Refuses sizes that cannot work (see validate()), naming them.
  moe_layer(communicator<B>& ep, moe_shape shape, moe_options options = {},
            std::vector<communicator_ref<B>> sequence_groups = {}, G gemm = {})
      : shape_(checked(shape, ep, options)),
        options_(options),
        ep_(ep.ref()),
        sequence_groups_(std::move(sequence_groups)),
        gemm_(std::move(gemm)),
        dispatcher_(ep, shape.experts) {}

  const moe_shape& shape() const noexcept { return shape_; }
  std::size_t local_experts() const noexcept { return dispatcher_.local_experts(); }
  std::size_t first_expert() const { return dispatcher_.first_expert(); }
  /// The last forward's routing (for inspection and tests).
  const routing& last_routing() const noexcept { return routing_; }
  const token_permutation& last_permutation() const noexcept { return permutation_; }

  /// y [T, C] from h [T, C] holding `sequences` sequences of equal length.
  moe_losses forward(std::span<const float> h, std::size_t sequences, const moe_tensors<const float>& weights,
                     std::span<float> y) {
    const std::size_t C = shape_.hidden, E = shape_.experts, K = shape_.top_k;
    check_inputs(h, sequences, weights, y);
    const std::size_t T = h.size() / C;
    input_.assign(h.begin(), h.end());
    sequences_ = sequences;

    route(gemm_, h, weights.router, shape_, routing_);
    std::vector<double> sums = sequence_sums(routing_, sequences);
    for (communicator_ref<B>& group : sequence_groups_) group.get().all_reduce(sums);
    losses_ = finish_losses(sums, E, K);

    const std::size_t cap = options_.capacity_factor > 0 ? capacity(options_.capacity_factor, T, K, E) : unlimited;
    permutation_ = permute_by_expert(routing_.expert, K, E, cap);
    std::vector<float> rows(permutation_.source.size() * C);
    gather_rows(h, C, permutation_, std::span<float>(rows));

    dispatcher_.plan(permutation_.per_expert, C);
    received_.resize(dispatcher_.rows_received() * C);
    dispatcher_.dispatch(std::span<const float>(rows), std::span<float>(received_));

    std::vector<float> out(received_.size());
    activations_.assign(local_experts() * ranks(), {});
    for_each_segment([&](std::size_t e, std::size_t source, std::size_t first, std::size_t n) {
      expert_forward(gemm_, weights.experts[e], C, shape_.ffn, received_.data() + first * C, n, out.data() + first * C,
                     activations_[e * ranks() + source]);
    });

    combined_.resize(rows.size());
    dispatcher_.combine(std::span<const float>(out), std::span<float>(combined_));
    std::fill(y.begin(), y.end(), 0.0f);
    scatter_add_rows(std::span<const float>(combined_), C, permutation_, std::span<const float>(routing_.weight), y);
    return {losses_.aux, losses_.z, permutation_.dropped};
  }

  /// dh [T, C] (overwritten) from dy [T, C]; gradients of the router and the local experts add
  /// into `grads`. Uses what the last forward kept.
  void backward(std::span<const float> dy, loss_gradients scale, const moe_tensors<const float>& weights,
                const moe_tensors<float>& grads, std::span<float> dh) {
    const std::size_t C = shape_.hidden, E = shape_.experts, K = shape_.top_k, T = routing_.tokens;
    if (dy.size() != T * C || dh.size() != T * C)
      fail(where() + ": backward got dy of " + std::to_string(dy.size()) + " and dh of " + std::to_string(dh.size()) +
           " elements; the last forward had " + std::to_string(T) + " tokens x " + std::to_string(C) + " = " +
           std::to_string(T * C));
    check_tensors(weights, "weights");
    check_tensors(grads, "gradients");

    // Each kept assignment a of token t: its row's gradient w_a · dy[t], and dL/dw_a = dy[t] · out_a.
    const std::size_t kept = permutation_.source.size();
    std::vector<float> d_rows(kept * C), d_weight(T * K, 0.0f);
    for (std::size_t i = 0; i < kept; ++i) {
      const std::size_t a = permutation_.source[i], t = a / K;
      const float w = routing_.weight[a];
      float dot = 0;
      for (std::size_t c = 0; c < C; ++c) {
        d_rows[i * C + c] = w * dy[t * C + c];
        dot += dy[t * C + c] * combined_[i * C + c];
      }
      d_weight[a] = dot;
    }

    std::vector<float> d_received(received_.size()), d_x(received_.size());
    dispatcher_.dispatch(std::span<const float>(d_rows), std::span<float>(d_received));
    for_each_segment([&](std::size_t e, std::size_t source, std::size_t first, std::size_t n) {
      expert_backward(gemm_, weights.experts[e], C, shape_.ffn, received_.data() + first * C, n,
                      activations_[e * ranks() + source], d_received.data() + first * C, d_x.data() + first * C,
                      grads.experts[e]);
    });
    std::vector<float> d_returned(kept * C);
    dispatcher_.combine(std::span<const float>(d_x), std::span<float>(d_returned));

    std::fill(dh.begin(), dh.end(), 0.0f);
    scatter_add_rows(std::span<const float>(d_returned), C, permutation_, std::span<const float>(), dh);
    std::vector<float> d_probs(T * E, 0.0f), d_logits(T * E, 0.0f);
    balance_backward(routing_, losses_, scale.aux, scale.z, d_probs, d_logits);
    route_backward(gemm_, routing_, std::span<const float>(input_), weights.router, d_weight, d_probs, d_logits, dh,
                   grads.router);
  }

 private:
  static const moe_shape& checked(const moe_shape& shape, communicator<B>& ep, const moe_options& options) {
    validate(shape, static_cast<std::size_t>(ep.size()), options, ep.name());
    return shape;
  }

  std::size_t ranks() { return static_cast<std::size_t>(ep_.get().size()); }

  std::string where() {
    communicator<B>& ep = ep_.get();
    return "weft::moe::moe_layer (group '" + ep.name() + "', rank " + std::to_string(ep.rank()) + " of " +
           std::to_string(ep.size()) + ")";
  }

  template <class F>
  void for_each_segment(F&& f) {
    for (std::size_t e = 0; e < local_experts(); ++e)
      for (std::size_t source = 0; source < ranks(); ++source) {
        const auto s = dispatcher_.received_segment(source, e);
        f(e, source, s.first, s.rows);
      }
  }

  void check_inputs(std::span<const float> h, std::size_t sequences, const moe_tensors<const float>& weights,
                    std::span<float> y) {
    const std::size_t C = shape_.hidden;
    if (h.size() % C != 0 || y.size() != h.size())
      fail(where() + ": h has " + std::to_string(h.size()) + " elements and y " + std::to_string(y.size()) +
           "; both must be [tokens, " + std::to_string(C) + "]");
    const std::size_t T = h.size() / C;
    if ((sequences == 0 && T != 0) || (sequences != 0 && T % sequences != 0))
      fail(where() + ": " + std::to_string(T) + " tokens do not split into " + std::to_string(sequences) +
           " sequences of equal length");
    check_tensors(weights, "weights");
  }

  template <class F>
  void check_tensors(const moe_tensors<F>& t, const char* what) {
    const std::size_t C = shape_.hidden, Fn = shape_.ffn;
    auto expect = [&](std::size_t have, std::size_t want, const std::string& name) {
      if (have != want)
        fail(where() + ": " + what + " " + name + " has " + std::to_string(have) + " elements, not " +
             std::to_string(want));
    };
    expect(t.router.size(), shape_.experts * C, "router [E, C]");
    if (t.experts.size() != local_experts())
      fail(where() + ": " + what + " hold " + std::to_string(t.experts.size()) + " experts; this rank owns " +
           std::to_string(local_experts()) + " (E / ep = " + std::to_string(shape_.experts) + " / " +
           std::to_string(ranks()) + ")");
    for (std::size_t e = 0; e < t.experts.size(); ++e) {
      const std::string n = "expert " + std::to_string(first_expert() + e) + " ";
      expect(t.experts[e].fc_weight.size(), C * Fn, n + "c_fc.weight [C, ffn]");
      expect(t.experts[e].fc_bias.size(), Fn, n + "c_fc.bias [ffn]");
      expect(t.experts[e].proj_weight.size(), Fn * C, n + "c_proj.weight [ffn, C]");
      expect(t.experts[e].proj_bias.size(), C, n + "c_proj.bias [C]");
    }
  }

  moe_shape shape_;
  moe_options options_;
  communicator_ref<B> ep_;
  std::vector<communicator_ref<B>> sequence_groups_;
  G gemm_;
  token_dispatcher<B> dispatcher_;
  // Kept from forward for backward.
  std::vector<float> input_;
  std::size_t sequences_ = 0;
  routing routing_;
  balance_losses losses_;
  token_permutation permutation_;
  std::vector<float> received_, combined_;
  std::vector<expert_activations> activations_;
};

}  // namespace weft::moe
