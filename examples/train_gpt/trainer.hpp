#pragma once
// The training loop: process groups from the layout, the model's chunks run by weft's pipeline
// executor, gradients reduced by weft's synchronizer during backward, AdamW (optionally on a
// ZeRO-1 shard), checkpoints, and what the run reports.

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <weft/checkpoint/async_writer.hpp>
#include <weft/checkpoint/distributed.hpp>
#include <weft/checkpoint/exchange.hpp>
#include <weft/checkpoint/safetensors.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/grad/flat_buffer.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/launch/mpi_cross_check.hpp>
#include <weft/launch/resolve.hpp>
#include <weft/layout/layout.hpp>
#include <weft/layout/node_placement.hpp>
#include <weft/layout/process_groups.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/schedule_kind.hpp>
#include <weft/pipeline/schedules.hpp>

#include "checkpoint_io.hpp"
#include "command_line.hpp"
#include "cpu_kernels.hpp"
#include "data.hpp"
#include "fully_sharded.hpp"
#include "json_output.hpp"
#include "model.hpp"
#include "options.hpp"
#include "parameters.hpp"
#include "timeline.hpp"

namespace train_gpt {

/// A mistake in the flags or files that every rank finds alike (reported once, exit status 1).
using weft_programs::input_error;

/// The step time the final summary reports: the upper middle of the steps' times (0 with none).
inline double median_step_seconds(std::vector<double> step_times) {
  if (step_times.empty()) return 0;
  std::sort(step_times.begin(), step_times.end());
  return step_times[step_times.size() / 2];
}

/// Everything the layout decides, derived from the flags (or the tuner's plan) and the number of
/// ranks: the tuner's vocabulary (degrees, virtual stages, micro-batch, sequence parallelism),
/// so a plan runs as it is.
struct run_layout {
  weft::tune::layout_choice choice;
  int micro_batches = 1;  // per optimizer step, per dp rank
  int global_batch = 1;

  const weft::layout::layout_spec& degrees() const noexcept { return choice.parallel; }
  bool sequence_parallel() const noexcept { return choice.sequence_parallel && choice.parallel.tp > 1; }
};

/// The layout from the flags: `choice` with dp derived from the ranks when it is 0.
inline run_layout resolve_layout(weft::tune::layout_choice choice, int global_batch, const std::string& schedule,
                                 const gpt_config& m, int world) {
  run_layout r;
  weft::layout::layout_spec& d = choice.parallel;
  d.world_size = world;
  const long model_parallel = static_cast<long>(d.tp) * d.pp * d.cp;
  if (d.dp == 0) {
    if (world % model_parallel != 0)
      throw input_error("--tp " + std::to_string(d.tp) + " x --pp " + std::to_string(d.pp) + " x --cp " +
                        std::to_string(d.cp) + " = " + std::to_string(model_parallel) + " does not divide the " +
                        std::to_string(world) + " ranks: launch a multiple of " + std::to_string(model_parallel) +
                        " ranks or change the degrees");
    d.dp = static_cast<int>(world / model_parallel);
  } else if (model_parallel * d.dp != world) {
    throw input_error("--tp " + std::to_string(d.tp) + " x --pp " + std::to_string(d.pp) + " x --cp " +
                      std::to_string(d.cp) + " x --dp " + std::to_string(d.dp) + " = " +
                      std::to_string(model_parallel * d.dp) + " ranks, but " + std::to_string(world) +
                      " were launched: make the degrees multiply to the ranks (or leave --dp out)");
  }
  const int micro_batch = choice.micro_batch;
  r.global_batch = global_batch > 0 ? global_batch : d.dp * micro_batch;
  if (r.global_batch % (d.dp * micro_batch) != 0)
    throw input_error("--global-batch " + std::to_string(r.global_batch) + " is not a multiple of dp " +
                      std::to_string(d.dp) + " x --micro-batch " + std::to_string(micro_batch) +
                      ": every dp rank runs whole micro-batches; pick a global batch divisible by " +
                      std::to_string(d.dp * micro_batch));
  r.micro_batches = r.global_batch / (d.dp * micro_batch);
  if (d.pp > 1 && schedule == "interleaved" && r.micro_batches % d.pp != 0)
    throw input_error("the interleaved schedule runs micro-batches in groups of pp: " + std::to_string(r.micro_batches) +
                      " micro-batches per step (global batch / (dp x micro-batch)) is not a multiple of --pp " +
                      std::to_string(d.pp) + "; change --global-batch or --micro-batch");
  if (choice.recompute_mode != weft::tune::recompute::none && schedule == "zb-h1")
    throw input_error("--recompute " + std::string(weft::tune::to_string(choice.recompute_mode)) +
                      " frees each layer's activations once its gradients are added in backward, but --schedule "
                      "zb-h1 defers the weight gradients, which need them: use another schedule or --recompute none");
  const bool fully_sharded = runs_fully_sharded(choice.sharding_mode);
  if (fully_sharded && d.pp > 1)
    throw input_error("--sharding zero2, zero3 and hsdp run with --pp 1: each micro-batch runs the units (one per "
                      "block, and the embeddings with the final norm as the root) forward in order and backward in "
                      "reverse, which pipeline stages would split; with pipeline parallelism use --sharding zero1");
  if (fully_sharded && schedule != "1f1b")
    throw input_error("--sharding zero2, zero3 and hsdp need --schedule 1f1b (the default): the schedule '" + schedule +
                      "' starts a micro-batch's forward before the previous one's backward ended");
  if (fully_sharded && d.ep > 1 && m.moe_experts > 0)
    throw input_error("--sharding zero2, zero3 and hsdp shard parameters over the dp x cp ranks, which all hold the "
                      "same ones, but with --ep " + std::to_string(d.ep) + " each rank holds only its E / ep experts, "
                      "reduced over the expert data-parallel ranks: use --sharding zero1 (it shards the experts' "
                      "optimizer state over those ranks) or --ep 1");
  if (std::optional<std::string> problem = moe_problem(m, d)) throw input_error(*problem);
  std::vector<std::string> problems = shape_problems(m, choice);
  if (!problems.empty()) {
    std::string text = problems.front();
    for (std::size_t i = 1; i < problems.size(); ++i) text += "; " + problems[i];
    throw input_error(text);
  }
  r.choice = std::move(choice);
  return r;
}

/// The layout the flags ask for.
inline weft::tune::layout_choice layout_from_flags(const options& o) {
  weft::tune::layout_choice c;
  c.parallel = {.tp = o.tp, .cp = o.cp, .pp = o.pp, .dp = o.dp, .virtual_stages = o.vp};
  c.parallel.ep = o.ep;
  c.micro_batch = o.micro_batch;
  c.sequence_parallel = o.sequence_parallel;
  c.sharding_mode = o.sharding;
  c.recompute_mode = o.recompute;
  return c;
}

/// Deterministic initial values, whatever the layout: every whole tensor from (seed, name),
/// GPT-2's scheme (normal 0.02; residual projections 0.02 / sqrt(2 layers); biases 0; norms 1).
inline std::vector<float> initial_whole(const param_spec& p, const gpt_config& m, std::uint64_t seed) {
  const std::size_t n = static_cast<std::size_t>(elements_of(p.whole));
  std::vector<float> out(n, 0.0f);
  switch (p.role) {
    case param_role::ln_1_w: case param_role::ln_2_w: case param_role::ln_f_w:
      std::fill(out.begin(), out.end(), 1.0f);
      return out;
    case param_role::ln_1_b: case param_role::ln_2_b: case param_role::ln_f_b: case param_role::attn_b:
    case param_role::attn_proj_b: case param_role::fc_b: case param_role::mlp_proj_b: case param_role::expert_fc_b:
    case param_role::expert_proj_b:
      return out;
    default: break;
  }
  double std = 0.02;
  if (p.role == param_role::attn_proj_w || p.role == param_role::mlp_proj_w || p.role == param_role::expert_proj_w)
    std /= std::sqrt(2.0 * m.layers);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull;
  for (char ch : p.name) state = (state ^ static_cast<unsigned char>(ch)) * 0x100000001B3ull;
  auto next = [&] {  // splitmix64 -> uniform in (0, 1)
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;
  };
  for (std::size_t i = 0; i < n; i += 2) {  // Box-Muller
    const double r = std::sqrt(-2.0 * std::log(next())), a = 6.283185307179586 * next();
    out[i] = static_cast<float>(std * r * std::cos(a));
    if (i + 1 < n) out[i + 1] = static_cast<float>(std * r * std::sin(a));
  }
  return out;
}

/// This process's peak resident memory.
inline std::int64_t max_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
}

