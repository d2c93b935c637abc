// train_gpt's CUDA operations (examples/train_gpt/cuda) against the CPU path's (cpu_kernels.hpp)
// on random inputs of awkward sizes (no multiple of 32 unless a case needs one), forward and
// backward. Needs a GPU: label `gpu` (scripts/gpu-check.sh runs it).
//
// Tolerances are relative to the largest magnitude of the CPU's result (max |gpu - cpu| <=
// rtol * max |cpu| + atol), each chosen from how the two computations differ:
//  - fp32 products and row reductions: the same float operations summed in another order, an error
//    of about (terms) x 2^-24 relative; up to 128 terms here, so 1e-5 with a margin (rtol 2e-5);
//  - bf16 products: inputs rounded to bf16 on both sides, the GPU's output rounded to bf16
//    (relative 2^-9), so 8e-3;
//  - exponentials: the CPU's fast_exp (1 ulp) against expf (2 ulp): 1e-5 in GELU and softmax;
//  - attention: a softmax over up to 100 keys and products of 64 terms, in another order: 1e-5
//    forward, 1e-4 backward (whose products sum over keys and queries of those);
//  - exact where the operations and their order are the CPU's: the embeddings (gather, and
//    each row's sum in token order), the residual add, AdamW (no fused multiply-adds).

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu_kernels.hpp"
#include "kernels.hpp"

using train_gpt::cpu_kernels;
namespace gpu = train_gpt::cuda;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// A device copy of a host vector, and back.
template <class T>
class device {
 public:
  explicit device(std::size_t n) : n_(n) {
    void* p = nullptr;
    check(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
    p_ = static_cast<T*>(p);
    check(cudaMemset(p_, 0, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMemset");
  }
  explicit device(const std::vector<T>& v) : device(v.size()) { set(v); }
  ~device() { cudaFree(p_); }
  device(const device&) = delete;
  device& operator=(const device&) = delete;
  void set(const std::vector<T>& v) { check(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "to device"); }
  std::vector<T> get() const {
    check(cudaDeviceSynchronize(), "kernels");
    std::vector<T> v(n_);
    check(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "to host");
    return v;
  }
  T* data() { return p_; }
  operator T*() { return p_; }

 private:
  T* p_ = nullptr;
  std::size_t n_;
};

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

/// `v` rounded to bf16: the rounded values as floats (the fp32 reference's inputs) and as bf16.
std::pair<std::vector<float>, std::vector<gpu::bf16>> to_bf16(std::vector<float> v) {
  std::vector<gpu::bf16> h(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16(v[i]), v[i] = __bfloat162float(h[i]);
  return {v, h};
}

std::vector<float> from_bf16(const std::vector<gpu::bf16>& h) {
  std::vector<float> v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) v[i] = __bfloat162float(h[i]);
  return v;
}

/// The largest |a - b| is at most rtol x the largest |b| + atol; says by how much otherwise.
void require_close(const std::vector<float>& gpu, const std::vector<float>& cpu, double rtol, double atol = 0,
                   const char* what = "") {
  REQUIRE(gpu.size() == cpu.size());
  double err = 0, mag = 0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    REQUIRE(std::isfinite(gpu[i]));
    const double e = std::abs(static_cast<double>(gpu[i]) - cpu[i]);
    if (e > err) err = e, worst = i;
    mag = std::max(mag, std::abs(static_cast<double>(cpu[i])));
  }
  INFO(what << ": max error " << err << " at " << worst << " (gpu " << gpu[worst] << ", cpu " << cpu[worst]
            << "), largest magnitude " << mag << ", tolerance " << rtol * mag + atol);
  CHECK(err <= rtol * mag + atol);
}

struct fixture {
  cudaStream_t stream{};
  fixture() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
      FAIL("no CUDA device here: test_train_gpt_cuda needs a GPU (run it with scripts/gpu-check.sh on a GPU machine)");
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
  }
  ~fixture() { cudaStreamDestroy(stream); }
};

constexpr double fp32_rtol = 2e-5;

}  // namespace

