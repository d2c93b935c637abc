#pragma once
/// \file
/// `weft::pipeline::executor<B, T>`: runs one rank's list of a pipeline schedule on the pp group.
/// It calls the trainer's forward, backward and weight-gradient callbacks in the table's order,
/// receives each action's input from the rank the table names and sends its output on, with the
/// boundary tensor's shape agreed by all stages once, when the executor is built.
///
/// Before anything is sent, the constructor (collective over the pp group) refuses, on every
/// rank with the same message, the configurations that hang or silently corrupt a pipeline: ranks
/// holding different schedules, a schedule for another number of stages than the group has, one
/// that `validate` (rules.hpp) forbids or `verify` (verify.hpp) finds deadlocking, boundary
/// shapes or element types that differ between stages, and a split-backward schedule without a
/// weight-gradient callback. Each problem names the rule, the stages involved and what to do.
///
/// Communication. The executor posts the transfer plan of detail/transfer_plan.hpp: each transfer
/// at the time the verifier's simulation of the table gives it, the transfers of one time on this
/// rank in one batch (`communicator::batch()`, one NCCL group), before the first action that
/// starts at or after that time. A send posted on its own waits for its receiver (NCCL holds the
/// stream; MPI past its eager limit), so two stages that each send before they receive would wait
/// for each other (1F1B: stage p-2 sends a1 before it receives g0, stage p-1 sends g0 before it
/// receives a1); in the plan every rank follows the simulation's one time order (stage p-1
/// receives a1, sent earlier, before it sends g0), and transfers of the same time share a batch as
/// in Megatron-LM's `send_forward_recv_backward`. `verify` simulates these batches with sends
/// that wait for their receivers and each rank's batches in posting order (one stream), and the
/// constructor refuses a table it does not accept, so an accepted table cannot deadlock on NCCL
/// or MPI. Receives keep the sender's order on each channel (point-to-point matching between two
/// ranks is by order, MPI without tags and NCCL alike). An action waits for the batch holding its
/// input; sends complete in the background and the step ends when all have. On MPI the receives
/// of the next `prefetch` actions are posted ahead, in batches of their own, so their transfers
/// overlap the current action; on NCCL every batch runs in posting order on the communicator's
/// stream, where a receive posted ahead would hold back this stage's later sends (prefetch 0).

/// Buffers: host memory owned by the executor, or memory from `executor_options::allocate` (device
/// memory for NCCL: the caller's), pooled and reused across actions and steps.

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/pipeline/detail/exchange_plan.hpp>
#include <weft/pipeline/detail/transfer_plan.hpp>
#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule.hpp>
#include <weft/pipeline/verify.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace weft::pipeline {

/// The trainer's work for one (micro-batch, chunk). Spans are empty at the ends of the pipeline:
///
/// - `forward(mb, chunk, input, output)`: `input` is the activation from the previous virtual
///   stage, empty on the first (virtual stage 0: the trainer reads its own micro-batch `mb`);
///   write the activation for the next virtual stage into `output`, empty on the last one (the
///   trainer computes the loss of `mb` there). `input` stays valid until the backward of the same
///   (mb, chunk) returns (its weight gradient, for split schedules), so the trainer need not copy
///   it.
/// - `backward(mb, chunk, output_grad, input_grad)`: `output_grad` is the gradient of this chunk's
///   output, empty on the last virtual stage (start from the loss); write the gradient of its
///   input into `input_grad`, empty on virtual stage 0. For schedules that split the backward
///   (ZB-H1) compute the input gradient only; `output_grad` then stays valid until `weight`
///   returns for the same (mb, chunk).
/// - `weight(mb, chunk)`: the weight gradient alone; needed only by split schedules.
template <element T>
struct stage_callbacks {
  std::function<void(int micro_batch, int chunk, std::span<const T> input, std::span<T> output)> forward{};
  std::function<void(int micro_batch, int chunk, std::span<const T> output_grad, std::span<T> input_grad)> backward{};
  std::function<void(int micro_batch, int chunk)> weight{};
};

