#pragma once
/// \file
/// GPUs, nodes and clusters as the tuner sees them, with presets from vendors' data sheets.
/// Units: FLOP/s, bytes, bytes/s, seconds. Link bandwidths follow the numbers people quote:
/// `intra_bandwidth` is the spec-sheet NVLink figure (both directions together, per GPU);
/// `network_bandwidth` is one direction per GPU (a 400 Gb/s InfiniBand port is 50e9 bytes/s).

#include <array>
#include <optional>
#include <string_view>

namespace weft::tune {

/// The GPU generation; it selects the GEMM efficiency the calibration fitted for it.
enum class gpu_architecture { ampere, ada, hopper, blackwell };

/// One GPU.
struct gpu_desc {
  std::string_view name{};
  gpu_architecture architecture = gpu_architecture::hopper;
  double peak_bf16 = 0;          ///< dense bf16/fp16 tensor-core FLOP/s
  double peak_fp8 = 0;           ///< dense fp8 FLOP/s; 0 when the GPU has no fp8 tensor cores
  double memory_bytes = 0;       ///< device memory
  double memory_bandwidth = 0;   ///< device memory bandwidth, bytes/s
};

/// One node: its GPUs and how they talk.
struct node_desc {
  int gpus_per_node = 8;
  double intra_bandwidth = 0;     ///< NVLink/NVSwitch per GPU, both directions together (bytes/s)
  double intra_latency = 2e-6;    ///< per ring step inside the node (s)
  double network_bandwidth = 0;   ///< inter-node bandwidth per GPU, one direction (bytes/s)
  double network_latency = 5e-6;  ///< per ring step across nodes (s)
  /// Ranks that share one compute unit: more than 1 on a CPU node running more ranks than cores
  /// (measured by `weft-plan --probe`), 1 for GPUs. A rank that idles lends its core to the others.
  double ranks_per_core = 1.0;
  /// Bus bandwidth (nccl-tests convention) of the data-parallel reduction inside a node at the
  /// gradient synchronizer's bucket cap, when measured (weft-plan --probe's all-reduce curve);
  /// 0: the data-parallel term uses intra_bandwidth like the other collectives.
  double dp_bucket_bandwidth = 0;
  /// Seconds each blocking exchange on the critical path costs beyond its transfer and the ring's
  /// latency steps, where the ranks that take part were busy computing: launching it, waiting for
  /// the slowest member to arrive, and handing the host back (on CPU ranks that share cores, the
  /// scheduler's time slices). Measured by `weft-plan --probe` (`exchange_latency`); 0 for the
  /// GPU presets, whose kernel-launch and NCCL latencies are in the latencies above.
  double exchange_latency = 0;
};

/// A cluster of identical nodes.
struct cluster_desc {
  gpu_desc gpu{};
  node_desc node{};
  int nodes = 1;
  double oversubscription = 1.0;  ///< network oversubscription (1: full bisection bandwidth)
  /// Relative spread of the repeated timings the description was measured from (a probed
  /// machine: `timing_spread`); 0 for the presets. Predictions closer than this are not told apart.
  double timing_spread = 0;
};

/// Number of GPUs in the cluster.
constexpr int gpu_count(const cluster_desc& c) noexcept { return c.nodes * c.node.gpus_per_node; }

namespace detail {
constexpr double giga = 1e9, tera = 1e12, gib = 1024.0 * 1024.0 * 1024.0;
constexpr double gbit = 1e9 / 8;  // one Gb/s in bytes/s
}  // namespace detail

/// The GPUs the presets know, by the names `weft-plan --gpu` accepts.
inline constexpr std::array<gpu_desc, 6> gpu_presets{{
    {"A100-40GB", gpu_architecture::ampere, 312 * detail::tera, 0, 40 * detail::gib, 1555 * detail::giga},
    {"A100-80GB", gpu_architecture::ampere, 312 * detail::tera, 0, 80 * detail::gib, 2039 * detail::giga},
    {"H100", gpu_architecture::hopper, 989 * detail::tera, 1979 * detail::tera, 80 * detail::gib, 3350 * detail::giga},
    {"H200", gpu_architecture::hopper, 989 * detail::tera, 1979 * detail::tera, 141 * detail::giga, 4800 * detail::giga},
    {"B200", gpu_architecture::blackwell, 2250 * detail::tera, 4500 * detail::tera, 180 * detail::giga, 8000 * detail::giga},
    {"L40S", gpu_architecture::ada, 362 * detail::tera, 733 * detail::tera, 48 * detail::giga, 864 * detail::giga},
}};

namespace detail {
constexpr char lower(char c) noexcept { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }
constexpr bool same_name(std::string_view a, std::string_view b) noexcept {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (lower(a[i]) != lower(b[i])) return false;
  return true;
}
}  // namespace detail

/// The preset named `name` (case-insensitive; `H100-SXM` and `A100` are accepted as H100 and
/// A100-80GB), or nothing.
constexpr std::optional<gpu_desc> gpu_preset(std::string_view name) noexcept {
  if (detail::same_name(name, "H100-SXM") || detail::same_name(name, "H100-80GB")) name = "H100";
  if (detail::same_name(name, "A100")) name = "A100-80GB";
  for (const gpu_desc& g : gpu_presets)
    if (detail::same_name(g.name, name)) return g;
  return std::nullopt;
}

/// The names `gpu_preset` accepts, for help texts and error messages.
constexpr std::string_view gpu_preset_names = "A100-40GB, A100-80GB, H100, H200, B200, L40S";

/// A DGX/HGX-like node for `gpu`: 8 GPUs on NVSwitch, one InfiniBand port per GPU
/// (A100: NVLink 3, 600 GB/s, 200 Gb/s HDR; H100/H200: NVLink 4, 900 GB/s, 400 Gb/s NDR;
/// B200: NVLink 5, 1.8 TB/s, 400 Gb/s). L40S has no NVLink: PCIe Gen4 x16 (64 GB/s both
/// directions) and 400 Gb/s per node shared by its 8 GPUs.
constexpr node_desc dgx_node(const gpu_desc& gpu) noexcept {
  switch (gpu.architecture) {
    case gpu_architecture::ampere: return {.gpus_per_node = 8, .intra_bandwidth = 600 * detail::giga,
                                           .network_bandwidth = 200 * detail::gbit};
    case gpu_architecture::hopper: return {.gpus_per_node = 8, .intra_bandwidth = 900 * detail::giga,
                                           .network_bandwidth = 400 * detail::gbit};
    case gpu_architecture::blackwell: return {.gpus_per_node = 8, .intra_bandwidth = 1800 * detail::giga,
                                              .network_bandwidth = 400 * detail::gbit};
    case gpu_architecture::ada: return {.gpus_per_node = 8, .intra_bandwidth = 64 * detail::giga,
                                        .intra_latency = 5e-6, .network_bandwidth = 50 * detail::gbit};
  }
  return {};
}

/// `nodes` DGX-like nodes of `gpu` (see dgx_node).
constexpr cluster_desc dgx_cluster(const gpu_desc& gpu, int nodes) noexcept {
  return {.gpu = gpu, .node = dgx_node(gpu), .nodes = nodes};
}

/// The small reference cluster: `nodes` (1 or 2) nodes of 4 A100 80 GB on NVLink (600 GB/s),
/// one 200 Gb/s InfiniBand port per node (50 Gb/s per GPU).
constexpr cluster_desc small_reference_cluster(int nodes = 2) noexcept {
  return {.gpu = gpu_presets[1],
          .node = {.gpus_per_node = 4, .intra_bandwidth = 600 * detail::giga, .network_bandwidth = 50 * detail::gbit},
          .nodes = nodes};
}

/// The large reference cluster: `nodes` (8 to 16) nodes of 8 H100 SXM 80 GB on NVSwitch
/// (900 GB/s), 400 Gb/s InfiniBand per GPU.
constexpr cluster_desc large_reference_cluster(int nodes = 16) noexcept {
  return {.gpu = gpu_presets[2],
          .node = {.gpus_per_node = 8, .intra_bandwidth = 900 * detail::giga, .network_bandwidth = 400 * detail::gbit},
          .nodes = nodes};
}

}  // namespace weft::tune
