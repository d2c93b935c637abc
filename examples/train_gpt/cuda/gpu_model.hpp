#pragma once
// One rank's GPT-2 on its GPU (one_gpu_model, used by cuda/trainer.cpp): the fp32 master weights,
// AdamW's moments and the activations on the device, the operations of kernels.hpp called in the
// order model.hpp calls cpu_kernels', every sum over tp, the ring's transfers over cp and the
// pipeline's between stages enqueued on the one compute stream. Its parameters and gradients live
// in buffers it does not own (model_storage): the gradient synchronizer's flat buffers, or with
// ZeRO-2, ZeRO-3 and HSDP the units of sharded_units.hpp, bound while their scopes are open.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ring_attention.hpp>
#include <weft/tp/vocab_parallel.hpp>
#include <weft/tune/layout.hpp>

#include "checkpoint_io.hpp"
#include "gpt_config.hpp"
#include "kernels.hpp"
#include "parameters.hpp"
#include "ring_kernel.hpp"
#include "trainer.hpp"  // initial_whole: the CPU trainer's initial weights

namespace train_gpt::cuda {

using nccl_comm = weft::communicator<weft::nccl_backend>;

/// The model's groups beyond dp: null where the degree is 1. Their operations are enqueued on the
/// compute stream (the caller sets it), between the kernels that make and use their data.
struct model_groups {
  nccl_comm* tp = nullptr;
  bool sequence_parallel = false;  ///< with tp: the rows outside the blocks split over tp
  nccl_comm* cp = nullptr;         ///< ring attention over cp ranks holding 2 chunks of each sequence
  nccl_comm* embedding = nullptr;  ///< pp > 1, on the first and last stage: the tied embedding's two copies
  nccl_comm* model = nullptr;      ///< tp x pp: the ranks holding one replica (whole tensors are summed over it)
};

/// The three states a checkpoint holds.
enum class checkpoint_state { params, exp_avg, exp_avg_sq };

struct cuda_free {
  void operator()(void* p) const noexcept { cudaFree(p); }
};
template <class T>
using device_ptr = std::unique_ptr<T[], cuda_free>;

template <class T>
device_ptr<T> device_alloc(std::size_t n) {
  void* p = nullptr;
  WEFT_CHECK_CUDA(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)));
  return device_ptr<T>(static_cast<T*>(p));
}

/// Where the model's parameters and gradients live (device memory it does not own: the flat
/// buffers laid out by the synchronizer's plan), and the runs of parameters this rank's AdamW
/// updates (every parameter whole, or with ZeRO-1 this rank's shard: state_offset is then the
/// run's place in the shard-sized moments). With sharded units (ZeRO-2, ZeRO-3, HSDP) there is
/// no buffer: each unit's gathered parameters and gradient buffer are bound while its scope is
/// open (one_gpu_model::bind_param, bind_grad), and AdamW runs on the shards outside the model.
struct model_storage {
  float* params = nullptr;  ///< the parameter buffer's first element (padding included); null with units
  std::size_t params_total = 0;  ///< elements of that layout (with units: the parameters packed)
  std::vector<float*> param, grad;  ///< each parameter's elements in the buffers (rank_parameters order)
  std::vector<std::size_t> offset;  ///< each parameter's place in that layout
  std::vector<state_segment> optimizer;
  bool sharded = false;  ///< ZeRO-1: `optimizer` is this rank's shard
  bool units = false;    ///< ZeRO-2, ZeRO-3, HSDP: parameters and gradients bound per unit scope
};

/// One rank's GPT-2 on its GPU: the fp32 master parameters, AdamW's moments and the activations
/// on the device; the gradients (fp32) in the synchronizer's buffer (model_storage). With tp > 1
/// the rank holds its tp slices (rank_parameters at `place`) and sums over `tp`, whose operations
/// are enqueued on the compute stream. With sequence parallelism (Megatron's) the rows outside
/// the attention and MLP blocks (the residual stream, the norms, the embeddings' output) are split
/// over tp, rank r holding rows [r n / tp, (r + 1) n / tp) of the micro-batch: each block's input
/// is all-gathered and its partial output reduce-scattered, where without it both are one all-reduce.
/// `T` is what the products read and write: float (--precision fp32: the parameters themselves,
/// fp32 activations) or bf16 (--precision bf16: a bf16 copy of the parameters, refreshed
/// after each optimizer step, and bf16 activations, every product accumulating in fp32). What
/// bf16 would spoil stays fp32 either way: layer norm's statistics and sums, attention's softmax
/// and sums (its q, k, v and output are fp32 around it; in bf16 the trainer's kernels, built with
/// attention_math::tensor_cores_bf16, round its products' operands to bf16 for the tensor cores),
/// the logits and the loss, the embeddings' lookup and gradient sums, the gradients and AdamW.
template <class T>
class one_gpu_model {
  static constexpr bool is_bf16 = std::is_same_v<T, bf16>;