/// How the executor runs. Aggregate: `{.elements = hidden * tokens}`.
template <element T>
struct executor_options {
  /// Elements of the tensor between two stages, per micro-batch (activation and its gradient);
  /// the same on every stage, checked at construction.
  std::size_t elements = 0;
  /// Transformer layers of the model, checked to split over stages x chunks; 0: not checked.
  int layers = 0;
  /// How many actions ahead receives are posted (0: only the current action's input). Negative: the
  /// backend's default, 1 with host buffers (MPI) and 0 with device buffers (NCCL) or with
  /// `in_stream_order`, where batches run in posting order, so a receive posted ahead would sit
  /// before this stage's later sends (refused there, see executor_problems).
  int prefetch = -1;
  /// Memory for one buffer of `elements` elements, owned by the caller and valid as long as the
  /// executor (device memory for NCCL). Empty: the executor allocates host memory.
  std::function<std::span<T>(std::size_t elements)> allocate{};
  /// Wait for each batch of transfers before posting the next, as NCCL's stream runs them (it
  /// always does there). On MPI, with boundaries above its eager limit (so that a send waits for
  /// its receiver), this runs the transfers in the order NCCL imposes: what tests use to show on
  /// CPUs that the executor cannot deadlock on NCCL. Needs prefetch 0.
  bool in_stream_order = false;
};

/// What one `run()` did on this rank.
struct step_stats {
  double seconds = 0;          ///< wall time of the step
  double compute_seconds = 0;  ///< inside the callbacks
  double wait_seconds = 0;     ///< blocked on inputs, and on the last sends at the end
  std::size_t sends = 0;
  std::size_t receives = 0;
  std::size_t buffers = 0;     ///< buffers of `elements` allocated so far (they are reused)
};