/// The optimizer-state file that goes with a model file.
inline std::string optimizer_path(const std::string& model_path) { return model_path + ".optimizer"; }

/// Where a rank's part of the model is: its coordinates on the run's layout.
inline model_place place_of(const weft::layout::rank_coordinates& at, const weft::layout::layout_spec& d) {
  return {.tp_rank = at.tp, .tp = d.tp, .pp_rank = at.pp, .pp = d.pp, .vp = d.virtual_stages, .ep_rank = at.ep, .ep = d.ep};
}

/// The run's pipeline schedule: --schedule (weft::pipeline's names, checked with the options) over
/// its stages, micro-batches and model chunks.
inline weft::pipeline::schedule run_schedule(const options& o, const run_layout& r, int layers) {
  const std::optional<weft::pipeline::schedule_kind> kind = weft::pipeline::parse_schedule_kind(o.schedule);
  if (!kind) throw std::logic_error("train_gpt: the schedule '" + o.schedule + "' passed the options' check");
  return weft::pipeline::make_schedule({.kind = *kind,
                                        .stages = r.degrees().pp,
                                        .micro_batches = r.micro_batches,
                                        .virtual_stages = r.degrees().virtual_stages,
                                        .layers = layers});
}

/// What every resumed run checks against its checkpoint at `path` (alike on every rank, on the CPU
/// and on GPUs): the data order (seed), a step left to train after `step`, and the global batch
/// (when the checkpoint records it).
inline void check_resume(const options& o, const run_layout& r, const std::string& path, std::int64_t step,
                         std::uint64_t seed, std::optional<std::int64_t> global_batch) {
  if (seed != o.seed)
    throw input_error("the checkpoint was trained with --seed " + std::to_string(seed) + " (its data order), not " +
                      std::to_string(o.seed) + ": resume with --seed " + std::to_string(seed));
  if (step >= o.steps)
    throw input_error("the checkpoint '" + path + "' is at step " + std::to_string(step) + " and --steps " +
                      std::to_string(o.steps) + " counts every step from the start, the checkpoint's included: "
                      "nothing is left to train; give --steps " + std::to_string(step + 1) + " or more to go on");
  // The global batch is part of what a run trains on; its default follows dp, so resuming on
  // another layout would quietly change it. Checkpoints from before it was recorded cannot be checked.
  if (global_batch && *global_batch != r.global_batch && !o.global_batch_given)
    throw input_error("the checkpoint '" + path + "' was trained with a global batch of " + std::to_string(*global_batch) +
                      " sequences per step, but this run's default is " + std::to_string(r.global_batch) +
                      (o.plan ? std::string(" (--plan's: 2 x the ranks)")
                              : " (dp " + std::to_string(r.degrees().dp) + " x micro-batch " +
                                    std::to_string(r.choice.micro_batch) + ")") +
                      ": give --global-batch " + std::to_string(*global_batch) +
                      " to continue the same run, or --global-batch " + std::to_string(r.global_batch) +
                      " to change it on purpose");
}

template <weft::backend B>
class trainer {
  using comm = weft::communicator<B>;
  using clock = std::chrono::steady_clock;

