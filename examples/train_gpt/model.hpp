#pragma once
// One rank's part of GPT-2: the forward and backward of its model chunks for one micro-batch,
// with weft doing every exchange the layout needs.
//
//  - tensor parallelism (Megatron): c_attn and c_fc column-parallel, c_proj row-parallel, with
//    weft::tp's mappings around them: without sequence parallelism the residual stream is whole
//    on every tp rank (all-reduce after each row-parallel layer, and of the input gradient
//    before it); with it, each tp rank keeps a slice of the micro-batch's tokens, gathered
//    before a column-parallel layer and reduce-scattered after a row-parallel one.
//  - vocabulary parallelism (Megatron's VocabParallelEmbedding and vocab-parallel
//    cross-entropy): each tp rank holds a block of the (padded) vocabulary's rows of the tied
//    embedding. The embedding is each rank's lookup of the tokens in its block, summed over tp;
//    the output layer computes each rank's columns of the logits, and weft::tp's
//    vocab_parallel_cross_entropy reduces the row maxima and sums over tp: no rank holds a full
//    row of logits.
//  - the loss never keeps [tokens x vocabulary] logits: forward computes the logits a chunk of
//    rows at a time, turns each chunk into its gradient at once (llm.c's fused classifier, Liger's
//    fused linear cross-entropy) and adds the output layer's weight and input gradients from it,
//    so only the [tokens x hidden] input gradient lives until backward.
//  - context parallelism: each cp rank holds 2 chunks of every sequence (weft::cp's load-balanced
//    causal split), and attention runs as weft::cp::ring_attention over the cp group with a BLAS
//    kernel (cpu_kernels.hpp); every other operation is per token.
//  - pipeline parallelism: this class computes one (micro-batch, chunk) at a time; the pipeline
//    executor (weft::pipeline) calls it in the schedule's order and moves the boundary tensors.
//
// Activation recomputation (Korthikanti et al. 2022), `shape::recompute`: selective drops each
// layer's attention core output (attention and its log-sum-exp) after forward and recomputes it
// from q, k, v in backward; full keeps only each layer's input and reruns the layer's forward
// (with its tp and cp exchanges) in backward. The recomputation runs the same code on the same
// inputs, so gradients equal those without it bit for bit. With either, backward adds each
// layer's parameter gradients right after its input gradient and frees the layer's activations,
// so one layer's activations at a time are rebuilt (`weight` then adds only the embeddings').
//
// Backward comes in two parts, as zero-bubble schedules (ZB-H1) want them: `backward` computes
// the gradient of the chunk's input (what the previous stage waits for) and keeps what the
// parameter gradients need; `weight` adds the parameter gradients. Other schedules call both in
// a row. Gradients are added into the spans the trainer gives (the synchronizer's buffer), so
// micro-batches accumulate there.
//
// With fully sharded data parallelism a parameter exists only while its unit is gathered: the
// model announces each parameter group's use (`on_scope`: enter and leave, forward and backward),
// and the trainer binds the group's parameters and gradients for that time. Backward then
// computes each group's input and parameter gradients together (`weight` only releases), since a
// group's gathered parameters and gradient buffer exist only inside its scope. Activation sets are pooled and reused across micro-batches and
// steps, so a step allocates nothing once the pool has grown to the schedule's peak.

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
#include <weft/tp/vocab_parallel.hpp>
#include <weft/tune/layout.hpp>

#include "cpu_kernels.hpp"
#include "gpt_config.hpp"
#include "moe_block.hpp"
#include "parameters.hpp"

namespace train_gpt {

/// One micro-batch's tokens as this rank sees them: `tokens` and `labels` are the rows this rank
/// computes at the ends of the model (with sequence parallelism, its slice), `positions` their
/// positions in the sequence. `all_tokens` and `all_labels` are every row of the cp rank's
/// micro-batch (every tp rank's slice): what the vocab-parallel embedding and loss see.
struct micro_batch_tokens {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> labels;
  std::vector<std::int64_t> positions;
  std::vector<std::int32_t> all_tokens;
  std::vector<std::int32_t> all_labels;
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
    weft::tune::recompute recompute = weft::tune::recompute::none;
    moe_settings moe;  // with moe.experts > 0: the MoE blocks' (model.moe_layer)
  };

  /// `params[i]` and `grads[i]` are this rank's local parts of `specs[i]` (rank_parameters order).
  /// `ep`: the expert-parallel group, for a model with MoE blocks.
  gpt_model(shape s, std::vector<param_spec> specs, comm& tp, comm& cp, comm* ep = nullptr)
      : s_(std::move(s)), specs_(std::move(specs)), tp_(tp), cp_(cp),
        split_{.seq = s_.model.seq, .cp = s_.cp, .kind = weft::cp::split_kind::load_balanced},
        attention_(cp, split_, {.heads = static_cast<std::size_t>(s_.model.heads / s_.place.tp),
                                .head_dim = static_cast<std::size_t>(s_.model.head_dim())}),
        moe_(s_.moe, static_cast<std::size_t>(s_.model.hidden), ep, cp) {
    for (std::size_t i = 0; i < specs_.size(); ++i)
      index_[{specs_[i].chunk, specs_[i].layer, specs_[i].role, specs_[i].expert}] = i;
    c_ = static_cast<std::size_t>(s_.model.hidden);
    t_ = static_cast<std::size_t>(s_.model.seq / s_.cp);
    n_ = static_cast<std::size_t>(s_.micro_batch) * t_;
    tp_size_ = static_cast<std::size_t>(s_.place.tp);
    rows_ = sp() ? n_ / tp_size_ : n_;
    cl_ = c_ / tp_size_;
    vocab_ = vocab_partition_of(s_.model, s_.place);
  }

