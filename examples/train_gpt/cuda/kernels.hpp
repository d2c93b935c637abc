#pragma once
// The model's arithmetic on an NVIDIA GPU: the operations of cpu_kernels.hpp on device pointers,
// in order on one CUDA stream, with the same conventions (row-major [tokens, features]
// activations, linear weights stored (in, out), parameter gradients added, input gradients
// overwritten unless said otherwise). Matrix products go through cuBLASLt; everything else is
// this folder's kernels, one concern a file (gemm.cu, layernorm.cu, elementwise.cu,
// embedding.cu, cross_entropy.cu, adamw.cu, attention.cu, convert.cu).
//
// Every call only enqueues work on the stream: nothing waits on the host, and scratch memory is
// allocated in stream order (cudaMallocAsync), grow-only. What is not deterministic in a plain GPU
// implementation is made so here: the embedding's backward sorts the rows by token (stable) and
// sums each token's rows in order, and every reduction over rows runs in a fixed order, so two
// runs on the same inputs give the same bits.
//
// This header is plain C++ (g++ compiles the callers); the kernels are in the .cu files.
//
// fp32 for every operation; bf16 (bf16 storage, fp32 accumulation) for the products (the linear
// layers' and the tied output layer's), layer norm, GELU, the residual add and the bias gradients'
// column sums, and conversions for the operations that stay in fp32 (attention's softmax, the
// loss, the embeddings, AdamW on the fp32 master weights): train_gpt --precision bf16.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

namespace train_gpt::cuda {

using bf16 = __nv_bfloat16;

/// How the fp32 matrix products compute: `fp32` multiplies in full single precision (what the CPU
/// path does, so results agree to rounding); `tf32` lets cuBLASLt use tensor cores with 10-bit
/// mantissa inputs (about 8x faster on H100/H200, and 1e-3 relative error).
enum class gemm_math { fp32, tf32 };

/// How attention computes: `fp32` on the CUDA cores, one row per thread (what the CPU path does,
/// so results agree to rounding); `tensor_cores_bf16` on the tensor cores (compute capability 8.0+):
/// q, k, v, the output gradient, the probabilities and their gradients rounded to bf16 as the
/// products' operands (relative 2^-9 each), the softmax and every sum in fp32; train_gpt
/// --precision bf16.
enum class attention_math { fp32, tensor_cores_bf16 };

/// cpu_kernels::adamw_settings, field for field.
struct adamw_settings {
  float lr = 3e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

class kernels {
 public:
  /// Enqueues everything on `stream` (not owned). attention_math::tensor_cores_bf16 on a GPU older than
  /// compute capability 8.0 throws std::invalid_argument.
  explicit kernels(cudaStream_t stream, gemm_math math = gemm_math::fp32,
                   attention_math attention = attention_math::fp32);
  ~kernels();
  kernels(const kernels&) = delete;
  kernels& operator=(const kernels&) = delete;

  cudaStream_t stream() const noexcept;

  // ---- linear layers (gemm.cu) -------------------------------------------------------------

  /// y[T,out] = x[T,in] W[in,out] (+ b): the bias through cuBLASLt's epilogue; `bias` may be null.
  void linear_forward(const float* x, const float* w, const float* bias, float* y, std::size_t tokens,
                      std::size_t in, std::size_t out);
  /// pre = x W + b and y = gelu(pre) (the MLP's c_fc and its activation): in one product with
  /// cuBLASLt's GELU epilogue, which writes both, when `out` is a multiple of 8 (the epilogue's
  /// alignment rule) and cuBLASLt has an algorithm for it; otherwise the product, then
  /// gelu_forward. Returns whether the epilogue did it.
  bool linear_forward_gelu(const float* x, const float* w, const float* bias, float* pre, float* y,
                           std::size_t tokens, std::size_t in, std::size_t out);
  /// dx = dy W^T (overwrites).
  void linear_backward_input(const float* w, const float* dy, float* dx, std::size_t tokens, std::size_t in,
                             std::size_t out);
  /// dW += x^T dy; db += column sums of dy (`dbias` may be null).
  void linear_backward_weight(const float* x, const float* dy, float* dw, float* dbias, std::size_t tokens,
                              std::size_t in, std::size_t out);
  /// bf16 storage, fp32 accumulation (the bias added in fp32 before rounding).
  void linear_forward(const bf16* x, const bf16* w, const bf16* bias, bf16* y, std::size_t tokens, std::size_t in,
                      std::size_t out);
  void linear_backward_input(const bf16* w, const bf16* dy, bf16* dx, std::size_t tokens, std::size_t in,
                             std::size_t out);
  /// dW (fp32, the master gradient) += x^T dy, from bf16 activations.
  void linear_backward_weight(const bf16* x, const bf16* dy, float* dw, std::size_t tokens, std::size_t in,
                              std::size_t out);