 public:
  /// `predicted_step_s`: the tuner's step time for this layout, reported beside the measured one.
  trainer(comm& world, options o, gpt_config m, run_layout r, const corpus& data,
          std::optional<double> predicted_step_s = std::nullopt)
      : world_(world), o_(std::move(o)), m_(m), r_(r), data_(data), predicted_(predicted_step_s),
        groups_(world, weft::layout::rank_layout(r.degrees())),
        coords_(groups_.coordinates()),
        place_(place_of(coords_, r.degrees())),
        specs_(rank_parameters(m_, place_)),
        model_({.model = m_, .place = place_, .sequence_parallel = r.sequence_parallel(),
                .micro_batch = r.choice.micro_batch, .cp = r.degrees().cp, .recompute = r.choice.recompute_mode,
                .moe = moe_settings_of(o_, m_, r.global_batch)},
               specs_, groups_.tp(), groups_.cp(),
               m_.moe_experts > 0 ? &groups_.get(weft::layout::group_kind::ep) : nullptr),
        trace_(o_.trace.has_value()), index_(m_) {
    own_ = {.tp_rank = coords_.tp,
            .tp = r.degrees().tp,
            .data_leader = coords_.dp == 0 && coords_.cp == 0,
            .expert_leader = coords_.expert_dp == 0 && coords_.expert_tp == 0,
            .expert_tp_rank = coords_.expert_tp};
    for (const param_spec& p : specs_) local_parameters_ += p.local_elements;
    skip_.assign(specs_.size(), false);
    for (int c = 0; c < place_.vp; ++c) chunk_params_.emplace_back();
    for (std::size_t i = 0; i < specs_.size(); ++i) chunk_params_[static_cast<std::size_t>(specs_[i].chunk)].push_back(i);
    if (runs_fully_sharded(r_.choice.sharding_mode)) {
      std::vector<int> nodes;  // HSDP: each world rank's node
      if (o_.hybrid) {
        nodes = node_of_ranks(world_, o_.ranks_per_node,
                              o_.ranks_per_node > 0 ? 0 : weft::resolve_launch_with_mpi().node);
        if (auto problem =
                hybrid_shard_problem(weft::layout::rank_layout(r.degrees()), nodes, node_source(o_.ranks_per_node)))
          throw input_error(*problem);
      }
      fsdp_ = std::make_unique<fully_sharded<B>>(
          groups_.get(weft::layout::group_kind::dp_cp), groups_.tp(), specs_,
          typename fully_sharded<B>::settings{.level = r_.choice.sharding_mode,
                                              .hybrid = o_.hybrid,
                                              .node = o_.hybrid ? nodes[static_cast<std::size_t>(world_.rank())] : 0,
                                              .micro_batches = r_.micro_batches,
                                              .sequence_parallel = r_.sequence_parallel()});
      fsdp_->attach(model_);
      for (std::size_t i = 0; i < specs_.size(); ++i)
        packed_segments_.push_back({i, 0, specs_[i].local_elements, fsdp_->packed_offsets()[i]});
      return;
    }
    for (std::size_t i = 0, offset = 0; i < specs_.size(); offset += specs_[i].local_elements, ++i)
      packed_segments_.push_back({i, 0, specs_[i].local_elements, offset});
    // With ep > 1 the experts are reduced apart, over the expert data-parallel group (the ranks
    // holding the same experts); with ep = 1 that group is the dp x cp group itself. A stage
    // without MoE blocks has no expert part (nor has any rank of its expert-dp group).
    const bool experts_apart = r.degrees().ep > 1;
    part_of_.resize(specs_.size());
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const std::size_t p = experts_apart && specs_[i].expert >= 0 ? 1 : 0;
      if (parts_.size() <= p) parts_.resize(p + 1);
      part_of_[i] = {p, parts_[p].members.size()};
      parts_[p].members.push_back(i);
    }
    for (std::size_t p = 0; p < parts_.size(); ++p) {
      reduced_part& part = parts_[p];
      part.sync = std::make_unique<weft::grad::synchronizer<B, float>>(
          groups_.get(p == 0 ? weft::layout::group_kind::dp_cp : weft::layout::group_kind::expert_dp),
          weft::grad::sync_options{.bucket_bytes = o_.bucket_mb > 0 ? static_cast<std::size_t>(o_.bucket_mb * (1 << 20))
                                                                     : weft::grad::measured_bucket_bytes,
                                   .scale = weft::grad::scaling::sum,
                                   .shard_optimizer_state = o_.zero1,
                                   .overlap = o_.overlap,
                                   .warn_if_not_overlapped = false});
      for (std::size_t i : part.members) part.sync->add_param(specs_[i].name, specs_[i].local_elements);
      part.sync->freeze();
      part.params = std::make_unique<weft::grad::flat_buffer<float>>(part.sync->shared_plan());
    }
    std::vector<std::span<float>> pv, gv;
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      pv.push_back(param_view(i));
      gv.push_back(grad_view(i));
    }
    model_.bind(std::move(pv), std::move(gv));
    for (std::size_t i = 0; i < specs_.size(); ++i)
      skip_[i] = specs_[i].role == param_role::wte && place_.pp > 1 && !place_.first_stage(specs_[i].chunk);
    // Optimizer state: whole local parameters, or this rank's ZeRO-1 shards (the experts' over expert-dp).
    if (o_.zero1) {
      for (const reduced_part& part : parts_)
        for (const weft::grad::shard_segment& s : part.sync->shard_segments())
          opt_segments_.push_back({part.members[s.param], s.param_offset, s.count, opt_size_}), opt_size_ += s.count;
    } else {
      for (std::size_t i = 0; i < specs_.size(); ++i)
        opt_segments_.push_back({i, 0, specs_[i].local_elements, opt_size_}), opt_size_ += specs_[i].local_elements;
    }
    m1_.assign(opt_size_, 0.0f);
    m2_.assign(opt_size_, 0.0f);
  }

  /// Initial weights: from (seed) or from a file's whole tensors.
  void initialize(const std::optional<std::string>& from) {
    if (from) {
      const weft::checkpoint::checkpoint_file f = read_checked(*from);
      load_params(f, *from);
      return;
    }
    std::vector<float> local;
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      const std::vector<float> whole = initial_whole(specs_[i], m_, o_.seed);
      if (!fsdp_) {
        cut_local(specs_[i], place_.tp_rank, place_.tp, whole, param_view(i));
        continue;
      }
      // Every rank of the shard group computes the same values and keeps its shard.
      local.resize(specs_[i].local_elements);
      cut_local(specs_[i], place_.tp_rank, place_.tp, whole, local);
      fsdp_->load_param(i, local);
    }
  }

  /// Continues a checkpoint: a distributed one (a directory: `--save-dir`'s root, then its newest
  /// complete step, or a step directory) or the two files of `--save`.
  void resume(const std::string& path) {
    std::error_code error;
    if (std::filesystem::is_directory(path, error)) return resume_distributed(path);
    const weft::checkpoint::checkpoint_file f = read_checked(path);
    load_params(f, path);
    const std::string opt = optimizer_path(path);
    const weft::checkpoint::checkpoint_file s = read_checked(opt);
    expect_model_tensors(s, opt, index_, "exp_avg.");
    expect_model_tensors(s, opt, index_, "exp_avg_sq.");
    auto number = [&](const char* key) { return optimizer_metadata_number(s, opt, key); };
    step_ = number("step");
    // Checkpoints from before the position was recorded: the sequences of `step` global batches.
    data_sequence_ = s.metadata.count("data_sequence") != 0 ? number("data_sequence") : step_ * r_.global_batch;
    check_resume(o_, r_, path, step_, static_cast<std::uint64_t>(number("seed")),
                 s.metadata.count("global_batch") != 0 ? std::optional(number("global_batch")) : std::nullopt);
    for (const char* prefix : {"exp_avg.", "exp_avg_sq."}) {
      const bool first = std::string(prefix) == "exp_avg.";
      std::vector<float> packed;
      if (fsdp_) packed.resize(fsdp_->packed_elements());
      std::vector<float>& target = fsdp_ ? packed : first ? m1_ : m2_;
      std::map<std::string, std::vector<float>> values;
      scatter_whole(specs_, fsdp_ ? packed_segments_ : opt_segments_, target, place_.tp_rank, place_.tp,
                    [&](const std::string& name) {
                      auto& v = values[name];
                      if (v.empty()) v = weft::checkpoint::values_of<float>(s.at(prefix + name));
                      return std::span<const float>(v);
                    });
      if (fsdp_)
        fsdp_->load_packed(first ? fully_sharded<B>::state::exp_avg : fully_sharded<B>::state::exp_avg_sq, packed);
    }
    if (world_.rank() == 0)
      std::printf("resumed from %s at step %lld\n", path.c_str(), static_cast<long long>(step_));
  }

  int run() {
    const int rank = world_.rank();
    const int per_dp = r_.global_batch / r_.degrees().dp;
    batch_loader loader(
        [&](std::int64_t step) { return data_.sequences(position(step), coords_.dp * per_dp, per_dp, m_.seq); }, step_,
        o_.steps);
    const float loss_scale = 1.0f / static_cast<float>(static_cast<double>(r_.global_batch) * m_.seq);
    const double tokens_per_step = static_cast<double>(r_.global_batch) * m_.seq;

    std::vector<micro_batch_tokens> batches(static_cast<std::size_t>(r_.micro_batches));
    double loss_sum = 0;
    std::vector<int> backward_count(static_cast<std::size_t>(place_.vp), 0);
    double mark_seconds = 0;

    // The timeline: each callback, each tp exchange, and the gaps between callbacks in which the
    // rank waited for the pipeline (the bubble, seen from this rank).
    model_.on_exchange([&](const char* name, clock::time_point a, clock::time_point b) {
      trace_.add(name, "tp exchange", a, b);
    });
    std::optional<clock::time_point> last_end;
    auto waited_until = [&](clock::time_point now) {
      if (last_end && place_.pp > 1) trace_.add("waiting for the pipeline", "pipeline", *last_end, now);
    };
    const bool split_backward = o_.schedule == "zb-h1";  // weight gradients in their own pass
    weft::pipeline::stage_callbacks<float> callbacks;
    callbacks.forward = [&](int mb, int chunk, std::span<const float> input, std::span<float> output) {
      const auto t0 = clock::now();
      waited_until(t0);
      loss_sum += model_.forward(mb, chunk, batches[static_cast<std::size_t>(mb)], input, output, loss_scale);
      last_end = clock::now();
      trace_.add("forward mb " + std::to_string(mb) + " chunk " + std::to_string(chunk), "compute", t0, *last_end);
    };
    callbacks.backward = [&](int mb, int chunk, std::span<const float> output_grad, std::span<float> input_grad) {
      const auto t0 = clock::now();
      waited_until(t0);
      model_.backward(mb, chunk, output_grad, input_grad);
      if (!split_backward) {
        model_.weight(mb, chunk, batches[static_cast<std::size_t>(mb)]);
        ++backward_count[static_cast<std::size_t>(chunk)];
      }
      last_end = clock::now();
      trace_.add("backward mb " + std::to_string(mb) + " chunk " + std::to_string(chunk), "compute", t0, *last_end);
    };
    if (split_backward) {
      callbacks.weight = [&](int mb, int chunk) {
        const auto t0 = clock::now();
        waited_until(t0);
        model_.weight(mb, chunk, batches[static_cast<std::size_t>(mb)]);
        ++backward_count[static_cast<std::size_t>(chunk)];
        last_end = clock::now();
        trace_.add("weight gradients mb " + std::to_string(mb) + " chunk " + std::to_string(chunk), "compute", t0,
                   *last_end);
      };
    }
    // On a chunk's last micro-batch, each group's gradients are final as soon as backward has
    // added them: hand them to the synchronizer then, so their buckets reduce during the rest of
    // backward.
    model_.on_gradients_added([&](int chunk, int group) {
      if (backward_count[static_cast<std::size_t>(chunk)] != r_.micro_batches - 1) return;
      const auto t1 = clock::now();
      gradients_final(chunk, group);
      mark_seconds += std::chrono::duration<double>(clock::now() - t1).count();
      trace_.add("gradients handed to the reduction", "dp reduction", t1, clock::now());
    });
    weft::pipeline::executor<B, float> pipeline(groups_.pp(), run_schedule(o_, r_, m_.layers), callbacks,
                                               {.elements = model_.boundary_elements(), .layers = m_.layers});

    std::ofstream log_json;
    if (o_.log_json && rank == 0) log_json = weft_programs::open_json_output(*o_.log_json);
    // Half the communication deadline: a stalled disk on rank 0 is reported there, naming the
    // file, before the other ranks' next collective gives up on rank 0 (0: neither has one).
    weft::checkpoint::async_writer writer(world_.timeout() / 2);
    std::optional<weft::checkpoint::distributed_saver> saver;
    if (o_.save_dir)
      saver.emplace(rank, world_.size(), weft::checkpoint::exchange_over(world_), *o_.save_dir,
                    weft::checkpoint::save_options{.keep = static_cast<std::size_t>(o_.keep),
                                                   .deadline = world_.timeout() / 2});
    const auto run_start = clock::now();
    double first_loss = 0, last_loss = 0, tokens_total = 0, seconds_total = 0;
    std::vector<double> step_times;

    for (std::int64_t step = step_; step < o_.steps; ++step) {
      const auto t0 = clock::now();
      // This rank's part of each micro-batch: its dp slice, cp chunks, and sequence-parallel rows.
      fill_batches(loader.take(step), batches);
      loss_sum = 0;
      std::fill(backward_count.begin(), backward_count.end(), 0);
      mark_seconds = 0;
      model_.reset_exchange_seconds();

      last_end.reset();
      const weft::pipeline::step_stats stats = pipeline.run();
      // The last stage's copy of the tied embedding: summed with the first stage's, then reduced.
      const auto t_tail = clock::now();
      if (fsdp_) {
        if (!fsdp_->step_ready())
          throw std::logic_error("train_gpt: the step's micro-batches ended without the sharded gradients reduced");
        mark_seconds += fsdp_->take_exposed_seconds();  // waiting for gathers and reductions
      } else {
        for (std::size_t i : chunk_params_[static_cast<std::size_t>(place_.vp - 1)])
          if (skip_[i]) {
            sum_split_gradient(i);
            mark_ready(i);
          }
        for (reduced_part& part : parts_) part.sync->finish();
      }
      const double tail_s = std::chrono::duration<double>(clock::now() - t_tail).count();
      const auto t_dump = clock::now();
      if (o_.dump_grads) dump_gradients(*o_.dump_grads, step);
      const auto t_opt = clock::now();
      double gather_s = optimizer_step(step + 1);
      for (reduced_part& part : parts_) part.sync->zero_grad();
      trace_.add("optimizer", "compute", t_opt, clock::now());
      trace_.add("gradient reduction (exposed)", "dp reduction", t_tail, t_dump);

      // Loss over the global batch: rows are disjoint over dp, cp and (with sequence parallelism)
      // tp; without it every tp rank computed the same rows, so only tp rank 0 counts them. The
      // MoE blocks' aux and z: summed over layers, the mean over the global batch's sequences.
      const auto [aux_sum, z_sum] = model_.take_moe_losses();
      std::array<double, 3> sums{(r_.sequence_parallel() || coords_.tp == 0) ? loss_sum : 0.0, aux_sum, z_sum};
      world_.all_reduce(std::span<double>(sums));
      const double ce_loss = sums[0] / tokens_per_step, aux_loss = sums[1] / r_.global_batch,
                   z_loss = sums[2] / r_.global_batch;
      double loss = ce_loss + o_.moe_aux_loss_coef * aux_loss + o_.moe_z_loss_coef * z_loss;
      const double step_s = std::chrono::duration<double>(clock::now() - t0).count();
      // Exposed communication: blocked in tp/cp exchanges, in marking gradients (the tp and
      // embedding sums), in the dp reduction after backward, in the ZeRO-1 gather; bubble: blocked
      // on pipeline inputs.
      std::array<double, 3> times{model_.exchange_seconds() + mark_seconds + tail_s + gather_s, stats.wait_seconds,
                                  step_s};
      world_.all_reduce(std::span<double>(times), weft::reduce_op::max);
      // The largest resident memory of any rank so far (model, optimizer state, activations, buffers).
      // And the largest training state (parameters, gradients, optimizer state, gathered units).
      std::array<std::int64_t, 3> memory{max_rss_bytes(), static_cast<std::int64_t>(state_bytes()),
                                         static_cast<std::int64_t>(local_parameters_)};
      world_.all_reduce(std::span<std::int64_t>(memory), weft::reduce_op::max);
      const std::int64_t peak_memory = memory[0];
      if (rank == 0 && o_.dump_grads) finish_dump(loss, {{"ce_loss", ce_loss}, {"aux_loss", aux_loss}, {"z_loss", z_loss}});
      std::optional<double> val_loss;
      if (val_ != nullptr && (step + 1 == o_.steps || (step + 1) % o_.val_every == 0)) val_loss = validation_loss();
      if (step == step_) first_loss = loss;
      last_loss = loss;
      step_times.push_back(times[2]);
      tokens_total += tokens_per_step;
      seconds_total += times[2];
      if (rank == 0) {
        const double tps = tokens_per_step / times[2];
        if (!o_.quiet) {
          const double eta = static_cast<double>(o_.steps - step - 1) * (seconds_total / static_cast<double>(step - step_ + 1));
          std::printf("step %lld/%d | loss %.6f | %.0f tokens/s | step %.1f ms | exposed comm %.1f ms | bubble %.1f ms "
                      "| eta %.0f s\n",
                      static_cast<long long>(step + 1), o_.steps, loss, tps, times[2] * 1e3, times[0] * 1e3,
                      times[1] * 1e3, eta);
          std::fflush(stdout);
        }
        if (val_loss) {  // printed with --quiet too: validation is asked for on its own
          std::printf("step %lld/%d | val loss %.6f\n", static_cast<long long>(step + 1), o_.steps, *val_loss);
          std::fflush(stdout);
        }
        if (log_json.is_open()) {
          log_json << "{\"step\": " << step + 1 << ", \"loss\": " << loss << ", \"tokens_per_s\": " << tps
                   << ", \"step_time_s\": " << times[2] << ", \"exposed_comm_s\": " << times[0]
                   << ", \"bubble_s\": " << times[1] << ", \"max_rss_bytes\": " << peak_memory
                   << ", \"training_state_bytes\": " << memory[1] << ", \"max_rank_parameters\": " << memory[2];
          if (predicted_) log_json << ", \"predicted_step_time_s\": " << *predicted_;
          if (val_loss) log_json << ", \"val_loss\": " << *val_loss;
          log_json << "}\n";
          log_json.flush();
        }
      }
      const bool last = step + 1 == o_.steps;
      const bool save_now = last || (o_.save_every > 0 && (step + 1) % o_.save_every == 0);
      if (o_.save && save_now) save(writer, step + 1);
      if (saver && save_now) {
        if (last) saver->wait();  // the last checkpoint is never skipped
        save_distributed(*saver, step + 1);
      }
    }
    writer.wait();
    if (saver) saver->wait();
    if (o_.trace) {
      std::string path = *o_.trace;
      const auto dot = path.rfind('.');
      const std::string suffix = ".rank" + std::to_string(rank);
      path = dot == std::string::npos || path.find('/', dot) != std::string::npos ? path + suffix
                                                                                 : path.substr(0, dot) + suffix + path.substr(dot);
      trace_.write(path, rank);
    }
    if (rank == 0) {
      const double median = median_step_seconds(step_times);
      std::printf("done: %lld steps, loss %.4f -> %.4f, median step %.1f ms, %.0f tokens/s, %.1f s in all "
                  "(tp %d pp %d dp %d cp %d, %d micro-batches of %d)\n",
                  static_cast<long long>(o_.steps - step_), first_loss, last_loss, median * 1e3,
                  median > 0 ? tokens_per_step / median : 0.0,
                  std::chrono::duration<double>(clock::now() - run_start).count(), place_.tp, place_.pp, r_.degrees().dp,
                  r_.degrees().cp, r_.micro_batches, r_.choice.micro_batch);
      if (predicted_)
        std::printf("predicted step %.1f ms (the tuner, from the measured hardware), measured %.1f ms: ratio %.2f\n",
                    *predicted_ * 1e3, median * 1e3, median > 0 ? *predicted_ / median : 0.0);
    }
    return 0;
  }

 private:
  weft::checkpoint::checkpoint_file read_checked(const std::string& path) {
    try {
      return weft::checkpoint::read_safetensors(path);
    } catch (const std::exception& e) {
      throw input_error(std::string(e.what()));
    }
  }

  // ---- distributed checkpoints (--save-dir, --resume DIR) ----------------------------------
  // Each rank saves what it holds of each state (its tp slices of its stage's parameters, or its
  // ZeRO / FSDP shards of them, and of AdamW's moments) as pieces of the whole tensors, and reads
  // back only the pieces of the whole tensors that its own layout holds: no gather, no whole model.

  enum class saved_state { params, exp_avg, exp_avg_sq };
  static constexpr saved_state saved_states[] = {saved_state::params, saved_state::exp_avg, saved_state::exp_avg_sq};
  /// The names of a state's tensors in a checkpoint: GPT-2's, and the optimizer file's for the moments.
  static std::string saved_name(saved_state which, const std::string& name) {
    return which == saved_state::params ? name : which == saved_state::exp_avg ? "exp_avg." + name : "exp_avg_sq." + name;
  }

  /// This rank's runs of a state: whole local parts of the parameters (also with ZeRO-1, whose
  /// parameters are gathered after each step), the ZeRO-1 shard of the moments, or FSDP's shards.
  /// T: const float to save them; float to load into them (FSDP then gathers the units again).
  template <class T>
  std::vector<param_run<T>> held_runs(saved_state which) {
    if (fsdp_) {
      using state = typename fully_sharded<B>::state;
      const state s = which == saved_state::params    ? state::params
                      : which == saved_state::exp_avg ? state::exp_avg
                                                      : state::exp_avg_sq;
      if constexpr (std::is_const_v<T>) return fsdp_->shard_runs(s);
      else return fsdp_->writable_shard_runs(s);
    }
    std::vector<param_run<T>> out;
    if (which == saved_state::params) {
      for (std::size_t i = 0; i < specs_.size(); ++i) out.push_back({i, 0, param_view(i)});
      return out;
    }
    std::vector<float>& moments = which == saved_state::exp_avg ? m1_ : m2_;
    for (const state_segment& seg : opt_segments_)
      out.push_back({seg.param, seg.param_offset, std::span<float>(moments).subspan(seg.state_offset, seg.count)});
    return out;
  }

  /// The model a distributed checkpoint is of: shown by weft-ckpt, checked on resume (the head
  /// count is the one thing the tensors' shapes do not say).
  std::string model_description() const {
    return "train_gpt GPT-2: " + std::to_string(m_.layers) + " layers, hidden " + std::to_string(m_.hidden) + ", " +
           std::to_string(m_.heads) + " heads, vocabulary " + std::to_string(m_.vocab) + ", " +
           std::to_string(m_.positions) + " positions" + moe_description(m_);
  }

  /// Collective: this rank's pieces of step `step`'s state to `saver` (written in the background).
  void save_distributed(weft::checkpoint::distributed_saver& saver, std::int64_t step) {
    namespace ckpt = weft::checkpoint;
    const auto t0 = clock::now();
    std::vector<ckpt::local_piece> pieces;
    std::vector<std::vector<float>> staged;  // boxes whose values are not consecutive here (c_attn's blocks over tp)
    for (saved_state which : saved_states)
      for (const param_run<const float>& run : held_runs<const float>(which)) {
        const param_spec& p = specs_[run.param];
        if (!fsdp_ && skip_[run.param]) continue;  // the last stage's copy of the tied embedding: the first stage's is saved
        // What tp replicates is written by tp rank 0 alone: each tp rank's dp group measures its
        // own bucket cap, so their ZeRO-1 shards of a replicated tensor may cut it differently.
        if (!own_.owns(p, /*sharded=*/true)) continue;
        const std::vector<std::int64_t> shape = local_shape(p, place_.tp);
        const auto begin = static_cast<std::int64_t>(run.param_offset);
        for (const held_box& box : whole_boxes(p, place_.tp_rank, place_.tp, begin, begin + static_cast<std::int64_t>(run.values.size()))) {
          const auto count = static_cast<std::size_t>(ckpt::element_count(box.local));
          std::span<const float> values;
          if (const auto start = contiguous_start(shape, box.local)) {
            values = run.values.subspan(static_cast<std::size_t>(*start - begin), count);
          } else {
            std::vector<float>& copy = staged.emplace_back(count);
            for_each_box_run(shape, box.local, [&](std::int64_t flat, std::int64_t packed, std::int64_t n) {
              std::copy_n(run.values.data() + (flat - begin), n, copy.data() + packed);
            });
            values = copy;
          }
          pieces.push_back(ckpt::piece_of<float>(saved_name(which, p.name), p.whole, box.whole, values));
        }
      }
    const weft::layout::layout_spec& d = r_.degrees();
    const int zero_stage = r_.choice.sharding_mode == weft::tune::sharding::optimizer   ? 1
                           : r_.choice.sharding_mode == weft::tune::sharding::gradients ? 2
                           : r_.choice.sharding_mode == weft::tune::sharding::full      ? 3
                                                                                        : 0;
    const ckpt::checkpoint_info info{
        .step = step,
        .data_position = {{"sequence", position(step).sequence}, {"seed", static_cast<std::int64_t>(o_.seed)}},
        .layout = {{"tp", d.tp}, {"pp", d.pp}, {"dp", d.dp}, {"cp", d.cp}, {"ep", d.ep}, {"vp", d.virtual_stages},
                   {"sequence_parallel", r_.sequence_parallel() ? 1 : 0}, {"zero_stage", zero_stage},
                   {"hsdp", o_.hybrid ? 1 : 0}, {"micro_batch", r_.choice.micro_batch},
                   {"global_batch", r_.global_batch}},
        .model = model_description()};
    const bool saved = saver.save(info, pieces);
    if (!saved && world_.rank() == 0) {
      std::printf("step %lld: no checkpoint written to %s: the previous one is still being written (the training "
                  "thread does not wait for the disk); save less often with a larger --save-every\n",
                  static_cast<long long>(step), saver.root().c_str());
      std::fflush(stdout);
    }
    trace_.add("checkpoint snapshot (distributed)", "checkpoint", t0, clock::now());
  }

  /// Continues from a distributed checkpoint in this run's layout: each rank reads the pieces of
  /// the whole tensors that overlap what it holds. A problem any rank finds (a corrupt or missing
  /// file is found only by the ranks that read it) stops every rank with one message.
  void resume_distributed(const std::string& path) {
    namespace ckpt = weft::checkpoint;
    std::string problem;
    std::string directory;
    try {
      ckpt::distributed_checkpoint checkpoint(path);
      directory = checkpoint.directory().string();
      const ckpt::checkpoint_index& index = checkpoint.index();
      const std::string where = "checkpoint '" + directory + "' (model '" + index.model + "')";
      std::size_t expected = 0;
      for (const param_spec& t : index_.tensors)
        for (saved_state which : saved_states) {
          ++expected;
          const std::string name = saved_name(which, t.name);
          const ckpt::saved_tensor* saved = index.find(name);
          if (saved == nullptr)
            throw input_error(where + " has no tensor '" + name + "' that this model needs: it is a checkpoint of "
                              "another model shape, or without optimizer state; give the flags of the saved model or "
                              "pick another checkpoint");
          if (saved->shape != t.whole || saved->type != weft::dtype::float32)
            throw input_error(where + ": tensor '" + name + "' is " + std::string(ckpt::safetensors_name(saved->type)) + " " +
                              ckpt::detail::shape_text(saved->shape) + " but this model needs F32 " +
                              ckpt::detail::shape_text(t.whole) +
                              ": the flags (--layers --hidden --heads --vocab --positions) do not match the checkpoint; "
                              "give the saved model's, or pick the matching checkpoint");
        }
      if (index.tensors.size() != expected)
        throw input_error(where + " holds " + std::to_string(index.tensors.size()) + " tensors, this model " +
                          std::to_string(expected) + " (its parameters and AdamW's two moments): it is a checkpoint "
                          "of another model; give the flags of the saved model or pick another checkpoint");
      if (index.model != model_description())
        throw input_error(where + " is not this run's model ('" + model_description() +
                          "'); give the saved model's flags (--heads included) or pick another checkpoint");
      auto position_of = [&](const char* key) {
        const auto it = index.data_position.find(key);
        if (it == index.data_position.end())
          throw input_error(where + " has no data position '" + key + "': it was not written by train_gpt --save-dir");
        return it->second;
      };
      step_ = index.step;
      data_sequence_ = position_of("sequence");
      const auto batch = index.layout.find("global_batch");
      check_resume(o_, r_, directory, step_, static_cast<std::uint64_t>(position_of("seed")),
                   batch == index.layout.end() ? std::nullopt : std::optional(batch->second));

      std::vector<float> staged;
      for (saved_state which : saved_states)
        for (const param_run<float>& run : held_runs<float>(which)) {
          const param_spec& p = specs_[run.param];
          const std::vector<std::int64_t> shape = local_shape(p, place_.tp);
          const auto begin = static_cast<std::int64_t>(run.param_offset);
          for (const held_box& box : whole_boxes(p, place_.tp_rank, place_.tp, begin, begin + static_cast<std::int64_t>(run.values.size()))) {
            const auto count = static_cast<std::size_t>(ckpt::element_count(box.local));
            const std::string name = saved_name(which, p.name);
            if (const auto start = contiguous_start(shape, box.local)) {
              checkpoint.read(name, box.whole, std::as_writable_bytes(run.values.subspan(static_cast<std::size_t>(*start - begin), count)));
              continue;
            }
            staged.resize(count);
            checkpoint.read(name, box.whole, std::as_writable_bytes(std::span<float>(staged)));
            for_each_box_run(shape, box.local, [&](std::int64_t flat, std::int64_t packed, std::int64_t n) {
              std::copy_n(staged.data() + packed, n, run.values.data() + (flat - begin));
            });
          }
        }
    } catch (const std::exception& e) {
      problem = e.what();
    }
    // Every rank learns whether any rank failed, and why (the first that did).
    const std::vector<std::string> problems = weft::checkpoint::exchange_over(world_)(problem);
    for (const std::string& p : problems)
      if (!p.empty()) throw input_error(p);
    if (world_.rank() == 0)
      std::printf("resumed from %s at step %lld\n", directory.c_str(), static_cast<long long>(step_));
  }

  void load_params(const weft::checkpoint::checkpoint_file& f, const std::string& path) {
    try {
      expect_model_tensors(f, path, index_);
    } catch (const std::exception& e) {
      throw input_error(e.what());
    }
    std::map<std::string, std::vector<float>> values;
    std::vector<float> packed(packed_elements());
    scatter_whole(specs_, packed_segments_, packed, place_.tp_rank, place_.tp,
                  [&](const std::string& name) {
                    auto& v = values[name];
                    if (v.empty()) v = weft::checkpoint::values_of<float>(f.at(name));
                    return std::span<const float>(v);
                  });
    if (fsdp_) return fsdp_->load_packed(fully_sharded<B>::state::params, packed);
    for (const state_segment& seg : packed_segments_)
      std::copy_n(packed.data() + seg.state_offset, seg.count, param_view(seg.param).data());
  }

  /// Where step `step`'s sequences come from: sampled text by (seed, step); token files by the
  /// sequences taken before it (those before the resumed step, then a global batch a step).
  data_position position(std::int64_t step) const {
    return {o_.seed, step, data_sequence_ + (step - step_) * r_.global_batch};
  }

  /// This rank's rows of each micro-batch from its slice of the step's sequences.
  void fill_batches(const std::vector<std::int32_t>& slice, std::vector<micro_batch_tokens>& batches) const {
    const std::vector<std::int64_t> positions = model_.sequence_positions();
    const auto [row_first, row_count] = model_.row_range();
    const std::size_t seq1 = static_cast<std::size_t>(m_.seq) + 1;
    for (int mb = 0; mb < r_.micro_batches; ++mb) {
      micro_batch_tokens& b = batches[static_cast<std::size_t>(mb)];
      b.tokens.clear(), b.labels.clear(), b.positions.clear(), b.all_tokens.clear(), b.all_labels.clear();
      // Row i of the micro-batch is token positions[i % local] of its sequence i / local.
      const std::size_t local = positions.size();
      for (std::size_t i = 0; i < static_cast<std::size_t>(r_.choice.micro_batch) * local; ++i) {
        const std::int32_t* seq = slice.data() + (static_cast<std::size_t>(mb * r_.choice.micro_batch) + i / local) * seq1;
        const std::int64_t p = positions[i % local];
        b.all_tokens.push_back(seq[p]);
        b.all_labels.push_back(seq[p + 1]);
        if (i < row_first || i >= row_first + row_count) continue;
        b.tokens.push_back(seq[p]);
        b.labels.push_back(seq[p + 1]);
        b.positions.push_back(p);
      }
    }
  }

 public:
  /// Validation data: its loss is computed every --val-every steps and after the last.
  void set_validation(const corpus& val) {
    if (fsdp_)
      throw input_error("--val-data runs forward passes alone, which --sharding zero2, zero3 and hsdp do not run yet "
                        "(--plan chose one here): give the layout yourself with --sharding none or zero1");
    val_ = &val;
  }

 private:
  /// The mean loss over the first --val-steps global batches of the validation data (in order),
  /// with forward passes alone: each micro-batch's chunks run stage after stage, each stage
  /// receiving its input from the one before, so no schedule and no gradient is involved.
  double validation_loss() {
    const int per_dp = r_.global_batch / r_.degrees().dp;
    std::vector<micro_batch_tokens> batches(static_cast<std::size_t>(r_.micro_batches));
    std::vector<float> input(model_.boundary_elements()), output(model_.boundary_elements());
    auto& pp = groups_.pp();
    const int next = (place_.pp_rank + 1) % place_.pp, previous = (place_.pp_rank + place_.pp - 1) % place_.pp;
    double sum = 0;
    for (int v = 0; v < o_.val_steps; ++v) {
      const data_position at{o_.seed, v, static_cast<std::int64_t>(v) * r_.global_batch};
      fill_batches(val_->sequences(at, coords_.dp * per_dp, per_dp, m_.seq), batches);
      for (int mb = 0; mb < r_.micro_batches; ++mb)
        for (int chunk = 0; chunk < place_.vp; ++chunk) {
          const bool first = place_.first_stage(chunk), last = place_.last_stage(chunk);
          if (!first) pp.recv(std::span<float>(input), previous);
          const double rows = model_.forward(mb, chunk, batches[static_cast<std::size_t>(mb)],
                                             first ? std::span<const float>() : std::span<const float>(input),
                                             last ? std::span<float>() : std::span<float>(output), 1.0f,
                                             /*with_gradients=*/false);
          model_.discard(mb, chunk);
          if (!last) pp.send(std::span<const float>(output), next);
          if (r_.sequence_parallel() || coords_.tp == 0) sum += rows;
        }
    }
    world_.all_reduce(std::span<double>(&sum, 1));
    return sum / (static_cast<double>(o_.val_steps) * r_.global_batch * m_.seq);
  }

  /// A group's gradients are complete (its chunk's last micro-batch): sum what tp or the
  /// embedding group split, then let the synchronizer reduce them (in reverse registration order).
  void gradients_final(int chunk, int group) {
    const auto& list = chunk_params_[static_cast<std::size_t>(chunk)];
    for (auto it = list.rbegin(); it != list.rend(); ++it) {
      const std::size_t i = *it;
      if (skip_[i] || group_of(specs_[i]) != group) continue;  // skip_: the last stage's embedding copy, after the step
      sum_split_gradient(i);
      mark_ready(i);
    }
  }

  /// The backward group (model.hpp) a parameter's gradient is final with.
  int group_of(const param_spec& p) const {
    if (p.layer >= 0) return p.layer;
    if (p.role == param_role::ln_f_w || p.role == param_role::ln_f_b) return gpt_model<B>::head_group;
    return gpt_model<B>::embedding_group;  // wte (input side; with pp = 1 also the output side), wpe
  }

  /// Sums the parts of parameter i's gradient that other ranks of the same replica computed:
  /// over tp for what tp replicates when sequence parallelism split the tokens, and over the
  /// first and last stages for the tied embedding.
  void sum_split_gradient(std::size_t i) {
    if (r_.sequence_parallel() && specs_[i].split == tp_split::replicated && !moe_param(specs_[i]))
      groups_.tp().all_reduce(grad_view(i));
    if (specs_[i].role == param_role::wte && place_.pp > 1)
      groups_.get(weft::layout::group_kind::embedding).all_reduce(grad_view(i));
  }

  /// AdamW on every local parameter, or on the ZeRO-1 shard and then the gather. Returns the
  /// seconds of the gather.
  double optimizer_step(std::int64_t step) {
    cpu_kernels::adamw_settings s{.lr = static_cast<float>(learning_rate(step)),
                                  .beta1 = static_cast<float>(o_.beta1),
                                  .beta2 = static_cast<float>(o_.beta2),
                                  .eps = static_cast<float>(o_.eps),
                                  .weight_decay = static_cast<float>(o_.weight_decay)};
    if (fsdp_) {
      fsdp_->step(s, step);
      return 0;
    }
    for (const state_segment& seg : opt_segments_) {
      float* p = param_view(seg.param).data() + seg.param_offset;
      const float* g = grad_view(seg.param).data() + seg.param_offset;
      cpu_kernels::adamw(p, g, m1_.data() + seg.state_offset, m2_.data() + seg.state_offset, seg.count, step, s,
                         specs_[seg.param].decay);
    }
    if (!o_.zero1) return 0;
    const auto t0 = clock::now();
    for (reduced_part& part : parts_) part.sync->gather_params(*part.params);
    trace_.add("ZeRO-1 parameter gather", "dp reduction", t0, clock::now());
    return std::chrono::duration<double>(clock::now() - t0).count();
  }

  /// The most bytes of training state this rank has held: parameters, gradients and optimizer
  /// state (and, fully sharded, the gathered units and gradient buffers in flight).
  std::size_t state_bytes() const {
    if (fsdp_) return fsdp_->peak_state_bytes();
    std::size_t elements = m1_.size() + m2_.size();
    for (const reduced_part& part : parts_) elements += part.params->all().size() + part.sync->grads().all().size();
    return elements * sizeof(float);
  }

  double learning_rate(std::int64_t step) const {
    if (o_.warmup > 0 && step <= o_.warmup) return o_.lr * static_cast<double>(step) / o_.warmup;
    return o_.lr;
  }

  std::vector<float> gather(std::span<const state_segment> segments, std::span<const float> state, bool sharded) {
    return gather_whole(world_, index_, specs_, segments, state, own_, sharded, skip_);
  }

  /// The local parts of every parameter, one after another in rank_parameters order (at
  /// packed_segments_), from `view(i)`: whole-file checkpoints and dumps gather from this copy.
  template <class View>
  std::vector<float> packed_copy(View&& view) const {
    std::vector<float> out(packed_elements());
    for (const state_segment& seg : packed_segments_) {
      const std::span<const float> values = view(seg.param);
      std::copy(values.begin(), values.end(), out.begin() + static_cast<std::ptrdiff_t>(seg.state_offset));
    }
    return out;
  }
  std::size_t packed_elements() const noexcept {
    return packed_segments_.empty() ? 0 : packed_segments_.back().state_offset + packed_segments_.back().count;
  }

  // ---- the synchronizers' parameters (none and ZeRO-1) ------------------------------------
  std::span<float> param_view(std::size_t i) const {
    const auto [p, j] = part_of_[i];
    return parts_[p].params->view(j);
  }
  std::span<float> grad_view(std::size_t i) const {
    const auto [p, j] = part_of_[i];
    return parts_[p].sync->grad(j);
  }
  void mark_ready(std::size_t i) {
    const auto [p, j] = part_of_[i];
    parts_[p].sync->mark_ready(j);
  }

  void save(weft::checkpoint::async_writer& writer, std::int64_t step) {
    const auto t0 = clock::now();
    std::vector<float> params, m1, m2;
    if (fsdp_) {  // the shards gathered into the rank's whole local parts, then assembled as below
      using state = typename fully_sharded<B>::state;
      params = gather(packed_segments_, fsdp_->packed(state::params), false);
      m1 = gather(packed_segments_, fsdp_->packed(state::exp_avg), false);
      m2 = gather(packed_segments_, fsdp_->packed(state::exp_avg_sq), false);
    } else {
      params = gather(packed_segments_, packed_copy([&](std::size_t i) { return param_view(i); }), false);
      m1 = gather(opt_segments_, m1_, o_.zero1);
      m2 = gather(opt_segments_, m2_, o_.zero1);
    }
    if (world_.rank() == 0) {
      weft::checkpoint::checkpoint_file model{config_metadata(m_), whole_records(index_, params)};
      weft::checkpoint::checkpoint_file state;
      state.metadata = {{"step", std::to_string(step)},
                        {"seed", std::to_string(o_.seed)},
                        {"global_batch", std::to_string(r_.global_batch)},
                        {"data_position", data_.sampled() ? "step " + std::to_string(step) + " of the (seed, step) sampler"
                                                          : "sequence " + std::to_string(position(step).sequence) +
                                                                " of the token stream"},
                        {"data_sequence", std::to_string(position(step).sequence)},
                        {"layout", "tp " + std::to_string(place_.tp) + " pp " + std::to_string(place_.pp) + " dp " +
                                       std::to_string(r_.degrees().dp) + " cp " + std::to_string(r_.degrees().cp) +
                                       " ep " + std::to_string(r_.degrees().ep)}};
      for (auto& r : whole_records(index_, m1, "exp_avg.")) state.tensors.push_back(std::move(r));
      for (auto& r : whole_records(index_, m2, "exp_avg_sq.")) state.tensors.push_back(std::move(r));
      // One submission, so this thread waits for no disk write (only for a previous save still
      // being written); the model file is renamed into place last, and not at all if its state
      // failed: a model file is never newer than its state.
      std::vector<weft::checkpoint::write_request> files;
      files.push_back({optimizer_path(*o_.save), std::move(state)});
      files.push_back({*o_.save, std::move(model)});
      const auto t_submit = clock::now();
      writer.submit(std::move(files));
      trace_.add("checkpoint submit", "checkpoint", t_submit, clock::now());
    }
    trace_.add("checkpoint snapshot", "checkpoint", t0, clock::now());
  }

  void dump_gradients(const std::string& path, std::int64_t step) {
    std::vector<float> grads;
    if (fsdp_) {
      grads = gather(packed_segments_, fsdp_->packed(fully_sharded<B>::state::grads), false);
    } else {
      const std::vector<float> packed = packed_copy([&](std::size_t i) { return grad_view(i); });
      if (!o_.zero1) {
        grads = gather(packed_segments_, packed, false);
      } else {  // the reduced gradients are each rank's ZeRO-1 shards
        std::vector<state_segment> segs;
        for (const reduced_part& part : parts_)
          for (const weft::grad::shard_segment& s : part.sync->shard_segments()) {
            const std::size_t i = part.members[s.param];
            segs.push_back({i, s.param_offset, s.count, packed_segments_[i].state_offset + s.param_offset});
          }
        grads = gather(segs, packed, true);
      }
    }
    if (world_.rank() != 0) return;
    // The whole global batch, as every rank's sampler gives it.
    const std::vector<std::int32_t> all = data_.sequences(position(step), 0, r_.global_batch, m_.seq);
    std::vector<std::int64_t> ids, labels;
    for (int s = 0; s < r_.global_batch; ++s)
      for (int t = 0; t < m_.seq; ++t) {
        ids.push_back(all[static_cast<std::size_t>(s) * (m_.seq + 1) + t]);
        labels.push_back(all[static_cast<std::size_t>(s) * (m_.seq + 1) + t + 1]);
      }
    weft::checkpoint::checkpoint_file f{config_metadata(m_), whole_records(index_, grads)};
    f.tensors.push_back(weft::checkpoint::make_record<std::int64_t>("input_ids", {r_.global_batch, m_.seq}, ids));
    f.tensors.push_back(weft::checkpoint::make_record<std::int64_t>("labels", {r_.global_batch, m_.seq}, labels));
    dump_pending_ = std::move(f);
    dump_path_ = path;
  }

 public:
  /// Writes the gradient dump (rank 0) once the step's loss is known.
  /// `parts`: the loss's parts (an MoE model's ce_loss, aux_loss, z_loss), dumped beside it.
  void finish_dump(double loss, const std::vector<std::pair<std::string, double>>& parts = {}) {
    if (!dump_pending_) return;
    const float l = static_cast<float>(loss);
    dump_pending_->tensors.push_back(weft::checkpoint::make_record<float>("loss", {}, std::span<const float>(&l, 1)));
    for (const auto& [name, value] : m_.moe_experts > 0 ? parts : std::vector<std::pair<std::string, double>>{}) {
      const float v = static_cast<float>(value);
      dump_pending_->tensors.push_back(weft::checkpoint::make_record<float>(name, {}, std::span<const float>(&v, 1)));
    }
    weft::checkpoint::write_safetensors(dump_path_, *dump_pending_);
    dump_pending_.reset();
  }

 private:
  comm& world_;
  options o_;
  gpt_config m_;
  run_layout r_;
  const corpus& data_;
  std::optional<double> predicted_;
  weft::process_groups<B> groups_;
  weft::layout::rank_coordinates coords_;
  model_place place_;
  std::vector<param_spec> specs_;
  gpt_model<B> model_;
  /// The parameters one synchronizer reduces (none and ZeRO-1), with their flat buffer: the
  /// dense ones over dp x cp and, with ep > 1, the experts over expert-dp.
  struct reduced_part {
    std::unique_ptr<weft::grad::synchronizer<B, float>> sync;
    std::unique_ptr<weft::grad::flat_buffer<float>> params;
    std::vector<std::size_t> members;  // the rank_parameters index of each registered parameter
  };
  std::vector<reduced_part> parts_;
  std::vector<std::pair<std::size_t, std::size_t>> part_of_;  // parameter -> (part, index in it)
  std::unique_ptr<fully_sharded<B>> fsdp_;                    // ZeRO-2, ZeRO-3, HSDP
  std::vector<state_segment> packed_segments_;                // the packed local parts (packed_copy)
  timeline trace_;
  whole_index index_;
  std::vector<bool> skip_;
  std::vector<state_segment> opt_segments_;
  std::size_t opt_size_ = 0;
  std::vector<float> m1_, m2_;
  ownership own_;
  std::size_t local_parameters_ = 0;  // elements of this rank's parameters (its tp, pp and ep part)
  std::vector<std::vector<std::size_t>> chunk_params_;
  std::int64_t step_ = 0;
  std::int64_t data_sequence_ = 0;  // sequences of the token stream taken before step_
  const corpus* val_ = nullptr;
  std::optional<weft::checkpoint::checkpoint_file> dump_pending_;
  std::string dump_path_;
};

}  // namespace train_gpt
