#pragma once
/// \file
/// FSDP units sized by measurement: which consecutive layers share a unit, given a cap (pure: no
/// communicator; fsdp/unit_sizing.hpp measures the cap). A trainer describes its model as layers (each a unit_spec: a
/// name and its parameters, in forward order) and lets the shard group's collectives decide how
/// many consecutive layers share a unit. Every unit costs one all-gather and one reduce-scatter
/// (ZeRO-3 gathers twice), so units that are too small pay the collectives' per-call cost many
/// times, while past some size the library switches to a slower algorithm (the reason the
/// gradient synchronizer measures its bucket cap, weft/grad/bucket_sizing.hpp); and a unit's
/// gathered parameters are the memory ZeRO-3 holds per unit, so larger is not free either.
///
///   * `choose_unit_bytes` (fsdp/unit_sizing.hpp) times the shard group's all-gather and reduce-scatter (in place, in the
///     gathered element type), one after the other at each size the synchronizer's probe chooses
///     (grad::probe_search) from 256 KiB up to the layers' total size, every rank holding the same
///     curve (each size's slowest rank). A size costs its all-gather plus its reduce-scatter; the cap is the largest
///     size whose bandwidth is within the tolerance (5 %) of the best: grad::choose_bucket_bytes,
///     the synchronizer's rule. An explicit cap (anything but grad::measured_bucket_bytes) is
///     taken as it is, and nothing is timed.
///   * `group_layers` (pure) puts consecutive layers in one unit while the unit's bytes stay within
///     the cap; a layer larger than the cap is a unit of its own, and a cap below every layer gives
///     one unit per layer, as registered.

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/fsdp/unit_plan.hpp>
#include <weft/grad/bucket_plan.hpp>

namespace weft::fsdp {

/// Where a registered layer went: its unit and the index, within that unit, of its first parameter
/// (the layer's parameters follow in their own order), for unit_scope::param(p) and grad(p).
struct layer_place {
  std::size_t unit = 0;
  std::size_t first_param = 0;
};

/// Layers grouped into units.
struct layer_grouping {
  std::vector<unit_spec> units;     ///< for sharded_model::add_unit, in forward order
  std::vector<layer_place> layers;  ///< per layer, in registration order
  /// The layers of unit `u`: [first, last], in forward order.
  std::pair<std::size_t, std::size_t> layers_of(std::size_t u) const {
    if (u >= units.size())
      fail("fsdp layer grouping: unit " + std::to_string(u) + " does not exist (" + std::to_string(units.size()) +
           " units)");
    std::size_t first = layers.size(), last = 0;
    for (std::size_t l = 0; l < layers.size(); ++l)
      if (layers[l].unit == u) {
        first = std::min(first, l);
        last = l;
      }
    return {first, last};
  }
};

/// Groups consecutive `layers` (forward order) into units of at most `unit_bytes` bytes of `type`
/// each (a larger layer alone). A unit of one layer is that layer as given; a unit of several is
/// named "<first layer>..<last layer>", with parameters named "<layer>.<parameter>"
/// (unit_spec::grouped_layers), so whole tensors keep the names they have ungrouped.
inline layer_grouping group_layers(std::span<const unit_spec> layers, dtype type, std::size_t unit_bytes) {
  if (layers.empty()) fail("fsdp layer grouping: no layers given; pass every layer of the model, in forward order");
  if (unit_bytes == 0) fail("fsdp layer grouping: unit_bytes is 0; give a positive cap, or measure it");
  auto bytes_of = [&](const unit_spec& layer) {
    std::size_t n = 0;
    for (const grad::param_spec& p : layer.params) n += p.count;
    return n * size_of(type);
  };
  layer_grouping out;
  std::size_t first = 0;  // the first layer of the unit being formed
  std::size_t held = 0;   // its bytes so far
  auto close = [&](std::size_t end) {  // layers [first, end) become one unit
    if (end - first == 1) {
      out.units.push_back(layers[first]);
    } else {
      unit_spec unit{layers[first].name + ".." + layers[end - 1].name, {}, true};
      for (std::size_t l = first; l < end; ++l) {
        if (layers[l].grouped_layers)
          fail("fsdp layer grouping: layer '" + layers[l].name + "' is itself a group of layers; group the layers "
               "as registered, once");
        for (const grad::param_spec& p : layers[l].params) unit.params.push_back({layers[l].name + "." + p.name, p.count});
      }
      out.units.push_back(std::move(unit));
    }
    first = end;
    held = 0;
  };
  for (std::size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].params.empty())
      fail("fsdp layer grouping: layer '" + layers[l].name + "' has no parameters; register at least one per layer");
    const std::size_t bytes = bytes_of(layers[l]);
    if (l > first && held + bytes > unit_bytes) close(l);
    std::size_t param = 0;
    for (std::size_t k = first; k < l; ++k) param += layers[k].params.size();
    out.layers.push_back({out.units.size(), param});
    held += bytes;
  }
  close(layers.size());
  return out;
}

}  // namespace weft::fsdp
