// Causal attention on the tensor cores (kernels built with attention_math::tensor_cores_bf16, which
// train_gpt --precision bf16 uses): attention.cu's flash-style algorithm with its five products
// (Q K^T and P V forward; Q K^T, dO V^T, P^T dO, dS^T Q and dS K backward) as warp-level matrix
// multiply-accumulates (WMMA: bf16 operands, fp32 accumulators). q, k, v and dout are read in
// fp32 and rounded to bf16 as they are staged into shared memory; the probabilities P and their
// gradients dS are rounded to bf16 only as operands of the next product. The softmax (scores,
// running maximum and sum, the exponentials), lse, delta and every accumulation stay fp32. The
// fp32 kernels do the same work one row per thread on the CUDA cores, which cannot reach the
// tensor cores' rate: for GPT-2's attention this is the difference between attention dominating a
// bf16 step and being a small part of it (bench/gpu_kernels measures both).
//
// Layout: a block is 4 warps; each warp owns 16 rows (queries in forward and dq, keys in dk/dv),
// and the block stages a tile of 64 of the other side's rows (keys, or queries) in shared memory,
// as bf16, zero-padded to the head width (32, 64 or 128). A warp's scores for its 16 rows against
// the tile go through shared memory, where each row is handled by a pair of lanes (32 columns
// each). Forward keeps the running output in shared memory, since the online softmax rescales its
// rows; backward keeps its sums (dk and dv, or dq) in accumulator fragments for the whole loop.
// Determinism as in attention.cu: no atomics, dk and dv summed by the key's warp over queries,
// dq by the query's warp over keys, in a fixed order.

#include <mma.h>

#include <cmath>
#include <cstdint>

#include "detail.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// Compiled for a GPU without bf16 tensor cores, the kernels are traps (kernels::kernels refuses
// attention_math::tensor_cores_bf16 there) and their helpers go unused.
#pragma nv_diag_suppress 177
#endif

