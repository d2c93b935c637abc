// The fully sharded model (ZeRO-3, ZeRO-2, HSDP) on the NCCL backend (label gpu: one GPU per rank,
// or ranks sharing one with WEFT_GPU_TESTS_SHARE_GPU). Forward and backward are kernels on a
// compute stream: forward copies each gathered parameter out (so the test sees what a unit's
// kernels read), backward spins before it adds 0.5 x parameter + a per-rank, per-micro-step term
// into each gradient (a gather or reduction that did not wait for its producer reads unfinished
// memory), and SGD steps the shards with a kernel. The expected parameters come from a host
// computation of the same training on whole tensors: the mean gradient over every rank and
// micro-step, written out from the formula.
#include <catch2/catch.hpp>

#include "gpu_test_support.hpp"
#include "host_sync_counter.hpp"

#include <cuda_runtime_api.h>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/fsdp/hybrid_groups.hpp>
#include <weft/layout/node_placement.hpp>
#include <weft/fsdp/sharded_model.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using Catch::Contains;

namespace {

using weft_test::cuda_ok;
using weft_test::nccl_comm;
using weft_test::world;

template <class T>
using device_model = weft::fsdp::sharded_model<weft::nccl_backend, T>;

// Units and their parameters' sizes (none a multiple of the 128-element padding).
const std::vector<std::vector<std::size_t>> unit_sizes = {{300, 7}, {1000}, {5, 129, 64}};

__host__ __device__ double contribution(int unit, int p, long i, int r, int m) {
  return 0.25 * (unit + 1) + 0.5 * (p + 1) + 0.125 * static_cast<double>(i % 5) + 0.75 * r + 1.5 * m;
}
double initial(std::size_t unit, std::size_t p, std::size_t i) {
  return 0.01 * static_cast<double>((i * 7 + p * 3 + unit) % 11) - 0.05;
}

template <class T>
__global__ void copy_kernel(const T* from, T* to, long n) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    to[i] = from[i];
}

// Spins ~`delay` cycles, then grad += 0.5 x param + contribution: a slow backward.
template <class T>
__global__ void backward_kernel(const T* param, T* grad, long n, int unit, int p, int r, int m, long long delay) {
  const long long start = clock64();
  while (clock64() - start < delay) {
  }
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    grad[i] += static_cast<T>(0.5 * static_cast<double>(param[i]) + contribution(unit, p, i, r, m));
}

// Unit u's backward on `stream`: one slow backward_kernel per parameter of its open scope.
template <class Scope>
void launch_backward(Scope& scope, std::size_t parameters, cudaStream_t stream, std::size_t u, int r, int m,
                     long long delay) {
  for (std::size_t p = 0; p < parameters; ++p) {
    const auto param = scope.param(p);
    const auto grad = scope.grad(p);
    backward_kernel<<<16, 256, 0, stream>>>(param.data(), grad.data(), static_cast<long>(grad.size()),
                                            static_cast<int>(u), static_cast<int>(p), r, m, delay);
    cuda_ok(cudaGetLastError());
  }
}

template <class T>
__global__ void sgd_kernel(T* param, const T* grad, long n, double lr) {
  for (long i = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long>(gridDim.x) * blockDim.x)
    param[i] = static_cast<T>(static_cast<double>(param[i]) - lr * static_cast<double>(grad[i]));
}

