#pragma once
/// \file
/// Collective matmul: the all-gather before a column-parallel GEMM and the reduce-scatter after a
/// row-parallel one, decomposed into tp ring steps so that each chunk's transfer runs while the
/// previous chunk multiplies (the decomposition of Wang et al., "Overlap Communication with
/// Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS 2023, which
/// Megatron's TP communication overlap also uses).
///
///   all_gather_matmul:    y[m·p, n] = all_gather_rows(x[m, k]) · w[n, k]ᵀ
///   matmul_reduce_scatter: y[m/p, n] = this rank's rows of  Σ_ranks x_r[m, k] · w_r[n, k]ᵀ
///
/// With p ranks each takes p steps (p GEMMs of a chunk, p-1 ring transfers to the next rank); the
/// transfer of step s+1 is posted (one `batch()` of send + receive) before the GEMM of step s runs.
///
/// The GEMM is the caller's (`gemm(a, b, c, rows, n, k)`: c[rows, n] = a[rows, k] · b[n, k]ᵀ,
/// overwriting c), so weft needs no BLAS: pass your BLAS's sgemm, or weft::tp::reference::matmul_nt.
///
/// Results:
///   - all_gather_matmul equals the plain all-gather-then-GEMM bit for bit whenever the GEMM
///     computes a row of c the same way however many rows it is given (true of the reference
///     loops and of the bench's blocked GEMM; usually, not always, of a BLAS).
///   - matmul_reduce_scatter sums the ranks' partial products in a fixed ring order: block b is
///     (((P_{b+1} + P_{b+2}) + ...) + P_b), indices mod p. With 2 ranks that equals any sum of the
///     two bit for bit; with more it differs from MPI's or NCCL's reduce-scatter (whose order is
///     their own) by rounding only: |Δ| ≤ (p-1)·ε·Σ|P_r| elementwise (ε = 2^-24 in float). The
///     result is the same on every run (deterministic), which MPI's and NCCL's are not promised to be.
///
/// Progress: Open MPI moves a large message only while some MPI call runs on its ranks, so the
/// GEMM of each step is cut into `progress_slices` row panels with a test of the pending transfer
/// between them; without that the transfer would mostly wait for the end of the GEMM.
///
/// Host memory only (the MPI backend). On GPUs the same decomposition needs two streams (one
/// for NCCL's p2p, one for the GEMMs) and events between them; it is not provided here.
/// `decompose = false` runs the plain version (one collective, then one GEMM) with the same
/// arguments, for comparison and as a fallback.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/error.hpp>
#include <weft/tp/mappings.hpp>