  /// logits[T,V] = h[T,C] wte^T.
  void logits_forward(const float* h, const float* wte, float* logits, std::size_t tokens, std::size_t c,
                      std::size_t vocab);
  /// dh = dlogits wte (overwrites).
  void logits_backward_input(const float* wte, const float* dlogits, float* dh, std::size_t tokens, std::size_t c,
                             std::size_t vocab);
  /// dwte += dlogits^T h.
  void logits_backward_weight(const float* h, const float* dlogits, float* dwte, std::size_t tokens, std::size_t c,
                              std::size_t vocab);

  /// bf16 h and wte, fp32 logits (the loss is computed in fp32).
  void logits_forward(const bf16* h, const bf16* wte, float* logits, std::size_t tokens, std::size_t c,
                      std::size_t vocab);
  void logits_backward_input(const bf16* wte, const bf16* dlogits, bf16* dh, std::size_t tokens, std::size_t c,
                             std::size_t vocab);
  /// dwte (fp32, the master gradient) += dlogits^T h.
  void logits_backward_weight(const bf16* h, const bf16* dlogits, float* dwte, std::size_t tokens, std::size_t c,
                              std::size_t vocab);

  // ---- fp32 <-> bf16 (convert.cu) ---------------------------------------------------------------

  /// to[i] = from[i], rounded to the nearest bf16 (ties to even) or widened exactly.
  void convert(const float* from, bf16* to, std::size_t n);
  void convert(const bf16* from, float* to, std::size_t n);
  /// Columns [0, width) of `rows` rows: to[r * to_width + j] = from[r * from_width + j], converted;
  /// the rest of `to` is left alone.
  void convert_columns(const float* from, std::size_t from_width, bf16* to, std::size_t to_width, std::size_t width,
                       std::size_t rows);
  void convert_columns(const bf16* from, std::size_t from_width, float* to, std::size_t to_width, std::size_t width,
                       std::size_t rows);

  // ---- reductions over rows, elementwise (elementwise.cu) -----------------------------------

  /// db[out] += column sums of dy[T, out], in a fixed order.
  void column_sums(const float* dy, float* db, std::size_t tokens, std::size_t out);
  /// From bf16 dy, summed in fp32 in the same order.
  void column_sums(const bf16* dy, float* db, std::size_t tokens, std::size_t out);
  /// GELU, tanh form (as GPT-2 and cpu_kernels).
  void gelu_forward(const float* x, float* y, std::size_t n);
  void gelu_forward(const bf16* x, bf16* y, std::size_t n);
  /// dx = dy * gelu'(x) (overwrites).
  void gelu_backward(const float* x, const float* dy, float* dx, std::size_t n);
  void gelu_backward(const bf16* x, const bf16* dy, bf16* dx, std::size_t n);
  /// y = x + out + bias per row ([T, C]).
  void residual_add(const float* x, const float* out, const float* bias, float* y, std::size_t tokens,
                    std::size_t c);
  void residual_add(const bf16* x, const bf16* out, const bf16* bias, bf16* y, std::size_t tokens, std::size_t c);

  // ---- layer norm (layernorm.cu) ----------------------------------------------------------

  void layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                         std::size_t tokens, std::size_t c, float eps = 1e-5f);
  /// dx += the input gradient.
  void layernorm_backward_input(const float* x, const float* w, const float* mean, const float* rstd,
                                const float* dy, float* dx, std::size_t tokens, std::size_t c);
  /// dw += sum over rows of x̂ dy, db += sum of dy, in a fixed order.
  void layernorm_backward_params(const float* x, const float* mean, const float* rstd, const float* dy, float* dw,
                                 float* db, std::size_t tokens, std::size_t c);
  /// bf16 activations and parameters; fp32 statistics, sums and parameter gradients.
  void layernorm_forward(const bf16* x, const bf16* w, const bf16* b, bf16* y, float* mean, float* rstd,
                         std::size_t tokens, std::size_t c, float eps = 1e-5f);
  void layernorm_backward_input(const bf16* x, const bf16* w, const float* mean, const float* rstd, const bf16* dy,
                                bf16* dx, std::size_t tokens, std::size_t c);
  void layernorm_backward_params(const bf16* x, const float* mean, const float* rstd, const bf16* dy, float* dw,
                                 float* db, std::size_t tokens, std::size_t c);

  // ---- embeddings (embedding.cu) ------------------------------------------------------------