struct stream_holder {
  cudaStream_t s = nullptr;
  stream_holder() { cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~stream_holder() { cudaStreamDestroy(s); }
};

struct config {
  weft::fsdp::fsdp_options options;
  bool hybrid = false;
  double tokens = 0;  // > 0: scaling::token_count with this count
  int steps = 3;
};

constexpr double lr = 0.05;

// The pieces written one after another ("unit" + std::to_string(u) trips GCC 12's -Wrestrict).
template <class... Parts>
std::string text(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

using whole_params = std::vector<std::vector<std::vector<double>>>;  // [unit][param][element]

whole_params initial_params() {
  whole_params w(unit_sizes.size());
  for (std::size_t u = 0; u < unit_sizes.size(); ++u)
    for (std::size_t p = 0; p < unit_sizes[u].size(); ++p) {
      w[u].emplace_back(unit_sizes[u][p]);
      for (std::size_t i = 0; i < unit_sizes[u][p]; ++i) w[u][p][i] = initial(u, p, i);
    }
  return w;
}

// One optimizer step of the reference: the gradient summed over ranks and micro-steps, scaled.
void reference_step(whole_params& w, int ranks, int micro_steps, double factor) {
  for (std::size_t u = 0; u < w.size(); ++u)
    for (std::size_t p = 0; p < w[u].size(); ++p)
      for (std::size_t i = 0; i < w[u][p].size(); ++i) {
        double g = 0;
        for (int r = 0; r < ranks; ++r)
          for (int m = 0; m < micro_steps; ++m)
            g += 0.5 * w[u][p][i] + contribution(static_cast<int>(u), static_cast<int>(p), static_cast<long>(i), r, m);
        w[u][p][i] -= lr * g * factor;
      }
}

template <class T>
double tolerance() {
  return std::is_same_v<T, double> ? 1e-12 : 2e-5;
}

template <class T>
void expect_close(const std::vector<T>& got, const std::vector<double>& want, const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::abs(static_cast<double>(got[i]) - want[i]) > tolerance<T>() * std::max(1.0, std::abs(want[i]))) {
      INFO(what << " element " << i);
      REQUIRE(static_cast<double>(got[i]) == Approx(want[i]));
    }
}

template <class T>
void register_units(device_model<T>& model) {
  for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
    std::vector<weft::grad::param_spec> params;
    for (std::size_t p = 0; p < unit_sizes[u].size(); ++p) params.push_back({text("p", p), unit_sizes[u][p]});
    model.add_unit(text("unit", u), std::move(params));
  }
  model.freeze();
}

