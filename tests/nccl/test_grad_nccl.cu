// The gradient synchronizer on the NCCL backend (label gpu: one GPU per rank). Backward is
// simulated by kernels on a compute stream that spin before they add each gradient, so a
// reduction that did not wait for its producer would read an unfinished buffer and the check
// would fail. Expected values are computed on the host from the formula every rank's kernels use.
#include <catch2/catch.hpp>

#include "gpu_test_support.hpp"

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/launch/nccl_bootstrap.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <weft/backend/cuda/device_guard.hpp>

using Catch::Contains;

namespace {

using weft_test::cuda_ok;
using weft_test::nccl_comm;
using weft_test::world;
using device_sync = weft::grad::synchronizer<weft::nccl_backend, float>;

// The gradient rank r's micro-step m adds to element i of parameter p (small integers and
// halves: sums are exact in float).
__host__ __device__ float contribution(int p, long i, int r, int m) {
  return static_cast<float>(p + 1) + static_cast<float>(i % 7) * 0.5f + static_cast<float>(r) +
         static_cast<float>(m) * 2.0f;
}

// Spins ~`delay` clock cycles, then adds this micro-step's gradient: a slow backward kernel.
__global__ void slow_backward(float* grad, long n, int p, int r, int m, long long delay) {
  long long start = clock64();
  while (clock64() - start < delay) {
  }
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    grad[i] += contribution(p, i, r, m);
}

const std::vector<std::size_t> sizes = {5000, 70000, 3, 20000, 131};

struct stream_holder {
  cudaStream_t s = nullptr;
  stream_holder() { cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~stream_holder() { cudaStreamDestroy(s); }
};

void register_all(device_sync& sync) {
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    std::string name = "layer";
    name += std::to_string(p);
    sync.add_param(std::move(name), sizes[p]);
  }
  sync.freeze();
}

// One backward: each parameter's gradient is added by a slow kernel, then marked ready. The
// default order is the last parameter first; `order` can give another (ranks may differ).
void backward(device_sync& sync, cudaStream_t compute, int micro, std::vector<std::size_t> order = {}) {
  const int r = sync.group().rank();
  if (order.empty())
    for (std::size_t p = sizes.size(); p-- > 0;) order.push_back(p);
  for (std::size_t p : order) {
    std::span<float> g = sync.grad(p);
    slow_backward<<<64, 256, 0, compute>>>(g.data(), static_cast<long>(g.size()), static_cast<int>(p), r, micro,
                                           200000);
    cuda_ok(cudaGetLastError());
    sync.mark_ready(p);
  }
}

// The same gradients, written without marking (for reduce_all()).
void backward_unmarked(device_sync& sync, cudaStream_t compute, int micro) {
  const int r = sync.group().rank();
  for (std::size_t p = sizes.size(); p-- > 0;) {
    std::span<float> g = sync.grad(p);
    slow_backward<<<64, 256, 0, compute>>>(g.data(), static_cast<long>(g.size()), static_cast<int>(p), r, micro,
                                           200000);
    cuda_ok(cudaGetLastError());
  }
}

double expected_sum(std::size_t p, long i, int ranks, int micro_steps) {
  double s = 0;
  for (int r = 0; r < ranks; ++r)
    for (int m = 0; m < micro_steps; ++m) s += contribution(static_cast<int>(p), i, r, m);
  return s;
}

std::vector<float> download(device_sync& sync, cudaStream_t compute) {
  cuda_ok(cudaStreamSynchronize(compute));
  std::vector<float> host(sync.grads().all().size());
  sync.grads().download(host);
  return host;
}

// Every element of every parameter equals expected_sum(...) x factor.
void check_all(device_sync& sync, cudaStream_t compute, int micro_steps, double factor, const char* what) {
  std::vector<float> host = download(sync, compute);
  const int ranks = sync.group().size();
  for (std::size_t p = 0; p < sizes.size(); ++p) {
    const std::size_t at = sync.plan().offset_of(p);
    for (std::size_t i = 0; i < sizes[p]; ++i) {
      const double want = expected_sum(p, static_cast<long>(i), ranks, micro_steps) * factor;
      if (std::abs(host[at + i] - want) > 1e-5 * std::abs(want)) {
        INFO(what << ": parameter " << p << " element " << i);
        REQUIRE(host[at + i] == Approx(want));
      }
    }
  }
}

// Spins about `cycles` GPU clock cycles and touches no memory: keeps a stream busy.
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Spins, then writes (offset + j) % 1000 over [offset, offset + count): a slow optimizer step on a shard.
__global__ void slow_shard_update(float* data, long offset, long count, long long delay) {
  long long start = clock64();
  while (clock64() - start < delay) {
  }
  for (long j = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; j < count;
       j += static_cast<long>(gridDim.x) * blockDim.x)
    data[offset + j] = static_cast<float>((offset + j) % 1000);
}

}  // namespace

