// Context parallelism on the NCCL backend, on device memory (label gpu).
//
// Ulysses: to_heads and to_sequence move device data only, so their results are exact: every
// element of the head-sharded tensor is checked against the formula of the token, head and
// channel it must hold (rows in rank order, this rank's heads), to_sequence is checked on a
// head-sharded tensor built on the host, and the round trip gives the input back; float and
// float16, contiguous and load-balanced splits.
//
// Ring attention: weft's only attention kernel is the CPU reference (host memory; refused with
// NCCL at compile time), so the ring runs here with a probe kernel on the device that does no
// attention but leaves an exact trace of what each rank saw: per query row, the sum of the V rows
// (and the count of keys) of every key it may see; in backward, dq sums the visible K rows and the
// dK/dV accumulators sum the Q and dout rows of every query that sees each key. Those sums are
// right only if every K/V block reached every rank exactly once with its owner's positions, the
// causal chunk pairs were chosen right, and each dK/dV accumulator travelled the ring and came home
// to the rank that owns its keys. The attention arithmetic itself is the kernel's (the CPU tests
// check the ring with the reference kernel against naive attention).
#include <catch2/catch.hpp>

#include "device_test_support.hpp"
#include "gpu_test_support.hpp"

#include <cuda_runtime_api.h>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/float16.hpp>
#include <weft/cp/attention_reference.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ring_attention.hpp>
#include <weft/cp/ulysses.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cp = weft::cp;

namespace {

using weft_test::cuda_ok;
using weft_test::device_array;
using weft_test::nccl_comm;
using weft_test::world;

std::string split_name(cp::split_kind kind) { return std::string(cp::to_string(kind)); }

// ---- Ulysses -------------------------------------------------------------------------------

// The value of token `pos` (global position), head h, channel d: distinct, exact in float16 (< 2048).
double token_value(std::int64_t pos, std::size_t h, std::size_t d) {
  return static_cast<double>(pos * 32 + static_cast<std::int64_t>(h * 4 + d));
}

template <class T>
std::vector<T> to_type(const std::vector<double>& x) {
  std::vector<T> out;
  for (double e : x) out.push_back(T(static_cast<float>(e)));
  return out;
}

template <class T>
void check_ulysses(nccl_comm& group, cp::split_kind kind) {
  const int p = group.size(), r = group.rank();
  const std::size_t heads = 4, dim = 3;  // 4 heads divide over 1, 2 and 4 ranks
  const cp::sequence_split split{.seq = 16, .cp = p, .kind = kind};
  const cp::attention_shape shape{heads, dim};
  cp::ulysses<weft::nccl_backend> ul(group, split, shape);
  const std::size_t s = static_cast<std::size_t>(cp::local_tokens(split)), hp = heads / static_cast<std::size_t>(p);
  const std::string where = split_name(kind) + " split, rank " + std::to_string(r) + " of " + std::to_string(p);
  REQUIRE(ul.heads_per_rank() == hp);
  REQUIRE(ul.sequence_sharded_size() == s * heads * dim);
  REQUIRE(ul.head_sharded_size() == static_cast<std::size_t>(split.seq) * hp * dim);

  // Sequence-sharded input: this rank's tokens (cp::positions), every head.
  const std::vector<std::int64_t> mine = cp::positions(split, r);
  std::vector<double> seq_sharded;
  for (std::size_t t = 0; t < s; ++t)
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t d = 0; d < dim; ++d) seq_sharded.push_back(token_value(mine[t], h, d));
  // Head-sharded: rank i's tokens in rank order, heads [r·hp, (r+1)·hp).
  std::vector<double> head_sharded;
  std::vector<std::int64_t> rank_order;
  for (int i = 0; i < p; ++i) {
    const std::vector<std::int64_t> theirs = cp::positions(split, i);
    for (std::size_t t = 0; t < s; ++t) {
      rank_order.push_back(theirs[t]);
      for (std::size_t hh = 0; hh < hp; ++hh)
        for (std::size_t d = 0; d < dim; ++d)
          head_sharded.push_back(token_value(theirs[t], static_cast<std::size_t>(r) * hp + hh, d));
    }
  }
  {
    INFO("ulysses::positions() (" << where << ")");
    CHECK(std::vector<std::int64_t>(ul.positions().begin(), ul.positions().end()) == rank_order);
  }

  device_array<T> input(to_type<T>(seq_sharded)), heads_out(head_sharded.size()), back(seq_sharded.size());
  ul.template to_heads<T>(input.cspan(), heads_out.span());
  weft_test::settle(group);
  weft_test::check_exact("to_heads placement (" + where + ")", heads_out.download(), head_sharded);
  ul.template to_sequence<T>(heads_out.cspan(), back.span());
  weft_test::settle(group);
  weft_test::check_exact("to_heads then to_sequence gives the input back (" + where + ")", back.download(),
                         seq_sharded);
  weft_test::check_exact("to_heads left its input alone (" + where + ")", input.download(), seq_sharded);