namespace detail {

/// What each rank contributes to the agreement at construction.
enum executor_field : std::size_t {
  field_group_size,
  field_kind,
  field_stages,
  field_micro_batches,
  field_virtual_stages,
  field_split,
  field_fingerprint,
  field_elements,
  field_dtype,
  field_callbacks,
  field_layers,
  field_prefetch,
  field_in_stream_order,
  executor_fields
};

inline constexpr std::int64_t has_forward = 1, has_backward = 2, has_weight = 4;

inline std::string describe_table(const std::int64_t* f) {
  return std::string(to_string(static_cast<schedule_kind>(f[field_kind]))) + ", " + std::to_string(f[field_stages]) +
         " stages, " + std::to_string(f[field_micro_batches]) + " micro-batches, " +
         std::to_string(f[field_virtual_stages]) + " chunk(s) per rank" +
         (f[field_layers] > 0 ? ", " + std::to_string(f[field_layers]) + " layers" : "");
}

/// Every reason to refuse, from what all ranks contributed (`all`: executor_fields per rank, in
/// group order) and this rank's copy of the table: a pure function, so every rank finds the same.
/// `stream_ordered`: the backend runs point-to-point calls in call order on one stream (NCCL).
inline std::vector<std::string> executor_problems(const schedule& s, std::span<const std::int64_t> all,
                                                  const std::string& group, bool stream_ordered = false) {
  std::vector<std::string> problems;
  const std::size_t ranks = all.size() / executor_fields;
  auto rec = [&](std::size_t r) { return all.data() + r * executor_fields; };

  // The same table everywhere, or nothing else is worth checking.
  bool same_table = true;
  for (std::size_t r = 1; r < ranks; ++r) {
    for (std::size_t f : {field_kind, field_stages, field_micro_batches, field_virtual_stages, field_split,
                          field_fingerprint, field_layers})
      if (rec(r)[f] != rec(0)[f]) same_table = false;
  }
  if (!same_table) {
    std::string detail;
    for (std::size_t r = 0; r < ranks; ++r) detail += "; stage " + std::to_string(r) + ": " + describe_table(rec(r));
    problems.push_back("the stages of group '" + group + "' hold different schedules" + detail +
                       " (same parameters with a different fingerprint: a table edited on some ranks). Every stage must "
                       "build the same schedule: make_schedule with the same kind, stages, micro-batches and chunks");
    return problems;
  }

  const int p = static_cast<int>(ranks);
  if (s.stages != p) {
    problems.push_back("the schedule was built for stages=" + std::to_string(s.stages) + ", but group '" + group +
                       "' has " + std::to_string(p) + " ranks: build it with stages=" + std::to_string(p) +
                       ", or run it on a pp group of " + std::to_string(s.stages) + " ranks");
  }
  const schedule_spec spec{.kind = s.kind,
                           .stages = s.stages,
                           .micro_batches = s.micro_batches,
                           .virtual_stages = s.virtual_stages,
                           .layers = static_cast<int>(rec(0)[field_layers])};
  for (std::string& problem : validate(spec)) problems.push_back(std::move(problem));
  if (problems.empty()) {
    const verify_report report = verify(s);
    for (std::size_t i = 0; i < report.problems.size() && i < 4; ++i)
      problems.push_back("the table is malformed: " + report.problems[i]);
    if (report.problems.empty() && !report.deadlock_free) {
      std::string waits;
      for (const std::string& w : report.waits) waits += (waits.empty() ? "" : "; ") + w;
      problems.push_back("the table deadlocks (" + waits + "): reorder it, or use make_schedule for " +
                         std::string(to_string(s.kind)) + ", whose tables verify() accepts");
    }
    if (!report.problems.empty())
      problems.push_back("use make_schedule for " + std::string(to_string(s.kind)) + ", whose tables verify() accepts");
  }

  bool same_shape = true;
  for (std::size_t r = 1; r < ranks; ++r)
    same_shape = same_shape && rec(r)[field_elements] == rec(0)[field_elements] && rec(r)[field_dtype] == rec(0)[field_dtype];
  if (!same_shape) {
    std::string detail;
    for (std::size_t r = 0; r < ranks; ++r)
      detail += (detail.empty() ? "" : ", ") + std::string("stage ") + std::to_string(r) + " " +
                std::to_string(rec(r)[field_elements]) + " x " +
                std::string(to_string(static_cast<dtype>(rec(r)[field_dtype])));
    problems.push_back("the stages of group '" + group + "' disagree about the tensor between stages (" + detail +
                       " per micro-batch): every stage must give the same elements and type (micro-batch size x "
                       "sequence x hidden size), or a receive would be cut short or overrun");
  } else if (rec(0)[field_elements] <= 0) {
    problems.push_back("elements=0: give the elements of the tensor between stages per micro-batch");
  }

  for (std::size_t r = 0; r < ranks; ++r) {
    if ((stream_ordered || rec(r)[field_in_stream_order] != 0) && rec(r)[field_prefetch] > 0)
      problems.push_back("stage " + std::to_string(r) + " posts receives " + std::to_string(rec(r)[field_prefetch]) +
                         " action(s) ahead (prefetch), but its transfers run in posting order (on NCCL's stream, or "
                         "in_stream_order): a receive posted ahead holds back this stage's later "
                         "sends, and deadlocks when its sender first waits for one of them (gpipe on 2 stages "
                         "already does). Use prefetch = 0 (the default here)");
  }

  for (std::size_t r = 0; r < ranks; ++r) {
    const std::int64_t have = rec(r)[field_callbacks];
    std::string missing;
    if ((have & has_forward) == 0) missing += "forward";
    if ((have & has_backward) == 0) missing += std::string(missing.empty() ? "" : " and ") + "backward";
    if (!missing.empty())
      problems.push_back("stage " + std::to_string(r) + " has no " + missing + " callback: give every stage_callbacks member the schedule calls");
    if (s.split_backward && (have & has_weight) == 0)
      problems.push_back("stage " + std::to_string(r) + " has no weight callback, but " + std::string(to_string(s.kind)) +
                         " splits the backward into input and weight gradients: give stage_callbacks::weight, or use "
                         "the 1f1b schedule");
  }
  return problems;
}

}  // namespace detail

template <backend B, element T>
class executor {
  /// NCCL: point-to-point calls run in call order on the communicator's stream.
  static constexpr bool stream_ordered = buffer_memory_v<B> == memory_space::device;

 public:
  using request = typename B::request;

