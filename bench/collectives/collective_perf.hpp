#pragma once
/// \file
/// The engine shared by the collective benchmarks (allreduce_perf, reduce_perf, broadcast_perf,
/// all_gather_perf, reduce_scatter_perf, alltoall_perf, sendrecv_perf): nccl-tests' options, a
/// sweep over message sizes, timing, optional checking of every result, and nccl-tests' table
/// format on standard output plus JSON records with `--json FILE`.
///
/// Timing. For each size and placement (out-of-place, then in-place) every rank runs `-w`
/// untimed iterations, meets the others at a barrier, then runs `-n` iterations back to back
/// (blocking calls; with `-a 1`, async calls waited for at the end). A rank's time is its mean per
/// iteration; the reported time is the maximum over ranks, since a collective is as slow as its
/// slowest rank. Every rank runs the same fixed number of iterations, so the ranks stay in step.
///
/// Sizes. `size` is the larger of one rank's send and receive buffers in bytes, `count` that
/// buffer's element count. For all_gather, reduce_scatter and all_to_all the count is rounded down
/// to a multiple of the number of ranks (one equal block per rank), so `size` may be below `-b`.
///
/// Bandwidth, as nccl-tests defines it: algbw = size / time; busbw = algbw x a factor per
/// collective that gives the traffic each link carries, comparable with the hardware's peak:
/// all_reduce 2(n-1)/n; reduce_scatter, all_gather, all_to_all (n-1)/n; broadcast, reduce,
/// send_recv 1.
///
/// Checking (`-c 1`). After timing, each rank fills its inputs with values computed from (rank,
/// index), runs the operation once, and counts the elements that differ from the values computed
/// independently from the same formula; `#wrong` is the sum over ranks. Inputs are small integers,
/// so sums, products, minima and maxima are exact in every dtype (up to 124 ranks); averages are
/// compared within the dtype's precision.

#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/config.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/core/reduce_op.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

// The NCCL path needs weft's NCCL backend and a CUDA device; builds without NCCL measure MPI only.
#if WEFT_HAS_NCCL && WEFT_HAS_MPI
#define WEFT_BENCH_NCCL 1
#include <cuda_runtime_api.h>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/launch/nccl_bootstrap.hpp>
#else
#define WEFT_BENCH_NCCL 0
#endif

#include "command_line.hpp"
#include "perf_main.hpp"

