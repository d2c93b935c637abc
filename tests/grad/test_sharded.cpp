// ZeRO-1: with the optimizer state sharded over the dp ranks (reduce-scatter, update the shard,
// all-gather the parameters), training gives the same parameters as the unsharded update.
#include <catch2/catch.hpp>

#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/synchronizer.hpp>

#include "dp_group.hpp"
#include "mlp.hpp"

#include <cmath>
#include <vector>

using grad_test::mlp;
using grad_test::range;
using weft::grad::flat_buffer;
using weft::grad::synchronizer;

namespace {

/// Adam over a set of runs of the flat buffers; its state is indexed by position in the runs.
struct adam {
  double lr = 0.05, beta1 = 0.9, beta2 = 0.99, eps = 1e-8;
  std::vector<double> m, v;
  int t = 0;
  explicit adam(std::size_t n) : m(n), v(n) {}
  struct run {
    std::size_t buffer_offset, count;
  };
  void step(std::span<double> params, std::span<const double> grads, const std::vector<run>& runs) {
    ++t;
    const double c1 = 1 - std::pow(beta1, t), c2 = 1 - std::pow(beta2, t);
    std::size_t s = 0;
    for (const run& r : runs)
      for (std::size_t i = r.buffer_offset; i < r.buffer_offset + r.count; ++i, ++s) {
        m[s] = beta1 * m[s] + (1 - beta1) * grads[i];
        v[s] = beta2 * v[s] + (1 - beta2) * grads[i] * grads[i];
        params[i] -= lr * (m[s] / c1) / (std::sqrt(v[s] / c2) + eps);
      }
  }
};

void load(mlp& model, flat_buffer<double>& params) {
  for (std::size_t p = 0; p < 4; ++p) {
    auto view = params.view(p);
    std::copy(view.begin(), view.end(), model.param(p).begin());
  }
}

// Trains `steps` optimizer steps of k micro-steps; returns the final flat parameter buffer.
std::vector<double> train(comm_t& dp, bool sharded, int steps, int k) {
  const std::size_t ranks = static_cast<std::size_t>(dp.size()), rank = static_cast<std::size_t>(dp.rank());
  synchronizer<weft::mpi_backend, double> sync(
      dp, {.bucket_bytes = 96, .first_bucket_bytes = 24, .pad_elements = 4, .accumulation_steps = k,
           .shard_optimizer_state = sharded, .warn_if_not_overlapped = false});
  for (std::size_t p = 0; p < 4; ++p) sync.add_param(mlp::names[p], mlp::sizes[p]);
  sync.freeze();
  mlp model;
  flat_buffer<double> params(sync.shared_plan());
  for (std::size_t p = 0; p < 4; ++p) std::copy(model.param(p).begin(), model.param(p).end(), params.view(p).begin());

  std::vector<adam::run> runs;
  if (sharded) {
    for (const auto& s : sync.shard_segments()) runs.push_back({s.buffer_offset, s.count});
  } else {
    for (std::size_t p = 0; p < 4; ++p) runs.push_back({sync.plan().offset_of(p), mlp::sizes[p]});
  }
  std::size_t state = 0;
  for (const auto& r : runs) state += r.count;
  if (sharded) REQUIRE(state == sync.shard_elements());
  adam optimizer(state);

  const std::size_t m = 3;
  for (int step = 0; step < steps; ++step) {
    load(model, params);
    for (int j = 0; j < k; ++j) {
      std::size_t first = ((static_cast<std::size_t>(step * k + j)) * ranks + rank) * m;
      for (std::size_t p = 4; p-- > 0;) {
        auto g = model.gradient(p, range(first, m), 1.0 / static_cast<double>(m));
        sync.mark_ready(p, g);
      }
      sync.finish();
    }
    optimizer.step(params.all(), sync.grads().all(), runs);
    if (sharded) {
      auto gather = sync.gather_params_async(params);
      gather.wait_for(0);  // the first layer's parameters, as the next forward would
      gather.wait();
    }
    sync.zero_grad();
  }
  return {params.all().begin(), params.all().end()};
}

}  // namespace

TEST_CASE("the sharded (ZeRO-1) Adam update equals the unsharded one", "[grad][sharded]") {
  auto dp = dp_group();
  for (int k : {1, 2}) {
    DYNAMIC_SECTION("accumulation window " << k) {
      auto plain = train(dp, false, 3, k);
      auto sharded = train(dp, true, 3, k);
      REQUIRE(plain.size() == sharded.size());
      auto initial = train(dp, false, 0, k);
      double moved = 0;
      for (std::size_t i = 0; i < plain.size(); ++i) {
        INFO("element " << i);
        REQUIRE(sharded[i] == Approx(plain[i]).epsilon(0).margin(1e-12));
        moved += std::abs(plain[i] - initial[i]);
      }
      // The update did something (a test that would pass with no training at all proves nothing).
      REQUIRE(moved > 1e-3);
    }
  }
}

TEST_CASE("shards cover every gradient exactly once across the ranks", "[grad][sharded]") {
  auto dp = dp_group();
  synchronizer<weft::mpi_backend> sync(dp, {.bucket_bytes = 200, .first_bucket_bytes = 40, .pad_elements = 1,
                                            .scale = weft::grad::scaling::sum, .shard_optimizer_state = true});
  for (std::size_t p = 0; p < 9; ++p) sync.add_param("p" + std::to_string(p), 7 + 11 * p);
  sync.freeze();
  // Count, over all ranks, how often each element is owned.
  const auto& plan = sync.plan();
  std::vector<int> owned(plan.total_elements(), 0), total(plan.total_elements(), 0);
  for (const auto& s : sync.shard_segments()) {
    REQUIRE(plan.offset_of(s.param) + s.param_offset == s.buffer_offset);
    for (std::size_t i = 0; i < s.count; ++i) ++owned[s.buffer_offset + i];
  }
  MPI_Allreduce(owned.data(), total.data(), static_cast<int>(owned.size()), MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  for (std::size_t p = 0; p < 9; ++p)
    for (std::size_t i = 0; i < plan.params()[p].count; ++i) REQUIRE(total[plan.offset_of(p) + i] == 1);

  // After finish(), the owned elements hold the sum over ranks.
  for (std::size_t p = 9; p-- > 0;) {
    auto g = sync.grad(p);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(dp.rank() + 1) * static_cast<float>(i % 5);
    sync.mark_ready(p);
  }
  sync.finish();
  const float ranks_sum = static_cast<float>(dp.size() * (dp.size() + 1) / 2);
  for (const auto& s : sync.shard_segments())
    for (std::size_t i = 0; i < s.count; ++i)
      REQUIRE(sync.grads().all()[s.buffer_offset + i] == ranks_sum * static_cast<float>((s.param_offset + i) % 5));
}

TEST_CASE("gathering into a buffer with another layout is refused", "[grad][sharded][errors]") {
  auto dp = dp_group();
  synchronizer<weft::mpi_backend> sync(dp, {.shard_optimizer_state = true});
  sync.add_param("a", 100);
  sync.freeze();
  flat_buffer<float> other(std::make_shared<const weft::grad::bucket_plan>(
      std::vector<weft::grad::param_spec>{{"a", 101}}, weft::dtype::float32, weft::grad::plan_options{}));
  REQUIRE_THROWS_WITH(sync.gather_params_async(other), Catch::Contains("plan"));
}
