#pragma once
/// \file
/// A measured hardware description: what `weft-plan --probe FILE` measures on the ranks it runs on
/// (GEMM throughput at the model's shapes, collective bus bandwidths inside and across nodes,
/// point-to-point bandwidth and latency, memory bandwidth and capacity) and what `--hardware FILE`
/// reads in place of a GPU preset. `predict` is the cost model on such a description: the step
/// time of one layout, for comparisons with measured step times.
///
/// File format (JSON, `"format": "weft.hardware.v1"`; units: FLOP/s, bytes, bytes/s, seconds):
///   name, ranks_per_node, nodes, memory_bytes (per rank), memory_bandwidth (per rank, all ranks
///   streaming at once), gemm_peak_flops and gemm_half_size (the fit of the GEMM samples),
///   gemm_samples [[smallest dimension, FLOP/s], ...], intra_node / across_nodes {all_reduce,
///   all_gather, reduce_scatter: bus bandwidth; latency; optional all_reduce_curve [[bytes, seconds],
///   ...]: the all-reduce's time at doubling sizes, as the gradient synchronizer measures it to
///   choose its bucket cap}, p2p {bandwidth, latency}, and (optional) cpus_per_node: the
///   processors the ranks of a node run on (0 or absent: unknown, e.g. GPUs); (optional)
///   exchange_latency: seconds a blocking exchange between busy ranks costs beyond its transfer
///   and the idle latency (absent: 0); (optional) timing_spread: the largest relative spread,
///   (slowest - fastest) / median, of the repetitions behind any one figure (absent: unknown).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/core/detail/json.hpp>
#include <weft/grad/bucket_cap.hpp>
#include <weft/tune/cost_model.hpp>
#include <weft/tune/report.hpp>