  void bind(std::vector<std::span<float>> params, std::vector<std::span<float>> grads) {
    params_.assign(params.begin(), params.end());
    grads_ = std::move(grads);
  }
  /// Points parameter i (rank_parameters order) and, in backward, its gradient elsewhere: for
  /// parameters that live only inside a scope.
  void bind_param(std::size_t i, std::span<const float> value) { params_.at(i) = value; }
  void bind_grad(std::size_t i, std::span<float> grad) { grads_.at(i) = grad; }

  using scope_event = train_gpt::scope_event;
  /// Called around each parameter group's use (group: a layer's index, head_group, embedding_group),
  /// in forward and in backward order. Setting it makes backward compute each group's parameter
  /// gradients inside its scope.
  void on_scope(std::function<void(int group, scope_event)> f) {
    on_scope_ = std::move(f);
    params_.resize(specs_.size());
    grads_.resize(specs_.size());
  }

  /// Elements of the tensor between two pipeline stages (per micro-batch).
  std::size_t boundary_elements() const noexcept { return rows_ * c_; }
  /// Global positions of this cp rank's tokens within a sequence.
  std::vector<std::int64_t> sequence_positions() const { return weft::cp::positions(split_, cp_.rank()); }
  /// Rows of the micro-batch this rank computes at the model's ends, out of all its cp rank's
  /// tokens (micro_batch x seq / cp): all of them, or its sequence-parallel slice.
  std::pair<std::size_t, std::size_t> row_range() const noexcept {
    return sp() ? std::pair{static_cast<std::size_t>(tp_.rank()) * rows_, rows_} : std::pair{std::size_t{0}, rows_};
  }
  /// Time blocked in this rank's tp exchanges since the last reset (all exposed: they sit between
  /// the computations that need them).
  double exchange_seconds() const noexcept { return exchange_seconds_; }
  /// Gradient groups backward finishes one after another: a layer's parameters (group = its
  /// index), the head's final norm, the embeddings.
  static constexpr int head_group = train_gpt::head_group, embedding_group = train_gpt::embedding_group;
  /// Called during `weight` as soon as a group's gradients for this micro-batch are added, so
  /// that their reduction can start while the rest of backward runs.
  void on_gradients_added(std::function<void(int chunk, int group)> f) { on_ready_ = std::move(f); }
  /// Called with each tp exchange's name and times (for the timeline).
  void on_exchange(std::function<void(const char*, std::chrono::steady_clock::time_point,
                                      std::chrono::steady_clock::time_point)> f) {
    on_exchange_ = std::move(f);
  }
  void reset_exchange_seconds() noexcept { exchange_seconds_ = 0; }
  /// The sums of the MoE blocks' aux and z losses over the sequences this rank counts (tp and cp
  /// rank 0: the others hold the same sequences) since the last call.
  std::pair<double, double> take_moe_losses() noexcept { return moe_.take_losses(); }

  /// Forward of chunk `chunk` for micro-batch `mb`. On the first virtual stage `input` is empty
  /// and the tokens are embedded; on the last, `output` is empty and the loss is computed with
  /// `loss_scale` (1 / tokens of the global batch): the sum of this rank's rows' losses is
  /// returned (0 elsewhere).
  /// `with_gradients` false: a forward pass with no backward (validation), whose loss must not
  /// add the output layer's gradients (the fused head computes them in forward).
  double forward(int mb, int chunk, const micro_batch_tokens& batch, std::span<const float> input,
                 std::span<float> output, float loss_scale, bool with_gradients = true) {
    activations& a = acquire(mb, chunk);
    a.batch = &batch;
    count_moe_losses_ = with_gradients && tp_.rank() == 0 && cp_.rank() == 0;
    const int first = s_.place.first_layer(s_.model, chunk);
    const int count = s_.place.layers_per_stage(s_.model);
    std::vector<float>& x = a.stream;  // the residual stream, layer to layer
    x.resize(rows_ * c_);
    if (s_.place.first_stage(chunk)) {
      scope(embedding_group, scope_event::enter_forward);
      embedding_forward(chunk, batch, x);
      scope(embedding_group, scope_event::leave_forward);
    } else {
      std::copy(input.begin(), input.end(), x.begin());
    }
    a.layers.resize(static_cast<std::size_t>(count));
    for (int i = 0; i < count; ++i) {
      layer_acts& acts = a.layers[static_cast<std::size_t>(i)];
      scope(first + i, scope_event::enter_forward);
      layer_forward(chunk, first + i, acts, x);
      scope(first + i, scope_event::leave_forward);
      if (s_.recompute == weft::tune::recompute::selective) free_vectors(acts.attn, acts.lse);
      if (s_.recompute == weft::tune::recompute::full) free_layer(acts, true);
    }
    if (!s_.place.last_stage(chunk)) {
      std::copy(x.begin(), x.end(), output.begin());
      return 0;
    }
    // The head: final layer norm, then the fused vocab-parallel output layer and loss.
    a.head_in.swap(x);
    scope(head_group, scope_event::enter_forward);
    const double loss = head_forward(a, chunk, batch, loss_scale, with_gradients);
    scope(head_group, scope_event::leave_forward);
    return loss;
  }

