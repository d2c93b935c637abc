#pragma once
// The two trainings the sharding tests compare: unsharded data parallel (weft's gradient
// synchronizer, with Adam written out here) and a sharded model (ZeRO-2, ZeRO-3 or HSDP, with
// fsdp::shard_adamw), on the same layer stack, global batches and hyper-parameters. Both return
// the whole parameters, layer by layer (weight, then bias).
#include <weft/backend/mpi/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/fsdp/adamw.hpp>
#include <weft/fsdp/sharded_model.hpp>
#include <weft/grad/synchronizer.hpp>

#include "layer_stack.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

namespace fsdp_test {

using comm_t = weft::communicator<weft::mpi_backend>;

/// The test's data-parallel group: every rank.
inline comm_t dp_world() { return comm_t(weft::mpi_backend::comm::world(), "dp"); }

/// One recorded communication event, without its micro-step (for comparing orders).
struct schedule_step {
  weft::fsdp::pass during;
  weft::fsdp::schedule_kind kind;
  std::size_t unit;
};

/// The recorded events without reduce_done (when a reduction is seen complete depends on timing).
inline std::vector<schedule_step> issued(const std::vector<weft::fsdp::schedule_event>& events) {
  std::vector<schedule_step> out;
  for (const auto& e : events)
    if (e.kind != weft::fsdp::schedule_kind::reduce_done) out.push_back({e.during, e.kind, e.unit});
  return out;
}

/// Short names for writing expected sequences by hand.
namespace events {
constexpr auto F = weft::fsdp::pass::forward;
constexpr auto Bk = weft::fsdp::pass::backward;
constexpr auto issue = weft::fsdp::schedule_kind::gather_issued;
constexpr auto waited = weft::fsdp::schedule_kind::gather_waited;
constexpr auto freed = weft::fsdp::schedule_kind::params_freed;
constexpr auto reduce = weft::fsdp::schedule_kind::reduce_issued;
}  // namespace events

/// A sequence of events as lines, for a readable comparison.
inline std::string text(const std::vector<schedule_step>& steps) {
  std::string out;
  for (const auto& s : steps)
    out += std::string(to_string(s.during)) + " " + std::string(to_string(s.kind)) + " " + std::to_string(s.unit) + "\n";
  return out;
}

inline const layer_stack& test_stack() {
  static const layer_stack stack{{6, 9, 7, 8, 3}};
  return stack;
}

/// Samples per micro-step over all ranks: divisible by every dp the tests use (1, 2, 3, 4).
constexpr std::size_t global_micro_batch = 12;

inline const weft::fsdp::adamw_options& test_adam() {
  static const weft::fsdp::adamw_options options{.lr = 0.02, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8,
                                                 .weight_decay = 0.01};
  return options;
}

/// This rank's samples of micro-step `micro` of optimizer step `step`, with `ranks` data-parallel ranks.
inline std::vector<std::size_t> samples_of(int step, int micro, int k, int rank, int ranks) {
  const std::size_t per_rank = global_micro_batch / static_cast<std::size_t>(ranks);
  const std::size_t first = static_cast<std::size_t>(step * k + micro) * global_micro_batch +
                            static_cast<std::size_t>(rank) * per_rank;
  return range(first, per_rank);
}

/// Unsharded data parallel over `dp`: `steps` optimizer steps of `k` micro-steps, AdamW over the
/// whole parameters on every rank. Gradients are means over each rank's samples, averaged over
/// ranks and micro-steps by the synchronizer. With `Rounded` other than double, forward and
/// backward read the parameters rounded to `Rounded` and each rank's gradients are rounded to it
/// before the (double) reduction: the rounding points of a sharded model gathering in `Rounded`.
template <class Rounded = double>
std::vector<double> train_ddp(comm_t& dp, int steps, int k) {
  const layer_stack& net = test_stack();
  weft::grad::synchronizer<weft::mpi_backend, double> sync(
      dp, {.bucket_bytes = 256, .first_bucket_bytes = 64, .pad_elements = 4, .accumulation_steps = k,
           .warn_if_not_overlapped = false});
  std::vector<std::vector<double>> params;
  for (std::size_t l = 0; l < net.layers(); ++l) {
    sync.add_param(net.name(l) + ".weight", net.weight_count(l));
    sync.add_param(net.name(l) + ".bias", net.bias_count(l));
    std::vector<double> w(net.weight_count(l)), b(net.bias_count(l));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = net.initial_weight(l, i);
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = net.initial_bias(l, i);
    params.push_back(w);
    params.push_back(b);
  }
  sync.freeze();
  std::vector<std::vector<double>> m, v;
  for (const auto& p : params) {
    m.emplace_back(p.size());
    v.emplace_back(p.size());
  }
  const auto& o = test_adam();
  for (int step = 0; step < steps; ++step) {
    for (int j = 0; j < k; ++j) {
      auto samples = samples_of(step, j, k, dp.rank(), dp.size());
      std::vector<std::vector<Rounded>> rounded;
      for (const auto& p : params) {
        rounded.emplace_back(p.size());
        for (std::size_t i = 0; i < p.size(); ++i) rounded.back()[i] = layer_stack::to<Rounded>(p[i]);
      }
      auto acts = net.begin(samples);
      for (std::size_t l = 0; l < net.layers(); ++l)
        net.forward<Rounded>(l, rounded[2 * l], rounded[2 * l + 1], acts);
      auto dy = net.output_gradient(samples, acts, 1.0 / static_cast<double>(samples.size()));
      for (std::size_t l = net.layers(); l-- > 0;) {
        std::vector<Rounded> gw(net.weight_count(l)), gb(net.bias_count(l));
        dy = net.backward<Rounded, Rounded>(l, rounded[2 * l], acts, dy, std::span<Rounded>(gw), std::span<Rounded>(gb));
        for (std::size_t i = 0; i < gw.size(); ++i) sync.grad(2 * l)[i] += layer_stack::value(gw[i]);
        for (std::size_t i = 0; i < gb.size(); ++i) sync.grad(2 * l + 1)[i] += layer_stack::value(gb[i]);
        sync.mark_ready(2 * l + 1);
        sync.mark_ready(2 * l);
      }
      sync.finish();
    }
    const double c1 = 1 - std::pow(o.beta1, step + 1), c2 = 1 - std::pow(o.beta2, step + 1);
    for (std::size_t p = 0; p < params.size(); ++p) {
      auto g = sync.grad(p);
      for (std::size_t i = 0; i < params[p].size(); ++i) {
        m[p][i] = o.beta1 * m[p][i] + (1 - o.beta1) * g[i];
        v[p][i] = o.beta2 * v[p][i] + (1 - o.beta2) * g[i] * g[i];
        params[p][i] = params[p][i] * (1 - o.lr * o.weight_decay) - o.lr * (m[p][i] / c1) / (std::sqrt(v[p][i] / c2) + o.eps);
      }
    }
    sync.zero_grad();
  }
  std::vector<double> out;
  for (const auto& p : params) out.insert(out.end(), p.begin(), p.end());
  return out;
}

template <class Param>
using model_t = weft::fsdp::sharded_model<weft::mpi_backend, Param>;
template <class Param>
using master_of = typename model_t<Param>::master_type;

/// Registers the stack's layers as units of `model` and freezes it.
template <class Param>
void register_units(model_t<Param>& model) {
  const layer_stack& net = test_stack();
  for (std::size_t l = 0; l < net.layers(); ++l)
    model.add_unit(net.name(l), {{"weight", net.weight_count(l)}, {"bias", net.bias_count(l)}});
  model.freeze();
}

/// Loads the stack's initial values (every rank computes them; each keeps its part).
template <class Param>
void load_initial(model_t<Param>& model) {
  const layer_stack& net = test_stack();
  for (std::size_t l = 0; l < net.layers(); ++l) {
    std::vector<master_of<Param>> w(net.weight_count(l)), b(net.bias_count(l));
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<master_of<Param>>(net.initial_weight(l, i));
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<master_of<Param>>(net.initial_bias(l, i));
    model.load_whole(l, 0, w);
    model.load_whole(l, 1, b);
  }
}

/// One micro-step of the stack through the units' scopes.
template <class Param>
void micro_step(model_t<Param>& model, const std::vector<std::size_t>& samples) {
  const layer_stack& net = test_stack();
  auto acts = net.begin(samples);
  for (std::size_t l = 0; l < net.layers(); ++l) {
    auto scope = model.forward(l);
    net.forward<Param>(l, scope.param(0), scope.param(1), acts);
  }
  auto dy = net.output_gradient(samples, acts, 1.0 / static_cast<double>(samples.size()));
  for (std::size_t l = net.layers(); l-- > 0;) {
    auto scope = model.backward(l);
    dy = net.backward<Param, Param>(l, scope.param(0), acts, dy, scope.grad(0), scope.grad(1));
  }
}

/// Optimizer steps `first_step` .. `first_step + steps - 1` on a frozen, loaded model.
template <class Param>
void train_steps(model_t<Param>& model, weft::fsdp::shard_adamw<master_of<Param>>& adam, int first_step, int steps,
                 int k, int rank, int ranks) {
  for (int step = first_step; step < first_step + steps; ++step) {
    for (int j = 0; j < k; ++j) {
      micro_step(model, samples_of(step, j, k, rank, ranks));
      const bool last = model.finish();
      if (last != (j == k - 1)) throw std::runtime_error("finish() returned the wrong window end");
    }
    adam.step(model);
    model.zero_grad();
  }
}

/// Whole parameters in train_ddp's order, from the model's gathered master shards.
template <class Param>
std::vector<double> whole_params(model_t<Param>& model) {
  std::vector<double> out;
  for (const auto& w : model.gather_whole_params())
    for (auto x : w.values) out.push_back(static_cast<double>(x));
  return out;
}

/// `steps` optimizer steps of a sharded model (made by the caller, with `ranks` dp ranks of which
/// this is `rank`); returns the whole parameters.
template <class Param>
std::vector<double> train_sharded(model_t<Param>& model, int steps, int k, int rank, int ranks) {
  register_units(model);
  load_initial(model);
  weft::fsdp::shard_adamw<master_of<Param>> adam(model, test_adam());
  train_steps(model, adam, 0, steps, k, rank, ranks);
  return whole_params(model);
}

/// Requires every element of `actual` within `bound` of `reference`, absolutely: the bound the
/// docs state. (Catch2's Approx(x).margin(m) would also pass anything within its default relative
/// epsilon, 1.19e-5, whatever m says.)
inline void require_within(const std::vector<double>& actual, const std::vector<double>& reference, double bound) {
  REQUIRE(actual.size() == reference.size());
  std::size_t worst = 0;
  double largest = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double d = std::abs(actual[i] - reference[i]);
    if (!(d <= largest)) {  // also catches NaN
      largest = d;
      worst = i;
    }
  }
  INFO("largest difference " << largest << " at element " << worst << " (bound " << bound << ")");
  REQUIRE(largest <= bound);
}

}  // namespace fsdp_test
