#pragma once
/// \file
/// Whole tensors of a sharded model: the form sharded state takes in a checkpoint, so that a run
/// saved on one number of ranks resumes on another. Cutting a whole tensor into a rank's shard is
/// pure (a function of the unit layout and the rank); gathering is the sharded model's job.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <weft/core/error.hpp>
#include <weft/fsdp/unit_plan.hpp>

namespace weft::fsdp {

/// One parameter's (or one optimizer state's) values, whole, under a name that is unique in the
/// model ("<unit>.<parameter>", with a prefix such as "exp_avg." for optimizer state).
template <class T>
struct whole_tensor {
  std::string name;
  std::vector<T> values;
};

/// The name a unit's parameter has in whole-tensor form: "<unit>.<parameter>", or for a unit of
/// grouped layers the parameter's own "<layer>.<parameter>" (the same name as ungrouped).
inline std::string whole_name(std::string_view prefix, const unit_layout& unit, std::size_t param) {
  if (unit.grouped_layers()) return std::string(prefix) + unit.params()[param].name;
  return std::string(prefix) + unit.name() + "." + unit.params()[param].name;
}

/// Writes shard `rank`'s part of every parameter of `unit` from `whole` (looked up by name, with
/// `prefix`) into `shard` (the rank's shard of the unit, padding included; padding is zeroed).
template <class T>
void cut_shard(const unit_layout& unit, int rank, std::span<const whole_tensor<T>> whole, std::string_view prefix,
               std::span<T> shard) {
  if (shard.size() != unit.shard_elements())
    fail("fsdp: the shard given for unit '" + unit.name() + "' has " + std::to_string(shard.size()) +
         " elements, the layout " + std::to_string(unit.shard_elements()));
  // Every parameter is looked up, not only those in this rank's shard, so that a checkpoint
  // that does not fit is refused on every rank alike.
  std::vector<const whole_tensor<T>*> source(unit.params().size());
  for (std::size_t p = 0; p < unit.params().size(); ++p) {
    const std::string name = whole_name(prefix, unit, p);
    auto found = std::find_if(whole.begin(), whole.end(), [&](const whole_tensor<T>& w) { return w.name == name; });
    if (found == whole.end())
      fail("fsdp: no whole tensor named '" + name + "' to re-shard from (" + std::to_string(whole.size()) +
           " given); save and load the same model, or register the units under the names the checkpoint uses");
    if (found->values.size() != unit.params()[p].count)
      fail("fsdp: whole tensor '" + name + "' has " + std::to_string(found->values.size()) +
           " elements but the parameter is registered with " + std::to_string(unit.params()[p].count));
    source[p] = &*found;
  }
  std::fill(shard.begin(), shard.end(), T{});
  for (const shard_run& run : unit.runs(rank))
    std::copy_n(source[run.param]->values.begin() + static_cast<std::ptrdiff_t>(run.param_offset), run.count,
                shard.begin() + static_cast<std::ptrdiff_t>(run.shard_offset));
}

/// Cuts a unit's gathered buffer (every shard, in rank order, padding included) into whole tensors.
template <class T>
void append_whole(const unit_layout& unit, std::span<const T> gathered, std::string_view prefix,
                  std::vector<whole_tensor<T>>& out) {
  for (std::size_t p = 0; p < unit.params().size(); ++p) {
    auto first = gathered.begin() + static_cast<std::ptrdiff_t>(unit.offset_of(p));
    out.push_back({whole_name(prefix, unit, p), std::vector<T>(first, first + static_cast<std::ptrdiff_t>(unit.params()[p].count))});
  }
}

}  // namespace weft::fsdp