  /// Drops (mb, chunk)'s activations after a forward pass that has no backward (validation).
  void discard(int mb, int chunk) {
    held_set(mb, chunk);
    release(mb, chunk);
  }

  /// The input part of backward for (mb, chunk): writes the gradient of the chunk's input into
  /// `input_grad` (empty on the first virtual stage) and keeps what `weight` needs.
  void backward(int mb, int chunk, std::span<const float> output_grad, std::span<float> input_grad) {
    activations& a = held_set(mb, chunk);
    count_moe_losses_ = false;  // a full recomputation's forward adds no loss
    const int first = s_.place.first_layer(s_.model, chunk);
    const int count = s_.place.layers_per_stage(s_.model);
    std::vector<float>& dx = a.stream;
    dx.resize(rows_ * c_);
    if (s_.place.last_stage(chunk)) {
      scope(head_group, scope_event::enter_backward);
      // The output layer's input gradient (forward computed each tp rank's part): summed over tp.
      column_input_grad(a.head_dh, a.head_dln);
      std::fill(dx.begin(), dx.end(), 0.0f);
      K::layernorm_backward_input(a.head_in.data(), param(chunk, -1, param_role::ln_f_w), a.head_mean.data(),
                                  a.head_rstd.data(), a.head_dln.data(), dx.data(), rows_, c_);
      if (scoped() || recomputing()) head_backward_weight(a, chunk);
      if (recomputing() && !scoped() && on_ready_) on_ready_(chunk, head_group);
      scope(head_group, scope_event::leave_backward);
    } else {
      std::copy(output_grad.begin(), output_grad.end(), dx.begin());
    }
    for (int i = count; i-- > 0;) {
      layer_acts& acts = a.layers[static_cast<std::size_t>(i)];
      scope(first + i, scope_event::enter_backward);
      if (s_.recompute == weft::tune::recompute::full) {
        std::vector<float>& out = scratch_.recomputed_output;
        out = acts.x;
        layer_forward(chunk, first + i, acts, out);
      } else if (s_.recompute == weft::tune::recompute::selective) {
        attention_forward(acts);
      }
      layer_backward_input(chunk, first + i, acts, dx);
      if (scoped() || recomputing()) layer_backward_weight(chunk, first + i, acts);
      scope(first + i, scope_event::leave_backward);
      if (recomputing()) {
        if (!scoped() && on_ready_) on_ready_(chunk, first + i);
        free_layer(acts, false);
      }
    }
    if (!s_.place.first_stage(chunk)) std::copy(dx.begin(), dx.end(), input_grad.begin());
    a.input_done = true;
    if (s_.place.first_stage(chunk)) {
      // The embedding's output gradient on every row of the micro-batch (what each rank's
      // vocabulary block needs): gathered with sequence parallelism, a.stream itself without.
      row_output_grad(a.stream, a.embedding_grad_full);
      if (scoped()) {
        scope(embedding_group, scope_event::enter_backward);
        embedding_backward(chunk, *a.batch, a);
        scope(embedding_group, scope_event::leave_backward);
      }
    }
  }

  /// The parameter part of backward for (mb, chunk), after `backward`: adds every parameter
  /// gradient of the chunk, group by group, then returns the activation set to the pool.
  void weight(int mb, int chunk, const micro_batch_tokens& batch) {
    activations& a = held_set(mb, chunk);
    if (!a.input_done) throw std::logic_error("train_gpt: weight() before backward() for a micro-batch");
    if (scoped()) {  // backward added every parameter gradient inside its group's scope
      release(mb, chunk);
      return;
    }
    const int first = s_.place.first_layer(s_.model, chunk);
    const int count = recomputing() ? 0 : s_.place.layers_per_stage(s_.model);  // recomputing: added in backward
    if (s_.place.last_stage(chunk) && !recomputing()) {
      head_backward_weight(a, chunk);
      if (on_ready_) on_ready_(chunk, head_group);
    }
    for (int i = count; i-- > 0;) {
      layer_backward_weight(chunk, first + i, a.layers[static_cast<std::size_t>(i)]);
      if (on_ready_) on_ready_(chunk, first + i);
    }
    if (s_.place.first_stage(chunk)) {
      // a.stream holds the gradient of the embeddings' output (backward left it there).
      embedding_backward(chunk, batch, a);
      if (on_ready_) on_ready_(chunk, embedding_group);
    }
    release(mb, chunk);
  }


 private:
  struct layer_acts {
    // forward
    std::vector<float> x, ln1, ln1_mean, ln1_rstd, ln1_full, q, k, v, attn, lse, x2, ln2, ln2_mean, ln2_rstd, ln2_full,
        fc, gelu;
    // backward's input part, kept for the parameter part (the *_full ones with sequence parallelism)
    std::vector<float> dy, dmlp_full, dfc, dln2, dx2, dproj_full, dqkv, dln1;
    typename moe_block<B>::state moe;  // an MoE block's layer state
  };
  struct activations {
    std::vector<layer_acts> layers;
    // head_dh: the output layer's input gradient, this tp rank's part (all the micro-batch's rows);
    // embedding_grad_full: with sequence parallelism, the embedding's output gradient gathered.
    std::vector<float> stream, head_in, head_ln, head_mean, head_rstd, head_ln_full, head_dh, head_dln,
        embedding_grad_full;
    const micro_batch_tokens* batch = nullptr;  // the forward's tokens (alive until weight())
    bool input_done = false;
  };
  /// Per-call temporaries, reused (one micro-batch computes at a time).
  struct scratch {
    std::vector<float> qkv, proj, mlp, dgelu, dattn, dq, dk, dv, dcol, dcol_local, row_local, recomputed_output;
  };
  struct key {
    int chunk, layer;
    param_role role;
    int expert;
    auto operator<=>(const key&) const = default;
  };