// Trains `c.steps` optimizer steps and checks what forward saw in every micro-step, the shards
// after every step (gathered into whole tensors), and that the whole tensors re-shard exactly.
template <class T>
void train_and_check(const config& c) {
  nccl_comm& dp = world();
  stream_holder compute;  // first: destroyed after the models, which order their releases on it
  std::optional<weft::fsdp::hybrid_groups<weft::nccl_backend>> groups;
  if (c.hybrid) groups.emplace(weft::fsdp::split_by_node(dp, weft::layout::node_of(dp.rank(), std::max(1, dp.size() / 2))));
  auto make = [&] {
    return c.hybrid ? std::make_unique<device_model<T>>(groups->shard, groups->replicate, c.options)
                    : std::make_unique<device_model<T>>(dp, c.options);
  };
  std::unique_ptr<device_model<T>> model = make();
  model->set_compute_stream(compute.s);
  register_units(*model);

  whole_params want = initial_params();
  for (std::size_t u = 0; u < want.size(); ++u)
    for (std::size_t p = 0; p < want[u].size(); ++p) {
      std::vector<T> values(want[u][p].begin(), want[u][p].end());
      model->load_whole(u, p, values);
    }

  std::vector<std::vector<std::unique_ptr<weft_test::device_array<T>>>> seen(unit_sizes.size());
  for (std::size_t u = 0; u < unit_sizes.size(); ++u)
    for (std::size_t n : unit_sizes[u]) seen[u].push_back(std::make_unique<weft_test::device_array<T>>(n));

  const int ranks = dp.size();
  const int micro_steps = c.options.accumulation_steps;
  const int r = dp.rank();
  for (int step = 0; step < c.steps; ++step) {
    for (int m = 0; m < micro_steps; ++m) {
      if (c.tokens > 0 && m == micro_steps - 1) model->set_token_count(c.tokens);
      for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
        auto scope = model->forward(u);
        for (std::size_t p = 0; p < unit_sizes[u].size(); ++p) {
          std::span<const T> param = scope.param(p);
          copy_kernel<<<16, 256, 0, compute.s>>>(param.data(), seen[u][p]->data(), static_cast<long>(param.size()));
          cuda_ok(cudaGetLastError());
        }
      }
      for (std::size_t u = unit_sizes.size(); u-- > 0;) {
        auto scope = model->backward(u);
        launch_backward(scope, unit_sizes[u].size(), compute.s, u, r, m, 100000);
      }
      const bool stepped = model->finish();
      CHECK(stepped == (m == micro_steps - 1));
      cuda_ok(cudaStreamSynchronize(compute.s));
      for (std::size_t u = 0; u < unit_sizes.size(); ++u)
        for (std::size_t p = 0; p < unit_sizes[u].size(); ++p)
          expect_close(seen[u][p]->download(), want[u][p],
                       text("step ", step, " micro-step ", m, ": forward of unit ", u, " read parameter ", p));
    }
    for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
      std::span<T> shard = model->shard_params(u);
      std::span<const T> grad = model->shard_grads(u);
      sgd_kernel<<<16, 256, 0, compute.s>>>(shard.data(), grad.data(), static_cast<long>(shard.size()), lr);
      cuda_ok(cudaGetLastError());
    }
    model->zero_grad();
    const double factor = c.tokens > 0 ? 1.0 / c.tokens : 1.0 / (static_cast<double>(ranks) * micro_steps);
    reference_step(want, ranks, micro_steps, factor);

    // gather_whole waits for the optimizer's kernels on the compute stream itself.
    const auto whole = model->gather_whole_params();
    REQUIRE(whole.size() == 6);
    std::size_t k = 0;
    for (std::size_t u = 0; u < want.size(); ++u)
      for (std::size_t p = 0; p < want[u].size(); ++p, ++k) {
        CHECK(whole[k].name == text("unit", u, ".p", p));
        expect_close(whole[k].values, want[u][p], text("after step ", step, ": unit ", u, " parameter ", p));
      }
  }

  // The whole tensors re-shard into a fresh model exactly (a resume on the same ranks).
  const auto saved = model->gather_whole_params();
  std::unique_ptr<device_model<T>> resumed = make();
  resumed->set_compute_stream(compute.s);
  register_units(*resumed);
  resumed->reshard_params_from_whole(saved);
  const auto again = resumed->gather_whole_params();
  REQUIRE(again.size() == saved.size());
  for (std::size_t i = 0; i < saved.size(); ++i) CHECK(again[i].values == saved[i].values);
  cuda_ok(cudaStreamSynchronize(compute.s));
}

}  // namespace

TEST_CASE("NCCL fsdp: ZeRO-3 with prefetch and resharding after forward trains as the whole-tensor reference") {
  SECTION("float") { train_and_check<float>({.options = {.reduce_dtype = weft::dtype::float32}}); }
  SECTION("double") { train_and_check<double>({.options = {.reduce_dtype = weft::dtype::float64}}); }
}

TEST_CASE("NCCL fsdp: ZeRO-3 with accumulation, kept between forward and backward, no prefetch") {
  train_and_check<double>({.options = {.reshard_after_forward = false,
                                       .prefetch = false,
                                       .accumulation_steps = 3,
                                       .reduce_dtype = weft::dtype::float64}});
}

TEST_CASE("NCCL fsdp: ZeRO-2 with accumulation") {
  train_and_check<double>({.options = {.level = weft::tune::sharding::gradients,
                                       .accumulation_steps = 2,
                                       .reduce_dtype = weft::dtype::float64}});
}

TEST_CASE("NCCL fsdp: token-count scaling is folded into the last micro-step's reductions") {
  train_and_check<double>({.options = {.accumulation_steps = 2,
                                       .scale = weft::grad::scaling::token_count,
                                       .reduce_dtype = weft::dtype::float64},
                           .tokens = 640});
}

