// The loss fused with the softmax over a chunk of logits, one block per row, the logits turned
// into their gradient in place (llm.c's fused classifier; the CPU path's chunked loss). The sum
// of exponentials is kept in double, as on the CPU. The vocabulary-parallel form is the same
// arithmetic cut at the two all-reduces weft::tp::vocab_parallel_cross_entropy makes.

#include <cfloat>

#include "detail.cuh"

namespace train_gpt::cuda {

namespace {

constexpr unsigned block = 512;

template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* shared) {
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  T r = shared[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w) r = op(r, shared[w]);  // the same order in every thread
  return r;
}
struct max_op {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct sum_op {
  __device__ double operator()(double a, double b) const { return a + b; }
};

__device__ float row_max(const float* row, std::size_t cols) {
  __shared__ float shared[block / 32];
  float m = -FLT_MAX;
  for (std::size_t j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, row[j]);
  return block_reduce(m, max_op{}, shared);
}

/// row[j] = e^(row[j] - max); returns the sum (double).
__device__ double exp_and_sum(float* row, std::size_t cols, float max) {
  __shared__ double shared[block / 32];
  double s = 0;
  for (std::size_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const float e = expf(row[j] - max);
    row[j] = e;
    s += static_cast<double>(e);
  }
  return block_reduce(s, sum_op{}, shared);
}

__global__ void cross_entropy_kernel(float* logits, const std::int32_t* labels, std::size_t vocab, float scale,
                                     double* row_losses) {
  float* row = logits + blockIdx.x * vocab;
  const auto label = static_cast<std::size_t>(labels[blockIdx.x]);
  const float max = row_max(row, vocab);
  const float label_logit = row[label];
  __syncthreads();  // every thread has read the label's logit before it is overwritten
  const double sum = exp_and_sum(row, vocab, max);
  const float to_probability = static_cast<float>(static_cast<double>(scale) / sum);
  for (std::size_t j = threadIdx.x; j < vocab; j += blockDim.x) row[j] = row[j] * to_probability - (j == label ? scale : 0.0f);
  if (threadIdx.x == 0) row_losses[blockIdx.x] = log(sum) + static_cast<double>(max) - static_cast<double>(label_logit);
}

__global__ void row_max_kernel(const float* logits, std::size_t cols, float* max) {
  const float m = row_max(logits + blockIdx.x * cols, cols);
  if (threadIdx.x == 0) max[blockIdx.x] = m;
}

__global__ void exp_sums_kernel(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t cols,
                                std::size_t first, const float* max, double* sums) {
  float* row = logits + blockIdx.x * cols;
  const auto label = static_cast<std::size_t>(labels[blockIdx.x]);
  const bool owned = label >= first && label < first + cols;
  const double target = owned ? static_cast<double>(row[label - first]) : 0.0;
  __syncthreads();
  const double sum = exp_and_sum(row, cols, max[blockIdx.x]);
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = sum;
    sums[rows + blockIdx.x] = target;
  }
}

__global__ void finish_kernel(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t cols,
                              std::size_t first, const float* max, const double* sums, float scale, double* row_losses) {
  float* row = logits + blockIdx.x * cols;
  const double sum = sums[blockIdx.x];
  const auto label = static_cast<std::size_t>(labels[blockIdx.x]);
  const float to_probability = static_cast<float>(static_cast<double>(scale) / sum);
  for (std::size_t j = threadIdx.x; j < cols; j += blockDim.x)
    row[j] = row[j] * to_probability - (first + j == label ? scale : 0.0f);
  if (threadIdx.x == 0 && row_losses != nullptr)
    row_losses[blockIdx.x] = log(sum) + static_cast<double>(max[blockIdx.x]) - sums[rows + blockIdx.x];
}

}  // namespace

void kernels::cross_entropy(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t vocab, float scale,
                            double* row_losses) {
  if (rows == 0) return;
  cross_entropy_kernel<<<static_cast<unsigned>(rows), block, 0, impl_->stream>>>(logits, labels, vocab, scale, row_losses);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::cross_entropy_row_max(const float* logits, std::size_t rows, std::size_t cols, float* max) {
  if (rows == 0) return;
  row_max_kernel<<<static_cast<unsigned>(rows), block, 0, impl_->stream>>>(logits, cols, max);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::cross_entropy_exp_sums(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t cols,
                                     std::size_t first, const float* max, double* sums) {
  if (rows == 0) return;
  exp_sums_kernel<<<static_cast<unsigned>(rows), block, 0, impl_->stream>>>(logits, labels, rows, cols, first, max, sums);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::cross_entropy_finish(float* logits, const std::int32_t* labels, std::size_t rows, std::size_t cols,
                                   std::size_t first, const float* max, const double* sums, float scale,
                                   double* row_losses) {
  if (rows == 0) return;
  finish_kernel<<<static_cast<unsigned>(rows), block, 0, impl_->stream>>>(logits, labels, rows, cols, first, max, sums,
                                                                         scale, row_losses);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace train_gpt::cuda