  activations& acquire(int mb, int chunk) {
    std::unique_ptr<activations> set;
    if (!pool_.empty()) {
      set = std::move(pool_.back());
      pool_.pop_back();
    } else {
      set = std::make_unique<activations>();
    }
    set->input_done = false;
    auto [it, fresh] = live_.emplace(std::pair{mb, chunk}, std::move(set));
    if (!fresh) throw std::logic_error("train_gpt: forward twice for micro-batch " + std::to_string(mb));
    return *it->second;
  }
  activations& held_set(int mb, int chunk) {
    auto it = live_.find({mb, chunk});
    if (it == live_.end())
      throw std::logic_error("train_gpt: backward for micro-batch " + std::to_string(mb) + " chunk " +
                             std::to_string(chunk) + " without its forward");
    return *it->second;
  }
  void release(int mb, int chunk) {
    auto it = live_.find({mb, chunk});
    pool_.push_back(std::move(it->second));
    live_.erase(it);
  }

  bool sp() const noexcept { return s_.sequence_parallel && s_.place.tp > 1; }
  bool recomputing() const noexcept { return s_.recompute != weft::tune::recompute::none; }
  /// Frees vectors' memory (clear() would keep it: activation sets are pooled).
  template <class... V>
  static void free_vectors(V&... v) {
    (std::vector<float>().swap(v), ...);
  }
  /// Frees a layer's activations: all of them, or all but its input (`keep_input`, full recomputation).
  static void free_layer(layer_acts& a, bool keep_input) {
    if (!keep_input) free_vectors(a.x);
    free_vectors(a.ln1, a.ln1_mean, a.ln1_rstd, a.ln1_full, a.q, a.k, a.v, a.attn, a.lse, a.x2, a.ln2, a.ln2_mean,
                 a.ln2_rstd, a.ln2_full, a.fc, a.gelu, a.dy, a.dmlp_full, a.dfc, a.dln2, a.dx2, a.dproj_full, a.dqkv,
                 a.dln1);
  }
  bool scoped() const noexcept { return static_cast<bool>(on_scope_); }
  void scope(int group, scope_event e) {
    if (on_scope_) on_scope_(group, e);
  }
  void head_backward_weight(activations& a, int chunk) {
    if (scoped()) {  // the output layer's weight gradient, which forward computed outside the scope
      float* g = head_wte_grad(chunk);
      for (std::size_t i = 0; i < pending_wte_grad_.size(); ++i) g[i] += pending_wte_grad_[i];
      pending_wte_grad_.clear();
    }
    K::layernorm_backward_params(a.head_in.data(), a.head_mean.data(), a.head_rstd.data(), a.head_dln.data(),
                                 grad(chunk, -1, param_role::ln_f_w), grad(chunk, -1, param_role::ln_f_b), rows_, c_);
  }
  std::size_t at(int chunk, int layer, param_role role, int expert = -1) const {
    auto it = index_.find({chunk, layer, role, expert});
    if (it == index_.end())
      throw std::logic_error("train_gpt: no parameter for chunk " + std::to_string(chunk) + " layer " +
                             std::to_string(layer));
    return it->second;
  }
  const float* param(int chunk, int layer, param_role role) { return params_[at(chunk, layer, role)].data(); }
  float* grad(int chunk, int layer, param_role role) { return grads_[at(chunk, layer, role)].data(); }
  // The output layer's embedding: the rank's own copy on the last stage (the input's with pp = 1).
  int wte_chunk(int chunk) const { return s_.place.pp > 1 ? chunk : 0; }
  const float* head_wte(int chunk) { return param(wte_chunk(chunk), -1, param_role::wte); }
  float* head_wte_grad(int chunk) { return grad(wte_chunk(chunk), -1, param_role::wte); }

