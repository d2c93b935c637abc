#pragma once
/// \file
/// The shard layout of a fully sharded model: which parameters form each unit (a layer or a group
/// of layers, chosen by the trainer), where each parameter lies in its unit's flat buffer, and
/// which part of that buffer each rank of the shard group owns. Pure: no communicator, so it can
/// be inspected and tested in one process, and its fingerprint lets the ranks check that they
/// planned the same shards.
///
/// A unit's flat buffer is the gradient synchronizer's bucket plan of its parameters with the
/// whole unit in one bucket (padded to a multiple of lcm(pad_elements, shard ranks)): the same
/// layout rules, padding rules and fingerprint, and a rank's shard is the bucket's equal part.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/grad/bucket_plan.hpp>
#include <weft/grad/detail/fingerprint.hpp>

namespace weft::fsdp {

/// A unit as the trainer registers it: a name (for errors and reports) and its parameters in
/// forward order.
struct unit_spec {
  std::string name;
  std::vector<grad::param_spec> params;
  /// Several layers in one unit (fsdp/unit_grouping.hpp): each parameter is named
  /// "<layer>.<parameter>", which is also its whole-tensor name, so that checkpoints do not depend
  /// on how layers were grouped. Otherwise whole tensors are named "<unit>.<parameter>".
  bool grouped_layers = false;
};

/// A run of one parameter's elements inside a rank's shard of a unit.
struct shard_run {
  std::size_t param = 0;         ///< index of the parameter within its unit
  std::size_t shard_offset = 0;  ///< first element within the shard
  std::size_t param_offset = 0;  ///< first element within the parameter
  std::size_t count = 0;
};

/// One unit's layout.
class unit_layout {
 public:
  unit_layout() = default;
  unit_layout(unit_spec spec, dtype type, std::size_t pad_elements, int shards)
      : name_(std::move(spec.name)), shards_(shards), grouped_layers_(spec.grouped_layers) {
    if (spec.params.empty())
      fail("fsdp unit '" + name_ + "' has no parameters; register at least one parameter per unit");
    plan_ = grad::bucket_plan(std::move(spec.params), type,
                              {.bucket_bytes = std::numeric_limits<std::size_t>::max(),
                               .first_bucket_bytes = std::numeric_limits<std::size_t>::max(),
                               .pad_elements = pad_elements,
                               .dp = shards});
  }

  const std::string& name() const noexcept { return name_; }
  /// Whether the unit groups several layers (its parameters' names are their whole-tensor names).
  bool grouped_layers() const noexcept { return grouped_layers_; }
  const grad::bucket_plan& plan() const noexcept { return plan_; }
  std::span<const grad::param_spec> params() const noexcept { return plan_.params(); }
  /// Elements of the unit's gathered buffer, padding included (a multiple of the shard count).
  std::size_t padded_elements() const noexcept { return plan_.total_elements(); }
  /// Elements of one rank's shard, padding included.
  std::size_t shard_elements() const noexcept { return padded_elements() / static_cast<std::size_t>(shards_); }
  /// Where parameter `param` (index within the unit) starts in the gathered buffer.
  std::size_t offset_of(std::size_t param) const { return plan_.offset_of(param); }
  /// The first element of shard `rank` in the gathered buffer.
  std::size_t shard_offset(int rank) const noexcept { return static_cast<std::size_t>(rank) * shard_elements(); }

  /// The runs of parameters that shard `rank` holds (padding excluded), in buffer order.
  std::vector<shard_run> runs(int rank) const {
    std::vector<shard_run> out;
    const std::size_t lo = shard_offset(rank), hi = lo + shard_elements();
    for (std::size_t p = 0; p < plan_.params().size(); ++p) {
      const std::size_t begin = plan_.offset_of(p), end = begin + plan_.params()[p].count;
      const std::size_t a = std::max(lo, begin), b = std::min(hi, end);
      if (a < b) out.push_back({p, a - lo, a - begin, b - a});
    }
    return out;
  }

 private:
  std::string name_;
  int shards_ = 1;
  bool grouped_layers_ = false;
  grad::bucket_plan plan_;
};

/// The layout of every unit, in registration (forward) order.
class unit_plan {
 public:
  unit_plan() = default;

  /// Plans `units` (forward order) for element type `type` (the gathered parameters' type)
  /// sharded over `shards` ranks.
  unit_plan(std::vector<unit_spec> units, dtype type, std::size_t pad_elements, int shards) : shards_(shards) {
    if (shards < 1) fail("fsdp unit plan: the shard group has " + std::to_string(shards) + " ranks; it needs at least 1");
    if (units.empty()) fail("fsdp unit plan: no units registered; register every unit before freeze()");
    grad::detail::fingerprint_builder h;
    h.add("weft.fsdp.unit_plan.v1").add(static_cast<std::uint64_t>(units.size()));
    for (unit_spec& u : units) {
      for (const unit_layout& seen : units_)
        if (seen.name() == u.name) fail("fsdp unit plan: two units are named '" + u.name + "'; give each unit its own name");
      h.add(u.name).add(static_cast<std::uint64_t>(u.grouped_layers));
      units_.emplace_back(std::move(u), type, pad_elements, shards);
      h.add(units_.back().plan().fingerprint());
    }
    fingerprint_ = h.value();
  }

  std::span<const unit_layout> units() const noexcept { return units_; }
  const unit_layout& unit(std::size_t u) const {
    if (u >= units_.size())
      fail("fsdp unit plan: unit " + std::to_string(u) + " does not exist (" + std::to_string(units_.size()) +
           " registered)");
    return units_[u];
  }
  std::size_t size() const noexcept { return units_.size(); }
  int shards() const noexcept { return shards_; }

  /// Elements of every unit's gathered buffer, padding included (what an unsharded copy holds).
  std::size_t padded_elements() const noexcept {
    std::size_t n = 0;
    for (const unit_layout& u : units_) n += u.padded_elements();
    return n;
  }
  /// Elements of one rank's shards over every unit, padding included.
  std::size_t shard_elements() const noexcept {
    std::size_t n = 0;
    for (const unit_layout& u : units_) n += u.shard_elements();
    return n;
  }
  /// The largest unit's gathered elements.
  std::size_t largest_unit_elements() const noexcept {
    std::size_t n = 0;
    for (const unit_layout& u : units_) n = std::max(n, u.padded_elements());
    return n;
  }

  /// A hash of everything that determines the shards (units, their parameters' names and sizes,
  /// the element type, padding and shard count): equal on two ranks exactly when their shards match.
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }

 private:
  std::vector<unit_layout> units_;
  int shards_ = 1;
  std::uint64_t fingerprint_ = 0;
};

}  // namespace weft::fsdp