TEST_CASE_METHOD(fixture, "linear layers: forward with and without bias, the GELU epilogue, both backward parts") {
  gpu::kernels k(stream);
  std::mt19937 rng(1);
  const std::size_t T = 77, in = 45;
  for (std::size_t out : {83u, 88u}) {  // 88: a multiple of 8, where the GELU epilogue is fused
    INFO("out " << out);
    const auto x = random_floats(T * in, rng), w = random_floats(in * out, rng, 0.2f), b = random_floats(out, rng);
    const auto dy = random_floats(T * out, rng), dw0 = random_floats(in * out, rng), db0 = random_floats(out, rng);
    device<float> dx_(x), dw_(w), db_(b), y_(T * out), pre_(T * out), g_(T * out), ddy(dy), dxg(T * in), ddw(dw0),
        ddb(db0);

    std::vector<float> y(T * out), yb(T * out), gelu(T * out);
    cpu_kernels::linear_forward(x.data(), w.data(), {}, y.data(), T, in, out);
    k.linear_forward(dx_, dw_, nullptr, y_, T, in, out);
    require_close(y_.get(), y, fp32_rtol, 0, "no bias");
    cpu_kernels::linear_forward(x.data(), w.data(), b, yb.data(), T, in, out);
    k.linear_forward(dx_, dw_, db_, y_, T, in, out);
    require_close(y_.get(), yb, fp32_rtol, 0, "bias");
    cpu_kernels::gelu_forward(yb.data(), gelu.data(), T * out);
    const bool fused = k.linear_forward_gelu(dx_, dw_, db_, pre_, g_, T, in, out);
    INFO("GELU in the product's epilogue: " << (fused ? "yes" : "no (product, then GELU)"));
    if (out % 8 != 0) CHECK_FALSE(fused);
    require_close(pre_.get(), yb, fp32_rtol, 0, "gelu epilogue's input");
    require_close(g_.get(), gelu, 1e-4, 1e-6, "gelu epilogue");  // cuBLASLt's own GELU formula

    std::vector<float> dx(T * in), dw = dw0, db = db0;
    cpu_kernels::linear_backward_input(w.data(), dy.data(), dx.data(), T, in, out);
    k.linear_backward_input(dw_, ddy, dxg, T, in, out);
    require_close(dxg.get(), dx, fp32_rtol, 0, "input gradient");
    cpu_kernels::linear_backward_weight(x.data(), dy.data(), dw.data(), db, T, in, out);
    k.linear_backward_weight(dx_, ddy, ddw, ddb, T, in, out);
    require_close(ddw.get(), dw, fp32_rtol, 0, "weight gradient (added)");
    require_close(ddb.get(), db, fp32_rtol, 0, "bias gradient (added)");
  }
}

TEST_CASE_METHOD(fixture, "bf16 linear layers against fp32 on the same rounded inputs") {
  gpu::kernels k(stream);
  std::mt19937 rng(2);
  const std::size_t T = 77, in = 72, out = 88;  // bf16 products want 16-byte rows: multiples of 8
  const auto [x, xh] = to_bf16(random_floats(T * in, rng));
  const auto [w, wh] = to_bf16(random_floats(in * out, rng, 0.2f));
  const auto [b, bh] = to_bf16(random_floats(out, rng));
  const auto [dy, dyh] = to_bf16(random_floats(T * out, rng));
  device<gpu::bf16> dx_(xh), dw_(wh), db_(bh), y_(T * out), ddy(dyh), dxg(T * in);
  device<float> ddw(in * out);
  std::vector<float> y(T * out), dx(T * in), dw(in * out, 0.0f);
  cpu_kernels::linear_forward(x.data(), w.data(), b, y.data(), T, in, out);
  k.linear_forward(dx_, dw_, db_, y_, T, in, out);
  require_close(from_bf16(y_.get()), y, 8e-3, 0, "bf16 forward");
  cpu_kernels::linear_backward_input(w.data(), dy.data(), dx.data(), T, in, out);
  k.linear_backward_input(dw_, ddy, dxg, T, in, out);
  require_close(from_bf16(dxg.get()), dx, 8e-3, 0, "bf16 input gradient");
  cpu_kernels::linear_backward_weight(x.data(), dy.data(), dw.data(), {}, T, in, out);
  k.linear_backward_weight(dx_, ddy, ddw, T, in, out);
  require_close(ddw.get(), dw, fp32_rtol, 0, "bf16 weight gradient (fp32 out)");  // exact products, fp32 sums
}

TEST_CASE_METHOD(fixture, "the tied output layer: logits, their input and weight gradients") {
  gpu::kernels k(stream);
  std::mt19937 rng(3);
  const std::size_t T = 29, c = 45, V = 1001;
  const auto h = random_floats(T * c, rng), wte = random_floats(V * c, rng, 0.1f), dl = random_floats(T * V, rng, 0.01f);
  const auto dwte0 = random_floats(V * c, rng);
  device<float> dh_(h), dwte(wte), dlog(dl), logits_(T * V), dhg(T * c), ddwte(dwte0);
  std::vector<float> logits(T * V), dh(T * c), dw = dwte0;
  cpu_kernels::logits_forward(h.data(), wte.data(), logits.data(), T, c, V);
  k.logits_forward(dh_, dwte, logits_, T, c, V);
  require_close(logits_.get(), logits, fp32_rtol, 0, "logits");
  cpu_kernels::logits_backward_input(wte.data(), dl.data(), dh.data(), T, c, V);
  k.logits_backward_input(dwte, dlog, dhg, T, c, V);
  require_close(dhg.get(), dh, 1e-4, 0, "dh (1001 terms)");
  cpu_kernels::logits_backward_weight(h.data(), dl.data(), dw.data(), T, c, V);
  k.logits_backward_weight(dh_, dlog, ddwte, T, c, V);
  require_close(ddwte.get(), dw, fp32_rtol, 0, "dwte (added)");
}

