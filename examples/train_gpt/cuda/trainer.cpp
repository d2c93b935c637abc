// train_on_cuda (device.hpp): GPT-2 trained on GPUs, one per rank, in fp32, data parallel over
// NCCL. Each rank's model calls the operations of kernels.hpp in the order model.hpp calls
// cpu_kernels' on one rank (gpt_model's path without tp, cp or pp, operation for operation), so
// the first step's loss and gradients are the CPU trainer's to rounding
// (tests/train_gpt/device_check.py compares them); weft's gradient synchronizer sums the
// gradients over the dp ranks (NCCL, device buffers) as it does for the CPU trainer over MPI.
//
// Everything a step computes stays on the device and is enqueued on one compute stream; the host
// waits once a step, for the losses. Parameters and AdamW's moments are one flat array each, in
// rank_parameters order; the gradients are the synchronizer's buffer. Every layer's activations
// are kept from forward to backward (no recomputation) and allocated once, for the run's
// micro-batch.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/checkpoint/safetensors.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/launch/nccl_bootstrap.hpp>

#include "checkpoint_io.hpp"
#include "device.hpp"
#include "kernels.hpp"
#include "options.hpp"
#include "parameters.hpp"
#include "trainer.hpp"

namespace train_gpt {

namespace {

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

/// One rank's GPT-2 on its GPU: parameters, AdamW's moments and activations on the device; the
/// gradients where bind_gradients() points (the synchronizer's buffer).
class one_gpu_model {
 public:
  one_gpu_model(const gpt_config& m, int micro_batch, cuda::kernels& k)
      : m_(m), k_(k), specs_(rank_parameters(m, model_place{})) {
    c_ = static_cast<std::size_t>(m.hidden);
    t_ = static_cast<std::size_t>(m.seq);
    b_ = static_cast<std::size_t>(micro_batch);
    n_ = b_ * t_;
    heads_ = static_cast<std::size_t>(m.heads);
    layers_ = static_cast<std::size_t>(m.layers);
    vocab_ = static_cast<std::size_t>(m.vocab);
    for (const param_spec& p : specs_) {
      offsets_.push_back(total_);
      total_ += p.local_elements;
    }
    params_ = device_alloc<float>(total_);
    m1_ = device_alloc<float>(total_);
    m2_ = device_alloc<float>(total_);
    WEFT_CHECK_CUDA(cudaMemsetAsync(m1_.get(), 0, total_ * sizeof(float), k_.stream()));
    WEFT_CHECK_CUDA(cudaMemsetAsync(m2_.get(), 0, total_ * sizeof(float), k_.stream()));
    const std::size_t nc = n_ * c_, l = layers_;
    stream_ = device_alloc<float>((l + 1) * nc);
    ln1_ = device_alloc<float>(l * nc), ln2_ = device_alloc<float>(l * nc);
    q_ = device_alloc<float>(l * nc), k_act_ = device_alloc<float>(l * nc), v_ = device_alloc<float>(l * nc);
    attn_ = device_alloc<float>(l * nc), x2_ = device_alloc<float>(l * nc);
    fc_ = device_alloc<float>(l * 4 * nc), gelu_ = device_alloc<float>(l * 4 * nc);
    stats_ = device_alloc<float>(4 * l * n_);  // mean and rstd of ln_1 and ln_2, per layer
    lse_ = device_alloc<float>(l * n_ * heads_);
    head_ln_ = device_alloc<float>(nc), head_stats_ = device_alloc<float>(2 * n_), head_dh_ = device_alloc<float>(nc);
    qkv_ = device_alloc<float>(3 * nc), dqkv_ = device_alloc<float>(3 * nc);
    tmp_ = device_alloc<float>(nc), dx_ = device_alloc<float>(nc), dy_ = device_alloc<float>(nc);
    dx2_ = device_alloc<float>(nc), dln1_ = device_alloc<float>(nc), dln2_ = device_alloc<float>(nc);
    dattn_ = device_alloc<float>(nc), dq_ = device_alloc<float>(nc), dk_ = device_alloc<float>(nc);
    dv_ = device_alloc<float>(nc);
    dgelu_ = device_alloc<float>(4 * nc), dfc_ = device_alloc<float>(4 * nc);
    // The loss's rows per chunk of logits, as gpt_model's head takes them (its padded block on one rank).
    chunk_rows_ = std::clamp<std::size_t>(logits_chunk_elements / vocab_partition_of(m, model_place{}).per_rank, 1, n_);
    logits_ = device_alloc<float>(chunk_rows_ * vocab_);
    tokens_ = device_alloc<std::int32_t>(n_), labels_ = device_alloc<std::int32_t>(n_);
    positions_ = device_alloc<std::int64_t>(n_), sequence_positions_ = device_alloc<std::int64_t>(t_);
    std::vector<std::int64_t> pos(n_);
    for (std::size_t i = 0; i < n_; ++i) pos[i] = static_cast<std::int64_t>(i % t_);
    upload(positions_.get(), pos);
    upload(sequence_positions_.get(), std::vector<std::int64_t>(pos.begin(), pos.begin() + static_cast<std::ptrdiff_t>(t_)));
  }

