// Per-element operations (GELU, the residual add) and the bias gradient's column sums.

#include "column_reduce.cuh"

namespace train_gpt::cuda {

namespace {

constexpr unsigned block = 256;
constexpr float sqrt_2_over_pi = 0.7978845608028654f;

__device__ inline float load(const float* p, std::size_t i) { return p[i]; }
__device__ inline float load(const bf16* p, std::size_t i) { return __bfloat162float(p[i]); }
__device__ inline void store(float* p, std::size_t i, float v) { p[i] = v; }
__device__ inline void store(bf16* p, std::size_t i, float v) { p[i] = __float2bfloat16(v); }

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// As cpu_kernels: 0.5 u (1 + tanh y) = u sigmoid(2 y), y = sqrt(2/pi) (u + 0.044715 u^3).
template <class T>
__global__ void gelu_forward_kernel(const T* x, T* y, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float u = load(x, i);
  store(y, i, u * sigmoid(2.0f * sqrt_2_over_pi * (u + 0.044715f * u * u * u)));
}

template <class T>
__global__ void gelu_backward_kernel(const T* x, const T* dy, T* dx, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float u = load(x, i);
  const float s = sigmoid(2.0f * sqrt_2_over_pi * (u + 0.044715f * u * u * u));
  const float grad = s + 2.0f * u * s * (1.0f - s) * sqrt_2_over_pi * (1.0f + 3.0f * 0.044715f * u * u);
  store(dx, i, load(dy, i) * grad);
}

template <class T>
__global__ void residual_add_kernel(const T* x, const T* out, const T* bias, T* y, std::size_t tokens, std::size_t c) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= tokens * c) return;
  store(y, i, load(x, i) + load(out, i) + load(bias, i % c));
}

template <class T>
struct column_of {
  const T* dy;
  std::size_t cols;
  __device__ float2 operator()(std::size_t t, std::size_t j) const { return {load(dy, t * cols + j), 0.0f}; }
};

template <class T>
void gelu_forward_on(cudaStream_t s, const T* x, T* y, std::size_t n) {
  if (n == 0) return;
  gelu_forward_kernel<<<detail::blocks_for(n, block), block, 0, s>>>(x, y, n);
  TRAIN_GPT_CUDA_LAUNCHED();
}
template <class T>
void gelu_backward_on(cudaStream_t s, const T* x, const T* dy, T* dx, std::size_t n) {
  if (n == 0) return;
  gelu_backward_kernel<<<detail::blocks_for(n, block), block, 0, s>>>(x, dy, dx, n);
  TRAIN_GPT_CUDA_LAUNCHED();
}
template <class T>
void residual_add_on(cudaStream_t s, const T* x, const T* out, const T* bias, T* y, std::size_t tokens, std::size_t c) {
  if (tokens * c == 0) return;
  residual_add_kernel<<<detail::blocks_for(tokens * c, block), block, 0, s>>>(x, out, bias, y, tokens, c);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace

void kernels::column_sums(const float* dy, float* db, std::size_t tokens, std::size_t out) {
  detail::column_reduce(*impl_, column_of<float>{dy, out}, tokens, out, db, nullptr);
}
void kernels::column_sums(const bf16* dy, float* db, std::size_t tokens, std::size_t out) {
  detail::column_reduce(*impl_, column_of<bf16>{dy, out}, tokens, out, db, nullptr);
}

void kernels::gelu_forward(const float* x, float* y, std::size_t n) { gelu_forward_on(impl_->stream, x, y, n); }
void kernels::gelu_forward(const bf16* x, bf16* y, std::size_t n) { gelu_forward_on(impl_->stream, x, y, n); }
void kernels::gelu_backward(const float* x, const float* dy, float* dx, std::size_t n) {
  gelu_backward_on(impl_->stream, x, dy, dx, n);
}
void kernels::gelu_backward(const bf16* x, const bf16* dy, bf16* dx, std::size_t n) {
  gelu_backward_on(impl_->stream, x, dy, dx, n);
}
void kernels::residual_add(const float* x, const float* out, const float* bias, float* y, std::size_t tokens,
                           std::size_t c) {
  residual_add_on(impl_->stream, x, out, bias, y, tokens, c);
}
void kernels::residual_add(const bf16* x, const bf16* out, const bf16* bias, bf16* y, std::size_t tokens,
                           std::size_t c) {
  residual_add_on(impl_->stream, x, out, bias, y, tokens, c);
}

}  // namespace train_gpt::cuda
