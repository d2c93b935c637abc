// weft-plan --probe: measures this machine's ranks through weft's MPI communicators and writes a
// hardware description (weft/tune/hardware_file.hpp). Each figure is the median of several timed
// repetitions after a warm-up, taken with every rank busy at once, as in training.

#include "probe.hpp"

#include <mpi.h>
#include <sched.h>
#include <unistd.h>
#if WEFT_PLAN_HAS_CBLAS
#include <cblas.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/bucket_sizing.hpp>
#include <weft/tp/linear.hpp>
#include <weft/tune/hardware_file.hpp>

namespace weft_plan {
namespace {

using mpi_comm = weft::communicator<weft::mpi_backend>;
using clock_type = std::chrono::steady_clock;
namespace tune = weft::tune;

constexpr int repetitions = 5;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Median over repetitions of the time from a barrier until every rank has run `body` `inner`
/// times (a barrier after it too, and the longest of the ranks' views), per run of `body`. Timing
/// each rank's own body alone would miss ranks that share a core: a rank scheduled only after
/// another finished would time its body at full speed, as if every rank had a core. `inner` is
/// raised (the same on every rank) until a repetition lasts min_sample_seconds, many of the
/// scheduler's time slices, so that how the ranks happened to be scheduled averages out. `spread`,
/// if given, receives (slowest - fastest) / median of the repetitions.
constexpr double min_sample_seconds = 0.05;
double timed(mpi_comm& comm, const std::function<void()>& body, int inner = 1, double* spread = nullptr) {
  const auto warm_start = clock_type::now();
  body();  // warm-up: first-touch pages, connection set-up; and how long one run takes
  std::vector<double> once{std::chrono::duration<double>(clock_type::now() - warm_start).count()};
  comm.all_reduce(once, weft::reduce_op::max);
  inner = std::max(inner, static_cast<int>(std::min(1e5, std::ceil(min_sample_seconds / std::max(once[0], 1e-9)))));
  std::vector<double> times;
  for (int r = 0; r < repetitions; ++r) {
    comm.barrier();
    const auto start = clock_type::now();
    for (int i = 0; i < inner; ++i) body();
    comm.barrier();
    std::vector<double> t{std::chrono::duration<double>(clock_type::now() - start).count() / inner};
    comm.all_reduce(t, weft::reduce_op::max);
    times.push_back(t[0]);
  }
  const double middle = median(times);
  if (spread != nullptr) *spread = (*std::max_element(times.begin(), times.end()) - *std::min_element(times.begin(), times.end())) / middle;
  return middle;
}

/// The GEMMs of one layer at tensor-parallel degree `tp` (as the cost model lists them): {n, k}
/// of each weight slice (QKV, projection, MLP up, MLP down), and the attention scores QK^T of one
/// head ({keys, head dimension}; listed at tp = 1 only, it does not depend on tp), which the model
/// runs at the efficiency of its head dimension.
std::vector<std::pair<std::size_t, std::size_t>> layer_gemms(const tune::model_desc& m, int tp) {
  const std::size_t h = static_cast<std::size_t>(m.hidden), f = static_cast<std::size_t>(tune::ffn_of(m));
  const std::size_t t = static_cast<std::size_t>(tp), up = m.swiglu ? 2 : 1;
  const std::size_t qkv = h + 2 * h * static_cast<std::size_t>(tune::kv_heads_of(m)) / static_cast<std::size_t>(m.heads);
  const std::size_t head_dim = h / static_cast<std::size_t>(m.heads);
  std::vector<std::pair<std::size_t, std::size_t>> gemms{{qkv / t, h}, {h, h / t}, {f * up / t, h}, {h, f / t}};
  if (tp == 1) gemms.emplace_back(static_cast<std::size_t>(m.seq), head_dim);
  return gemms;
}

/// The GEMM the probe times: c[rows, n] = a[rows, k] b[n, k]^T, through the CBLAS a CPU trainer
/// calls when weft-plan was built with one, else weft::tp's reference matmul.
#if WEFT_PLAN_HAS_CBLAS
constexpr const char* gemm_kernel = "cblas_sgemm";
void gemm_nt(const float* a, const float* b, float* c, std::size_t rows, std::size_t n, std::size_t k) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k),
              1.0f, a, static_cast<int>(k), b, static_cast<int>(k), 0.0f, c, static_cast<int>(n));
}
// A blocked GEMM's speed depends on all three sizes: time whole GEMMs up to about 1e9 FLOPs.
constexpr double flops_per_sample = 1e9;
#else
constexpr const char* gemm_kernel = "weft::tp::reference::matmul_nt";
void gemm_nt(const float* a, const float* b, float* c, std::size_t rows, std::size_t n, std::size_t k) {
  weft::tp::reference::matmul_nt(a, b, c, rows, n, k);
}
// Rows are independent in this matmul: time enough of them for about 1e8 FLOPs.
constexpr double flops_per_sample = 1e8;
#endif

