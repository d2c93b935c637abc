#pragma once
/// \file
/// The cost model's few empirical constants. Everything else in the model is a published formula
/// or a data-sheet number. The fitted values come from a grid search against the published runs
/// in tests/tune/data/published_runs.csv (see docs/tuning.md, "Calibration"); `tune_fit` redoes it
/// and validates it leaving one source out.

#include <weft/tune/hardware.hpp>

namespace weft::tune {

/// Empirical constants of the cost model.
struct calibration {
  /// Fraction of dense peak a large GEMM reaches on Ampere and Ada GPUs (fitted).
  double gemm_efficiency_ampere = 0.75;
  /// Fraction of dense peak a large GEMM reaches on Hopper and Blackwell GPUs (fitted; lower than
  /// Ampere's because these GPUs reach their peak only at clocks they cannot hold under load).
  double gemm_efficiency_hopper = 0.675;
  /// GEMM size (the smaller of the two dimensions a GPU sees besides tokens) at which a GEMM
  /// reaches half its large-GEMM efficiency: efficiency(d) = peak_fraction * d / (d + half_size).
  double gemm_half_size = 256;
  /// Whether `gemm_half_size` is the A100-80GB's and scales, on other GPUs, with the GPU's ridge
  /// point (dense peak / memory bandwidth, Williams et al., "Roofline", CACM 2009): a GEMM whose
  /// smallest dimension is d does about d FLOPs per byte it streams, so it reaches a given fraction
  /// of the peak at a d proportional to the ridge point.
  bool gemm_half_size_follows_ridge = true;
  /// How many times the elementwise work of a layer (norms, activations, dropout, softmax) reads or
  /// writes each byte of the layer's activations, per forward pass (fitted).
  double elementwise_passes = 1.5;
  /// Fraction of a link's bandwidth a collective achieves (nccl-tests bus bandwidth over link rate).
  double link_efficiency = 0.90;
  /// Device memory kept back regardless of the device's size: the CUDA context with the kernel
  /// images of the math libraries (about 1 GiB), NCCL's channel buffers for the tensor-, data-
  /// and pipeline-parallel communicators (1.5 to 2 GiB) and cuBLAS workspaces (bytes; an
  /// estimate from those parts, not fitted).
  double memory_reserve = 3.0 * 1024 * 1024 * 1024;
  /// Fraction of the rest kept back for the caching allocator's fragmentation (an engineering
  /// margin, not fitted).
  double memory_headroom = 0.08;
};

/// The calibration the tuner uses unless told otherwise.
inline constexpr calibration default_calibration{};

/// Large-GEMM fraction of peak for a GPU generation.
constexpr double gemm_peak_fraction(const calibration& c, gpu_architecture a) noexcept {
  return (a == gpu_architecture::hopper || a == gpu_architecture::blackwell) ? c.gemm_efficiency_hopper
                                                                              : c.gemm_efficiency_ampere;
}

}  // namespace weft::tune
