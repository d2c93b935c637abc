#pragma once
// What the trainer on GPUs (cuda/trainer.cpp) takes: data parallelism alone (one GPU a rank), fp32,
// the dense model, every activation and the whole optimizer state on each GPU, no checkpoints,
// validation, traces or JSON logs. A pure check of the flags and the resolved layout, so its
// messages are testable on a CPU and every rank decides alike.

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <weft/layout/layout.hpp>

#include "options.hpp"

namespace train_gpt {

/// Why the trainer on the GPU does not take this run (what to do instead), or nothing when it
/// does. `degrees` is the resolved layout (dp derived from the ranks) of `world_size` ranks.
inline std::optional<std::string> cuda_trainer_refusal(const options& o, const weft::layout::layout_spec& degrees,
                                                       int world_size) {
  const auto& d = degrees;
  if (d.tp != 1 || d.pp != 1 || d.cp != 1 || d.ep != 1 || d.virtual_stages != 1)
    return "the trainer on the GPU runs data parallelism alone (tp, pp and cp 1, one GPU a rank), and this run has " +
           std::to_string(world_size) + " ranks as tp " + std::to_string(d.tp) + " pp " + std::to_string(d.pp) +
           " dp " + std::to_string(d.dp) + " cp " + std::to_string(d.cp) +
           ": use --dp alone, or --device cpu for tensor, pipeline and context parallelism";
  if (o.model.moe_experts > 0)
    return std::string("the trainer on the GPU runs the dense model (no mixture of experts on it yet): drop "
                       "--moe-experts, or use --device cpu");
  if (o.precision != precision_kind::fp32)
    return std::string("the trainer on the GPU trains in fp32 (bf16 is not on it yet): drop --precision bf16");
  if (o.sharding != weft::tune::sharding::none || o.recompute != weft::tune::recompute::none)
    return std::string("the trainer on the GPU keeps every activation and the whole optimizer state on its GPU: drop "
                       "--sharding and --recompute, or use --device cpu");
  const std::vector<std::pair<bool, const char*>> cpu_only = {
      {o.save.has_value(), "--save"},         {o.save_dir.has_value(), "--save-dir"},
      {o.resume.has_value(), "--resume"},     {o.init_from.has_value(), "--init-from"},
      {o.val_data.has_value(), "--val-data"}, {o.trace.has_value(), "--trace"},
      {o.log_json.has_value(), "--log-json"}, {o.hardware.has_value(), "--hardware"}};
  for (const auto& [given, flag] : cpu_only)
    if (given)
      return std::string("the trainer on the GPU does not take ") + flag +
             " (checkpoints, initial weights from a file, validation, traces, JSON logs and the tuner's hardware "
             "description are the CPU trainer's): drop it, or use --device cpu";
  return std::nullopt;
}

}  // namespace train_gpt
