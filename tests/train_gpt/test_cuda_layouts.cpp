// The column-major products the CUDA operations hand to cuBLASLt (examples/train_gpt/cuda/
// products.hpp: each operation's shape, and its operands swapped and read as transposes), run on
// the CPU through CBLAS's column-major interface with exactly those parameters, against
// cpu_kernels' row-major results. Checks the layouts that gemm.cu gives cuBLASLt without a GPU.

#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "cpu_kernels.hpp"
#include "products.hpp"

using namespace train_gpt;

namespace {

std::vector<float> random_floats(std::size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

/// C = op(A) op(B) (+ beta C) as cuBLASLt is asked for it: column-major, B's storage first.
void column_major_gemm(const cuda::row_major_product& p, const float* A, const float* B, float* C, float beta) {
  const cuda::column_major_product c = cuda::column_major(p);
  // The stored shapes cover the operands' storage exactly.
  REQUIRE(c.first_rows * c.first_cols == p.K * p.N);
  REQUIRE(c.second_rows * c.second_cols == p.M * p.K);
  cblas_sgemm(CblasColMajor, c.trans_first ? CblasTrans : CblasNoTrans, c.trans_second ? CblasTrans : CblasNoTrans,
              static_cast<int>(c.m), static_cast<int>(c.n), static_cast<int>(c.k), 1.0f, B, static_cast<int>(c.first_ld),
              A, static_cast<int>(c.second_ld), beta, C, static_cast<int>(c.ld_out));
}

void require_close(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(std::abs(a[i] - b[i]) <= 1e-4f * (1.0f + std::abs(b[i])));
}

}  // namespace

TEST_CASE("the CUDA products' column-major forms equal cpu_kernels' row-major products") {
  std::mt19937 rng(11);
  const std::size_t T = 13, in = 7, out = 11, V = 17;  // all different, so a swapped dimension shows
  const auto x = random_floats(T * in, rng), w = random_floats(in * out, rng), dy = random_floats(T * out, rng);
  const auto dw0 = random_floats(in * out, rng);

  std::vector<float> want(T * out), got(T * out);
  cpu_kernels::linear_forward(x.data(), w.data(), {}, want.data(), T, in, out);
  column_major_gemm(cuda::linear_forward_product(T, in, out), x.data(), w.data(), got.data(), 0.0f);
  require_close(got, want);

  want.assign(T * in, 0.0f);
  got.assign(T * in, 0.0f);
  cpu_kernels::linear_backward_input(w.data(), dy.data(), want.data(), T, in, out);
  column_major_gemm(cuda::linear_backward_input_product(T, in, out), dy.data(), w.data(), got.data(), 0.0f);
  require_close(got, want);

  want = dw0;
  got = dw0;
  cpu_kernels::linear_backward_weight(x.data(), dy.data(), want.data(), {}, T, in, out);
  column_major_gemm(cuda::linear_backward_weight_product(T, in, out), x.data(), dy.data(), got.data(), 1.0f);
  require_close(got, want);

  // The tied output layer: h [T, C = in], wte [V, C].
  const auto wte = random_floats(V * in, rng), dl = random_floats(T * V, rng), dwte0 = random_floats(V * in, rng);
  want.assign(T * V, 0.0f);
  got.assign(T * V, 0.0f);
  cpu_kernels::logits_forward(x.data(), wte.data(), want.data(), T, in, V);
  column_major_gemm(cuda::logits_forward_product(T, in, V), x.data(), wte.data(), got.data(), 0.0f);
  require_close(got, want);

  want.assign(T * in, 0.0f);
  got.assign(T * in, 0.0f);
  cpu_kernels::logits_backward_input(wte.data(), dl.data(), want.data(), T, in, V);
  column_major_gemm(cuda::logits_backward_input_product(T, in, V), dl.data(), wte.data(), got.data(), 0.0f);
  require_close(got, want);

  want = dwte0;
  got = dwte0;
  cpu_kernels::logits_backward_weight(x.data(), dl.data(), want.data(), T, in, V);
  column_major_gemm(cuda::logits_backward_weight_product(T, in, V), dl.data(), x.data(), got.data(), 1.0f);
  require_close(got, want);
}