 public:
  /// `slots`: the micro-batches of each chunk whose activations the rank holds at once (1 without
  /// pp; with it weft::pipeline::slots_by_micro_batch of the schedule: micro-batch mb in slot
  /// mb % slots). `split_backward`: the schedule runs the weight gradients apart (zb-h1), so
  /// backward computes the input gradients alone and keeps what `weight` reads. `recompute`
  /// (gpt_model's, Korthikanti et al.): selective keeps one layer's attention output and its lse
  /// for all layers and recomputes each layer's from its q, k, v in backward; full keeps each
  /// layer's input (the residual stream) alone and reruns the layer's forward, its tp and cp
  /// exchanges included, in backward. The same kernels on the same inputs give the same bits, so
  /// the gradients equal those without it; not with a split backward (its weight pass reads
  /// every layer's activations later).
  one_gpu_model(const gpt_config& m, int micro_batch, kernels& k, model_storage storage, const model_place& place,
                const model_groups& groups, std::size_t slots = 1, bool split_backward = false,
                weft::tune::recompute recompute = weft::tune::recompute::none)
      : m_(m),
        k_(k),
        place_(place),
        tp_(place.tp > 1 ? groups.tp : nullptr),
        embedding_(place.pp > 1 ? groups.embedding : nullptr),
        model_(place.tp * place.pp > 1 ? groups.model : nullptr),
        sp_(place.tp > 1 && groups.sequence_parallel),
        cp_(groups.cp != nullptr && groups.cp->size() > 1 ? groups.cp : nullptr),
        split_{.seq = m.seq, .cp = cp_ != nullptr ? cp_->size() : 1, .kind = weft::cp::split_kind::load_balanced},
        specs_(rank_parameters(m, place)),
        storage_(std::move(storage)),
        vocab_block_(vocab_partition_of(m, place)),
        split_backward_(split_backward),
        recompute_(recompute) {
    if (split_backward_ && recompute_ != weft::tune::recompute::none)
      throw std::logic_error("train_gpt: recomputation with a split backward (zb-h1)");
    c_ = static_cast<std::size_t>(m.hidden);
    cl_ = c_ / static_cast<std::size_t>(place.tp);
    t_ = static_cast<std::size_t>(m.seq / split_.cp);  // the rank's tokens of each sequence
    b_ = static_cast<std::size_t>(micro_batch);
    n_ = b_ * t_;
    if (sp_ && n_ % static_cast<std::size_t>(place.tp) != 0)
      throw std::logic_error("train_gpt: sequence parallelism with " + std::to_string(n_) + " rows a micro-batch over tp " +
                             std::to_string(place.tp));
    rows_ = sp_ ? n_ / static_cast<std::size_t>(place.tp) : n_;
    first_row_ = sp_ ? rows_ * static_cast<std::size_t>(place.tp_rank) : 0;
    heads_ = static_cast<std::size_t>(m.heads);
    local_heads_ = heads_ / static_cast<std::size_t>(place.tp);
    chunks_ = static_cast<std::size_t>(place.vp);
    layers_ = static_cast<std::size_t>(place.layers_per_stage(m));  // each chunk's
    slots_ = std::max<std::size_t>(slots, 1);
    vocab_ = vocab_block_.real_rows();
    padded_vocab_ = vocab_block_.per_rank;
    total_ = storage_.params_total;
    offsets_ = storage_.offset;
    read_.assign(storage_.param.begin(), storage_.param.end());
    // AdamW's moments: beside the parameters (same offsets), or the shard's runs one after another
    // (none with units: their AdamW runs on the shards).
    moments_ = storage_.units ? 0 : total_;
    if (storage_.sharded) {
      moments_ = 0;
      for (const state_segment& s : storage_.optimizer) moments_ = std::max(moments_, s.state_offset + s.count);
    }
    m1_ = device_alloc<float>(moments_);
    m2_ = device_alloc<float>(moments_);
    WEFT_CHECK_CUDA(cudaMemsetAsync(m1_.get(), 0, moments_ * sizeof(float), k_.stream()));
    WEFT_CHECK_CUDA(cudaMemsetAsync(m2_.get(), 0, moments_ * sizeof(float), k_.stream()));
    if constexpr (is_bf16) working_ = device_alloc<T>(total_);
    if (storage_.units) {
      if (place_.pp > 1) throw std::logic_error("train_gpt: sharded units with pipeline stages");
      wte_grad_stash_ = device_alloc<float>(vocab_block_.per_rank * c_);
      zeros_ = device_alloc<float>(c_);
      WEFT_CHECK_CUDA(cudaMemsetAsync(wte_grad_stash_.get(), 0, vocab_block_.per_rank * c_ * sizeof(float), k_.stream()));
      WEFT_CHECK_CUDA(cudaMemsetAsync(zeros_.get(), 0, c_ * sizeof(float), k_.stream()));
    }
    // nc: every row of the micro-batch, a full row of activations per token; ncl: the rank's tp
    // slice of the heads or of the MLP's inner width (a quarter of it); rc: the rank's rows (all of
    // them without sequence parallelism). l: the layers whose activations are kept, those of each
    // chunk for each slot; the residual stream has each chunk's input and every layer's output.
    // Recomputation keeps one layer's set of what it rebuilds (la: attention's output and lse;
    // with full, li: every activation inside the layer), which each layer's backward rebuilds.
    const std::size_t nc = n_ * c_, ncl = n_ * cl_, rc = rows_ * c_, l = slots_ * chunks_ * layers_;
    const std::size_t li = recompute_ == weft::tune::recompute::full ? 1 : l;
    const std::size_t la = recompute_ != weft::tune::recompute::none ? 1 : l;
    stream_ = device_alloc<T>((l + slots_ * chunks_) * rc);
    ln1_ = device_alloc<T>(li * nc), ln2_ = device_alloc<T>(li * nc);
    q_ = device_alloc<float>(li * ncl), k_act_ = device_alloc<float>(li * ncl), v_ = device_alloc<float>(li * ncl);
    attn_ = device_alloc<float>(la * ncl), x2_ = device_alloc<T>(li * rc);
    fc_ = device_alloc<T>(li * 4 * ncl), gelu_ = device_alloc<T>(li * 4 * ncl);
    stats_ = device_alloc<float>(4 * li * rows_);  // mean and rstd of ln_1 and ln_2, per layer
    lse_ = device_alloc<float>(la * n_ * local_heads_);
    // The head's output gradient and norm statistics, kept from forward to backward per slot.
    head_ln_ = device_alloc<T>(nc), head_stats_ = device_alloc<float>(slots_ * 2 * rows_);
    head_dh_ = device_alloc<T>(slots_ * nc);
    qkv_ = device_alloc<T>(3 * ncl);
    tmp_ = device_alloc<T>(nc), dx_ = device_alloc<T>(rc);
    // The output gradients the weight gradients read (kept_grads): one layer's, used at once, or
    // with a split backward every layer's of every slot, kept from backward to weight.
    const std::size_t kept = split_backward_ ? l : 1;
    kept_dy_ = device_alloc<T>(kept * rc), kept_dx2_ = device_alloc<T>(kept * rc);
    kept_dln1_ = device_alloc<T>(kept * rc), kept_dln2_ = device_alloc<T>(kept * rc);
    kept_dfc_ = device_alloc<T>(kept * 4 * ncl), kept_dqkv_ = device_alloc<T>(kept * 3 * ncl);
    if (sp_) {
      // The rank's rows of what is gathered or reduce-scattered, the gathered output gradients,
      // and the partial sums over tp of the norms' input gradients (every row, before the
      // reduce-scatter; without sp they are summed in place, in the kept rows).
      ln_rows_ = device_alloc<T>(rc), tmp_rows_ = device_alloc<T>(rc), head_dh_rows_ = device_alloc<T>(slots_ * rc);
      dy_all_ = device_alloc<T>(nc), dln1_ = device_alloc<T>(nc), dln2_ = device_alloc<T>(nc);
      kept_dy_all_ = device_alloc<T>(kept * nc), kept_dx2_all_ = device_alloc<T>(kept * nc);
      if constexpr (is_bf16) embedding_local_ = device_alloc<float>(rc);
      else embedding_rows_ = device_alloc<float>(nc);  // bf16 allocates it below
    }
    dattn_ = device_alloc<float>(ncl), dq_ = device_alloc<float>(ncl), dk_ = device_alloc<float>(ncl);
    dv_ = device_alloc<float>(ncl);
    dgelu_ = device_alloc<T>(4 * ncl);
    if constexpr (is_bf16) {
      // The products' bf16 copies of attention's output (kept per layer for c_proj's weight
      // gradient) and of its gradient; the embeddings' fp32 rows.
      attn_products_ = device_alloc<T>(la * ncl), dattn_products_ = device_alloc<T>(ncl);
      embedding_rows_ = device_alloc<float>(nc);
    }
    if (tp_ != nullptr) {
      // The vocabulary-parallel loss's row maxima (float) and sums (double: exp sums, label logits).
      row_max_ = device_alloc<float>(n_);
      row_sums_ = device_alloc<double>(2 * n_);
    }
    // The loss's rows per chunk of logits. fp32: as gpt_model's head takes them (its padded block
    // on one rank), so the tied embedding's gradient sums in the CPU's chunks. bf16: chunks 32 x
    // larger (fewer, larger products for the tensor cores; 1.3 GB of logits and their bf16 gradient at
    // GPT-2's vocabulary).
    const std::size_t chunk_elements = is_bf16 ? logits_chunk_elements << 5 : logits_chunk_elements;
    chunk_rows_ = std::clamp<std::size_t>(chunk_elements / padded_vocab_, 1, n_);
    logits_ = device_alloc<float>(chunk_rows_ * vocab_);
    if constexpr (is_bf16) {
      // The bf16 products run over the padded vocabulary (rows of 16 bytes whatever --vocab is):
      // fp32 logits [rows, padded], the loss's gradient as bf16 [rows, padded] whose padded
      // columns stay zero (the conversion writes the real ones only).
      wide_logits_ = device_alloc<float>(chunk_rows_ * padded_vocab_);
      dlogits_products_ = device_alloc<T>(chunk_rows_ * padded_vocab_);
      WEFT_CHECK_CUDA(
          cudaMemsetAsync(dlogits_products_.get(), 0, chunk_rows_ * padded_vocab_ * sizeof(T), k_.stream()));
    }
    tokens_ = device_alloc<std::int32_t>(slots_ * n_), labels_ = device_alloc<std::int32_t>(slots_ * n_);
    local_tokens_.resize(n_);
    // Row i is token i % t of its sequence i / t; its position in the sequence is the split's
    // (all of them in order without cp).
    const std::vector<std::int64_t> own = sequence_positions();
    std::vector<std::int64_t> pos(n_);
    for (std::size_t i = 0; i < n_; ++i) pos[i] = own[i % t_];
    positions_ = device_alloc<std::int64_t>(n_), sequence_positions_ = device_alloc<std::int64_t>(t_);
    upload(positions_.get(), pos);
    upload(sequence_positions_.get(), own);
    if (cp_ != nullptr) {
      std::vector<std::int64_t> every(static_cast<std::size_t>(m.seq));
      for (std::size_t i = 0; i < every.size(); ++i) every[i] = static_cast<std::int64_t>(i);
      all_positions_ = device_alloc<std::int64_t>(every.size());
      upload(all_positions_.get(), every);
      ring_.emplace(*cp_, split_,
                    weft::cp::attention_shape{.heads = local_heads_, .head_dim = c_ / heads_},
                    weft::cp::attention_options{.causal = true},
                    ring_kernel{.k = &k_, .positions = all_positions_.get()});
    }
  }

