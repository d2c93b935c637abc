#pragma once
// The matrix products of kernels.hpp as shapes, and how each becomes the column-major product
// cuBLASLt computes. Plain C++, so that a CPU test can run the very same column-major calls
// through CBLAS and compare them with cpu_kernels (tests/train_gpt/test_cuda_layouts.cpp).

#include <cstddef>

namespace train_gpt::cuda {

/// Row-major C[M,N] = op(A) op(B): A stored [M,K] ([K,M] when `trans_a`), B stored [K,N]
/// ([N,K] when `trans_b`), C [M,N].
struct row_major_product {
  bool trans_a = false, trans_b = false;
  std::size_t M = 0, N = 0, K = 0;
};

/// y[T,out] = x[T,in] W[in,out]
constexpr row_major_product linear_forward_product(std::size_t tokens, std::size_t in, std::size_t out) {
  return {false, false, tokens, out, in};
}
/// dx[T,in] = dy[T,out] W^T (W stored [in,out])
constexpr row_major_product linear_backward_input_product(std::size_t tokens, std::size_t in, std::size_t out) {
  return {false, true, tokens, in, out};
}
/// dW[in,out] += x^T dy (x stored [T,in])
constexpr row_major_product linear_backward_weight_product(std::size_t tokens, std::size_t in, std::size_t out) {
  return {true, false, in, out, tokens};
}
/// logits[T,V] = h[T,C] wte^T (wte stored [V,C])
constexpr row_major_product logits_forward_product(std::size_t tokens, std::size_t c, std::size_t vocab) {
  return {false, true, tokens, vocab, c};
}
/// dh[T,C] = dlogits[T,V] wte[V,C]
constexpr row_major_product logits_backward_input_product(std::size_t tokens, std::size_t c, std::size_t vocab) {
  return {false, false, tokens, c, vocab};
}
/// dwte[V,C] += dlogits^T h (dlogits stored [T,V])
constexpr row_major_product logits_backward_weight_product(std::size_t tokens, std::size_t c, std::size_t vocab) {
  return {true, false, vocab, c, tokens};
}

/// The column-major product D(m x n) = op(first) op(second) equal to a row-major one: C^T =
/// op(B)^T op(A)^T, so `first` is the row-major B and `second` the row-major A, each read as
/// the column-major transpose of its storage. Stored shapes are (rows x cols, leading dimension).
struct column_major_product {
  bool trans_first = false, trans_second = false;
  std::size_t m = 0, n = 0, k = 0;
  std::size_t first_rows = 0, first_cols = 0, first_ld = 0;
  std::size_t second_rows = 0, second_cols = 0, second_ld = 0;
  std::size_t ld_out = 0;
};

constexpr column_major_product column_major(const row_major_product& p) {
  column_major_product c;
  c.trans_first = p.trans_b;
  c.trans_second = p.trans_a;
  c.m = p.N;
  c.n = p.M;
  c.k = p.K;
  // B stored [K,N] is column-major (N x K) = (m x k); stored [N,K] is (K x N) = (k x m), transposed.
  c.first_rows = p.trans_b ? c.k : c.m;
  c.first_cols = p.trans_b ? c.m : c.k;
  c.first_ld = c.first_rows;
  // A stored [M,K] is column-major (K x M) = (k x n); stored [K,M] is (M x K) = (n x k), transposed.
  c.second_rows = p.trans_a ? c.n : c.k;
  c.second_cols = p.trans_a ? c.k : c.n;
  c.second_ld = c.second_rows;
  c.ld_out = c.m;
  return c;
}

}  // namespace train_gpt::cuda
