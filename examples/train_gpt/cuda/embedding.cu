// The embeddings: forward is a gather; backward adds each row of dx to its token's (and its
// position's) row of the table. Adding with atomics would make the sums' order, and so their
// bits, change from run to run; instead the rows are sorted by index with a stable radix sort
// (CUB), and one block per distinct index adds that index's rows in their original order. Under
// tensor parallelism each rank looks up only the tokens of its vocabulary block: the caller gives
// the others as -1 (a zero row forward, nothing added backward).

#include <cub/device/device_radix_sort.cuh>

#include "detail.cuh"

namespace train_gpt::cuda {

namespace {

__global__ void embedding_forward_kernel(const std::int32_t* tokens, const std::int64_t* positions, const float* wte,
                                         const float* wpe, float* x, std::size_t n, std::size_t c) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n * c) return;
  const std::size_t t = i / c, j = i % c;
  const float token = tokens[t] < 0 ? 0.0f : wte[static_cast<std::size_t>(tokens[t]) * c + j];
  x[i] = wpe == nullptr ? token : token + wpe[static_cast<std::size_t>(positions[t]) * c + j];
}

__global__ void add_positions_kernel(const std::int64_t* positions, const float* wpe, float* x, std::size_t n,
                                     std::size_t c) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n * c) return;
  x[i] += wpe[static_cast<std::size_t>(positions[i / c]) * c + i % c];
}

__global__ void iota_kernel(std::int32_t* out, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = static_cast<std::int32_t>(i);
}

/// Block b: if sorted entry b starts a run of equal indices, adds the run's rows of dx (in
/// their original order, which the stable sort kept) to the table's row; a negative index (a
/// token of another tp rank's block) adds nothing.
template <class Index>
__global__ void add_runs_kernel(const Index* sorted, const std::int32_t* rows, const float* dx, float* table,
                                std::size_t n, std::size_t c) {
  const std::size_t b = blockIdx.x;
  if (sorted[b] < 0 || (b > 0 && sorted[b] == sorted[b - 1])) return;
  std::size_t end = b + 1;
  while (end < n && sorted[end] == sorted[b]) ++end;
  float* out = table + static_cast<std::size_t>(sorted[b]) * c;
  for (std::size_t j = threadIdx.x; j < c; j += blockDim.x) {
    float s = out[j];
    for (std::size_t e = b; e < end; ++e) s += dx[static_cast<std::size_t>(rows[e]) * c + j];
    out[j] = s;
  }
}

template <class Index>
void add_rows_sorted(kernels::impl& k, const Index* index, const float* dx, float* table, std::size_t n, std::size_t c) {
  auto* keys = static_cast<Index*>(k.sort_keys.get(n * sizeof(Index), k.stream));
  auto* rows = static_cast<std::int32_t*>(k.sort_values.get(2 * n * sizeof(std::int32_t), k.stream));
  std::int32_t* sorted_rows = rows + n;
  iota_kernel<<<detail::blocks_for(n, 256), 256, 0, k.stream>>>(rows, n);
  TRAIN_GPT_CUDA_LAUNCHED();
  std::size_t temp_bytes = 0;
  const int count = static_cast<int>(n);
  TRAIN_GPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, index, keys, rows, sorted_rows, count, 0,
                                                       static_cast<int>(sizeof(Index) * 8), k.stream));
  void* temp = k.sort_temp.get(temp_bytes, k.stream);
  TRAIN_GPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, index, keys, rows, sorted_rows, count, 0,
                                                       static_cast<int>(sizeof(Index) * 8), k.stream));
  add_runs_kernel<Index><<<static_cast<unsigned>(n), 256, 0, k.stream>>>(keys, sorted_rows, dx, table, n, c);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace

void kernels::embedding_forward(const std::int32_t* tokens, const std::int64_t* positions, const float* wte,
                                const float* wpe, float* x, std::size_t n, std::size_t c) {
  if (n * c == 0) return;
  embedding_forward_kernel<<<detail::blocks_for(n * c, 256), 256, 0, impl_->stream>>>(tokens, positions, wte, wpe, x, n, c);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::add_positions(const std::int64_t* positions, const float* wpe, float* x, std::size_t n, std::size_t c) {
  if (n * c == 0) return;
  add_positions_kernel<<<detail::blocks_for(n * c, 256), 256, 0, impl_->stream>>>(positions, wpe, x, n, c);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::embedding_backward(const std::int32_t* tokens, const std::int64_t* positions, const float* dx,
                                 float* dwte, float* dwpe, std::size_t n, std::size_t c) {
  if (n * c == 0) return;
  add_rows_sorted(*impl_, tokens, dx, dwte, n, c);
  add_rows_sorted(*impl_, positions, dx, dwpe, n, c);
}

}  // namespace train_gpt::cuda
