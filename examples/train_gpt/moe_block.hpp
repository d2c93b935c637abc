#pragma once
// The mixture-of-experts MLP of train_gpt's MoE blocks (--moe-experts E --moe-every N): weft::moe's
// layer over the layout's ep group, in place of GPT-2's MLP in every block i with i % N == 0.
//
//  - The layer sees every row of the micro-batch (with sequence parallelism, ln_2's output after
//    its gather): the micro-batch's sequences whole on this cp rank's chunks, so the losses'
//    per-sequence sums are all-reduced over cp alone. Each tp rank routes and computes the same
//    rows (the experts are not split over tp; the ep group is the ranks of one tp coordinate,
//    Megatron-Core's expert grid with expert-tp = tp), so the output, the input gradient and the
//    router's and experts' gradients are whole on every tp rank: nothing is summed over tp.
//  - The router is a parameter of every rank of the stage, reduced over dp x cp like the other
//    replicated ones; each expert is a parameter of its ep rank alone (rank r holds experts
//    r * E / ep ..), whole, and its gradient (complete for every token routed to it from the ep
//    group) is summed over the expert data-parallel group, the ranks that hold the same experts.
//  - Each micro-batch's activation set holds its own layer state (what backward needs), so the
//    pipeline schedules keep several micro-batches in flight.

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/layout/layout.hpp>
#include <weft/moe/layer.hpp>

#include "blas_gemm.hpp"
#include "gpt_config.hpp"
#include "options.hpp"
#include "parameters.hpp"

namespace train_gpt {

/// weft::moe's products on OpenBLAS (the library's reference_gemm is plain loops).
using weft_programs::blas_gemm;

/// The MoE settings of a run (flags --moe-* and --ep).
struct moe_settings {
  int experts = 0;  ///< E; 0: a dense model
  int top_k = 2;
  int every = 1;
  double capacity_factor = 0;  ///< 0: dropless
  /// dL/daux and dL/dz of each sequence: the coefficients over the global batch's sequences.
  double aux_gradient = 0, z_gradient = 0;
};

/// The run's MoE settings: the flags', with the losses' gradients for a global batch of
/// `global_batch` sequences (loss = mean over them of CE + α Σ aux + β Σ z).
inline moe_settings moe_settings_of(const options& o, const gpt_config& m, int global_batch) {
  return {.experts = m.moe_experts,
          .top_k = m.moe_top_k,
          .every = m.moe_every,
          .capacity_factor = o.moe_capacity_factor,
          .aux_gradient = o.moe_aux_loss_coef / global_batch,
          .z_gradient = o.moe_z_loss_coef / global_batch};
}

/// What the MoE flags and the layout ask that cannot run, in one message; nullopt when they fit
/// (the ep degree against the ranks is weft::layout's check).
inline std::optional<std::string> moe_problem(const gpt_config& m, const weft::layout::layout_spec& d) {
  if (m.moe_experts == 0) {
    if (d.ep > 1)
      return "--ep " + std::to_string(d.ep) + " spreads the experts of MoE blocks over ranks, but the model has none: "
             "add --moe-experts E, or drop --ep";
    return std::nullopt;
  }
  const std::string E = std::to_string(m.moe_experts), K = std::to_string(m.moe_top_k), ep = std::to_string(d.ep);
  if (m.moe_top_k > m.moe_experts)
    return "--moe-top-k " + K + " is more than the " + E + " experts (--moe-experts): each token picks K different "
           "experts; choose K <= E";
  if (d.ep > 0 && m.moe_experts % d.ep != 0)
    return "--moe-experts " + E + " do not divide over --ep " + ep + ": each rank of the ep group computes E / ep "
           "experts; choose --moe-experts a multiple of --ep";
  try {  // anything else the library refuses
    weft::moe::validate({.hidden = static_cast<std::size_t>(m.hidden),
                         .ffn = 4 * static_cast<std::size_t>(m.hidden),
                         .experts = static_cast<std::size_t>(m.moe_experts),
                         .top_k = static_cast<std::size_t>(m.moe_top_k)},
                        static_cast<std::size_t>(d.ep), {}, "ep");
  } catch (const std::exception& e) {
    return "--moe-experts " + E + " --moe-top-k " + K + " --ep " + ep + ": " + e.what();
  }
  if (d.expert_tp != 0 && d.expert_tp != d.tp)
    return "train_gpt runs each expert whole on every tp rank (expert-tp = tp); another expert-tp is not supported";
  return std::nullopt;
}

/// The MoE part of the model's description in a distributed checkpoint ("" for a dense model).
inline std::string moe_description(const gpt_config& m) {
  if (m.moe_experts == 0) return "";
  return ", " + std::to_string(m.moe_experts) + " experts (top " + std::to_string(m.moe_top_k) + ") every " +
         std::to_string(m.moe_every) + " layers";
}

/// One rank's MoE MLPs: the layer state of each (activation set, layer) and the losses of the
/// step's sequences.
template <weft::backend B>
class moe_block {
 public:
  using layer_type = weft::moe::moe_layer<B, blas_gemm>;
  /// Fetches a parameter (or gradient) of a layer: (layer, role, expert) -> its span.
  template <class F>
  using lookup = std::function<std::span<F>(int layer, param_role role, int expert)>;

