#pragma once
/// \file
/// The state a gradient synchronizer shares between its host and device parts: the group, the
/// options, the registered parameters and their bucket plan, the gradient buffer, the hook, the
/// schedule of the current micro-step, each bucket's job and timing, and the report. The host part
/// (grad/detail/host_sync.hpp) and the device part (grad/detail/device_sync.hpp) derive from it;
/// synchronizer<B, T> derives from the part its backend's memory space selects.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/comm/communicator_ref.hpp>
#include <weft/core/dtype.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/bucket_sizing.hpp>
#include <weft/grad/comm_hook.hpp>
#include <weft/grad/flat_buffer.hpp>
#include <weft/grad/options.hpp>
#include <weft/grad/reduction_schedule.hpp>
#include <weft/grad/step_report.hpp>

namespace weft::grad::detail {

template <backend B, element T>
class sync_core {
 public:
  using request = typename B::request;
  using clock = std::chrono::steady_clock;
  /// Whether gradients live in device memory (a GPU backend) rather than host memory.
  static constexpr bool on_device = buffer_memory_v<B> == memory_space::device;
  using buffer_type = flat_buffer<T, buffer_memory_v<B>>;

  sync_core(const sync_core&) = delete;
  sync_core& operator=(const sync_core&) = delete;

  /// The group; it may have moved since construction, but must still exist.
  communicator<B>& group() const { return group_.get(); }

 protected:
  sync_core(communicator<B>& group, sync_options options) : group_(group.ref()), options_(options) {}
  ~sync_core() = default;

  std::string where() const { return "gradient synchronizer on group '" + group().name() + "'"; }

  double since_start() const { return std::chrono::duration<double>(clock::now() - start_).count(); }

  /// The factor the reduced sum is multiplied by, if known now.
  std::optional<double> scale_factor() const {
    return window_scale_factor(options_.scale, group().size(), options_.accumulation_steps, token_count_);
  }

  /// Fills bucket b's job and the start of its timing; the part then puts it on the wire.
  bucket_job<T>& prepare_job(std::size_t b) {
    std::optional<double> factor = scale_factor();
    deferred_[b] = factor ? 0 : 1;
    bucket_job<T>& job = jobs_[b];
    job = {.index = b, .data = grads_.bucket_slice(b), .scale = factor.value_or(1.0),
           .shard = options_.shard_optimizer_state, .caller_waits = issuing_in_finish_};
    timings_[b].bucket = b;
    timings_[b].bytes = job.data.size_bytes();
    timings_[b].start_s = since_start();
    return job;
  }

  /// The slice of bucket b that holds a result on this rank.
  std::span<T> result_of(std::size_t b) {
    std::span<T> data = grads_.bucket_slice(b);
    if (!options_.shard_optimizer_state) return data;
    auto [offset, count] = plan_->buckets()[b].shard(group().rank(), group().size());
    return grads_.all().subspan(offset, count);
  }

  /// Whether a step that should have overlapped did not; sets the report's warning (printed
  /// once). `exposed_s`, `hidden_s` and `comm_s` are filled by the part.
  void warn_if_not_overlapped(step_report& r, std::size_t started_during_backward) {
    if (!(r.overlap_expected && r.exposed_s > 1e-3 && r.hidden_s < 0.05 * r.comm_s)) return;
    if (started_during_backward == 0)
      r.warning = "overlap is on but hid no communication: every bucket started after backward ended; call "
                  "mark_ready() as backward produces each gradient (or set overlap = false and call reduce_all())";
    else
      r.warning = "overlap is on but hid almost no communication: " + std::to_string(started_during_backward) +
                  " of " + std::to_string(timings_.size()) +
                  " buckets started during backward, yet the communication ran after it (backward too short, or a "
                  "backend without asynchronous progress, e.g. MPI initialised without MPI_THREAD_MULTIPLE)";
    if (options_.warn_if_not_overlapped && !warned_) {
      warned_ = true;
      std::fprintf(stderr, "weft: %s: %s\n", where().c_str(), r.warning.c_str());
    }
  }

  /// The communication time of a step's buckets (their union), the part of it before backward
  /// ended, the latest end, and how many buckets started during backward.
  struct bucket_spans {
    double comm_s = 0;
    double before_s = 0;
    double last_end_s = 0;
    std::size_t started_during_backward = 0;
  };
  static bucket_spans spans_of(const step_report& r) {
    std::vector<std::pair<double, double>> spans;
    bucket_spans out;
    out.last_end_s = r.backward_s;
    for (const bucket_timing& t : r.buckets) {
      spans.emplace_back(t.start_s, t.end_s);
      if (t.start_s < r.backward_s) ++out.started_during_backward;
      out.last_end_s = std::max(out.last_end_s, t.end_s);
    }
    auto [comm, before] = union_length(spans, r.backward_s);
    out.comm_s = comm;
    out.before_s = before;
    return out;
  }

  communicator_ref<B> group_;  ///< follows the communicator if it moves
  sync_options options_;
  std::vector<param_spec> specs_;
  std::shared_ptr<const bucket_plan> plan_;
  bucket_size_choice bucket_choice_;
  buffer_type grads_;
  std::shared_ptr<comm_hook<B, T>> hook_;

  // the current micro-step
  reduction_schedule schedule_;
  std::vector<bucket_job<T>> jobs_;
  std::vector<char> deferred_;  ///< scaled after completion (token count unknown at issue)
  std::size_t steps_ = 0;
  std::optional<double> token_count_;
  bool issuing_in_finish_ = false;  ///< the caller waits for what is issued now

  // timing
  clock::time_point start_{};
  double issue_s_ = 0;
  std::vector<bucket_timing> timings_;
  step_report report_;
  bool warned_ = false;

  std::vector<shard_range> shard_ranges_;
  std::vector<shard_segment> shard_segments_;

  // Last: destroyed first (the parts' own requests before them), so in-flight reductions finish
  // while the buffer and hook still exist.
  std::vector<request> requests_;  ///< per bucket: the reduction
};

}  // namespace weft::grad::detail