TEST_CASE_METHOD(fixture, "layer norm forward and backward; column sums, twice with the same bits") {
  gpu::kernels k(stream);
  std::mt19937 rng(4);
  const std::size_t T = 301, c = 71;
  auto x = random_floats(T * c, rng, 2.0f);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t i = 0; i < c; ++i) x[t * c + i] += static_cast<float>(t % 7);  // rows with a mean far from 0
  const auto w = random_floats(c, rng), b = random_floats(c, rng), dy = random_floats(T * c, rng);
  const auto dx0 = random_floats(T * c, rng), dw0 = random_floats(c, rng), db0 = random_floats(c, rng);
  device<float> xd(x), wd(w), bd(b), yd(T * c), md(T), rd(T), dyd(dy), dxd(dx0), dwd(dw0), dbd(db0);
  std::vector<float> y(T * c), mean(T), rstd(T), dx = dx0, dw = dw0, db = db0;
  cpu_kernels::layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), T, c);
  k.layernorm_forward(xd, wd, bd, yd, md, rd, T, c);
  require_close(yd.get(), y, fp32_rtol, 0, "y");
  require_close(md.get(), mean, fp32_rtol, 0, "mean");
  require_close(rd.get(), rstd, fp32_rtol, 0, "rstd");
  cpu_kernels::layernorm_backward_input(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), dx.data(), T, c);
  k.layernorm_backward_input(xd, wd, md, rd, dyd, dxd, T, c);
  require_close(dxd.get(), dx, fp32_rtol, 0, "dx (added)");
  cpu_kernels::layernorm_backward_params(x.data(), mean.data(), rstd.data(), dy.data(), dw.data(), db.data(), T, c);
  k.layernorm_backward_params(xd, md, rd, dyd, dwd, dbd, T, c);
  require_close(dwd.get(), dw, 1e-4, 0, "dw (added; 301 rows)");
  require_close(dbd.get(), db, 1e-4, 0, "db (added; 301 rows)");

  // The bias gradient: the same bits from two runs (a fixed order of sums), and the CPU's value.
  const std::size_t rows = 4097;  // more than one band of rows
  const auto g = random_floats(rows * c, rng);
  std::vector<float> sums(c, 0.0f);
  cpu_kernels::column_sums(g.data(), sums, rows);
  device<float> gd(g), s1(c), s2(c);
  k.column_sums(gd, s1, rows, c);
  k.column_sums(gd, s2, rows, c);
  const auto first = s1.get();
  CHECK(first == s2.get());
  require_close(first, sums, 1e-4, 0, "column sums (4097 rows)");
}

TEST_CASE_METHOD(fixture, "bf16 layer norm against fp32 on the same rounded inputs") {
  gpu::kernels k(stream);
  std::mt19937 rng(10);
  const std::size_t T = 77, c = 71;
  const auto [x, xh] = to_bf16(random_floats(T * c, rng, 2.0f));
  const auto [w, wh] = to_bf16(random_floats(c, rng));
  const auto [b, bh] = to_bf16(random_floats(c, rng));
  const auto [dy, dyh] = to_bf16(random_floats(T * c, rng));
  const auto [dx0, dx0h] = to_bf16(random_floats(T * c, rng));
  device<gpu::bf16> xd(xh), wd(wh), bd(bh), yd(T * c), dyd(dyh), dxd(dx0h);
  device<float> md(T), rd(T), dwd(c), dbd(c);
  std::vector<float> y(T * c), mean(T), rstd(T), dx = dx0, dw(c, 0.0f), db(c, 0.0f);
  cpu_kernels::layernorm_forward(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), T, c);
  k.layernorm_forward(xd, wd, bd, yd, md, rd, T, c);
  require_close(from_bf16(yd.get()), y, 8e-3, 0, "bf16 y");
  require_close(md.get(), mean, fp32_rtol, 1e-6, "mean (fp32 from bf16 inputs)");
  require_close(rd.get(), rstd, fp32_rtol, 0, "rstd");
  cpu_kernels::layernorm_backward_input(x.data(), w.data(), mean.data(), rstd.data(), dy.data(), dx.data(), T, c);
  k.layernorm_backward_input(xd, wd, md, rd, dyd, dxd, T, c);
  require_close(from_bf16(dxd.get()), dx, 8e-3, 0, "bf16 dx (added)");
  cpu_kernels::layernorm_backward_params(x.data(), mean.data(), rstd.data(), dy.data(), dw.data(), db.data(), T, c);
  k.layernorm_backward_params(xd, md, rd, dyd, dwd, dbd, T, c);
  require_close(dwd.get(), dw, 1e-4, 0, "dw (fp32)");
  require_close(dbd.get(), db, 1e-4, 0, "db (fp32)");
}

TEST_CASE_METHOD(fixture, "GELU forward and backward, the residual add") {
  gpu::kernels k(stream);
  std::mt19937 rng(5);
  const std::size_t n = 10007, T = 77, c = 130;
  const auto x = random_floats(n, rng, 3.0f), dy = random_floats(n, rng);
  device<float> xd(x), yd(n), dyd(dy), dxd(n);
  std::vector<float> y(n), dx(n);
  cpu_kernels::gelu_forward(x.data(), y.data(), n);
  k.gelu_forward(xd, yd, n);
  require_close(yd.get(), y, 1e-5, 1e-7, "gelu");
  cpu_kernels::gelu_backward(x.data(), dy.data(), dx.data(), n);
  k.gelu_backward(xd, dyd, dxd, n);
  require_close(dxd.get(), dx, 1e-5, 1e-7, "gelu backward");

  const auto a = random_floats(T * c, rng), o = random_floats(T * c, rng), b = random_floats(c, rng);
  device<float> ad(a), od(o), bd(b), rd(T * c);
  std::vector<float> r(T * c);
  cpu_kernels::residual_add(a.data(), o.data(), b.data(), r.data(), T, c);
  k.residual_add(ad, od, bd, rd, T, c);
  CHECK(rd.get() == r);
}

