#pragma once
/// \file
/// AdamW (decoupled weight decay, Loshchilov & Hutter) on a sharded model's local shards: each
/// rank keeps the moments of its shard only (1/dp of the state) and updates its master shard from
/// its gradient shard. The moments are laid out like the master shards, so they go to and come
/// from whole tensors the same way (checkpoints that resume on another number of ranks).

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/core/error.hpp>
#include <weft/fsdp/sharded_model.hpp>
#include <weft/fsdp/whole_tensor.hpp>

namespace weft::fsdp {

struct adamw_options {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

template <class Master>
class shard_adamw {
 public:
  shard_adamw() = default;
  /// Moments for every unit of `model` (frozen), zeroed.
  template <class Model>
  shard_adamw(const Model& model, adamw_options options) : options_(options) {
    static_assert(Model::memory == memory_space::host,
                  "weft::fsdp::shard_adamw updates host shards; on a GPU backend step the shards with your own "
                  "kernels (shard_params(u) and shard_grads(u) are device memory)");
    for (std::size_t u = 0; u < model.unit_count(); ++u) {
      exp_avg_.emplace_back(model.shard_params_view(u).size());
      exp_avg_sq_.emplace_back(model.shard_params_view(u).size());
    }
  }

  /// One step over every unit's shard (call after a finish() that returned true).
  template <class Model>
  void step(Model& model) {
    if (exp_avg_.size() != model.unit_count())
      fail("shard_adamw: made for " + std::to_string(exp_avg_.size()) + " units, the model has " +
           std::to_string(model.unit_count()));
    ++steps_;
    const double c1 = 1 - std::pow(options_.beta1, static_cast<double>(steps_));
    const double c2 = 1 - std::pow(options_.beta2, static_cast<double>(steps_));
    for (std::size_t u = 0; u < exp_avg_.size(); ++u) {
      std::span<Master> p = model.shard_params(u);
      std::span<const Master> g = model.shard_grads(u);
      std::vector<Master>& m = exp_avg_[u];
      std::vector<Master>& v = exp_avg_sq_[u];
      for (std::size_t i = 0; i < p.size(); ++i) {
        const double gi = static_cast<double>(g[i]);
        const double mi = options_.beta1 * static_cast<double>(m[i]) + (1 - options_.beta1) * gi;
        const double vi = options_.beta2 * static_cast<double>(v[i]) + (1 - options_.beta2) * gi * gi;
        m[i] = static_cast<Master>(mi);
        v[i] = static_cast<Master>(vi);
        double pi = static_cast<double>(p[i]) * (1 - options_.lr * options_.weight_decay);
        pi -= options_.lr * (mi / c1) / (std::sqrt(vi / c2) + options_.eps);
        p[i] = static_cast<Master>(pi);
      }
    }
  }

  std::size_t steps() const noexcept { return steps_; }
  std::span<Master> exp_avg(std::size_t u) { return exp_avg_.at(u); }
  std::span<Master> exp_avg_sq(std::size_t u) { return exp_avg_sq_.at(u); }
  /// Bytes of optimizer state this rank holds.
  std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& m : exp_avg_) n += 2 * m.size() * sizeof(Master);
    return n;
  }

  /// The moments as whole tensors ("exp_avg.<unit>.<param>", "exp_avg_sq.<unit>.<param>") and the
  /// step count ("adamw.step"), on every rank. Collective over the model's shard group.
  template <class Model>
  std::vector<whole_tensor<Master>> gather_whole(Model& model) {
    auto out = model.gather_whole([this](std::size_t u) { return std::span<const Master>(exp_avg_.at(u)); }, "exp_avg.");
    auto sq = model.gather_whole([this](std::size_t u) { return std::span<const Master>(exp_avg_sq_.at(u)); },
                                 "exp_avg_sq.");
    out.insert(out.end(), sq.begin(), sq.end());
    out.push_back({"adamw.step", {static_cast<Master>(steps_)}});
    return out;
  }

  /// Sets the moments and the step count from whole tensors saved on any number of ranks.
  template <class Model>
  void reshard_from_whole(Model& model, std::span<const whole_tensor<Master>> whole) {
    model.reshard_from_whole(whole, [this](std::size_t u) { return exp_avg(u); }, "exp_avg.");
    model.reshard_from_whole(whole, [this](std::size_t u) { return exp_avg_sq(u); }, "exp_avg_sq.");
    for (const whole_tensor<Master>& w : whole)
      if (w.name == "adamw.step" && w.values.size() == 1) {
        steps_ = static_cast<std::size_t>(w.values[0]);
        return;
      }
    fail("shard_adamw: no whole tensor 'adamw.step' (one element) to resume the step count from");
  }

 private:
  adamw_options options_;
  std::size_t steps_ = 0;
  std::vector<std::vector<Master>> exp_avg_, exp_avg_sq_;
};

}  // namespace weft::fsdp