  const std::vector<param_spec>& specs() const noexcept { return specs_; }
  /// Where backward adds each parameter's gradient (rank_parameters order): the synchronizer's buffer.
  void bind_gradients(std::vector<float*> grads) { grads_ = std::move(grads); }
  std::size_t micro_batch_rows() const noexcept { return n_; }

  /// The initial weights (initial_whole, the CPU trainer's, cut to this rank's parts: the padded
  /// vocabulary rows zero).
  void initialize(std::uint64_t seed) {
    std::vector<float> host(total_, 0.0f);
    for (std::size_t i = 0; i < specs_.size(); ++i)
      cut_local(specs_[i], 0, 1, initial_whole(specs_[i], m_, seed),
                std::span<float>(host).subspan(offsets_[i], specs_[i].local_elements));
    upload(params_.get(), host);
  }

  /// Forward and backward of one micro-batch (`tokens` and `labels`: its n rows); the gradients are
  /// added, and each row's loss goes to `row_losses` (device, n doubles).
  void forward_backward(const std::vector<std::int32_t>& tokens, const std::vector<std::int32_t>& labels,
                        float loss_scale, double* row_losses) {
    upload(tokens_.get(), tokens);
    upload(labels_.get(), labels);
    const std::size_t nc = n_ * c_;
    k_.embedding_forward(tokens_.get(), positions_.get(), param(param_role::wte), param(param_role::wpe),
                         stream_.get(), n_, c_);
    for (std::size_t l = 0; l < layers_; ++l) layer_forward(l);
    // The head: final norm, then the logits a chunk of rows at a time, each turned into its gradient.
    const float* h_in = stream_.get() + layers_ * nc;
    float* mean = head_stats_.get();
    float* rstd = head_stats_.get() + n_;
    k_.layernorm_forward(h_in, param(param_role::ln_f_w), param(param_role::ln_f_b), head_ln_.get(), mean, rstd, n_, c_);
    for (std::size_t r0 = 0; r0 < n_; r0 += chunk_rows_) {
      const std::size_t rows = std::min(chunk_rows_, n_ - r0);
      k_.logits_forward(head_ln_.get() + r0 * c_, param(param_role::wte), logits_.get(), rows, c_, vocab_);
      k_.cross_entropy(logits_.get(), labels_.get() + r0, rows, vocab_, loss_scale, row_losses + r0);
      k_.logits_backward_input(param(param_role::wte), logits_.get(), head_dh_.get() + r0 * c_, rows, c_, vocab_);
      k_.logits_backward_weight(head_ln_.get() + r0 * c_, logits_.get(), grad(param_role::wte), rows, c_, vocab_);
    }
    // Backward: the final norm, the layers in reverse, the embeddings.
    WEFT_CHECK_CUDA(cudaMemsetAsync(dx_.get(), 0, nc * sizeof(float), k_.stream()));
    k_.layernorm_backward_input(h_in, param(param_role::ln_f_w), mean, rstd, head_dh_.get(), dx_.get(), n_, c_);
    k_.layernorm_backward_params(h_in, mean, rstd, head_dh_.get(), grad(param_role::ln_f_w), grad(param_role::ln_f_b),
                                 n_, c_);
    for (std::size_t l = layers_; l-- > 0;) layer_backward(l);
    k_.embedding_backward(tokens_.get(), positions_.get(), dx_.get(), grad(param_role::wte), grad(param_role::wpe), n_,
                          c_);
  }