  std::size_t micro_batch_rows() const noexcept { return n_; }
  /// Elements of the tensor between two pipeline stages: the rank's rows of the residual stream.
  std::size_t boundary_elements() const noexcept { return rows_ * c_; }
  /// The positions in each sequence of the rank's tokens (weft::cp's load-balanced split over cp).
  std::vector<std::int64_t> sequence_positions() const {
    return weft::cp::positions(split_, cp_ != nullptr ? cp_->rank() : 0);
  }

  /// After the host waited for the compute stream: lets go of the step's sums over tp (complete by
  /// then; waiting on each would have made the host wait inside the step).
  void settle() {
    for (auto& r : pending_) r.wait();
    pending_.clear();
  }

  /// The initial weights (initial_whole, the CPU trainer's, cut to this rank's parts: the padded
  /// vocabulary rows zero), on the host in the storage's layout (offset).
  std::vector<float> initial_values(std::uint64_t seed) const {
    std::vector<float> host(total_, 0.0f);
    for (std::size_t i = 0; i < specs_.size(); ++i)
      cut_local(specs_[i], place_.tp_rank, place_.tp, initial_whole(specs_[i], m_, seed),
                std::span<float>(host).subspan(offsets_[i], specs_[i].local_elements));
    return host;
  }
  /// Sets the parameter buffer to the initial weights (not with units: load initial_values'
  /// parameters into the shards).
  void initialize(std::uint64_t seed) {
    if (storage_.units) throw std::logic_error("train_gpt: initialize() on a model whose parameters live in units");
    upload(storage_.params, initial_values(seed));
    refresh_working_copy();
  }

  // ---- sharded units (ZeRO-2, ZeRO-3, HSDP) --------------------------------------------------
  /// Called around each parameter group's use (sharded_units::on_scope), in forward and backward
  /// order, as gpt_model announces them on the CPU: the embeddings, each block, the head.
  void on_scope(std::function<void(int group, scope_event)> f) { on_scope_ = std::move(f); }
  /// Parameter i's gathered fp32 values, valid while its unit's scope is open; in bf16 also
  /// rounded into the products' copy (so it is refreshed at every gather).
  void bind_param(std::size_t i, std::span<const float> value) {
    read_.at(i) = value.data();
    if constexpr (is_bf16) k_.convert(value.data(), working_.get() + offsets_[i], value.size());
  }
  /// Parameter i's gradient buffer, valid while its unit's backward scope is open.
  void bind_grad(std::size_t i, std::span<float> grad_buffer) { storage_.grad.at(i) = grad_buffer.data(); }
  /// In place on the compute stream, parameter i's gradient (`g`, its unit's buffer) summed over tp
  /// when this rank computed it from its rows alone (partial_over_tp), before the unit's
  /// reduction; waited for in settle().
  void sum_gradient_over_tp(std::size_t i, std::span<float> g) {
    if (partial_over_tp(i)) sum_over_tp(g.data(), g.size());
  }

  /// The three states a checkpoint holds, each as whole tensors (checkpoint order: the padded
  /// vocabulary rows left out), and back. whole_state is collective over tp x pp (the slices and
  /// stages summed into whole tensors); with ZeRO-1 not for the moments, of which each rank holds
  /// a shard (place_moment_shard, then whole_from_device once the shards are gathered).
  using state = checkpoint_state;
  std::vector<float> whole_state(const whole_index& index, state which) {
    return whole_of(index, [&](std::size_t i) -> const float* { return of(which) + offsets_[i]; });
  }
  /// With ZeRO-1 the moments' file is whole: this rank keeps its shard of it.
  void load_whole_state(state which, const std::function<std::span<const float>(const std::string&)>& lookup) {
    if (which != state::params && storage_.sharded) {
      const std::vector<float> host = local_of_whole(lookup);
      float* moments = which == state::exp_avg ? m1_.get() : m2_.get();
      for (const state_segment& seg : storage_.optimizer)
        WEFT_CHECK_CUDA(cudaMemcpyAsync(moments + seg.state_offset,
                                        host.data() + offsets_[seg.param] + seg.param_offset,
                                        seg.count * sizeof(float), cudaMemcpyHostToDevice, k_.stream()));
      WEFT_CHECK_CUDA(cudaStreamSynchronize(k_.stream()));  // before `host` goes
      return;
    }
    upload(of(which), local_of_whole(lookup));
    if (which == state::params) refresh_working_copy();
  }
  /// ZeRO-1: this rank's shard of AdamW's moment `which` (exp_avg or exp_avg_sq), or of the reduced
  /// gradients (place_gradient_shard: where the reduce-scatter left them), copied into `full`
  /// (device, the storage's layout) at the shard's segments; the rest of `full` is not written.
  void place_moment_shard(state which, float* full) const {
    if (which == state::params || !storage_.sharded)
      throw std::logic_error("train_gpt: place_moment_shard without a moment shard");
    const float* moments = which == state::exp_avg ? m1_.get() : m2_.get();
    place_shard(full, [&](const state_segment& seg) { return moments + seg.state_offset; });
  }
  void place_gradient_shard(float* full) const {
    if (!storage_.sharded) throw std::logic_error("train_gpt: place_gradient_shard without ZeRO-1");
    place_shard(full, [&](const state_segment& seg) { return storage_.grad[seg.param] + seg.param_offset; });
  }
  /// Whole tensors (checkpoint order) from `full` (device, the storage's layout: every parameter's
  /// local elements); collective over tp x pp, as whole_state.
  std::vector<float> whole_from_device(const whole_index& index, const float* full) {
    return whole_of(index, [&](std::size_t i) { return full + offsets_[i]; });
  }
  /// This rank's local elements of whole tensors (`lookup(name)`), on the host in the storage's
  /// layout (offset; with units, the packed form sharded_units::load_packed takes).
  std::vector<float> local_of_whole(const std::function<std::span<const float>(const std::string&)>& lookup) const {
    std::vector<float> host(total_, 0.0f);  // the padding zero
    for (std::size_t i = 0; i < specs_.size(); ++i)
      cut_local(specs_[i], place_.tp_rank, place_.tp, lookup(specs_[i].name),
                std::span<float>(host).subspan(offsets_[i], specs_[i].local_elements));
    return host;
  }

  /// Forward and backward of one micro-batch without pipeline stages (`tokens` and `labels`: its
  /// n rows); the gradients are added, and each row's loss goes to `row_losses` (device, n doubles).
  void forward_backward(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& labels,
                        float loss_scale, double* row_losses) {
    forward(0, 0, tokens, labels, nullptr, nullptr, loss_scale, row_losses);
    backward(0, 0, nullptr, nullptr);
  }

