#pragma once
/// \file
/// The all-gather of updated parameters after a sharded (ZeRO-1) optimizer step, one bucket at a
/// time in forward order (the first layers' bucket first), so the next forward can start on the
/// first layers while later buckets are still in flight.
///
/// On a GPU backend, waiting means ordering the consumer stream (the one the next forward runs
/// on) after the gather, without blocking the host; `synchronize()` blocks the host.

#include <weft/config.hpp>

#include <cstddef>
#include <memory>
#include <vector>

#if WEFT_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

#include <weft/backend/backend.hpp>
#include <weft/grad/bucket_plan.hpp>

namespace weft::grad {

template <backend B>
class param_gather {
 public:
  using request = typename B::request;
  static constexpr bool on_device = buffer_memory_v<B> == memory_space::device;

  param_gather() = default;
  /// `consumer`: on a GPU backend, the cudaStream_t the gathered parameters are read on.
  param_gather(std::shared_ptr<const bucket_plan> plan, std::vector<request> per_bucket, void* consumer = nullptr)
      : plan_(std::move(plan)), requests_(std::move(per_bucket)), consumer_(consumer) {}
  param_gather(param_gather&&) noexcept = default;
  param_gather& operator=(param_gather&&) noexcept = default;

  /// The parameters of `param` (registration index) are gathered before what comes next reads
  /// them: the host waits, or on a GPU backend the consumer stream does.
  void wait_for(std::size_t param) {
    if (!plan_) return;
    order(requests_.at(plan_->bucket_of(param)));
  }
  /// Every parameter is gathered before what comes next reads them (as wait_for).
  void wait() {
    // Issued from the last bucket to the first: wait in issue order.
    for (std::size_t b = requests_.size(); b-- > 0;) order(requests_[b]);
  }
  /// Blocks the host until every gather has completed (the same as wait() on the host).
  void synchronize() {
    for (std::size_t b = requests_.size(); b-- > 0;) requests_[b].wait();
  }
  /// The per-bucket requests, handed over (the gather is empty afterwards).
  std::vector<request> take_requests() && {
    plan_.reset();
    return std::move(requests_);
  }
  /// True when every parameter is gathered.
  bool test() {
    bool done = true;
    for (request& r : requests_) done = r.test() && done;
    return done;
  }

 private:
  void order(request& r) {
    if constexpr (on_device) {
#if WEFT_HAS_CUDA
      r.make_stream_wait(static_cast<cudaStream_t>(consumer_));
#endif
    } else {
      r.wait();
    }
  }

  std::shared_ptr<const bucket_plan> plan_;
  std::vector<request> requests_;  ///< indexed by bucket
  void* consumer_ = nullptr;
};

}  // namespace weft::grad