  /// AdamW over every parameter (cpu_kernels::adamw's arithmetic, bit for bit); `step` from 1.
  void adamw(long step, const cuda::adamw_settings& s) {
    for (std::size_t i = 0; i < specs_.size(); ++i)
      k_.adamw(params_.get() + offsets_[i], grads_[i], m1_.get() + offsets_[i],
               m2_.get() + offsets_[i], specs_[i].local_elements, step, s, specs_[i].decay);
  }

  /// The gradients as whole tensors in checkpoint order (the padded vocabulary rows left out).
  std::vector<float> whole_gradients(const whole_index& index) {
    std::vector<float> local(total_), whole(index.total, 0.0f);
    for (std::size_t i = 0; i < specs_.size(); ++i)
      WEFT_CHECK_CUDA(cudaMemcpyAsync(local.data() + offsets_[i], grads_[i], specs_[i].local_elements * sizeof(float),
                                      cudaMemcpyDeviceToHost, k_.stream()));
    WEFT_CHECK_CUDA(cudaStreamSynchronize(k_.stream()));
    for (std::size_t i = 0; i < specs_.size(); ++i)
      place_local(specs_[i], 0, 1, std::span<const float>(local).subspan(offsets_[i], specs_[i].local_elements),
                  std::span<float>(whole).subspan(index.offset.at(specs_[i].name),
                                                  static_cast<std::size_t>(elements_of(specs_[i].whole))));
    return whole;
  }

 private:
  static constexpr std::size_t logits_chunk_elements = std::size_t{1} << 22;  // gpt_model's

  template <class T>
  void upload(T* device, const std::vector<T>& host) {
    WEFT_CHECK_CUDA(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, k_.stream()));
  }
  /// Columns [first, first + width) of a row-major [rows, from_width] array into a [rows, width]
  /// one, or back (the q | k | v blocks of c_attn's output and their gradients).
  void copy_columns(float* to, std::size_t to_width, const float* from, std::size_t from_width, std::size_t width) {
    WEFT_CHECK_CUDA(cudaMemcpy2DAsync(to, to_width * sizeof(float), from, from_width * sizeof(float),
                                      width * sizeof(float), n_, cudaMemcpyDeviceToDevice, k_.stream()));
  }

  std::size_t index_of(int layer, param_role role) const {
    for (std::size_t i = 0; i < specs_.size(); ++i)
      if (specs_[i].layer == layer && specs_[i].role == role) return i;
    throw std::logic_error("train_gpt: no parameter for layer " + std::to_string(layer));
  }
  const float* param(param_role role, int layer = -1) const { return params_.get() + offsets_[index_of(layer, role)]; }
  float* grad(param_role role, int layer = -1) const { return grads_.at(index_of(layer, role)); }

  struct layer_view {
    float *x, *out, *ln1, *q, *k, *v, *attn, *lse, *x2, *ln2, *fc, *gelu, *mean1, *rstd1, *mean2, *rstd2;
  };
  layer_view view(std::size_t l) const {
    const std::size_t nc = n_ * c_;
    float* stats = stats_.get() + 4 * l * n_;
    return {stream_.get() + l * nc, stream_.get() + (l + 1) * nc, ln1_.get() + l * nc, q_.get() + l * nc,
            k_act_.get() + l * nc,  v_.get() + l * nc,            attn_.get() + l * nc, lse_.get() + l * n_ * heads_,
            x2_.get() + l * nc,     ln2_.get() + l * nc,          fc_.get() + 4 * l * nc, gelu_.get() + 4 * l * nc,
            stats,                  stats + n_,                   stats + 2 * n_,     stats + 3 * n_};
  }
  float softmax_scale() const {
    return static_cast<float>(weft::cp::softmax_scale({.heads = heads_, .head_dim = c_ / heads_}, {}));
  }

