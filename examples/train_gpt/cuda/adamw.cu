// Fused AdamW: one pass over the parameters, their gradients and both moments. Every operation is
// written with the round-to-nearest intrinsics, in cpu_kernels::adamw's order, so that nvcc
// contracts nothing into a fused multiply-add and the step equals the CPU's bit for bit.

#include <cmath>

#include "detail.cuh"

namespace train_gpt::cuda {

namespace {

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, std::size_t n, adamw_settings s,
                             float c1, float c2, float wd) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float g = grad[i];
  const float mi = __fadd_rn(__fmul_rn(s.beta1, m[i]), __fmul_rn(__fsub_rn(1.0f, s.beta1), g));
  const float vi = __fadd_rn(__fmul_rn(s.beta2, v[i]), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, s.beta2), g), g));
  m[i] = mi;
  v[i] = vi;
  const float mhat = __fdiv_rn(mi, c1), vhat = __fdiv_rn(vi, c2);
  const float p = param[i];
  const float update = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), s.eps)), __fmul_rn(wd, p));
  param[i] = __fsub_rn(p, __fmul_rn(s.lr, update));
}

}  // namespace

void kernels::adamw(float* param, const float* grad, float* m, float* v, std::size_t n, long step,
                    const adamw_settings& s, bool decay) {
  if (n == 0) return;
  // The bias corrections on the host, as the CPU path computes them (std::pow in float).
  const float c1 = 1.0f - std::pow(s.beta1, static_cast<float>(step));
  const float c2 = 1.0f - std::pow(s.beta2, static_cast<float>(step));
  adamw_kernel<<<detail::blocks_for(n, 256), 256, 0, impl_->stream>>>(param, grad, m, v, n, s, c1, c2,
                                                                       decay ? s.weight_decay : 0.0f);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace train_gpt::cuda