  // to_sequence on its own, from a head-sharded tensor built on the host.
  device_array<T> built(to_type<T>(head_sharded)), seq_out(seq_sharded.size());
  ul.template to_sequence<T>(built.cspan(), seq_out.span());
  weft_test::settle(group);
  weft_test::check_exact("to_sequence placement from a host-built head-sharded tensor (" + where + ")",
                         seq_out.download(), seq_sharded);
}

// ---- ring attention with a device probe kernel ------------------------------------------------

// Device memory of n elements ordered on a stream (cudaMallocAsync / cudaFreeAsync), as the
// kernel's allocate() hands it to the ring.
template <class T>
class stream_scratch {
 public:
  stream_scratch(std::size_t n, cudaStream_t stream) : n_(n), stream_(stream) {
    if (n_ > 0) cuda_ok(cudaMallocAsync(reinterpret_cast<void**>(&data_), n_ * sizeof(T), stream_));
  }
  stream_scratch(stream_scratch&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), n_(std::exchange(other.n_, 0)), stream_(other.stream_) {}
  stream_scratch(const stream_scratch&) = delete;
  stream_scratch& operator=(const stream_scratch&) = delete;
  stream_scratch& operator=(stream_scratch&&) = delete;
  ~stream_scratch() {
    if (data_ != nullptr) cudaFreeAsync(data_, stream_);
  }
  operator std::span<T>() const { return {data_, n_}; }
  operator std::span<const T>() const { return {data_, n_}; }

 private:
  T* data_ = nullptr;
  std::size_t n_ = 0;
  cudaStream_t stream_ = nullptr;
};

constexpr int threads = 128;
int blocks_for(std::size_t n) { return static_cast<int>((n + threads - 1) / threads); }

template <class T>
__global__ void fill_kernel(T* data, long n, T value) {
  const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i < n) data[i] = value;
}

// Key kj of the block is visible to query qi when not masked (positions q0 + qi and k0 + kj).
__device__ bool visible(bool causal, long q0, long qi, long k0, long kj) { return !causal || k0 + kj <= q0 + qi; }

// out[qi, h, d] = Σ over visible keys of v[kj, h, d]; lse[qi, h] = how many keys are visible.
template <class T>
__global__ void probe_forward(const T* v, T* out, T* lse, long nq, long nk, long row, long head_dim, long q0, long k0,
                              bool causal) {
  const long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (idx >= nq * row) return;
  const long qi = idx / row, rest = idx % row;
  T acc = 0, count = 0;
  for (long kj = 0; kj < nk; ++kj)
    if (visible(causal, q0, qi, k0, kj)) {
      acc += v[kj * row + rest];
      count += 1;
    }
  out[idx] = acc;
  if (rest % head_dim == 0) lse[qi * (row / head_dim) + rest / head_dim] = count;
}

// The ring's running (out, lse) start at (0, -inf): out += block; lse = (lse or 0) + block's count.
template <class T>
__global__ void probe_merge(T* out, T* lse, const T* block_out, const T* block_lse, long n_out, long n_lse) {
  const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i < n_out) out[i] += block_out[i];
  if (i < n_lse) lse[i] = (isinf(lse[i]) ? T(0) : lse[i]) + block_lse[i];
}

// dq[qi] += Σ visible k[kj].
template <class T>
__global__ void probe_backward_dq(const T* k, T* dq, long nq, long nk, long row, long q0, long k0, bool causal) {
  const long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (idx >= nq * row) return;
  const long qi = idx / row, rest = idx % row;
  T acc = 0;
  for (long kj = 0; kj < nk; ++kj)
    if (visible(causal, q0, qi, k0, kj)) acc += k[kj * row + rest];
  dq[idx] += acc;
}

// dk[kj] += Σ q[qi] and dv[kj] += Σ dout[qi] over the queries that see key kj.
template <class T>
__global__ void probe_backward_dkv(const T* q, const T* dout, T* dk, T* dv, long nq, long nk, long row, long q0,
                                   long k0, bool causal) {
  const long idx = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (idx >= nk * row) return;
  const long kj = idx / row, rest = idx % row;
  T acc_k = 0, acc_v = 0;
  for (long qi = 0; qi < nq; ++qi)
    if (visible(causal, q0, qi, k0, kj)) {
      acc_k += q[qi * row + rest];
      acc_v += dout[qi * row + rest];
    }
  dk[idx] += acc_k;
  dv[idx] += acc_v;
}