/// GEMM throughput per rank at the model's shapes, every rank computing at once: the weight GEMMs
/// of one sequence per micro-batch at every tp up to the node, and at every cp up to the node
/// (a cp rank holds seq / cp tokens, which makes the GEMMs thinner), and the attention scores.
/// `largest_spread` receives the largest relative spread of a sample's repetitions.
std::vector<tune::gemm_sample> measure_gemms(mpi_comm& comm, const tune::model_desc& m, int ranks_per_node,
                                             double& largest_spread) {
  std::vector<tune::gemm_sample> samples;
  auto sample = [&](std::size_t tokens, std::size_t n, std::size_t k) {
    const double flops_per_row = 2.0 * static_cast<double>(n) * static_cast<double>(k);
    const std::size_t rows =
        std::clamp(static_cast<std::size_t>(flops_per_sample / flops_per_row), std::size_t{1}, tokens);
    std::vector<float> a(rows * k, 0.5f), b(n * k, 0.25f), c(rows * n);
    double spread = 0;
    const double t = timed(comm, [&] { gemm_nt(a.data(), b.data(), c.data(), rows, n, k); }, 1, &spread);
    largest_spread = std::max(largest_spread, spread);
    samples.push_back({static_cast<double>(std::min({tokens, n, k})), flops_per_row * static_cast<double>(rows) / t});
  };
  const std::size_t seq = static_cast<std::size_t>(m.seq);
  for (int tp = 1; tp <= ranks_per_node; tp *= 2) {
    if (!weft::layout::tp_splits_heads(m.heads, tune::kv_heads_of(m), tp)) continue;
    for (auto [n, k] : layer_gemms(m, tp)) sample(seq, n, k);
  }
  for (int cp = 2; cp <= ranks_per_node; cp *= 2) {
    if (!weft::layout::cp_splits_sequence(m.seq, cp)) continue;
    for (auto [n, k] : layer_gemms(m, 1)) sample(seq / static_cast<std::size_t>(cp), n, k);
  }
  return samples;
}

/// The processors the ranks of a node may run on together: the union of their affinity masks
/// (every core of the node unless the launcher binds ranks), which they share. Collective over
/// the node's ranks.
int node_processors(mpi_comm& node) {
  std::vector<std::uint8_t> usable(CPU_SETSIZE, 0);
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) usable[static_cast<std::size_t>(cpu)] = CPU_ISSET(cpu, &set) ? 1 : 0;
  } else {  // no mask to read: every online processor
    const long online = std::clamp(sysconf(_SC_NPROCESSORS_ONLN), 1L, static_cast<long>(CPU_SETSIZE));
    std::fill_n(usable.begin(), online, std::uint8_t{1});
  }
  node.all_reduce(usable, weft::reduce_op::max);  // the union over the node's ranks
  return static_cast<int>(std::count(usable.begin(), usable.end(), std::uint8_t{1}));
}