TEST_CASE_METHOD(fixture, "bf16 GELU and residual add against their fp32 kernels on the same rounded inputs") {
  // Each computes in fp32 from exactly widened inputs and rounds once: GELU within a bf16 rounding
  // of the fp32 kernel's (2^-9 relative, so 4e-3 of the largest), the residual add (two float
  // additions in the same order) the fp32 kernel's result rounded to nearest, to the bit.
  gpu::kernels k(stream);
  std::mt19937 rng(11);
  const std::size_t n = 10007, T = 77, c = 136;
  const auto [x, xh] = to_bf16(random_floats(n, rng, 3.0f));
  const auto [dy, dyh] = to_bf16(random_floats(n, rng));
  device<float> xf(x), yf(n), dyf(dy), dxf(n);
  device<gpu::bf16> xb(xh), yb(n), dyb(dyh), dxb(n);
  k.gelu_forward(xf, yf, n);
  k.gelu_forward(xb, yb, n);
  require_close(from_bf16(yb.get()), yf.get(), 4e-3, 0, "bf16 gelu");
  k.gelu_backward(xf, dyf, dxf, n);
  k.gelu_backward(xb, dyb, dxb, n);
  require_close(from_bf16(dxb.get()), dxf.get(), 4e-3, 0, "bf16 gelu backward");

  const auto [a, ah] = to_bf16(random_floats(T * c, rng));
  const auto [o, oh] = to_bf16(random_floats(T * c, rng));
  const auto [b, bh] = to_bf16(random_floats(c, rng));
  device<float> af(a), of(o), bf(b), rf(T * c);
  device<gpu::bf16> ab(ah), ob(oh), bb(bh), rb(T * c);
  k.residual_add(af, of, bf, rf, T, c);
  k.residual_add(ab, ob, bb, rb, T, c);
  CHECK(from_bf16(rb.get()) == to_bf16(rf.get()).first);
}

TEST_CASE_METHOD(fixture, "fp32 <-> bf16 conversions: round to nearest even, widen exactly, column ranges") {
  gpu::kernels k(stream);
  std::mt19937 rng(12);
  // An independent rounding: add half an ulp of bf16 (less one, plus the kept bit: ties to even)
  // to the float's bits and keep the top 16.
  auto round_bits = [](float f) {
    std::uint32_t u = 0;
    std::memcpy(&u, &f, 4);
    return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  };
  auto bits_of = [](gpu::bf16 h) {
    std::uint16_t u = 0;
    std::memcpy(&u, &h, 2);
    return u;
  };
  auto widen = [](std::uint16_t b) {
    const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float f = 0;
    std::memcpy(&f, &u, 4);
    return f;
  };
  std::vector<float> x = random_floats(1001, rng, 100.0f);
  // Ties: 1 + 2^-8 rounds down to 1 (even), 1 + 3 x 2^-8 up to 1 + 2^-6; and signs, zero, tiny, huge.
  for (float v : {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f), 0.0f, -0.0f, 1e-30f, 3e38f, -2.5f})
    x.push_back(v);
  const std::size_t n = x.size();
  device<float> xd(x), back(n);
  device<gpu::bf16> hd(n);
  k.convert(xd, hd, n);
  const std::vector<gpu::bf16> h = hd.get();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += bits_of(h[i]) != round_bits(x[i]);
  CHECK(wrong == 0);
  CHECK(widen(bits_of(h[n - 8])) == 1.0f);
  CHECK(widen(bits_of(h[n - 7])) == 1.0f + 0x1p-6f);
  k.convert(hd, back, n);
  const std::vector<float> wide = back.get();
  for (std::size_t i = 0; i < n; ++i) {
    const float expected = widen(bits_of(h[i]));
    wrong += std::memcmp(&wide[i], &expected, 4) != 0;  // bits: -0 stays -0
  }
  CHECK(wrong == 0);

  // Columns: the middle block of a [rows, 3 c] array to bf16 [rows, c] and back into the middle of
  // a wider fp32 array whose other columns keep their values.
  const std::size_t rows = 37, c = 24;
  const auto qkv = random_floats(rows * 3 * c, rng);
  device<float> qkvd(qkv);
  device<gpu::bf16> middle(rows * c);
  k.convert_columns(qkvd.data() + c, 3 * c, middle, c, c, rows);
  const std::vector<gpu::bf16> m = middle.get();
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < c; ++j) wrong += bits_of(m[r * c + j]) != round_bits(qkv[r * 3 * c + c + j]);
  CHECK(wrong == 0);
  const std::size_t wide_cols = 2 * c + 5;
  const auto before = random_floats(rows * wide_cols, rng);
  device<float> target(before);
  k.convert_columns(middle, c, target.data() + 3, wide_cols, c, rows);
  const std::vector<float> after = target.get();
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < wide_cols; ++j) {
      const float expected = j >= 3 && j < 3 + c ? widen(bits_of(m[r * c + j - 3])) : before[r * wide_cols + j];
      wrong += after[r * wide_cols + j] != expected;
    }
  CHECK(wrong == 0);
}