  /// x[t] = wte[token[t]] + wpe[position[t]]; tokens and positions are device arrays of `n`. A
  /// token of -1 looks up a zero row, and a null `wpe` adds no positions (tensor parallelism: each
  /// rank's vocabulary block, summed over tp, then add_positions).
  void embedding_forward(const std::int32_t* tokens, const std::int64_t* positions, const float* wte,
                         const float* wpe, float* x, std::size_t n, std::size_t c);
  /// x[t] += wpe[position[t]].
  void add_positions(const std::int64_t* positions, const float* wpe, float* x, std::size_t n, std::size_t c);
  /// dwte[token[t]] += dx[t], dwpe[position[t]] += dx[t], deterministically: rows sorted by index
  /// (a stable radix sort) and each index's rows summed in their order by one block. Rows whose
  /// token is -1 add nothing to dwte.
  void embedding_backward(const std::int32_t* tokens, const std::int64_t* positions, const float* dx, float* dwte,
                          float* dwpe, std::size_t n, std::size_t c);

  // ---- the loss (cross_entropy.cu) ----------------------------------------------------------

  /// cpu_kernels::cross_entropy on one rank's full rows: each row's loss into `row_losses`
  /// (device, double, [rows]); `logits` [rows, vocab] overwritten with the gradient of (sum of
  /// losses) * scale. Labels are device int32 within [0, vocab).
  void cross_entropy(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t vocab, float scale,
                     double* row_losses);
  /// The vocabulary-parallel loss (weft::tp::vocab_parallel_cross_entropy) in three device steps,
  /// with the caller's two all-reduces between them. `logits` is [rows, cols]: this rank's real
  /// vocabulary columns, token ids [first, first + cols).
  ///  1. row_max: max[t] = the row's maximum (the lowest float when cols = 0); all-reduce max.
  void cross_entropy_row_max(const float* logits, std::size_t rows, std::size_t cols, float* max);
  ///  2. exp_sums: logits become e^(l - max); sums[t] = their sum, sums[rows + t] = the label's
  ///     logit where this rank owns the label, else 0 (doubles); all-reduce sum.
  void cross_entropy_exp_sums(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t cols,
                              std::size_t first, const float* max, double* sums);
  ///  3. finish: logits become the gradient of (sum of losses) * scale; row_losses[t] (may be null).
  void cross_entropy_finish(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t cols,
                            std::size_t first, const float* max, const double* sums, float scale,
                            double* row_losses);

  // ---- optimizer (adamw.cu) --------------------------------------------------------------------

  /// cpu_kernels::adamw, operation for operation (no fused multiply-adds), so the step is
  /// bit-identical to the CPU's.
  void adamw(float* param, const float* grad, float* m, float* v, std::size_t n, long step,
             const adamw_settings& s, bool decay);

  // ---- causal attention (attention.cu) --------------------------------------------------------

  /// A flash-style kernel (Dao et al.): scores never leave the chip; online softmax over key
  /// tiles; on the tensor cores under attention_math::tensor_cores_bf16. q [nq, heads, head_dim],
  /// k and v [nk, heads, head_dim], out likewise, lse [nq, heads]; positions are device int64
  /// arrays; with `causal`, query i sees key j when k_pos[j] <= q_pos[i] (a row that sees none
  /// gets out 0, lse -inf). head_dim <= 128.
  void attention_forward(const float* q, const float* k, const float* v, const std::int64_t* q_pos,
                         const std::int64_t* k_pos, std::size_t nq, std::size_t nk, std::size_t heads,
                         std::size_t head_dim, float scale, bool causal, float* out, float* lse);
  /// dq, dk, dv += the gradients (as blas_attention::backward); deterministic (dq by query row,
  /// dk and dv by key row: no atomics).
  void attention_backward(const float* q, const float* k, const float* v, const std::int64_t* q_pos,
                          const std::int64_t* k_pos, std::size_t nq, std::size_t nk, std::size_t heads,
                          std::size_t head_dim, float scale, bool causal, const float* out, const float* lse,
                          const float* dout, float* dq, float* dk, float* dv);

  /// Ring attention's fold of one key block into the running result (weft::cp::ring_attention's
  /// kernel.merge): per query row and head, lse = log(e^lse + e^block_lse) and out the two
  /// outputs weighted by their share of it; out, block_out [rows, heads, head_dim], lse and
  /// block_lse [rows, heads], -inf where no key was visible.
  void attention_merge(float* out, float* lse, const float* block_out, const float* block_lse, std::size_t rows,
                       std::size_t heads, std::size_t head_dim);
  /// data[i] = value.
  void fill(float* data, std::size_t n, float value);

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace train_gpt::cuda