/// Bus bandwidths and per-step latency of the collectives over `comm` (nccl-tests convention).
tune::link_measurement measure_link(mpi_comm& comm) {
  tune::link_measurement l;
  const int n = comm.size();
  if (n < 2) return l;
  const std::size_t count = std::size_t{4} << 20;  // 16 MB of floats
  std::vector<float> data(count, 1.0f), gathered(count), block(count / static_cast<std::size_t>(n));
  const double bytes = 4.0 * static_cast<double>(count);
  const double ring = static_cast<double>(n - 1) / n;
  l.all_reduce = 2 * ring * bytes / timed(comm, [&] { comm.all_reduce(data); });
  std::vector<float> mine(count / static_cast<std::size_t>(n), 1.0f);
  l.all_gather = ring * bytes / timed(comm, [&] { comm.all_gather(mine, gathered); });
  l.reduce_scatter = ring * bytes / timed(comm, [&] { comm.reduce_scatter(data, block); });
  std::vector<float> one{1.0f};
  // A small all-reduce is 2 (n - 1) latency steps in the model's ring.
  l.latency = timed(comm, [&] { comm.all_reduce(one); }, 200) / (2.0 * (n - 1));
  // The curve the gradient synchronizer chooses its bucket cap from, with its rule's own probe
  // (a longer budget: this is a one-off measurement), so the tuner's data-parallel term sees the
  // buckets a run will use.
  weft::grad::probe_options curve_probe;
  curve_probe.budget_s = 1.0;
  l.all_reduce_curve = weft::grad::probe_reduction<float>(comm, curve_probe.largest_bytes, false, curve_probe);
  return l;
}

/// Seconds a blocking exchange costs between ranks that were computing, beyond the idle latency:
/// neighbouring pairs of ranks (tp groups of 2), every pair at once, alternate one sequence's QKV
/// GEMM at tp 2 with a one-value all-reduce over the pair; the time beyond the GEMM alone and the
/// idle all-reduce is the exchange's launch, the wait for the partner and the host hand-off (on
/// ranks that share cores, the scheduler's time slices: the partner may not be running when the
/// exchange starts). The two loops are timed in turn, 5 times, and the median of the paired
/// differences is taken, so that a machine whose speed drifts (other work starting or stopping)
/// moves both sides of each difference alike. At least 0.
double measure_exchange_latency(mpi_comm& world, const tune::model_desc& m) {
  std::optional<mpi_comm> pair = world.split(world.rank() / 2, world.rank(), "pair");
  const std::size_t h = static_cast<std::size_t>(m.hidden), rows = static_cast<std::size_t>(m.seq);
  const std::size_t qkv = h + 2 * h * static_cast<std::size_t>(tune::kv_heads_of(m)) / static_cast<std::size_t>(m.heads);
  const std::size_t n = std::max<std::size_t>(1, qkv / 2);
  std::vector<float> a(rows * h, 0.5f), b(n * h, 0.25f), c(rows * n), one{1.0f};
  auto gemm = [&] { gemm_nt(a.data(), b.data(), c.data(), rows, n, h); };
  auto exchanging = [&] {
    gemm();
    pair->all_reduce(one);
  };
  constexpr int pairs = 5;
  std::vector<double> differences;
  for (int i = 0; i < pairs; ++i) differences.push_back(timed(world, exchanging) - timed(world, gemm));
  const double idle = timed(world, [&] { pair->all_reduce(one); }, 200);
  return std::max(0.0, median(differences) - idle);
}

/// One-way bandwidth and latency between world ranks 0 and 1 (ping-pong, half the round trip).
std::pair<double, double> measure_p2p(mpi_comm& comm) {
  if (comm.size() < 2) return {0, 0};
  auto round_trip = [&](std::vector<float>& buffer, int inner) {
    return timed(comm, [&] {
      if (comm.rank() == 0) {
        comm.send(buffer, 1);
        comm.recv(buffer, 1);
      } else if (comm.rank() == 1) {
        comm.recv(buffer, 0);
        comm.send(buffer, 0);
      }
    }, inner);
  };
  std::vector<float> large(std::size_t{4} << 20), small(2);  // 16 MB, 8 bytes
  const double bandwidth = 4.0 * static_cast<double>(large.size()) / (round_trip(large, 1) / 2);
  const double latency = round_trip(small, 200) / 2;
  return {bandwidth, latency};
}

/// Bytes per second one rank streams through memory (read + write of a copy), all ranks at once.
double measure_memory_bandwidth(mpi_comm& comm) {
  const std::size_t count = std::size_t{16} << 20;  // 64 MB of floats each way
  std::vector<float> from(count, 1.0f), to(count);
  const double t = timed(comm, [&] { std::copy(from.begin(), from.end(), to.begin()); });
  return 2.0 * 4.0 * static_cast<double>(count) / t;
}

}  // namespace

