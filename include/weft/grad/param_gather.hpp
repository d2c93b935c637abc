#pragma once
/// \file
/// The all-gather of updated parameters after a sharded (ZeRO-1) optimizer step, one bucket at a
/// time in forward order (the first layers' bucket first), so the next forward can start on the
/// first layers while later buckets are still in flight.

#include <cstddef>
#include <memory>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/grad/bucket_plan.hpp>

namespace weft::grad {

template <backend B>
class param_gather {
 public:
  using request = typename B::request;

  param_gather() = default;
  param_gather(std::shared_ptr<const bucket_plan> plan, std::vector<request> per_bucket)
      : plan_(std::move(plan)), requests_(std::move(per_bucket)) {}
  param_gather(param_gather&&) noexcept = default;
  param_gather& operator=(param_gather&&) noexcept = default;

  /// Blocks until the parameters of `param` (registration index) are gathered.
  void wait_for(std::size_t param) {
    if (!plan_) return;
    requests_.at(plan_->bucket_of(param)).wait();
  }
  /// Blocks until every parameter is gathered.
  void wait() {
    // Issued from the last bucket to the first: wait in issue order.
    for (std::size_t b = requests_.size(); b-- > 0;) requests_[b].wait();
  }
  /// True when every parameter is gathered.
  bool test() {
    bool done = true;
    for (request& r : requests_) done = r.test() && done;
    return done;
  }

 private:
  std::shared_ptr<const bucket_plan> plan_;
  std::vector<request> requests_;  ///< indexed by bucket
};

}  // namespace weft::grad