  /// gpt_model::layer_forward on one rank.
  void layer_forward(std::size_t l) {
    const layer_view a = view(l);
    const int layer = static_cast<int>(l);
    const std::size_t c = c_, n = n_, d = c_ / heads_;
    k_.layernorm_forward(a.x, param(param_role::ln_1_w, layer), param(param_role::ln_1_b, layer), a.ln1, a.mean1,
                         a.rstd1, n, c);
    k_.linear_forward(a.ln1, param(param_role::attn_w, layer), param(param_role::attn_b, layer), qkv_.get(), n, c,
                      3 * c);
    copy_columns(a.q, c, qkv_.get(), 3 * c, c);
    copy_columns(a.k, c, qkv_.get() + c, 3 * c, c);
    copy_columns(a.v, c, qkv_.get() + 2 * c, 3 * c, c);
    for (std::size_t b = 0; b < b_; ++b) {
      const std::size_t o = b * t_ * c;
      k_.attention_forward(a.q + o, a.k + o, a.v + o, sequence_positions_.get(), sequence_positions_.get(), t_, t_,
                           heads_, d, softmax_scale(), true, a.attn + o, a.lse + b * t_ * heads_);
    }
    k_.linear_forward(a.attn, param(param_role::attn_proj_w, layer), nullptr, tmp_.get(), n, c, c);
    k_.residual_add(a.x, tmp_.get(), param(param_role::attn_proj_b, layer), a.x2, n, c);
    k_.layernorm_forward(a.x2, param(param_role::ln_2_w, layer), param(param_role::ln_2_b, layer), a.ln2, a.mean2,
                         a.rstd2, n, c);
    k_.linear_forward(a.ln2, param(param_role::fc_w, layer), param(param_role::fc_b, layer), a.fc, n, c, 4 * c);
    k_.gelu_forward(a.fc, a.gelu, n * 4 * c);
    k_.linear_forward(a.gelu, param(param_role::mlp_proj_w, layer), nullptr, tmp_.get(), n, 4 * c, c);
    k_.residual_add(a.x2, tmp_.get(), param(param_role::mlp_proj_b, layer), a.out, n, c);
  }

