#pragma once
/// \file
/// The one arithmetic interface weft/moe needs: a single-precision matrix product in the shape
/// of BLAS's sgemm, row-major. The router and the experts are loops of these products (the
/// experts run as grouped GEMMs: one product per expert and source rank). weft itself links no
/// BLAS: `reference_gemm` is plain loops, obviously correct and slow; a trainer passes an object
/// with the same member that calls its BLAS (cblas_sgemm(CblasRowMajor, ...) has exactly these
/// arguments) or cuBLAS.

#include <concepts>
#include <cstddef>

namespace weft::moe {

/// c[m, n] = alpha · op(a) · op(b) + beta · c, row-major; op(x) is x or xᵀ (trans_*); lda, ldb,
/// ldc are the row strides of a, b and c as stored. beta == 0 overwrites c (NaNs there included).
template <class G>
concept gemm_kernel = requires(const G& g, bool trans, std::size_t n, float scalar, const float* in, float* out) {
  { g.gemm(trans, trans, n, n, n, scalar, in, n, in, n, scalar, out, n) } -> std::same_as<void>;
};

/// Plain loops, accumulating in double.
struct reference_gemm {
  void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
            std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) const {
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        double sum = 0;
        for (std::size_t q = 0; q < k; ++q)
          sum += static_cast<double>(trans_a ? a[q * lda + i] : a[i * lda + q]) *
                 static_cast<double>(trans_b ? b[j * ldb + q] : b[q * ldb + j]);
        float& out = c[i * ldc + j];
        out = static_cast<float>(alpha * sum) + (beta == 0 ? 0.0f : beta * out);
      }
  }
};

static_assert(gemm_kernel<reference_gemm>);

}  // namespace weft::moe