  /// Collective over `pp`: agrees on the schedule and the boundary shape with every stage and
  /// refuses (weft::error, the same problems on every rank, before any message) what would hang or
  /// corrupt. `pp` must outlive the executor (it is held by reference and followed through moves).
  executor(communicator<B>& pp, schedule table, stage_callbacks<T> callbacks, executor_options<T> options)
      : pp_(pp.ref()), table_(std::move(table)), callbacks_(std::move(callbacks)), options_(std::move(options)) {
    prefetch_ = options_.prefetch >= 0 ? options_.prefetch : (stream_ordered || options_.in_stream_order ? 0 : 1);
    agree(pp);
    rank_ = pp.rank();
    plan_ = detail::plan_exchange(table_, rank_);
    const auto v = static_cast<std::size_t>(table_.virtual_stages);
    const auto m = static_cast<std::size_t>(table_.micro_batches);
    slots_ = std::vector<recv_slot>(2 * m * v);
    held_input_.assign(m * v, -1);
    held_grad_.assign(m * v, -1);
    // The inputs held until their backward, plus the receives posted ahead and the sends in flight.
    const verify_report report = verify(table_);
    transfers_ = detail::plan_transfers(table_, rank_, plan_, report.times, prefetch_);
    const int held = report.peak_in_flight.empty() ? 1 : report.peak_in_flight[static_cast<std::size_t>(rank_)];
    for (int i = 0; i < held + 2 * (prefetch_ + 1); ++i) allocate_buffer_index();
  }

  executor(const executor&) = delete;
  executor& operator=(const executor&) = delete;
  executor(executor&&) = default;
  executor& operator=(executor&&) = default;

  /// One training step: every action of this rank's list, in order. Collective over the pp group
  /// (every stage calls it once per step). Returns when this rank's actions ran and its sends
  /// completed.
  step_stats run() {
    communicator<B>& comm = pp_.get();
    using clock = std::chrono::steady_clock;
    auto seconds = [](clock::duration d) { return std::chrono::duration<double>(d).count(); };
    const auto start = clock::now();
    step_stats stats;
    const std::vector<action>& list = table_.ranks[static_cast<std::size_t>(rank_)];
    const int last = table_.chunks_total() - 1;
    batches_.clear();
    output_of_.assign(list.size(), -1);
    for (std::size_t i = 0;; ++i) {
      recycle_batches();
      post_step(comm, i, stats);
      if (i == list.size()) break;
      const action& a = list[i];
      const int k = table_.virtual_stage(rank_, a.chunk);
      int output = -1;
      if (a.kind == action_kind::forward) {
        const int input = take_input(i, stats);
        if (a.send_to >= 0) output = acquire();
        else if (k < last) same_rank_neighbour(a);
        if (k > 0 && a.recv_from < 0) same_rank_neighbour(a);
        const auto t0 = clock::now();
        callbacks_.forward(a.micro_batch, a.chunk, input < 0 ? std::span<const T>() : std::span<const T>(buffers_[static_cast<std::size_t>(input)]),
                           output < 0 ? std::span<T>() : buffers_[static_cast<std::size_t>(output)]);
        stats.compute_seconds += seconds(clock::now() - t0);
        held_input_[pair_index(a.micro_batch, a.chunk)] = input;
      } else if (a.kind == action_kind::backward) {
        const int grad = take_input(i, stats);
        if (a.send_to >= 0) output = acquire();
        const auto t0 = clock::now();
        callbacks_.backward(a.micro_batch, a.chunk, grad < 0 ? std::span<const T>() : std::span<const T>(buffers_[static_cast<std::size_t>(grad)]),
                            output < 0 ? std::span<T>() : buffers_[static_cast<std::size_t>(output)]);
        stats.compute_seconds += seconds(clock::now() - t0);
        if (table_.split_backward) {
          held_grad_[pair_index(a.micro_batch, a.chunk)] = grad;
        } else {
          release(grad);
          release(std::exchange(held_input_[pair_index(a.micro_batch, a.chunk)], -1));
        }
      } else {
        const auto t0 = clock::now();
        callbacks_.weight(a.micro_batch, a.chunk);
        stats.compute_seconds += seconds(clock::now() - t0);
        release(std::exchange(held_grad_[pair_index(a.micro_batch, a.chunk)], -1));
        release(std::exchange(held_input_[pair_index(a.micro_batch, a.chunk)], -1));
      }
      if (output >= 0) {
        output_of_[i] = output;  // sent by a batch of a later step
        ++stats.sends;
      }
    }
    for (std::size_t b = 0; b < batches_.size(); ++b) finish_batch(b, stats);
    batches_.clear();
    stats.receives = plan_.receives;
    stats.buffers = buffers_.size();
    stats.seconds = seconds(clock::now() - start);
    return stats;
  }

