#pragma once
// One rank's part of GPT-2: the forward and backward of its model chunks for one micro-batch,
// with weft doing every exchange the layout needs.
//
//  - tensor parallelism (Megatron): c_attn and c_fc column-parallel, c_proj row-parallel, with
//    weft::tp's mappings around them: without sequence parallelism the residual stream is whole
//    on every tp rank (all-reduce after each row-parallel layer, and of the input gradient
//    before it); with it, each tp rank keeps a slice of the micro-batch's tokens, gathered
//    before a column-parallel layer and reduce-scattered after a row-parallel one.
//  - context parallelism: each cp rank holds 2 chunks of every sequence (weft::cp's load-balanced
//    causal split), and attention runs as weft::cp::ring_attention over the cp group with a BLAS
//    kernel (cpu_kernels.hpp); every other operation is per token.
//  - pipeline parallelism: this class computes one (micro-batch, chunk) at a time; the pipeline
//    executor (weft::pipeline) calls it in the schedule's order and moves the boundary tensors.
//
// Gradients are added into the spans the trainer gives (the synchronizer's buffer), so
// micro-batches accumulate there.

#include <algorithm>
#include <chrono>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/comm/communicator.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ring_attention.hpp>
#include <weft/tp/mappings.hpp>

#include "cpu_kernels.hpp"
#include "gpt_config.hpp"
#include "parameters.hpp"

namespace train_gpt {

/// One micro-batch's tokens as this rank sees them: `tokens` and `labels` are the rows this rank
/// computes at the ends of the model (with sequence parallelism, its slice), `positions` their
/// positions in the sequence.
struct micro_batch_tokens {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> labels;
  std::vector<std::int64_t> positions;
};

/// Time spent blocked in this rank's tp and cp exchanges (all of it is exposed: they sit between
/// the computations that need them).
struct exchange_time {
  double seconds = 0;
};

template <weft::backend B>
class gpt_model {
  using comm = weft::communicator<B>;
  using K = cpu_kernels;

 public:
  struct shape {
    gpt_config model;
    model_place place;
    bool sequence_parallel = false;
    int micro_batch = 1;  // sequences per micro-batch
    int cp = 1;
  };

  /// `params[i]` and `grads[i]` are this rank's local parts of `specs[i]` (rank_parameters order).
  gpt_model(shape s, std::vector<param_spec> specs, comm& tp, comm& cp)
      : s_(std::move(s)), specs_(std::move(specs)), tp_(tp), cp_(cp),
        split_{.seq = s_.model.seq, .cp = s_.cp, .kind = weft::cp::split_kind::load_balanced},
        attention_(cp, split_, {.heads = static_cast<std::size_t>(s_.model.heads / s_.place.tp),
                                .head_dim = static_cast<std::size_t>(s_.model.head_dim())}) {
    for (std::size_t i = 0; i < specs_.size(); ++i) index_[{specs_[i].chunk, specs_[i].layer, specs_[i].role}] = i;
    c_ = static_cast<std::size_t>(s_.model.hidden);
    t_ = static_cast<std::size_t>(s_.model.seq / s_.cp);
    n_ = static_cast<std::size_t>(s_.micro_batch) * t_;
    tp_size_ = static_cast<std::size_t>(s_.place.tp);
    rows_ = sp() ? n_ / tp_size_ : n_;
    cl_ = c_ / tp_size_;
  }

  void bind(std::vector<std::span<float>> params, std::vector<std::span<float>> grads) {
    params_ = std::move(params);
    grads_ = std::move(grads);
  }