  /// The embedding of the rank's rows into `x`: each tp rank looks up the tokens of its
  /// vocabulary block (zeros for the others) on every row of the micro-batch, the sum over tp
  /// (reduce_from_tp_region, or reduce-scatter onto the rank's rows with sequence parallelism) is
  /// the token embedding, and the position embedding is added.
  void embedding_forward(int chunk, const micro_batch_tokens& batch, std::vector<float>& x) {
    const float* wte = param(chunk, -1, param_role::wte);
    const float* wpe = param(chunk, -1, param_role::wpe);
    if (tp_size_ == 1) {
      K::embedding_forward(batch.tokens, batch.positions, wte, wpe, x.data(), c_);
      return;
    }
    std::vector<float>& partial = scratch_.proj;
    partial.assign(n_ * c_, 0.0f);
    for (std::size_t t = 0; t < n_; ++t)
      if (vocab_.owns(batch.all_tokens[t]))
        std::copy_n(wte + (static_cast<std::size_t>(batch.all_tokens[t]) - vocab_.first()) * c_, c_,
                    partial.data() + t * c_);
    const std::vector<float>& tokens = row_output(partial, scratch_.row_local);
    for (std::size_t t = 0; t < rows_; ++t) {
      const float* p = wpe + static_cast<std::size_t>(batch.positions[t]) * c_;
      for (std::size_t j = 0; j < c_; ++j) x[t * c_ + j] = tokens[t * c_ + j] + p[j];
    }
  }
  /// The embeddings' gradients from their output's (a.stream: the rank's rows; with sequence
  /// parallelism a.embedding_grad_full: all rows): the positions' from the rank's rows, each
  /// vocabulary row's from every row of the micro-batch whose token is in the rank's block.
  void embedding_backward(int chunk, const micro_batch_tokens& batch, const activations& a) {
    float* dwte = grad(chunk, -1, param_role::wte);
    float* dwpe = grad(chunk, -1, param_role::wpe);
    if (tp_size_ == 1) {
      K::embedding_backward(batch.tokens, batch.positions, a.stream.data(), dwte, dwpe, c_);
      return;
    }
    for (std::size_t t = 0; t < rows_; ++t) {
      float* p = dwpe + static_cast<std::size_t>(batch.positions[t]) * c_;
      for (std::size_t j = 0; j < c_; ++j) p[j] += a.stream[t * c_ + j];
    }
    const std::vector<float>& all = sp() ? a.embedding_grad_full : a.stream;
    for (std::size_t t = 0; t < n_; ++t)
      if (vocab_.owns(batch.all_tokens[t])) {
        float* e = dwte + (static_cast<std::size_t>(batch.all_tokens[t]) - vocab_.first()) * c_;
        for (std::size_t j = 0; j < c_; ++j) e[j] += all[t * c_ + j];
      }
  }

  /// The final layer norm, the output layer (this rank's vocabulary columns) and the loss, a
  /// chunk of rows at a time: each chunk's logits become their gradient at once, which gives the
  /// output layer's input gradient (a.head_dh, this rank's part) and adds its weight gradient.
  /// Returns the sum of the losses of the rank's rows.
  double head_forward(activations& a, int chunk, const micro_batch_tokens& batch, float loss_scale,
                      bool with_gradients) {
    a.head_ln.resize(rows_ * c_);
    a.head_mean.resize(rows_);
    a.head_rstd.resize(rows_);
    const std::vector<float>& h =
        column_input_norm(a.head_in, param(chunk, -1, param_role::ln_f_w), param(chunk, -1, param_role::ln_f_b),
                          a.head_ln, a.head_mean, a.head_rstd, a.head_ln_full);
    const float* wte = head_wte(chunk);
    const std::size_t cols = vocab_.real_rows();
    float* dwte = with_gradients ? head_wte_grad_target(chunk, cols) : nullptr;
    a.head_dh.resize(n_ * c_);
    row_losses_.resize(n_);
    // Rows per chunk from the padded block (the same on every tp rank, so their collectives pair up).
    const std::size_t chunk_rows = std::clamp<std::size_t>(logits_chunk_elements / vocab_.per_rank, 1, n_);
    for (std::size_t r0 = 0; r0 < n_; r0 += chunk_rows) {
      const std::size_t k = std::min(chunk_rows, n_ - r0);
      logits_.resize(k * cols);
      if (cols > 0) K::logits_forward(h.data() + r0 * c_, wte, logits_.data(), k, c_, cols);
      weft::tp::vocab_parallel_cross_entropy<B>(
          tp_, vocab_, std::span<float>(logits_), std::span<const std::int32_t>(batch.all_labels).subspan(r0, k),
          loss_scale, std::span<double>(row_losses_).subspan(r0, k), [](float v) { return detail::fast_exp(v); });
      if (cols == 0 || !with_gradients) {
        std::fill_n(a.head_dh.data() + r0 * c_, k * c_, 0.0f);
        continue;
      }
      K::logits_backward_input(wte, logits_.data(), a.head_dh.data() + r0 * c_, k, c_, cols);
      K::logits_backward_weight(h.data() + r0 * c_, logits_.data(), dwte, k, c_, cols);
    }
    const auto [first, count] = row_range();
    double loss = 0;
    for (std::size_t t = first; t < first + count; ++t) loss += row_losses_[t];
    return loss;
  }
  /// Where forward adds the output layer's weight gradient: the gradient itself, or (when
  /// gradients exist only inside a scope) a buffer that the head's backward adds in.
  float* head_wte_grad_target(int chunk, std::size_t rows) {
    if (!scoped()) return head_wte_grad(chunk);
    if (pending_wte_grad_.empty()) pending_wte_grad_.assign(rows * c_, 0.0f);
    return pending_wte_grad_.data();
  }

  template <class F>
  void exchange(const char* name, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    exchange_seconds_ += std::chrono::duration<double>(t1 - t0).count();
    if (on_exchange_) on_exchange_(name, t0, t1);
  }