TEST_CASE("NCCL synchronizer: accumulation window, mean over dp x k, ordered after the compute stream") {
  nccl_comm& dp = world();
  stream_holder compute;
  constexpr int k = 3;
  device_sync sync(dp, {.bucket_bytes = 64 << 10, .first_bucket_bytes = 16 << 10, .accumulation_steps = k});
  sync.set_compute_stream(compute.s);
  register_all(sync);
  REQUIRE(sync.plan().buckets().size() >= 3);
  for (std::size_t step = 0; step < 4; ++step) {
    for (int m = 0; m < k; ++m) {
      if (m == k - 1 && step >= 2) {
        // Steps 0 and 1 were never asked for: step 0's events were read when step 2 reused them;
        // during step 2's (and 3's) reducing backward the report is the previous step's.
        backward(sync, compute.s, m, {sizes.size() - 1});
        const weft::grad::step_report& previous = sync.last_report();
        REQUIRE(previous.step == step - 1);
        REQUIRE(previous.buckets.size() == sync.plan().buckets().size());
        std::vector<std::size_t> rest;
        for (std::size_t p = sizes.size() - 1; p-- > 0;) rest.push_back(p);
        backward(sync, compute.s, m, rest);
      } else {
        backward(sync, compute.s, m);
      }
      REQUIRE(sync.finish() == (m == k - 1));
    }
    check_all(sync, compute.s, k, 1.0 / (dp.size() * k), "accumulated mean");
    if (step == 3) {
      const weft::grad::step_report& report = sync.last_report();
      REQUIRE(report.step == step);
      REQUIRE(report.buckets.size() == sync.plan().buckets().size());
      REQUIRE(report.backward_s > 0);
      REQUIRE(report.hidden_s <= report.comm_s + 1e-6);
      double exposed = 0;
      for (const auto& b : report.buckets) {
        // GPU-side times: a reduction starts after its gradients were ready and ends after it starts.
        REQUIRE(b.start_s >= b.ready_s - 1e-5);
        REQUIRE(b.end_s >= b.start_s);
        exposed += b.exposed_s;
      }
      REQUIRE(exposed == Approx(report.finish_s).margin(1e-6));
    }
    sync.zero_grad();
  }
}

TEST_CASE("NCCL synchronizer: reduce_all, ranks marking in different orders, unmarked parameters") {
  nccl_comm& dp = world();
  stream_holder compute;
  device_sync sync(dp, {.bucket_bytes = 64 << 10, .first_bucket_bytes = 16 << 10, .scale = weft::grad::scaling::sum});
  sync.set_compute_stream(compute.s);
  register_all(sync);

  backward_unmarked(sync, compute.s, 0);
  REQUIRE(sync.reduce_all());
  check_all(sync, compute.s, 1, 1.0, "reduce_all");
  sync.zero_grad();

  // Odd ranks mark forward, even ranks backward: reductions still go out in bucket order.
  std::vector<std::size_t> order;
  for (std::size_t p = 0; p < sizes.size(); ++p) order.push_back(p);
  if (dp.rank() % 2 == 0) std::reverse(order.begin(), order.end());
  backward(sync, compute.s, 0, order);
  REQUIRE(sync.finish());
  check_all(sync, compute.s, 1, 1.0, "different mark orders");
  sync.zero_grad();

  // One parameter left unmarked on every rank: every bucket is still reduced (no rank hangs),
  // and finish() names it.
  std::vector<std::size_t> all_but_one;
  for (std::size_t p = sizes.size(); p-- > 1;) all_but_one.push_back(p);
  backward(sync, compute.s, 0, all_but_one);
  REQUIRE_THROWS_WITH(sync.finish(), Contains("'layer0'"));
  cuda_ok(cudaStreamSynchronize(compute.s));
  sync.zero_grad();
}