TEST_CASE("NCCL fsdp: hybrid sharding (shard inside a node, all-reduce across) with accumulation") {
  // One rank: one shard group of one and one replica. Two ranks: shard groups of one, two
  // replicas (only the all-reduce). Four: two shard groups of two, two replicas.
  train_and_check<double>({.options = {.accumulation_steps = 2, .reduce_dtype = weft::dtype::float64},
                           .hybrid = true});
}

TEST_CASE("NCCL fsdp: refused on a GPU: reduction in another type, token count set too late") {
  nccl_comm& dp = world();
  CHECK_THROWS_WITH(device_model<double>(dp, {.reduce_dtype = weft::dtype::float32}), Contains("on a GPU backend"));

  device_model<float> model(dp, {.scale = weft::grad::scaling::token_count, .reduce_dtype = weft::dtype::float32});
  register_units(model);
  for (std::size_t u = 0; u < unit_sizes.size(); ++u) model.forward(u).end();
  CHECK_THROWS_WITH(model.backward(unit_sizes.size() - 1), Contains("set_token_count() was not called before the backward"));
  // Every rank refused the same backward; finish() reduces zeros for the units and says so.
  CHECK_THROWS_WITH(model.finish(), Contains("not run backward"));
  // The model is usable again once the count is set.
  model.set_token_count(4);
  for (std::size_t u = 0; u < unit_sizes.size(); ++u) model.forward(u).end();
  for (std::size_t u = unit_sizes.size(); u-- > 0;) model.backward(u).end();
  CHECK(model.finish());
}

// A training step asks the host to wait for nothing: every gather's and every backward's memory
// is allocated and zeroed in stream order, from a pool that keeps freed memory (before, each
// allocation made a stream and waited for it, and zeroing waited too). Counted by interposing the
// CUDA runtime's synchronizing calls (host_sync_counter.cpp) over a whole ZeRO-3 step with
// accumulation, prefetch and resharding after forward, after one step to warm up. The NCCL
// requests' own waits poll events and are not counted here ("a step waits for no request on the
// host" counts them).
TEST_CASE("NCCL fsdp: a ZeRO-3 step makes no host synchronization", "[fsdp][gpu][sync]") {
  nccl_comm& dp = world();
  stream_holder compute;
  device_model<float> model(dp, {.accumulation_steps = 2});
  model.set_compute_stream(compute.s);
  register_units(model);
  auto step = [&] {
    for (int m = 0; m < 2; ++m) {
      for (std::size_t u = 0; u < unit_sizes.size(); ++u) model.forward(u).end();
      for (std::size_t u = unit_sizes.size(); u-- > 0;) {
        auto scope = model.backward(u);
        launch_backward(scope, unit_sizes[u].size(), compute.s, u, dp.rank(), m, 1000);
      }
      CHECK(model.finish() == (m == 1));
    }
    model.zero_grad();
  };
  step();
  cuda_ok(cudaStreamSynchronize(compute.s));
  weft_test::host_syncs::start();
  step();
  const weft_test::host_syncs::counts counted = weft_test::host_syncs::stop();
  INFO("synchronizations " << counted.synchronizations << ", blocking allocations, frees, copies and memsets "
                           << counted.blocking_memory << ", streams created " << counted.streams_created);
  CHECK(counted.total() == 0);
  cuda_ok(cudaStreamSynchronize(compute.s));
}

namespace {

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

weft::fsdp::hybrid_groups<weft::nccl_backend> replica_groups(nccl_comm& dp) {
  return weft::fsdp::split_by_node(dp, weft::layout::node_of(dp.rank(), std::max(1, dp.size() / 2)));
}

}  // namespace

