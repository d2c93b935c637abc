// Layer norm: one warp per row for forward and the input gradient (two passes over the row, the
// variance from the centred values as the CPU path computes it); the parameter gradients as
// fixed-order column sums.

#include "column_reduce.cuh"

namespace train_gpt::cuda {

namespace {

constexpr unsigned warps_per_block = 8;

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void layernorm_forward_kernel(const float* x, const float* w, const float* b, float* y, float* mean,
                                         float* rstd, std::size_t tokens, std::size_t c, float eps) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(warps_per_block) + threadIdx.y;
  if (t >= tokens) return;
  const float* xt = x + t * c;
  float s = 0;
  for (std::size_t i = threadIdx.x; i < c; i += 32) s += xt[i];
  const float m = warp_sum(s) / static_cast<float>(c);
  float v = 0;
  for (std::size_t i = threadIdx.x; i < c; i += 32) v += (xt[i] - m) * (xt[i] - m);
  const float r = 1.0f / sqrtf(warp_sum(v) / static_cast<float>(c) + eps);
  float* yt = y + t * c;
  for (std::size_t i = threadIdx.x; i < c; i += 32) yt[i] = (xt[i] - m) * r * w[i] + b[i];
  if (threadIdx.x == 0) {
    mean[t] = m;
    rstd[t] = r;
  }
}

__global__ void layernorm_backward_input_kernel(const float* x, const float* w, const float* mean, const float* rstd,
                                                const float* dy, float* dx, std::size_t tokens, std::size_t c) {
  const std::size_t t = blockIdx.x * static_cast<std::size_t>(warps_per_block) + threadIdx.y;
  if (t >= tokens) return;
  const float* xt = x + t * c;
  const float* dyt = dy + t * c;
  const float m = mean[t], r = rstd[t];
  float dn = 0, dn_xhat = 0;
  for (std::size_t i = threadIdx.x; i < c; i += 32) {
    const float d = w[i] * dyt[i];
    dn += d;
    dn_xhat += d * (xt[i] - m) * r;
  }
  const float mean_dn = warp_sum(dn) / static_cast<float>(c), mean_dn_xhat = warp_sum(dn_xhat) / static_cast<float>(c);
  float* dxt = dx + t * c;
  for (std::size_t i = threadIdx.x; i < c; i += 32)
    dxt[i] += (w[i] * dyt[i] - mean_dn - (xt[i] - m) * r * mean_dn_xhat) * r;
}

/// (x̂ dy, dy) of one element: what the weight's and the bias's gradients sum.
struct norm_param_grads {
  const float *x, *mean, *rstd, *dy;
  std::size_t c;
  __device__ float2 operator()(std::size_t t, std::size_t i) const {
    const float d = dy[t * c + i];
    return {(x[t * c + i] - mean[t]) * rstd[t] * d, d};
  }
};

}  // namespace

void kernels::layernorm_forward(const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                                std::size_t tokens, std::size_t c, float eps) {
  if (tokens == 0) return;
  layernorm_forward_kernel<<<detail::blocks_for(tokens, warps_per_block), dim3(32, warps_per_block), 0, impl_->stream>>>(
      x, w, b, y, mean, rstd, tokens, c, eps);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::layernorm_backward_input(const float* x, const float* w, const float* mean, const float* rstd,
                                       const float* dy, float* dx, std::size_t tokens, std::size_t c) {
  if (tokens == 0) return;
  layernorm_backward_input_kernel<<<detail::blocks_for(tokens, warps_per_block), dim3(32, warps_per_block), 0,
                                    impl_->stream>>>(x, w, mean, rstd, dy, dx, tokens, c);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::layernorm_backward_params(const float* x, const float* mean, const float* rstd, const float* dy,
                                        float* dw, float* db, std::size_t tokens, std::size_t c) {
  detail::column_reduce(*impl_, norm_param_grads{x, mean, rstd, dy, c}, tokens, c, dw, db);
}

}  // namespace train_gpt::cuda