namespace weft::tune {

/// Collective bus bandwidths (the nccl-tests convention: the bytes each rank moves over the link
/// per second, so a ring all-reduce of `b` bytes over `n` ranks takes 2 (n - 1)/n b / bandwidth).
struct link_measurement {
  double all_reduce = 0;
  double all_gather = 0;
  double reduce_scatter = 0;
  double latency = 0;  ///< per ring step: half the round trip of a small message
  /// The all-reduce's time at doubling sizes, each the slowest rank's (weft::grad::probe_reduction):
  /// what the gradient synchronizer chooses its bucket cap from. Empty: not measured.
  std::vector<grad::curve_point> all_reduce_curve;
};

/// One GEMM timing: the GEMM's smallest dimension and the FLOP/s it ran at.
struct gemm_sample {
  double smallest_dimension = 0;
  double flops_per_s = 0;
};

/// The hardware as measured by the probe.
struct measured_hardware {
  std::string name;                ///< what was measured (host, rank count)
  int ranks_per_node = 1;
  int nodes = 1;
  double memory_bytes = 0;         ///< per rank
  double memory_bandwidth = 0;     ///< per rank, every rank streaming at once
  double gemm_peak_flops = 0;      ///< large-GEMM throughput per rank (fit of gemm_samples)
  double gemm_half_size = 0;       ///< smallest dimension at half that throughput (fit)
  std::vector<gemm_sample> gemm_samples;
  link_measurement intra_node;     ///< among the ranks of one node
  link_measurement across_nodes;   ///< among one rank per node (equal to intra_node on one node)
  double p2p_bandwidth = 0;        ///< one direction, large messages
  double p2p_latency = 0;          ///< one way, small messages
  int cpus_per_node = 0;           ///< processors the ranks of a node share (0: unknown)
  /// Seconds a blocking exchange costs where its ranks were computing, beyond the transfer and the
  /// idle per-step latency: launch, waiting for the last member, host hand-off (0: not measured).
  double exchange_latency = 0;
  /// The largest (slowest - fastest) / median over the repetitions of any one measured figure:
  /// how far the machine moved while it was probed (0: not recorded).
  double timing_spread = 0;
};

/// Fits the cost model's GEMM curve, time = F (d + d_half) / (peak d), to samples by least squares
/// on 1 / throughput = 1/peak + (d_half/peak) / d. Returns {peak, d_half}; d_half is 0 when the
/// samples do not slow down with smaller d.
inline std::pair<double, double> fit_gemm_curve(const std::vector<gemm_sample>& samples) {
  if (samples.empty()) fail("tune: no GEMM samples to fit");
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = static_cast<double>(samples.size());
  for (const gemm_sample& s : samples) {
    if (s.smallest_dimension <= 0 || s.flops_per_s <= 0) fail("tune: a GEMM sample has no size or no throughput");
    const double x = 1 / s.smallest_dimension, y = 1 / s.flops_per_s;
    sx += x;
    sy += y;
    sxx += x * x;
    sxy += x * y;
  }
  const double denominator = n * sxx - sx * sx;
  double slope = denominator > 0 ? (n * sxy - sx * sy) / denominator : 0;
  double intercept = (sy - slope * sx) / n;
  if (slope <= 0 || intercept <= 0) {  // no size effect measurable: one throughput for all sizes
    slope = 0;
    intercept = sy / n;
  }
  return {1 / intercept, slope / intercept};
}

/// The bus bandwidth of the data-parallel reduction inside a node at the bucket cap the gradient
/// synchronizer would choose from the measured curve (the same rule, weft::grad::choose_bucket_bytes),
/// so that the prediction and the run agree on bucket sizes; 0 without a curve.
inline double dp_bucket_bus_bandwidth(const measured_hardware& hw) {
  const std::vector<grad::curve_point>& curve = hw.intra_node.all_reduce_curve;
  if (curve.empty() || hw.ranks_per_node < 2) return 0;
  const grad::bucket_size_choice choice = grad::choose_bucket_bytes(curve);
  const auto at = std::find_if(curve.begin(), curve.end(),
                               [&](const grad::curve_point& p) { return p.bytes == choice.bucket_bytes; });
  const double n = hw.ranks_per_node;
  return 2 * (n - 1) / n * at->bandwidth();
}

/// The cluster the cost model sees: one "GPU" per rank with the measured GEMM peak and memory, the
/// node's links at the measured all-reduce bus bandwidth (the model halves `intra_bandwidth`,
/// which it takes as both directions together) and latencies.
inline cluster_desc cluster_of(const measured_hardware& hw) {
  cluster_desc c;
  c.gpu = {.name = "measured", .architecture = gpu_architecture::ampere, .peak_bf16 = hw.gemm_peak_flops, .peak_fp8 = 0,
           .memory_bytes = hw.memory_bytes, .memory_bandwidth = hw.memory_bandwidth};
  c.node = {.gpus_per_node = hw.ranks_per_node, .intra_bandwidth = 2 * hw.intra_node.all_reduce,
            .intra_latency = hw.intra_node.latency, .network_bandwidth = hw.across_nodes.all_reduce,
            .network_latency = hw.across_nodes.latency,
            .ranks_per_core = hw.cpus_per_node > 0
                                  ? std::max(1.0, static_cast<double>(hw.ranks_per_node) / hw.cpus_per_node)
                                  : 1.0,
            .dp_bucket_bandwidth = dp_bucket_bus_bandwidth(hw),
            .exchange_latency = hw.exchange_latency};
  c.nodes = hw.nodes;
  c.timing_spread = hw.timing_spread;
  return c;
}

/// The calibration on measured hardware: the measured GEMM curve replaces the fitted efficiency
/// and half size, links run at their measured bus bandwidth, and no device memory is reserved
/// (the reserve is a GPU's CUDA context and NCCL buffers). The elementwise passes stay fitted.
inline calibration calibration_of(const measured_hardware& hw, calibration base = default_calibration) {
  base.gemm_efficiency_ampere = 1;
  base.gemm_efficiency_hopper = 1;
  base.gemm_half_size = hw.gemm_half_size;
  base.gemm_half_size_follows_ridge = false;  // measured on this hardware
  base.link_efficiency = 1;
  base.memory_reserve = 0;
  return base;
}

/// The prediction for one layout on measured hardware: `predict(...).time.step` is the step time
/// in seconds, `.memory` the memory per rank. The layout's world size must be the description's
/// ranks (ranks_per_node x nodes). Throws weft::error for an invalid layout.
inline plan predict(const model_desc& model, const measured_hardware& hw, const job_desc& job,
                    const layout_choice& choice, const software_desc& software = {}) {
  return evaluate(model, cluster_of(hw), job, choice, software, calibration_of(hw));
}

namespace detail {

inline std::string link_json(const link_measurement& l) {
  std::string o = "{\"all_reduce\": " + json_number(l.all_reduce) + ", \"all_gather\": " + json_number(l.all_gather) +
                  ", \"reduce_scatter\": " + json_number(l.reduce_scatter) + ", \"latency\": " + json_number(l.latency);
  if (!l.all_reduce_curve.empty()) {
    o += ", \"all_reduce_curve\": [";
    for (std::size_t i = 0; i < l.all_reduce_curve.size(); ++i)
      o += std::string(i ? ", " : "") + "[" + std::to_string(l.all_reduce_curve[i].bytes) + ", " +
           json_number(l.all_reduce_curve[i].seconds) + "]";
    o += "]";
  }
  return o + "}";
}

}  // namespace detail

/// The description as the JSON file `read_hardware` reads.
inline std::string to_json(const measured_hardware& hw) {
  using detail::json_number;
  std::string o = "{\n  \"format\": \"weft.hardware.v1\",\n  \"name\": " + detail::json_string(hw.name) +
                  ",\n  \"ranks_per_node\": " + std::to_string(hw.ranks_per_node) +
                  ",\n  \"nodes\": " + std::to_string(hw.nodes) + ",\n  \"memory_bytes\": " + json_number(hw.memory_bytes) +
                  ",\n  \"memory_bandwidth\": " + json_number(hw.memory_bandwidth) +
                  ",\n  \"gemm_peak_flops\": " + json_number(hw.gemm_peak_flops) +
                  ",\n  \"gemm_half_size\": " + json_number(hw.gemm_half_size) + ",\n  \"gemm_samples\": [";
  for (std::size_t i = 0; i < hw.gemm_samples.size(); ++i)
    o += std::string(i ? ", " : "") + "[" + json_number(hw.gemm_samples[i].smallest_dimension) + ", " +
         json_number(hw.gemm_samples[i].flops_per_s) + "]";
  o += "],\n  \"intra_node\": " + detail::link_json(hw.intra_node) +
       ",\n  \"across_nodes\": " + detail::link_json(hw.across_nodes) +
       ",\n  \"p2p\": {\"bandwidth\": " + json_number(hw.p2p_bandwidth) + ", \"latency\": " + json_number(hw.p2p_latency) +
       "},\n  \"cpus_per_node\": " + std::to_string(hw.cpus_per_node) +
       ",\n  \"exchange_latency\": " + json_number(hw.exchange_latency) +
       ",\n  \"timing_spread\": " + json_number(hw.timing_spread) + "\n}\n";
  return o;
}

/// The most ranks a hardware description may describe (ranks_per_node x nodes), and the bound
/// on each count in it.
inline constexpr int max_hardware_ranks = 1 << 20;

/// Parses a hardware description; throws weft::error naming the missing or wrong field, or the
/// range a count must lie in.
inline measured_hardware parse_hardware(std::string_view text, const std::string& origin = "hardware description") {
  using weft::detail::json_value;
  using kind = json_value::kind;
  json_value doc;
  try {
    doc = weft::detail::json_parser::parse(text);
  } catch (const weft::detail::json_syntax_error& e) {
    fail("tune: " + origin + " is not valid JSON: " + e.what() + " (byte " + std::to_string(e.offset()) + ")");
  }
  if (doc.type != kind::object) fail("tune: " + origin + " is not a JSON object");
  auto field = [&](const json_value& o, const std::string& name, const std::string& where) -> const json_value& {
    const json_value* found = weft::detail::find_member(o, name);
    if (!found) fail("tune: " + origin + " has no '" + where + name + "'; write it with weft-plan --probe");
    return *found;
  };
  auto positive = [&](const json_value& o, const std::string& name, const std::string& where = "") {
    const json_value& v = field(o, name, where);
    if (v.type != kind::number || !(weft::detail::number_value(v) > 0) || !std::isfinite(weft::detail::number_value(v)))
      fail("tune: " + origin + ": '" + where + name + "' must be a positive number, not " +
           (v.type == kind::number ? v.text : std::string(weft::detail::describe(v.type))));
    return weft::detail::number_value(v);
  };
  // Counts are integers: 0.5 ranks per node would truncate to 0 (and divide by it), 1e300 would
  // not fit an int.
  auto whole = [&](const json_value& v, const std::string& name, int low, int high) {
    if (v.type != kind::number || !v.integer || *v.integer < low || *v.integer > high)
      fail("tune: " + origin + ": '" + name + "' must be a whole number from " + std::to_string(low) + " to " +
           std::to_string(high) + ", not " + (v.type == kind::number ? v.text : std::string(weft::detail::describe(v.type))));
    return static_cast<int>(*v.integer);
  };
  const json_value& o = doc;
  const json_value& format = field(o, "format", "");
  if (format.type != kind::string || format.text != "weft.hardware.v1")
    fail("tune: " + origin + " is not a weft.hardware.v1 description (field 'format')");
  measured_hardware hw;
  if (const json_value* name = weft::detail::find_member(o, "name"); name && name->type == kind::string) hw.name = name->text;
  hw.ranks_per_node = whole(field(o, "ranks_per_node", ""), "ranks_per_node", 1, max_hardware_ranks);
  hw.nodes = whole(field(o, "nodes", ""), "nodes", 1, max_hardware_ranks);
  if (static_cast<std::int64_t>(hw.ranks_per_node) * hw.nodes > max_hardware_ranks)
    fail("tune: " + origin + ": " + std::to_string(hw.ranks_per_node) + " ranks per node x " + std::to_string(hw.nodes) +
         " nodes is more than " + std::to_string(max_hardware_ranks) + " ranks");
  hw.memory_bytes = positive(o, "memory_bytes");
  hw.memory_bandwidth = positive(o, "memory_bandwidth");
  hw.gemm_peak_flops = positive(o, "gemm_peak_flops");
  const json_value& half = field(o, "gemm_half_size", "");
  if (half.type != kind::number || !(weft::detail::number_value(half) >= 0) || !std::isfinite(weft::detail::number_value(half)))
    fail("tune: " + origin + ": 'gemm_half_size' must be a number >= 0");
  hw.gemm_half_size = weft::detail::number_value(half);
  if (const json_value* samples = weft::detail::find_member(o, "gemm_samples"); samples && samples->type == kind::array)
    for (const json_value& s : samples->items)
      if (s.type == kind::array && s.items.size() == 2 && s.items[0].type == kind::number &&
          s.items[1].type == kind::number && std::isfinite(weft::detail::number_value(s.items[0])) &&
          std::isfinite(weft::detail::number_value(s.items[1])))
        hw.gemm_samples.push_back({weft::detail::number_value(s.items[0]), weft::detail::number_value(s.items[1])});
  auto link = [&](const std::string& name) {
    const json_value& l = field(o, name, "");
    if (l.type != kind::object) fail("tune: " + origin + ": '" + name + "' must be an object");
    link_measurement m{positive(l, "all_reduce", name + "."), positive(l, "all_gather", name + "."),
                       positive(l, "reduce_scatter", name + "."), positive(l, "latency", name + "."), {}};
    if (const json_value* curve = weft::detail::find_member(l, "all_reduce_curve")) {
      const std::string where = name + ".all_reduce_curve";
      if (curve->type != kind::array || curve->items.size() > 64)
        fail("tune: " + origin + ": '" + where + "' must be a list of at most 64 [bytes, seconds] pairs");
      for (const json_value& point : curve->items) {
        if (point.type != kind::array || point.items.size() != 2 || point.items[0].type != kind::number ||
            !point.items[0].integer || *point.items[0].integer < 1 || *point.items[0].integer > (std::int64_t{1} << 40) ||
            point.items[1].type != kind::number || !(weft::detail::number_value(point.items[1]) > 0) ||
            !std::isfinite(weft::detail::number_value(point.items[1])))
          fail("tune: " + origin + ": each point of '" + where +
               "' must be [bytes, seconds]: a whole number of bytes from 1 to 2^40 and a positive time");
        m.all_reduce_curve.push_back({static_cast<std::size_t>(*point.items[0].integer),
                                      weft::detail::number_value(point.items[1])});
      }
    }
    return m;
  };
  hw.intra_node = link("intra_node");
  hw.across_nodes = link("across_nodes");
  const json_value& p2p = field(o, "p2p", "");
  if (p2p.type != kind::object) fail("tune: " + origin + ": 'p2p' must be an object");
  hw.p2p_bandwidth = positive(p2p, "bandwidth", "p2p.");
  hw.p2p_latency = positive(p2p, "latency", "p2p.");
  if (const json_value* cpus = weft::detail::find_member(o, "cpus_per_node")) {
    hw.cpus_per_node = whole(*cpus, "cpus_per_node", 0, max_hardware_ranks);
  }
  // Written by newer probes; older descriptions lack them (0: not measured).
  auto optional_non_negative = [&](const std::string& name) {
    const json_value* v = weft::detail::find_member(o, name);
    if (!v) return 0.0;
    if (v->type != kind::number || !(weft::detail::number_value(*v) >= 0) || !std::isfinite(weft::detail::number_value(*v)))
      fail("tune: " + origin + ": '" + name + "' must be a number >= 0, not " +
           (v->type == kind::number ? v->text : std::string(weft::detail::describe(v->type))));
    return weft::detail::number_value(*v);
  };
  hw.exchange_latency = optional_non_negative("exchange_latency");
  hw.timing_spread = optional_non_negative("timing_spread");
  return hw;
}

/// Reads a hardware description written by `weft-plan --probe`.
inline measured_hardware read_hardware(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tune: cannot open hardware description '" + path + "'; write one with weft-plan --probe " + path);
  // A description is about a kilobyte: stop reading long before something like /dev/zero fills memory.
  constexpr std::size_t max_bytes = std::size_t{1} << 24;
  std::string text;
  char buffer[1 << 16];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    text.append(buffer, static_cast<std::size_t>(in.gcount()));
    if (text.size() > max_bytes)
      fail("tune: '" + path + "' is more than " + std::to_string(max_bytes) + " bytes: not a hardware description");
  }
  return parse_hardware(text, "'" + path + "'");
}

}  // namespace weft::tune
