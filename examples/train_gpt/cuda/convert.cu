// Conversions between fp32 and bf16 (round to nearest even; bf16 to fp32 is exact), of whole
// arrays and of column ranges of row-major matrices: what the bf16 trainer uses where a bf16
// product meets an fp32 operation (the master weights' bf16 copy, attention's fp32 q, k and v
// cut from the bf16 c_attn output and its gradients joined back, the loss's fp32 logits and
// their bf16 gradient).

#include "detail.cuh"

namespace train_gpt::cuda {

namespace {

constexpr unsigned block = 256;

__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(bf16 v) { return __bfloat162float(v); }
template <class To>
__device__ inline To from_float(float v);
template <>
__device__ inline float from_float<float>(float v) { return v; }
template <>
__device__ inline bf16 from_float<bf16>(float v) { return __float2bfloat16_rn(v); }

/// to[r * to_width + j] = from[r * from_width + j] for j < width, one thread an element.
template <class From, class To>
__global__ void convert_columns_kernel(const From* from, std::size_t from_width, To* to, std::size_t to_width,
                                       std::size_t width, std::size_t rows) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * width) return;
  const std::size_t r = i / width, j = i % width;
  to[r * to_width + j] = from_float<To>(to_float(from[r * from_width + j]));
}

template <class From, class To>
void convert_columns_on(cudaStream_t s, const From* from, std::size_t from_width, To* to, std::size_t to_width,
                        std::size_t width, std::size_t rows) {
  if (rows * width == 0) return;
  convert_columns_kernel<<<detail::blocks_for(rows * width, block), block, 0, s>>>(from, from_width, to, to_width, width,
                                                                                 rows);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace

void kernels::convert(const float* from, bf16* to, std::size_t n) { convert_columns_on(impl_->stream, from, n, to, n, n, 1); }
void kernels::convert(const bf16* from, float* to, std::size_t n) { convert_columns_on(impl_->stream, from, n, to, n, n, 1); }

void kernels::convert_columns(const float* from, std::size_t from_width, bf16* to, std::size_t to_width,
                              std::size_t width, std::size_t rows) {
  convert_columns_on(impl_->stream, from, from_width, to, to_width, width, rows);
}
void kernels::convert_columns(const bf16* from, std::size_t from_width, float* to, std::size_t to_width,
                              std::size_t width, std::size_t rows) {
  convert_columns_on(impl_->stream, from, from_width, to, to_width, width, rows);
}

}  // namespace train_gpt::cuda
