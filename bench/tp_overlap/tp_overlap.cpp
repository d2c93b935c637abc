// Collective matmul on the tp group: does the ring decomposition hide the all-gather behind the
// GEMM? Each rank holds x[m, k] (its rows of the sequence) and w[n, k]; the step is
// y[m·p, n] = all_gather(x) · wᵀ. Medians (over iterations; each iteration the slowest rank) of:
//   gemm        the GEMM alone (m·p rows)
//   comm        the all-gather alone
//   plain       all-gather, then GEMM
//   overlapped  weft::tp::all_gather_matmul (p ring steps, transfer of step s+1 during GEMM of s)
// and the same four for the row-parallel side (GEMM then reduce-scatter of y[m·p, n]).
// Target: overlapped <= gemm + 0.3 x comm, at sizes where comm >= 1/3 of the plain step.
//
//   mpirun -n 2 weft_bench_tp_overlap [--m 512] [--k 2048] [--n 48] [--slices 8] [--iterations 9]
//                                     [--warmup 2] [--json FILE]
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/tp/collective_matmul.hpp>

#include "../grad_sync/bench_args.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

using namespace weft_bench;
using comm_t = weft::communicator<weft::mpi_backend>;

namespace {

// c[m, n] = a[m, k] · b[n, k]ᵀ, blocked over n and k so a panel of b stays in cache; each c[i, j]
// sums over k in increasing order (so results do not depend on how rows are grouped).
void blocked_gemm(const float* a, const float* b, float* c, std::size_t m, std::size_t n, std::size_t k) {
  constexpr std::size_t jb = 16, kb = 512;
  for (std::size_t i = 0; i < m * n; ++i) c[i] = 0.0f;
  for (std::size_t q0 = 0; q0 < k; q0 += kb) {
    const std::size_t q1 = std::min(k, q0 + kb);
    for (std::size_t j0 = 0; j0 < n; j0 += jb) {
      const std::size_t j1 = std::min(n, j0 + jb);
      for (std::size_t i = 0; i < m; ++i) {
        const float* ai = a + i * k;
        for (std::size_t j = j0; j < j1; ++j) {
          const float* bj = b + j * k;
          float s = c[i * n + j];
          for (std::size_t q = q0; q < q1; ++q) s += ai[q] * bj[q];
          c[i * n + j] = s;
        }
      }
    }
  }
}

struct side {
  double gemm = 0, comm = 0, plain = 0, overlapped = 0;
  std::size_t wrong = 0;
  double target() const { return gemm + 0.3 * comm; }
  double ratio() const { return overlapped / target(); }
  double comm_fraction() const { return comm / plain; }
};

template <class F>
double timed(MPI_Comm raw, F&& f) {
  MPI_Barrier(raw);
  const double t = now_s();
  f();
  return max_over_ranks(now_s() - t, raw);
}

void print(const char* title, const side& s) {
  std::printf("%-26s %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f %8.3f %9.2f %7zu\n", title, s.gemm * 1e3, s.comm * 1e3,
              (s.gemm + s.comm) * 1e3, s.plain * 1e3, s.overlapped * 1e3, s.target() * 1e3, s.ratio(),
              s.comm_fraction(), s.wrong);
}

std::string json_of(const side& s) {
  return "{\"gemm_s\": " + json_value(s.gemm) + ", \"comm_s\": " + json_value(s.comm) +
         ", \"parts_s\": " + json_value(s.gemm + s.comm) + ", \"plain_s\": " + json_value(s.plain) +
         ", \"overlapped_s\": " + json_value(s.overlapped) + ", \"target_s\": " + json_value(s.target()) +
         ", \"ratio\": " + json_value(s.ratio()) + ", \"comm_fraction\": " + json_value(s.comm_fraction()) +
         ", \"wrong\": " + std::to_string(s.wrong) + "}";
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int status = 0;
  try {
    check_arguments(argc, argv, {"--m", "--k", "--n", "--slices", "--iterations", "--warmup", "--json"}, {});
    const std::size_t m = std::stoul(option(argc, argv, "--m", "512"));
    const std::size_t k = std::stoul(option(argc, argv, "--k", "2048"));
    const std::size_t n = std::stoul(option(argc, argv, "--n", "48"));
    const std::size_t slices = std::stoul(option(argc, argv, "--slices", "8"));
    const int iterations = std::stoi(option(argc, argv, "--iterations", "9"));
    const int warmup = std::stoi(option(argc, argv, "--warmup", "2"));
    const std::string json_path = option(argc, argv, "--json");

    comm_t tp(weft::mpi_backend::comm::world(), "tp");
    MPI_Comm raw = MPI_COMM_WORLD;
    const auto p = static_cast<std::size_t>(tp.size());
    const auto r = static_cast<std::size_t>(tp.rank());
    std::vector<float> x(m * k), w(n * k), gathered(m * p * k);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 31 + r * 7) % 97) / 97.0f - 0.5f;
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((i * 17) % 89) / 89.0f - 0.5f;
    std::vector<float> y_plain(m * p * n), y_overlap(m * p * n), y_full(m * p * n);
    std::vector<float> xr(m * p * k), rs_plain(m * n), rs_overlap(m * n);  // row-parallel side: x[m·p, k]
    for (std::size_t i = 0; i < xr.size(); ++i) xr[i] = static_cast<float>((i * 13 + r * 5) % 83) / 83.0f - 0.5f;
    weft::tp::collective_matmul_workspace<float> ws_plain, ws_overlap;
    const weft::tp::collective_matmul_options plain_opts{.decompose = false};
    const weft::tp::collective_matmul_options overlap_opts{.decompose = true, .progress_slices = slices};
    auto gemm = [](const float* a, const float* b, float* c, std::size_t mm, std::size_t nn, std::size_t kk) {
      blocked_gemm(a, b, c, mm, nn, kk);
    };