TEST_CASE_METHOD(fixture, "bf16 column sums and tied output layer against their fp32 kernels on the same rounded inputs") {
  gpu::kernels k(stream);
  std::mt19937 rng(13);
  // Column sums: bf16 widened exactly, then the fp32 kernel's sums in its order: the same bits.
  const std::size_t rows = 4097, cols = 72;
  const auto [g, gh] = to_bf16(random_floats(rows * cols, rng));
  const auto s0 = random_floats(cols, rng);
  device<float> gf(g), sf(s0), sb(s0);
  device<gpu::bf16> gb(gh);
  k.column_sums(gf, sf, rows, cols);
  k.column_sums(gb, sb, rows, cols);
  CHECK(sb.get() == sf.get());

  // The tied output layer on a padded vocabulary (a multiple of 8: bf16 rows of 16 bytes). Products
  // of bf16 are exact in fp32 and both sum in fp32, in their own orders: the fp32 results (logits,
  // dwte) within 1e-4 of the largest (72 and 29 terms, with tensor cores' accumulation), the bf16
  // dh within one bf16 rounding (8e-3, as the bf16 linear layers).
  const std::size_t T = 29, c = 72, V = 1008;
  const auto [h, hh] = to_bf16(random_floats(T * c, rng));
  const auto [wte, wteh] = to_bf16(random_floats(V * c, rng, 0.1f));
  const auto [dl, dlh] = to_bf16(random_floats(T * V, rng, 0.01f));
  const auto dwte0 = random_floats(V * c, rng);
  device<float> hf(h), wtef(wte), dlf(dl), logitsf(T * V), dhf(T * c), dwtef(dwte0);
  device<gpu::bf16> hb(hh), wteb(wteh), dlb(dlh), dhb(T * c);
  device<float> logitsb(T * V), dwteb(dwte0);
  k.logits_forward(hf, wtef, logitsf, T, c, V);
  k.logits_forward(hb, wteb, logitsb, T, c, V);
  require_close(logitsb.get(), logitsf.get(), 1e-4, 0, "bf16 logits (fp32 out)");
  k.logits_backward_input(wtef, dlf, dhf, T, c, V);
  k.logits_backward_input(wteb, dlb, dhb, T, c, V);
  require_close(from_bf16(dhb.get()), dhf.get(), 8e-3, 0, "bf16 dh");
  k.logits_backward_weight(hf, dlf, dwtef, T, c, V);
  k.logits_backward_weight(hb, dlb, dwteb, T, c, V);
  require_close(dwteb.get(), dwtef.get(), 1e-4, 0, "bf16 dwte (fp32, added)");
}

TEST_CASE_METHOD(fixture, "embeddings: forward exact; backward exact and the same bits on every run") {
  gpu::kernels k(stream);
  std::mt19937 rng(6);
  const std::size_t n = 301, c = 45, vocab = 37, seq = 43;  // tokens repeat many times
  std::vector<std::int32_t> tokens(n);
  std::vector<std::int64_t> positions(n);
  std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(vocab) - 1);
  for (std::size_t t = 0; t < n; ++t) tokens[t] = tok(rng), positions[t] = static_cast<std::int64_t>(t % seq);
  const auto wte = random_floats(vocab * c, rng), wpe = random_floats(seq * c, rng), dx = random_floats(n * c, rng);
  const auto dwte0 = random_floats(vocab * c, rng), dwpe0 = random_floats(seq * c, rng);
  device<std::int32_t> td(tokens);
  device<std::int64_t> pd(positions);
  device<float> wted(wte), wped(wpe), xd(n * c), dxd(dx);
  std::vector<float> x(n * c);
  cpu_kernels::embedding_forward(tokens, positions, wte.data(), wpe.data(), x.data(), c);
  k.embedding_forward(td, pd, wted, wped, xd, n, c);
  CHECK(xd.get() == x);

  std::vector<float> dwte = dwte0, dwpe = dwpe0;
  cpu_kernels::embedding_backward(tokens, positions, dx.data(), dwte.data(), dwpe.data(), c);
  std::vector<std::vector<float>> runs;
  for (int run = 0; run < 2; ++run) {
    device<float> dwted(dwte0), dwped(dwpe0);
    k.embedding_backward(td, pd, dxd, dwted, dwped, n, c);
    const auto gw = dwted.get(), gp = dwped.get();
    CHECK(gw == dwte);  // each token's rows added in token order, as the CPU adds them
    CHECK(gp == dwpe);
    runs.push_back(gw);
  }
  CHECK(runs[0] == runs[1]);
}