  /// gpt_model::layer_backward_input and layer_backward_weight on one rank: dx_ holds the
  /// gradient of the layer's output in, of its input out.
  void layer_backward(std::size_t l) {
    const layer_view a = view(l);
    const int layer = static_cast<int>(l);
    const std::size_t c = c_, n = n_, d = c_ / heads_, nc = n_ * c_;
    auto copy = [&](float* to, const float* from, std::size_t count) {
      WEFT_CHECK_CUDA(cudaMemcpyAsync(to, from, count * sizeof(float), cudaMemcpyDeviceToDevice, k_.stream()));
    };
    // MLP: y = x2 + c_proj(gelu(c_fc(ln_2(x2)))).
    copy(dy_.get(), dx_.get(), nc);
    k_.linear_backward_input(param(param_role::mlp_proj_w, layer), dy_.get(), dgelu_.get(), n, 4 * c, c);
    k_.gelu_backward(a.fc, dgelu_.get(), dfc_.get(), n * 4 * c);
    k_.linear_backward_input(param(param_role::fc_w, layer), dfc_.get(), dln2_.get(), n, c, 4 * c);
    k_.layernorm_backward_input(a.x2, param(param_role::ln_2_w, layer), a.mean2, a.rstd2, dln2_.get(), dx_.get(), n, c);
    copy(dx2_.get(), dx_.get(), nc);
    // Attention: x2 = x + c_proj(attention(c_attn(ln_1(x)))).
    k_.linear_backward_input(param(param_role::attn_proj_w, layer), dx2_.get(), dattn_.get(), n, c, c);
    for (float* g : {dq_.get(), dk_.get(), dv_.get()})
      WEFT_CHECK_CUDA(cudaMemsetAsync(g, 0, nc * sizeof(float), k_.stream()));
    for (std::size_t b = 0; b < b_; ++b) {
      const std::size_t o = b * t_ * c;
      k_.attention_backward(a.q + o, a.k + o, a.v + o, sequence_positions_.get(), sequence_positions_.get(), t_, t_,
                            heads_, d, softmax_scale(), true, a.attn + o, a.lse + b * t_ * heads_, dattn_.get() + o,
                            dq_.get() + o, dk_.get() + o, dv_.get() + o);
    }
    copy_columns(dqkv_.get(), 3 * c, dq_.get(), c, c);
    copy_columns(dqkv_.get() + c, 3 * c, dk_.get(), c, c);
    copy_columns(dqkv_.get() + 2 * c, 3 * c, dv_.get(), c, c);
    k_.linear_backward_input(param(param_role::attn_w, layer), dqkv_.get(), dln1_.get(), n, c, 3 * c);
    k_.layernorm_backward_input(a.x, param(param_role::ln_1_w, layer), a.mean1, a.rstd1, dln1_.get(), dx_.get(), n, c);
    // The parameter gradients, in gpt_model::layer_backward_weight's order.
    k_.column_sums(dy_.get(), grad(param_role::mlp_proj_b, layer), n, c);
    k_.linear_backward_weight(a.gelu, dy_.get(), grad(param_role::mlp_proj_w, layer), nullptr, n, 4 * c, c);
    k_.linear_backward_weight(a.ln2, dfc_.get(), grad(param_role::fc_w, layer), grad(param_role::fc_b, layer), n, c,
                              4 * c);
    k_.layernorm_backward_params(a.x2, a.mean2, a.rstd2, dln2_.get(), grad(param_role::ln_2_w, layer),
                                 grad(param_role::ln_2_b, layer), n, c);
    k_.column_sums(dx2_.get(), grad(param_role::attn_proj_b, layer), n, c);
    k_.linear_backward_weight(a.attn, dx2_.get(), grad(param_role::attn_proj_w, layer), nullptr, n, c, c);
    k_.linear_backward_weight(a.ln1, dqkv_.get(), grad(param_role::attn_w, layer), grad(param_role::attn_b, layer), n,
                              c, 3 * c);
    k_.layernorm_backward_params(a.x, a.mean1, a.rstd1, dln1_.get(), grad(param_role::ln_1_w, layer),
                                 grad(param_role::ln_1_b, layer), n, c);
  }

  gpt_config m_;
  cuda::kernels& k_;
  std::vector<param_spec> specs_;
  std::vector<std::size_t> offsets_;
  std::size_t total_ = 0, c_ = 0, t_ = 0, b_ = 0, n_ = 0, heads_ = 0, layers_ = 0, vocab_ = 0, chunk_rows_ = 1;
  device_ptr<float> params_, m1_, m2_;
  std::vector<float*> grads_;
  device_ptr<float> stream_, ln1_, ln2_, q_, k_act_, v_, attn_, x2_, fc_, gelu_, stats_, lse_;
  device_ptr<float> head_ln_, head_stats_, head_dh_, qkv_, dqkv_, tmp_, dx_, dy_, dx2_, dln1_, dln2_, dattn_, dq_,
      dk_, dv_, dgelu_, dfc_, logits_;
  device_ptr<std::int32_t> tokens_, labels_;
  device_ptr<std::int64_t> positions_, sequence_positions_;
};

struct stream_deleter {
  void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
};

}  // namespace