  /// Elements of the tensor between two pipeline stages (per micro-batch).
  std::size_t boundary_elements() const noexcept { return rows_ * c_; }
  /// Global positions of this cp rank's tokens within a sequence.
  std::vector<std::int64_t> sequence_positions() const { return weft::cp::positions(split_, cp_.rank()); }
  const weft::cp::sequence_split& split() const noexcept { return split_; }
  /// Rows of the micro-batch this rank computes at the model's ends, out of all its cp rank's
  /// tokens (micro_batch x seq / cp): all of them, or its sequence-parallel slice.
  std::pair<std::size_t, std::size_t> row_range() const noexcept {
    return sp() ? std::pair{static_cast<std::size_t>(tp_.rank()) * rows_, rows_} : std::pair{std::size_t{0}, rows_};
  }
  double exchange_seconds() const noexcept { return exchange_.seconds; }
  /// Gradient groups backward finishes one after another: a layer's parameters (group = its
  /// index), the head's final norm, the embeddings.
  static constexpr int head_group = -2, embedding_group = -1;
  /// Called during backward as soon as a group's gradients for this micro-batch are added, so
  /// that their reduction can start while the rest of backward runs.
  void on_gradients_added(std::function<void(int chunk, int group)> f) { on_ready_ = std::move(f); }
  /// Called with each tp exchange's name and times (for the timeline).
  void on_exchange(std::function<void(const char*, std::chrono::steady_clock::time_point,
                                      std::chrono::steady_clock::time_point)> f) {
    on_exchange_ = std::move(f);
  }
  void reset_exchange_seconds() noexcept { exchange_.seconds = 0; }

  /// Forward of chunk `chunk` for micro-batch `mb`. On the first virtual stage `input` is empty
  /// and the tokens are embedded; on the last, `output` is empty and the loss is computed with
  /// `loss_scale` (1 / tokens of the global batch): the sum of this rank's rows' losses is
  /// returned (0 elsewhere).
  double forward(int mb, int chunk, const micro_batch_tokens& batch, std::span<const float> input,
                 std::span<float> output, float loss_scale) {
    activations& a = acts_[{mb, chunk}];
    const int first = s_.place.first_layer(s_.model, chunk);
    const int count = s_.place.layers_per_stage(s_.model);
    std::vector<float> x(rows_ * c_);
    if (s_.place.first_stage(chunk)) {
      K::embedding_forward(batch.tokens, batch.positions, param(chunk, -1, param_role::wte),
                           param(chunk, -1, param_role::wpe), x.data(), c_);
    } else {
      std::copy(input.begin(), input.end(), x.begin());
    }
    a.layers.resize(static_cast<std::size_t>(count));
    for (int i = 0; i < count; ++i) x = layer_forward(chunk, first + i, a.layers[static_cast<std::size_t>(i)], std::move(x));
    if (!s_.place.last_stage(chunk)) {
      std::copy(x.begin(), x.end(), output.begin());
      return 0;
    }
    // The head: final layer norm, logits through the tied embedding, cross-entropy.
    const std::size_t v = static_cast<std::size_t>(s_.model.vocab);
    a.head_in = std::move(x);
    a.head_ln.resize(rows_ * c_);
    a.head_mean.resize(rows_);
    a.head_rstd.resize(rows_);
    K::layernorm_forward(a.head_in.data(), param(chunk, -1, param_role::ln_f_w), param(chunk, -1, param_role::ln_f_b),
                         a.head_ln.data(), a.head_mean.data(), a.head_rstd.data(), rows_, c_);
    a.dlogits.resize(rows_ * v);
    K::logits_forward(a.head_ln.data(), head_wte(chunk), a.dlogits.data(), rows_, c_, v);
    return K::cross_entropy(a.dlogits.data(), batch.labels, v, loss_scale);
  }