  /// With sequence parallelism: the whole micro-batch's rows of `local` gathered into `full`
  /// (the input of a column-parallel layer). Without it the rank's rows are already whole.
  void gather_sequence(const std::vector<float>& local, std::vector<float>& full) {
    full.resize(n_ * c_);
    exchange("tp all-gather (sequence)", [&] {
      weft::tp::all_gather_sequence<B, float>(tp_, {std::span<const float>(local), {rows_, c_}}, std::span<float>(full));
    });
  }
  /// The gradient of a column-parallel layer's input (`full`, all rows, this rank's part of the
  /// sum) into `local`, the rank's rows: reduce-scattered with sequence parallelism, all-reduced
  /// without it (copy_to_tp_region's backward).
  void column_input_grad(std::vector<float>& full, std::vector<float>& local) {
    if (tp_size_ > 1 && !sp())
      exchange("tp all-reduce (input gradient)",
               [&] { weft::tp::copy_to_tp_region_backward<B, float>(tp_, std::span<float>(full)); });
    if (!sp()) {
      local.swap(full);
      return;
    }
    local.resize(rows_ * c_);
    exchange("tp reduce-scatter (input gradient)", [&] {
      weft::tp::all_gather_sequence_backward<B, float>(tp_, {std::span<const float>(full), {n_, c_}},
                                                       std::span<float>(local));
    });
  }
  /// A row-parallel layer's partial output (`partial`, all rows) summed over tp onto the rank's
  /// rows; returns where the sum is (`partial` itself without sequence parallelism).
  std::vector<float>& row_output(std::vector<float>& partial, std::vector<float>& local) {
    if (tp_size_ == 1) return partial;
    if (!sp()) {
      exchange("tp all-reduce (output)", [&] { weft::tp::reduce_from_tp_region<B, float>(tp_, std::span<float>(partial)); });
      return partial;
    }
    local.resize(rows_ * c_);
    exchange("tp reduce-scatter (sequence)", [&] {
      weft::tp::reduce_scatter_sequence<B, float>(tp_, {std::span<const float>(partial), {n_, c_}},
                                                  std::span<float>(local));
    });
    return local;
  }
  /// The gradient of a row-parallel layer's output on all the micro-batch's rows: gathered with
  /// sequence parallelism into `full`; without it, `local` is already all of them.
  const std::vector<float>& row_output_grad(const std::vector<float>& local, std::vector<float>& full) {
    if (!sp()) return local;
    full.resize(n_ * c_);
    exchange("tp all-gather (output gradient)", [&] {
      weft::tp::reduce_scatter_sequence_backward<B, float>(tp_, {std::span<const float>(local), {rows_, c_}},
                                                           std::span<float>(full));
    });
    return full;
  }

  /// The layer norm in front of a column-parallel layer: normalises the rank's rows of `x` into
  /// `ln` (keeping the statistics) and returns the column layer's input: `ln` itself, or with
  /// sequence parallelism the whole micro-batch's rows gathered into `full`.
  const std::vector<float>& column_input_norm(const std::vector<float>& x, const float* w, const float* b,
                                              std::vector<float>& ln, std::vector<float>& mean,
                                              std::vector<float>& rstd, std::vector<float>& full) {
    ln.resize(rows_ * c_);
    mean.resize(rows_);
    rstd.resize(rows_);
    K::layernorm_forward(x.data(), w, b, ln.data(), mean.data(), rstd.data(), rows_, c_);
    if (!sp()) return ln;
    gather_sequence(ln, full);
    return full;
  }

  /// The attention core: a.attn and a.lse from a.q, a.k, a.v (ring attention over cp).
  void attention_forward(layer_acts& a) {
    const std::size_t cl = cl_, n = n_;
    a.attn.resize(n * cl);
    const std::size_t heads = static_cast<std::size_t>(s_.model.heads) / tp_size_;
    a.lse.resize(n * heads);
    for (std::size_t b = 0; b < static_cast<std::size_t>(s_.micro_batch); ++b) {
      const std::size_t o = b * t_ * cl, w = t_ * cl;
      attention_.template forward<float>(std::span<const float>(a.q).subspan(o, w), std::span<const float>(a.k).subspan(o, w),
                                         std::span<const float>(a.v).subspan(o, w), std::span<float>(a.attn).subspan(o, w),
                                         std::span<float>(a.lse).subspan(b * t_ * heads, t_ * heads));
    }
  }

  /// One transformer block; `x` is the residual stream in (kept in a.x) and out.
  void layer_forward(int chunk, int layer, layer_acts& a, std::vector<float>& x) {
    const std::size_t c = c_, cl = cl_, n = n_, rows = rows_;
    a.x.swap(x);
    x.resize(rows * c);
    const std::vector<float>& ln1_full =
        column_input_norm(a.x, param(chunk, layer, param_role::ln_1_w), param(chunk, layer, param_role::ln_1_b), a.ln1,
                          a.ln1_mean, a.ln1_rstd, a.ln1_full);
    // qkv: [n, 3 cl] as q | k | v, each [n, heads/tp, head_dim].
    std::vector<float>& qkv = scratch_.qkv;
    qkv.resize(n * 3 * cl);
    K::linear_forward(ln1_full.data(), param(chunk, layer, param_role::attn_w),
                      {param(chunk, layer, param_role::attn_b), 3 * cl}, qkv.data(), n, c, 3 * cl);
    a.q.resize(n * cl);
    a.k.resize(n * cl);
    a.v.resize(n * cl);
    for (std::size_t i = 0; i < n; ++i) {
      std::copy_n(qkv.data() + i * 3 * cl, cl, a.q.data() + i * cl);
      std::copy_n(qkv.data() + i * 3 * cl + cl, cl, a.k.data() + i * cl);
      std::copy_n(qkv.data() + i * 3 * cl + 2 * cl, cl, a.v.data() + i * cl);
    }
    attention_forward(a);
    std::vector<float>& proj = scratch_.proj;
    proj.resize(n * c);
    K::linear_forward(a.attn.data(), param(chunk, layer, param_role::attn_proj_w), {}, proj.data(), n, cl, c);
    const std::vector<float>& attn_out = row_output(proj, scratch_.row_local);
    a.x2.resize(rows * c);
    K::residual_add(a.x.data(), attn_out.data(), param(chunk, layer, param_role::attn_proj_b), a.x2.data(), rows, c);

    const std::vector<float>& ln2_full =
        column_input_norm(a.x2, param(chunk, layer, param_role::ln_2_w), param(chunk, layer, param_role::ln_2_b), a.ln2,
                          a.ln2_mean, a.ln2_rstd, a.ln2_full);
    if (s_.model.moe_layer(layer)) return moe_forward(chunk, layer, a, ln2_full, x);
    a.fc.resize(n * 4 * cl);
    K::linear_forward(ln2_full.data(), param(chunk, layer, param_role::fc_w),
                      {param(chunk, layer, param_role::fc_b), 4 * cl}, a.fc.data(), n, c, 4 * cl);
    a.gelu.resize(n * 4 * cl);
    K::gelu_forward(a.fc.data(), a.gelu.data(), n * 4 * cl);
    std::vector<float>& mlp = scratch_.mlp;
    mlp.resize(n * c);
    K::linear_forward(a.gelu.data(), param(chunk, layer, param_role::mlp_proj_w), {}, mlp.data(), n, 4 * cl, c);
    const std::vector<float>& mlp_out = row_output(mlp, scratch_.row_local);
    K::residual_add(a.x2.data(), mlp_out.data(), param(chunk, layer, param_role::mlp_proj_b), x.data(), rows, c);
  }