  moe_block(moe_settings s, std::size_t hidden, weft::communicator<B>* ep, weft::communicator<B>& cp)
      : s_(s), shape_{.hidden = hidden,
                      .ffn = 4 * hidden,
                      .experts = static_cast<std::size_t>(s.experts),
                      .top_k = static_cast<std::size_t>(s.top_k)},
        ep_(ep), cp_(cp) {}

  /// A micro-batch's layer state, kept in its activation set until backward.
  struct state {
    std::unique_ptr<layer_type> layer;
  };

  /// y [rows, C] from h [rows, C], rows = `sequences` whole sequences (this cp rank's chunks).
  /// With `count_losses`, the sequences' aux and z are added to the step's sums.
  void forward(state& st, int layer, std::span<const float> h, std::size_t sequences, const lookup<const float>& param,
               std::span<float> y, bool count_losses) {
    if (!st.layer) {
      std::vector<weft::communicator_ref<B>> sequence_groups;
      if (cp_.size() > 1) sequence_groups.push_back(cp_.ref());
      st.layer = std::make_unique<layer_type>(*ep_, shape_, weft::moe::moe_options{.capacity_factor = s_.capacity_factor},
                                              std::move(sequence_groups));
    }
    const weft::moe::moe_losses losses = st.layer->forward(h, sequences, tensors(*st.layer, layer, param), y);
    if (!count_losses) return;
    for (double v : losses.aux) aux_sum_ += v;
    for (double v : losses.z) z_sum_ += v;
  }

  /// dh [rows, C] (overwritten) from dy [rows, C]; the router's and the local experts' gradients
  /// are added through `grad`.
  void backward(state& st, int layer, std::span<const float> dy, const lookup<const float>& param,
                const lookup<float>& grad, std::span<float> dh) {
    st.layer->backward(dy, {.aux = s_.aux_gradient, .z = s_.z_gradient}, tensors(*st.layer, layer, param),
                       tensors(*st.layer, layer, grad), dh);
  }

  /// The sums of aux and z over this rank's sequences and MoE layers since the last take.
  std::pair<double, double> take_losses() noexcept {
    const std::pair<double, double> out{aux_sum_, z_sum_};
    aux_sum_ = z_sum_ = 0;
    return out;
  }

 private:
  template <class F>
  weft::moe::moe_tensors<F> tensors(const layer_type& l, int layer, const lookup<F>& get) const {
    weft::moe::moe_tensors<F> t{get(layer, param_role::router_w, -1), {}};
    for (std::size_t e = 0; e < l.local_experts(); ++e) {
      const int g = static_cast<int>(l.first_expert() + e);
      t.experts.push_back({get(layer, param_role::expert_fc_w, g), get(layer, param_role::expert_fc_b, g),
                           get(layer, param_role::expert_proj_w, g), get(layer, param_role::expert_proj_b, g)});
    }
    return t;
  }

  moe_settings s_;
  weft::moe::moe_shape shape_;
  weft::communicator<B>* ep_;
  weft::communicator<B>& cp_;
  double aux_sum_ = 0, z_sum_ = 0;
};

}  // namespace train_gpt