namespace train_gpt::cuda::detail {

namespace {

namespace wmma = nvcuda::wmma;

constexpr int warps = 4;
constexpr int warp_rows = 16;                      // one WMMA tile's rows
constexpr int block_rows = warps * warp_rows;      // 64 rows per block
constexpr int tile = 64;                           // the other side's rows staged at a time
constexpr unsigned full_mask = 0xffffffffu;

using a_rows = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using b_cols = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;  // B^T stored row-major
using b_rows = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using accumulator = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

/// Shared-memory regions start on 128-byte boundaries (WMMA needs 32).
constexpr std::size_t aligned(std::size_t bytes) { return (bytes + 127) / 128 * 128; }

/// A warp's two fp32 [16][tile] score areas, back to back: large enough for its 16 rows staged as
/// bf16 [16][D] at the start, and for its fp32 [16][D] result at the end (D <= 128 = 2 tile).
constexpr std::size_t score_area = aligned(warp_rows * tile * sizeof(float));

/// Byte offsets into the dynamic shared memory of each kernel: the block's staged tile, then each
/// warp's own part.
template <int D>
struct forward_layout {
  static constexpr std::size_t keys = 0;                                               // bf16 [tile][D]
  static constexpr std::size_t values = keys + aligned(tile * D * sizeof(bf16));       // bf16 [tile][D]
  static constexpr std::size_t key_pos = values + aligned(tile * D * sizeof(bf16));    // int64 [tile]
  static constexpr std::size_t warp_part = key_pos + aligned(tile * sizeof(std::int64_t));
  static constexpr std::size_t scores = 0;                                             // fp32 [16][tile]
  static constexpr std::size_t probs = scores + 2 * score_area;                        // bf16 [16][tile]
  static constexpr std::size_t output = probs + aligned(warp_rows * tile * sizeof(bf16));  // fp32 [16][D]
  static constexpr std::size_t per_warp = output + aligned(warp_rows * D * sizeof(float));
  static constexpr std::size_t bytes = warp_part + warps * per_warp;
};

template <int D>
struct dkdv_layout {
  static constexpr std::size_t queries = 0;                                            // bf16 [tile][D]
  static constexpr std::size_t douts = queries + aligned(tile * D * sizeof(bf16));     // bf16 [tile][D]
  static constexpr std::size_t lse = douts + aligned(tile * D * sizeof(bf16));         // fp32 [tile]
  static constexpr std::size_t delta = lse + aligned(tile * sizeof(float));            // fp32 [tile]
  static constexpr std::size_t query_pos = delta + aligned(tile * sizeof(float));      // int64 [tile]
  static constexpr std::size_t warp_part = query_pos + aligned(tile * sizeof(std::int64_t));
  static constexpr std::size_t scores = 0;                                             // fp32 [16][tile]: S^T
  static constexpr std::size_t dprobs = score_area;                                    // fp32 [16][tile]: dP^T
  static constexpr std::size_t probs = 2 * score_area;                                 // bf16 [16][tile]: P^T
  static constexpr std::size_t dscores = probs + aligned(warp_rows * tile * sizeof(bf16));  // bf16: dS^T
  static constexpr std::size_t per_warp = dscores + aligned(warp_rows * tile * sizeof(bf16));
  static constexpr std::size_t bytes = warp_part + warps * per_warp;
};

template <int D>
struct dq_layout {
  static constexpr std::size_t keys = 0;                                               // bf16 [tile][D]
  static constexpr std::size_t values = keys + aligned(tile * D * sizeof(bf16));       // bf16 [tile][D]
  static constexpr std::size_t key_pos = values + aligned(tile * D * sizeof(bf16));    // int64 [tile]
  static constexpr std::size_t warp_part = key_pos + aligned(tile * sizeof(std::int64_t));
  static constexpr std::size_t scores = 0;                                             // fp32 [16][tile]
  static constexpr std::size_t dprobs = score_area;                                    // fp32 [16][tile]
  static constexpr std::size_t dscores = 2 * score_area;                               // bf16 [16][tile]
  static constexpr std::size_t per_warp = dscores + aligned(warp_rows * tile * sizeof(bf16));
  static constexpr std::size_t bytes = warp_part + warps * per_warp;
};

__device__ inline bool hidden(bool causal, std::int64_t k_pos, std::int64_t q_pos) { return causal && k_pos > q_pos; }

/// dst[r][e] (bf16, row stride D) = head h of row first + r of a [n, heads, d] fp32 tensor, for r
/// in [0, rows); zeros past d and past n. Threads `tid` of `count` share the work.
template <int D>
__device__ void stage_rows(bf16* dst, const float* src, std::size_t first, std::size_t n, std::size_t stride,
                           std::size_t h, int d, int rows, int tid, int count) {
  for (int idx = tid; idx < rows * D; idx += count) {
    const int r = idx / D, e = idx % D;
    const std::size_t row = first + static_cast<std::size_t>(r);
    dst[idx] = __float2bfloat16(row < n && e < d ? src[row * stride + h * static_cast<std::size_t>(d) + e] : 0.0f);
  }
}

__device__ inline std::int64_t warp_max(std::int64_t x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const std::int64_t y = __shfl_xor_sync(full_mask, x, offset);
    x = y > x ? y : x;
  }
  return x;
}
__device__ inline std::int64_t warp_min(std::int64_t x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const std::int64_t y = __shfl_xor_sync(full_mask, x, offset);
    x = y < x ? y : x;
  }
  return x;
}

/// The block's extreme of the warps' values (`mine`, the same in all lanes of a warp): the largest,
/// or with `smallest` the smallest. Every thread of the block calls it.
__device__ inline std::int64_t block_extreme(std::int64_t* shared, std::int64_t mine, bool smallest) {
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (threadIdx.x % 32 == 0) shared[warp] = mine;
  __syncthreads();
  std::int64_t x = shared[0];
  for (int w = 1; w < warps; ++w) x = (smallest ? shared[w] < x : shared[w] > x) ? shared[w] : x;
  return x;
}

