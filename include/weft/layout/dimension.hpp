#pragma once
/// \file
/// The five parallel dimensions of a training layout, their names, and sets of them.

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace weft::layout {

/// A parallel dimension: tensor (tp), context (cp), expert (ep), data (dp) and pipeline (pp).
/// The enumerator order is the canonical one, used to append dimensions left out of an order string.
enum class dim : std::uint8_t { tp, cp, ep, dp, pp };

inline constexpr int dim_count = 5;
inline constexpr std::array<dim, dim_count> all_dims{dim::tp, dim::cp, dim::ep, dim::dp, dim::pp};

/// One value per dimension, indexed by `dim`.
template <class T>
using per_dim = std::array<T, dim_count>;

constexpr std::size_t index_of(dim d) noexcept { return static_cast<std::size_t>(d); }

/// The dimension's name as written in order strings ("tp", "cp", ...).
constexpr std::string_view to_string(dim d) noexcept {
  switch (d) {
    case dim::tp: return "tp";
    case dim::cp: return "cp";
    case dim::ep: return "ep";
    case dim::dp: return "dp";
    case dim::pp: return "pp";
  }
  return "?";
}

/// The dimension named `name`, or nothing if it names none.
constexpr std::optional<dim> parse_dim(std::string_view name) noexcept {
  for (dim d : all_dims) {
    if (to_string(d) == name) return d;
  }
  return std::nullopt;
}

/// A set of dimensions: the dimensions a group varies over (its "mask").
class dim_set {
 public:
  constexpr dim_set() noexcept = default;
  constexpr dim_set(std::initializer_list<dim> dims) noexcept {
    for (dim d : dims) bits_ = static_cast<std::uint8_t>(bits_ | bit(d));
  }

  constexpr bool contains(dim d) const noexcept { return (bits_ & bit(d)) != 0; }
  /// This set with `d` added.
  constexpr dim_set with(dim d) const noexcept {
    dim_set result = *this;
    result.bits_ = static_cast<std::uint8_t>(bits_ | bit(d));
    return result;
  }
  constexpr bool empty() const noexcept { return bits_ == 0; }
  constexpr bool operator==(const dim_set&) const noexcept = default;

 private:
  static constexpr std::uint8_t bit(dim d) noexcept { return static_cast<std::uint8_t>(1u << index_of(d)); }
  std::uint8_t bits_ = 0;
};

}  // namespace weft::layout