  /// An MoE block's MLP on all the micro-batch's rows (`ln2_full`); x = x2 + its output on the
  /// rank's rows (the experts' biases are inside the experts).
  void moe_forward(int chunk, int layer, layer_acts& a, const std::vector<float>& ln2_full, std::vector<float>& x) {
    std::vector<float>& y = scratch_.mlp;
    y.resize(n_ * c_);
    moe_.forward(a.moe, layer, ln2_full, static_cast<std::size_t>(s_.micro_batch), moe_params(chunk), y,
                 count_moe_losses_);
    const std::size_t first = row_range().first;
    for (std::size_t i = 0; i < rows_ * c_; ++i) x[i] = a.x2[i] + y[first * c_ + i];
  }
  /// Its backward from the output gradient on all rows (`dmlp`): the router's and the local
  /// experts' gradients are added, and ln_2's output gradient (whole on every tp rank, so not
  /// summed over tp) is the rank's rows of `dh`.
  void moe_backward_input(int chunk, int layer, layer_acts& a, const std::vector<float>& dmlp, std::vector<float>& dh) {
    moe_.backward(a.moe, layer, dmlp, moe_params(chunk), moe_grads(chunk), dh);
    const auto first = static_cast<std::ptrdiff_t>(row_range().first * c_);
    a.dln2.assign(dh.begin() + first, dh.begin() + first + static_cast<std::ptrdiff_t>(rows_ * c_));
  }
  typename moe_block<B>::template lookup<const float> moe_params(int chunk) {
    return [this, chunk](int layer, param_role role, int expert) { return params_[at(chunk, layer, role, expert)]; };
  }
  typename moe_block<B>::template lookup<float> moe_grads(int chunk) {
    return [this, chunk](int layer, param_role role, int expert) { return grads_[at(chunk, layer, role, expert)]; };
  }

  /// The input part of one block's backward: `dx` is the gradient of the block's output in, of
  /// its input out; what the parameter gradients need is kept in `a`.
  void layer_backward_input(int chunk, int layer, layer_acts& a, std::vector<float>& dx) {
    const std::size_t c = c_, cl = cl_, n = n_, rows = rows_;
    // MLP: y = x2 + c_proj(gelu(c_fc(ln_2(x2)))), or an MoE block's y = x2 + moe(ln_2(x2)).
    a.dy = dx;
    const std::vector<float>& dmlp = row_output_grad(a.dy, a.dmlp_full);
    std::vector<float>& dcol = scratch_.dcol;
    dcol.resize(n * c);
    if (s_.model.moe_layer(layer)) {
      moe_backward_input(chunk, layer, a, dmlp, dcol);
    } else {
      std::vector<float>& dgelu = scratch_.dgelu;
      dgelu.resize(n * 4 * cl);
      K::linear_backward_input(param(chunk, layer, param_role::mlp_proj_w), dmlp.data(), dgelu.data(), n, 4 * cl, c);
      a.dfc.resize(n * 4 * cl);
      K::gelu_backward(a.fc.data(), dgelu.data(), a.dfc.data(), n * 4 * cl);
      K::linear_backward_input(param(chunk, layer, param_role::fc_w), a.dfc.data(), dcol.data(), n, c, 4 * cl);
      column_input_grad(dcol, a.dln2);
    }
    // dx2 = dy + the norm's input gradient.
    K::layernorm_backward_input(a.x2.data(), param(chunk, layer, param_role::ln_2_w), a.ln2_mean.data(),
                                a.ln2_rstd.data(), a.dln2.data(), dx.data(), rows, c);
    a.dx2 = dx;
    // Attention: x2 = x + c_proj(attention(c_attn(ln_1(x)))).
    const std::vector<float>& dproj = row_output_grad(a.dx2, a.dproj_full);
    std::vector<float>& dattn = scratch_.dattn;
    dattn.resize(n * cl);
    K::linear_backward_input(param(chunk, layer, param_role::attn_proj_w), dproj.data(), dattn.data(), n, cl, c);
    std::vector<float>&dq = scratch_.dq, &dk = scratch_.dk, &dv = scratch_.dv;
    dq.assign(n * cl, 0.0f);
    dk.assign(n * cl, 0.0f);
    dv.assign(n * cl, 0.0f);
    const std::size_t heads = static_cast<std::size_t>(s_.model.heads) / tp_size_;
    for (std::size_t b = 0; b < static_cast<std::size_t>(s_.micro_batch); ++b) {
      const std::size_t o = b * t_ * cl, w = t_ * cl;
      attention_.template backward<float>(
          std::span<const float>(a.q).subspan(o, w), std::span<const float>(a.k).subspan(o, w),
          std::span<const float>(a.v).subspan(o, w), std::span<const float>(a.attn).subspan(o, w),
          std::span<const float>(a.lse).subspan(b * t_ * heads, t_ * heads), std::span<const float>(dattn).subspan(o, w),
          std::span<float>(dq).subspan(o, w), std::span<float>(dk).subspan(o, w), std::span<float>(dv).subspan(o, w));
    }
    a.dqkv.resize(n * 3 * cl);
    for (std::size_t i = 0; i < n; ++i) {
      std::copy_n(dq.data() + i * cl, cl, a.dqkv.data() + i * 3 * cl);
      std::copy_n(dk.data() + i * cl, cl, a.dqkv.data() + i * 3 * cl + cl);
      std::copy_n(dv.data() + i * cl, cl, a.dqkv.data() + i * 3 * cl + 2 * cl);
    }
    dcol.resize(n * c);
    K::linear_backward_input(param(chunk, layer, param_role::attn_w), a.dqkv.data(), dcol.data(), n, c, 3 * cl);
    column_input_grad(dcol, a.dln1);
    K::layernorm_backward_input(a.x.data(), param(chunk, layer, param_role::ln_1_w), a.ln1_mean.data(),
                                a.ln1_rstd.data(), a.dln1.data(), dx.data(), rows, c);
  }