int run_probe(const std::string& path, const tune::model_desc& model, int& argc, char**& argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int status = 0;
  try {
    mpi_comm world(weft::mpi_backend::comm::world(), "world");
    if (world.size() < 2) weft::fail("probe: run it on at least 2 ranks (mpiexec -n N weft-plan --probe FILE ...)");
    // Nodes: ranks that share a host name.
    char host[MPI_MAX_PROCESSOR_NAME] = {};
    int length = 0;
    MPI_Get_processor_name(host, &length);
    std::vector<std::uint8_t> mine(MPI_MAX_PROCESSOR_NAME, 0),
        all(static_cast<std::size_t>(MPI_MAX_PROCESSOR_NAME * world.size()));
    std::copy(host, host + length, mine.begin());
    world.all_gather(mine, all);
    std::map<std::string, int> node_of;
    std::vector<int> node(static_cast<std::size_t>(world.size()));
    for (int r = 0; r < world.size(); ++r) {
      const auto* first = all.data() + static_cast<std::ptrdiff_t>(r) * MPI_MAX_PROCESSOR_NAME;
      const std::string name(first, std::find(first, first + MPI_MAX_PROCESSOR_NAME, std::uint8_t{0}));
      node[static_cast<std::size_t>(r)] = node_of.emplace(name, static_cast<int>(node_of.size())).first->second;
    }
    const int nodes = static_cast<int>(node_of.size());
    if (world.size() % nodes != 0 ||
        std::count(node.begin(), node.end(), node[0]) != world.size() / nodes)
      weft::fail("probe: the nodes run different numbers of ranks; launch the same number on each node");
    const int per_node = world.size() / nodes;
    std::optional<mpi_comm> local = world.split(node[static_cast<std::size_t>(world.rank())], world.rank(), "node");
    const bool leader = local->rank() == 0;
    std::optional<mpi_comm> leaders = world.split(leader ? 0 : -1, world.rank(), "leaders");

    tune::measured_hardware hw;
    hw.cpus_per_node = node_processors(*local);
    hw.name = std::string(host) + ", " + std::to_string(world.size()) + " ranks, GEMMs timed with " + gemm_kernel;
    hw.ranks_per_node = per_node;
    hw.nodes = nodes;
    hw.memory_bytes = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE)) / per_node;
    hw.memory_bandwidth = measure_memory_bandwidth(world);
    hw.gemm_samples = measure_gemms(world, model, per_node, hw.timing_spread);
    std::tie(hw.gemm_peak_flops, hw.gemm_half_size) = tune::fit_gemm_curve(hw.gemm_samples);
    hw.intra_node = measure_link(*local);
    tune::link_measurement across = hw.intra_node;
    if (nodes > 1 && leaders) across = measure_link(*leaders);
    std::vector<double> across_values{across.all_reduce, across.all_gather, across.reduce_scatter, across.latency};
    world.broadcast(across_values, 0);  // world rank 0 is a leader
    hw.across_nodes = {across_values[0], across_values[1], across_values[2], across_values[3], {}};
    std::tie(hw.p2p_bandwidth, hw.p2p_latency) = measure_p2p(world);
    hw.exchange_latency = measure_exchange_latency(world, model);
    if (world.rank() == 0) {
      std::ofstream out(path);
      if (!out) weft::fail("probe: cannot write '" + path + "'");
      out << tune::to_json(hw);
      std::printf("probe of %s (%d node%s x %d ranks): GEMM %.3g FLOP/s per rank (half at d = %.0f), memory %.3g B/s "
                  "per rank, all-reduce %.3g B/s bus, all-gather %.3g, reduce-scatter %.3g, latency %.3g s per step; "
                  "p2p %.3g B/s, %.3g s; exchange between busy ranks %.3g s; GEMM timings spread %.0f %%; written to %s\n",
                  hw.name.c_str(), nodes, nodes > 1 ? "s" : "", per_node, hw.gemm_peak_flops, hw.gemm_half_size,
                  hw.memory_bandwidth, hw.intra_node.all_reduce, hw.intra_node.all_gather, hw.intra_node.reduce_scatter,
                  hw.intra_node.latency, hw.p2p_bandwidth, hw.p2p_latency, hw.exchange_latency, 100 * hw.timing_spread,
                  path.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft-plan: %s\n", e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return status;
}

}  // namespace weft_plan
