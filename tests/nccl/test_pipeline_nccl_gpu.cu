// The pipeline executor on the NCCL backend (label gpu): 2 and 4 stages, gpipe and 1f1b, with
// activation buffers of device memory from executor_options::allocate and callbacks that do their
// work with kernels on the communicator's stream (so each send is ordered after the kernel that
// wrote its buffer). Stage s computes y = x + (s + 1) forward; backward, the input gradient is
// 2·(output gradient) + (the forward's input), read from the input span the executor keeps until
// that backward. The last stage's outputs and the first stage's input gradients are compared
// exactly with the host's recursion over the same formulas, for two steps in a row.
#include <catch2/catch.hpp>

#include "device_test_support.hpp"
#include "gpu_test_support.hpp"

#include <cuda_runtime_api.h>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/schedules.hpp>

#include <cstddef>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace wp = weft::pipeline;

namespace {

using weft_test::cuda_ok;
using weft_test::device_array;
using weft_test::nccl_comm;
using weft_test::world;

constexpr std::size_t elements = 1000;  // per micro-batch
constexpr int threads = 128;
constexpr int blocks = static_cast<int>((elements + threads - 1) / threads);

// out = in + add.
__global__ void add_constant(const float* in, float* out, long n, float add) {
  const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = in[i] + add;
}

// input_grad = 2·output_grad + input.
__global__ void twice_plus(const float* output_grad, const float* input, float* input_grad, long n) {
  const long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (i < n) input_grad[i] = 2.0f * output_grad[i] + input[i];
}

// The first stage's micro-batch and the last stage's loss gradient (small integers, exact in float).
double x_at(int step, int mb, std::size_t i) { return static_cast<double>(mb * 7 + static_cast<int>(i % 11) + step * 3); }
double loss_grad_at(int mb, std::size_t i) { return static_cast<double>(mb + static_cast<int>(i % 5) + 1); }

struct expected_values {
  std::vector<double> y;   // the last stage's outputs, [micro-batch, elements]
  std::vector<double> dx;  // the first stage's input gradients
};

// The host's computation: the input of stage s is a_s = x + Σ_{t<s} (t + 1); the last stage's
// output is a_P; backward from g at the last stage, d_in(s) = 2·d_out(s) + a_s.
expected_values expected(int stages, int micro_batches, int step) {
  expected_values e;
  for (int mb = 0; mb < micro_batches; ++mb)
    for (std::size_t i = 0; i < elements; ++i) {
      std::vector<double> a(static_cast<std::size_t>(stages) + 1);
      a[0] = x_at(step, mb, i);
      for (int s = 0; s < stages; ++s) a[static_cast<std::size_t>(s) + 1] = a[static_cast<std::size_t>(s)] + (s + 1);
      e.y.push_back(a[static_cast<std::size_t>(stages)]);
      double grad = loss_grad_at(mb, i);
      for (int s = stages - 1; s >= 0; --s) grad = 2 * grad + a[static_cast<std::size_t>(s)];
      e.dx.push_back(grad);
    }
  return e;
}

std::vector<float> host_block(int micro_batches, auto formula) {
  std::vector<float> out;
  for (int mb = 0; mb < micro_batches; ++mb)
    for (std::size_t i = 0; i < elements; ++i) out.push_back(static_cast<float>(formula(mb, i)));
  return out;
}

void run_pipeline(nccl_comm& pp, wp::schedule_kind kind, int micro_batches) {
  const int stages = pp.size(), stage = pp.rank();
  const bool first = stage == 0, last = stage == stages - 1;
  const std::string where = std::string(wp::to_string(kind)) + ", " + std::to_string(stages) + " stages, " +
                            std::to_string(micro_batches) + " micro-batches, stage " + std::to_string(stage);
  INFO(where);
  const cudaStream_t stream = pp.native().stream();
  const std::size_t all = elements * static_cast<std::size_t>(micro_batches);

  // Device memory the executor gets its buffers from (outlives it), and the ends of the pipeline.
  std::vector<std::unique_ptr<device_array<float>>> pool;
  device_array<float> xs(all), loss_grads(all), ys(all), dxs(all);
  loss_grads.upload(host_block(micro_batches, [](int mb, std::size_t i) { return loss_grad_at(mb, i); }));
  std::vector<const float*> saved_input(static_cast<std::size_t>(micro_batches), nullptr);
  auto at = [&](const device_array<float>& a, int mb) { return a.data() + static_cast<std::size_t>(mb) * elements; };

  wp::stage_callbacks<float> callbacks;
  callbacks.forward = [&](int mb, int chunk, std::span<const float> input, std::span<float> output) {
    REQUIRE(chunk == 0);
    REQUIRE(input.empty() == first);
    REQUIRE(output.empty() == last);
    const float* in = first ? at(xs, mb) : input.data();
    if (!first) REQUIRE(input.size() == elements);
    if (!last) REQUIRE(output.size() == elements);
    float* out = last ? at(ys, mb) : output.data();
    saved_input[static_cast<std::size_t>(mb)] = in;  // valid until this micro-batch's backward returns
    add_constant<<<blocks, threads, 0, stream>>>(in, out, static_cast<long>(elements), static_cast<float>(stage + 1));
    cuda_ok(cudaGetLastError());
  };
  callbacks.backward = [&](int mb, int chunk, std::span<const float> output_grad, std::span<float> input_grad) {
    REQUIRE(chunk == 0);
    REQUIRE(output_grad.empty() == last);
    REQUIRE(input_grad.empty() == first);
    const float* g = last ? at(loss_grads, mb) : output_grad.data();
    float* d = first ? at(dxs, mb) : input_grad.data();
    const float* input = saved_input[static_cast<std::size_t>(mb)];
    REQUIRE(input != nullptr);
    twice_plus<<<blocks, threads, 0, stream>>>(g, input, d, static_cast<long>(elements));
    cuda_ok(cudaGetLastError());
    saved_input[static_cast<std::size_t>(mb)] = nullptr;
  };
  wp::executor_options<float> options{.elements = elements,
                                      .allocate = [&](std::size_t n) {
                                        pool.push_back(std::make_unique<device_array<float>>(n));
                                        return pool.back()->span();
                                      }};
  wp::executor<weft::nccl_backend, float> exec(
      pp, wp::make_schedule({.kind = kind, .stages = stages, .micro_batches = micro_batches}), callbacks, options);

  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    xs.upload(host_block(micro_batches, [&](int mb, std::size_t i) { return x_at(step, mb, i); }));
    ys.upload(std::vector<float>(all, -1.0f));
    dxs.upload(std::vector<float>(all, -1.0f));
    const wp::step_stats stats = exec.run();
    weft_test::settle(pp);  // the last kernels (the first stage's last backward) are not followed by a send
    const std::size_t m = static_cast<std::size_t>(micro_batches);
    CHECK(stats.receives == m * ((first ? 0u : 1u) + (last ? 0u : 1u)));
    CHECK(stats.sends == m * ((first ? 0u : 1u) + (last ? 0u : 1u)));
    for (const float* p : saved_input) CHECK(p == nullptr);  // every forward had its backward
    const expected_values want = expected(stages, micro_batches, step);
    if (last)
      weft_test::check_exact("the last stage's outputs (" + where + ", step " + std::to_string(step) + ")",
                             ys.download(), want.y);
    if (first)
      weft_test::check_exact("the first stage's input gradients (" + where + ", step " + std::to_string(step) + ")",
                             dxs.download(), want.dx);
  }
}

}  // namespace