  /// Backward of chunk `chunk` for micro-batch `mb`: adds the parameter gradients and writes the
  /// gradient of the chunk's input into `input_grad` (empty on the first virtual stage).
  void backward(int mb, int chunk, const micro_batch_tokens& batch, std::span<const float> output_grad,
                std::span<float> input_grad) {
    auto it = acts_.find({mb, chunk});
    activations& a = it->second;
    const int first = s_.place.first_layer(s_.model, chunk);
    const int count = s_.place.layers_per_stage(s_.model);
    std::vector<float> dx(rows_ * c_);
    if (s_.place.last_stage(chunk)) {
      const std::size_t v = static_cast<std::size_t>(s_.model.vocab);
      std::vector<float> dln(rows_ * c_);
      K::logits_backward(a.head_ln.data(), head_wte(chunk), a.dlogits.data(), dln.data(), head_wte_grad(chunk), rows_,
                         c_, v);
      std::fill(dx.begin(), dx.end(), 0.0f);
      K::layernorm_backward(a.head_in.data(), param(chunk, -1, param_role::ln_f_w), a.head_mean.data(),
                            a.head_rstd.data(), dln.data(), dx.data(), grad(chunk, -1, param_role::ln_f_w),
                            grad(chunk, -1, param_role::ln_f_b), rows_, c_);
    } else {
      std::copy(output_grad.begin(), output_grad.end(), dx.begin());
    }
    if (s_.place.last_stage(chunk) && on_ready_) on_ready_(chunk, head_group);
    for (int i = count; i-- > 0;) {
      dx = layer_backward(chunk, first + i, a.layers[static_cast<std::size_t>(i)], std::move(dx));
      if (on_ready_) on_ready_(chunk, first + i);
    }
    if (s_.place.first_stage(chunk)) {
      K::embedding_backward(batch.tokens, batch.positions, dx.data(), grad(chunk, -1, param_role::wte),
                            grad(chunk, -1, param_role::wpe), c_);
      if (on_ready_) on_ready_(chunk, embedding_group);
    } else {
      std::copy(dx.begin(), dx.end(), input_grad.begin());
    }
    acts_.erase(it);
  }

  /// Activation sets held now (micro-batches between forward and backward).
  std::size_t held() const noexcept { return acts_.size(); }

 private:
  struct layer_acts {
    std::vector<float> x, ln1, ln1_mean, ln1_rstd, ln1_full, q, k, v, attn, lse, x2, ln2, ln2_mean, ln2_rstd, ln2_full,
        fc, gelu;
  };
  struct activations {
    std::vector<layer_acts> layers;
    std::vector<float> head_in, head_ln, head_mean, head_rstd, dlogits;
  };
  struct key {
    int chunk, layer;
    param_role role;
    auto operator<=>(const key&) const = default;
  };

  bool sp() const noexcept { return s_.sequence_parallel && s_.place.tp > 1; }
  std::size_t at(int chunk, int layer, param_role role) const {
    auto it = index_.find({chunk, layer, role});
    if (it == index_.end())
      throw std::logic_error("train_gpt: no parameter for chunk " + std::to_string(chunk) + " layer " +
                             std::to_string(layer));
    return it->second;
  }
  float* param(int chunk, int layer, param_role role) { return params_[at(chunk, layer, role)].data(); }
  float* grad(int chunk, int layer, param_role role) { return grads_[at(chunk, layer, role)].data(); }
  // The output layer's embedding: the rank's own copy on the last stage (the input's with pp = 1).
  int wte_chunk(int chunk) const { return s_.place.pp > 1 ? chunk : 0; }
  float* head_wte(int chunk) { return param(wte_chunk(chunk), -1, param_role::wte); }
  float* head_wte_grad(int chunk) { return grad(wte_chunk(chunk), -1, param_role::wte); }

  template <class F>
  void exchange(const char* name, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    exchange_.seconds += std::chrono::duration<double>(t1 - t0).count();
    if (on_exchange_) on_exchange_(name, t0, t1);
  }