/// Stages the block's next tile of keys and values (rows j0.. of k and v, head h) as bf16, and
/// their positions in kp (INT64_MAX past nk); false, with nothing staged, when every key of the
/// tile is after `latest` (the block's latest query position). Every thread of the block calls it.
template <int D>
__device__ bool stage_key_tile(bf16* keys, bf16* values, std::int64_t* kp, const float* k, const float* v,
                               const std::int64_t* k_pos, std::size_t j0, std::size_t nk, std::size_t stride,
                               std::size_t h, int d, bool causal, std::int64_t latest) {
  __syncthreads();  // every warp is done with the previous tile
  bool seen = false;
  if (threadIdx.x < tile) {
    const std::size_t j = j0 + threadIdx.x;
    kp[threadIdx.x] = j < nk ? k_pos[j] : INT64_MAX;
    seen = j < nk && !hidden(causal, kp[threadIdx.x], latest);
  }
  if (!__syncthreads_or(seen)) return false;
  stage_rows<D>(keys, k, j0, nk, stride, h, d, tile, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
  stage_rows<D>(values, v, j0, nk, stride, h, d, tile, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
  __syncthreads();
  return true;
}

/// Whether a query at `latest` (a warp's latest) sees any key of the staged tile; warp-uniform.
__device__ inline bool warp_sees_keys(const std::int64_t* kp, std::size_t j0, std::size_t nk, bool causal,
                                      std::int64_t latest, int lane) {
  return __any_sync(full_mask, (j0 + lane < nk && !hidden(causal, kp[lane], latest)) ||
                                   (j0 + lane + 32 < nk && !hidden(causal, kp[lane + 32], latest)));
}

/// The warp's 16 x tile product `out` (fp32, row stride tile) = A B^T, A the warp's rows in
/// fragments, B the staged tile (row stride D): scores against each of the tile's rows.
template <int D>
__device__ void rows_times_tile(float* out, const a_rows (&a)[D / 16], const bf16* staged) {
#pragma unroll
  for (int nt = 0; nt < tile / 16; ++nt) {
    accumulator s;
    wmma::fill_fragment(s, 0.0f);
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
      b_cols b;
      wmma::load_matrix_sync(b, staged + nt * 16 * D + kt * 16, D);
      wmma::mma_sync(s, a[kt], b, s);
    }
    wmma::store_matrix_sync(out + nt * 16, s, tile, wmma::mem_row_major);
  }
}

/// sums[nt] += W (the warp's bf16 [16][tile], row stride tile) times the staged tile (row stride D).
template <int D>
__device__ void add_weights_times_tile(accumulator (&sums)[D / 16], const bf16* weights, const bf16* staged) {
#pragma unroll
  for (int kt = 0; kt < tile / 16; ++kt) {
    a_rows w;
    wmma::load_matrix_sync(w, weights + kt * 16, tile);
#pragma unroll
    for (int nt = 0; nt < D / 16; ++nt) {
      b_rows b;
      wmma::load_matrix_sync(b, staged + kt * 16 * D + nt * 16, D);
      wmma::mma_sync(sums[nt], w, b, sums[nt]);
    }
  }
}

/// Loads the warp's 16 rows of head h (from row `first`) as A fragments, staged through `area`.
template <int D>
__device__ void load_warp_rows(a_rows (&a)[D / 16], bf16* area, const float* src, std::size_t first, std::size_t n,
                               std::size_t stride, std::size_t h, int d, int lane) {
  stage_rows<D>(area, src, first, n, stride, h, d, warp_rows, lane, 32);
  __syncwarp();
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) wmma::load_matrix_sync(a[kt], area + kt * 16, D);
  __syncwarp();  // the area is reused
}