// The first position of a chunk whose positions must be consecutive (the ring passes one
// contiguous segment of the split at a time); anything else is a failure of the ring's pairing.
long first_of_consecutive(std::span<const std::int64_t> pos, const char* what) {
  if (pos.empty()) throw std::runtime_error(std::string("probe kernel: empty ") + what + " positions");
  for (std::size_t i = 1; i < pos.size(); ++i)
    if (pos[i] != pos[0] + static_cast<std::int64_t>(i))
      throw std::runtime_error(std::string("probe kernel: the ") + what +
                               " positions of one call are not one contiguous segment of the split");
  return static_cast<long>(pos[0]);
}

// An attention kernel (cp::attention_kernel) on device memory whose every launch is on the
// communicator's stream, so it is ordered with the ring's sends and receives.
struct probe_kernel {
  static constexpr weft::memory_space memory = weft::memory_space::device;
  cudaStream_t stream = nullptr;

  template <class T>
  stream_scratch<T> allocate(std::size_t n) const {
    return stream_scratch<T>(n, stream);
  }
  template <class T>
  void fill(std::span<T> data, T value) const {
    if (data.empty()) return;
    fill_kernel<<<blocks_for(data.size()), threads, 0, stream>>>(data.data(), static_cast<long>(data.size()), value);
    cuda_ok(cudaGetLastError());
  }
  template <class T>
  void forward(std::span<const T> q, std::span<const std::int64_t> q_pos, std::span<const T> k, std::span<const T> v,
               std::span<const std::int64_t> k_pos, cp::attention_shape shape, cp::attention_options options,
               std::span<T> out, std::span<T> lse) const {
    const long row = static_cast<long>(shape.row()), nq = static_cast<long>(q_pos.size()),
               nk = static_cast<long>(k_pos.size());
    REQUIRE(q.size() == static_cast<std::size_t>(nq * row));
    REQUIRE(k.size() == static_cast<std::size_t>(nk * row));
    REQUIRE(lse.size() == static_cast<std::size_t>(nq) * shape.heads);
    probe_forward<<<blocks_for(out.size()), threads, 0, stream>>>(
        v.data(), out.data(), lse.data(), nq, nk, row, static_cast<long>(shape.head_dim),
        first_of_consecutive(q_pos, "query"), first_of_consecutive(k_pos, "key"), options.causal);
    cuda_ok(cudaGetLastError());
  }
  template <class T>
  void merge(std::span<T> out, std::span<T> lse, std::span<const T> block_out, std::span<const T> block_lse) const {
    probe_merge<<<blocks_for(out.size()), threads, 0, stream>>>(out.data(), lse.data(), block_out.data(),
                                                                block_lse.data(), static_cast<long>(out.size()),
                                                                static_cast<long>(lse.size()));
    cuda_ok(cudaGetLastError());
  }
  template <class T>
  void backward(std::span<const T> q, std::span<const std::int64_t> q_pos, std::span<const T> k, std::span<const T>,
                std::span<const std::int64_t> k_pos, cp::attention_shape shape, cp::attention_options options,
                std::span<const T>, std::span<const T>, std::span<const T> dout, std::span<T> dq, std::span<T> dk,
                std::span<T> dv) const {
    const long row = static_cast<long>(shape.row()), nq = static_cast<long>(q_pos.size()),
               nk = static_cast<long>(k_pos.size());
    const long q0 = first_of_consecutive(q_pos, "query"), k0 = first_of_consecutive(k_pos, "key");
    probe_backward_dq<<<blocks_for(dq.size()), threads, 0, stream>>>(k.data(), dq.data(), nq, nk, row, q0, k0,
                                                                      options.causal);
    cuda_ok(cudaGetLastError());
    probe_backward_dkv<<<blocks_for(dk.size()), threads, 0, stream>>>(q.data(), dout.data(), dk.data(), dv.data(),
                                                                      nq, nk, row, q0, k0, options.causal);
    cuda_ok(cudaGetLastError());
  }
};

static_assert(cp::attention_kernel<probe_kernel, float>);
static_assert(cp::kernel_runs_on<probe_kernel, weft::nccl_backend>);
static_assert(probe_kernel::memory == weft::memory_space::device);

// Global inputs by position i (queries) or j (keys), head h, channel d: small integers.
double q_at(std::int64_t i, std::size_t h, std::size_t d) { return static_cast<double>(i % 5) + static_cast<double>(h + d) + 1; }
double k_at(std::int64_t j, std::size_t h, std::size_t d) { return static_cast<double>(j % 3) + static_cast<double>(d) + 1 + static_cast<double>(h); }
double v_at(std::int64_t j, std::size_t h, std::size_t d) { return static_cast<double>(j) + static_cast<double>(2 * h + d); }
double dout_at(std::int64_t i, std::size_t h, std::size_t d) { return static_cast<double>(i % 4) + static_cast<double>(d + h); }