  /// This rank's stage in the pp group.
  int stage() const noexcept { return rank_; }
  const schedule& table() const noexcept { return table_; }
  std::size_t elements() const noexcept { return options_.elements; }

 private:
  struct recv_slot {
    int buffer = -1;
    std::size_t batch = 0;  ///< index in batches_ of the batch that receives it
  };
  /// A batch of transfers posted in this step, and the buffers it sends from (free once it ends).
  struct posted_batch {
    request done{};
    std::vector<int> send_buffers;
    bool finished = false;
  };

  void agree(communicator<B>& pp) {
    std::vector<std::int64_t> mine(detail::executor_fields, 0);
    mine[detail::field_group_size] = pp.size();
    mine[detail::field_kind] = static_cast<std::int64_t>(table_.kind);
    mine[detail::field_stages] = table_.stages;
    mine[detail::field_micro_batches] = table_.micro_batches;
    mine[detail::field_virtual_stages] = table_.virtual_stages;
    mine[detail::field_split] = table_.split_backward ? 1 : 0;
    mine[detail::field_fingerprint] = static_cast<std::int64_t>(detail::fingerprint(table_));
    mine[detail::field_elements] = static_cast<std::int64_t>(options_.elements);
    mine[detail::field_dtype] = static_cast<std::int64_t>(dtype_of<T>);
    mine[detail::field_callbacks] = (callbacks_.forward ? detail::has_forward : 0) |
                                    (callbacks_.backward ? detail::has_backward : 0) |
                                    (callbacks_.weight ? detail::has_weight : 0);
    mine[detail::field_layers] = options_.layers;
    mine[detail::field_prefetch] = prefetch_;
    mine[detail::field_in_stream_order] = options_.in_stream_order ? 1 : 0;
    std::vector<std::int64_t> all(detail::executor_fields * static_cast<std::size_t>(pp.size()));
    pp.host_all_gather(std::span<const std::int64_t>(mine), all);  // recorded and held to the deadline
    const std::vector<std::string> problems = detail::executor_problems(table_, all, pp.name(), stream_ordered);
    if (problems.empty()) return;
    std::string message = "pipeline executor on group '" + pp.name() + "' (stage " + std::to_string(pp.rank()) + " of " +
                          std::to_string(pp.size()) + ") refused its configuration before sending anything: " +
                          problems.front();
    for (std::size_t i = 1; i < problems.size(); ++i) message += "; also, " + problems[i];
    fail(message);
  }

  std::size_t pair_index(int micro_batch, int chunk) const noexcept {
    return static_cast<std::size_t>(micro_batch) * static_cast<std::size_t>(table_.virtual_stages) + static_cast<std::size_t>(chunk);
  }
  std::size_t slot_index(const detail::inbound_message& msg) const noexcept {
    return (msg.consumer == action_kind::forward ? 0 : 1) * static_cast<std::size_t>(table_.micro_batches * table_.virtual_stages) +
           pair_index(msg.micro_batch, msg.chunk);
  }

  [[noreturn]] void same_rank_neighbour(const action& a) const {
    fail("pipeline executor on group '" + pp_.get().name() + "' (stage " + std::to_string(rank_) + "): " +
         short_name(a, table_.virtual_stages) + " passes its tensor to a chunk on the same rank, which this executor does not do: "
         "use at least 2 stages for an interleaved schedule");
  }