TEST_CASE("NCCL synchronizer: sharded, token-count scaling folded into the reduce-scatter; parameter gather") {
  nccl_comm& dp = world();
  stream_holder compute;
  device_sync sync(dp, {.bucket_bytes = 64 << 10,
                        .first_bucket_bytes = 16 << 10,
                        .scale = weft::grad::scaling::token_count,
                        .shard_optimizer_state = true});
  sync.set_compute_stream(compute.s);
  register_all(sync);
  const double tokens = 96.0;
  sync.set_token_count(tokens);
  backward(sync, compute.s, 0);
  REQUIRE(sync.finish());
  std::vector<float> host = download(sync, compute.s);
  for (const weft::grad::shard_segment& seg : sync.shard_segments())
    for (std::size_t j = 0; j < seg.count; ++j) {
      const long i = static_cast<long>(seg.param_offset + j);
      const double want = expected_sum(seg.param, i, dp.size(), 1) / tokens;
      if (std::abs(host[seg.buffer_offset + j] - want) > 1e-5 * std::abs(want)) {
        INFO("parameter " << seg.param << " element " << i);
        REQUIRE(host[seg.buffer_offset + j] == Approx(want));
      }
    }

  // Each rank's "optimizer" writes its shard on the compute stream with a slow kernel; the gather
  // must wait for it, and the compute stream must wait for the gather.
  device_sync::buffer_type params(sync.shared_plan());
  std::vector<float> minus_one(params.all().size(), -1.0f);
  params.upload(minus_one);
  for (const weft::grad::shard_range& range : sync.shard_ranges()) {
    slow_shard_update<<<32, 256, 0, compute.s>>>(params.all().data(), static_cast<long>(range.offset),
                                                 static_cast<long>(range.count), 400000);
    cuda_ok(cudaGetLastError());
  }
  weft::grad::param_gather<weft::nccl_backend> gather = sync.gather_params_async(params);
  gather.wait();  // the compute stream waits, not the host
  cuda_ok(cudaStreamSynchronize(compute.s));
  std::vector<float> all(params.all().size());
  params.download(all);
  for (std::size_t i = 0; i < all.size(); ++i)
    if (all[i] != static_cast<float>(i % 1000)) {
      INFO("element " << i);
      REQUIRE(all[i] == static_cast<float>(i % 1000));
    }
}

TEST_CASE("NCCL synchronizer: what a device buffer cannot do is refused with the way out") {
  nccl_comm& dp = world();
  REQUIRE_THROWS_WITH((weft::grad::synchronizer<weft::nccl_backend, weft::bfloat16>(
                          dp, {.precision = weft::grad::reduce_precision::fp32})),
                      Contains("keep the gradient buffer in float"));

  // The token count arrives after the reduction was queued: every rank reports it, none hangs.
  stream_holder compute;
  device_sync sync(dp, {.scale = weft::grad::scaling::token_count});
  sync.set_compute_stream(compute.s);
  register_all(sync);
  backward(sync, compute.s, 0);
  REQUIRE_THROWS_WITH(sync.finish(), Contains("before the window's last backward"));
  cuda_ok(cudaStreamSynchronize(compute.s));

  // Set during the reducing backward: refused at once, the same on every rank.
  sync.zero_grad();
  backward(sync, compute.s, 0, {sizes.size() - 1});
  REQUIRE_THROWS_WITH(sync.set_token_count(10.0), Contains("before that backward's first mark_ready()"));
  std::vector<std::size_t> rest;
  for (std::size_t p = sizes.size() - 1; p-- > 0;) rest.push_back(p);
  backward(sync, compute.s, 0, rest);
  REQUIRE_THROWS(sync.finish());  // still no count: reported, and every bucket was reduced
  cuda_ok(cudaStreamSynchronize(compute.s));
}

TEST_CASE("NCCL scaled sums: a factor float16 cannot hold is refused before anything is enqueued") {
  nccl_comm& dp = world();
  const int p = dp.size();
  const std::size_t n = 1000;
  weft::half* data = nullptr;
  cuda_ok(cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(weft::half)));
  std::vector<weft::half> ones(n, weft::half(1.0f));
  cuda_ok(cudaMemcpy(data, ones.data(), n * sizeof(weft::half), cudaMemcpyHostToDevice));
  std::span<weft::half> span(data, n);
  // 1/4M tokens is subnormal in float16 (about 5 % off); 2^-25 is zero: refused on every rank alike.
  REQUIRE_THROWS_WITH(dp.all_reduce_scaled_async(span, 1.0 / 4e6), Contains("float16") && Contains("subnormal"));
  REQUIRE_THROWS_WITH(dp.all_reduce_scaled_async(span, std::ldexp(1.0, -25)), Contains("synchronizer<B, float>"));
  // 1/dp is exact enough: folded, and the communicator is still in step on every rank.
  dp.all_reduce_scaled_async(span, 1.0 / p).wait();
  std::vector<weft::half> back(n);
  cuda_ok(cudaMemcpy(back.data(), data, n * sizeof(weft::half), cudaMemcpyDeviceToHost));
  CHECK(static_cast<float>(back[n - 1]) == Approx(1.0f).epsilon(1e-3));
  cudaFree(data);

  // The synchronizer says so for a float16 buffer with a token count it cannot fold.
  stream_holder compute;
  weft::grad::synchronizer<weft::nccl_backend, weft::half> sync(dp, {.scale = weft::grad::scaling::token_count});
  sync.set_compute_stream(compute.s);
  sync.add_param("w", 4096);
  sync.freeze();
  sync.set_token_count(4e6);
  REQUIRE_THROWS_WITH(sync.reduce_all(), Contains("float16") && Contains("synchronizer<B, float>"));
  cuda_ok(cudaStreamSynchronize(compute.s));
}