  /// The parameter part of one block's backward, from what the input part kept.
  void layer_backward_weight(int chunk, int layer, layer_acts& a) {
    const std::size_t c = c_, cl = cl_, n = n_, rows = rows_;
    const std::vector<float>& ln1_full = sp() ? a.ln1_full : a.ln1;
    const std::vector<float>& ln2_full = sp() ? a.ln2_full : a.ln2;
    const std::vector<float>& dproj = sp() ? a.dproj_full : a.dx2;
    if (!s_.model.moe_layer(layer)) {  // an MoE block's MLP added its gradients in backward's input part
      K::column_sums(a.dy.data(), {grad(chunk, layer, param_role::mlp_proj_b), c}, rows);
      const std::vector<float>& dmlp = sp() ? a.dmlp_full : a.dy;
      K::linear_backward_weight(a.gelu.data(), dmlp.data(), grad(chunk, layer, param_role::mlp_proj_w), {}, n, 4 * cl, c);
      K::linear_backward_weight(ln2_full.data(), a.dfc.data(), grad(chunk, layer, param_role::fc_w),
                                {grad(chunk, layer, param_role::fc_b), 4 * cl}, n, c, 4 * cl);
    }
    K::layernorm_backward_params(a.x2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.dln2.data(),
                                 grad(chunk, layer, param_role::ln_2_w), grad(chunk, layer, param_role::ln_2_b), rows, c);
    K::column_sums(a.dx2.data(), {grad(chunk, layer, param_role::attn_proj_b), c}, rows);
    K::linear_backward_weight(a.attn.data(), dproj.data(), grad(chunk, layer, param_role::attn_proj_w), {}, n, cl, c);
    K::linear_backward_weight(ln1_full.data(), a.dqkv.data(), grad(chunk, layer, param_role::attn_w),
                              {grad(chunk, layer, param_role::attn_b), 3 * cl}, n, c, 3 * cl);
    K::layernorm_backward_params(a.x.data(), a.ln1_mean.data(), a.ln1_rstd.data(), a.dln1.data(),
                                 grad(chunk, layer, param_role::ln_1_w), grad(chunk, layer, param_role::ln_1_b), rows, c);
  }

  shape s_;
  std::vector<param_spec> specs_;
  comm& tp_;
  comm& cp_;
  weft::cp::sequence_split split_;
  weft::cp::ring_attention<B, blas_attention> attention_;
  moe_block<B> moe_;
  bool count_moe_losses_ = false;
  std::map<key, std::size_t> index_;
  std::vector<std::span<const float>> params_;
  std::vector<std::span<float>> grads_;
  std::map<std::pair<int, int>, std::unique_ptr<activations>> live_;
  std::vector<std::unique_ptr<activations>> pool_;
  scratch scratch_;
  weft::tp::vocab_partition vocab_;
  /// The logits of one chunk of rows (this rank's vocabulary columns), turned into their gradient.
  static constexpr std::size_t logits_chunk_elements = std::size_t{1} << 22;
  std::vector<float> logits_, pending_wte_grad_;
  std::vector<double> row_losses_;
  std::size_t c_ = 0, cl_ = 0, t_ = 0, n_ = 0, rows_ = 0, tp_size_ = 1;
  double exchange_seconds_ = 0;
  std::function<void(const char*, std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point)>
      on_exchange_;
  std::function<void(int, int)> on_ready_;
  std::function<void(int, scope_event)> on_scope_;
};

}  // namespace train_gpt
