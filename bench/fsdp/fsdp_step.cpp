// A training step of a stack of dense layers under unsharded data parallel (weft's gradient
// synchronizer, overlapped), ZeRO-2, and ZeRO-3 / FSDP with and without prefetch, side by side in
// one run on the same model, batch and AdamW; plus each one's training-state memory per rank.
//
//   mpirun -n 4 weft_bench_fsdp [--layers 8] [--width 384] [--batch 48] [--steps 8] [--warmup 2] [--json FILE]
//
// Targets: FSDP step <= 1.25 x the data-parallel step (prefetch hides the gathers); FSDP's
// training state per rank <= replicated / dp + two units' gathered parameters.
#include <mpi.h>

#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/fsdp/adamw.hpp>
#include <weft/fsdp/sharded_model.hpp>
#include <weft/grad/synchronizer.hpp>

#include "../grad_sync/bench_args.hpp"
#include "json_output.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

using namespace weft_bench;
using comm_t = weft::communicator<weft::mpi_backend>;

namespace {

constexpr const char* usage_text =
    "usage: weft_bench_fsdp [--layers N] [--width N] [--batch N] [--steps N] [--warmup N] [--json FILE]\n";

struct shape {
  std::size_t layers = 8, width = 384, batch = 48;
  std::size_t weights() const { return width * width; }
};

/// y += x W + b for a batch (W stored in x in-major order, so the inner loop is contiguous).
void dense_forward(const shape& s, std::span<const float> w, std::span<const float> b, const std::vector<float>& x,
                   std::vector<float>& y) {
  const std::size_t n = s.width;
  y.assign(s.batch * n, 0.0f);
  for (std::size_t r = 0; r < s.batch; ++r) {
    float* out = y.data() + r * n;
    for (std::size_t o = 0; o < n; ++o) out[o] = b[o];
    for (std::size_t i = 0; i < n; ++i) {
      const float xi = x[r * n + i];
      const float* row = w.data() + i * n;
      for (std::size_t o = 0; o < n; ++o) out[o] += xi * row[o];
    }
    for (std::size_t o = 0; o < n; ++o) out[o] = std::tanh(out[o]);
  }
}

/// Adds the layer's weight and bias gradients into gw, gb; returns the gradient of its input.
std::vector<float> dense_backward(const shape& s, std::span<const float> w, const std::vector<float>& x,
                                  const std::vector<float>& y, const std::vector<float>& dy, std::span<float> gw,
                                  std::span<float> gb) {
  const std::size_t n = s.width;
  std::vector<float> dz(dy.size()), dx(s.batch * n, 0.0f);
  for (std::size_t i = 0; i < dz.size(); ++i) dz[i] = dy[i] * (1 - y[i] * y[i]);
  for (std::size_t r = 0; r < s.batch; ++r) {
    const float* d = dz.data() + r * n;
    for (std::size_t o = 0; o < n; ++o) gb[o] += d[o];
    for (std::size_t i = 0; i < n; ++i) {
      const float xi = x[r * n + i];
      float* grow = gw.data() + i * n;
      const float* row = w.data() + i * n;
      float acc = 0;
      for (std::size_t o = 0; o < n; ++o) {
        grow[o] += xi * d[o];
        acc += row[o] * d[o];
      }
      dx[r * n + i] = acc;
    }
  }
  return dx;
}

float initial(std::size_t layer, std::size_t i, std::size_t width) {
  return static_cast<float>(0.5 / std::sqrt(static_cast<double>(width)) *
                            std::sin(1.3 * static_cast<double>(i) + 0.7 * static_cast<double>(layer)));
}

std::vector<float> batch_input(const shape& s, int rank, int step) {
  std::vector<float> x(s.batch * s.width);
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<float>(std::sin(0.01 * static_cast<double>(i) + rank + 0.1 * step));
  return x;
}

void adamw(std::span<float> p, std::span<const float> g, std::vector<float>& m, std::vector<float>& v, int t) {
  const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f;
  const float c1 = 1 - std::pow(b1, static_cast<float>(t)), c2 = 1 - std::pow(b2, static_cast<float>(t));
  for (std::size_t i = 0; i < p.size(); ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] -= lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + 1e-8f);
  }
}