  /// The whole micro-batch's rows for a column-parallel layer: gathered with sequence
  /// parallelism, the rank's own rows otherwise.
  std::vector<float> to_column_input(const std::vector<float>& local) {
    if (!sp()) return local;
    std::vector<float> full(n_ * c_);
    exchange("tp all-gather (sequence)", [&] {
      weft::tp::all_gather_sequence<B, float>(tp_, {std::span<const float>(local), {rows_, c_}}, std::span<float>(full));
    });
    return full;
  }
  /// The gradient of a column-parallel layer's input back to the rank's rows: reduce-scattered
  /// with sequence parallelism, all-reduced without it (copy_to_tp_region's backward).
  std::vector<float> from_column_input_grad(std::vector<float> full) {
    if (tp_size_ == 1) return full;
    if (!sp()) {
      exchange("tp all-reduce (input gradient)", [&] { weft::tp::copy_to_tp_region_backward<B, float>(tp_, std::span<float>(full)); });
      return full;
    }
    std::vector<float> local(rows_ * c_);
    exchange("tp reduce-scatter (input gradient)", [&] {
      weft::tp::all_gather_sequence_backward<B, float>(tp_, {std::span<const float>(full), {n_, c_}},
                                                       std::span<float>(local));
    });
    return local;
  }
  /// A row-parallel layer's partial output summed over tp, onto the rank's rows.
  std::vector<float> from_row_output(std::vector<float> partial) {
    if (tp_size_ == 1) return partial;
    if (!sp()) {
      exchange("tp all-reduce (output)", [&] { weft::tp::reduce_from_tp_region<B, float>(tp_, std::span<float>(partial)); });
      return partial;
    }
    std::vector<float> local(rows_ * c_);
    exchange("tp reduce-scatter (sequence)", [&] {
      weft::tp::reduce_scatter_sequence<B, float>(tp_, {std::span<const float>(partial), {n_, c_}},
                                                  std::span<float>(local));
    });
    return local;
  }
  /// The gradient of a row-parallel layer's output on all the micro-batch's rows.
  std::vector<float> to_row_output_grad(const std::vector<float>& local) {
    if (!sp()) return local;
    std::vector<float> full(n_ * c_);
    exchange("tp all-gather (output gradient)", [&] {
      weft::tp::reduce_scatter_sequence_backward<B, float>(tp_, {std::span<const float>(local), {rows_, c_}},
                                                           std::span<float>(full));
    });
    return full;
  }

  std::vector<float> layer_forward(int chunk, int layer, layer_acts& a, std::vector<float> x) {
    const std::size_t c = c_, cl = cl_, n = n_, rows = rows_;
    a.x = std::move(x);
    a.ln1.resize(rows * c);
    a.ln1_mean.resize(rows);
    a.ln1_rstd.resize(rows);
    K::layernorm_forward(a.x.data(), param(chunk, layer, param_role::ln_1_w), param(chunk, layer, param_role::ln_1_b),
                         a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), rows, c);
    a.ln1_full = to_column_input(a.ln1);
    // qkv: [n, 3 cl] as q | k | v, each [n, heads/tp, head_dim].
    std::vector<float> qkv(n * 3 * cl);
    const float* wqkv = param(chunk, layer, param_role::attn_w);
    K::linear_forward(a.ln1_full.data(), wqkv, {param(chunk, layer, param_role::attn_b), 3 * cl}, qkv.data(), n, c,
                      3 * cl);
    a.q.resize(n * cl);
    a.k.resize(n * cl);
    a.v.resize(n * cl);
    for (std::size_t i = 0; i < n; ++i) {
      std::copy_n(qkv.data() + i * 3 * cl, cl, a.q.data() + i * cl);
      std::copy_n(qkv.data() + i * 3 * cl + cl, cl, a.k.data() + i * cl);
      std::copy_n(qkv.data() + i * 3 * cl + 2 * cl, cl, a.v.data() + i * cl);
    }
    a.attn.resize(n * cl);
    const std::size_t heads = static_cast<std::size_t>(s_.model.heads) / tp_size_;
    a.lse.resize(n * heads);
    for (std::size_t b = 0; b < static_cast<std::size_t>(s_.micro_batch); ++b) {
      const std::size_t o = b * t_ * cl;
      auto run = [&] {
        attention_.template forward<float>(std::span<const float>(a.q).subspan(o, t_ * cl),
                                           std::span<const float>(a.k).subspan(o, t_ * cl),
                                           std::span<const float>(a.v).subspan(o, t_ * cl),
                                           std::span<float>(a.attn).subspan(o, t_ * cl),
                                           std::span<float>(a.lse).subspan(b * t_ * heads, t_ * heads));
      };
      run();
    }
    std::vector<float> proj(n * c);
    K::linear_forward(a.attn.data(), param(chunk, layer, param_role::attn_proj_w), {}, proj.data(), n, cl, c);
    std::vector<float> attn_out = from_row_output(std::move(proj));
    const float* bproj = param(chunk, layer, param_role::attn_proj_b);
    a.x2.resize(rows * c);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < c; ++j) a.x2[i * c + j] = a.x[i * c + j] + attn_out[i * c + j] + bproj[j];