TEST_CASE("NCCL synchronizer built on another thread: every allocation and event is on the group's device") {
  // A fresh thread's current device is 0, whatever device the group lives on (on a machine with a
  // GPU per rank, rank k's group is on device k): the synchronizer must use the group's.
  nccl_comm& dp = world();
  const int device = dp.native().device();
  std::exception_ptr failure;
  int thread_device_after = -1;
  std::vector<int> buffer_devices;
  std::vector<float> host;
  std::thread worker([&] {
    try {
      cuda_ok(cudaSetDevice(0));
      cudaStream_t compute = nullptr;
      {
        weft::cuda::device_guard on(device);  // the trainer's compute stream is on its GPU
        cuda_ok(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
      }
      {
        device_sync sync(dp, {.bucket_bytes = 64 << 10, .first_bucket_bytes = 16 << 10});
        sync.set_compute_stream(compute);
        register_all(sync);
        cudaPointerAttributes attributes{};
        cuda_ok(cudaPointerGetAttributes(&attributes, sync.grads().all().data()));
        buffer_devices.push_back(attributes.device);
        device_sync::buffer_type params(sync.shared_plan(), device);
        cuda_ok(cudaPointerGetAttributes(&attributes, params.all().data()));
        buffer_devices.push_back(attributes.device);
        buffer_devices.push_back(params.device());
        {
          weft::cuda::device_guard on(device);
          backward(sync, compute, 0);
        }
        REQUIRE(sync.finish());
        REQUIRE(sync.last_report().buckets.size() == sync.plan().buckets().size());
        cuda_ok(cudaStreamSynchronize(compute));
        host.resize(sync.grads().all().size());
        sync.grads().download(host);
        cuda_ok(cudaGetDevice(&thread_device_after));
        check_all(sync, compute, 1, 1.0 / dp.size(), "another thread");
      }
      cudaStreamDestroy(compute);
    } catch (...) {
      failure = std::current_exception();
    }
  });
  worker.join();
  if (failure) std::rethrow_exception(failure);
  for (int d : buffer_devices) CHECK(d == device);
  CHECK(thread_device_after == 0);  // weft restored the thread's own device
  CHECK_FALSE(host.empty());
}

TEST_CASE("NCCL synchronizer: destroyed right after zero_grad(), its buffer outlives the zeroing queued on a busy stream") {
  // zero_grad() queues a memset on the compute stream and returns. The buffer is released in its
  // own stream's order: unless that release waits for the memset, trimming the pool unmaps the
  // memory while the memset still waits behind the busy stream (an illegal address).
  nccl_comm& dp = world();
  stream_holder compute;
  {
    device_sync sync(dp, {.bucket_bytes = 64 << 10, .first_bucket_bytes = 16 << 10});
    sync.set_compute_stream(compute.s);
    register_all(sync);
    spin<<<1, 1, 0, compute.s>>>(200'000'000);  // about 0.1 s at 2 GHz
    cuda_ok(cudaGetLastError());
    sync.zero_grad();
  }
  cudaMemPool_t pool = nullptr;
  cuda_ok(cudaDeviceGetDefaultMemPool(&pool, dp.native().device()));
  cuda_ok(cudaMemPoolTrimTo(pool, 0));
  cuda_ok(cudaStreamSynchronize(compute.s));
  // The communicator is still usable afterwards (its device had no fault).
  weft_test::device_array<float> x(std::vector<float>(8, 1.0f));
  dp.all_reduce(x.span());
  CHECK(x.download()[7] == static_cast<float>(dp.size()));
}