namespace weft_bench {

constexpr std::string_view program_name(collective k) noexcept {
  switch (k) {
    case collective::all_reduce: return "allreduce_perf";
    case collective::reduce: return "reduce_perf";
    case collective::broadcast: return "broadcast_perf";
    case collective::all_gather: return "all_gather_perf";
    case collective::reduce_scatter: return "reduce_scatter_perf";
    case collective::all_to_all: return "alltoall_perf";
    case collective::send_recv: return "sendrecv_perf";
  }
  return "?";
}

constexpr std::string_view collective_name(collective k) noexcept {
  switch (k) {
    case collective::all_reduce: return "all_reduce";
    case collective::reduce: return "reduce";
    case collective::broadcast: return "broadcast";
    case collective::all_gather: return "all_gather";
    case collective::reduce_scatter: return "reduce_scatter";
    case collective::all_to_all: return "all_to_all";
    case collective::send_recv: return "send_recv";
  }
  return "?";
}

constexpr bool reduces(collective k) noexcept {
  return k == collective::all_reduce || k == collective::reduce || k == collective::reduce_scatter;
}
constexpr bool rooted(collective k) noexcept { return k == collective::reduce || k == collective::broadcast; }
/// Operations whose buffer is cut into one block per rank.
constexpr bool blocked(collective k) noexcept {
  return k == collective::all_gather || k == collective::reduce_scatter || k == collective::all_to_all;
}
/// A send and a receive on one buffer is not an in-place operation any backend defines.
constexpr bool has_in_place(collective k) noexcept { return k != collective::send_recv; }

/// nccl-tests' bus-bandwidth factor for `ranks` ranks.
constexpr double bus_factor(collective k, int ranks) noexcept {
  const double n = ranks;
  switch (k) {
    case collective::all_reduce: return 2.0 * (n - 1.0) / n;
    case collective::reduce_scatter:
    case collective::all_gather:
    case collective::all_to_all: return (n - 1.0) / n;
    case collective::broadcast:
    case collective::reduce:
    case collective::send_recv: return 1.0;
  }
  return 1.0;
}

using weft_programs::parse_bytes;
using weft_programs::parse_integer;
using weft_programs::usage_error;

struct options {
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{32} << 20;
  std::size_t factor = 2;
  int iterations = 20;
  int warmup = 5;
  bool check = true;
  weft::dtype type = weft::dtype::float32;
  weft::reduce_op op = weft::reduce_op::sum;
  int root = 0;
  int async = -1;  ///< -1: the backend's default (blocking on MPI, async on NCCL, as nccl-tests)
  std::string backend;
  std::string json_path;
  bool help = false;
};

inline weft::dtype parse_dtype(const std::string& text) {
  using weft::dtype;
  if (text == "float" || text == "float32") return dtype::float32;
  if (text == "double" || text == "float64") return dtype::float64;
  if (text == "half" || text == "float16") return dtype::float16;
  if (text == "bfloat16" || text == "bf16") return dtype::bfloat16;
  if (text == "int32") return dtype::int32;
  if (text == "int64") return dtype::int64;
  if (text == "uint8") return dtype::uint8;
  throw usage_error("-d: unknown type '" + text + "' (float, double, half, bfloat16, int32, int64, uint8)");
}

inline weft::reduce_op parse_op(const std::string& text) {
  using weft::reduce_op;
  for (reduce_op op : {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max, reduce_op::avg})
    if (text == weft::to_string(op)) return op;
  throw usage_error("-o: unknown reduction '" + text + "' (sum, prod, min, max, avg)");
}

inline std::string usage(collective k) {
  std::string name(program_name(k));
  return "usage: mpirun -n RANKS " + name +
         " [options]\n"
         "  -b, --minbytes SIZE      smallest message (bytes; K, M, G suffixes) [8]\n"
         "  -e, --maxbytes SIZE      largest message [32M]\n"
         "  -f, --stepfactor N       multiply the size by N each step [2]\n"
         "  -n, --iters N            timed iterations per size [20]\n"
         "  -w, --warmup_iters N     untimed iterations per size [5]\n"
         "  -c, --check 0|1          check every result and count wrong elements [1]\n"
         "  -d, --datatype TYPE      float, double, half, bfloat16, int32, int64, uint8 [float]\n"
         "  -o, --op OP              sum, prod, min, max, avg (reducing collectives) [sum]\n"
         "  -r, --root R             root rank (reduce, broadcast) [0]\n"
         "  -a, --async 0|1          issue the iterations async and wait at the end [0 on mpi, 1 on nccl]\n"
         "      --backend NAME       mpi, nccl, or auto: nccl when every rank sees a GPU, else mpi" +
#if WEFT_BENCH_NCCL
         std::string(" [auto]\n") +
#else
         std::string(" (this build has no NCCL backend) [auto]\n") +
#endif
         "      --json FILE          also write the results as a JSON list of records\n"
         "  -h, --help               this text\n";
}

/// Parses nccl-tests-style options: "-b 8", "-b8", "--minbytes 8", "--minbytes=8".
inline options parse_options(collective k, int argc, char** argv) {
  struct flag {
    char short_name;
    std::string_view long_name;
    bool takes_value;
  };
  static constexpr flag flags[] = {{'b', "minbytes", true}, {'e', "maxbytes", true}, {'f', "stepfactor", true},
                                   {'n', "iters", true},    {'w', "warmup_iters", true}, {'c', "check", true},
                                   {'d', "datatype", true}, {'o', "op", true},       {'r', "root", true},
                                   {'a', "async", true},    {0, "backend", true},    {0, "json", true},
                                   {'h', "help", false}};
  options o;
  o.backend = "auto";
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const flag* matched = nullptr;
    std::string value;
    bool has_value = false;
    if (arg.rfind("--", 0) == 0) {
      std::string name = arg.substr(2);
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_value = true;
      }
      for (const flag& f : flags)
        if (f.long_name == name) matched = &f;
    } else if (arg.size() >= 2 && arg[0] == '-') {
      for (const flag& f : flags)
        if (f.short_name != 0 && f.short_name == arg[1]) matched = &f;
      if (matched != nullptr && arg.size() > 2) {
        value = arg.substr(2);
        has_value = true;
      }
    }
    if (matched == nullptr) throw usage_error("unknown option '" + arg + "'");
    if (matched->takes_value && !has_value) {
      if (i + 1 >= argc) throw usage_error("option '" + arg + "' needs a value");
      value = argv[++i];
    }
    const std::string name = "--" + std::string(matched->long_name);
    switch (matched->short_name) {
      case 'b': o.min_bytes = parse_bytes("-b", value); break;
      case 'e': o.max_bytes = parse_bytes("-e", value); break;
      case 'f': o.factor = parse_integer<std::size_t>("-f", value, 1, 1 << 20); break;
      case 'n': o.iterations = parse_integer("-n", value, 1, 1 << 30); break;
      case 'w': o.warmup = parse_integer("-w", value, 0, 1 << 30); break;
      case 'c': o.check = parse_integer("-c", value, 0, 1) != 0; break;
      case 'd': o.type = parse_dtype(value); break;
      case 'o': o.op = parse_op(value); break;
      case 'r': o.root = parse_integer("-r", value, 0, 1 << 30); break;
      case 'a': o.async = parse_integer("-a", value, 0, 1); break;
      case 'h': o.help = true; break;
      default:
        if (name == "--backend") o.backend = value;
        else o.json_path = value;
    }
  }
  if (o.min_bytes == 0) throw usage_error("-b must be at least 1 byte");
  if (o.max_bytes < o.min_bytes) throw usage_error("-e (max bytes) is smaller than -b (min bytes)");
  if (o.factor < 2 && o.min_bytes != o.max_bytes)
    throw usage_error("-f must be at least 2 unless -b equals -e (a single size)");
  if (o.backend != "mpi" && o.backend != "nccl" && o.backend != "auto")
    throw usage_error("--backend: unknown backend '" + o.backend + "' (mpi, nccl or auto)");