TEST_CASE_METHOD(fixture, "embeddings of one vocabulary block (tensor parallelism): -1 is a zero row, adds nothing") {
  gpu::kernels k(stream);
  std::mt19937 rng(16);
  const std::size_t n = 97, c = 24, vocab = 40, seq = 17, first = 20, block = 20;  // this rank: tokens [20, 40)
  std::vector<std::int32_t> tokens(n), local(n);
  std::vector<std::int64_t> positions(n);
  std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(vocab) - 1);
  for (std::size_t t = 0; t < n; ++t) {
    tokens[t] = tok(rng), positions[t] = static_cast<std::int64_t>(t % seq);
    local[t] = tokens[t] >= static_cast<std::int32_t>(first) ? tokens[t] - static_cast<std::int32_t>(first) : -1;
  }
  const auto wte = random_floats(block * c, rng), wpe = random_floats(seq * c, rng), dx = random_floats(n * c, rng);
  device<std::int32_t> ld(local);
  device<std::int64_t> pd(positions);
  device<float> wted(wte), wped(wpe), xd(n * c), dxd(dx), dwted(block * c), dwped(seq * c);
  // The lookup alone, then the positions added: the rows of other blocks are the positions' alone.
  k.embedding_forward(ld, pd, wted, nullptr, xd, n, c);
  k.add_positions(pd, wped, xd, n, c);
  std::vector<float> expected(n * c), dwte(block * c, 0.0f), dwpe(seq * c, 0.0f);
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t j = 0; j < c; ++j) {
      const float token = local[t] < 0 ? 0.0f : wte[static_cast<std::size_t>(local[t]) * c + j];
      expected[t * c + j] = token + wpe[static_cast<std::size_t>(positions[t]) * c + j];
    }
  CHECK(xd.get() == expected);
  k.embedding_backward(ld, pd, dxd, dwted, dwped, n, c);
  for (std::size_t t = 0; t < n; ++t)  // rows in order, as the stable sort keeps them
    for (std::size_t j = 0; j < c; ++j) {
      if (local[t] >= 0) dwte[static_cast<std::size_t>(local[t]) * c + j] += dx[t * c + j];
      dwpe[static_cast<std::size_t>(positions[t]) * c + j] += dx[t * c + j];
    }
  CHECK(dwted.get() == dwte);
  CHECK(dwped.get() == dwpe);
}

TEST_CASE_METHOD(fixture, "cross-entropy fused with the softmax, whole rows and split by vocabulary") {
  gpu::kernels k(stream);
  std::mt19937 rng(7);
  const std::size_t rows = 29, V = 1001;
  const float scale = 1.0f / 29.0f;
  const auto logits = random_floats(rows * V, rng, 3.0f);
  std::vector<std::int32_t> labels(rows);
  std::uniform_int_distribution<std::int32_t> lab(0, static_cast<std::int32_t>(V) - 1);
  for (auto& l : labels) l = lab(rng);
  labels[0] = 0, labels[1] = static_cast<std::int32_t>(V) - 1, labels[2] = 500, labels[3] = 499;  // the ends of both blocks

  std::vector<float> grad = logits;
  const double cpu_loss = cpu_kernels::cross_entropy(grad.data(), labels, V, scale);
  device<float> ld(logits);
  device<std::int32_t> labd(labels);
  device<double> lossd(rows);
  k.cross_entropy(ld, labd, rows, V, scale, lossd);
  const auto losses = lossd.get();
  CHECK(std::abs(std::accumulate(losses.begin(), losses.end(), 0.0) - cpu_loss) <= 1e-5 * std::abs(cpu_loss));
  require_close(ld.get(), grad, 1e-5, 1e-9, "gradient");

  // Two vocabulary blocks (500 and 501 columns), with the host doing the all-reduces.
  const std::size_t split = 500;
  std::vector<std::vector<float>> blocks(2);
  for (std::size_t t = 0; t < rows; ++t) {
    blocks[0].insert(blocks[0].end(), logits.begin() + t * V, logits.begin() + t * V + split);
    blocks[1].insert(blocks[1].end(), logits.begin() + t * V + split, logits.begin() + (t + 1) * V);
  }
  const std::size_t first[2] = {0, split}, cols[2] = {split, V - split};
  device<float> b0(blocks[0]), b1(blocks[1]), max0(rows), max1(rows);
  device<double> sums0(2 * rows), sums1(2 * rows), loss0(rows);
  float* b[2] = {b0, b1};
  float* mx[2] = {max0, max1};
  double* sm[2] = {sums0, sums1};
  for (int r = 0; r < 2; ++r) k.cross_entropy_row_max(b[r], rows, cols[r], mx[r]);
  const auto m0 = max0.get(), m1 = max1.get();
  std::vector<float> max(rows);
  for (std::size_t t = 0; t < rows; ++t) max[t] = std::max(m0[t], m1[t]);
  max0.set(max);
  max1.set(max);
  for (int r = 0; r < 2; ++r) k.cross_entropy_exp_sums(b[r], labd, rows, cols[r], first[r], mx[r], sm[r]);
  auto s0 = sums0.get();
  const auto s1 = sums1.get();
  for (std::size_t i = 0; i < 2 * rows; ++i) s0[i] += s1[i];
  sums0.set(s0);
  sums1.set(s0);
  for (int r = 0; r < 2; ++r) k.cross_entropy_finish(b[r], labd, rows, cols[r], first[r], mx[r], sm[r], scale, r == 0 ? loss0.data() : nullptr);
  const auto split_losses = loss0.get();
  CHECK(std::abs(std::accumulate(split_losses.begin(), split_losses.end(), 0.0) - cpu_loss) <= 1e-5 * std::abs(cpu_loss));
  const auto g0 = b0.get(), g1 = b1.get();
  std::vector<float> joined;
  for (std::size_t t = 0; t < rows; ++t) {
    joined.insert(joined.end(), g0.begin() + t * split, g0.begin() + (t + 1) * split);
    joined.insert(joined.end(), g1.begin() + t * (V - split), g1.begin() + (t + 1) * (V - split));
  }
  require_close(joined, grad, 1e-5, 1e-9, "vocab-parallel gradient");
}

