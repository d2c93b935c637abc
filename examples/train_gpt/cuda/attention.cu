// Causal attention, flash-style (Dao et al. 2022) in fp32: the scores of a block of query rows
// against a tile of keys live only in registers and shared memory, with the softmax computed
// online (a running maximum and sum per row), so memory is O(tokens) instead of O(tokens^2).
// One thread owns one query row (forward, dq) or one key row (dk, dv), with the row's vectors in
// registers (head_dim <= 128, rounded up to 32, 64 or 128; the padding is zeros). Backward never
// adds from two threads into one place: dk and dv are summed by the key row's thread over the
// queries, dq by the query row's thread over the keys, so the result is deterministic.
// Tiles a causal mask hides wholly (every key after every query of the block) are skipped.
//
// Why a kernel of our own and not cuDNN's fused attention: cuDNN 9's frontend (the C++ headers
// that build its attention graphs) is not part of the CUDA installation weft builds against, and
// the backend API alone would be several hundred lines of descriptors; this kernel is small,
// takes weft's position-based causal masks (ring attention's load-balanced chunks) as they are,
// and bench/gpu_kernels measures it, so the choice can be revisited with numbers. Under
// attention_math::tensor_cores_bf16 the same algorithm runs on the tensor cores (attention_bf16.cu).

#include <cmath>
#include <cstdint>

#include "detail.cuh"

namespace train_gpt::cuda {

namespace {

constexpr int query_block = 64;   // query rows per block (forward, dq): one per thread
constexpr int key_tile = 32;      // keys in shared memory at a time (forward, dq)
constexpr int key_block = 64;     // key rows per block (dk, dv): one per thread
constexpr int query_tile = 32;    // queries in shared memory at a time (dk, dv)

__device__ inline bool hidden(bool causal, std::int64_t k_pos, std::int64_t q_pos) { return causal && k_pos > q_pos; }

/// Loads rows [first, first + count) of a [n, heads, d] tensor's head `h` into tile[count][MaxD],
/// zeros past d and past n.
template <int MaxD, int Rows>
__device__ void load_tile(float (*tile)[MaxD], const float* src, std::size_t first, std::size_t n, std::size_t row_stride,
                          std::size_t h, int d) {
  for (int idx = threadIdx.x; idx < Rows * MaxD; idx += blockDim.x) {
    const int r = idx / MaxD, e = idx % MaxD;
    const std::size_t row = first + static_cast<std::size_t>(r);
    tile[r][e] = row < n && e < d ? src[row * row_stride + h * static_cast<std::size_t>(d) + e] : 0.0f;
  }
}

template <int MaxD>
__global__ void __launch_bounds__(query_block) forward_kernel(const float* q, const float* k, const float* v,
                                                              const std::int64_t* q_pos, const std::int64_t* k_pos,
                                                              std::size_t nq, std::size_t nk, std::size_t heads, int d,
                                                              float scale, bool causal, float* out, float* lse) {
  __shared__ float ks[key_tile][MaxD], vs[key_tile][MaxD];
  __shared__ std::int64_t kp[key_tile];
  __shared__ std::int64_t block_max_pos[query_block];
  const std::size_t h = blockIdx.y, stride = heads * static_cast<std::size_t>(d);
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(query_block) + threadIdx.x;
  const bool valid = i < nq;
  const std::int64_t my_pos = valid ? q_pos[i] : INT64_MIN;
  block_max_pos[threadIdx.x] = my_pos;
  float qr[MaxD], o[MaxD];
#pragma unroll
  for (int e = 0; e < MaxD; ++e) {
    qr[e] = valid && e < d ? q[i * stride + h * d + e] * scale : 0.0f;
    o[e] = 0.0f;
  }
  __syncthreads();
  std::int64_t max_pos = block_max_pos[0];
  for (int r = 1; r < query_block; ++r) max_pos = block_max_pos[r] > max_pos ? block_max_pos[r] : max_pos;
  float m = -INFINITY, l = 0.0f;
  for (std::size_t j0 = 0; j0 < nk; j0 += key_tile) {
    __syncthreads();  // the previous tile is no longer read
    if (threadIdx.x < key_tile) kp[threadIdx.x] = j0 + threadIdx.x < nk ? k_pos[j0 + threadIdx.x] : 0;
    const bool seen = threadIdx.x < key_tile && j0 + threadIdx.x < nk && !hidden(causal, k_pos[j0 + threadIdx.x], max_pos);
    if (!__syncthreads_or(seen)) continue;  // every key of the tile is after every query of the block
    load_tile<MaxD, key_tile>(ks, k, j0, nk, stride, h, d);
    load_tile<MaxD, key_tile>(vs, v, j0, nk, stride, h, d);
    __syncthreads();
    if (!valid) continue;
    const int count = static_cast<int>(nk - j0 < key_tile ? nk - j0 : std::size_t{key_tile});
    for (int j = 0; j < count; ++j) {
      if (hidden(causal, kp[j], my_pos)) continue;
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < MaxD; ++e) s += qr[e] * ks[j][e];
      if (s > m) {
        const float correction = expf(m - s);  // 0 on the first key seen (m = -inf)
        l = l * correction + 1.0f;
#pragma unroll
        for (int e = 0; e < MaxD; ++e) o[e] = o[e] * correction + vs[j][e];
        m = s;
      } else {
        const float p = expf(s - m);
        l += p;
#pragma unroll
        for (int e = 0; e < MaxD; ++e) o[e] += p * vs[j][e];
      }
    }
  }
  if (!valid) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int e = 0; e < MaxD; ++e)
    if (e < d) out[i * stride + h * d + e] = o[e] * inv;
  lse[i * heads + h] = l > 0.0f ? m + logf(l) : -INFINITY;
}

