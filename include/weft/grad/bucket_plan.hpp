#pragma once
/// \file
/// The bucket plan: which parameters' gradients are reduced together, and where each gradient
/// lives in the flat gradient buffer. It is a pure function of the registered parameters and the
/// options (no communicator), so it can be tested and inspected in one process, and its
/// fingerprint lets the ranks of a group check that they planned the same thing.
///
/// Buckets are formed in reverse registration order, because backward produces the last layer's
/// gradients first: bucket 0 holds the last parameters and is ready first. The buffer is laid out
/// in bucket order, so every bucket is one contiguous slice and nothing is copied into or out of
/// buckets. A parameter never straddles two buckets.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/grad/detail/fingerprint.hpp>

namespace weft::grad {

/// A parameter as the plan sees it: a name (for errors and reports) and its number of elements.
struct param_spec {
  std::string name;
  std::size_t count = 0;
};

/// How gradients are grouped into buckets.
struct plan_options {
  /// Cap on a bucket's gradient bytes; a parameter larger than the cap gets a bucket of its own.
  std::size_t bucket_bytes = std::size_t{25} << 20;
  /// Cap on the first bucket (the last layers' gradients): small, so communication starts early.
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// Each bucket's length is rounded up to a multiple of lcm(pad_elements, dp) elements (1: only
  /// to a multiple of dp). Multiples of dp let a bucket be reduce-scattered into equal shards.
  std::size_t pad_elements = 128;
  /// The size of the group the buckets are reduced over.
  int dp = 1;
};

/// One bucket: a contiguous slice of the flat buffer.
struct bucket {
  std::size_t offset = 0;  ///< first element in the flat buffer
  std::size_t count = 0;   ///< elements, padding included (a multiple of the padding unit)
  std::size_t used = 0;    ///< elements that hold gradients; [offset + used, offset + count) is padding
  std::vector<std::size_t> params;  ///< registration indices, in the order they lie in the buffer

  /// The elements of `shard` (0..shards-1) when the bucket is split into `shards` equal parts.
  std::pair<std::size_t, std::size_t> shard(int index, int shards) const noexcept {
    std::size_t length = count / static_cast<std::size_t>(shards);
    return {offset + static_cast<std::size_t>(index) * length, length};
  }
};

class bucket_plan {
 public:
  bucket_plan() = default;

  /// Plans buckets for `params` (in registration order) whose gradients have element type `type`.
  bucket_plan(std::vector<param_spec> params, dtype type, plan_options options)
      : params_(std::move(params)), type_(type), options_(options) {
    validate();
    build();
  }

  std::span<const param_spec> params() const noexcept { return params_; }
  std::span<const bucket> buckets() const noexcept { return buckets_; }
  dtype type() const noexcept { return type_; }
  const plan_options& options() const noexcept { return options_; }

  /// Elements of the flat buffer (gradients plus padding).
  std::size_t total_elements() const noexcept { return total_; }
  /// Elements that hold gradients (the sum of the parameters' sizes).
  std::size_t used_elements() const noexcept { return used_; }
  /// The padding unit: every bucket's length is a multiple of it.
  std::size_t padding_unit() const noexcept { return unit_; }

  /// Where parameter `param` (registration index) starts in the flat buffer.
  std::size_t offset_of(std::size_t param) const { return param_offset_.at(param); }
  /// The bucket that holds parameter `param`.
  std::size_t bucket_of(std::size_t param) const { return param_bucket_.at(param); }

  /// A hash of everything that determines the plan (element type, options, every parameter's name
  /// and size, in order). Equal on two ranks exactly when they planned the same buffer.
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }

  /// A readable table of the buckets (for logs and reports).
  std::string describe() const {
    std::string out = "bucket plan: " + std::to_string(params_.size()) + " parameters, " +
                      std::to_string(buckets_.size()) + " buckets, " + std::to_string(total_) + " elements of " +
                      std::string(to_string(type_)) + " (" + std::to_string(total_ - used_) + " padding)\n";
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const bucket& k = buckets_[b];
      out += "  bucket " + std::to_string(b) + ": offset " + std::to_string(k.offset) + ", " +
             std::to_string(k.count) + " elements (" + std::to_string(k.count * size_of(type_)) + " bytes), " +
             std::to_string(k.params.size()) + " parameters: " + params_[k.params.front()].name;
      if (k.params.size() > 1) out += " .. " + params_[k.params.back()].name;
      out += "\n";
    }
    return out;
  }

 private:
  void validate() const {
    if (options_.bucket_bytes == 0) fail("bucket plan: bucket_bytes is 0; give a cap in bytes (default 25 MiB)");
    if (options_.first_bucket_bytes == 0)
      fail("bucket plan: first_bucket_bytes is 0; give a cap in bytes (default 1 MiB), or bucket_bytes to disable");
    if (options_.dp < 1)
      fail("bucket plan: dp is " + std::to_string(options_.dp) + "; it must be the group size (at least 1)");
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_[i].count == 0)
        fail("bucket plan: parameter '" + params_[i].name + "' (index " + std::to_string(i) +
             ") has 0 elements; register only parameters that have gradients");
  }

  std::size_t cap_elements(std::size_t bucket_index) const noexcept {
    std::size_t bytes = bucket_index == 0 ? options_.first_bucket_bytes : options_.bucket_bytes;
    return std::max<std::size_t>(1, bytes / size_of(type_));
  }

  void build() {
    unit_ = std::lcm(std::max<std::size_t>(1, options_.pad_elements), static_cast<std::size_t>(options_.dp));
    param_offset_.assign(params_.size(), 0);
    param_bucket_.assign(params_.size(), 0);
    bucket current;
    auto close = [&] {
      if (current.params.empty()) return;
      current.offset = total_;
      current.count = (current.used + unit_ - 1) / unit_ * unit_;
      std::size_t at = current.offset;
      for (std::size_t p : current.params) {
        param_offset_[p] = at;
        param_bucket_[p] = buckets_.size();
        at += params_[p].count;
      }
      total_ += current.count;
      used_ += current.used;
      buckets_.push_back(std::move(current));
      current = bucket{};
    };
    for (std::size_t i = params_.size(); i-- > 0;) {
      std::size_t n = params_[i].count;
      if (!current.params.empty() && current.used + n > cap_elements(buckets_.size())) close();
      current.params.push_back(i);
      current.used += n;
      if (current.used >= cap_elements(buckets_.size())) close();
    }
    close();

    detail::fingerprint_builder h;
    h.add("weft.grad.bucket_plan.v1").add(static_cast<std::uint64_t>(type_));
    h.add(options_.bucket_bytes).add(options_.first_bucket_bytes).add(options_.pad_elements);
    h.add(static_cast<std::uint64_t>(options_.dp)).add(params_.size());
    for (const param_spec& p : params_) h.add(p.name).add(p.count);
    fingerprint_ = h.value();
  }

  std::vector<param_spec> params_;
  dtype type_ = dtype::float32;
  plan_options options_;
  std::vector<bucket> buckets_;
  std::vector<std::size_t> param_offset_;
  std::vector<std::size_t> param_bucket_;
  std::size_t total_ = 0;
  std::size_t used_ = 0;
  std::size_t unit_ = 1;
  std::uint64_t fingerprint_ = 0;
};

}  // namespace weft::grad
