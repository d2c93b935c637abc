#pragma once
// The timed all-reduce of weft's cluster checks (health_check and weft-doctor): buffers on the
// host (MPI) or the GPU (NCCL), an input whose sum is known exactly, rounds each started from a
// barrier, and the hosts the ranks run on. Needs MPI; not part of the library.

#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/config.hpp>

#if WEFT_HAS_NCCL
#include <cuda_runtime_api.h>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/launch/nccl_bootstrap.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

namespace weft_programs {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The bus bandwidth factor of an all-reduce over `ranks` (nccl-tests' convention: 2(n-1)/n).
inline double bus_factor(int ranks) { return ranks > 1 ? 2.0 * (ranks - 1) / ranks : 1.0; }

/// Rank r's input at index i is (r + i) mod 7: exact in float for any realistic rank count, and
/// the sum at i depends only on i mod 7, so the expected result is a 7-entry table.
inline void fill_input(std::span<float> data, int rank) {
  for (std::size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<float>((static_cast<std::size_t>(rank) + i) % 7);
}

/// Elements of an all-reduce (sum) of fill_input over `ranks` ranks that differ from the exact sum.
inline std::size_t count_wrong(std::span<const float> result, int ranks) {
  float expected[7];
  for (std::size_t m = 0; m < 7; ++m) {
    std::size_t sum = 0;
    for (int r = 0; r < ranks; ++r) sum += (static_cast<std::size_t>(r) + m) % 7;
    expected[m] = static_cast<float>(sum);
  }
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < result.size(); ++i) wrong += result[i] == expected[i % 7] ? 0 : 1;
  return wrong;
}

/// The host-side exchanges (host names, the barrier before each round, the reports, the status)
/// run over MPI_COMM_WORLD through this communicator, so they have the deadline too.
using control_comm = weft::communicator<weft::mpi_backend>;

/// Where the buffers live and how this rank's side is timed, per backend.
template <class B>
struct all_reduce_platform;

/// Host buffers.
template <>
struct all_reduce_platform<weft::mpi_backend> {
  static constexpr const char* name = "mpi";
  using comm_type = weft::communicator<weft::mpi_backend>;
  using buffer = std::vector<float>;
  /// The host communicator itself.
  static comm_type& world(control_comm& control, std::optional<comm_type>&) { return control; }
  static buffer allocate(std::size_t n) { return buffer(n); }
  static void fill(buffer& b, int rank) { fill_input(b, rank); }
  static std::size_t wrong(const buffer& b, int ranks) { return count_wrong(b, ranks); }
  /// Local memory bandwidth (read + write), GB/s: a node with slow memory or a busy CPU shows here.
  static double copy_gbps(buffer& from, buffer& to) {
    const auto start = clock_type::now();
    std::memcpy(to.data(), from.data(), from.size() * sizeof(float));
    return 2.0 * static_cast<double>(from.size() * sizeof(float)) / seconds_since(start) / 1e9;
  }
  static std::span<float> view(buffer& b) { return b; }
};

#if WEFT_HAS_NCCL
/// Device memory of n floats, freed with the object.
class device_floats {
 public:
  explicit device_floats(std::size_t n) : n_(n) {
    if (n > 0) WEFT_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&data_), n * sizeof(float)));
  }
  device_floats(device_floats&& other) noexcept : data_(std::exchange(other.data_, nullptr)), n_(other.n_) {}
  device_floats& operator=(device_floats&&) = delete;
  ~device_floats() {
    if (data_ != nullptr) cudaFree(data_);
  }
  float* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return n_; }

 private:
  float* data_ = nullptr;
  std::size_t n_ = 0;
};

