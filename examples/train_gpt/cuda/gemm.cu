// The matrix products through cuBLASLt, and the kernels object's own state (the handle, its
// workspace, the scratch memory). cuBLASLt is column-major; a row-major product C = op(A) op(B)
// is the column-major C^T = op(B)^T op(A)^T, so every call below swaps the operands.

#include <array>
#include <bit>
#include <cstdint>

#include "detail.cuh"
#include "products.hpp"

namespace train_gpt::cuda {

namespace detail {

void* scratch::get(std::size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_) return ptr_;
  release(stream);
  TRAIN_GPT_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  bytes_ = bytes;
  return ptr_;
}
void scratch::release(cudaStream_t stream) noexcept {
  if (ptr_ != nullptr) static_cast<void>(cudaFreeAsync(ptr_, stream));
  ptr_ = nullptr;
  bytes_ = 0;
}

namespace {

/// The largest power of two up to 256 that divides the address (what cuBLASLt's algorithms may assume).
int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (a == 0) return 256;
  return static_cast<int>(std::min<std::uintptr_t>(a & (~a + 1), 256));
}

struct desc_guard {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~desc_guard() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

/// Row-major C[M,N] = op(A) op(B) (+ beta C), A stored [M,K] ([K,M] when `ta`), B stored [K,N]
/// ([N,K] when `tb`), C [M,N]; with the epilogue's bias over N (and GELU, its input into `aux`).
/// Returns false, having done nothing, when cuBLASLt has no algorithm for it and `optional` is set.
bool gemm(kernels::impl& k, cudaDataType_t ab, cudaDataType_t cd, const row_major_product& p, const void* A,
          const void* B, void* C, float beta, cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT,
          const void* bias = nullptr, void* aux = nullptr, bool optional = false) {
  const bool ta = p.trans_a, tb = p.trans_b;
  const std::size_t M = p.M, N = p.N, K = p.K;
  if (M == 0 || N == 0) return true;
  const column_major_product cm = column_major(p);
  const cublasComputeType_t compute =
      ab == CUDA_R_32F && k.math == gemm_math::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  desc_guard d;
  TRAIN_GPT_CUDA_CHECK(cublasLtMatmulDescCreate(&d.op, compute, CUDA_R_32F));
  const cublasOperation_t opa = cm.trans_first ? CUBLAS_OP_T : CUBLAS_OP_N, opb = cm.trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
  TRAIN_GPT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
  TRAIN_GPT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
  TRAIN_GPT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
  if (bias != nullptr)
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  if (aux != nullptr) {
    const auto ld = static_cast<std::int64_t>(cm.ld_out);
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux));
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld));
  }
  // The column-major operands: B's storage first, then A's (products.hpp).
  TRAIN_GPT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&d.a, ab, cm.first_rows, cm.first_cols, static_cast<std::int64_t>(cm.first_ld)));
  TRAIN_GPT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&d.b, ab, cm.second_rows, cm.second_cols, static_cast<std::int64_t>(cm.second_ld)));
  TRAIN_GPT_CUDA_CHECK(cublasLtMatrixLayoutCreate(&d.c, cd, cm.m, cm.n, static_cast<std::int64_t>(cm.ld_out)));

  const std::array<long long, 14> key{ta, tb, static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                                      ab, cd, epilogue, beta != 0.0f, alignment_of(A), alignment_of(B), alignment_of(C),
                                      alignment_of(bias), alignment_of(aux)};
  auto found = k.algos.find(key);
  if (found == k.algos.end()) {
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
    const std::uint64_t ws = kernels::impl::workspace_bytes;
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    const std::uint32_t align_a = static_cast<std::uint32_t>(alignment_of(B)), align_b = static_cast<std::uint32_t>(alignment_of(A)),
                        align_c = static_cast<std::uint32_t>(alignment_of(C));
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a));
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b));
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c));
    TRAIN_GPT_CUDA_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c));
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    // An epilogue cuBLASLt does not offer for these types may come back as NOT_SUPPORTED or as no result.
    const cublasStatus_t status =
        cublasLtMatmulAlgoGetHeuristic(k.lt, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result, &returned);
    if ((status != CUBLAS_STATUS_SUCCESS || returned == 0) && optional) {
      k.algos.emplace(key, std::nullopt);
      return false;
    }
    TRAIN_GPT_CUDA_CHECK(status);
    if (returned == 0)
      throw std::runtime_error("train_gpt cuda: cuBLASLt has no algorithm for a " + std::to_string(M) + " x " +
                               std::to_string(N) + " x " + std::to_string(K) + " product with epilogue " +
                               std::to_string(static_cast<int>(epilogue)));
    found = k.algos.emplace(key, result.algo).first;
  }
  if (!found->second) return false;  // only optional products are remembered as missing
  const float alpha = 1.0f;
  TRAIN_GPT_CUDA_CHECK(cublasLtMatmul(k.lt, d.op, &alpha, B, d.a, A, d.b, &beta, C, d.c, C, d.c, &*found->second,
                                      k.workspace, kernels::impl::workspace_bytes, k.stream));
  return true;
}

}  // namespace detail

kernels::kernels(cudaStream_t stream, gemm_math math, attention_math attention) : impl_(std::make_unique<impl>()) {
  impl_->stream = stream;
  impl_->math = math;
  impl_->attention = attention;
  if (attention == attention_math::tensor_cores_bf16) {  // bf16 WMMA (attention_bf16.cu) needs Ampere or newer
    int device = 0, major = 0, minor = 0;
    TRAIN_GPT_CUDA_CHECK(cudaGetDevice(&device));
    TRAIN_GPT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TRAIN_GPT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major < 8)
      throw std::invalid_argument("train_gpt cuda: bf16 attention runs on tensor cores of compute capability 8.0 or "
                                  "newer; GPU " + std::to_string(device) + " is " + std::to_string(major) + "." +
                                  std::to_string(minor) + " (use --precision fp32)");
  }
  TRAIN_GPT_CUDA_CHECK(cublasLtCreate(&impl_->lt));
  TRAIN_GPT_CUDA_CHECK(cudaMallocAsync(&impl_->workspace, impl::workspace_bytes, stream));
}