    std::vector<double> ag[4], rs[4];
    for (int it = 0; it < warmup + iterations; ++it) {
      double t[8];
      t[0] = timed(raw, [&] { blocked_gemm(gathered.data(), w.data(), y_full.data(), m * p, n, k); });
      t[1] = timed(raw, [&] { tp.all_gather(std::span<const float>(x), std::span<float>(gathered)); });
      t[2] = timed(raw, [&] {
        weft::tp::all_gather_matmul(tp, std::span<const float>(x), std::span<const float>(w), std::span<float>(y_plain),
                                    m, n, k, gemm, plain_opts, &ws_plain);
      });
      t[3] = timed(raw, [&] {
        weft::tp::all_gather_matmul(tp, std::span<const float>(x), std::span<const float>(w),
                                    std::span<float>(y_overlap), m, n, k, gemm, overlap_opts, &ws_overlap);
      });
      t[4] = timed(raw, [&] { blocked_gemm(xr.data(), w.data(), y_full.data(), m * p, n, k); });
      t[5] = timed(raw, [&] { tp.reduce_scatter(std::span<const float>(y_full), std::span<float>(rs_plain)); });
      t[6] = timed(raw, [&] {
        weft::tp::matmul_reduce_scatter(tp, std::span<const float>(xr), std::span<const float>(w),
                                        std::span<float>(rs_plain), m * p, n, k, gemm, plain_opts, &ws_plain);
      });
      t[7] = timed(raw, [&] {
        weft::tp::matmul_reduce_scatter(tp, std::span<const float>(xr), std::span<const float>(w),
                                        std::span<float>(rs_overlap), m * p, n, k, gemm, overlap_opts, &ws_overlap);
      });
      if (it < warmup) continue;
      for (int v = 0; v < 4; ++v) {
        ag[v].push_back(t[v]);
        rs[v].push_back(t[4 + v]);
      }
    }
    side a{median(ag[0]), median(ag[1]), median(ag[2]), median(ag[3]), 0};
    side b{median(rs[0]), median(rs[1]), median(rs[2]), median(rs[3]), 0};
    // Correctness: the all-gather side bit for bit; the reduce-scatter side within the rounding
    // of a different summation order (bit for bit on 2 ranks).
    for (std::size_t i = 0; i < y_plain.size(); ++i) a.wrong += y_plain[i] != y_overlap[i];
    for (std::size_t i = 0; i < rs_plain.size(); ++i) {
      const float tolerance = p == 2 ? 0.0f : 1e-5f * static_cast<float>(k) * static_cast<float>(p);
      b.wrong += !(std::fabs(rs_plain[i] - rs_overlap[i]) <= tolerance);
    }
    unsigned long long wrong[2] = {a.wrong, b.wrong}, all_wrong[2] = {0, 0};
    MPI_Allreduce(wrong, all_wrong, 2, MPI_UNSIGNED_LONG_LONG, MPI_SUM, raw);
    a.wrong = all_wrong[0];
    b.wrong = all_wrong[1];

    if (r == 0) {
      std::printf("# weft tp collective matmul: %zu ranks, x[%zu, %zu] per rank, w[%zu, %zu], %zu progress slices, "
                  "%d iterations (median; each the slowest rank)\n",
                  p, m, k, n, k, slices, iterations);
      std::printf("%-26s %10s %10s %10s %10s %10s %10s %8s %9s %7s\n", "# step", "gemm_ms", "comm_ms", "sum_ms",
                  "plain_ms", "overlap_ms", "target_ms", "ratio", "comm/plain", "#wrong");
      print("all_gather + GEMM", a);
      print("GEMM + reduce_scatter", b);
      std::printf("# ratio = overlapped / (gemm + 0.3 x comm); target <= 1 where comm/plain >= 0.33\n");
      std::printf("# wrong elements in total: %llu (%s)\n", all_wrong[0] + all_wrong[1],
                  all_wrong[0] + all_wrong[1] == 0 ? "OK" : "WRONG");
      if (!json_path.empty()) {
        std::ofstream out(json_path);
        out << "{\"ranks\": " << p << ", \"m\": " << m << ", \"k\": " << k << ", \"n\": " << n
            << ", \"slices\": " << slices << ", \"iterations\": " << iterations
            << ", \"wrong\": " << (all_wrong[0] + all_wrong[1]) << ",\n \"all_gather_matmul\": " << json_of(a)
            << ",\n \"matmul_reduce_scatter\": " << json_of(b) << "}\n";
      }
    }
    status = all_wrong[0] + all_wrong[1] == 0 ? 0 : 1;
  } catch (const weft_programs::usage_error& e) {
    std::fprintf(stderr, "weft_bench_tp_overlap: %s\n", e.what());
    status = 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft_bench_tp_overlap: %s\n", e.what());
    status = 1;
  }
  MPI_Finalize();
  return status;
}