  void allocate_buffer() {
    if (options_.allocate) {
      std::span<T> memory = options_.allocate(options_.elements);
      if (memory.size() < options_.elements)
        fail("pipeline executor (stage " + std::to_string(rank_) + "): executor_options::allocate returned " +
             std::to_string(memory.size()) + " elements for a buffer of " + std::to_string(options_.elements) +
             ": return at least as many as asked");
      buffers_.push_back(memory.first(options_.elements));
    } else {
      owned_.push_back(std::make_unique<T[]>(options_.elements));
      buffers_.push_back(std::span<T>(owned_.back().get(), options_.elements));
    }
  }
  int acquire() {
    if (free_index_.empty()) allocate_buffer_index();
    const int b = free_index_.back();
    free_index_.pop_back();
    return b;
  }
  void allocate_buffer_index() {
    allocate_buffer();
    free_index_.push_back(static_cast<int>(buffers_.size()) - 1);
  }
  void release(int buffer) {
    if (buffer >= 0) free_index_.push_back(buffer);
  }

  /// Posts the batches of step `step` (before action `step`; the last one after every action).
  void post_step(communicator<B>& comm, std::size_t step, step_stats& stats) {
    for (const detail::transfer_batch& planned : transfers_.steps[step]) {
      auto batch = comm.batch();
      posted_batch entry;
      for (const detail::transfer& t : planned.transfers) {
        if (t.send) {
          const int buffer = std::exchange(output_of_[static_cast<std::size_t>(t.action)], -1);
          batch.send(std::span<const T>(buffers_[static_cast<std::size_t>(buffer)]), t.peer);
          entry.send_buffers.push_back(buffer);
        } else {
          recv_slot& slot = slots_[slot_index(t.message)];
          slot.buffer = acquire();
          slot.batch = batches_.size();
          batch.recv(buffers_[static_cast<std::size_t>(slot.buffer)], t.peer);
        }
      }
      entry.done = batch.run_async();
      batches_.push_back(std::move(entry));
      if (options_.in_stream_order) finish_batch(batches_.size() - 1, stats);
    }
  }

  /// Waits for batch `b` (once) and frees the buffers it sent from.
  void finish_batch(std::size_t b, step_stats& stats) {
    posted_batch& batch = batches_[b];
    if (batch.finished) return;
    const auto t0 = std::chrono::steady_clock::now();
    batch.done.wait();
    stats.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    batch.finished = true;
    for (int buffer : batch.send_buffers) release(buffer);
  }

  /// Waits for action `i`'s input and hands over its buffer (-1: the action receives nothing).
  int take_input(std::size_t i, step_stats& stats) {
    const detail::inbound_slot& need = plan_.consumes[i];
    if (need.peer < 0) return -1;
    const detail::inbound_message& msg =
        plan_.messages_from(need.peer)[static_cast<std::size_t>(need.position)];
    recv_slot& slot = slots_[slot_index(msg)];
    finish_batch(slot.batch, stats);
    return std::exchange(slot.buffer, -1);
  }

  /// Frees the buffers of the batches that have completed (and lets the backend progress them).
  void recycle_batches() {
    for (posted_batch& batch : batches_) {
      if (batch.finished || batch.send_buffers.empty() || !batch.done.test()) continue;
      batch.finished = true;
      for (int buffer : batch.send_buffers) release(buffer);
    }
  }

  communicator_ref<B> pp_;
  schedule table_;
  stage_callbacks<T> callbacks_;
  executor_options<T> options_;
  int prefetch_ = 0;  ///< receives posted ahead, in actions (options_.prefetch resolved)
  int rank_ = 0;
  detail::exchange_plan plan_;
  std::vector<std::unique_ptr<T[]>> owned_;
  std::vector<std::span<T>> buffers_;
  std::vector<int> free_index_;  // buffers not in use
  std::vector<recv_slot> slots_;
  std::vector<int> held_input_, held_grad_;
  detail::transfer_plan transfers_;
  std::vector<posted_batch> batches_;  ///< this step's, in posting order
  std::vector<int> output_of_;         ///< per action of this step: the buffer its output waits in to be sent
};

}  // namespace weft::pipeline