// HSDP's all-reduce across replicas writes the gradient shards on the replicate group's stream, so
// a model destroyed mid-backward (an exception unwinding) gives its memory back after the work
// queued there too, not only after the compute and shard streams. Seen from the stream the memory
// was allocated on (the compute stream): it must wait for a kernel queued on the replicate
// group's stream after the all-reduce; before the fix it was idle at once.
TEST_CASE("NCCL fsdp: HSDP gives its memory back after the replicate group's stream", "[fsdp][gpu]") {
  nccl_comm& dp = world();
  stream_holder compute;
  auto groups = replica_groups(dp);
  cudaStream_t replicate_stream = groups.replicate.native().stream();
  {
    device_model<double> model(groups.shard, groups.replicate, {.reduce_dtype = weft::dtype::float64});
    model.set_compute_stream(compute.s);
    register_units(model);
    for (std::size_t u = 0; u < unit_sizes.size(); ++u) model.forward(u).end();
    model.backward(unit_sizes.size() - 1).end();  // its reduce-scatter and all-reduce across replicas are queued
    spin_kernel<<<1, 1, 0, replicate_stream>>>(2'000'000'000LL);  // about a second
    cuda_ok(cudaGetLastError());
  }
  bool compute_waits = true;
  for (int i = 0; i < 20 && compute_waits; ++i) {
    const cudaError_t state = cudaStreamQuery(compute.s);
    if (state == cudaSuccess) {
      compute_waits = false;
    } else {
      REQUIRE(state == cudaErrorNotReady);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  cuda_ok(cudaStreamSynchronize(replicate_stream));
  cuda_ok(cudaStreamSynchronize(compute.s));
  CHECK(compute_waits);
}

// Nor does the host wait for any request in a step: finish() makes the compute stream wait for
// the reductions (events) instead of waiting for them itself, and a request that is replaced (the
// next micro-step's gather or reduce-scatter of a unit) is set aside and polled, not waited for.
// The shard group's stream (and, under HSDP, the replicate group's) is held by a kernel spinning
// for about two seconds while a whole step is queued: two micro-steps, zero_grad() and the next
// window's first forward. A host call that returns only after a held stream has gone idle waited
// for it; none may. Before this change finish() of the first micro-step waited for every
// reduce-scatter, so every call from it on was counted. That the compute stream still reads the
// reduced gradients is what the training tests above check (their optimizer kernels run on it).
TEST_CASE("NCCL fsdp: a step waits for no request on the host", "[fsdp][gpu][sync]") {
  nccl_comm& dp = world();
  stream_holder compute;  // first: destroyed after the models, which order their releases on it
  auto groups = replica_groups(dp);
  auto run = [&](bool hybrid) {
    const weft::fsdp::fsdp_options options{.accumulation_steps = 2};
    auto model = hybrid ? std::make_unique<device_model<float>>(groups.shard, groups.replicate, options)
                        : std::make_unique<device_model<float>>(dp, options);
    model->set_compute_stream(compute.s);
    register_units(*model);
    std::vector<cudaStream_t> held = {model->shard_group().native().stream()};
    if (hybrid) held.push_back(model->replicate_group().native().stream());

    long after_idle = 0;  // host calls that returned after a held stream had gone idle
    std::string first;
    auto look = [&](const std::string& call) {
      for (cudaStream_t s : held) {
        const cudaError_t state = cudaStreamQuery(s);
        if (state == cudaErrorNotReady) continue;
        cuda_ok(state);
        if (after_idle++ == 0) first = call;
        return;
      }
    };
    auto micro_steps = [&](bool watched) {
      for (int m = 0; m < 2; ++m) {
        for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
          model->forward(u).end();
          if (watched) look(text("forward ", u, " of micro-step ", m));
        }
        for (std::size_t u = unit_sizes.size(); u-- > 0;) {
          {
            auto scope = model->backward(u);
            launch_backward(scope, unit_sizes[u].size(), compute.s, u, dp.rank(), m, 1000);
          }
          if (watched) look(text("backward ", u, " of micro-step ", m));
        }
        CHECK(model->finish() == (m == 1));
        if (watched) look(text("finish() of micro-step ", m));
      }
      model->zero_grad();
    };
    micro_steps(false);  // warm: the memory pool and the event pools are filled
    cuda_ok(cudaStreamSynchronize(compute.s));

    for (cudaStream_t s : held) {
      spin_kernel<<<1, 1, 0, s>>>(4'000'000'000LL);  // about two seconds
      cuda_ok(cudaGetLastError());
    }
    weft_test::host_syncs::start();
    micro_steps(true);
    model->forward(0).end();  // the next window's first gather replaces the last one's request
    look("the next window's forward 0");
    const weft_test::host_syncs::counts counted = weft_test::host_syncs::stop();
    INFO((hybrid ? "HSDP" : "ZeRO-3") << ": " << after_idle << " calls returned after a held stream went idle"
                                      << (after_idle ? ", the first: " + first : std::string()));
    CHECK(after_idle == 0);
    CHECK(counted.total() == 0);
    // The window goes on to its end, so the model is left between micro-steps.
    for (std::size_t u = 1; u < unit_sizes.size(); ++u) model->forward(u).end();
    for (std::size_t u = unit_sizes.size(); u-- > 0;) model->backward(u).end();
    model->finish();
    for (cudaStream_t s : held) cuda_ok(cudaStreamSynchronize(s));
    cuda_ok(cudaStreamSynchronize(compute.s));
  };
  SECTION("ZeRO-3") { run(false); }
  SECTION("HSDP") { run(true); }
}

// The token count is folded into each unit's reduction as it is issued: changing it during the
// window's last backward would scale some units and not others, so it is refused (as the
// synchronizer refuses it after the first mark_ready).
TEST_CASE("NCCL fsdp: the token count cannot change during the window's last backward", "[fsdp][gpu]") {
  nccl_comm& dp = world();
  stream_holder compute;
  device_model<float> model(dp, {.scale = weft::grad::scaling::token_count, .reduce_dtype = weft::dtype::float32});
  model.set_compute_stream(compute.s);
  register_units(model);
  model.set_token_count(4);
  for (std::size_t u = 0; u < unit_sizes.size(); ++u) model.forward(u).end();
  model.backward(unit_sizes.size() - 1).end();  // reduced with 1/4 folded in
  CHECK_THROWS_WITH(model.set_token_count(8), Contains("during the window's last backward"));
  for (std::size_t u = unit_sizes.size() - 1; u-- > 0;) model.backward(u).end();
  CHECK(model.finish());
  model.set_token_count(8);  // between windows it may change
  cuda_ok(cudaStreamSynchronize(compute.s));
}

// An all-reduce across replicas that fails when issued (here: the replicate group was aborted on
// every rank) is kept for finish(), as the host path keeps a failure seen while polling: the unit
// counts as reduced, so finish() does not reduce-scatter it a second time. Before the fix the end
// of each backward threw and finish() issued every unit's reduce-scatter again.
TEST_CASE("NCCL fsdp: a failed all-reduce across replicas is reported by finish(), each unit reduce-scattered once",
          "[fsdp][gpu]") {
  nccl_comm& dp = world();
  stream_holder compute;
  auto groups = replica_groups(dp);
  {
    device_model<double> model(groups.shard, groups.replicate,
                               {.level = weft::tune::sharding::gradients, .reduce_dtype = weft::dtype::float64});
    model.set_compute_stream(compute.s);
    register_units(model);
    auto backward_and_finish = [&] {
      for (std::size_t u = unit_sizes.size(); u-- > 0;) CHECK_NOTHROW(model.backward(u).end());
      return model.finish();
    };
    // A clean micro-step: what the shard group issues from backward to the end of finish().
    for (std::size_t u = 0; u < unit_sizes.size(); ++u) model.forward(u).end();
    const std::uint64_t clean_start = groups.shard.recorder().issued();
    CHECK(backward_and_finish());
    const std::uint64_t clean = groups.shard.recorder().issued() - clean_start;
    model.zero_grad();

    for (std::size_t u = 0; u < unit_sizes.size(); ++u) model.forward(u).end();
    groups.replicate.native().abort();
    const std::uint64_t failed_start = groups.shard.recorder().issued();
    CHECK_THROWS(backward_and_finish());
    CHECK(groups.shard.recorder().issued() - failed_start == clean);
  }
  cuda_ok(cudaStreamSynchronize(compute.s));
}
