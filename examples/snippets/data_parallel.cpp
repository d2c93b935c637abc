// docs/data_parallel.md's host examples as one program: the gradient synchronizer with
// accumulation ("Using it") and with sharded optimizer state (ZeRO-1), on a model whose gradients
// are known on every rank. Each result is checked against a formula; rank 0 prints
// "data_parallel: ok" when every check passed on every rank.
#include <weft/backend/mpi/backend.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/launch/mpi_environment.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect_near(float got, float want, const char* what, std::size_t param) {
  if (std::abs(got - want) > 1e-5f * std::max(1.0f, std::abs(want))) {
    std::fprintf(stderr, "data_parallel: FAILED: %s of parameter %zu is %g, expected %g\n", what, param, got, want);
    ++failures;
  }
}

/// Three parameters, one large enough for a bucket of its own. Backward hands parameter p the
/// gradient input x (p + 1) in every element, last parameter first.
struct toy_model {
  struct parameter {
    std::string name;
    std::size_t numel;
  };
  std::vector<parameter> params{{"embedding", 300000}, {"layer", 1000}, {"head", 3}};
  float input = 0;

  std::vector<parameter>& parameters() { return params; }
  void forward(float x) { input = x; }
  void backward(const std::function<void(std::size_t, std::span<const float>)>& ready) {
    for (std::size_t p = params.size(); p-- > 0;) {
      const std::vector<float> gradient(params[p].numel, input * static_cast<float>(p + 1));
      ready(p, gradient);
    }
  }
};

/// Checks that each gradient is the mean over ranks and micro-batches, then takes an SGD step.
struct checking_sgd {
  float mean_input;  ///< the mean of every rank's and micro-batch's input
  void step(std::vector<float>& params, weft::grad::flat_buffer<float>& grads) const {
    for (std::size_t p = 0; p < 3; ++p) {
      const std::span<float> g = grads.view(p);
      expect_near(g.front(), mean_input * static_cast<float>(p + 1), "the reduced gradient", p);
      expect_near(g.back(), mean_input * static_cast<float>(p + 1), "the reduced gradient", p);
      params[p] -= 0.1f * g.front();
    }
  }
};

void accumulation(weft::communicator<weft::mpi_backend>& world) {
  toy_model model;
  const float ranks = static_cast<float>(world.size());
  std::vector<float> batch;  // micro-batch m of rank r has input r + m
  for (int micro = 0; micro < 4; ++micro) batch.push_back(static_cast<float>(world.rank() + micro));
  const checking_sgd optimizer{(ranks - 1) / 2 + 1.5f};
  std::vector<float> params(3, 0.0f);
  const int steps = 3;

  weft::communicator<weft::mpi_backend>& dp = world;     // the data-parallel group
  weft::grad::synchronizer<weft::mpi_backend, float> sync(dp, {.accumulation_steps = 4});
  std::vector<std::size_t> id;
  for (auto& p : model.parameters()) id.push_back(sync.add_param(p.name, p.numel));  // forward order
  sync.freeze();                                        // collective: plans, allocates, compares plans

  for (int step = 0; step < steps; ++step) {            // one optimizer step
    for (int micro = 0; micro < 4; ++micro) {
      model.forward(batch[micro]);
      model.backward([&](std::size_t layer_param, std::span<const float> g) {
        sync.mark_ready(id[layer_param], g);            // adds g into the buffer, may start a bucket
      });
      sync.finish();                                    // true on the 4th micro-step: gradients reduced
    }
    optimizer.step(params, sync.grads());               // averaged over dp x 4 micro-batches
    sync.zero_grad();
  }
  expect_near(params[2], -0.1f * 3 * optimizer.mean_input * 3, "the parameter after 3 steps", 2);
}

/// The first moment of Adam, enough to show where each rank's share of the state lives.
void adam_update(std::span<float> param, std::span<const float> grad, std::span<float> exp_avg) {
  for (std::size_t i = 0; i < param.size(); ++i) {
    exp_avg[i] = 0.9f * exp_avg[i] + 0.1f * grad[i];
    param[i] -= exp_avg[i];
  }
}

void sharded_state(weft::communicator<weft::mpi_backend>& dp) {
  using B = weft::mpi_backend;
  toy_model model;
  const std::size_t first_param_of_layer0 = 0;

  weft::grad::synchronizer<B, float> sync(dp, {.shard_optimizer_state = true});
  for (auto& p : model.parameters()) sync.add_param(p.name, p.numel);
  sync.freeze();
  weft::grad::flat_buffer<float> params(sync.shared_plan());   // parameters, same layout
  std::vector<float> exp_avg(sync.shard_elements());           // 1/dp of the state
  model.forward(static_cast<float>(dp.rank()));
  model.backward([&](std::size_t p, std::span<const float> g) { sync.mark_ready(p, g); });
  sync.finish();
  std::size_t state_used = 0;
  auto next_state = [&](std::size_t count) { return std::span(exp_avg).subspan((state_used += count) - count, count); };
  for (const auto& s : sync.shard_segments())   // runs of one parameter: param, buffer_offset, count
    adam_update(params.all().subspan(s.buffer_offset, s.count),
                sync.grads().all().subspan(s.buffer_offset, s.count), /* this run's state */ next_state(s.count));
  auto gather = sync.gather_params_async(params);  // all-gather, first layers' bucket first
  gather.wait_for(first_param_of_layer0);          // then layer 0's forward can run
  gather.wait();

  // Every rank now holds every updated parameter: -0.1 x the mean gradient, (p + 1) x the mean rank.
  const float mean_rank = static_cast<float>(dp.size() - 1) / 2;
  if (state_used != exp_avg.size()) {
    std::fprintf(stderr, "data_parallel: FAILED: the shard's segments cover %zu of %zu state elements\n", state_used,
                 exp_avg.size());
    ++failures;
  }
  for (std::size_t p = 0; p < 3; ++p) {
    const std::span<float> values = params.view(p);
    for (float v : {values.front(), values[values.size() / 2], values.back()})
      expect_near(v, -0.1f * mean_rank * static_cast<float>(p + 1), "the gathered parameter", p);
  }
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "world");
  accumulation(world);
  sharded_state(world);
  std::vector<int> failed{failures};
  world.all_reduce(failed);
  if (world.rank() == 0 && failed[0] == 0) std::printf("data_parallel: ok\n");
  return failed[0] == 0 ? 0 : 1;
}