int train_on_cuda(const options& o, const gpt_config& m, const run_layout& r, const corpus& data) {
  using clock = std::chrono::steady_clock;
  cudaStream_t raw = nullptr;
  // The dp group over NCCL (each rank's GPU chosen by its local rank; the unique id sent over MPI).
  weft::communicator<weft::nccl_backend> dp = weft::nccl_world();
  if (o.comm_timeout) dp.set_timeout(*o.comm_timeout);
  const int rank = dp.rank();
  WEFT_CHECK_CUDA(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  const std::unique_ptr<CUstream_st, stream_deleter> stream(raw);
  cuda::kernels k(stream.get(), cuda::gemm_math::fp32);
  one_gpu_model model(m, r.choice.micro_batch, k);
  // The gradients: the synchronizer's device buffer, summed over dp after the step's last
  // micro-batch (the loss is already divided by the global batch's tokens), as the CPU trainer's.
  weft::grad::synchronizer<weft::nccl_backend, float> sync(
      dp, weft::grad::sync_options{.bucket_bytes = o.bucket_mb > 0 ? static_cast<std::size_t>(o.bucket_mb * (1 << 20))
                                                                   : std::size_t{25} << 20,
                                   .accumulation_steps = r.micro_batches,
                                   .scale = weft::grad::scaling::sum,
                                   .warn_if_not_overlapped = false});
  sync.set_compute_stream(stream.get());
  for (const param_spec& p : model.specs()) sync.add_param(p.name, p.local_elements);
  sync.freeze();
  std::vector<float*> grads;
  for (std::size_t i = 0; i < model.specs().size(); ++i) grads.push_back(sync.grad(i).data());
  model.bind_gradients(std::move(grads));
  model.initialize(o.seed);

  const std::size_t n = model.micro_batch_rows(), seq1 = static_cast<std::size_t>(m.seq) + 1;
  const int per_dp = r.global_batch / r.degrees().dp;
  const float loss_scale = 1.0f / static_cast<float>(static_cast<double>(r.global_batch) * m.seq);
  const double tokens_per_step = static_cast<double>(r.global_batch) * m.seq;
  const device_ptr<double> row_losses = device_alloc<double>(static_cast<std::size_t>(r.micro_batches) * n);
  const device_ptr<double> loss_sum = device_alloc<double>(1);
  std::vector<double> host_losses(static_cast<std::size_t>(r.micro_batches) * n);
  std::vector<std::int32_t> tokens(n), labels(n);
  const whole_index index(m);
  std::vector<double> step_times;
  double first_loss = 0, last_loss = 0;
  if (rank == 0)
    std::printf("train_gpt: %d layers, hidden %d, %d heads, vocab %d, seq %d (%.2f M parameters) on %d GPU(s) in fp32: "
                "dp %d, global batch %d = %d micro-batch(es) of %d per dp rank\n",
                m.layers, m.hidden, m.heads, m.vocab, m.seq, static_cast<double>(m.parameter_count()) / 1e6, dp.size(),
                dp.size(), r.global_batch, r.micro_batches, r.choice.micro_batch);
  const auto run_start = clock::now();
  for (std::int64_t step = 0; step < o.steps; ++step) {
    const auto t0 = clock::now();
    const data_position at{o.seed, step, step * r.global_batch};
    const std::vector<std::int32_t> slice = data.sequences(at, static_cast<std::int64_t>(rank) * per_dp, per_dp, m.seq);
    for (int mb = 0; mb < r.micro_batches; ++mb) {
      // Row i of the micro-batch is token i % seq of its sequence i / seq (trainer::fill_batches without cp or sp).
      for (std::size_t i = 0; i < n; ++i) {
        const std::int32_t* s =
            slice.data() + (static_cast<std::size_t>(mb * r.choice.micro_batch) + i / static_cast<std::size_t>(m.seq)) * seq1;
        const std::size_t p = i % static_cast<std::size_t>(m.seq);
        tokens[i] = s[p];
        labels[i] = s[p + 1];
      }
      model.forward_backward(tokens, labels, loss_scale, row_losses.get() + static_cast<std::size_t>(mb) * n);
      // Every gradient is complete for this micro-batch: the last one's reduction starts, and the
      // compute stream waits for it (the others return at once).
      sync.reduce_all();
    }
    WEFT_CHECK_CUDA(cudaMemcpyAsync(host_losses.data(), row_losses.get(), host_losses.size() * sizeof(double),
                                    cudaMemcpyDeviceToHost, stream.get()));
    std::optional<weft::checkpoint::checkpoint_file> dump;
    if (o.dump_grads && rank == 0) {
      // trainer::dump_gradients' file: whole gradients (after the dp sum), then the whole global
      // batch's input_ids and labels, and the loss.
      const std::vector<std::int32_t> all = data.sequences(at, 0, r.global_batch, m.seq);
      dump.emplace(weft::checkpoint::checkpoint_file{config_metadata(m), whole_records(index, model.whole_gradients(index))});
      std::vector<std::int64_t> ids, next;
      for (int s = 0; s < r.global_batch; ++s)
        for (int t = 0; t < m.seq; ++t) {
          ids.push_back(all[static_cast<std::size_t>(s) * seq1 + static_cast<std::size_t>(t)]);
          next.push_back(all[static_cast<std::size_t>(s) * seq1 + static_cast<std::size_t>(t) + 1]);
        }
      dump->tensors.push_back(weft::checkpoint::make_record<std::int64_t>("input_ids", {r.global_batch, m.seq}, ids));
      dump->tensors.push_back(weft::checkpoint::make_record<std::int64_t>("labels", {r.global_batch, m.seq}, next));
    }
    const double lr = o.warmup > 0 && step + 1 <= o.warmup ? o.lr * static_cast<double>(step + 1) / o.warmup : o.lr;
    model.adamw(static_cast<long>(step + 1), {.lr = static_cast<float>(lr),
                                              .beta1 = static_cast<float>(o.beta1),
                                              .beta2 = static_cast<float>(o.beta2),
                                              .eps = static_cast<float>(o.eps),
                                              .weight_decay = static_cast<float>(o.weight_decay)});
    sync.zero_grad();
    WEFT_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
    // Summed as the CPU trainer sums them: each micro-batch's rows in order, the micro-batches,
    // then the ranks.
    double loss = 0;
    for (int mb = 0; mb < r.micro_batches; ++mb) {
      double part = 0;
      for (std::size_t t = 0; t < n; ++t) part += host_losses[static_cast<std::size_t>(mb) * n + t];
      loss += part;
    }
    WEFT_CHECK_CUDA(cudaMemcpy(loss_sum.get(), &loss, sizeof(double), cudaMemcpyHostToDevice));
    dp.all_reduce(std::span<double>(loss_sum.get(), 1));
    WEFT_CHECK_CUDA(cudaMemcpy(&loss, loss_sum.get(), sizeof(double), cudaMemcpyDeviceToHost));
    loss /= tokens_per_step;
    if (dump) {
      const float l = static_cast<float>(loss);
      dump->tensors.push_back(weft::checkpoint::make_record<float>("loss", {}, std::span<const float>(&l, 1)));
      weft::checkpoint::write_safetensors(*o.dump_grads, *dump);
    }
    const double step_s = std::chrono::duration<double>(clock::now() - t0).count();
    step_times.push_back(step_s);
    if (step == 0) first_loss = loss;
    last_loss = loss;
    if (!o.quiet && rank == 0) {
      std::printf("step %lld/%d | loss %.6f | %.0f tokens/s | step %.1f ms\n", static_cast<long long>(step + 1),
                  o.steps, loss, tokens_per_step / step_s, step_s * 1e3);
      std::fflush(stdout);
    }
  }
  if (rank == 0) {
    const double median = median_step_seconds(step_times);
    std::printf("done: %d steps, loss %.4f -> %.4f, median step %.1f ms, %.0f tokens/s, %.1f s in all (dp %d on "
                "GPUs, fp32, %d micro-batches of %d)\n",
                o.steps, first_loss, last_loss, median * 1e3, median > 0 ? tokens_per_step / median : 0.0,
                std::chrono::duration<double>(clock::now() - run_start).count(), dp.size(), r.micro_batches,
                r.choice.micro_batch);
  }
  return 0;
}

}  // namespace train_gpt