    a.ln2.resize(rows * c);
    a.ln2_mean.resize(rows);
    a.ln2_rstd.resize(rows);
    K::layernorm_forward(a.x2.data(), param(chunk, layer, param_role::ln_2_w), param(chunk, layer, param_role::ln_2_b),
                         a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), rows, c);
    a.ln2_full = to_column_input(a.ln2);
    a.fc.resize(n * 4 * cl);
    K::linear_forward(a.ln2_full.data(), param(chunk, layer, param_role::fc_w), {param(chunk, layer, param_role::fc_b), 4 * cl},
                      a.fc.data(), n, c, 4 * cl);
    a.gelu.resize(n * 4 * cl);
    K::gelu_forward(a.fc.data(), a.gelu.data(), n * 4 * cl);
    std::vector<float> mlp(n * c);
    K::linear_forward(a.gelu.data(), param(chunk, layer, param_role::mlp_proj_w), {}, mlp.data(), n, 4 * cl, c);
    std::vector<float> mlp_out = from_row_output(std::move(mlp));
    const float* bmlp = param(chunk, layer, param_role::mlp_proj_b);
    std::vector<float> y(rows * c);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < c; ++j) y[i * c + j] = a.x2[i * c + j] + mlp_out[i * c + j] + bmlp[j];
    // Keep what backward reads; the rest goes now.
    if (!sp()) a.ln1_full.clear(), a.ln2_full.clear();
    return y;
  }

  std::vector<float> layer_backward(int chunk, int layer, layer_acts& a, std::vector<float> dy) {
    const std::size_t c = c_, cl = cl_, n = n_, rows = rows_;
    const std::vector<float>& ln1_full = sp() ? a.ln1_full : a.ln1;
    const std::vector<float>& ln2_full = sp() ? a.ln2_full : a.ln2;
    // MLP: y = x2 + c_proj(gelu(c_fc(ln_2(x2)))).
    float* dbmlp = grad(chunk, layer, param_role::mlp_proj_b);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < c; ++j) dbmlp[j] += dy[i * c + j];
    std::vector<float> dmlp = to_row_output_grad(dy);
    std::vector<float> dgelu(n * 4 * cl);
    K::linear_backward(a.gelu.data(), param(chunk, layer, param_role::mlp_proj_w), dmlp.data(), dgelu.data(),
                       grad(chunk, layer, param_role::mlp_proj_w), {}, n, 4 * cl, c);
    std::vector<float> dfc(n * 4 * cl);
    K::gelu_backward(a.fc.data(), dgelu.data(), dfc.data(), n * 4 * cl);
    std::vector<float> dln2_full(n * c);
    K::linear_backward(ln2_full.data(), param(chunk, layer, param_role::fc_w), dfc.data(), dln2_full.data(),
                       grad(chunk, layer, param_role::fc_w), {grad(chunk, layer, param_role::fc_b), 4 * cl}, n, c, 4 * cl);
    std::vector<float> dln2 = from_column_input_grad(std::move(dln2_full));
    std::vector<float> dx2 = std::move(dy);  // the residual's gradient, then the norm's added
    K::layernorm_backward(a.x2.data(), param(chunk, layer, param_role::ln_2_w), a.ln2_mean.data(), a.ln2_rstd.data(),
                          dln2.data(), dx2.data(), grad(chunk, layer, param_role::ln_2_w),
                          grad(chunk, layer, param_role::ln_2_b), rows, c);
    // Attention: x2 = x + c_proj(attention(c_attn(ln_1(x)))).
    float* dbproj = grad(chunk, layer, param_role::attn_proj_b);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < c; ++j) dbproj[j] += dx2[i * c + j];
    std::vector<float> dproj = to_row_output_grad(dx2);
    std::vector<float> dattn(n * cl);
    K::linear_backward(a.attn.data(), param(chunk, layer, param_role::attn_proj_w), dproj.data(), dattn.data(),
                       grad(chunk, layer, param_role::attn_proj_w), {}, n, cl, c);
    std::vector<float> dq(n * cl, 0.0f), dk(n * cl, 0.0f), dv(n * cl, 0.0f);
    const std::size_t heads = static_cast<std::size_t>(s_.model.heads) / tp_size_;
    for (std::size_t b = 0; b < static_cast<std::size_t>(s_.micro_batch); ++b) {
      const std::size_t o = b * t_ * cl, w = t_ * cl;
      attention_.template backward<float>(
          std::span<const float>(a.q).subspan(o, w), std::span<const float>(a.k).subspan(o, w),
          std::span<const float>(a.v).subspan(o, w), std::span<const float>(a.attn).subspan(o, w),
          std::span<const float>(a.lse).subspan(b * t_ * heads, t_ * heads), std::span<const float>(dattn).subspan(o, w),
          std::span<float>(dq).subspan(o, w), std::span<float>(dk).subspan(o, w), std::span<float>(dv).subspan(o, w));
    }
    std::vector<float> dqkv(n * 3 * cl);
    for (std::size_t i = 0; i < n; ++i) {
      std::copy_n(dq.data() + i * cl, cl, dqkv.data() + i * 3 * cl);
      std::copy_n(dk.data() + i * cl, cl, dqkv.data() + i * 3 * cl + cl);
      std::copy_n(dv.data() + i * cl, cl, dqkv.data() + i * 3 * cl + 2 * cl);
    }
    std::vector<float> dln1_full(n * c);
    K::linear_backward(ln1_full.data(), param(chunk, layer, param_role::attn_w), dqkv.data(), dln1_full.data(),
                       grad(chunk, layer, param_role::attn_w), {grad(chunk, layer, param_role::attn_b), 3 * cl}, n, c,
                       3 * cl);
    std::vector<float> dln1 = from_column_input_grad(std::move(dln1_full));
    std::vector<float> dx = std::move(dx2);
    K::layernorm_backward(a.x.data(), param(chunk, layer, param_role::ln_1_w), a.ln1_mean.data(), a.ln1_rstd.data(),
                          dln1.data(), dx.data(), grad(chunk, layer, param_role::ln_1_w),
                          grad(chunk, layer, param_role::ln_1_b), rows, c);
    return dx;
  }

  shape s_;
  std::vector<param_spec> specs_;
  comm& tp_;
  comm& cp_;
  weft::cp::sequence_split split_;
  weft::cp::ring_attention<B, blas_attention> attention_;
  std::map<key, std::size_t> index_;
  std::vector<std::span<float>> params_, grads_;
  std::map<std::pair<int, int>, activations> acts_;
  std::size_t c_ = 0, cl_ = 0, t_ = 0, n_ = 0, rows_ = 0, tp_size_ = 1;
  exchange_time exchange_;
  std::function<void(const char*, std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point)>
      on_exchange_;
  std::function<void(int, int)> on_ready_;
};

}  // namespace train_gpt