struct result {
  double step_s = 0;
  std::size_t bytes = 0;
};

double step_time(comm_t& world, double local) { return max_over_ranks(local, world.native().native()); }

result run_ddp(comm_t& dp, const shape& s, int warmup, int steps) {
  weft::grad::synchronizer<weft::mpi_backend, float> sync(dp, {.warn_if_not_overlapped = false});
  for (std::size_t l = 0; l < s.layers; ++l) {
    sync.add_param("layer" + std::to_string(l) + ".weight", s.weights());
    sync.add_param("layer" + std::to_string(l) + ".bias", s.width);
  }
  sync.freeze();
  weft::grad::flat_buffer<float> params(sync.shared_plan());
  for (std::size_t l = 0; l < s.layers; ++l) {
    auto w = params.view(2 * l);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = initial(l, i, s.width);
  }
  std::vector<float> m(params.all().size()), v(params.all().size());
  std::vector<double> times;
  for (int step = 0; step < warmup + steps; ++step) {
    dp.barrier();
    const double t0 = now_s();
    std::vector<std::vector<float>> acts(s.layers + 1);
    acts[0] = batch_input(s, dp.rank(), step);
    for (std::size_t l = 0; l < s.layers; ++l) dense_forward(s, params.view(2 * l), params.view(2 * l + 1), acts[l], acts[l + 1]);
    std::vector<float> dy(acts.back().size(), 1e-3f);
    for (std::size_t l = s.layers; l-- > 0;) {
      dy = dense_backward(s, params.view(2 * l), acts[l], acts[l + 1], dy, sync.grad(2 * l), sync.grad(2 * l + 1));
      sync.mark_ready(2 * l + 1);
      sync.mark_ready(2 * l);
    }
    sync.finish();
    adamw(params.all(), sync.grads().all(), m, v, step + 1);
    sync.zero_grad();
    const double t = step_time(dp, now_s() - t0);
    if (step >= warmup) times.push_back(t);
  }
  const std::size_t floats = params.all().size();
  return {median(times), 4 * floats * sizeof(float)};  // parameters, gradients, two moments
}

result run_sharded(comm_t& dp, const shape& s, weft::fsdp::fsdp_options options, int warmup, int steps) {
  weft::fsdp::sharded_model<weft::mpi_backend, float> model(dp, options);
  for (std::size_t l = 0; l < s.layers; ++l)
    model.add_unit("layer" + std::to_string(l), {{"weight", s.weights()}, {"bias", s.width}});
  model.freeze();
  for (std::size_t l = 0; l < s.layers; ++l) {
    std::vector<float> w(s.weights());
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = initial(l, i, s.width);
    model.load_whole(l, 0, w);
  }
  weft::fsdp::shard_adamw<float> adam(model, {.lr = 1e-3});
  std::vector<double> times;
  for (int step = 0; step < warmup + steps; ++step) {
    if (step == warmup) model.reset_peak();
    dp.barrier();
    const double t0 = now_s();
    std::vector<std::vector<float>> acts(s.layers + 1);
    acts[0] = batch_input(s, dp.rank(), step);
    for (std::size_t l = 0; l < s.layers; ++l) {
      auto unit = model.forward(l);
      dense_forward(s, unit.param(0), unit.param(1), acts[l], acts[l + 1]);
    }
    std::vector<float> dy(acts.back().size(), 1e-3f);
    for (std::size_t l = s.layers; l-- > 0;) {
      auto unit = model.backward(l);
      dy = dense_backward(s, unit.param(0), acts[l], acts[l + 1], dy, unit.grad(0), unit.grad(1));
    }
    model.finish();
    adam.step(model);
    model.zero_grad();
    const double t = step_time(dp, now_s() - t0);
    if (step >= warmup) times.push_back(t);
  }
  return {median(times), model.peak_bytes() + adam.bytes()};
}

}  // namespace