/// delta[i, h] = dout_i · out_i (the softmax backward's row term).
__global__ void delta_kernel(const float* out, const float* dout, std::size_t rows, int d, float* delta) {
  const std::size_t r = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;  // r = i * heads + h
  if (r >= rows) return;
  float s = 0.0f;
  for (int e = 0; e < d; ++e) s += dout[r * d + e] * out[r * d + e];
  delta[r] = s;
}

/// dk and dv of one key row per thread, summed over the query tiles.
template <int MaxD>
__global__ void __launch_bounds__(key_block) dkdv_kernel(const float* q, const float* k, const float* v,
                                                         const std::int64_t* q_pos, const std::int64_t* k_pos,
                                                         std::size_t nq, std::size_t nk, std::size_t heads, int d,
                                                         float scale, bool causal, const float* lse, const float* delta,
                                                         const float* dout, float* dk, float* dv) {
  __shared__ float qs[query_tile][MaxD], dos[query_tile][MaxD];
  __shared__ float lse_s[query_tile], delta_s[query_tile];
  __shared__ std::int64_t qp[query_tile];
  __shared__ std::int64_t block_min_pos[key_block];
  const std::size_t h = blockIdx.y, stride = heads * static_cast<std::size_t>(d);
  const std::size_t j = blockIdx.x * static_cast<std::size_t>(key_block) + threadIdx.x;
  const bool valid = j < nk;
  const std::int64_t my_pos = valid ? k_pos[j] : INT64_MAX;
  block_min_pos[threadIdx.x] = my_pos;
  float kr[MaxD], vr[MaxD], dkr[MaxD], dvr[MaxD];
#pragma unroll
  for (int e = 0; e < MaxD; ++e) {
    kr[e] = valid && e < d ? k[j * stride + h * d + e] : 0.0f;
    vr[e] = valid && e < d ? v[j * stride + h * d + e] : 0.0f;
    dkr[e] = 0.0f;
    dvr[e] = 0.0f;
  }
  __syncthreads();
  std::int64_t min_pos = block_min_pos[0];
  for (int r = 1; r < key_block; ++r) min_pos = block_min_pos[r] < min_pos ? block_min_pos[r] : min_pos;
  for (std::size_t i0 = 0; i0 < nq; i0 += query_tile) {
    __syncthreads();
    const std::size_t qi = i0 + threadIdx.x;
    const bool seen = threadIdx.x < query_tile && qi < nq && !hidden(causal, min_pos, q_pos[qi]);
    if (!__syncthreads_or(seen)) continue;  // every query of the tile is before every key of the block
    if (threadIdx.x < query_tile) {
      qp[threadIdx.x] = qi < nq ? q_pos[qi] : 0;
      lse_s[threadIdx.x] = qi < nq ? lse[qi * heads + h] : -INFINITY;
      delta_s[threadIdx.x] = qi < nq ? delta[qi * heads + h] : 0.0f;
    }
    load_tile<MaxD, query_tile>(qs, q, i0, nq, stride, h, d);
    load_tile<MaxD, query_tile>(dos, dout, i0, nq, stride, h, d);
    __syncthreads();
    if (!valid) continue;
    const int count = static_cast<int>(nq - i0 < query_tile ? nq - i0 : std::size_t{query_tile});
    for (int r = 0; r < count; ++r) {
      if (hidden(causal, my_pos, qp[r]) || lse_s[r] == -INFINITY) continue;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < MaxD; ++e) {
        s += qs[r][e] * kr[e];
        dp += dos[r][e] * vr[e];
      }
      const float p = expf(s * scale - lse_s[r]);
      const float ds = p * (dp - delta_s[r]) * scale;
#pragma unroll
      for (int e = 0; e < MaxD; ++e) {
        dvr[e] += p * dos[r][e];
        dkr[e] += ds * qs[r][e];
      }
    }
  }
  if (!valid) return;