TEST_CASE("pipeline executor on NCCL: gpipe and 1f1b, outputs and input gradients exact", "[pipeline][nccl][gpu]") {
  nccl_comm& pp = world();
  REQUIRE(pp.size() >= 2);  // registered at 2 and 4 ranks: a pipeline of one stage sends nothing
  for (wp::schedule_kind kind : {wp::schedule_kind::gpipe, wp::schedule_kind::one_f_one_b})
    for (int micro_batches : {pp.size(), 2 * pp.size() + 1}) run_pipeline(pp, kind, micro_batches);
}

// Every schedule with 32 MiB boundaries, far past what NCCL buffers for a send whose receiver has
// not arrived (a send then holds the communicator's stream until its partner posts): with each
// send and receive posted alone, 1F1B, ZB-H1 and interleaved deadlock for every m >= 2 (the
// verifier's rendezvous simulation, tests/pipeline); the executor's batches complete. Virtual
// stage k adds 1 forward and 1 backward, so the last one's output is x + p·v and the first one's
// input gradient g + p·v; both are counted element by element on the device.
namespace {

constexpr long big = 8L << 20;  // floats per micro-batch: 32 MiB
constexpr int big_threads = 256, big_blocks = 1024;

__global__ void plus_one(const float* in, float* out, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n; i += static_cast<long>(gridDim.x) * blockDim.x)
    out[i] = in[i] + 1.0f;
}
// x (which == 0) or the loss gradient (which == 1) of micro-batch mb, plus `plus`.
__device__ float big_value(int which, int mb, long i, float plus) {
  return (which == 0 ? static_cast<float>(mb * 7 + static_cast<int>(i % 11)) : static_cast<float>(mb + static_cast<int>(i % 5) + 1)) + plus;
}
__global__ void fill_big(float* out, long n, int which, int mb) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n; i += static_cast<long>(gridDim.x) * blockDim.x)
    out[i] = big_value(which, mb, i, 0.0f);
}
__global__ void count_wrong(const float* got, long n, int which, int mb, float plus, unsigned long long* wrong) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n; i += static_cast<long>(gridDim.x) * blockDim.x)
    if (got[i] != big_value(which, mb, i, plus)) atomicAdd(wrong, 1ull);
}