TEST_CASE_METHOD(fixture, "AdamW: three steps equal to the CPU's, bit for bit") {
  gpu::kernels k(stream);
  std::mt19937 rng(8);
  const std::size_t n = 1031;
  for (bool decay : {true, false}) {
    auto p = random_floats(n, rng);
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    device<float> pd(p), md(n), vd(n), gd(n);
    const cpu_kernels::adamw_settings cs{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
    const gpu::adamw_settings gs{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
    for (long step = 1; step <= 3; ++step) {
      const auto g = random_floats(n, rng, 0.1f);
      gd.set(g);
      cpu_kernels::adamw(p.data(), g.data(), m.data(), v.data(), n, step, cs, decay);
      k.adamw(pd, gd, md, vd, n, step, gs, decay);
      CHECK(pd.get() == p);
      CHECK(md.get() == m);
      CHECK(vd.get() == v);
    }
  }
}

TEST_CASE_METHOD(fixture, "ring attention's merge: two key blocks attended apart and merged are one attended whole") {
  gpu::kernels k(stream);
  std::mt19937 rng(19);
  const std::size_t nq = 45, heads = 3, d = 32, row = heads * d;
  std::vector<std::int64_t> q_pos(nq), first(30), second(nq);  // keys 0..29, then 30..74; queries 30..74
  std::iota(q_pos.begin(), q_pos.end(), 30);
  std::iota(first.begin(), first.end(), 0);
  std::iota(second.begin(), second.end(), 30);
  std::vector<std::int64_t> all(first);
  all.insert(all.end(), second.begin(), second.end());
  const auto q = random_floats(nq * row, rng), k1 = random_floats(first.size() * row, rng),
             v1 = random_floats(first.size() * row, rng), k2 = random_floats(second.size() * row, rng),
             v2 = random_floats(second.size() * row, rng);
  std::vector<float> kall(k1), vall(v1);
  kall.insert(kall.end(), k2.begin(), k2.end());
  vall.insert(vall.end(), v2.begin(), v2.end());
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  device<std::int64_t> qp(q_pos), p1(first), p2(second), pall(all);
  device<float> qd(q), k1d(k1), v1d(v1), k2d(k2), v2d(v2), kalld(kall), valld(vall);
  device<float> whole(nq * row), whole_lse(nq * heads), out(nq * row), lse(nq * heads), block(nq * row),
      block_lse(nq * heads);
  k.attention_forward(qd, kalld, valld, qp, pall, nq, all.size(), heads, d, scale, true, whole, whole_lse);
  // As the ring starts: out 0 and lse -inf, then each block folded in.
  k.fill(out, nq * row, 0.0f);
  k.fill(lse, nq * heads, -INFINITY);
  k.attention_forward(qd, k2d, v2d, qp, p2, nq, second.size(), heads, d, scale, true, block, block_lse);  // the diagonal
  k.attention_merge(out, lse, block, block_lse, nq, heads, d);
  k.attention_forward(qd, k1d, v1d, qp, p1, nq, first.size(), heads, d, scale, true, block, block_lse);  // all visible
  k.attention_merge(out, lse, block, block_lse, nq, heads, d);
  require_close(out.get(), whole.get(), 1e-5, 1e-7, "merged out");
  require_close(lse.get(), whole_lse.get(), 1e-5, 0, "merged lse");
  // A block no query sees (keys after every query) leaves the result as it was.
  std::vector<std::int64_t> later(10);
  std::iota(later.begin(), later.end(), 100);
  device<std::int64_t> pl(later);
  device<float> kl(random_floats(later.size() * row, rng)), vl(random_floats(later.size() * row, rng));
  k.attention_forward(qd, kl, vl, qp, pl, nq, later.size(), heads, d, scale, true, block, block_lse);
  k.attention_merge(out, lse, block, block_lse, nq, heads, d);
  require_close(out.get(), whole.get(), 1e-5, 1e-7, "out after a hidden block");
}

namespace {

/// Attention computed `math`'s way against the CPU path's BLAS attention, forward and backward, on
/// random inputs (rounded to bf16 first when `rounded`, for both sides), over the cases below:
/// out within forward_rtol, dq, dk, dv (added to random values) within backward_rtol.
void check_attention(cudaStream_t stream, gpu::attention_math math, bool rounded, double forward_rtol,
                     double backward_rtol) {
  gpu::kernels k(stream, gpu::gemm_math::fp32, math);
  std::mt19937 rng(9);
  struct case_ {
    const char* name;
    std::vector<std::int64_t> q_pos, k_pos;
    std::size_t heads, head_dim;
    bool causal;
  };
  auto range = [](std::int64_t first, std::size_t n) {
    std::vector<std::int64_t> v(n);
    std::iota(v.begin(), v.end(), first);
    return v;
  };
  auto join = [](std::vector<std::int64_t> a, const std::vector<std::int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<case_> cases = {
      {"one sequence of 77, head_dim 64", range(0, 77), range(0, 77), 3, 64, true},
      {"one sequence of 100, head_dim 40", range(0, 100), range(0, 100), 2, 40, true},
      // cp's load-balanced chunks: queries of chunks 1 and 6 against the keys of chunks 1 and 6
      {"load-balanced chunks, head_dim 24", join(range(13, 13), range(78, 13)), join(range(13, 13), range(78, 13)), 3, 24, true},
      // a later block of keys than queries: every row sees nothing (out 0, lse -inf)
      {"keys after every query", range(0, 37), range(40, 45), 2, 64, true},
      {"not causal, head_dim 100", range(0, 51), range(0, 67), 2, 100, false},
      // several blocks of queries and tiles of keys (64 each), some of them hidden wholly
      {"one sequence of 300, head_dim 64", range(0, 300), range(0, 300), 2, 64, true},
      {"one sequence of 150, head_dim 128", range(0, 150), range(0, 150), 1, 128, true},
  };
  auto input = [&](std::size_t n) { return rounded ? to_bf16(random_floats(n, rng)).first : random_floats(n, rng); };
  for (const case_& c : cases) {
    INFO(c.name);
    const std::size_t nq = c.q_pos.size(), nk = c.k_pos.size(), row = c.heads * c.head_dim;
    const weft::cp::attention_shape shape{.heads = c.heads, .head_dim = c.head_dim};
    const weft::cp::attention_options options{.causal = c.causal};
    const float scale = static_cast<float>(weft::cp::softmax_scale(shape, options));
    const auto q = input(nq * row), kk = input(nk * row), v = input(nk * row), dout = input(nq * row);
    const auto dq0 = random_floats(nq * row, rng), dk0 = random_floats(nk * row, rng), dv0 = random_floats(nk * row, rng);
    std::vector<float> out(nq * row), lse(nq * c.heads), dq = dq0, dk = dk0, dv = dv0;
    train_gpt::blas_attention cpu;
    cpu.forward(q, c.q_pos, kk, v, c.k_pos, shape, options, out, lse);
    cpu.backward(q, c.q_pos, kk, v, c.k_pos, shape, options, out, lse, dout, dq, dk, dv);

    device<float> qd(q), kd(kk), vd(v), od(nq * row), lsed(nq * c.heads), dod(dout), dqd(dq0), dkd(dk0), dvd(dv0);
    device<std::int64_t> qp(c.q_pos), kp(c.k_pos);
    k.attention_forward(qd, kd, vd, qp, kp, nq, nk, c.heads, c.head_dim, scale, c.causal, od, lsed);
    require_close(od.get(), out, forward_rtol, 1e-7, "out");
    const auto g_lse = lsed.get();
    for (std::size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(lse[i])) {
        CHECK((std::isinf(g_lse[i]) && g_lse[i] < 0));
        continue;
      }
      CHECK(std::abs(g_lse[i] - lse[i]) <= 1e-5f * std::max(1.0f, std::abs(lse[i])));
    }
    k.attention_backward(qd, kd, vd, qp, kp, nq, nk, c.heads, c.head_dim, scale, c.causal, od, lsed, dod, dqd, dkd, dvd);
    // The added-to values are as large as the gradients: compare the gradients alone.
    auto minus = [](std::vector<float> a, const std::vector<float>& b) {
      for (std::size_t i = 0; i < a.size(); ++i) a[i] -= b[i];
      return a;
    };
    require_close(minus(dqd.get(), dq0), minus(dq, dq0), backward_rtol, 1e-6, "dq (added)");
    require_close(minus(dkd.get(), dk0), minus(dk, dk0), backward_rtol, 1e-6, "dk (added)");
    require_close(minus(dvd.get(), dv0), minus(dv, dv0), backward_rtol, 1e-6, "dv (added)");
  }
}

}  // namespace

TEST_CASE_METHOD(fixture, "causal attention, forward and backward, against the CPU path's BLAS attention") {
  check_attention(stream, gpu::attention_math::fp32, false, 1e-5, 1e-4);
}

// Inputs rounded to bf16 on both sides, so the scores are the CPU's to fp32 rounding (bf16 x bf16
// products are exact in fp32) and lse agrees to 1e-5; what differs is the probabilities and their
// gradients rounded to bf16 as operands (relative 2^-9 each): out within 1e-2 of its largest
// magnitude, and the gradients, sums of such terms that partly cancel (dS sums to zero over each
// query's keys), within 3e-2. A product wired wrong (a transposed tile, a missed key tile, a lost
// rescale) is off by the gradients' own size.
TEST_CASE_METHOD(fixture, "bf16 attention on the tensor cores against the CPU's on the same rounded inputs") {
  check_attention(stream, gpu::attention_math::tensor_cores_bf16, true, 1e-2, 3e-2);
}
