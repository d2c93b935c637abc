#pragma once
// What the trainer on GPUs (cuda/trainer.cpp) takes: data, tensor (with or without sequence
// parallelism), context and pipeline parallelism (gpipe, 1f1b, interleaved; one GPU a rank), fp32
// or bf16, the dense model, every activation on each GPU and the optimizer state whole or as a
// ZeRO-1 shard, the checkpoint files of --save and --resume (without ZeRO-1); no distributed checkpoints, initial weights from a
// file, validation, traces or JSON logs. A pure check of the flags and the resolved layout, so its
// messages are testable on a CPU and every rank decides alike.

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <weft/layout/layout.hpp>
#include <weft/tp/vocab_parallel.hpp>

#include "options.hpp"

namespace train_gpt {

/// Why the trainer on the GPU does not take this run (what to do instead), or nothing when it
/// does. `degrees` is the resolved layout (dp derived from the ranks) of `world_size` ranks.
inline std::optional<std::string> cuda_trainer_refusal(const options& o, const weft::layout::layout_spec& degrees,
                                                       int world_size) {
  const auto& d = degrees;
  if (d.ep != 1)
    return "the trainer on the GPU runs data, tensor, context and pipeline parallelism (ep 1, one GPU a rank), and "
           "this run has " + std::to_string(world_size) + " ranks with ep " + std::to_string(d.ep) +
           ": drop --ep, or use --device cpu for expert parallelism";
  if (o.model.moe_experts > 0)
    return std::string("the trainer on the GPU runs the dense model (no mixture of experts on it yet): drop "
                       "--moe-experts, or use --device cpu");
  // The bf16 products read rows of 16 bytes: the hidden size and the padded vocabulary (the
  // tied output layer's width on the GPU) are multiples of 8.
  if (o.precision == precision_kind::bf16 && o.model.hidden % 8 != 0)
    return "--precision bf16 needs --hidden a multiple of 8 (the bf16 products read rows of 16 bytes), and it is " +
           std::to_string(o.model.hidden) + ": give --hidden " + std::to_string((o.model.hidden / 8 + 1) * 8) +
           ", or train in fp32";
  // Under tp the products' widths are the rank's slices: hidden / tp (and 3x, 4x it).
  if (o.precision == precision_kind::bf16 && d.tp > 1 && o.model.hidden % (8 * d.tp) != 0)
    return "--precision bf16 with --tp " + std::to_string(d.tp) + " needs --hidden a multiple of " +
           std::to_string(8 * d.tp) + " (each rank's slice, hidden / tp, is a row of the bf16 products, which read "
           "rows of 16 bytes), and it is " + std::to_string(o.model.hidden) + ": give --hidden " +
           std::to_string((o.model.hidden / (8 * d.tp) + 1) * 8 * d.tp) + ", or train in fp32";
  const long long divisor = std::max(o.model.vocab_divisible_by, 1);
  // The tied output layer's width on a rank: its block of the padded vocabulary (all of it with tp 1);
  // partition_vocab takes positive sizes only, which the options and the layout check themselves.
  if (o.precision == precision_kind::bf16 && o.model.vocab > 0 && d.tp >= 1 &&
      weft::tp::partition_vocab(static_cast<std::size_t>(o.model.vocab), d.tp, 0, static_cast<std::size_t>(divisor))
                  .per_rank % 8 != 0)
    return "--precision bf16 needs the padded vocabulary a multiple of 8 (the bf16 products read rows of 16 bytes), "
           "and --vocab " + std::to_string(o.model.vocab) + " padded to a multiple of --make-vocab-size-divisible-by " +
           std::to_string(divisor) + (d.tp > 1 ? " x tp " + std::to_string(d.tp) + " gives each rank a block that" : "") +
           " is not: give --make-vocab-size-divisible-by 8 (or a multiple of it), or train in fp32";
  const std::vector<std::pair<bool, const char*>> cpu_only = {
      {o.save_dir.has_value(), "--save-dir"}, {o.init_from.has_value(), "--init-from"},
      {o.val_data.has_value(), "--val-data"}, {o.trace.has_value(), "--trace"},
      {o.log_json.has_value(), "--log-json"}, {o.hardware.has_value(), "--hardware"}};
  for (const auto& [given, flag] : cpu_only)
    if (given)
      return std::string("the trainer on the GPU does not take ") + flag +
             " (distributed checkpoints, initial weights from a file, validation, traces, JSON logs and the tuner's "
             "hardware description are the CPU trainer's; it saves and resumes with --save and --resume FILE): drop "
             "it, or use --device cpu";
  return std::nullopt;
}

}  // namespace train_gpt
