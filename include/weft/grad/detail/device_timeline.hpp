#pragma once
/// \file
/// The device side of a synchronizer step on a GPU backend: the events that order the
/// communicator's stream after the stream that produces gradients (so a bucket's reduction reads
/// its gradients only after the kernels that wrote them), and the timing of each step, measured
/// by the GPU itself.
///
/// Events are created and recorded with the communicator's device current, whatever the calling
/// thread's device is. Reading a timing waits for its events through a waiter the synchronizer
/// gives (the communicator's polling, which watches NCCL's error state and the deadline), never
/// with cudaEventSynchronize, which would wait forever behind a kernel stuck on a lost peer.
///
/// Two sets of events alternate between optimizer steps, so the host can run a step ahead of the
/// GPU without waiting for the previous step's timings; a step's timing is read when the report
/// is asked for, or when its set of events is needed again two steps later.

#include <weft/config.hpp>

#if WEFT_HAS_CUDA

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <vector>

#include <weft/backend/cuda/device_guard.hpp>
#include <weft/backend/cuda/event.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/step_report.hpp>

namespace weft::grad::detail {

class device_timeline {
 public:
  device_timeline() = default;

  /// Events for `buckets` buckets, on `device` (negative: the current device).
  explicit device_timeline(std::size_t buckets, int device = -1) : device_(device) {
    cuda::device_guard on(device_);
    for (step_events& set : sets_) {
      set.begin = cuda::event::create(true);
      set.backward_end = cuda::event::create(true);
      for (std::size_t b = 0; b < buckets; ++b) {
        set.ready.push_back(cuda::event::create(true));
        set.start.push_back(cuda::event::create(true));
        set.end.push_back(cuda::event::create(true));
      }
    }
  }

  /// Whether the set the next step will use still holds an unread step.
  bool next_set_unread(std::size_t step) const { return sets_[step % 2].unread; }

  /// The start of reducing step `step`'s backward, on the compute stream.
  void begin(std::size_t step, cudaStream_t compute) {
    cuda::device_guard on(device_);
    current_ = step % 2;
    step_events& set = sets_[current_];
    set.step = step;
    set.issued = 0;
    set.ready_recorded.assign(set.ready.size(), 0);
    set.begin.record(compute);
  }

  /// Bucket `b`'s last gradient was marked ready: marks the point of the compute stream its
  /// reduction must wait for (everything queued so far), even while earlier buckets hold that
  /// reduction back.
  void bucket_ready(std::size_t b, cudaStream_t compute) {
    cuda::device_guard on(device_);
    sets_[current_].ready[b].record(compute);
    sets_[current_].ready_recorded[b] = 1;
  }

  /// Bucket `b`'s reduction is about to be queued: the communication stream waits for the
  /// bucket's ready point (recorded now if it was not: reduce_all, unmarked parameters), then
  /// marks the reduction's start.
  void bucket_start(std::size_t b, cudaStream_t compute, cudaStream_t communication) {
    cuda::device_guard on(device_);
    step_events& set = sets_[current_];
    if (!set.ready_recorded[b]) bucket_ready(b, compute);
    set.ready[b].make_wait(communication);
    set.start[b].record(communication);
  }

  /// Bucket `b`'s reduction has been queued on the communication stream.
  void bucket_issued(std::size_t b, cudaStream_t communication) {
    cuda::device_guard on(device_);
    sets_[current_].end[b].record(communication);
    ++sets_[current_].issued;
  }

  /// Backward has ended on the compute stream (finish() of the reducing micro-step).
  void end_backward(cudaStream_t compute, bool overlap_expected, double issue_s) {
    cuda::device_guard on(device_);
    step_events& set = sets_[current_];
    set.backward_end.record(compute);
    set.overlap_expected = overlap_expected;
    set.issue_s = issue_s;
    set.unread = true;
    newest_ = current_;
  }

  /// Whether the newest step whose backward has ended has not been read yet.
  bool newest_unread() const { return sets_[newest_].unread; }

  /// Reads the timing of the set that step `step` used; `wait(event)` blocks until an event has
  /// happened (call it once the step's reductions are known to be complete).
  template <class Wait>
  step_report read(std::size_t step, const bucket_plan& plan, Wait&& wait) {
    return read_set(sets_[step % 2], plan, wait);
  }
  /// Reads the newest finished step's timing.
  template <class Wait>
  step_report read_newest(const bucket_plan& plan, Wait&& wait) {
    return read_set(sets_[newest_], plan, wait);
  }

 private:
  struct step_events {
    cuda::event begin, backward_end;
    std::vector<cuda::event> ready, start, end;
    std::vector<char> ready_recorded;
    std::size_t step = 0;
    std::size_t issued = 0;
    bool overlap_expected = false;
    double issue_s = 0;
    bool unread = false;
  };

  template <class Wait>
  static double seconds(const cuda::event& from, const cuda::event& to, Wait& wait) {
    if (!to.query()) wait(to);
    return static_cast<double>(to.elapsed_ms_since(from)) * 1e-3;
  }

  template <class Wait>
  step_report read_set(step_events& set, const bucket_plan& plan, Wait& wait) {
    step_report r;
    r.step = set.step;
    r.overlap_expected = set.overlap_expected;
    r.issue_s = set.issue_s;
    r.backward_s = seconds(set.begin, set.backward_end, wait);
    double previous_end = r.backward_s;
    for (std::size_t b = 0; b < set.issued; ++b) {
      bucket_timing t;
      t.bucket = b;
      t.bytes = plan.buckets()[b].count * size_of(plan.type());
      t.ready_s = seconds(set.begin, set.ready[b], wait);
      t.start_s = seconds(set.begin, set.start[b], wait);
      t.end_s = seconds(set.begin, set.end[b], wait);
      // What the compute stream waited for this bucket after backward (buckets end in order).
      t.exposed_s = t.end_s > previous_end ? t.end_s - previous_end : 0.0;
      if (t.end_s > previous_end) previous_end = t.end_s;
      r.buckets.push_back(t);
    }
    set.unread = false;
    return r;
  }

  std::array<step_events, 2> sets_;
  std::size_t current_ = 0;  ///< the set of the step in progress
  std::size_t newest_ = 0;   ///< the set of the newest step whose backward has ended
  int device_ = -1;          ///< the communicator's device
};

}  // namespace weft::grad::detail

#endif  // WEFT_HAS_CUDA
