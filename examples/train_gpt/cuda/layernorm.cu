// Layer norm: one warp per row for forward and the input gradient (two passes over the row, the
// variance from the centred values as the CPU path computes it); the parameter gradients as
// fixed-order column sums. In fp32, and in bf16 (bf16 activations and parameters, fp32 statistics,
// sums and parameter gradients).

#include "column_reduce.cuh"

namespace train_gpt::cuda {

namespace {

constexpr unsigned warps_per_block = 8;

__device__ inline float load(const float* p, std::size_t i) { return p[i]; }
__device__ inline float load(const bf16* p, std::size_t i) { return __bfloat162float(p[i]); }
__device__ inline void store(float* p, std::size_t i, float v) { p[i] = v; }
__device__ inline void store(bf16* p, std::size_t i, float v) { p[i] = __float2bfloat16(v); }

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T>
__global__ void layernorm_forward_kernel(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd,
                                         std::size_t tokens, std::size_t c, float eps) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(warps_per_block) + threadIdx.y;
  if (t >= tokens) return;
  const T* xt = x + t * c;
  float s = 0;
  for (std::size_t i = threadIdx.x; i < c; i += 32) s += load(xt, i);
  const float m = warp_sum(s) / static_cast<float>(c);
  float v = 0;
  for (std::size_t i = threadIdx.x; i < c; i += 32) v += (load(xt, i) - m) * (load(xt, i) - m);
  const float r = 1.0f / sqrtf(warp_sum(v) / static_cast<float>(c) + eps);
  T* yt = y + t * c;
  for (std::size_t i = threadIdx.x; i < c; i += 32) store(yt, i, (load(xt, i) - m) * r * load(w, i) + load(b, i));
  if (threadIdx.x == 0) {
    mean[t] = m;
    rstd[t] = r;
  }
}

template <class T>
__global__ void layernorm_backward_input_kernel(const T* x, const T* w, const float* mean, const float* rstd,
                                                const T* dy, T* dx, std::size_t tokens, std::size_t c) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(warps_per_block) + threadIdx.y;
  if (t >= tokens) return;
  const T* xt = x + t * c;
  const T* dyt = dy + t * c;
  const float m = mean[t], r = rstd[t];
  float dn = 0, dn_xhat = 0;
  for (std::size_t i = threadIdx.x; i < c; i += 32) {
    const float d = load(w, i) * load(dyt, i);
    dn += d;
    dn_xhat += d * (load(xt, i) - m) * r;
  }
  const float mean_dn = warp_sum(dn) / static_cast<float>(c), mean_dn_xhat = warp_sum(dn_xhat) / static_cast<float>(c);
  T* dxt = dx + t * c;
  for (std::size_t i = threadIdx.x; i < c; i += 32)
    store(dxt, i, load(dxt, i) + (load(w, i) * load(dyt, i) - mean_dn - (load(xt, i) - m) * r * mean_dn_xhat) * r);
}

/// (x̂ dy, dy) of one element: what the weight's and the bias's gradients sum.
template <class T>
struct norm_param_grads {
  const T* x;
  const float *mean, *rstd;
  const T* dy;
  std::size_t c;
  __device__ float2 operator()(std::size_t t, std::size_t i) const {
    const float d = load(dy, t * c + i);
    return {(load(x, t * c + i) - mean[t]) * rstd[t] * d, d};
  }
};

template <class T>
void forward_on(kernels::impl& k, const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, std::size_t tokens,
                std::size_t c, float eps) {
  if (tokens == 0) return;
  layernorm_forward_kernel<<<detail::blocks_for(tokens, warps_per_block), dim3(32, warps_per_block), 0, k.stream>>>(
      x, w, b, y, mean, rstd, tokens, c, eps);
  TRAIN_GPT_CUDA_LAUNCHED();
}
template <class T>
void backward_input_on(kernels::impl& k, const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx,
                       std::size_t tokens, std::size_t c) {
  if (tokens == 0) return;
  layernorm_backward_input_kernel<<<detail::blocks_for(tokens, warps_per_block), dim3(32, warps_per_block), 0,
                                    k.stream>>>(x, w, mean, rstd, dy, dx, tokens, c);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace

void kernels::layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                                std::size_t tokens, std::size_t c, float eps) {
  forward_on(*impl_, x, w, b, y, mean, rstd, tokens, c, eps);
}
void kernels::layernorm_forward(const bf16* x, const bf16* w, const bf16* b, bf16* y, float* mean, float* rstd,
                                std::size_t tokens, std::size_t c, float eps) {
  forward_on(*impl_, x, w, b, y, mean, rstd, tokens, c, eps);
}

void kernels::layernorm_backward_input(const float* x, const float* w, const float* mean, const float* rstd,
                                       const float* dy, float* dx, std::size_t tokens, std::size_t c) {
  backward_input_on(*impl_, x, w, mean, rstd, dy, dx, tokens, c);
}
void kernels::layernorm_backward_input(const bf16* x, const bf16* w, const float* mean, const float* rstd,
                                       const bf16* dy, bf16* dx, std::size_t tokens, std::size_t c) {
  backward_input_on(*impl_, x, w, mean, rstd, dy, dx, tokens, c);
}

void kernels::layernorm_backward_params(const float* x, const float* mean, const float* rstd, const float* dy,
                                        float* dw, float* db, std::size_t tokens, std::size_t c) {
  detail::column_reduce(*impl_, norm_param_grads<float>{x, mean, rstd, dy, c}, tokens, c, dw, db);
}
void kernels::layernorm_backward_params(const bf16* x, const float* mean, const float* rstd, const bf16* dy,
                                        float* dw, float* db, std::size_t tokens, std::size_t c) {
  detail::column_reduce(*impl_, norm_param_grads<bf16>{x, mean, rstd, dy, c}, tokens, c, dw, db);
}

}  // namespace train_gpt::cuda