#if !WEFT_BENCH_NCCL
  if (o.backend == "nccl")
    throw usage_error("--backend nccl: this build has no NCCL backend; configure weft with CUDA and NCCL found");
#endif
  if (!reduces(k) && o.op != weft::reduce_op::sum)
    throw usage_error("-o: " + std::string(collective_name(k)) + " does not reduce");
  return o;
}

// ---- element values ----------------------------------------------------------------------

template <class T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, weft::half> || std::is_same_v<T, weft::bfloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, weft::half> || std::is_same_v<T, weft::bfloat16>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

/// Relative tolerance for results that are not exact (averages).
template <class T>
constexpr double tolerance() {
  if constexpr (std::is_same_v<T, weft::bfloat16>) return 1.6e-2;
  else if constexpr (std::is_same_v<T, weft::half>) return 2e-3;
  else if constexpr (std::is_same_v<T, float>) return 1e-6;
  else if constexpr (std::is_same_v<T, double>) return 1e-13;
  else return 0.0;
}

/// What an unwritten result element holds; no input or expected value takes it (below 124 ranks).
constexpr double sentinel = 250.0;

/// The value rank `rank` contributes at index k to a reduction with `op`. Every value is a small
/// integer, so results are exact in every dtype; for prod only one rank per index contributes a 2.
inline double reduction_input(int rank, std::size_t k, weft::reduce_op op, int ranks) {
  if (op == weft::reduce_op::prod)
    return rank == static_cast<int>(k % static_cast<std::size_t>(ranks)) ? 1.0 + static_cast<double>(k % 2) : 1.0;
  return static_cast<double>((static_cast<std::size_t>(rank) * 2 + k) % 3);
}

/// The value rank `rank` holds at index k for collectives that only move data.
inline double moved_input(int rank, std::size_t k) {
  return static_cast<double>((static_cast<std::size_t>(rank) * 13 + k * 7) % 101);
}

/// The reduction of every rank's reduction_input at index k, computed independently of weft.
template <class T>
double expected_reduction(std::size_t k, weft::reduce_op op, int ranks) {
  double acc = reduction_input(0, k, op, ranks);
  for (int r = 1; r < ranks; ++r) {
    double x = reduction_input(r, k, op, ranks);
    switch (op) {
      case weft::reduce_op::sum:
      case weft::reduce_op::avg: acc += x; break;
      case weft::reduce_op::prod: acc *= x; break;
      case weft::reduce_op::min: acc = std::min(acc, x); break;
      case weft::reduce_op::max: acc = std::max(acc, x); break;
    }
  }
  if (op == weft::reduce_op::avg) {
    if constexpr (std::is_integral_v<T>) return std::floor(acc / ranks);
    else return acc / ranks;
  }
  return acc;
}