void check_ring(nccl_comm& group, cp::split_kind kind, bool causal) {
  const int p = group.size(), r = group.rank();
  const std::size_t heads = 2, dim = 3;
  const cp::sequence_split split{.seq = 16, .cp = p, .kind = kind};
  const cp::attention_shape shape{heads, dim};
  const std::int64_t seq = split.seq;
  const std::string where = split_name(kind) + " split, " + (causal ? "causal" : "no mask") + ", rank " +
                            std::to_string(r) + " of " + std::to_string(p);
  cp::ring_attention<weft::nccl_backend, probe_kernel> ring(group, split, shape, {.causal = causal},
                                                            probe_kernel{group.native().stream()});
  const std::vector<std::int64_t> mine = cp::positions(split, r);
  REQUIRE(std::vector<std::int64_t>(ring.positions().begin(), ring.positions().end()) == mine);
  const std::size_t s = mine.size();
  auto sees = [&](std::int64_t i, std::int64_t j) { return !causal || j <= i; };

  std::vector<double> q, k, v, dout, want_out, want_lse, want_dq, want_dk, want_dv;
  for (std::size_t t = 0; t < s; ++t) {
    const std::int64_t pos = mine[t];
    for (std::size_t h = 0; h < heads; ++h) {
      double count = 0;
      for (std::int64_t j = 0; j < seq; ++j) count += sees(pos, j) ? 1 : 0;
      want_lse.push_back(count);
      for (std::size_t d = 0; d < dim; ++d) {
        q.push_back(q_at(pos, h, d));
        k.push_back(k_at(pos, h, d));
        v.push_back(v_at(pos, h, d));
        dout.push_back(dout_at(pos, h, d));
        double o = 0, g = 0, gk = 0, gv = 0;
        for (std::int64_t j = 0; j < seq; ++j)
          if (sees(pos, j)) {  // this row as a query: the keys it sees
            o += v_at(j, h, d);
            g += k_at(j, h, d);
          }
        for (std::int64_t i = 0; i < seq; ++i)
          if (sees(i, pos)) {  // this row as a key: the queries that see it
            gk += q_at(i, h, d);
            gv += dout_at(i, h, d);
          }
        want_out.push_back(o);
        want_dq.push_back(g);
        want_dk.push_back(gk);
        want_dv.push_back(gv);
      }
    }
  }
  device_array<float> dq_(q.size()), dk_(q.size()), dv_(q.size()), out(q.size()), lse(s * heads);
  device_array<float> q_(std::vector<float>(q.begin(), q.end())), k_(std::vector<float>(k.begin(), k.end())),
      v_(std::vector<float>(v.begin(), v.end())), dout_(std::vector<float>(dout.begin(), dout.end()));
  ring.forward<float>(q_.cspan(), k_.cspan(), v_.cspan(), out.span(), lse.span());
  weft_test::settle(group);
  weft_test::check_exact("ring forward: Σ of the V rows each query sees (" + where + ")", out.download(), want_out);
  weft_test::check_exact("ring forward: the number of keys each query sees, in lse (" + where + ")", lse.download(),
                         want_lse);

  ring.backward<float>(q_.cspan(), k_.cspan(), v_.cspan(), out.cspan(), lse.cspan(), dout_.cspan(), dq_.span(),
                       dk_.span(), dv_.span());
  weft_test::settle(group);
  weft_test::check_exact("ring backward: dq = Σ of the K rows each query sees (" + where + ")", dq_.download(), want_dq);
  weft_test::check_exact("ring backward: dk = Σ of the Q rows of the queries that see each key, home on its owner (" +
                             where + ")",
                         dk_.download(), want_dk);
  weft_test::check_exact("ring backward: dv = Σ of the dout rows of the queries that see each key, home on its owner (" +
                             where + ")",
                         dv_.download(), want_dv);
}

}  // namespace

TEMPLATE_TEST_CASE("Ulysses on NCCL device memory: exact placement of to_heads and to_sequence, and the round trip",
                   "[cp][nccl][gpu]", float, weft::half) {
  for (cp::split_kind kind : {cp::split_kind::contiguous, cp::split_kind::load_balanced})
    check_ulysses<TestType>(world(), kind);
}

TEST_CASE("ring attention on NCCL with a device probe kernel: every K/V block seen once, dK/dV accumulators home",
          "[cp][nccl][gpu]") {
  for (cp::split_kind kind : {cp::split_kind::contiguous, cp::split_kind::load_balanced})
    for (bool causal : {false, true}) check_ring(world(), kind, causal);
}
