#pragma once
// Sums over rows, per column, in a fixed order (no atomics): each block sums a band of rows into a
// partial row, and a second kernel adds the partial rows in order. Two runs give the same bits.

#include <algorithm>

#include "detail.cuh"

namespace train_gpt::cuda::detail {

constexpr unsigned reduce_cols = 32, reduce_threads_y = 8;

/// partial[band][j] = the sum over the band's rows of value(t, j) (two sums at once: .x and .y).
template <class Value>
__global__ void column_partials(Value value, std::size_t rows, std::size_t cols, std::size_t band_rows, float2* partial) {
  __shared__ float2 sums[reduce_threads_y][reduce_cols];
  const std::size_t j = blockIdx.x * reduce_cols + threadIdx.x;
  const std::size_t begin = blockIdx.y * band_rows, end = min(rows, begin + band_rows);
  float2 s{0.0f, 0.0f};
  if (j < cols)
    for (std::size_t t = begin + threadIdx.y; t < end; t += reduce_threads_y) {
      const float2 v = value(t, j);
      s.x += v.x;
      s.y += v.y;
    }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || j >= cols) return;
  for (unsigned y = 1; y < reduce_threads_y; ++y) {
    s.x += sums[y][threadIdx.x].x;
    s.y += sums[y][threadIdx.x].y;
  }
  partial[blockIdx.y * cols + j] = s;
}

/// out_x[j] += the sum of the partial rows' .x (and out_y[j] += .y when out_y is not null).
template <class Partial>  // a template: defined in every file that includes this one, without clashing
__global__ void add_column_partials(const Partial* partial, std::size_t bands, std::size_t cols, float* out_x,
                                           float* out_y) {
  const std::size_t j = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (j >= cols) return;
  Partial s{0.0f, 0.0f};
  for (std::size_t b = 0; b < bands; ++b) {
    s.x += partial[b * cols + j].x;
    s.y += partial[b * cols + j].y;
  }
  out_x[j] += s.x;
  if (out_y != nullptr) out_y[j] += s.y;
}

/// out_x[j] += sum over t of value(t, j).x, out_y[j] += ... .y: `rows` cut into at most 64 bands
/// (a number that depends only on `rows`, so the order of the sums is fixed).
template <class Value>
void column_reduce(kernels::impl& k, Value value, std::size_t rows, std::size_t cols, float* out_x, float* out_y) {
  if (rows == 0 || cols == 0) return;
  const std::size_t bands = std::min<std::size_t>(64, (rows + 63) / 64), band_rows = (rows + bands - 1) / bands;
  auto* partial = static_cast<float2*>(k.partial.get(bands * cols * sizeof(float2), k.stream));
  column_partials<<<dim3(blocks_for(cols, reduce_cols), static_cast<unsigned>(bands)), dim3(reduce_cols, reduce_threads_y), 0,
                    k.stream>>>(value, rows, cols, band_rows, partial);
  TRAIN_GPT_CUDA_LAUNCHED();
  add_column_partials<<<blocks_for(cols, 256), 256, 0, k.stream>>>(partial, bands, cols, out_x, out_y);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace train_gpt::cuda::detail