template <class T>
bool matches(T got, double expected) {
  double value = to_double(got);
  if constexpr (std::is_integral_v<T>) {
    return value == expected;
  } else {
    return std::abs(value - expected) <= tolerance<T>() * std::max(1.0, std::abs(expected));
  }
}

// ---- backends ----------------------------------------------------------------------------

/// How a benchmark gets a world communicator and buffers for backend B.
template <class B>
struct bench_backend;

/// Host buffers; blocking calls are complete when they return.
template <>
struct bench_backend<weft::mpi_backend> {
  using comm_type = weft::communicator<weft::mpi_backend>;
  template <class T>
  using memory = std::vector<T>;

  static comm_type world() { return comm_type(weft::mpi_backend::comm::world(), "world"); }
  template <class T>
  static memory<T> allocate(std::size_t n) {
    return memory<T>(n);
  }
  template <class T>
  static std::span<T> view(memory<T>& m) {
    return std::span<T>(m);
  }
  /// Writes value_at(i) to m[offset + i] for i < n.
  template <class T, class F>
  static void fill(memory<T>& m, std::size_t offset, std::size_t n, F&& value_at) {
    for (std::size_t i = 0; i < n; ++i) m[offset + i] = from_double<T>(value_at(i));
  }
  /// The number of i < n where m[offset + i] differs from expected_at(i).
  template <class T, class F>
  static std::size_t count_wrong(memory<T>& m, std::size_t offset, std::size_t n, F&& expected_at) {
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += matches(m[offset + i], expected_at(i)) ? 0 : 1;
    return wrong;
  }
  static void synchronize(comm_type&) {}
};

#if WEFT_BENCH_NCCL
/// Device memory of n elements (cudaMalloc), freed with the object.
template <class T>
class device_memory {
 public:
  device_memory() = default;
  explicit device_memory(std::size_t n) : n_(n) {
    if (n > 0) WEFT_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&data_), n * sizeof(T)));
  }
  device_memory(device_memory&& other) noexcept : data_(std::exchange(other.data_, nullptr)), n_(std::exchange(other.n_, 0)) {}
  device_memory& operator=(device_memory&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(n_, other.n_);
    return *this;
  }
  ~device_memory() {
    if (data_ != nullptr) cudaFree(data_);
  }
  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return n_; }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
};

/// Device buffers on each rank's GPU; inputs and results travel through host copies.
template <>
struct bench_backend<weft::nccl_backend> {
  using comm_type = weft::communicator<weft::nccl_backend>;
  template <class T>
  using memory = device_memory<T>;

