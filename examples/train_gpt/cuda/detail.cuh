#pragma once
// What the .cu files share: error checks, the stream-ordered scratch memory and the cuBLASLt
// state behind train_gpt::cuda::kernels.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels.hpp"

namespace train_gpt::cuda::detail {

inline void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("train_gpt cuda: ") + what + " failed at " + file + ":" +
                             std::to_string(line) + ": " + cudaGetErrorString(e));
}
inline void check(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("train_gpt cuda: ") + what + " failed at " + file + ":" +
                             std::to_string(line) + ": cuBLAS status " + std::to_string(static_cast<int>(s)));
}

/// Blocks of `block` threads to cover `n` items.
inline unsigned blocks_for(std::size_t n, unsigned block) { return static_cast<unsigned>((n + block - 1) / block); }

/// Calls f with the padded head width the attention kernels hold `head_dim` in (32, 64 or 128;
/// the padding is zeros).
template <class F>
void with_head_width(std::size_t head_dim, F&& f) {
  if (head_dim == 0 || head_dim > 128)
    throw std::invalid_argument("train_gpt cuda attention: head_dim " + std::to_string(head_dim) +
                                " is not supported (1 to 128; GPT-2 uses 64)");
  if (head_dim <= 32) f(std::integral_constant<int, 32>{});
  else if (head_dim <= 64) f(std::integral_constant<int, 64>{});
  else f(std::integral_constant<int, 128>{});
}

/// Attention on the tensor cores (attention_bf16.cu): kernels::attention_forward and the
/// products of kernels::attention_backward (after delta = rowsum(dout * out)) under
/// attention_math::tensor_cores_bf16, with their arguments.
void attention_forward_bf16(cudaStream_t stream, const float* q, const float* k, const float* v,
                            const std::int64_t* q_pos, const std::int64_t* k_pos, std::size_t nq, std::size_t nk,
                            std::size_t heads, std::size_t head_dim, float scale, bool causal, float* out, float* lse);
void attention_backward_bf16(cudaStream_t stream, const float* q, const float* k, const float* v,
                             const std::int64_t* q_pos, const std::int64_t* k_pos, std::size_t nq, std::size_t nk,
                             std::size_t heads, std::size_t head_dim, float scale, bool causal, const float* lse,
                             const float* delta, const float* dout, float* dq, float* dk, float* dv);

/// Device memory that grows on demand, in stream order (no host synchronization).
class scratch {
 public:
  void* get(std::size_t bytes, cudaStream_t stream);
  void release(cudaStream_t stream) noexcept;

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace train_gpt::cuda::detail

#define TRAIN_GPT_CUDA_CHECK(call) ::train_gpt::cuda::detail::check((call), #call, __FILE__, __LINE__)
/// After a launch: the launch's own errors (bad configuration), without waiting for the kernel.
#define TRAIN_GPT_CUDA_LAUNCHED() TRAIN_GPT_CUDA_CHECK(cudaGetLastError())

namespace train_gpt::cuda {

struct kernels::impl {
  cudaStream_t stream;
  gemm_math math;
  attention_math attention;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  static constexpr std::size_t workspace_bytes = std::size_t{32} << 20;  // cuBLASLt's recommendation for Hopper
  /// The best algorithm cuBLASLt's heuristic gives for each product's shape and form (none: an
  /// optional epilogue it does not offer there).
  std::map<std::array<long long, 14>, std::optional<cublasLtMatmulAlgo_t>> algos;
  detail::scratch sort_keys, sort_values, sort_temp, partial, attention_delta;
};

}  // namespace train_gpt::cuda
