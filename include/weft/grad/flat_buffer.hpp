#pragma once
/// \file
/// A flat buffer laid out by a bucket plan: one contiguous allocation with a view per parameter
/// and a slice per bucket. The synchronizer keeps gradients in one; a trainer that shards its
/// optimizer state keeps its parameters in another with the same plan, so updated shards can be
/// all-gathered in place.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/grad/bucket_plan.hpp>

namespace weft::grad {

template <element T>
class flat_buffer {
 public:
  flat_buffer() = default;

  /// A zeroed buffer laid out by `plan` (whose element type must be T).
  explicit flat_buffer(std::shared_ptr<const bucket_plan> plan) : plan_(std::move(plan)) {
    if (!plan_) fail("flat_buffer: no bucket plan given");
    if (plan_->type() != dtype_of<T>)
      fail("flat_buffer: the plan is for " + std::string(to_string(plan_->type())) + " but the buffer holds " +
           std::string(to_string(dtype_of<T>)));
    data_.assign(plan_->total_elements(), T{});
  }

  const bucket_plan& plan() const noexcept { return *plan_; }
  std::shared_ptr<const bucket_plan> shared_plan() const noexcept { return plan_; }

  /// The whole buffer, padding included.
  std::span<T> all() noexcept { return data_; }
  std::span<const T> all() const noexcept { return data_; }

  /// The elements of parameter `param` (registration index).
  std::span<T> view(std::size_t param) { return std::span<T>(data_).subspan(plan_->offset_of(param), count(param)); }
  std::span<const T> view(std::size_t param) const {
    return std::span<const T>(data_).subspan(plan_->offset_of(param), count(param));
  }

  /// Bucket `index` as one slice, padding included.
  std::span<T> bucket_slice(std::size_t index) {
    const bucket& b = plan_->buckets()[index];
    return std::span<T>(data_).subspan(b.offset, b.count);
  }

  /// Sets every element (padding included) to zero.
  void zero() noexcept { std::fill(data_.begin(), data_.end(), T{}); }

 private:
  std::size_t count(std::size_t param) const {
    if (param >= plan_->params().size())
      fail("flat_buffer: parameter index " + std::to_string(param) + " is out of range (" +
           std::to_string(plan_->params().size()) + " parameters registered)");
    return plan_->params()[param].count;
  }

  std::shared_ptr<const bucket_plan> plan_;
  std::vector<T> data_;
};

}  // namespace weft::grad