/// dst[row r, head h] += the warp's fp32 [16][D] sums, stored through `area` (2 score areas).
template <int D>
__device__ void add_warp_sums(float* dst, accumulator (&sums)[D / 16], float* area, std::size_t first, std::size_t n,
                              std::size_t stride, std::size_t h, int d, int lane) {
#pragma unroll
  for (int nt = 0; nt < D / 16; ++nt) wmma::store_matrix_sync(area + nt * 16, sums[nt], D, wmma::mem_row_major);
  __syncwarp();
  for (int idx = lane; idx < warp_rows * D; idx += 32) {
    const int r = idx / D, e = idx % D;
    const std::size_t row = first + static_cast<std::size_t>(r);
    if (row < n && e < d) dst[row * stride + h * static_cast<std::size_t>(d) + e] += area[idx];
  }
  __syncwarp();
}

template <int D>
__global__ void __launch_bounds__(warps * 32)
    forward_kernel(const float* q, const float* k, const float* v, const std::int64_t* q_pos, const std::int64_t* k_pos,
                   std::size_t nq, std::size_t nk, std::size_t heads, int d, float scale, bool causal, float* out,
                   float* lse) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 WMMA needs sm_80 (kernels::kernels refuses attention_math::tensor_cores_bf16 there)
#else
  using L = forward_layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ std::int64_t latest[warps];
  bf16* keys = reinterpret_cast<bf16*>(smem + L::keys);
  bf16* values = reinterpret_cast<bf16*>(smem + L::values);
  auto* kp = reinterpret_cast<std::int64_t*>(smem + L::key_pos);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  unsigned char* own = smem + L::warp_part + warp * L::per_warp;
  float* scores = reinterpret_cast<float*>(own + L::scores);
  bf16* probs = reinterpret_cast<bf16*>(own + L::probs);
  float* output = reinterpret_cast<float*>(own + L::output);
  const std::size_t h = blockIdx.y, stride = heads * static_cast<std::size_t>(d);
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(block_rows) + warp * warp_rows;

  a_rows qa[D / 16];
  load_warp_rows<D>(qa, reinterpret_cast<bf16*>(scores), q, first, nq, stride, h, d, lane);
  for (int idx = lane; idx < warp_rows * D; idx += 32) output[idx] = 0.0f;
  __syncwarp();  // every lane reads rows the others zeroed
  // Lanes 2r and 2r + 1 own row r: its statistics (the same in both), and half of its columns.
  const int r = lane / 2, half = lane % 2;
  const std::size_t i = first + static_cast<std::size_t>(r);
  const bool valid = i < nq;
  const std::int64_t my_pos = valid ? q_pos[i] : INT64_MIN;
  const std::int64_t warp_latest = warp_max(my_pos);
  const std::int64_t block_latest = block_extreme(latest, warp_latest, false);
  float m = -INFINITY, l = 0.0f;
  for (std::size_t j0 = 0; j0 < nk; j0 += tile) {
    // Skipped: a tile whose every key is after every query of the block, or of the warp.
    if (!stage_key_tile<D>(keys, values, kp, k, v, k_pos, j0, nk, stride, h, d, causal, block_latest)) continue;
    if (!warp_sees_keys(kp, j0, nk, causal, warp_latest, lane)) continue;
    rows_times_tile<D>(scores, qa, keys);
    __syncwarp();
    // Online softmax over the tile: the masked, scaled scores, the new running maximum, the
    // probabilities against it (bf16 for the product), the rescale of what was summed before.
    float* row_scores = scores + r * tile;
    bf16* row_probs = probs + r * tile;
    const int c0 = half * (tile / 2);
    float tile_max = -INFINITY;
    for (int c = c0; c < c0 + tile / 2; ++c) {
      const bool visible = valid && j0 + c < nk && !hidden(causal, kp[c], my_pos);
      const float s = visible ? row_scores[c] * scale : -INFINITY;
      row_scores[c] = s;
      tile_max = fmaxf(tile_max, s);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(full_mask, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    float correction = 1.0f, sum = 0.0f;
    if (m_new == -INFINITY) {  // nothing visible to this row yet
      for (int c = c0; c < c0 + tile / 2; ++c) row_probs[c] = __float2bfloat16(0.0f);
    } else {
      correction = expf(m - m_new);  // 0 while m is -inf
      for (int c = c0; c < c0 + tile / 2; ++c) {
        const float p = expf(row_scores[c] - m_new);  // 0 for a hidden key
        sum += p;
        row_probs[c] = __float2bfloat16(p);
      }
      m = m_new;
    }
    sum += __shfl_xor_sync(full_mask, sum, 1);
    l = l * correction + sum;
    for (int e = half * (D / 2); e < (half + 1) * (D / 2); ++e) output[r * D + e] *= correction;
    __syncwarp();
    // output += P V
#pragma unroll
    for (int nt = 0; nt < D / 16; ++nt) {
      accumulator o;
      wmma::load_matrix_sync(o, output + nt * 16, D, wmma::mem_row_major);
#pragma unroll
      for (int kt = 0; kt < tile / 16; ++kt) {
        a_rows p;
        wmma::load_matrix_sync(p, probs + kt * 16, tile);
        b_rows b;
        wmma::load_matrix_sync(b, values + kt * 16 * D + nt * 16, D);
        wmma::mma_sync(o, p, b, o);
      }
      wmma::store_matrix_sync(output + nt * 16, o, D, wmma::mem_row_major);
    }
    __syncwarp();
  }
  if (!valid) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  for (int e = half * (D / 2); e < (half + 1) * (D / 2); ++e)
    if (e < d) out[i * stride + h * d + e] = l > 0.0f ? output[r * D + e] * inv : 0.0f;
  if (half == 0) lse[i * heads + h] = l > 0.0f ? m + logf(l) : -INFINITY;
#endif
}

/// dk and dv of the warp's 16 key rows, summed over the query tiles.
template <int D>
__global__ void __launch_bounds__(warps * 32)
    dkdv_kernel(const float* q, const float* k, const float* v, const std::int64_t* q_pos, const std::int64_t* k_pos,
                std::size_t nq, std::size_t nk, std::size_t heads, int d, float scale, bool causal, const float* lse,
                const float* delta, const float* dout, float* dk, float* dv) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using L = dkdv_layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ std::int64_t earliest[warps];
  bf16* queries = reinterpret_cast<bf16*>(smem + L::queries);
  bf16* douts = reinterpret_cast<bf16*>(smem + L::douts);
  auto* lse_s = reinterpret_cast<float*>(smem + L::lse);
  auto* delta_s = reinterpret_cast<float*>(smem + L::delta);
  auto* qp = reinterpret_cast<std::int64_t*>(smem + L::query_pos);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  unsigned char* own = smem + L::warp_part + warp * L::per_warp;
  float* scores = reinterpret_cast<float*>(own + L::scores);
  float* dprobs = reinterpret_cast<float*>(own + L::dprobs);
  bf16* probs = reinterpret_cast<bf16*>(own + L::probs);
  bf16* dscores = reinterpret_cast<bf16*>(own + L::dscores);
  const std::size_t h = blockIdx.y, stride = heads * static_cast<std::size_t>(d);
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(block_rows) + warp * warp_rows;

  a_rows ka[D / 16], va[D / 16];
  load_warp_rows<D>(ka, reinterpret_cast<bf16*>(scores), k, first, nk, stride, h, d, lane);
  load_warp_rows<D>(va, reinterpret_cast<bf16*>(scores), v, first, nk, stride, h, d, lane);
  accumulator dk_sum[D / 16], dv_sum[D / 16];
#pragma unroll
  for (int nt = 0; nt < D / 16; ++nt) {
    wmma::fill_fragment(dk_sum[nt], 0.0f);
    wmma::fill_fragment(dv_sum[nt], 0.0f);
  }
  const int r = lane / 2, half = lane % 2;
  const std::size_t j = first + static_cast<std::size_t>(r);
  const bool valid = j < nk;
  const std::int64_t my_pos = valid ? k_pos[j] : INT64_MAX;
  const std::int64_t warp_earliest = warp_min(my_pos);
  const std::int64_t block_earliest = block_extreme(earliest, warp_earliest, true);
  for (std::size_t i0 = 0; i0 < nq; i0 += tile) {
    __syncthreads();
    bool seen = false;
    if (threadIdx.x < tile) {
      const std::size_t qi = i0 + threadIdx.x;
      const bool in = qi < nq;
      qp[threadIdx.x] = in ? q_pos[qi] : INT64_MIN;
      lse_s[threadIdx.x] = in ? lse[qi * heads + h] : -INFINITY;
      delta_s[threadIdx.x] = in ? delta[qi * heads + h] : 0.0f;
      seen = in && lse_s[threadIdx.x] != -INFINITY && !hidden(causal, block_earliest, qp[threadIdx.x]);
    }
    if (!__syncthreads_or(seen)) continue;  // every query of the tile is before every key of the block
    stage_rows<D>(queries, q, i0, nq, stride, h, d, tile, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
    stage_rows<D>(douts, dout, i0, nq, stride, h, d, tile, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
    __syncthreads();
    auto sees = [&](int c) {
      return i0 + c < nq && lse_s[c] != -INFINITY && !hidden(causal, warp_earliest, qp[c]);
    };
    if (!__any_sync(full_mask, sees(lane) || sees(lane + 32))) continue;
    rows_times_tile<D>(scores, ka, queries);  // S^T = K Q^T
    rows_times_tile<D>(dprobs, va, douts);    // dP^T = V dO^T
    __syncwarp();
    for (int c = half * (tile / 2); c < (half + 1) * (tile / 2); ++c) {
      const bool visible = valid && i0 + c < nq && lse_s[c] != -INFINITY && !hidden(causal, my_pos, qp[c]);
      const float p = visible ? expf(scores[r * tile + c] * scale - lse_s[c]) : 0.0f;
      const float ds = p * (dprobs[r * tile + c] - delta_s[c]) * scale;
      probs[r * tile + c] = __float2bfloat16(p);
      dscores[r * tile + c] = __float2bfloat16(ds);
    }
    __syncwarp();
    add_weights_times_tile<D>(dv_sum, probs, douts);     // dV += P^T dO
    add_weights_times_tile<D>(dk_sum, dscores, queries);  // dK += dS^T Q
  }
  add_warp_sums<D>(dv, dv_sum, scores, first, nk, stride, h, d, lane);
  add_warp_sums<D>(dk, dk_sum, scores, first, nk, stride, h, d, lane);
#endif
}

/// dq of the warp's 16 query rows, summed over the key tiles.
template <int D>
__global__ void __launch_bounds__(warps * 32)
    dq_kernel(const float* q, const float* k, const float* v, const std::int64_t* q_pos, const std::int64_t* k_pos,
              std::size_t nq, std::size_t nk, std::size_t heads, int d, float scale, bool causal, const float* lse,
              const float* delta, const float* dout, float* dq) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using L = dq_layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ std::int64_t latest[warps];
  bf16* keys = reinterpret_cast<bf16*>(smem + L::keys);
  bf16* values = reinterpret_cast<bf16*>(smem + L::values);
  auto* kp = reinterpret_cast<std::int64_t*>(smem + L::key_pos);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  unsigned char* own = smem + L::warp_part + warp * L::per_warp;
  float* scores = reinterpret_cast<float*>(own + L::scores);
  float* dprobs = reinterpret_cast<float*>(own + L::dprobs);
  bf16* dscores = reinterpret_cast<bf16*>(own + L::dscores);
  const std::size_t h = blockIdx.y, stride = heads * static_cast<std::size_t>(d);
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(block_rows) + warp * warp_rows;

  a_rows qa[D / 16], oa[D / 16];
  load_warp_rows<D>(qa, reinterpret_cast<bf16*>(scores), q, first, nq, stride, h, d, lane);
  load_warp_rows<D>(oa, reinterpret_cast<bf16*>(scores), dout, first, nq, stride, h, d, lane);
  accumulator dq_sum[D / 16];
#pragma unroll
  for (int nt = 0; nt < D / 16; ++nt) wmma::fill_fragment(dq_sum[nt], 0.0f);
  const int r = lane / 2, half = lane % 2;
  const std::size_t i = first + static_cast<std::size_t>(r);
  const bool valid = i < nq;
  const std::int64_t my_pos = valid ? q_pos[i] : INT64_MIN;
  const float my_lse = valid ? lse[i * heads + h] : -INFINITY;
  const float my_delta = valid ? delta[i * heads + h] : 0.0f;
  const std::int64_t warp_latest = warp_max(my_pos);
  const std::int64_t block_latest = block_extreme(latest, warp_latest, false);
  for (std::size_t j0 = 0; j0 < nk; j0 += tile) {
    if (!stage_key_tile<D>(keys, values, kp, k, v, k_pos, j0, nk, stride, h, d, causal, block_latest)) continue;
    if (!warp_sees_keys(kp, j0, nk, causal, warp_latest, lane)) continue;
    rows_times_tile<D>(scores, qa, keys);    // S = Q K^T
    rows_times_tile<D>(dprobs, oa, values);  // dP = dO V^T
    __syncwarp();
    for (int c = half * (tile / 2); c < (half + 1) * (tile / 2); ++c) {
      const bool visible = valid && my_lse != -INFINITY && j0 + c < nk && !hidden(causal, kp[c], my_pos);
      const float p = visible ? expf(scores[r * tile + c] * scale - my_lse) : 0.0f;
      dscores[r * tile + c] = __float2bfloat16(p * (dprobs[r * tile + c] - my_delta) * scale);
    }
    __syncwarp();
    add_weights_times_tile<D>(dq_sum, dscores, keys);  // dQ += dS K
  }
  add_warp_sums<D>(dq, dq_sum, scores, first, nq, stride, h, d, lane);
#endif
}

/// Launches `kernel` with `bytes` of dynamic shared memory (over the default 48 KB: opted into).
template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, std::size_t bytes, cudaStream_t stream, Args... args) {
  TRAIN_GPT_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  kernel<<<grid, warps * 32, bytes, stream>>>(args...);
  TRAIN_GPT_CUDA_LAUNCHED();
}

}  // namespace