/// GPU buffers, one GPU per rank.
template <>
struct all_reduce_platform<weft::nccl_backend> {
  static constexpr const char* name = "nccl";
  using comm_type = weft::communicator<weft::nccl_backend>;
  using buffer = device_floats;
  static comm_type& world(control_comm&, std::optional<comm_type>& made) { return made.emplace(weft::nccl_world()); }
  static buffer allocate(std::size_t n) { return buffer(n); }
  static void fill(buffer& b, int rank) {
    std::vector<float> host(b.size());
    fill_input(host, rank);
    WEFT_CHECK_CUDA(cudaMemcpy(b.data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  static std::size_t wrong(const buffer& b, int ranks) {
    std::vector<float> host(b.size());
    WEFT_CHECK_CUDA(cudaMemcpy(host.data(), b.data(), host.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return count_wrong(host, ranks);
  }
  /// GPU memory bandwidth (read + write), GB/s: a GPU with throttled clocks shows here.
  static double copy_gbps(buffer& from, buffer& to) {
    WEFT_CHECK_CUDA(cudaDeviceSynchronize());
    const auto start = clock_type::now();
    WEFT_CHECK_CUDA(cudaMemcpy(to.data(), from.data(), from.size() * sizeof(float), cudaMemcpyDeviceToDevice));
    WEFT_CHECK_CUDA(cudaDeviceSynchronize());
    return 2.0 * static_cast<double>(from.size() * sizeof(float)) / seconds_since(start) / 1e9;
  }
  static std::span<float> view(buffer& b) { return std::span<float>(b.data(), b.size()); }
};
#endif

/// Whether every rank sees a GPU (then the all-reduce runs on NCCL). Collective over `control`.
inline bool every_rank_has_gpu(control_comm& control) {
  int gpu = 0;
#if WEFT_HAS_NCCL
  int devices = 0;
  gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0 ? 1 : 0;
#endif
  control.all_reduce(std::span<int>(&gpu, 1), weft::reduce_op::min);
  return gpu != 0;
}

/// This process's host name.
inline std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

/// The host of each rank, and the hosts in order of first appearance. Collective over `control`.
struct rank_hosts {
  std::vector<std::string> host_of;  // by rank
  std::vector<std::string> hosts;    // each host once
  std::vector<int> index_of;         // by rank: its host's place in `hosts`
};

/// Gathers every rank's `mine` (its host name, at most 255 bytes) over `control`.
inline rank_hosts gather_hosts(control_comm& control, const std::string& mine) {
  constexpr std::size_t host_bytes = 256;
  const int ranks = control.size();
  std::vector<std::uint8_t> host(host_bytes, 0);
  std::memcpy(host.data(), mine.data(), std::min(mine.size(), host_bytes - 1));
  std::vector<std::uint8_t> all_hosts(host_bytes * static_cast<std::size_t>(ranks));
  control.all_gather(host, all_hosts);
  rank_hosts result;
  std::map<std::string, int> index;
  for (int r = 0; r < ranks; ++r) {
    const std::string name = reinterpret_cast<const char*>(&all_hosts[static_cast<std::size_t>(r) * host_bytes]);
    result.host_of.push_back(name);
    const auto [at, added] = index.emplace(name, static_cast<int>(result.hosts.size()));
    if (added) result.hosts.push_back(name);
    result.index_of.push_back(at->second);
  }
  return result;
}

/// What one rank saw of the timed all-reduce rounds.
struct all_reduce_rounds {
  std::vector<double> round_s;  // this rank's time in each timed round
  std::size_t wrong = 0;        // wrong elements after the warm-up and after the timed rounds
};

/// `warmup` untimed rounds, then `rounds` timed ones, each from a barrier over `gate` (the same
/// ranks as `comm`, or more), of the all-reduce of `send` into `recv` over `comm`; the result is
/// checked after each phase. `send` is filled with fill_input for the rank in `comm`.
template <class Platform, class Comm, class Gate>
all_reduce_rounds time_all_reduce(Comm& comm, Gate& gate, typename Platform::buffer& send_buffer,
                                  typename Platform::buffer& recv_buffer, int warmup, int rounds) {
  std::span<const float> send = Platform::view(send_buffer);
  std::span<float> recv = Platform::view(recv_buffer);
  Platform::fill(send_buffer, comm.rank());
  all_reduce_rounds result;
  for (int i = 0; i < warmup; ++i) comm.all_reduce(send, recv);
  if (warmup > 0) result.wrong += Platform::wrong(recv_buffer, comm.size());
  result.round_s.resize(static_cast<std::size_t>(rounds));
  for (int i = 0; i < rounds; ++i) {
    gate.barrier();
    const auto start = clock_type::now();
    comm.all_reduce(send, recv);
    result.round_s[static_cast<std::size_t>(i)] = seconds_since(start);
  }
  if (rounds > 0) result.wrong += Platform::wrong(recv_buffer, comm.size());
  return result;
}

}  // namespace weft_programs
