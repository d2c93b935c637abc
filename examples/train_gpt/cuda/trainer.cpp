// train_on_cuda (device.hpp): GPT-2 trained on GPUs, one per rank, in fp32 or bf16 (bf16 products
// on fp32 master weights, one_gpu_model in gpu_model.hpp), data, tensor, context and pipeline
// parallel over NCCL, with ZeRO-1 (the synchronizer) or ZeRO-2, ZeRO-3 and HSDP (sharded_units.hpp).
// Each rank's model calls the operations of kernels.hpp in the order model.hpp calls cpu_kernels'
// (with tp, Megatron's column- and row-parallel layers, the vocabulary-parallel embedding and
// loss, each sum over tp an all-reduce on the compute stream; with cp, weft::cp::ring_attention
// around the attention kernel, ring_kernel.hpp; with pp, weft::pipeline's executor calling each
// stage's forward and backward per micro-batch, and under zb-h1 the layers' weight gradients
// apart), so the first step's loss and gradients are the
// CPU trainer's to rounding
// (tests/train_gpt/device_check.py compares them); weft's gradient synchronizer sums the
// gradients over the dp ranks (NCCL, device buffers) as it does for the CPU trainer over MPI.
//
// Everything a step computes stays on the device and is enqueued on one compute stream; the host
// waits once a step, for the losses. Parameters and AdamW's moments are one flat array each, in
// rank_parameters order, and the gradients the synchronizer's buffer (with units: each unit's
// shards and buffers). Every layer's activations
// are kept from forward to backward (no recomputation) and allocated once, for the run's
// micro-batch. --save and --resume write and read the CPU trainer's files (whole fp32 tensors and
// AdamW's moments), and since every kernel is deterministic a resumed run continues bit for bit.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <weft/backend/cuda/check.hpp>
#include <weft/backend/nccl/backend.hpp>
#include <weft/checkpoint/safetensors.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/cp/causal_split.hpp>
#include <weft/cp/ring_attention.hpp>
#include <weft/grad/synchronizer.hpp>
#include <weft/launch/nccl_bootstrap.hpp>
#include <weft/layout/process_groups.hpp>
#include <weft/pipeline/activation_slots.hpp>
#include <weft/pipeline/executor.hpp>
#include <weft/pipeline/schedules.hpp>

#include "checkpoint_io.hpp"
#include "device.hpp"
#include "gpu_model.hpp"
#include "kernels.hpp"
#include "options.hpp"
#include "parameters.hpp"
#include "ring_kernel.hpp"
#include "sharded_units.hpp"
#include "trainer.hpp"