void attention_forward_bf16(cudaStream_t stream, const float* q, const float* k, const float* v,
                            const std::int64_t* q_pos, const std::int64_t* k_pos, std::size_t nq, std::size_t nk,
                            std::size_t heads, std::size_t head_dim, float scale, bool causal, float* out, float* lse) {
  with_head_width(head_dim, [&](auto width) {
    constexpr int w = decltype(width)::value;
    launch(forward_kernel<w>, dim3(blocks_for(nq, block_rows), static_cast<unsigned>(heads)), forward_layout<w>::bytes,
           stream, q, k, v, q_pos, k_pos, nq, nk, heads, static_cast<int>(head_dim), scale, causal, out, lse);
  });
}

void attention_backward_bf16(cudaStream_t stream, const float* q, const float* k, const float* v,
                             const std::int64_t* q_pos, const std::int64_t* k_pos, std::size_t nq, std::size_t nk,
                             std::size_t heads, std::size_t head_dim, float scale, bool causal, const float* lse,
                             const float* delta, const float* dout, float* dq, float* dk, float* dv) {
  with_head_width(head_dim, [&](auto width) {
    constexpr int w = decltype(width)::value;
    const int d = static_cast<int>(head_dim);
    launch(dkdv_kernel<w>, dim3(blocks_for(nk, block_rows), static_cast<unsigned>(heads)), dkdv_layout<w>::bytes,
           stream, q, k, v, q_pos, k_pos, nq, nk, heads, d, scale, causal, lse, delta, dout, dk, dv);
    launch(dq_kernel<w>, dim3(blocks_for(nq, block_rows), static_cast<unsigned>(heads)), dq_layout<w>::bytes, stream,
           q, k, v, q_pos, k_pos, nq, nk, heads, d, scale, causal, lse, delta, dout, dq);
  });
}

}  // namespace train_gpt::cuda::detail