#pragma unroll
  for (int e = 0; e < MaxD; ++e)
    if (e < d) {
      dk[j * stride + h * d + e] += dkr[e];
      dv[j * stride + h * d + e] += dvr[e];
    }
}

/// dq of one query row per thread, summed over the key tiles.
template <int MaxD>
__global__ void __launch_bounds__(query_block) dq_kernel(const float* q, const float* k, const float* v,
                                                         const std::int64_t* q_pos, const std::int64_t* k_pos,
                                                         std::size_t nq, std::size_t nk, std::size_t heads, int d,
                                                         float scale, bool causal, const float* lse, const float* delta,
                                                         const float* dout, float* dq) {
  __shared__ float ks[key_tile][MaxD], vs[key_tile][MaxD];
  __shared__ std::int64_t kp[key_tile];
  __shared__ std::int64_t block_max_pos[query_block];
  const std::size_t h = blockIdx.y, stride = heads * static_cast<std::size_t>(d);
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(query_block) + threadIdx.x;
  const bool valid = i < nq;
  const std::int64_t my_pos = valid ? q_pos[i] : INT64_MIN;
  block_max_pos[threadIdx.x] = my_pos;
  float qr[MaxD], dor[MaxD], dqr[MaxD];
#pragma unroll
  for (int e = 0; e < MaxD; ++e) {
    qr[e] = valid && e < d ? q[i * stride + h * d + e] : 0.0f;
    dor[e] = valid && e < d ? dout[i * stride + h * d + e] : 0.0f;
    dqr[e] = 0.0f;
  }
  const float my_lse = valid ? lse[i * heads + h] : -INFINITY;
  const float my_delta = valid ? delta[i * heads + h] : 0.0f;
  __syncthreads();
  std::int64_t max_pos = block_max_pos[0];
  for (int r = 1; r < query_block; ++r) max_pos = block_max_pos[r] > max_pos ? block_max_pos[r] : max_pos;
  for (std::size_t j0 = 0; j0 < nk; j0 += key_tile) {
    __syncthreads();
    if (threadIdx.x < key_tile) kp[threadIdx.x] = j0 + threadIdx.x < nk ? k_pos[j0 + threadIdx.x] : 0;
    const bool seen = threadIdx.x < key_tile && j0 + threadIdx.x < nk && !hidden(causal, k_pos[j0 + threadIdx.x], max_pos);
    if (!__syncthreads_or(seen)) continue;
    load_tile<MaxD, key_tile>(ks, k, j0, nk, stride, h, d);
    load_tile<MaxD, key_tile>(vs, v, j0, nk, stride, h, d);
    __syncthreads();
    if (!valid || my_lse == -INFINITY) continue;
    const int count = static_cast<int>(nk - j0 < key_tile ? nk - j0 : std::size_t{key_tile});
    for (int j = 0; j < count; ++j) {
      if (hidden(causal, kp[j], my_pos)) continue;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int e = 0; e < MaxD; ++e) {
        s += qr[e] * ks[j][e];
        dp += dor[e] * vs[j][e];
      }
      const float p = expf(s * scale - my_lse);
      const float ds = p * (dp - my_delta) * scale;
#pragma unroll
      for (int e = 0; e < MaxD; ++e) dqr[e] += ds * ks[j][e];
    }
  }
  if (!valid) return;
#pragma unroll
  for (int e = 0; e < MaxD; ++e)
    if (e < d) dq[i * stride + h * d + e] += dqr[e];
}

