// weft::moe's gemm_kernel on CBLAS (OpenBLAS): what a trainer passes to moe_layer so that the
// router and the experts run as BLAS products.
#pragma once

#include <cblas.h>

#include <cstddef>

namespace moe_test {

struct blas_gemm {
  void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
            std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) const {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }
};

}  // namespace moe_test
