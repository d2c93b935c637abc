#pragma once
// weft::moe's gemm_kernel on CBLAS (OpenBLAS): what train_gpt's MoE blocks and the MoE tests pass
// to moe_layer so that the router and the experts run as BLAS products. Here, with the programs'
// other shared pieces, because the library links no BLAS; the includer adds cblas.h's directory
// and links OpenBLAS.

#include <cblas.h>

#include <cstddef>

#include <weft/moe/gemm.hpp>

namespace weft_programs {

struct blas_gemm {
  void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
            std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) const {
    if (m == 0 || n == 0) return;
    if (k == 0) {  // BLAS would scale c by beta; the interface's beta == 0 overwrites
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0.0f : beta * c[i * ldc + j];
      return;
    }
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }
};
static_assert(weft::moe::gemm_kernel<blas_gemm>);

}  // namespace weft_programs