int main(int argc, char** argv) {
  return weft_programs::mpi_main("weft_bench_fsdp", usage_text, argc, argv, [&](int) {
    check_arguments(argc, argv, {"--layers", "--width", "--batch", "--steps", "--warmup", "--json"}, {});
    using weft_programs::parse_integer;
    shape s;
    s.layers = static_cast<std::size_t>(parse_integer<int>("--layers", option(argc, argv, "--layers", "8"), 1, 1000));
    s.width = static_cast<std::size_t>(parse_integer<int>("--width", option(argc, argv, "--width", "384"), 1, 100000));
    s.batch = static_cast<std::size_t>(parse_integer<int>("--batch", option(argc, argv, "--batch", "48"), 1, 100000));
    const int steps = parse_integer<int>("--steps", option(argc, argv, "--steps", "8"), 1, 100000);
    const int warmup = parse_integer<int>("--warmup", option(argc, argv, "--warmup", "2"), 0, 100000);
    const std::string json_path = option(argc, argv, "--json");

    comm_t dp(weft::mpi_backend::comm::world(), "dp");
    using weft::tune::sharding;
    const result ddp = run_ddp(dp, s, warmup, steps);
    const result fsdp = run_sharded(dp, s, {.level = sharding::full}, warmup, steps);
    const result fsdp_no_prefetch = run_sharded(dp, s, {.level = sharding::full, .prefetch = false}, warmup, steps);
    const result zero2 = run_sharded(dp, s, {.level = sharding::gradients}, warmup, steps);

    // The target's allowance: a 1/dp share of the replicated state plus two units' gathered
    // parameters (the unit in use and the prefetched one).
    const std::size_t unit_bytes = (s.weights() + s.width) * sizeof(float);
    const double target_bytes = static_cast<double>(ddp.bytes) / dp.size() + 2.0 * static_cast<double>(unit_bytes);
    if (dp.rank() == 0) {
      std::printf("weft_bench_fsdp: %d ranks, %zu layers of %zu x %zu, batch %zu per rank, median of %d steps\n",
                  dp.size(), s.layers, s.width, s.width, s.batch, steps);
      std::printf("  %-22s %10s %8s %14s\n", "variant", "step_ms", "vs ddp", "state_bytes");
      auto row = [&](const char* name, const result& r) {
        std::printf("  %-22s %10.2f %8.3f %14zu\n", name, r.step_s * 1e3, r.step_s / ddp.step_s, r.bytes);
      };
      row("ddp", ddp);
      row("zero2", zero2);
      row("fsdp (zero3)", fsdp);
      row("fsdp without prefetch", fsdp_no_prefetch);
      std::printf("  fsdp state %.0f bytes vs target %.0f (replicated / dp + 2 units of %zu): %s\n",
                  static_cast<double>(fsdp.bytes), target_bytes, unit_bytes,
                  static_cast<double>(fsdp.bytes) <= target_bytes ? "met" : "missed");
      std::printf("  fsdp step %.3f x ddp (target <= 1.25): %s\n", fsdp.step_s / ddp.step_s,
                  fsdp.step_s <= 1.25 * ddp.step_s ? "met" : "missed");
      if (!json_path.empty()) {
        std::ofstream out = weft_programs::open_json_output(json_path);
        out << "{\"ranks\": " << dp.size() << ", \"layers\": " << s.layers << ", \"width\": " << s.width
            << ", \"batch_per_rank\": " << s.batch << ", \"steps\": " << steps << ",\n \"ddp_step_s\": "
            << json_value(ddp.step_s) << ", \"fsdp_step_s\": " << json_value(fsdp.step_s)
            << ", \"fsdp_no_prefetch_step_s\": " << json_value(fsdp_no_prefetch.step_s)
            << ", \"zero2_step_s\": " << json_value(zero2.step_s) << ",\n \"replicated_bytes_per_rank\": " << ddp.bytes
            << ", \"fsdp_bytes_per_rank\": " << fsdp.bytes << ", \"zero2_bytes_per_rank\": " << zero2.bytes
            << ", \"fsdp_target_bytes\": " << static_cast<std::size_t>(target_bytes)
            << ", \"unit_bytes\": " << unit_bytes << "}\n";
      }
    }
    return 0;
  });
}