/// Folds a block's attention (its output and LSE) into the running one, per (query row, head):
/// lse = log(e^lse + e^block_lse), out = out e^(old lse - lse) + block_out e^(block_lse - lse).
/// A side whose LSE is -inf (no visible key) contributes nothing.
__global__ void attention_merge_kernel(float* out, float* lse, const float* block_out, const float* block_lse,
                                       std::size_t rows_heads, int d) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= rows_heads) return;
  const float a = lse[i], b = block_lse[i];
  if (b == -INFINITY) return;
  float* o = out + i * static_cast<std::size_t>(d);
  const float* bo = block_out + i * static_cast<std::size_t>(d);
  if (a == -INFINITY) {
    for (int e = 0; e < d; ++e) o[e] = bo[e];
    lse[i] = b;
    return;
  }
  const float m = fmaxf(a, b);
  const float merged = m + logf(expf(a - m) + expf(b - m));
  const float wa = expf(a - merged), wb = expf(b - merged);
  for (int e = 0; e < d; ++e) o[e] = o[e] * wa + bo[e] * wb;
  lse[i] = merged;
}

__global__ void fill_kernel(float* data, std::size_t n, float value) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) data[i] = value;
}

}  // namespace

void kernels::attention_merge(float* out, float* lse, const float* block_out, const float* block_lse, std::size_t rows,
                              std::size_t heads, std::size_t head_dim) {
  const std::size_t n = rows * heads;
  if (n == 0) return;
  attention_merge_kernel<<<detail::blocks_for(n, 128), 128, 0, impl_->stream>>>(out, lse, block_out, block_lse, n,
                                                                                static_cast<int>(head_dim));
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::fill(float* data, std::size_t n, float value) {
  if (n == 0) return;
  fill_kernel<<<detail::blocks_for(n, 256), 256, 0, impl_->stream>>>(data, n, value);
  TRAIN_GPT_CUDA_LAUNCHED();
}

void kernels::attention_forward(const float* q, const float* k, const float* v, const std::int64_t* q_pos,
                                const std::int64_t* k_pos, std::size_t nq, std::size_t nk, std::size_t heads,
                                std::size_t head_dim, float scale, bool causal, float* out, float* lse) {
  if (nq == 0 || heads == 0) return;
  if (impl_->attention == attention_math::tensor_cores_bf16) {
    detail::attention_forward_bf16(impl_->stream, q, k, v, q_pos, k_pos, nq, nk, heads, head_dim, scale, causal, out,
                                   lse);
    return;
  }
  detail::with_head_width(head_dim, [&](auto width) {
    forward_kernel<decltype(width)::value><<<dim3(detail::blocks_for(nq, query_block), static_cast<unsigned>(heads)),
                                             query_block, 0, impl_->stream>>>(
        q, k, v, q_pos, k_pos, nq, nk, heads, static_cast<int>(head_dim), scale, causal, out, lse);
    TRAIN_GPT_CUDA_LAUNCHED();
  });
}

void kernels::attention_backward(const float* q, const float* k, const float* v, const std::int64_t* q_pos,
                                 const std::int64_t* k_pos, std::size_t nq, std::size_t nk, std::size_t heads,
                                 std::size_t head_dim, float scale, bool causal, const float* out, const float* lse,
                                 const float* dout, float* dq, float* dk, float* dv) {
  if (nq == 0 || nk == 0 || heads == 0) return;
  impl& s = *impl_;
  auto* delta = static_cast<float*>(s.attention_delta.get(nq * heads * sizeof(float), s.stream));
  delta_kernel<<<detail::blocks_for(nq * heads, 256), 256, 0, s.stream>>>(out, dout, nq * heads,
                                                                            static_cast<int>(head_dim), delta);
  TRAIN_GPT_CUDA_LAUNCHED();
  if (s.attention == attention_math::tensor_cores_bf16) {
    detail::attention_backward_bf16(s.stream, q, k, v, q_pos, k_pos, nq, nk, heads, head_dim, scale, causal, lse, delta,
                                    dout, dq, dk, dv);
    return;
  }
  detail::with_head_width(head_dim, [&](auto width) {
    constexpr int w = decltype(width)::value;
    const int d = static_cast<int>(head_dim);
    dkdv_kernel<w><<<dim3(detail::blocks_for(nk, key_block), static_cast<unsigned>(heads)), key_block, 0, s.stream>>>(
        q, k, v, q_pos, k_pos, nq, nk, heads, d, scale, causal, lse, delta, dout, dk, dv);
    TRAIN_GPT_CUDA_LAUNCHED();
    dq_kernel<w><<<dim3(detail::blocks_for(nq, query_block), static_cast<unsigned>(heads)), query_block, 0, s.stream>>>(
        q, k, v, q_pos, k_pos, nq, nk, heads, d, scale, causal, lse, delta, dout, dq);
    TRAIN_GPT_CUDA_LAUNCHED();
  });
}

}  // namespace train_gpt::cuda