void run_big_boundaries(nccl_comm& pp, wp::schedule_kind kind, int micro_batches) {
  const int stages = pp.size(), rank = pp.rank();
  const wp::schedule s = wp::make_schedule({.kind = kind, .stages = stages, .micro_batches = micro_batches,
                                            .virtual_stages = kind == wp::schedule_kind::interleaved ? 2 : 1});
  const std::string where = std::string(wp::to_string(kind)) + ", " + std::to_string(stages) + " stages, " +
                            std::to_string(micro_batches) + " micro-batches, 32 MiB boundaries, stage " + std::to_string(rank);
  INFO(where);
  const cudaStream_t stream = pp.native().stream();
  const int last = s.chunks_total() - 1;
  const std::size_t n = static_cast<std::size_t>(big), m = static_cast<std::size_t>(micro_batches);
  const bool first_rank = rank == s.rank_of(0), last_rank = rank == s.rank_of(last);
  device_array<float> xs(first_rank ? n * m : 0), dxs(first_rank ? n * m : 0), gs(last_rank ? n * m : 0), ys(last_rank ? n * m : 0);
  auto at = [&](const device_array<float>& a, int mb) { return a.data() + static_cast<std::size_t>(mb) * n; };
  for (int mb = 0; mb < micro_batches; ++mb) {
    if (first_rank) fill_big<<<big_blocks, big_threads>>>(at(xs, mb), big, 0, mb);
    if (last_rank) fill_big<<<big_blocks, big_threads>>>(at(gs, mb), big, 1, mb);
  }
  cuda_ok(cudaGetLastError());
  cuda_ok(cudaDeviceSynchronize());

  std::vector<std::unique_ptr<device_array<float>>> pool;
  int forwards = 0, backwards = 0, weights = 0;
  wp::stage_callbacks<float> callbacks;
  callbacks.forward = [&](int mb, int chunk, std::span<const float> input, std::span<float> output) {
    const int k = s.virtual_stage(rank, chunk);
    REQUIRE(input.empty() == (k == 0));
    REQUIRE(output.empty() == (k == last));
    plus_one<<<big_blocks, big_threads, 0, stream>>>(k == 0 ? at(xs, mb) : input.data(), k == last ? at(ys, mb) : output.data(), big);
    cuda_ok(cudaGetLastError());
    ++forwards;
  };
  callbacks.backward = [&](int mb, int chunk, std::span<const float> output_grad, std::span<float> input_grad) {
    const int k = s.virtual_stage(rank, chunk);
    REQUIRE(output_grad.empty() == (k == last));
    REQUIRE(input_grad.empty() == (k == 0));
    plus_one<<<big_blocks, big_threads, 0, stream>>>(k == last ? at(gs, mb) : output_grad.data(),
                                                     k == 0 ? at(dxs, mb) : input_grad.data(), big);
    cuda_ok(cudaGetLastError());
    ++backwards;
  };
  callbacks.weight = [&](int, int) { ++weights; };
  wp::executor_options<float> options{.elements = n, .allocate = [&](std::size_t count) {
                                        pool.push_back(std::make_unique<device_array<float>>(count));
                                        return pool.back()->span();
                                      }};
  wp::executor<weft::nccl_backend, float> exec(pp, s, callbacks, options);
  const wp::step_stats stats = exec.run();
  weft_test::settle(pp);
  if (rank == 0)
    std::printf("pipeline p2p: %s: %.3f s (%.3f s waiting)\n", where.c_str(), stats.seconds, stats.wait_seconds);
  CHECK(forwards == micro_batches * s.virtual_stages);
  CHECK(backwards == micro_batches * s.virtual_stages);
  CHECK(weights == (s.split_backward ? micro_batches * s.virtual_stages : 0));

  device_array<unsigned long long> wrong(1);
  wrong.upload({0ull});
  const float through = static_cast<float>(s.chunks_total());
  for (int mb = 0; mb < micro_batches; ++mb) {
    if (last_rank) count_wrong<<<big_blocks, big_threads>>>(at(ys, mb), big, 0, mb, through, wrong.data());
    if (first_rank) count_wrong<<<big_blocks, big_threads>>>(at(dxs, mb), big, 1, mb, through, wrong.data());
  }
  cuda_ok(cudaGetLastError());
  cuda_ok(cudaDeviceSynchronize());
  CHECK(wrong.download().front() == 0ull);
}

}  // namespace

TEST_CASE("pipeline executor on NCCL: every schedule with 32 MiB boundaries completes, values exact",
          "[pipeline][nccl][gpu][rendezvous]") {
  nccl_comm& pp = world();
  REQUIRE(pp.size() >= 2);
  // m = p for each; 1F1B also with 2p, a long steady phase (every m >= 2 deadlocked unbatched).
  for (wp::schedule_kind kind : wp::all_schedule_kinds) run_big_boundaries(pp, kind, pp.size());
  run_big_boundaries(pp, wp::schedule_kind::one_f_one_b, 2 * pp.size());
}