  /// Forward of one micro-batch through chunk `chunk`'s layers, its activations kept in `slot`:
  /// from the tokens on virtual stage 0 (else from `input`, the previous stage's output on the
  /// device), to the loss on the last virtual stage, whose gradient the head computes at once
  /// (each row's loss into `row_losses`, device, n doubles; else the output goes to `output`).
  void forward(std::size_t slot, int chunk, const std::vector<std::int32_t>& tokens,
               const std::vector<std::int32_t>& labels, const T* input, T* output, float loss_scale,
               double* row_losses) {
    const std::size_t rc = rows_ * c_;
    T* in = stream_at(slot, chunk, 0);
    if (place_.first_stage(chunk)) {
      scope(embedding_group, scope_event::enter_forward);
      embed(slot, tokens);
      scope(embedding_group, scope_event::leave_forward);
    } else {
      copy_rows(in, input, rc);
    }
    for (std::size_t j = 0; j < layers_; ++j) {
      const int layer = place_.first_layer(m_, chunk) + static_cast<int>(j);
      scope(layer, scope_event::enter_forward);
      layer_forward(slot, chunk, j);
      scope(layer, scope_event::leave_forward);
    }
    const T* out = stream_at(slot, chunk, layers_);
    if (place_.last_stage(chunk)) {
      scope(head_group, scope_event::enter_forward);
      head(slot, out, labels, loss_scale, row_losses);
      scope(head_group, scope_event::leave_forward);
    } else {
      copy_rows(output, out, rc);
    }
  }

  /// Backward of one micro-batch through chunk `chunk` (its activations in `slot`): from the
  /// head's gradient on the last virtual stage (else from `output_grad`), the gradients added, to
  /// the embeddings on virtual stage 0 (else the input's gradient into `input_grad`).
  void backward(std::size_t slot, int chunk, const T* output_grad, T* input_grad) {
    const std::size_t rc = rows_ * c_;
    if (place_.last_stage(chunk)) {
      scope(head_group, scope_event::enter_backward);
      if (wte_grad_stash_) {
        // Units: the output layer's weight gradient, which forward computed before the root's
        // gradient buffer existed, added into it now that its backward scope is open.
        float* g = grad(param_role::wte);
        k_.residual_add(g, wte_grad_stash_.get(), zeros_.get(), g, padded_vocab_, c_);
        WEFT_CHECK_CUDA(cudaMemsetAsync(wte_grad_stash_.get(), 0, padded_vocab_ * c_ * sizeof(float), k_.stream()));
      }
      // The final norm's backward from the head's output gradient (summed over tp in forward).
      const T* h_in = stream_at(slot, chunk, layers_);
      const float* mean = head_stats_.get() + slot * 2 * rows_;
      const float* rstd = mean + rows_;
      const T* dh = sp_ ? head_dh_rows_.get() + slot * rc : head_dh_.get() + slot * n_ * c_;
      WEFT_CHECK_CUDA(cudaMemsetAsync(dx_.get(), 0, rc * sizeof(T), k_.stream()));
      k_.layernorm_backward_input(h_in, param(param_role::ln_f_w), mean, rstd, dh, dx_.get(), rows_, c_);
      k_.layernorm_backward_params(h_in, mean, rstd, dh, grad(param_role::ln_f_w), grad(param_role::ln_f_b), rows_, c_);
      scope(head_group, scope_event::leave_backward);
    } else {
      copy_rows(dx_.get(), output_grad, rc);
    }
    for (std::size_t j = layers_; j-- > 0;) {
      const int layer = place_.first_layer(m_, chunk) + static_cast<int>(j);
      scope(layer, scope_event::enter_backward);
      // Recomputation rebuilds what forward did not keep, in the shared buffers, with the
      // layer's parameters of its backward scope (gathered, under units).
      if (recompute_ == weft::tune::recompute::full) layer_forward(slot, chunk, j);
      if (recompute_ == weft::tune::recompute::selective) attention_core(view(slot, chunk, j));
      layer_backward_input(slot, chunk, j);
      if (!split_backward_) layer_backward_weight(slot, chunk, j);
      scope(layer, scope_event::leave_backward);
    }
    if (!place_.first_stage(chunk)) return copy_rows(input_grad, dx_.get(), rc);
    scope(embedding_group, scope_event::enter_backward);
    // Every row's gradient (gathered from the tp ranks with sp; whole on every tp rank): the
    // positions' from each row, the block's tokens' from their rows (the other blocks' tokens are
    // -1 here). With sp every rank thus computes wpe's whole gradient, not a partial sum.
    const T* dx_all = gathered(dx_.get(), dy_all_.get());
    const std::int32_t* tokens = tokens_.get() + slot * n_;
    if constexpr (is_bf16) {
      k_.convert(dx_all, embedding_rows_.get(), n_ * c_);
      k_.embedding_backward(tokens, positions_.get(), embedding_rows_.get(), grad(param_role::wte),
                            grad(param_role::wpe), n_, c_);
    } else {
      k_.embedding_backward(tokens, positions_.get(), dx_all, grad(param_role::wte), grad(param_role::wpe), n_, c_);
    }
    scope(embedding_group, scope_event::leave_backward);
  }

  /// A split backward's second part for (slot, chunk), after `backward`: every layer's weight
  /// gradients, from the output gradients backward kept. (The head's and the embeddings'
  /// parameter gradients are added by forward and backward themselves, as without the split.)
  void weight(std::size_t slot, int chunk) {
    if (!split_backward_) throw std::logic_error("train_gpt: weight() on a model whose backward is not split");
    for (std::size_t j = layers_; j-- > 0;) layer_backward_weight(slot, chunk, j);
  }

  /// pp > 1: the tied embedding's two copies (the first stage's input embedding, the last
  /// stage's output layer) each hold part of its gradient; their sum, on both, once a step.
  void tie_embeddings() {
    if (embedding_ == nullptr) return;
    for (std::size_t i = 0; i < specs_.size(); ++i)
      if (specs_[i].role == param_role::wte) {
        pending_.push_back(embedding_->all_reduce_async(std::span<float>(storage_.grad[i], specs_[i].local_elements)));
      }
  }

  /// Sequence parallelism: each tp rank computed the gradients of what tp replicates inside the
  /// split rows (the norms, the c_proj biases) from its rows alone; their sums over tp, once a
  /// step (after the last micro-batch, before the dp reduction reads them). wpe's is whole already.
  void sum_row_split_gradients() {
    for (std::size_t i = 0; i < specs_.size(); ++i)
      if (partial_over_tp(i)) sum_over_tp(storage_.grad[i], specs_[i].local_elements);
  }
  /// Whether parameter i's gradient on this rank is a partial sum over tp: with sequence
  /// parallelism, what tp replicates inside the split rows; not wpe's, which backward computes
  /// from every row (gathered) on every rank.
  bool partial_over_tp(std::size_t i) const {
    return sp_ && specs_[i].split == tp_split::replicated && specs_[i].role != param_role::wpe;
  }

  /// AdamW over this rank's runs of the parameters (cpu_kernels::adamw's arithmetic, bit for bit,
  /// on the fp32 master weights); `step` from 1. With ZeRO-1 the caller gathers the shards next,
  /// then refreshes the bf16 copy.
  void adamw(long step, const adamw_settings& s) {
    for (const state_segment& seg : storage_.optimizer)
      k_.adamw(storage_.param[seg.param] + seg.param_offset, storage_.grad[seg.param] + seg.param_offset,
               m1_.get() + seg.state_offset, m2_.get() + seg.state_offset, seg.count, step, s, specs_[seg.param].decay);
  }
  /// bf16: the products' copy of the master weights, rounded to nearest (after every change to
  /// them; with units bind_param makes it at every gather).
  void refresh_working_copy() {
    if constexpr (is_bf16)
      if (!storage_.units) k_.convert(storage_.params, working_.get(), total_);
  }

