#pragma once
/// \file
/// The FSDP unit cap measured on the shard group: its all-gather and reduce-scatter timed as a
/// pair at the sizes the synchronizer's probe chooses, and its rule applied to their sum (fsdp/unit_grouping.hpp says
/// why and groups the layers by the cap; weft/grad/bucket_sizing.hpp times the collectives).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/fsdp/unit_plan.hpp>
#include <weft/grad/bucket_cap.hpp>
#include <weft/grad/bucket_sizing.hpp>
#include <weft/grad/detail/fingerprint.hpp>
#include <weft/grad/options.hpp>

namespace weft::fsdp {

/// The unit cap for `layers` on `shard_group`: `unit_bytes` when given, otherwise measured on the
/// group's all-gather and reduce-scatter of `Param` (the rule: fsdp/unit_grouping.hpp).
/// Collective when measuring: every rank must pass the same layers and options; ranks that differ
/// stop with one message before anything is timed.
template <element Param, backend B>
grad::bucket_size_choice choose_unit_bytes(communicator<B>& shard_group, std::span<const unit_spec> layers,
                                           std::size_t unit_bytes = grad::measured_bucket_bytes,
                                           const grad::probe_options& probe = {}) {
  if (unit_bytes != grad::measured_bucket_bytes) {
    if (unit_bytes == 0) fail("fsdp unit size: unit_bytes is 0; give a positive cap, or measure it");
    grad::bucket_size_choice given;
    given.bucket_bytes = unit_bytes;
    return given;
  }
  std::size_t elements = 0;
  for (const unit_spec& layer : layers)
    for (const grad::param_spec& p : layer.params) elements += p.count;
  const std::size_t total = elements * sizeof(Param);
  grad::detail::fingerprint_builder h;
  h.add("weft.fsdp.unit_probe.v2").add(static_cast<std::uint64_t>(total)).add(probe.smallest_bytes);
  h.add(probe.largest_bytes).add(std::bit_cast<std::uint64_t>(probe.budget_s)).add(static_cast<std::uint64_t>(probe.repeats));
  h.add(probe.run_bytes).add(std::bit_cast<std::uint64_t>(probe.tolerance));
  shard_group.expect_same_on_all_ranks("the layers' total size and the fsdp unit probe's options", h.value());

  // A unit costs its all-gather and its reduce-scatter: each size is timed as the pair.
  constexpr grad::probed_collective pair[] = {grad::probed_collective::all_gather, grad::probed_collective::reduce_scatter};
  return grad::probe_collectives<Param>(shard_group, total, std::span<const grad::probed_collective>(pair), probe);
}

}  // namespace weft::fsdp