namespace weft::tp {

struct collective_matmul_options {
  bool decompose = true;             ///< false: the plain collective, then one GEMM
  std::size_t progress_slices = 4;   ///< row panels per step's GEMM, with a progress test between them
};

/// Buffers a collective matmul reuses from call to call (optional; a call without one allocates).
template <class T>
struct collective_matmul_workspace {
  std::vector<T> a, b, c;
};

/// A GEMM callback: gemm(a, b, c, rows, n, k) computes c[rows, n] = a[rows, k] · b[n, k]ᵀ.
template <class G, class T>
concept gemm_nt = requires(G g, const T* a, const T* b, T* c, std::size_t s) { g(a, b, c, s, s, s); };

namespace detail {

template <backend B>
void require(communicator<B>& comm, std::string_view op, bool ok, const std::string& message) {
  if (!ok) fail(where(comm, op) + ": " + message);
}

/// Runs the GEMM of `rows` rows in slices, testing `pending` between them so the transfer moves.
template <class T, class G, class R>
void sliced_gemm(G& gemm, const T* a, const T* w, T* c, std::size_t rows, std::size_t n, std::size_t k,
                 std::size_t slices, R* pending) {
  slices = std::max<std::size_t>(1, std::min(slices, rows));
  const std::size_t per = (rows + slices - 1) / slices;
  for (std::size_t start = 0; start < rows; start += per) {
    const std::size_t count = std::min(per, rows - start);
    gemm(a + start * k, w, c + start * n, count, n, k);
    if (pending != nullptr) (void)pending->test();
  }
}

}  // namespace detail

/// y[m·p, n] = (every rank's x[m, k], gathered by rows in rank order) · w[n, k]ᵀ, with the ring
/// transfers overlapping the GEMMs. Collective over `tp`; shapes equal on every rank.
template <backend B, class T, gemm_nt<T> G>
void all_gather_matmul(communicator<B>& tp, std::span<const T> x, std::span<const T> w, std::span<T> y,
                       std::size_t m, std::size_t n, std::size_t k, G&& gemm, collective_matmul_options options = {},
                       collective_matmul_workspace<T>* workspace = nullptr) {
  static_assert(buffer_memory_v<B> == memory_space::host,
                "weft::tp::all_gather_matmul runs on host memory (the MPI backend); on GPUs overlap NCCL and "
                "cuBLAS on two streams instead");
  constexpr std::string_view op = "all_gather_matmul";
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  detail::require(tp, op, x.size() == m * k,
                  "x has " + std::to_string(x.size()) + " elements, not m·k = " + std::to_string(m * k) +
                      " (this rank's [m, k] rows); pass this rank's rows");
  detail::require(tp, op, w.size() == n * k,
                  "w has " + std::to_string(w.size()) + " elements, not n·k = " + std::to_string(n * k) + " ([n, k])");
  detail::require(tp, op, y.size() == m * p * n,
                  "y has " + std::to_string(y.size()) + " elements, not m·p·n = " + std::to_string(m * p * n) +
                      " (the gathered rows times n)");
  collective_matmul_workspace<T> own;
  collective_matmul_workspace<T>& ws = workspace ? *workspace : own;
  if (!options.decompose || p == 1) {
    ws.a.resize(m * p * k);
    tp.all_gather(x, std::span<T>(ws.a));
    gemm(static_cast<const T*>(ws.a.data()), w.data(), y.data(), m * p, n, k);
    return;
  }
  ws.a.resize(m * k);
  ws.b.resize(m * k);
  const int next = static_cast<int>((r + 1) % p), prev = static_cast<int>((r + p - 1) % p);
  std::span<const T> current = x;  // step s holds the rows of rank (r - s) mod p
  T* spare[2] = {ws.a.data(), ws.b.data()};
  for (std::size_t s = 0; s < p; ++s) {
    const std::size_t owner = (r + p - s) % p;
    typename communicator<B>::request pending;
    std::span<T> incoming;
    if (s + 1 < p) {
      incoming = std::span<T>(spare[s % 2], m * k);
      pending = tp.batch().send(current, next).recv(incoming, prev).run_async();
    }
    detail::sliced_gemm(gemm, current.data(), w.data(), y.data() + owner * m * n, m, n, k, options.progress_slices,
                        s + 1 < p ? &pending : nullptr);
    if (s + 1 < p) {
      pending.wait();
      current = incoming;
    }
  }
}

/// y[m/p, n] = this rank's block of rows of Σ over ranks of x_r[m, k] · w_r[n, k]ᵀ (each rank's
/// partial product of a row-parallel layer), with the ring transfers overlapping the GEMMs.
/// Collective over `tp`; m must divide by the group size.
template <backend B, class T, gemm_nt<T> G>
void matmul_reduce_scatter(communicator<B>& tp, std::span<const T> x, std::span<const T> w, std::span<T> y,
                           std::size_t m, std::size_t n, std::size_t k, G&& gemm,
                           collective_matmul_options options = {}, collective_matmul_workspace<T>* workspace = nullptr) {
  static_assert(buffer_memory_v<B> == memory_space::host,
                "weft::tp::matmul_reduce_scatter runs on host memory (the MPI backend); on GPUs overlap NCCL and "
                "cuBLAS on two streams instead");
  constexpr std::string_view op = "matmul_reduce_scatter";
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  detail::require(tp, op, m % p == 0,
                  "m = " + std::to_string(m) + " rows do not divide by the group size " + std::to_string(p) +
                      "; pad the rows or choose a tp degree that divides them");
  detail::require(tp, op, x.size() == m * k,
                  "x has " + std::to_string(x.size()) + " elements, not m·k = " + std::to_string(m * k) + " ([m, k])");
  detail::require(tp, op, w.size() == n * k,
                  "w has " + std::to_string(w.size()) + " elements, not n·k = " + std::to_string(n * k) + " ([n, k])");
  const std::size_t rows = m / p;
  detail::require(tp, op, y.size() == rows * n,
                  "y has " + std::to_string(y.size()) + " elements, not (m/p)·n = " + std::to_string(rows * n) +
                      " (this rank's block)");
  collective_matmul_workspace<T> own;
  collective_matmul_workspace<T>& ws = workspace ? *workspace : own;
  if (!options.decompose || p == 1) {
    ws.a.resize(m * n);
    gemm(x.data(), w.data(), ws.a.data(), m, n, k);
    tp.reduce_scatter(std::span<const T>(ws.a), y, reduce_op::sum);
    return;
  }
  // Step s works on block (r + p - 1 - s) mod p: it adds this rank's partial product to the
  // running sum received from the previous rank and passes it on; at the last step the block is
  // this rank's own and the sum is complete.
  const std::size_t chunk = rows * n;
  ws.a.resize(chunk);  // the sum this rank sends
  ws.b.resize(chunk);  // the sum it receives
  ws.c.resize(chunk);  // this step's partial product
  const int next = static_cast<int>((r + 1) % p), prev = static_cast<int>((r + p - 1) % p);
  for (std::size_t s = 0; s < p; ++s) {
    const std::size_t block = (r + p - 1 - s) % p;
    const bool last = s + 1 == p;
    T* partial = last ? y.data() : ws.c.data();
    typename communicator<B>::request pending;
    if (s > 0) pending = tp.batch().send(std::span<const T>(ws.a), next).recv(std::span<T>(ws.b), prev).run_async();
    detail::sliced_gemm(gemm, x.data() + block * rows * k, w.data(), partial, rows, n, k, options.progress_slices,
                        s > 0 ? &pending : nullptr);
    if (s > 0) {
      pending.wait();
      for (std::size_t i = 0; i < chunk; ++i) partial[i] = ws.b[i] + partial[i];
    }
    if (!last) std::swap(ws.a, ws.c);  // this step's sum is what the next step sends
  }
}

}  // namespace weft::tp