  static comm_type world() { return weft::nccl_world(); }
  template <class T>
  static memory<T> allocate(std::size_t n) {
    return memory<T>(n);
  }
  template <class T>
  static std::span<T> view(memory<T>& m) {
    return std::span<T>(m.data(), m.size());
  }
  template <class T, class F>
  static void fill(memory<T>& m, std::size_t offset, std::size_t n, F&& value_at) {
    std::vector<T> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = from_double<T>(value_at(i));
    if (n > 0) WEFT_CHECK_CUDA(cudaMemcpy(m.data() + offset, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <class T, class F>
  static std::size_t count_wrong(memory<T>& m, std::size_t offset, std::size_t n, F&& expected_at) {
    std::vector<T> host(n);
    if (n > 0) WEFT_CHECK_CUDA(cudaMemcpy(host.data(), m.data() + offset, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += matches(host[i], expected_at(i)) ? 0 : 1;
    return wrong;
  }
  static void synchronize(comm_type& comm) { WEFT_CHECK_CUDA(cudaStreamSynchronize(comm.native().stream())); }
};
#endif

// ---- the sweep ---------------------------------------------------------------------------

/// The buffers of one step: counts in elements.
struct shape {
  std::size_t send = 0;
  std::size_t recv = 0;
  std::size_t count = 0;  ///< the larger of the two
};

inline shape shape_for(collective k, std::size_t bytes, std::size_t element_size, int ranks) {
  std::size_t count = bytes / element_size;
  const auto n = static_cast<std::size_t>(ranks);
  if (blocked(k)) count -= count % n;
  shape s{count, count, count};
  if (k == collective::all_gather) s.send = count / n;
  if (k == collective::reduce_scatter) s.recv = count / n;
  return s;
}

struct result {
  double time_us = 0;
  double algbw = 0;  // GB/s
  double busbw = 0;  // GB/s
  long long wrong = -1;  // -1: not checked
  bool ran = false;
};

inline void write_json(const std::string& path, const std::string& body) {
  std::ofstream out(path);
  out << body;
  if (!out) throw std::runtime_error("cannot write the JSON results to '" + path + "'");
}

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char text[64];
  std::snprintf(text, sizeof(text), "%.9g", v);
  return text;
}

template <class B, class T>
class sweep {
 public:
  using support = bench_backend<B>;
  using comm_type = typename support::comm_type;
  using request = typename comm_type::request;

  sweep(collective k, const options& o, comm_type& comm) : k_(k), o_(o), comm_(comm) {}

  int run() {
    const int ranks = comm_.size();
    const std::size_t max_count = o_.max_bytes / sizeof(T);
    a_ = support::template allocate<T>(max_count);
    b_ = support::template allocate<T>(max_count);
    // Defined contents for the timed runs (the largest step's check inputs).
    const shape largest = shape_for(k_, max_count * sizeof(T), sizeof(T), ranks);
    fill_inputs(largest, /*in_place=*/false);
    if (has_in_place(k_)) fill_inputs(largest, /*in_place=*/true);

    print_header();
    long long total_wrong = 0;
    double busbw_sum = 0;
    int busbw_rows = 0;
    std::string json = "[";
    bool first_record = true;
    std::size_t bytes = o_.min_bytes;
    for (;;) {
      const shape s = shape_for(k_, bytes, sizeof(T), ranks);
      result placement[2];
      for (int in_place = 0; in_place < 2; ++in_place) {
        if (in_place && !has_in_place(k_)) continue;
        placement[in_place] = measure(s, in_place != 0);
        if (placement[in_place].wrong > 0) total_wrong += placement[in_place].wrong;
        busbw_sum += placement[in_place].busbw;
        ++busbw_rows;
      }
      if (comm_.rank() == 0) {
        print_row(s, placement);
        for (int in_place = 0; in_place < 2; ++in_place) {
          if (!placement[in_place].ran) continue;
          json += (first_record ? "\n  " : ",\n  ") + record(s, placement[in_place], in_place != 0);
          first_record = false;
        }
      }
      if (bytes >= o_.max_bytes || o_.factor < 2 || bytes > o_.max_bytes / o_.factor) break;
      bytes *= o_.factor;
    }
    json += "\n]\n";
    if (comm_.rank() == 0) {
      if (o_.check)
        std::printf("# wrong elements in total: %lld (%s)\n", total_wrong, total_wrong == 0 ? "OK" : "FAILED");
      else
        std::printf("# results not checked (-c 0)\n");
      std::printf("# average bus bandwidth: %.3f GB/s\n#\n", busbw_rows > 0 ? busbw_sum / busbw_rows : 0.0);
      std::fflush(stdout);
      if (!o_.json_path.empty()) write_json(o_.json_path, json);
    }
    return total_wrong == 0 ? 0 : 1;
  }

 private:
  std::span<T> a(std::size_t n) { return support::view(a_).first(n); }
  std::span<T> b(std::size_t n) { return support::view(b_).first(n); }
  int rank() const { return comm_.rank(); }
  int ranks() const { return comm_.size(); }

  /// One operation of the benchmarked kind on the step's buffers.
  request issue(const shape& s, bool in_place, bool async) {
    const weft::reduce_op op = o_.op;
    const int root = o_.root;
    auto run = [&](auto&& blocking, auto&& nonblocking) -> request {
      if (async) return nonblocking();
      blocking();
      return request{};
    };
    std::span<const T> send = a(s.send);
    std::span<T> recv = b(s.recv);
    std::span<T> whole = b(s.count);
    switch (k_) {
      case collective::all_reduce:
        if (in_place) return run([&] { comm_.all_reduce(whole, op); }, [&] { return comm_.all_reduce_async(whole, op); });
        return run([&] { comm_.all_reduce(send, recv, op); }, [&] { return comm_.all_reduce_async(send, recv, op); });
      case collective::reduce:
        if (in_place)
          return run([&] { comm_.reduce(whole, root, op); }, [&] { return comm_.reduce_async(whole, root, op); });
        return run([&] { comm_.reduce(send, recv, root, op); },
                   [&] { return comm_.reduce_async(send, recv, root, op); });
      case collective::broadcast:
        if (in_place) return run([&] { comm_.broadcast(whole, root); }, [&] { return comm_.broadcast_async(whole, root); });
        return run([&] { comm_.broadcast(send, recv, root); }, [&] { return comm_.broadcast_async(send, recv, root); });
      case collective::all_gather:
        if (in_place)
          return run([&] { comm_.all_gather_in_place(whole); }, [&] { return comm_.all_gather_in_place_async(whole); });
        return run([&] { comm_.all_gather(send, recv); }, [&] { return comm_.all_gather_async(send, recv); });
      case collective::reduce_scatter:
        if (in_place)
          return run([&] { comm_.reduce_scatter_in_place(whole, op); },
                     [&] { return comm_.reduce_scatter_in_place_async(whole, op); });
        return run([&] { comm_.reduce_scatter(send, recv, op); },
                   [&] { return comm_.reduce_scatter_async(send, recv, op); });
      case collective::all_to_all:
        if (in_place) return run([&] { comm_.all_to_all(whole); }, [&] { return comm_.all_to_all_async(whole); });
        return run([&] { comm_.all_to_all(send, recv); }, [&] { return comm_.all_to_all_async(send, recv); });
      case collective::send_recv: {
        const int next = (rank() + 1) % ranks();
        const int previous = (rank() + ranks() - 1) % ranks();
        auto batch = comm_.batch();
        batch.send(send, next).recv(recv, previous);
        return run([&] { batch.run(); }, [&] { return batch.run_async(); });
      }
    }
    return request{};
  }

  result measure(const shape& s, bool in_place) {
    result r;
    r.ran = true;
    for (int i = 0; i < o_.warmup; ++i) issue(s, in_place, o_.async != 0).wait();
    support::synchronize(comm_);
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = std::chrono::steady_clock::now();
    if (o_.async != 0) {
      std::vector<request> pending;
      pending.reserve(static_cast<std::size_t>(o_.iterations));
      for (int i = 0; i < o_.iterations; ++i) pending.push_back(issue(s, in_place, true));
      for (request& p : pending) p.wait();
    } else {
      for (int i = 0; i < o_.iterations; ++i) issue(s, in_place, false);
    }
    support::synchronize(comm_);
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    double seconds = elapsed.count() / o_.iterations;
    MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const double bytes = static_cast<double>(s.count * sizeof(T));
    r.time_us = seconds * 1e6;
    r.algbw = seconds > 0 ? bytes / seconds / 1e9 : 0.0;
    r.busbw = r.algbw * bus_factor(k_, ranks());
    if (o_.check) {
      fill_inputs(s, in_place);
      issue(s, in_place, false);
      support::synchronize(comm_);
      long long wrong = static_cast<long long>(count_wrong(s, in_place));
      MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
      r.wrong = wrong;
    }
    return r;
  }

  /// Inputs for one check (or the initial contents): see the file comment.
  void fill_inputs(const shape& s, bool in_place) {
    const int me = rank();
    const int n = ranks();
    const weft::reduce_op op = o_.op;
    auto reduction = [=](std::size_t k) { return reduction_input(me, k, op, n); };
    auto moved = [=](std::size_t k) { return moved_input(me, k); };
    auto unwritten = [](std::size_t) { return sentinel; };
    switch (k_) {
      case collective::all_reduce:
      case collective::reduce:
      case collective::reduce_scatter:
        if (in_place) {
          support::fill(b_, 0, s.count, reduction);
        } else {
          support::fill(a_, 0, s.send, reduction);
          support::fill(b_, 0, s.recv, unwritten);
        }
        break;
      case collective::broadcast: {
        const int root = o_.root;
        if (in_place) {
          if (me == root) support::fill(b_, 0, s.count, moved);
          else support::fill(b_, 0, s.count, unwritten);
        } else {
          support::fill(a_, 0, s.send, moved);  // read on the root only
          support::fill(b_, 0, s.recv, unwritten);
        }
        break;
      }
      case collective::all_gather:
        support::fill(b_, 0, s.recv, unwritten);
        if (in_place) support::fill(b_, static_cast<std::size_t>(me) * s.send, s.send, moved);
        else support::fill(a_, 0, s.send, moved);
        break;
      case collective::all_to_all:
        if (in_place) {
          support::fill(b_, 0, s.count, moved);
        } else {
          support::fill(a_, 0, s.send, moved);
          support::fill(b_, 0, s.recv, unwritten);
        }
        break;
      case collective::send_recv:
        support::fill(a_, 0, s.send, moved);
        support::fill(b_, 0, s.recv, unwritten);
        break;
    }
  }

  std::size_t count_wrong(const shape& s, bool in_place) {
    const int me = rank();
    const int n = ranks();
    const weft::reduce_op op = o_.op;
    switch (k_) {
      case collective::all_reduce:
        return support::count_wrong(b_, 0, s.count, [=](std::size_t k) { return expected_reduction<T>(k, op, n); });
      case collective::reduce:
        if (me != o_.root) return 0;
        return support::count_wrong(b_, 0, s.count, [=](std::size_t k) { return expected_reduction<T>(k, op, n); });
      case collective::broadcast: {
        const int root = o_.root;
        return support::count_wrong(b_, 0, s.count, [=](std::size_t k) { return moved_input(root, k); });
      }
      case collective::all_gather: {
        const std::size_t block = s.send;
        return support::count_wrong(b_, 0, s.recv, [=](std::size_t k) {
          return block == 0 ? sentinel : moved_input(static_cast<int>(k / block), k % block);
        });
      }
      case collective::reduce_scatter: {
        const std::size_t offset = static_cast<std::size_t>(me) * s.recv;
        return support::count_wrong(b_, in_place ? offset : 0, s.recv,
                                    [=](std::size_t j) { return expected_reduction<T>(offset + j, op, n); });
      }
      case collective::all_to_all: {
        const std::size_t block = s.count / static_cast<std::size_t>(n);
        return support::count_wrong(b_, 0, s.count, [=](std::size_t k) {
          const auto from = static_cast<int>(k / block);
          return moved_input(from, static_cast<std::size_t>(me) * block + k % block);
        });
      }
      case collective::send_recv: {
        const int previous = (me + n - 1) % n;
        return support::count_wrong(b_, 0, s.recv, [=](std::size_t k) { return moved_input(previous, k); });
      }
    }
    return 0;
  }

  std::string_view op_column() const { return reduces(k_) ? weft::to_string(o_.op) : std::string_view("none"); }
  int root_column() const { return rooted(k_) ? o_.root : -1; }

  void print_header() {
    // Every rank's host, so a result can be traced to the machines it ran on.
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    std::vector<char> hosts(rank() == 0 ? sizeof(host) * static_cast<std::size_t>(ranks()) : 0);
    MPI_Gather(host, sizeof(host), MPI_CHAR, hosts.data(), sizeof(host), MPI_CHAR, 0, MPI_COMM_WORLD);
    std::vector<int> pids(static_cast<std::size_t>(ranks()));
    int pid = static_cast<int>(getpid());
    MPI_Gather(&pid, 1, MPI_INT, pids.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rank() != 0) return;
    std::printf("# weft %s: backend %s, %d ranks, %s blocking=%s, check level %s\n", program_name(k_).data(),
                o_.backend.c_str(), ranks(), collective_name(k_).data(), o_.async ? "no (async)" : "yes",
                comm_.checks() == weft::check_level::communication ? "communication" : "local");
    std::printf("# minBytes %zu maxBytes %zu step: %zu(factor) warmup iters: %d iters: %d validation: %d\n",
                o_.min_bytes, o_.max_bytes, o_.factor, o_.warmup, o_.iterations, o_.check ? 1 : 0);
    std::printf("#\n");
    for (int r = 0; r < ranks(); ++r)
      std::printf("#  rank %3d  pid %7d  on %s\n", r, pids[static_cast<std::size_t>(r)],
                  &hosts[static_cast<std::size_t>(r) * sizeof(host)]);
    std::printf("#\n");
    std::printf("# %10s  %12s  %8s  %6s  %6s  %34s  %34s\n", "", "", "", "", "", "out-of-place     ", "in-place      ");
    std::printf("# %10s  %12s  %8s  %6s  %6s  %8s  %7s  %7s  %6s  %8s  %7s  %7s  %6s\n", "size", "count", "type",
                "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
    std::printf("# %10s  %12s  %8s  %6s  %6s  %8s  %7s  %7s  %6s  %8s  %7s  %7s  %6s\n", "(B)", "(elements)", "", "",
                "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
    std::fflush(stdout);
  }

  void print_row(const shape& s, const result (&placement)[2]) {
    std::printf("  %10zu  %12zu  %8s  %6s  %6d", s.count * sizeof(T), s.count, weft::to_string(o_.type).data(),
                op_column().data(), root_column());
    for (const result& r : placement) {
      if (!r.ran) {
        std::printf("  %8s  %7s  %7s  %6s", "N/A", "N/A", "N/A", "N/A");
        continue;
      }
      std::string wrong = r.wrong < 0 ? "N/A" : std::to_string(r.wrong);
      std::printf("  %8.2f  %7.2f  %7.2f  %6s", r.time_us, r.algbw, r.busbw, wrong.c_str());
    }
    std::printf("\n");
    std::fflush(stdout);
  }

  std::string record(const shape& s, const result& r, bool in_place) const {
    std::string text = "{\"collective\": \"" + std::string(collective_name(k_)) + "\", \"backend\": \"" + o_.backend +
                       "\", \"ranks\": " + std::to_string(comm_.size()) +
                       ", \"bytes\": " + std::to_string(s.count * sizeof(T)) + ", \"count\": " + std::to_string(s.count) +
                       ", \"type\": \"" + std::string(weft::to_string(o_.type)) + "\", \"redop\": \"" +
                       std::string(op_column()) + "\", \"root\": " + std::to_string(root_column()) +
                       ", \"in_place\": " + (in_place ? "true" : "false") + ", \"async\": " + (o_.async ? "true" : "false") +
                       ", \"iterations\": " + std::to_string(o_.iterations) + ", \"time_us\": " + json_number(r.time_us) +
                       ", \"algbw_gbps\": " + json_number(r.algbw) + ", \"busbw_gbps\": " + json_number(r.busbw) +
                       ", \"wrong\": " + (r.wrong < 0 ? std::string("null") : std::to_string(r.wrong)) + "}";
    return text;
  }

  collective k_;
  const options& o_;
  comm_type& comm_;
  typename support::template memory<T> a_;
  typename support::template memory<T> b_;
};

template <class B>
int run_backend(collective k, const options& o) {
  auto comm = bench_backend<B>::world();
  if (k == collective::send_recv && comm.size() < 2)
    throw usage_error("sendrecv_perf needs at least 2 ranks (each rank sends to the next)");
  if (rooted(k) && o.root >= comm.size())
    throw usage_error("-r: root " + std::to_string(o.root) + " is not a rank (0.." + std::to_string(comm.size() - 1) +
                      ")");
  switch (o.type) {
    case weft::dtype::float32: return sweep<B, float>(k, o, comm).run();
    case weft::dtype::float64: return sweep<B, double>(k, o, comm).run();
    case weft::dtype::float16: return sweep<B, weft::half>(k, o, comm).run();
    case weft::dtype::bfloat16: return sweep<B, weft::bfloat16>(k, o, comm).run();
    case weft::dtype::int32: return sweep<B, std::int32_t>(k, o, comm).run();
    case weft::dtype::int64: return sweep<B, std::int64_t>(k, o, comm).run();
    case weft::dtype::uint8: return sweep<B, std::uint8_t>(k, o, comm).run();
  }
  return 1;
}

/// Resolves `--backend auto` (NCCL when every rank sees a GPU) and the backend's default for
/// `-a`. Collective: every rank must pick the same backend.
inline void resolve_backend(options& o) {
  if (o.backend == "auto") {
    int gpu = 0;
#if WEFT_BENCH_NCCL
    int devices = 0;
    gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 ? 1 : 0;
#endif
    MPI_Allreduce(MPI_IN_PLACE, &gpu, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    o.backend = gpu != 0 ? "nccl" : "mpi";
  }
  if (o.async < 0) o.async = o.backend == "nccl" ? 1 : 0;
}

int perf_main(collective k, int argc, char** argv) {
  return weft_programs::mpi_main(program_name(k), usage(k), argc, argv, [&](int world_rank) {
    options o = parse_options(k, argc, argv);
    resolve_backend(o);
    if (o.help) {
      if (world_rank == 0) std::printf("%s", usage(k).c_str());
      return 0;
    }
#if WEFT_BENCH_NCCL
    if (o.backend == "nccl") return run_backend<weft::nccl_backend>(k, o);
#endif
    return run_backend<weft::mpi_backend>(k, o);
  });
}

}  // namespace weft_bench