  /// The gradients as whole tensors in checkpoint order (the padded vocabulary rows left out);
  /// collective over tp x pp.
  std::vector<float> whole_gradients(const whole_index& index) {
    return whole_of(index, [&](std::size_t i) -> const float* { return storage_.grad[i]; });
  }

 private:
  static constexpr std::size_t logits_chunk_elements = std::size_t{1} << 22;  // gpt_model's

  template <class Source>
  void place_shard(float* full, Source&& source) const {
    for (const state_segment& seg : storage_.optimizer)
      WEFT_CHECK_CUDA(cudaMemcpyAsync(full + offsets_[seg.param] + seg.param_offset, source(seg),
                                      seg.count * sizeof(float), cudaMemcpyDeviceToDevice, k_.stream()));
  }
  template <class U>
  void upload(U* device, const std::vector<U>& host) {
    WEFT_CHECK_CUDA(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(U), cudaMemcpyHostToDevice, k_.stream()));
  }
  /// Each parameter's local elements (from `local_of(i)`, device) placed in whole tensors on the
  /// host. Under tp and pp each rank places its slices of its stage's tensors (what tp replicates,
  /// tp rank 0 alone; the tied embedding, the first stage's copy) and the sum over tp x pp is the
  /// whole (collective over that group).
  template <class Local>
  std::vector<float> whole_of(const whole_index& index, Local&& local_of) {
    std::vector<float> local(total_);
    for (std::size_t i = 0; i < specs_.size(); ++i)
      WEFT_CHECK_CUDA(cudaMemcpyAsync(local.data() + offsets_[i], local_of(i), specs_[i].local_elements * sizeof(float),
                                      cudaMemcpyDeviceToHost, k_.stream()));
    WEFT_CHECK_CUDA(cudaStreamSynchronize(k_.stream()));
    return whole_from_local(index, local);
  }

 public:
  /// Whole tensors (checkpoint order) from every parameter's local elements on the host, in the
  /// storage's layout (offset): with units, what sharded_units::packed gathered. Collective over
  /// tp x pp, as whole_of.
  std::vector<float> whole_from_local(const whole_index& index, std::span<const float> local) {
    std::vector<float> whole(index.total, 0.0f);
    const ownership own{.tp_rank = place_.tp_rank, .tp = place_.tp, .data_leader = true};  // the CPU trainer's rule
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const bool last_stage_copy = specs_[i].role == param_role::wte && !place_.first_stage(specs_[i].chunk);
      if (!own.owns(specs_[i], /*sharded=*/false) || last_stage_copy) continue;
      place_local(specs_[i], place_.tp_rank, place_.tp,
                  local.subspan(offsets_[i], specs_[i].local_elements),
                  std::span<float>(whole).subspan(index.offset.at(specs_[i].name),
                                                  static_cast<std::size_t>(elements_of(specs_[i].whole))));
    }
    if (model_ != nullptr) {
      const device_ptr<float> summed = device_alloc<float>(whole.size());
      upload(summed.get(), whole);
      model_->all_reduce(std::span<float>(summed.get(), whole.size()));
      WEFT_CHECK_CUDA(cudaMemcpyAsync(whole.data(), summed.get(), whole.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                      k_.stream()));
      WEFT_CHECK_CUDA(cudaStreamSynchronize(k_.stream()));
    }
    return whole;
  }

 private:

  /// The residual stream of `slot` and `chunk` before its layer `j` (j = layers_: the chunk's output).
  T* stream_at(std::size_t slot, int chunk, std::size_t j) const {
    return stream_.get() + ((slot * chunks_ + static_cast<std::size_t>(chunk)) * (layers_ + 1) + j) * rows_ * c_;
  }
  void copy_rows(T* to, const T* from, std::size_t count) {
    WEFT_CHECK_CUDA(cudaMemcpyAsync(to, from, count * sizeof(T), cudaMemcpyDeviceToDevice, k_.stream()));
  }

  /// The embeddings of micro-batch `tokens` into the residual stream of `slot` (virtual stage 0).
  /// Under tp the rank looks up the tokens of its vocabulary block: ids relative to the block, -1
  /// for the others (model.hpp's embedding_forward).
  void embed(std::size_t slot, const std::vector<std::int32_t>& tokens) {
    std::int32_t* ids = tokens_.get() + slot * n_;
    if (tp_ != nullptr) {
      for (std::size_t t = 0; t < n_; ++t)
        local_tokens_[t] = vocab_block_.owns(tokens[t]) ? tokens[t] - static_cast<std::int32_t>(vocab_block_.first()) : -1;
      upload(ids, local_tokens_);
    } else {
      upload(ids, tokens);
    }
    T* stream = stream_at(slot, 0, 0);
    // The lookup covers every row (fp32: into the residual stream itself unless it is split);
    // `embedded` ends as the rank's rows, in fp32.
    float* all_rows;
    if constexpr (is_bf16) all_rows = embedding_rows_.get();
    else all_rows = sp_ ? embedding_rows_.get() : stream;
    float* embedded = all_rows;
    if (tp_ == nullptr) {
      k_.embedding_forward(ids, positions_.get(), master(param_role::wte), master(param_role::wpe), all_rows, n_, c_);
    } else {  // the blocks' lookups summed over tp (onto the rank's rows with sp), then the positions added
      k_.embedding_forward(ids, positions_.get(), master(param_role::wte), nullptr, all_rows, n_, c_);
      float* own_rows = nullptr;
      if (sp_) {
        if constexpr (is_bf16) own_rows = embedding_local_.get();
        else own_rows = stream;
      }
      embedded = reduced(all_rows, own_rows);
      k_.add_positions(positions_.get() + first_row_, master(param_role::wpe), embedded, rows_, c_);
    }
    if constexpr (is_bf16) k_.convert(embedded, stream, rows_ * c_);
  }

  /// The head on the last virtual stage: the final norm of `h_in` (the rank's rows of `slot`),
  /// then the logits a chunk of rows at a time, each turned at once into the loss (each row's into
  /// `row_losses`), the output layer's weight gradient and its input gradient, whose sum over the
  /// vocabulary blocks (onto the rank's rows with sp) `backward` starts from.
  void head(std::size_t slot, const T* h_in, const std::vector<std::int32_t>& labels, float loss_scale,
            double* row_losses) {
    upload(labels_.get() + slot * n_, labels);
    float* mean = head_stats_.get() + slot * 2 * rows_;
    float* rstd = mean + rows_;
    T* ln_out = sp_ ? ln_rows_.get() : head_ln_.get();
    k_.layernorm_forward(h_in, param(param_role::ln_f_w), param(param_role::ln_f_b), ln_out, mean, rstd, rows_, c_);
    gathered(ln_out, head_ln_.get());  // every row in head_ln_ (without sp, ln_out is head_ln_)
    T* head_dh = head_dh_.get() + slot * n_ * c_;
    // vocab_: the real tokens of the rank's block (all of them with tp 1); padded_vocab_: the block's rows.
    for (std::size_t r0 = 0; r0 < n_; r0 += chunk_rows_) {
      const std::size_t rows = std::min(chunk_rows_, n_ - r0);
      T* dh = head_dh + r0 * c_;
      if constexpr (is_bf16) {
        const std::size_t v = vocab_, vp = padded_vocab_;
        k_.logits_forward(head_ln_.get() + r0 * c_, param(param_role::wte), wide_logits_.get(), rows, c_, vp);
        if (v > 0)
          WEFT_CHECK_CUDA(cudaMemcpy2DAsync(logits_.get(), v * sizeof(float), wide_logits_.get(), vp * sizeof(float),
                                            v * sizeof(float), rows, cudaMemcpyDeviceToDevice, k_.stream()));
        loss(slot, rows, r0, loss_scale, row_losses);
        if (v > 0) k_.convert_columns(logits_.get(), v, dlogits_products_.get(), vp, v, rows);
        k_.logits_backward_input(param(param_role::wte), dlogits_products_.get(), dh, rows, c_, vp);
        k_.logits_backward_weight(head_ln_.get() + r0 * c_, dlogits_products_.get(), output_layer_grad(), rows, c_, vp);
      } else if (vocab_ > 0) {
        k_.logits_forward(head_ln_.get() + r0 * c_, param(param_role::wte), logits_.get(), rows, c_, vocab_);
        loss(slot, rows, r0, loss_scale, row_losses);
        k_.logits_backward_input(param(param_role::wte), logits_.get(), dh, rows, c_, vocab_);
        k_.logits_backward_weight(head_ln_.get() + r0 * c_, logits_.get(), output_layer_grad(), rows, c_, vocab_);
      } else {  // a block wholly in the padding: no logits, but the loss's sums over tp still
        loss(slot, rows, r0, loss_scale, row_losses);
        WEFT_CHECK_CUDA(cudaMemsetAsync(dh, 0, rows * c_ * sizeof(T), k_.stream()));
      }
    }
    reduced(head_dh, sp_ ? head_dh_rows_.get() + slot * rows_ * c_ : nullptr);
  }

  /// `count` elements as weft's element type (bf16 as weft::bfloat16, the same bits).
  template <class U>
  static auto elements(U* data, std::size_t count) {
    using element = std::conditional_t<std::is_same_v<std::remove_const_t<U>, bf16>,
                                       std::conditional_t<std::is_const_v<U>, const weft::bfloat16, weft::bfloat16>, U>;
    static_assert(sizeof(element) == sizeof(U));
    return std::span<element>(reinterpret_cast<element*>(data), count);
  }
  /// In place, the sum over tp of `count` elements on the compute stream (nothing without tp).
  template <class U>
  void sum_over_tp(U* data, std::size_t count, weft::reduce_op op = weft::reduce_op::sum) {
    if (tp_ == nullptr) return;
    pending_.push_back(tp_->all_reduce_async(elements(data, count), op));
  }
  /// The sum over tp of `partial` (every row of the micro-batch): with sequence parallelism the
  /// rank's rows of it, into `own_rows`; otherwise all of it, in place. Returns where it is.
  template <class U>
  U* reduced(U* partial, U* own_rows) {
    if (!sp_) {
      sum_over_tp(partial, n_ * c_);
      return partial;
    }
    pending_.push_back(tp_->reduce_scatter_async(elements(std::as_const(partial), n_ * c_), elements(own_rows, rows_ * c_)));
    return own_rows;
  }
  /// Every row of the micro-batch: with sequence parallelism gathered from the tp ranks' rows
  /// (`own_rows`) into `all`; otherwise `own_rows` already is every row.
  const T* gathered(const T* own_rows, T* all) {
    if (!sp_) return own_rows;
    pending_.push_back(tp_->all_gather_async(elements(own_rows, rows_ * c_), elements(all, n_ * c_)));
    return all;
  }

  /// The loss of `rows` rows from r0 on logits_ (this block's real columns): cpu_kernels'
  /// cross-entropy on whole rows, or with tp the vocabulary-parallel one, whose maxima and sums
  /// are reduced over tp between its three steps. logits_ becomes its gradient.
  void loss(std::size_t slot, std::size_t rows, std::size_t r0, float loss_scale, double* row_losses) {
    const std::int32_t* labels = labels_.get() + slot * n_ + r0;
    if (tp_ == nullptr) return k_.cross_entropy(logits_.get(), labels, rows, vocab_, loss_scale, row_losses + r0);
    const std::size_t first = vocab_block_.first();
    k_.cross_entropy_row_max(logits_.get(), rows, vocab_, row_max_.get());
    sum_over_tp(row_max_.get(), rows, weft::reduce_op::max);
    k_.cross_entropy_exp_sums(logits_.get(), labels, rows, vocab_, first, row_max_.get(), row_sums_.get());
    sum_over_tp(row_sums_.get(), 2 * rows);
    k_.cross_entropy_finish(logits_.get(), labels, rows, vocab_, first, row_max_.get(), row_sums_.get(), loss_scale,
                            row_losses + r0);
  }
  float* of(state which) const {
    if (storage_.units) throw std::logic_error("train_gpt: a whole state of a model whose parameters live in units");
    if (which != state::params && storage_.sharded)
      throw std::logic_error("train_gpt: the whole moments of a ZeRO-1 shard were asked for");
    return which == state::params ? storage_.params : which == state::exp_avg ? m1_.get() : m2_.get();
  }

  /// Columns [0, width) of a row-major [rows, from_width] array into a [rows, to_width] one (the
  /// q | k | v blocks of c_attn's output and their gradients), converted where the types differ.
  template <class From, class To>
  void copy_columns(To* to, std::size_t to_width, const From* from, std::size_t from_width, std::size_t width) {
    if constexpr (std::is_same_v<From, To>)
      WEFT_CHECK_CUDA(cudaMemcpy2DAsync(to, to_width * sizeof(To), from, from_width * sizeof(From), width * sizeof(To),
                                        n_, cudaMemcpyDeviceToDevice, k_.stream()));
    else
      k_.convert_columns(from, from_width, to, to_width, width, n_);
  }

  std::size_t index_of(int layer, param_role role) const {
    for (std::size_t i = 0; i < specs_.size(); ++i)
      if (specs_[i].layer == layer && specs_[i].role == role) return i;
    throw std::logic_error("train_gpt: no parameter for layer " + std::to_string(layer));
  }
  /// The fp32 master weights.
  const float* master(param_role role, int layer = -1) const { return read_[index_of(layer, role)]; }
  /// The weights the products and norms read: the master weights in fp32, their bf16 copy in bf16.
  const T* param(param_role role, int layer = -1) const {
    if constexpr (is_bf16) return working_.get() + offsets_[index_of(layer, role)];
    else return master(role, layer);
  }
  float* grad(param_role role, int layer = -1) const { return storage_.grad.at(index_of(layer, role)); }
  /// Where the head adds the output layer's weight gradient in forward: the tied embedding's
  /// gradient, or with units (whose root has no gradient buffer in forward) the stash backward
  /// adds into it.
  float* output_layer_grad() const { return wte_grad_stash_ ? wte_grad_stash_.get() : grad(param_role::wte); }
  void scope(int group, scope_event e) {
    if (on_scope_) on_scope_(group, e);
  }

  struct layer_view {
    T *x, *out, *ln1;
    float *q, *k, *v, *attn, *lse;
    T *attn_products, *x2, *ln2, *fc, *gelu;
    float *mean1, *rstd1, *mean2, *rstd2;
  };
  /// Layer j of `chunk`'s activations in `slot`. With recomputation what it rebuilds is one
  /// layer's set (index 0: l with full, la with either); the residual stream is every layer's.
  layer_view view(std::size_t slot, int chunk, std::size_t j) const {
    const std::size_t nc = n_ * c_, ncl = n_ * cl_, rc = rows_ * c_;
    const std::size_t kept = (slot * chunks_ + static_cast<std::size_t>(chunk)) * layers_ + j;
    const std::size_t l = recompute_ == weft::tune::recompute::full ? 0 : kept;
    const std::size_t la = recompute_ != weft::tune::recompute::none ? 0 : kept;
    float* stats = stats_.get() + 4 * l * rows_;
    float* attn = attn_.get() + la * ncl;
    T* attn_products;
    if constexpr (is_bf16) attn_products = attn_products_.get() + la * ncl;
    else attn_products = attn;  // fp32: the products read attention's output itself
    return {stream_at(slot, chunk, j), stream_at(slot, chunk, j + 1), ln1_.get() + l * nc,
            q_.get() + l * ncl,        k_act_.get() + l * ncl,       v_.get() + l * ncl,
            attn,                      lse_.get() + la * n_ * local_heads_, attn_products,
            x2_.get() + l * rc,        ln2_.get() + l * nc,          fc_.get() + 4 * l * ncl,
            gelu_.get() + 4 * l * ncl, stats,                        stats + rows_,
            stats + 2 * rows_,         stats + 3 * rows_};
  }
  float softmax_scale() const {
    return static_cast<float>(weft::cp::softmax_scale({.heads = heads_, .head_dim = c_ / heads_}, {}));
  }
  /// dW += x^T dy and db += column sums of dy (`dbias` may be null), in that order in both precisions.
  void weight_gradients(const T* x, const T* dy, float* dw, float* dbias, std::size_t in, std::size_t out) {
    if constexpr (is_bf16) {
      k_.linear_backward_weight(x, dy, dw, n_, in, out);
      if (dbias != nullptr) k_.column_sums(dy, dbias, n_, out);
    } else {
      k_.linear_backward_weight(x, dy, dw, dbias, n_, in, out);
    }
  }

  /// gpt_model::layer_forward: c_attn and c_fc column-parallel (the rank's heads, its quarter of
  /// the MLP's width: cl = c / tp), both c_proj row-parallel, their partial outputs summed over tp
  /// before the (replicated) bias and the residual. The norms and the residual adds run on the
  /// rank's rows (r: all of them without sp); the blocks on every row (n).
  void layer_forward(std::size_t slot, int chunk, std::size_t j) {
    const layer_view a = view(slot, chunk, j);
    const int layer = place_.first_layer(m_, chunk) + static_cast<int>(j);
    const std::size_t c = c_, cl = cl_, n = n_, r = rows_;
    T* ln_out = sp_ ? ln_rows_.get() : a.ln1;
    k_.layernorm_forward(a.x, param(param_role::ln_1_w, layer), param(param_role::ln_1_b, layer), ln_out, a.mean1,
                         a.rstd1, r, c);
    gathered(ln_out, a.ln1);  // every row in a.ln1 (without sp, ln_out is a.ln1)
    k_.linear_forward(a.ln1, param(param_role::attn_w, layer), param(param_role::attn_b, layer), qkv_.get(), n, c,
                      3 * cl);
    copy_columns(a.q, cl, qkv_.get(), 3 * cl, cl);
    copy_columns(a.k, cl, qkv_.get() + cl, 3 * cl, cl);
    copy_columns(a.v, cl, qkv_.get() + 2 * cl, 3 * cl, cl);
    attention_core(a);
    k_.linear_forward(a.attn_products, param(param_role::attn_proj_w, layer), nullptr, tmp_.get(), n, cl, c);
    k_.residual_add(a.x, reduced(tmp_.get(), tmp_rows_.get()), param(param_role::attn_proj_b, layer), a.x2, r, c);
    ln_out = sp_ ? ln_rows_.get() : a.ln2;
    k_.layernorm_forward(a.x2, param(param_role::ln_2_w, layer), param(param_role::ln_2_b, layer), ln_out, a.mean2,
                         a.rstd2, r, c);
    gathered(ln_out, a.ln2);
    k_.linear_forward(a.ln2, param(param_role::fc_w, layer), param(param_role::fc_b, layer), a.fc, n, c, 4 * cl);
    k_.gelu_forward(a.fc, a.gelu, n * 4 * cl);
    k_.linear_forward(a.gelu, param(param_role::mlp_proj_w, layer), nullptr, tmp_.get(), n, 4 * cl, c);
    k_.residual_add(a.x2, reduced(tmp_.get(), tmp_rows_.get()), param(param_role::mlp_proj_b, layer), a.out, r, c);
  }

  /// Attention's output and lse from the layer's q, k and v (each sequence: the rank's tokens, over
  /// the ring with cp), and in bf16 the products' copy of the output: what selective
  /// recomputation rebuilds.
  void attention_core(const layer_view& a) {
    const std::size_t cl = cl_, d = c_ / heads_, h = local_heads_;
    for (std::size_t b = 0; b < b_; ++b) {
      const std::size_t o = b * t_ * cl, w = t_ * cl;
      if (ring_) {
        ring_->template forward<float>({a.q + o, w}, {a.k + o, w}, {a.v + o, w}, {a.attn + o, w},
                                       {a.lse + b * t_ * h, t_ * h});
        continue;
      }
      k_.attention_forward(a.q + o, a.k + o, a.v + o, sequence_positions_.get(), sequence_positions_.get(), t_, t_, h,
                           d, softmax_scale(), true, a.attn + o, a.lse + b * t_ * h);
    }
    if constexpr (is_bf16) k_.convert(a.attn, a.attn_products, n_ * cl);
  }

  /// The output gradients of layer j of `chunk` in `slot` that its weight gradients read: the
  /// rank's rows of the MLP's (dy) and of attention's (dx2) output gradients, every row of them
  /// with sp (dy_all, dx2_all), c_fc's and c_attn's output gradients, and the norms' (rows).
  /// Without a split backward every layer shares one set, used at once.
  struct kept_grads {
    T *dy, *dy_all, *dx2, *dx2_all, *dfc, *dqkv, *dln1, *dln2;
  };
  kept_grads kept(std::size_t slot, int chunk, std::size_t j) const {
    const std::size_t l = split_backward_ ? (slot * chunks_ + static_cast<std::size_t>(chunk)) * layers_ + j : 0;
    const std::size_t nc = n_ * c_, ncl = n_ * cl_, rc = rows_ * c_;
    return {kept_dy_.get() + l * rc,   sp_ ? kept_dy_all_.get() + l * nc : nullptr,
            kept_dx2_.get() + l * rc,  sp_ ? kept_dx2_all_.get() + l * nc : nullptr,
            kept_dfc_.get() + l * 4 * ncl, kept_dqkv_.get() + l * 3 * ncl,
            kept_dln1_.get() + l * rc, kept_dln2_.get() + l * rc};
  }

  /// gpt_model::layer_backward_input on one rank: dx_ holds the gradient of the layer's output
  /// in, of its input out; what the weight gradients need goes to kept(slot, chunk, j).
  void layer_backward_input(std::size_t slot, int chunk, std::size_t j) {
    const layer_view a = view(slot, chunk, j);
    const kept_grads g = kept(slot, chunk, j);
    const int layer = place_.first_layer(m_, chunk) + static_cast<int>(j);
    const std::size_t c = c_, cl = cl_, n = n_, r = rows_, d = c_ / heads_, h = local_heads_, rc = rows_ * c_,
                      ncl = n_ * cl_;
    // MLP: y = x2 + c_proj(gelu(c_fc(ln_2(x2)))).
    // The output gradients of the rank's rows (g.dy, g.dx2), and of every row for the blocks (dy, dx2).
    copy_rows(g.dy, dx_.get(), rc);
    const T* dy = gathered(g.dy, g.dy_all);
    k_.linear_backward_input(param(param_role::mlp_proj_w, layer), dy, dgelu_.get(), n, 4 * cl, c);
    k_.gelu_backward(a.fc, dgelu_.get(), g.dfc, n * 4 * cl);
    // ln_2's output fed every rank's slice of c_fc: its gradient is their sum (in g.dln2).
    T* dln2_partial = sp_ ? dln2_.get() : g.dln2;
    k_.linear_backward_input(param(param_role::fc_w, layer), g.dfc, dln2_partial, n, c, 4 * cl);
    const T* dln2 = reduced(dln2_partial, g.dln2);
    k_.layernorm_backward_input(a.x2, param(param_role::ln_2_w, layer), a.mean2, a.rstd2, dln2, dx_.get(), r, c);
    copy_rows(g.dx2, dx_.get(), rc);
    const T* dx2 = gathered(g.dx2, g.dx2_all);
    // Attention: x2 = x + c_proj(attention(c_attn(ln_1(x)))).
    if constexpr (is_bf16) {
      k_.linear_backward_input(param(param_role::attn_proj_w, layer), dx2, dattn_products_.get(), n, cl, c);
      k_.convert(dattn_products_.get(), dattn_.get(), ncl);
    } else {
      k_.linear_backward_input(param(param_role::attn_proj_w, layer), dx2, dattn_.get(), n, cl, c);
    }
    for (float* grad_of : {dq_.get(), dk_.get(), dv_.get()})
      WEFT_CHECK_CUDA(cudaMemsetAsync(grad_of, 0, ncl * sizeof(float), k_.stream()));
    for (std::size_t b = 0; b < b_; ++b) {
      const std::size_t o = b * t_ * cl, w = t_ * cl;
      if (ring_) {  // overwrites dq, dk, dv
        ring_->template backward<float>({a.q + o, w}, {a.k + o, w}, {a.v + o, w}, {a.attn + o, w},
                                        {a.lse + b * t_ * h, t_ * h}, {dattn_.get() + o, w}, {dq_.get() + o, w},
                                        {dk_.get() + o, w}, {dv_.get() + o, w});
        continue;
      }
      k_.attention_backward(a.q + o, a.k + o, a.v + o, sequence_positions_.get(), sequence_positions_.get(), t_, t_, h,
                            d, softmax_scale(), true, a.attn + o, a.lse + b * t_ * h, dattn_.get() + o, dq_.get() + o,
                            dk_.get() + o, dv_.get() + o);
    }
    copy_columns(g.dqkv, 3 * cl, dq_.get(), cl, cl);
    copy_columns(g.dqkv + cl, 3 * cl, dk_.get(), cl, cl);
    copy_columns(g.dqkv + 2 * cl, 3 * cl, dv_.get(), cl, cl);
    // ln_1's output fed every rank's heads: its gradient is their sum (in g.dln1).
    T* dln1_partial = sp_ ? dln1_.get() : g.dln1;
    k_.linear_backward_input(param(param_role::attn_w, layer), g.dqkv, dln1_partial, n, c, 3 * cl);
    const T* dln1 = reduced(dln1_partial, g.dln1);
    k_.layernorm_backward_input(a.x, param(param_role::ln_1_w, layer), a.mean1, a.rstd1, dln1, dx_.get(), r, c);
  }

  /// gpt_model::layer_backward_weight on one rank: the parameter gradients, in its order, from the
  /// layer's activations and what layer_backward_input kept; the norms' and the c_proj biases'
  /// from the rank's rows (with sp, partial sums: sum_row_split_gradients).
  void layer_backward_weight(std::size_t slot, int chunk, std::size_t j) {
    const layer_view a = view(slot, chunk, j);
    const kept_grads g = kept(slot, chunk, j);
    const int layer = place_.first_layer(m_, chunk) + static_cast<int>(j);
    const std::size_t c = c_, cl = cl_, r = rows_;
    const T* dy = sp_ ? g.dy_all : g.dy;
    const T* dx2 = sp_ ? g.dx2_all : g.dx2;
    k_.column_sums(g.dy, grad(param_role::mlp_proj_b, layer), r, c);
    weight_gradients(a.gelu, dy, grad(param_role::mlp_proj_w, layer), nullptr, 4 * cl, c);
    weight_gradients(a.ln2, g.dfc, grad(param_role::fc_w, layer), grad(param_role::fc_b, layer), c, 4 * cl);
    k_.layernorm_backward_params(a.x2, a.mean2, a.rstd2, g.dln2, grad(param_role::ln_2_w, layer),
                                 grad(param_role::ln_2_b, layer), r, c);
    k_.column_sums(g.dx2, grad(param_role::attn_proj_b, layer), r, c);
    weight_gradients(a.attn_products, dx2, grad(param_role::attn_proj_w, layer), nullptr, cl, c);
    weight_gradients(a.ln1, g.dqkv, grad(param_role::attn_w, layer), grad(param_role::attn_b, layer), c, 3 * cl);
    k_.layernorm_backward_params(a.x, a.mean1, a.rstd1, g.dln1, grad(param_role::ln_1_w, layer),
                                 grad(param_role::ln_1_b, layer), r, c);
  }

  gpt_config m_;
  kernels& k_;
  model_place place_;
  nccl_comm* tp_;  // null with tp 1
  nccl_comm* embedding_;  // null with pp 1 and on the middle stages
  nccl_comm* model_;      // tp x pp, null when both are 1
  bool sp_;        // sequence parallelism (tp > 1)
  nccl_comm* cp_;  // null with cp 1
  weft::cp::sequence_split split_;
  std::vector<param_spec> specs_;
  model_storage storage_;
  weft::tp::vocab_partition vocab_block_;  // the rows of wte this rank holds
  bool split_backward_ = false;            // zb-h1: weight() adds the layers' weight gradients
  weft::tune::recompute recompute_ = weft::tune::recompute::none;
  std::vector<const float*> read_;         // each parameter's fp32 values (with units: bound per scope)
  std::function<void(int, scope_event)> on_scope_;  // units only
  std::vector<std::size_t> offsets_;       // each parameter's place in the parameter buffer
  // c_: the hidden size; cl_: the rank's slice of it (c / tp); vocab_: the real tokens of the
  // rank's vocabulary block; padded_vocab_: the block's rows.
  // n_: the micro-batch's rows; rows_: the rank's (n_ / tp with sp, else n_), from first_row_.
  // chunks_: the model chunks on this rank (pp's virtual stages); layers_: each chunk's layers;
  // slots_: the micro-batches whose activations are held at once.
  std::size_t total_ = 0, moments_ = 0, c_ = 0, cl_ = 0, t_ = 0, b_ = 0, n_ = 0, rows_ = 0, first_row_ = 0, heads_ = 0,
              local_heads_ = 0, chunks_ = 1, layers_ = 0, slots_ = 1, vocab_ = 0, padded_vocab_ = 0, chunk_rows_ = 1;
  std::vector<std::int32_t> local_tokens_;    // tp: the micro-batch's tokens relative to the block
  device_ptr<float> row_max_;                 // tp: the loss's row maxima
  device_ptr<double> row_sums_;               // tp: its exp sums and label logits
  device_ptr<float> m1_, m2_;
  device_ptr<T> working_;  // bf16 only
  device_ptr<T> stream_, ln1_, ln2_, x2_, fc_, gelu_, head_ln_, head_dh_, qkv_, tmp_, dx_, dgelu_;
  device_ptr<T> kept_dy_, kept_dx2_, kept_dfc_, kept_dqkv_, kept_dln1_, kept_dln2_;  // kept_grads
  device_ptr<T> kept_dy_all_, kept_dx2_all_;                                         // kept_grads, sp only
  device_ptr<float> q_, k_act_, v_, attn_, stats_, lse_, head_stats_, dattn_, dq_, dk_, dv_, logits_;
  device_ptr<T> attn_products_, dattn_products_, dlogits_products_;  // bf16 only
  device_ptr<float> embedding_rows_, wide_logits_;                    // bf16 (or sp: embedding_rows_) only
  device_ptr<T> ln_rows_, tmp_rows_, head_dh_rows_, dy_all_, dln1_, dln2_;  // sp only
  device_ptr<float> embedding_local_;                                 // sp in bf16 only
  device_ptr<float> wte_grad_stash_, zeros_;                          // units only
  device_ptr<std::int32_t> tokens_, labels_;
  device_ptr<std::int64_t> positions_, sequence_positions_, all_positions_;
  std::optional<weft::cp::ring_attention<weft::nccl_backend, ring_kernel>> ring_;  // with cp
  // The step's operations over tp, until settle(); last, so that unwinding waits for them before
  // the buffers they use are freed.
  std::vector<nccl_comm::request> pending_;
};

}  // namespace train_gpt::cuda
