// Times train_gpt's CUDA operations (examples/train_gpt/cuda) at GPT-2 small's sizes on one GPU:
// 8 sequences of 1024 tokens (8192 rows), hidden 768, 12 heads of 64, the vocabulary padded to
// 50304, 124 M parameters for AdamW. Prints one line per operation, the mean of its timed calls
// (CUDA events around a batch of calls, after a warm-up) and the rate it reached: TFLOP/s for
// products and attention (2 flops per multiply-add; causal attention counts only the unmasked
// half), GB/s for the rest (the bytes each call must read and write at least).
//
//   gpu_kernels [--reps N]     (default 10 calls per operation)

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kernels.hpp"

namespace gpu = train_gpt::cuda;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// Device memory filled with small random values (or zeros), freed with the program.
struct arena {
  std::vector<void*> blocks;
  std::mt19937 rng{1};
  ~arena() {
    for (void* p : blocks) cudaFree(p);
  }
  template <class T>
  T* zeros(std::size_t n) {
    void* p = nullptr;
    check(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
    check(cudaMemset(p, 0, n * sizeof(T)), "cudaMemset");
    blocks.push_back(p);
    return static_cast<T*>(p);
  }
  /// Random values (zeros would let the GPU run cooler and faster than on real data): a block of
  /// up to 1 M values repeated, so that filling 124 M parameters takes no time on the host.
  template <class T>
  T* random(std::size_t n, float scale = 0.1f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<T> h(std::min<std::size_t>(n, std::size_t{1} << 20));
    for (T& x : h) x = static_cast<T>(d(rng));
    T* p = zeros<T>(n);
    for (std::size_t i = 0; i < n; i += h.size())
      check(cudaMemcpy(p + i, h.data(), std::min(h.size(), n - i) * sizeof(T), cudaMemcpyHostToDevice), "to device");
    return p;
  }
};

struct timer {
  cudaStream_t stream;
  int reps;
  /// Milliseconds per call of f, over `reps` calls after two to warm up.
  double time(const std::function<void()>& f) const {
    f();
    f();
    cudaEvent_t start, stop;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < reps; ++i) f();
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return static_cast<double>(ms) / reps;
  }
};

void report_flops(const char* name, double ms, double flops) {
  std::printf("gpu kernel: %-44s %9.3f ms %9.1f TFLOP/s\n", name, ms, flops / (ms * 1e-3) / 1e12);
}
void report_bytes(const char* name, double ms, double bytes) {
  std::printf("gpu kernel: %-44s %9.3f ms %9.1f GB/s\n", name, ms, bytes / (ms * 1e-3) / 1e9);
}

}  // namespace

