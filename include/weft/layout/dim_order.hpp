#pragma once
/// \file
/// The order string of a layout ("tp-cp-ep-dp-pp"): which dimension varies fastest over ranks.

#include <weft/core/error.hpp>
#include <weft/layout/dimension.hpp>

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace weft::layout {

/// Megatron-Core's default: tensor-parallel ranks are adjacent (so a TP group stays inside a
/// node), pipeline stages are farthest apart.
inline constexpr std::string_view default_order = "tp-cp-ep-dp-pp";

/// A parsed order: every dimension exactly once, the first one varying fastest over world ranks.
/// Dimensions the text leaves out are appended in canonical order; they must have size 1, which
/// `rank_layout` checks (a dimension of size 1 has no effect wherever it stands).
class dim_order {
 public:
  /// The default order, tp-cp-ep-dp-pp.
  dim_order() noexcept : dims_(all_dims), written_(all_dims_set()) {}

  /// Parses names separated by '-'; on failure returns nothing and, if `problem` is given,
  /// stores a message that says what is wrong and how to write a valid order.
  static std::optional<dim_order> try_parse(std::string_view text, std::string* problem = nullptr) {
    auto reject = [&](const std::string& why) -> std::optional<dim_order> {
      if (problem != nullptr) {
        *problem = "order '" + std::string(text) + "' is invalid: " + why +
                   "; write the dimension names tp, cp, ep, dp, pp separated by '-', each at most once, "
                   "fastest-varying first (default " + std::string(default_order) + ")";
      }
      return std::nullopt;
    };
    dim_order result;
    result.written_ = dim_set{};
    std::size_t count = 0;
    std::size_t start = 0;
    while (start <= text.size()) {
      std::size_t end = text.find('-', start);
      if (end == std::string_view::npos) end = text.size();
      std::string_view name = text.substr(start, end - start);
      if (name.empty()) return reject(text.empty() ? std::string("it is empty") : std::string("it has an empty name"));
      std::optional<dim> d = parse_dim(name);
      if (!d) return reject("unknown dimension '" + std::string(name) + "'");
      if (result.written_.contains(*d)) return reject("dimension '" + std::string(name) + "' appears more than once");
      result.dims_[count++] = *d;
      result.written_ = result.written_.with(*d);
      start = end + 1;
    }
    for (dim d : all_dims) {
      if (!result.written_.contains(d)) result.dims_[count++] = d;
    }
    return result;
  }

  /// Parses like `try_parse`, throwing `weft::error` with the reason on failure.
  static dim_order parse(std::string_view text) {
    std::string problem;
    std::optional<dim_order> order = try_parse(text, &problem);
    if (!order) fail(problem);
    return *order;
  }

  /// All five dimensions, fastest-varying first.
  const std::array<dim, dim_count>& dims() const noexcept { return dims_; }
  /// Whether the parsed text named `d` (rather than it being appended).
  bool written(dim d) const noexcept { return written_.contains(d); }
  /// The last dimension the parsed text named (pp in the default order).
  dim last_written() const noexcept {
    dim last = dims_.front();
    for (dim d : dims_) {
      if (written_.contains(d)) last = d;
    }
    return last;
  }
  /// Place of `d` in the order, 0 for the fastest-varying.
  int position(dim d) const noexcept {
    for (int i = 0; i < dim_count; ++i) {
      if (dims_[static_cast<std::size_t>(i)] == d) return i;
    }
    return -1;
  }
  /// The full order, every dimension named: "tp-cp-ep-dp-pp".
  std::string to_string() const {
    std::string text;
    for (dim d : dims_) {
      if (!text.empty()) text += '-';
      text += weft::layout::to_string(d);
    }
    return text;
  }

  bool operator==(const dim_order& other) const noexcept { return dims_ == other.dims_; }

 private:
  static constexpr dim_set all_dims_set() noexcept { return dim_set{dim::tp, dim::cp, dim::ep, dim::dp, dim::pp}; }

  std::array<dim, dim_count> dims_;
  dim_set written_;
};

}  // namespace weft::layout