namespace train_gpt {

namespace {

using cuda::checkpoint_state;
using cuda::device_alloc;
using cuda::device_ptr;
using cuda::model_storage;
using cuda::nccl_comm;
using cuda::one_gpu_model;

struct stream_deleter {
  void operator()(cudaStream_t s) const noexcept { cudaStreamDestroy(s); }
};

/// A checkpoint's states as whole tensors in checkpoint order, and the writing back of each from
/// whole tensors by name: the model's buffers, or with units the shards (see train()).
using whole_state_of = std::function<std::vector<float>(checkpoint_state)>;
using whole_lookup = std::function<std::span<const float>(const std::string&)>;
using load_state_of = std::function<void(checkpoint_state, const whole_lookup&)>;

/// The checkpoint files of --save (the CPU trainer's: whole tensors, the optimizer state beside
/// them with the step and the data position), from rank 0; the states are copied off the GPU
/// after the step's last kernel, so the file holds exactly what the next step starts from.
inline void save_checkpoint(const whole_state_of& whole, const options& o, const gpt_config& m, const run_layout& r,
                            const whole_index& index, const corpus& data, std::int64_t step, std::int64_t sequence,
                            bool writer) {
  using state = checkpoint_state;
  // Collective (over tp x pp, and with units over dp x cp); the writer alone writes.
  std::vector<float> params = whole(state::params);
  std::vector<float> exp_avg = whole(state::exp_avg);
  std::vector<float> exp_avg_sq = whole(state::exp_avg_sq);
  if (!writer) return;
  weft::checkpoint::checkpoint_file weights{config_metadata(m), whole_records(index, params)};
  weft::checkpoint::checkpoint_file optimizer;
  optimizer.metadata = {{"step", std::to_string(step)},
                        {"seed", std::to_string(o.seed)},
                        {"global_batch", std::to_string(r.global_batch)},
                        {"data_position", data.sampled() ? "step " + std::to_string(step) + " of the (seed, step) sampler"
                                                         : "sequence " + std::to_string(sequence) + " of the token stream"},
                        {"data_sequence", std::to_string(sequence)},
                        {"layout", "tp " + std::to_string(r.degrees().tp) + " pp " + std::to_string(r.degrees().pp) +
                                       " dp " + std::to_string(r.degrees().dp) + " cp " + std::to_string(r.degrees().cp)},
                        {"precision", o.precision == precision_kind::bf16 ? "bf16" : "fp32"}};
  for (auto& record : whole_records(index, exp_avg, "exp_avg.")) optimizer.tensors.push_back(std::move(record));
  for (auto& record : whole_records(index, exp_avg_sq, "exp_avg_sq.")) optimizer.tensors.push_back(std::move(record));
  // The state first and the model last, as the CPU trainer writes them: a model file is never
  // newer than its state.
  weft::checkpoint::write_safetensors(optimizer_path(*o.save), optimizer);
  weft::checkpoint::write_safetensors(*o.save, weights);
}

/// --resume FILE: the weights, both AdamW moments and the step and data position, checked as the
/// CPU trainer checks them (every rank reads the files alike, so every rank fails alike). Returns
/// the step to continue from and the data sequence it starts at.
inline std::pair<std::int64_t, std::int64_t> resume_checkpoint(const load_state_of& load, const options& o,
                                                               const run_layout& r, const whole_index& index) {
  using weft_programs::input_error;
  using state = checkpoint_state;
  const std::string& path = *o.resume;
  std::error_code error;
  if (std::filesystem::is_directory(path, error))
    throw input_error("--resume " + path + " is a folder of distributed checkpoints (--save-dir), which the trainer on "
                      "the GPU does not read: resume from a --save file, or use --device cpu");
  const std::string opt = optimizer_path(path);
  weft::checkpoint::checkpoint_file weights, optimizer;
  try {
    weights = weft::checkpoint::read_safetensors(path);
    optimizer = weft::checkpoint::read_safetensors(opt);
    expect_model_tensors(weights, path, index);
    expect_model_tensors(optimizer, opt, index, "exp_avg.");
    expect_model_tensors(optimizer, opt, index, "exp_avg_sq.");
  } catch (const std::exception& e) {
    throw input_error(e.what());
  }
  auto number = [&](const char* key) { return optimizer_metadata_number(optimizer, opt, key); };
  const std::int64_t step = number("step");
  const std::int64_t sequence = optimizer.metadata.count("data_sequence") != 0 ? number("data_sequence")
                                                                               : step * r.global_batch;
  check_resume(o, r, path, step, static_cast<std::uint64_t>(number("seed")),
               optimizer.metadata.count("global_batch") != 0 ? std::optional(number("global_batch")) : std::nullopt);
  for (const auto& [which, file, prefix] :
       {std::tuple{state::params, &weights, ""}, std::tuple{state::exp_avg, &optimizer, "exp_avg."},
        std::tuple{state::exp_avg_sq, &optimizer, "exp_avg_sq."}}) {
    std::map<std::string, std::vector<float>> values;
    load(which, [&, f = file, p = std::string(prefix)](const std::string& name) {
      auto& v = values[name];
      if (v.empty()) v = weft::checkpoint::values_of<float>(f->at(p + name));
      return std::span<const float>(v);
    });
  }
  return {step, sequence};
}

/// The run in precision `T` (float: fp32; cuda::bf16: bf16 products on fp32 master weights).
template <class T>
int train(const options& o, const gpt_config& m, const run_layout& r, const corpus& data) {
  using clock = std::chrono::steady_clock;
  constexpr const char* precision = std::is_same_v<T, cuda::bf16> ? "bf16" : "fp32";
  cudaStream_t raw = nullptr;
  // Every rank over NCCL (each rank's GPU chosen by its local rank; the unique id sent over MPI),
  // split into the layout's groups (Megatron's rank order, as the CPU trainer's).
  nccl_comm world = weft::nccl_world();
  if (o.comm_timeout) world.set_timeout(*o.comm_timeout);
  const int rank = world.rank();
  // The compute stream (on the GPU nccl_world selected) outlives the groups, whose tp, cp, pp,
  // tp x pp and embedding communicators enqueue on it.
  WEFT_CHECK_CUDA(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  const std::unique_ptr<CUstream_st, stream_deleter> stream(raw);
  weft::process_groups<weft::nccl_backend> groups(world, weft::layout::rank_layout(r.degrees()));
  nccl_comm& dp = groups.get(weft::layout::group_kind::dp_cp);
  nccl_comm& tp = groups.tp();
  nccl_comm& cp = groups.get(weft::layout::group_kind::cp);
  nccl_comm& pp = groups.pp();
  nccl_comm& model_group = groups.get(weft::layout::group_kind::tp_pp);
  nccl_comm* embedding =
      groups.has(weft::layout::group_kind::embedding) ? &groups.get(weft::layout::group_kind::embedding) : nullptr;
  const weft::layout::rank_coordinates coords = groups.coordinates();
  const weft::layout::layout_spec& d = r.degrees();
  const model_place place = place_of(coords, d);
  // The sums over tp sit between kernels of one micro-batch, and so do the pipeline's transfers
  // between stages and the tied embedding's sum: each on the compute stream itself, ordered with
  // the kernels that make and use their data. The ring's transfers over cp keep the cp
  // communicator's own stream, ordered by the ring's kernel with events (ring_kernel.hpp), so the
  // next key/value block travels while this one is attended.
  for (nccl_comm* c : {&tp, &pp, &model_group, embedding})
    if (c != nullptr && c->size() > 1) c->native().use_stream(stream.get());
  // bf16: attention on the tensor cores too (fp32 keeps the CUDA cores' kernels, whose results agree
  // with the CPU trainer's to rounding).
  cuda::kernels k(stream.get(), cuda::gemm_math::fp32,
                  std::is_same_v<T, cuda::bf16> ? cuda::attention_math::tensor_cores_bf16 : cuda::attention_math::fp32);
  // The gradients: the synchronizer's device buffer (fp32 in both precisions, so they are reduced
  // in fp32), added over the step's micro-batches and summed over dp x cp once after the last (the
  // loss is already divided by the global batch's tokens), as the CPU trainer's. With ZeRO-1
  // (--zero1) it reduce-scatters them instead, each rank's AdamW updates its shard, and the shards
  // are gathered after the step. With ZeRO-2, ZeRO-3 and HSDP (--sharding) the parameters are the
  // units of sharded_units.hpp over dp x cp instead (the CPU trainer's units): gathered per unit
  // as the model opens its scopes, each unit's gradients reduce-scattered in fp32 as its backward
  // ends, and AdamW on this rank's shards, its moments in device memory laid out like them.
  using synchronizer = weft::grad::synchronizer<weft::nccl_backend, float>;
  const std::vector<param_spec> specs = rank_parameters(m, place);
  const bool fully_sharded = runs_fully_sharded(r.choice.sharding_mode);
  std::optional<synchronizer> sync;
  std::optional<synchronizer::buffer_type> params;
  std::optional<sharded_units<weft::nccl_backend>> units;
  std::vector<device_ptr<float>> unit_m1, unit_m2;  // AdamW's moments of each unit's shard
  one_gpu_model<T>* bound = nullptr;                 // the model the units bind (made below)
  model_storage storage;
  if (fully_sharded) {
    int node = 0;
    if (o.hybrid) {
      // HSDP's nodes, world rank by world rank (as the CPU trainer finds them): blocks of
      // --ranks-per-node ranks, or the launcher's nodes; checked before any group is split.
      const std::vector<int> nodes = node_of_ranks(
          world, o.ranks_per_node, o.ranks_per_node > 0 ? 0 : weft::resolve_launch_with_mpi().node);
      if (auto problem = hybrid_shard_problem(weft::layout::rank_layout(d), nodes, node_source(o.ranks_per_node)))
        throw weft_programs::input_error(*problem);
      node = nodes[static_cast<std::size_t>(rank)];
    }
    units.emplace(dp, tp, specs,
                  sharded_units<weft::nccl_backend>::settings{.level = r.choice.sharding_mode,
                                                              .hybrid = o.hybrid,
                                                              .node = node,
                                                              .micro_batches = r.micro_batches,
                                                              .sequence_parallel = r.sequence_parallel()},
                  [&](std::size_t u, bool backward) {
                    for (std::size_t j = 0; j < units->unit(u).size(); ++j) {
                      bound->bind_param(units->unit(u)[j], units->model().param(u, j));
                      if (backward) bound->bind_grad(units->unit(u)[j], units->model().grad(u, j));
                    }
                  });
    units->model().set_compute_stream(stream.get());
    units->model().freeze();
    for (std::size_t u = 0; u < units->unit_count(); ++u) {
      const std::size_t n_shard = units->model().shard_params_view(u).size();
      for (auto* moments : {&unit_m1, &unit_m2}) {
        moments->push_back(device_alloc<float>(n_shard));
        WEFT_CHECK_CUDA(cudaMemsetAsync(moments->back().get(), 0, n_shard * sizeof(float), stream.get()));
      }
    }
    storage.units = true;
    storage.params_total = units->packed_elements();
    storage.offset.assign(units->packed_offsets().begin(), units->packed_offsets().end());
    storage.param.assign(specs.size(), nullptr);
    storage.grad.assign(specs.size(), nullptr);
  } else {
    sync.emplace(dp, weft::grad::sync_options{.bucket_bytes = o.bucket_mb > 0
                                                                  ? static_cast<std::size_t>(o.bucket_mb * (1 << 20))
                                                                  : std::size_t{25} << 20,
                                              .accumulation_steps = 1,
                                              .scale = weft::grad::scaling::sum,
                                              .shard_optimizer_state = o.zero1,
                                              .warn_if_not_overlapped = false});
    sync->set_compute_stream(stream.get());
    for (const param_spec& p : specs) sync->add_param(p.name, p.local_elements);
    sync->freeze();
    // The parameters in a device buffer laid out by the same plan (what gather_params fills).
    params.emplace(sync->shared_plan(), dp.native().device());
    storage.params = params->all().data();
    storage.params_total = params->all().size();
    storage.sharded = o.zero1;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      storage.param.push_back(params->view(i).data());
      storage.grad.push_back(sync->grad(i).data());
      storage.offset.push_back(static_cast<std::size_t>(storage.param[i] - storage.params));
    }
    if (o.zero1) {
      std::size_t at = 0;
      for (const weft::grad::shard_segment& s : sync->shard_segments())
        storage.optimizer.push_back({s.param, s.param_offset, s.count, at}), at += s.count;
    } else {
      for (std::size_t i = 0; i < specs.size(); ++i)
        storage.optimizer.push_back({i, 0, specs[i].local_elements, storage.offset[i]});
    }
  }
  // With pp, the schedule (every stage's list of forwards, backwards and, under zb-h1, weight
  // passes) and the activation slots a stage needs: each chunk's micro-batch mb in slot
  // mb % slots, held from its forward until its backward (its weight pass under zb-h1).
  std::optional<weft::pipeline::schedule> table;
  std::size_t slots = 1;
  bool split_backward = false;
  if (d.pp > 1) {
    table = run_schedule(o, r, m.layers);
    slots = static_cast<std::size_t>(weft::pipeline::slots_by_micro_batch(*table, coords.pp));
    split_backward = table->split_backward;
  }
  one_gpu_model<T> model(m, r.choice.micro_batch, k, std::move(storage), place,
                         {.tp = &tp,
                          .sequence_parallel = r.sequence_parallel(),
                          .cp = &cp,
                          .embedding = embedding,
                          .model = &model_group},
                         slots, split_backward, r.choice.recompute_mode);
  if (units) {
    bound = &model;
    model.on_scope([&](int group, scope_event e) {
      units->on_scope(group, e, [&](std::size_t i, std::span<float> g) { model.sum_gradient_over_tp(i, g); });
    });
  }
  const whole_index index(m);
  // A checkpoint's states: whole tensors from the model's buffers (collective over tp x pp), or
  // with units from the shards (gathered over dp x cp by every rank, then as the buffers' by
  // rank 0's tp x pp group); read back into the buffers, or cut into the shards.
  const bool gathers = coords.dp == 0 && coords.cp == 0;
  auto unit_state = [&](checkpoint_state which, std::size_t u) {
    const std::size_t count = units->model().shard_params_view(u).size();
    return which == checkpoint_state::params    ? units->model().shard_params(u)
           : which == checkpoint_state::exp_avg ? std::span<float>(unit_m1[u].get(), count)
                                                : std::span<float>(unit_m2[u].get(), count);
  };
  // ZeRO-1: each rank holds its shard of the moments (and, after the step's reduce-scatter, of the
  // reduced gradients) at the synchronizer's shard segments: placed into a buffer laid out by its
  // plan and gathered over dp as the parameters are (collective over dp), then made whole as
  // without ZeRO-1.
  auto whole_of_shards = [&](const std::function<void(float*)>& place_shard) {
    synchronizer::buffer_type full(sync->shared_plan(), dp.native().device());
    place_shard(full.all().data());
    sync->gather_params(full);
    return model.whole_from_device(index, full.all().data());
  };
  const whole_state_of whole_state = [&](checkpoint_state which) -> std::vector<float> {
    if (!units && o.zero1 && which != checkpoint_state::params)
      return whole_of_shards([&](float* full) { model.place_moment_shard(which, full); });
    if (!units) return model.whole_state(index, which);
    const std::vector<float> packed = units->packed([&](std::size_t u) {
      if (which == checkpoint_state::params) return units->model().shard_params_view(u);
      return std::span<const float>(unit_state(which, u));
    });
    return gathers ? model.whole_from_local(index, packed) : std::vector<float>{};
  };
  const load_state_of load_state = [&](checkpoint_state which, const whole_lookup& lookup) {
    if (!units) return model.load_whole_state(which, lookup);
    units->load_packed(model.local_of_whole(lookup), [&](std::size_t u) { return unit_state(which, u); });
  };
  // Where the run starts: step 0 and the first sequence, or the checkpoint's step and position.
  std::int64_t first_step = 0, first_sequence = 0;
  if (o.resume) {
    std::tie(first_step, first_sequence) = resume_checkpoint(load_state, o, r, index);
    if (rank == 0) std::printf("resumed from %s at step %lld\n", o.resume->c_str(), static_cast<long long>(first_step));
  } else if (units) {
    const std::vector<float> initial = model.initial_values(o.seed);
    for (std::size_t i = 0; i < specs.size(); ++i)
      units->load_param(i, std::span<const float>(initial).subspan(units->packed_offsets()[i], specs[i].local_elements));
  } else {
    model.initialize(o.seed);
  }
  auto position = [&](std::int64_t step) {
    return data_position{o.seed, step, first_sequence + (step - first_step) * r.global_batch};
  };

  const std::size_t n = model.micro_batch_rows(), seq1 = static_cast<std::size_t>(m.seq) + 1;
  const std::vector<std::int64_t> own_positions = model.sequence_positions();
  const int per_dp = r.global_batch / r.degrees().dp;
  const float loss_scale = 1.0f / static_cast<float>(static_cast<double>(r.global_batch) * m.seq);
  const double tokens_per_step = static_cast<double>(r.global_batch) * m.seq;
  const device_ptr<double> row_losses = device_alloc<double>(static_cast<std::size_t>(r.micro_batches) * n);
  const device_ptr<double> loss_sum = device_alloc<double>(1);
  std::vector<double> host_losses(static_cast<std::size_t>(r.micro_batches) * n);
  std::vector<std::vector<std::int32_t>> tokens(static_cast<std::size_t>(r.micro_batches), std::vector<std::int32_t>(n)),
      labels = tokens;
  // The loss is the last stage's, the same on its tp ranks: counted once, by tp rank 0 there.
  const bool counts_loss = place.last_stage(place.vp - 1) && coords.tp == 0;
  // The pipeline: the boundary tensors in device memory of the products' type, transfers on the
  // compute stream; each (micro-batch, chunk) runs in the schedule's order.
  using boundary = std::conditional_t<std::is_same_v<T, cuda::bf16>, weft::bfloat16, T>;
  static_assert(sizeof(boundary) == sizeof(T));
  std::vector<device_ptr<boundary>> boundary_buffers;
  std::optional<weft::pipeline::executor<weft::nccl_backend, boundary>> pipeline;
  if (table) {
    auto as_model = [](auto* p) { return reinterpret_cast<std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(p)>>, const T*, T*>>(p); };
    weft::pipeline::stage_callbacks<boundary> callbacks;
    callbacks.forward = [&, as_model](int mb, int chunk, std::span<const boundary> input, std::span<boundary> output) {
      const auto i = static_cast<std::size_t>(mb);
      model.forward(i % slots, chunk, tokens[i], labels[i], as_model(input.data()), as_model(output.data()), loss_scale,
                    row_losses.get() + i * n);
    };
    callbacks.backward = [&, as_model](int mb, int chunk, std::span<const boundary> output_grad,
                                       std::span<boundary> input_grad) {
      model.backward(static_cast<std::size_t>(mb) % slots, chunk, as_model(output_grad.data()),
                     as_model(input_grad.data()));
    };
    if (split_backward)
      callbacks.weight = [&](int mb, int chunk) { model.weight(static_cast<std::size_t>(mb) % slots, chunk); };
    pipeline.emplace(pp, std::move(*table), callbacks,
                     weft::pipeline::executor_options<boundary>{
                         .elements = model.boundary_elements(),
                         .layers = m.layers,
                         .allocate = [&](std::size_t elements) {
                           boundary_buffers.push_back(device_alloc<boundary>(elements));
                           return std::span<boundary>(boundary_buffers.back().get(), elements);
                         }});
  }
  std::vector<double> step_times;
  double first_loss = 0, last_loss = 0;
  if (rank == 0)
    std::printf("train_gpt: %d layers, hidden %d, %d heads, vocab %d, seq %d (%.2f M parameters) on %d GPU(s) in %s: "
                "tp %d pp %d dp %d cp %d%s, %s schedule, global batch %d = %d micro-batch(es) of %d per dp rank\n",
                m.layers, m.hidden, m.heads, m.vocab, m.seq, static_cast<double>(m.parameter_count()) / 1e6,
                world.size(), precision, d.tp, d.pp, d.dp, d.cp, sharding_text(o).c_str(),
                d.pp > 1 ? o.schedule.c_str() : "no pipeline", r.global_batch, r.micro_batches, r.choice.micro_batch);
  const auto run_start = clock::now();
  for (std::int64_t step = first_step; step < o.steps; ++step) {
    const auto t0 = clock::now();
    const data_position at = position(step);
    // The dp rank's sequences (every tp, cp and pp rank of a dp group reads the same).
    const std::vector<std::int32_t> slice =
        data.sequences(at, static_cast<std::int64_t>(coords.dp) * per_dp, per_dp, m.seq);
    for (std::size_t mb = 0; mb < tokens.size(); ++mb) {
      // Row i of the micro-batch is the rank's token i % t of its sequence i / t (t = seq / cp):
      // the token at that position of the sequence, and the next as its label (trainer::fill_batches).
      for (std::size_t i = 0; i < n; ++i) {
        const std::int32_t* s =
            slice.data() + (mb * static_cast<std::size_t>(r.choice.micro_batch) + i / own_positions.size()) * seq1;
        const auto p = static_cast<std::size_t>(own_positions[i % own_positions.size()]);
        tokens[mb][i] = s[p];
        labels[mb][i] = s[p + 1];
      }
    }
    if (pipeline) {
      pipeline->run();
    } else {
      for (std::size_t mb = 0; mb < tokens.size(); ++mb)
        model.forward_backward(tokens[mb], labels[mb], loss_scale, row_losses.get() + mb * n);
    }
    // Every gradient of the step is added: the sums over tp (sequence parallelism's) and between
    // the tied embedding's copies (pp), then the reduction over dp x cp, which the compute stream
    // waits for. With units each unit's reduction was issued as its backward ended (the tp sums
    // inside its scope), and the last micro-batch's root finished the step's.
    if (units) {
      if (!units->step_ready())
        throw std::logic_error("train_gpt: the sharded units' step did not end with the last micro-batch");
    } else {
      model.sum_row_split_gradients();
      model.tie_embeddings();
      sync->reduce_all();
    }
    WEFT_CHECK_CUDA(cudaMemcpyAsync(host_losses.data(), row_losses.get(), host_losses.size() * sizeof(double),
                                    cudaMemcpyDeviceToHost, stream.get()));
    std::optional<weft::checkpoint::checkpoint_file> dump;
    // Gathered by rank 0's tp x pp group (a collective over it; every dp and cp rank holds the
    // same), written by rank 0.
    std::vector<float> dumped_gradients;
    if (o.dump_grads && units) {
      // The reduced gradient shards gathered over dp x cp (every rank of it), then as above.
      const std::vector<float> packed =
          units->packed([&](std::size_t u) { return units->model().shard_grads(u); });
      if (gathers) dumped_gradients = model.whole_from_local(index, packed);
    } else if (o.dump_grads && o.zero1) {  // every dp rank gathers the shards
      std::vector<float> whole = whole_of_shards([&](float* full) { model.place_gradient_shard(full); });
      if (gathers) dumped_gradients = std::move(whole);
    } else if (o.dump_grads && gathers) {
      dumped_gradients = model.whole_gradients(index);
    }
    if (o.dump_grads && rank == 0) {
      // trainer::dump_gradients' file: whole gradients (after the dp sum), then the whole global
      // batch's input_ids and labels, and the loss.
      const std::vector<std::int32_t> all = data.sequences(at, 0, r.global_batch, m.seq);
      dump.emplace(weft::checkpoint::checkpoint_file{config_metadata(m), whole_records(index, dumped_gradients)});
      std::vector<std::int64_t> ids, next;
      for (int s = 0; s < r.global_batch; ++s)
        for (int t = 0; t < m.seq; ++t) {
          ids.push_back(all[static_cast<std::size_t>(s) * seq1 + static_cast<std::size_t>(t)]);
          next.push_back(all[static_cast<std::size_t>(s) * seq1 + static_cast<std::size_t>(t) + 1]);
        }
      dump->tensors.push_back(weft::checkpoint::make_record<std::int64_t>("input_ids", {r.global_batch, m.seq}, ids));
      dump->tensors.push_back(weft::checkpoint::make_record<std::int64_t>("labels", {r.global_batch, m.seq}, next));
    }
    const double lr = o.warmup > 0 && step + 1 <= o.warmup ? o.lr * static_cast<double>(step + 1) / o.warmup : o.lr;
    const cuda::adamw_settings adamw{.lr = static_cast<float>(lr),
                                     .beta1 = static_cast<float>(o.beta1),
                                     .beta2 = static_cast<float>(o.beta2),
                                     .eps = static_cast<float>(o.eps),
                                     .weight_decay = static_cast<float>(o.weight_decay)};
    if (units) {
      // AdamW on this rank's shard of each unit (the compute stream waits for the reductions), the
      // shards then gathered again by the next forward; the gradient shards zeroed after it.
      for (std::size_t u = 0; u < units->unit_count(); ++u) {
        const std::span<float> shard = units->model().shard_params(u);
        const std::span<const float> grads = units->model().shard_grads(u);
        for (const weft::fsdp::shard_run& run : units->model().shard_runs(u))
          k.adamw(shard.data() + run.shard_offset, grads.data() + run.shard_offset, unit_m1[u].get() + run.shard_offset,
                  unit_m2[u].get() + run.shard_offset, run.count, static_cast<long>(step + 1), adamw,
                  specs[units->unit(u)[run.param]].decay);
      }
      units->model().zero_grad();
      units->stepped();
    } else {
      model.adamw(static_cast<long>(step + 1), adamw);
      // ZeRO-1: every rank's updated shard to every rank (queued after AdamW; the compute stream waits).
      if (o.zero1) sync->gather_params(*params);
      model.refresh_working_copy();
      sync->zero_grad();
    }
    WEFT_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
    model.settle();
    // Summed as the CPU trainer sums them: each micro-batch's rows in order, the micro-batches,
    // then the ranks (each row counted once: on the last stage, by its tp rank 0).
    double loss = 0;
    for (int mb = 0; counts_loss && mb < r.micro_batches; ++mb) {
      double part = 0;
      for (std::size_t t = 0; t < n; ++t) part += host_losses[static_cast<std::size_t>(mb) * n + t];
      loss += part;
    }
    WEFT_CHECK_CUDA(cudaMemcpy(loss_sum.get(), &loss, sizeof(double), cudaMemcpyHostToDevice));
    world.all_reduce(std::span<double>(loss_sum.get(), 1));
    WEFT_CHECK_CUDA(cudaMemcpy(&loss, loss_sum.get(), sizeof(double), cudaMemcpyDeviceToHost));
    loss /= tokens_per_step;
    if (dump) {
      const float l = static_cast<float>(loss);
      dump->tensors.push_back(weft::checkpoint::make_record<float>("loss", {}, std::span<const float>(&l, 1)));
      weft::checkpoint::write_safetensors(*o.dump_grads, *dump);
    }
    const bool last = step + 1 == o.steps;
    // Every dp and cp rank holds the same weights and moments: rank 0's tp x pp group's are the
    // checkpoint (gathered from its slices and stages; rank 0 writes). With units and with ZeRO-1
    // every rank gathers its shards first.
    if (o.save && (gathers || units || o.zero1) && (last || (o.save_every > 0 && (step + 1) % o.save_every == 0)))
      save_checkpoint(whole_state, o, m, r, index, data, step + 1, position(step + 1).sequence, rank == 0);
    const double step_s = std::chrono::duration<double>(clock::now() - t0).count();
    step_times.push_back(step_s);
    if (step == first_step) first_loss = loss;
    last_loss = loss;
    if (!o.quiet && rank == 0) {
      std::printf("step %lld/%d | loss %.6f | %.0f tokens/s | step %.1f ms\n", static_cast<long long>(step + 1),
                  o.steps, loss, tokens_per_step / step_s, step_s * 1e3);
      std::fflush(stdout);
    }
  }
  if (rank == 0) {
    const double median = median_step_seconds(step_times);
    std::printf("done: %lld steps, loss %.4f -> %.4f, median step %.1f ms, %.0f tokens/s, %.1f s in all (tp %d pp %d dp "
                "%d cp %d on GPUs, %s, %d micro-batches of %d)\n",
                static_cast<long long>(o.steps - first_step), first_loss, last_loss, median * 1e3,
                median > 0 ? tokens_per_step / median : 0.0,
                std::chrono::duration<double>(clock::now() - run_start).count(), d.tp, d.pp, d.dp, d.cp, precision,
                r.micro_batches, r.choice.micro_batch);
  }
  return 0;
}

}  // namespace

int train_on_cuda(const options& o, const gpt_config& m, const run_layout& r, const corpus& data) {
  return o.precision == precision_kind::bf16 ? train<cuda::bf16>(o, m, r, data) : train<float>(o, m, r, data);
}

}  // namespace train_gpt