kernels::~kernels() {
  impl& k = *impl_;
  for (detail::scratch* s : {&k.sort_keys, &k.sort_values, &k.sort_temp, &k.partial, &k.attention_delta}) s->release(k.stream);
  if (k.workspace) static_cast<void>(cudaFreeAsync(k.workspace, k.stream));
  if (k.lt) cublasLtDestroy(k.lt);
}

cudaStream_t kernels::stream() const noexcept { return impl_->stream; }

void kernels::linear_forward(const float* x, const float* w, const float* bias, float* y, std::size_t tokens,
                             std::size_t in, std::size_t out) {
  detail::gemm(*impl_, CUDA_R_32F, CUDA_R_32F, linear_forward_product(tokens, in, out), x, w, y, 0.0f,
               bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, bias);
}

bool kernels::linear_forward_gelu(const float* x, const float* w, const float* bias, float* pre, float* y,
                                  std::size_t tokens, std::size_t in, std::size_t out) {
  if (out % 8 == 0 && bias != nullptr &&
      detail::gemm(*impl_, CUDA_R_32F, CUDA_R_32F, linear_forward_product(tokens, in, out), x, w, y, 0.0f,
                   CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, pre, true))
    return true;
  linear_forward(x, w, bias, pre, tokens, in, out);
  gelu_forward(pre, y, tokens * out);
  return false;
}

void kernels::linear_backward_input(const float* w, const float* dy, float* dx, std::size_t tokens, std::size_t in,
                                    std::size_t out) {
  detail::gemm(*impl_, CUDA_R_32F, CUDA_R_32F, linear_backward_input_product(tokens, in, out), dy, w, dx, 0.0f);
}

void kernels::linear_backward_weight(const float* x, const float* dy, float* dw, float* dbias, std::size_t tokens,
                                     std::size_t in, std::size_t out) {
  detail::gemm(*impl_, CUDA_R_32F, CUDA_R_32F, linear_backward_weight_product(tokens, in, out), x, dy, dw, 1.0f);
  if (dbias != nullptr) column_sums(dy, dbias, tokens, out);
}

void kernels::linear_forward(const bf16* x, const bf16* w, const bf16* bias, bf16* y, std::size_t tokens,
                             std::size_t in, std::size_t out) {
  detail::gemm(*impl_, CUDA_R_16BF, CUDA_R_16BF, linear_forward_product(tokens, in, out), x, w, y, 0.0f,
               bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, bias);
}

void kernels::linear_backward_input(const bf16* w, const bf16* dy, bf16* dx, std::size_t tokens, std::size_t in,
                                    std::size_t out) {
  detail::gemm(*impl_, CUDA_R_16BF, CUDA_R_16BF, linear_backward_input_product(tokens, in, out), dy, w, dx, 0.0f);
}

void kernels::linear_backward_weight(const bf16* x, const bf16* dy, float* dw, std::size_t tokens, std::size_t in,
                                     std::size_t out) {
  detail::gemm(*impl_, CUDA_R_16BF, CUDA_R_32F, linear_backward_weight_product(tokens, in, out), x, dy, dw, 1.0f);
}

void kernels::logits_forward(const float* h, const float* wte, float* logits, std::size_t tokens, std::size_t c,
                             std::size_t vocab) {
  detail::gemm(*impl_, CUDA_R_32F, CUDA_R_32F, logits_forward_product(tokens, c, vocab), h, wte, logits, 0.0f);
}

void kernels::logits_backward_input(const float* wte, const float* dlogits, float* dh, std::size_t tokens,
                                    std::size_t c, std::size_t vocab) {
  detail::gemm(*impl_, CUDA_R_32F, CUDA_R_32F, logits_backward_input_product(tokens, c, vocab), dlogits, wte, dh, 0.0f);
}

void kernels::logits_backward_weight(const float* h, const float* dlogits, float* dwte, std::size_t tokens,
                                     std::size_t c, std::size_t vocab) {
  detail::gemm(*impl_, CUDA_R_32F, CUDA_R_32F, logits_backward_weight_product(tokens, c, vocab), dlogits, h, dwte, 1.0f);
}

void kernels::logits_forward(const bf16* h, const bf16* wte, float* logits, std::size_t tokens, std::size_t c,
                             std::size_t vocab) {
  detail::gemm(*impl_, CUDA_R_16BF, CUDA_R_32F, logits_forward_product(tokens, c, vocab), h, wte, logits, 0.0f);
}

void kernels::logits_backward_input(const bf16* wte, const bf16* dlogits, bf16* dh, std::size_t tokens, std::size_t c,
                                    std::size_t vocab) {
  detail::gemm(*impl_, CUDA_R_16BF, CUDA_R_16BF, logits_backward_input_product(tokens, c, vocab), dlogits, wte, dh, 0.0f);
}

void kernels::logits_backward_weight(const bf16* h, const bf16* dlogits, float* dwte, std::size_t tokens, std::size_t c,
                                     std::size_t vocab) {
  detail::gemm(*impl_, CUDA_R_16BF, CUDA_R_32F, logits_backward_weight_product(tokens, c, vocab), dlogits, h, dwte, 1.0f);
}

}  // namespace train_gpt::cuda