int main(int argc, char** argv) try {
  int reps = 10;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "gpu_kernels: unknown argument '%s' (usage: gpu_kernels [--reps N], N >= 1)\n", argv[i]);
      return 2;
    }
  }
  if (reps < 1) {
    std::fprintf(stderr, "gpu_kernels: --reps must be at least 1\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "gpu_kernels: no CUDA device here; run it on a GPU machine (scripts/gpu-check.sh)\n");
    return 1;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("gpu kernel: device %s, %d reps per operation\n", prop.name, reps);

  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  const timer t{stream, reps};
  arena a;
  const std::size_t seqs = 8, seq = 1024, N = seqs * seq, C = 768, H = 12, D = 64, V = 50304, logit_rows = 1024;
  const double flops_per = 2.0;

  // ---- products: fp32, tf32 and bf16 ----
  {
    gpu::kernels fp32(stream, gpu::gemm_math::fp32), tf32(stream, gpu::gemm_math::tf32);
    float* x = a.random<float>(N * 4 * C);
    float* w = a.random<float>(4 * C * 4 * C);
    float* b = a.random<float>(4 * C);
    float* y = a.zeros<float>(N * 4 * C);
    float* pre = a.zeros<float>(N * 4 * C);
    float* dw = a.zeros<float>(4 * C * 4 * C);
    const double fc = flops_per * N * C * 4 * C;  // c_fc: [N, C] x [C, 4C]
    for (auto* k : {&fp32, &tf32}) {
      const char* math = k == &fp32 ? "fp32" : "tf32";
      std::string name = std::string("linear fwd+bias c_fc ") + math;
      report_flops(name.c_str(), t.time([&] { k->linear_forward(x, w, b, y, N, C, 4 * C); }), fc);
      const bool fused = k->linear_forward_gelu(x, w, b, pre, y, N, C, 4 * C);
      name = std::string("linear fwd+bias+gelu ") + (fused ? "epilogue" : "(no epilogue)") + " c_fc " + math;
      report_flops(name.c_str(), t.time([&] { k->linear_forward_gelu(x, w, b, pre, y, N, C, 4 * C); }), fc);
      name = std::string("linear fwd+bias, then gelu c_fc ") + math;
      report_flops(name.c_str(), t.time([&] {
                     k->linear_forward(x, w, b, pre, N, C, 4 * C);
                     k->gelu_forward(pre, y, N * 4 * C);
                   }),
                   fc);
      name = std::string("linear bwd input c_fc ") + math;
      report_flops(name.c_str(), t.time([&] { k->linear_backward_input(w, y, x, N, C, 4 * C); }), fc);
      name = std::string("linear bwd weight+bias c_fc ") + math;
      report_flops(name.c_str(), t.time([&] { k->linear_backward_weight(x, y, dw, b, N, C, 4 * C); }), fc);
      name = std::string("logits fwd 1024 rows x 50304 ") + math;
      float* wte = a.random<float>(V * C);
      float* logits = a.zeros<float>(logit_rows * V);
      report_flops(name.c_str(), t.time([&] { k->logits_forward(x, wte, logits, logit_rows, C, V); }),
                   flops_per * logit_rows * C * V);
    }
    gpu::bf16* xb = a.random<gpu::bf16>(N * 4 * C);
    gpu::bf16* wb = a.random<gpu::bf16>(4 * C * 4 * C);
    gpu::bf16* bb = a.random<gpu::bf16>(4 * C);
    gpu::bf16* yb = a.zeros<gpu::bf16>(N * 4 * C);
    report_flops("linear fwd+bias c_fc bf16", t.time([&] { fp32.linear_forward(xb, wb, bb, yb, N, C, 4 * C); }), fc);
    report_flops("linear bwd input c_fc bf16", t.time([&] { fp32.linear_backward_input(wb, yb, xb, N, C, 4 * C); }), fc);
    report_flops("linear bwd weight c_fc bf16 (fp32 grad)",
                 t.time([&] { fp32.linear_backward_weight(xb, yb, dw, N, C, 4 * C); }), fc);
    report_bytes("gelu fwd bf16 [8192, 3072]", t.time([&] { fp32.gelu_forward(yb, xb, N * 4 * C); }), 2.0 * 2 * N * 4 * C);
    float* mean = a.zeros<float>(N);
    float* rstd = a.zeros<float>(N);
    report_bytes("layernorm fwd bf16 [8192, 768]",
                 t.time([&] { fp32.layernorm_forward(xb, bb, bb, yb, mean, rstd, N, C); }), 2.0 * 2 * N * C);
  }

  // ---- per-element and per-row operations, fp32 ----
  gpu::kernels k(stream);
  {
    float* x = a.random<float>(N * 4 * C);
    float* y = a.zeros<float>(N * 4 * C);
    float* dx = a.zeros<float>(N * 4 * C);
    const double n4 = static_cast<double>(N) * 4 * C, n1 = static_cast<double>(N) * C;
    report_bytes("gelu fwd [8192, 3072]", t.time([&] { k.gelu_forward(x, y, N * 4 * C); }), 4 * 2 * n4);
    report_bytes("gelu bwd [8192, 3072]", t.time([&] { k.gelu_backward(x, y, dx, N * 4 * C); }), 4 * 3 * n4);
    float* bias = a.random<float>(C);
    report_bytes("residual add [8192, 768]", t.time([&] { k.residual_add(x, y, bias, dx, N, C); }), 4 * 3 * n1);
    report_bytes("column sums (bias grad) [8192, 768]", t.time([&] { k.column_sums(x, bias, N, C); }), 4 * n1);
    float* w = a.random<float>(C);
    float* mean = a.zeros<float>(N);
    float* rstd = a.zeros<float>(N);
    report_bytes("layernorm fwd [8192, 768]", t.time([&] { k.layernorm_forward(x, w, bias, y, mean, rstd, N, C); }),
                 4 * 2 * n1);
    report_bytes("layernorm bwd input [8192, 768]",
                 t.time([&] { k.layernorm_backward_input(x, w, mean, rstd, y, dx, N, C); }), 4 * 4 * n1);
    float* dw = a.zeros<float>(C);
    report_bytes("layernorm bwd params [8192, 768]",
                 t.time([&] { k.layernorm_backward_params(x, mean, rstd, y, dw, bias, N, C); }), 4 * 2 * n1);

    // Embeddings: GPT-2's vocabulary, tokens drawn at random (repeats as in text).
    std::vector<std::int32_t> tokens(N);
    std::vector<std::int64_t> positions(N);
    std::mt19937 rng(2);
    std::uniform_int_distribution<std::int32_t> tok(0, 50256);
    for (std::size_t i = 0; i < N; ++i) tokens[i] = tok(rng), positions[i] = static_cast<std::int64_t>(i % seq);
    auto* td = a.zeros<std::int32_t>(N);
    auto* pd = a.zeros<std::int64_t>(N);
    check(cudaMemcpy(td, tokens.data(), N * sizeof(std::int32_t), cudaMemcpyHostToDevice), "to device");
    check(cudaMemcpy(pd, positions.data(), N * sizeof(std::int64_t), cudaMemcpyHostToDevice), "to device");
    float* wte = a.random<float>(V * C);
    float* wpe = a.random<float>(seq * C);
    float* dwte = a.zeros<float>(V * C);
    float* dwpe = a.zeros<float>(seq * C);
    report_bytes("embedding fwd [8192, 768]", t.time([&] { k.embedding_forward(td, pd, wte, wpe, y, N, C); }), 4 * 3 * n1);
    report_bytes("embedding bwd, sorted (deterministic)",
                 t.time([&] { k.embedding_backward(td, pd, x, dwte, dwpe, N, C); }), 4 * 5 * n1);

    // The loss over a chunk of rows of logits (what the model keeps at once).
    float* logits = a.random<float>(logit_rows * V, 2.0f);
    auto* labels = a.zeros<std::int32_t>(logit_rows);
    check(cudaMemcpy(labels, tokens.data(), logit_rows * sizeof(std::int32_t), cudaMemcpyHostToDevice), "to device");
    auto* losses = a.zeros<double>(logit_rows);
    report_bytes("cross-entropy fused [1024, 50304]",
                 t.time([&] { k.cross_entropy(logits, labels, logit_rows, V, 1e-3f, losses); }),
                 4.0 * 2 * logit_rows * V);

    // AdamW over GPT-2 small's 124 M parameters: reads p, g, m, v and writes p, m, v.
    const std::size_t params = 124'475'904;
    float* p = a.random<float>(params);
    float* g = a.random<float>(params);
    float* m = a.zeros<float>(params);
    float* v = a.zeros<float>(params);
    long step = 0;
    report_bytes("adamw 124M params", t.time([&] { k.adamw(p, g, m, v, params, ++step, {}, true); }), 4.0 * 7 * params);
  }

  // ---- causal attention: 8 sequences of 1024, 12 heads of 64, one call per sequence ----
  {
    const std::size_t row = H * D;
    float* q = a.random<float>(N * row, 1.0f);
    float* kk = a.random<float>(N * row, 1.0f);
    float* v = a.random<float>(N * row, 1.0f);
    float* out = a.zeros<float>(N * row);
    float* lse = a.zeros<float>(N * H);
    float* dout = a.random<float>(N * row, 1.0f);
    float* dq = a.zeros<float>(N * row);
    float* dk = a.zeros<float>(N * row);
    float* dv = a.zeros<float>(N * row);
    std::vector<std::int64_t> pos(seq);
    std::iota(pos.begin(), pos.end(), 0);
    auto* pd = a.zeros<std::int64_t>(seq);
    check(cudaMemcpy(pd, pos.data(), seq * sizeof(std::int64_t), cudaMemcpyHostToDevice), "to device");
    const float scale = 0.125f;
    // Causal: half of the seq x seq scores; forward is 2 products (QK^T, PV), backward 5.
    const double half_products = flops_per * static_cast<double>(seq) * seq * D * H / 2 * seqs;
    gpu::kernels tensor_cores(stream, gpu::gemm_math::fp32, gpu::attention_math::tensor_cores_bf16);
    for (auto [kernel, name] : {std::pair<gpu::kernels*, const char*>{&k, "fp32 (flash-style)"},
                                std::pair<gpu::kernels*, const char*>{&tensor_cores, "bf16 tensor cores"}}) {
      report_flops((std::string("attention fwd causal ") + name).c_str(), t.time([&] {
                     for (std::size_t s = 0; s < seqs; ++s)
                       kernel->attention_forward(q + s * seq * row, kk + s * seq * row, v + s * seq * row, pd, pd, seq,
                                                 seq, H, D, scale, true, out + s * seq * row, lse + s * seq * H);
                   }),
                   2 * half_products);
      report_flops((std::string("attention bwd causal ") + name).c_str(), t.time([&] {
                     for (std::size_t s = 0; s < seqs; ++s)
                       kernel->attention_backward(q + s * seq * row, kk + s * seq * row, v + s * seq * row, pd, pd,
                                                  seq, seq, H, D, scale, true, out + s * seq * row, lse + s * seq * H,
                                                  dout + s * seq * row, dq + s * seq * row, dk + s * seq * row,
                                                  dv + s * seq * row);
                   }),
                   5 * half_products);
    }
  }
  check(cudaStreamSynchronize(stream), "kernels");  // the stream lives until exit: `k` frees on it
  std::printf("gpu kernel: done\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "gpu_kernels: %s\n", e.what());
  return 1;
}
