#pragma once
// Which parameters a rank holds, and how each relates to the whole tensor in a checkpoint: a
// pure description of the model's parameters for a layout (no communication, no arithmetic).
//
// Names and whole shapes are Hugging Face GPT-2's; linear weights are (in, out) as its Conv1D
// stores them. Tensor parallelism (Megatron) splits c_attn and c_fc by output columns (c_attn
// per head, so each of q, k, v keeps the rank's heads), c_proj by input rows, and replicates the
// rest; the token embedding (and the tied output layer) is split by vocabulary rows
// (weft::tp::partition_vocab: Megatron's padding to a multiple of 128 x tp, the padded rows
// zero, never in a checkpoint). Pipeline parallelism gives virtual stage s = chunk * pp + pp_rank the layers
// [s * L / (pp * vp), (s + 1) * L / (pp * vp)); the first virtual stage holds the embeddings, the
// last the final layer norm and, with pp > 1, its own copy of the tied token embedding. An MoE
// block's experts are held by their ep rank alone (rank r of ep: experts r * E / ep ..), whole.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <weft/checkpoint/detail/distributed_plan.hpp>
#include <weft/tp/vocab_parallel.hpp>

#include "gpt_config.hpp"

namespace train_gpt {

/// A parameter group's use as a model announces it (gpt_model::on_scope on the CPU, the GPU
/// trainer's model alike), for sharded training to open and close the units holding the group.
/// A group is a block's index, `head_group` (the final norm and the output layer) or
/// `embedding_group` (the token and position embeddings).
enum class scope_event { enter_forward, leave_forward, enter_backward, leave_backward };
inline constexpr int head_group = -2, embedding_group = -1;

/// How a parameter's local part is cut from the whole tensor.
enum class tp_split {
  replicated,  ///< the whole tensor on every tp rank
  columns,     ///< the last dimension, in `blocks` equal blocks each split over tp (q|k|v: 3)
  rows,        ///< the first dimension
  vocab_rows,  ///< the first dimension, padded by weft::tp::partition_vocab (the whole tensor has the true rows)
};

enum class param_role : std::uint8_t {
  wte, wpe, ln_1_w, ln_1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln_2_w, ln_2_b, fc_w, fc_b, mlp_proj_w,
  mlp_proj_b, ln_f_w, ln_f_b,
  // a mixture-of-experts block's MLP (moe_block.hpp): the router and each expert's GPT-2 MLP
  router_w, expert_fc_w, expert_fc_b, expert_proj_w, expert_proj_b
};

struct param_spec {
  std::string name;                   // the checkpoint name, e.g. "h.3.attn.c_attn.weight"
  param_role role;
  int layer = -1;                     // -1 for embeddings and ln_f
  int chunk = 0;                      // this rank's model chunk that holds it
  std::vector<std::int64_t> whole;    // the whole tensor's shape
  tp_split split = tp_split::replicated;
  int blocks = 1;
  std::size_t local_elements = 0;     // on this rank
  std::int64_t padded_rows = 0;       // vocab_rows: the padded first dimension
  bool decay = false;                 // AdamW weight decay: matrices and embeddings, not biases and norms
  int expert = -1;                    // an MoE expert's index (its tensors whole on the expert's ep rank)
};

/// Whether `p` belongs to an MoE block's MLP, whose gradients are whole on every tp rank (each tp
/// rank routes the same rows), also with sequence parallelism.
inline bool moe_param(const param_spec& p) noexcept { return p.role >= param_role::router_w; }

inline std::int64_t elements_of(std::span<const std::int64_t> shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

/// This rank's place in the model: its tp rank and size, its pipeline position, and its ep rank
/// and size (which MoE experts it holds).
struct model_place {
  int tp_rank = 0, tp = 1;
  int pp_rank = 0, pp = 1, vp = 1;
  int ep_rank = 0, ep = 1;

  int virtual_stage(int chunk) const noexcept { return chunk * pp + pp_rank; }
  bool first_stage(int chunk) const noexcept { return virtual_stage(chunk) == 0; }
  bool last_stage(int chunk) const noexcept { return virtual_stage(chunk) == pp * vp - 1; }
  int layers_per_stage(const gpt_config& m) const noexcept { return m.layers / (pp * vp); }
  int first_layer(const gpt_config& m, int chunk) const noexcept { return virtual_stage(chunk) * layers_per_stage(m); }
};

/// This rank's block of the vocabulary: the rows of wte it holds.
inline weft::tp::vocab_partition vocab_partition_of(const gpt_config& m, const model_place& at) {
  return weft::tp::partition_vocab(static_cast<std::size_t>(m.vocab), at.tp, at.tp_rank,
                                   static_cast<std::size_t>(m.vocab_divisible_by));
}

/// The parameters this rank holds, in forward order (chunk by chunk): the order gradients are
/// registered with the synchronizer and buckets are planned in.
inline std::vector<param_spec> rank_parameters(const gpt_config& m, const model_place& at) {
  std::vector<param_spec> out;
  const std::int64_t c = m.hidden;
  auto add = [&](std::string name, param_role role, int layer, int chunk, std::vector<std::int64_t> whole,
                 tp_split split, int blocks = 1, int expert = -1) {
    param_spec p{std::move(name), role, layer, chunk, std::move(whole), split, blocks, 0, 0, false, expert};
    std::int64_t n = elements_of(p.whole);
    if (split == tp_split::vocab_rows) {
      p.padded_rows = static_cast<std::int64_t>(vocab_partition_of(m, at).padded);
      n = p.padded_rows / at.tp * c;
    } else if (split != tp_split::replicated) {
      n /= at.tp;
    }
    p.local_elements = static_cast<std::size_t>(n);
    p.decay = p.whole.size() == 2;
    out.push_back(std::move(p));
  };
  // The last stage's copy of the tied embedding comes first: its gradient is final only after the
  // whole pipeline step (it is summed with the first stage's), so it belongs in the last bucket.
  if (at.pp > 1 && at.last_stage(at.vp - 1))
    add("wte.weight", param_role::wte, -1, at.vp - 1, {m.vocab, c}, tp_split::vocab_rows);
  for (int chunk = 0; chunk < at.vp; ++chunk) {
    if (at.first_stage(chunk)) {
      add("wte.weight", param_role::wte, -1, chunk, {m.vocab, c}, tp_split::vocab_rows);
      add("wpe.weight", param_role::wpe, -1, chunk, {m.positions, c}, tp_split::replicated);
    }
    const int first = at.first_layer(m, chunk);
    for (int l = first; l < first + at.layers_per_stage(m); ++l) {
      const std::string h = "h." + std::to_string(l) + ".";
      add(h + "ln_1.weight", param_role::ln_1_w, l, chunk, {c}, tp_split::replicated);
      add(h + "ln_1.bias", param_role::ln_1_b, l, chunk, {c}, tp_split::replicated);
      add(h + "attn.c_attn.weight", param_role::attn_w, l, chunk, {c, 3 * c}, tp_split::columns, 3);
      add(h + "attn.c_attn.bias", param_role::attn_b, l, chunk, {3 * c}, tp_split::columns, 3);
      add(h + "attn.c_proj.weight", param_role::attn_proj_w, l, chunk, {c, c}, tp_split::rows);
      add(h + "attn.c_proj.bias", param_role::attn_proj_b, l, chunk, {c}, tp_split::replicated);
      add(h + "ln_2.weight", param_role::ln_2_w, l, chunk, {c}, tp_split::replicated);
      add(h + "ln_2.bias", param_role::ln_2_b, l, chunk, {c}, tp_split::replicated);
      if (m.moe_layer(l)) {
        add(h + "mlp.router.weight", param_role::router_w, l, chunk, {m.moe_experts, c}, tp_split::replicated);
        const int local = m.moe_experts / at.ep;  // this ep rank's experts (weft::moe's split)
        for (int e = at.ep_rank * local; e < (at.ep_rank + 1) * local; ++e) {
          const std::string x = h + "mlp.experts." + std::to_string(e) + ".";
          add(x + "c_fc.weight", param_role::expert_fc_w, l, chunk, {c, 4 * c}, tp_split::replicated, 1, e);
          add(x + "c_fc.bias", param_role::expert_fc_b, l, chunk, {4 * c}, tp_split::replicated, 1, e);
          add(x + "c_proj.weight", param_role::expert_proj_w, l, chunk, {4 * c, c}, tp_split::replicated, 1, e);
          add(x + "c_proj.bias", param_role::expert_proj_b, l, chunk, {c}, tp_split::replicated, 1, e);
        }
        continue;
      }
      add(h + "mlp.c_fc.weight", param_role::fc_w, l, chunk, {c, 4 * c}, tp_split::columns);
      add(h + "mlp.c_fc.bias", param_role::fc_b, l, chunk, {4 * c}, tp_split::columns);
      add(h + "mlp.c_proj.weight", param_role::mlp_proj_w, l, chunk, {4 * c, c}, tp_split::rows);
      add(h + "mlp.c_proj.bias", param_role::mlp_proj_b, l, chunk, {c}, tp_split::replicated);
    }
    if (at.last_stage(chunk)) {
      add("ln_f.weight", param_role::ln_f_w, -1, chunk, {c}, tp_split::replicated);
      add("ln_f.bias", param_role::ln_f_b, -1, chunk, {c}, tp_split::replicated);
    }
  }
  return out;
}

/// The whole model's tensors in checkpoint order (GPT-2's), with their whole shapes.
inline std::vector<param_spec> whole_parameters(const gpt_config& m) { return rank_parameters(m, model_place{}); }

/// Calls `copy(whole_offset, local_offset, count)` for every run of elements that the local part
/// of `p` on tp rank `tp_rank` of `tp` shares with the whole tensor (row-major both).
template <class Copy>
void for_each_local_run(const param_spec& p, int tp_rank, int tp, Copy&& copy) {
  const std::size_t whole = static_cast<std::size_t>(elements_of(p.whole));
  switch (p.split) {
    case tp_split::replicated: copy(std::size_t{0}, std::size_t{0}, whole); return;
    case tp_split::rows: {
      const std::size_t rows = static_cast<std::size_t>(p.whole[0]) / static_cast<std::size_t>(tp);
      const std::size_t row = whole / static_cast<std::size_t>(p.whole[0]);
      copy(static_cast<std::size_t>(tp_rank) * rows * row, std::size_t{0}, rows * row);
      return;
    }
    case tp_split::vocab_rows: {  // the real rows of the rank's block; its padding has no whole elements
      const std::size_t row = whole / static_cast<std::size_t>(p.whole[0]);
      const weft::tp::vocab_partition part{.vocab = static_cast<std::size_t>(p.whole[0]),
                                           .padded = static_cast<std::size_t>(p.padded_rows),
                                           .per_rank = static_cast<std::size_t>(p.padded_rows) / static_cast<std::size_t>(tp),
                                           .tp = tp,
                                           .rank = tp_rank};
      if (part.real_rows() > 0) copy(part.first() * row, std::size_t{0}, part.real_rows() * row);
      return;
    }
    case tp_split::columns: {
      const std::size_t cols = static_cast<std::size_t>(p.whole.back());
      const std::size_t rows = whole / cols;
      const std::size_t block = cols / static_cast<std::size_t>(p.blocks);
      const std::size_t part = block / static_cast<std::size_t>(tp);
      const std::size_t local_cols = part * static_cast<std::size_t>(p.blocks);
      for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t b = 0; b < static_cast<std::size_t>(p.blocks); ++b)
          copy(r * cols + b * block + static_cast<std::size_t>(tp_rank) * part, r * local_cols + b * part, part);
      return;
    }
  }
}

/// The shape of the local part of `p` on a rank of `tp` (vocab rows: padding included).
inline std::vector<std::int64_t> local_shape(const param_spec& p, int tp) {
  std::vector<std::int64_t> shape = p.whole;
  if (p.split == tp_split::rows) shape[0] /= tp;
  if (p.split == tp_split::vocab_rows) shape[0] = p.padded_rows / tp;
  if (p.split == tp_split::columns) shape.back() /= tp;
  return shape;
}

/// A box of a parameter's local part and the box of the whole tensor that holds the same
/// elements (row-major in both).
struct held_box {
  weft::checkpoint::region local;
  weft::checkpoint::region whole;
};

/// A run of one parameter's local elements in a state a rank holds (its parameters, a ZeRO or
/// FSDP shard, AdamW's moments): local elements [param_offset, param_offset + values.size()) of
/// parameter `param` (rank_parameters order).
template <class T>
struct param_run {
  std::size_t param = 0;
  std::size_t param_offset = 0;
  std::span<T> values;
};

/// The boxes of the whole tensor that local elements [begin, end) (row-major) of `p` on tp rank
/// `tp_rank` hold, in local order: how a tp slice, or a ZeRO / FSDP shard of one, becomes pieces
/// of a distributed checkpoint. A column split's local part is `blocks` column blocks, each from
/// its own place in the whole tensor (c_attn's q, k and v), so a box never spans two blocks; the
/// vocabulary's padding rows hold no whole elements and give no box.
inline std::vector<held_box> whole_boxes(const param_spec& p, int tp_rank, int tp, std::int64_t begin, std::int64_t end) {
  namespace ckpt = weft::checkpoint;
  const std::vector<std::int64_t> shape = local_shape(p, tp);
  ckpt::region real = ckpt::whole_region(shape);
  std::int64_t first_row = 0;  // the whole tensor's row of local row 0 (row splits)
  if (p.split == tp_split::rows) first_row = shape[0] * tp_rank;
  if (p.split == tp_split::vocab_rows) {
    const weft::tp::vocab_partition part{.vocab = static_cast<std::size_t>(p.whole[0]),
                                         .padded = static_cast<std::size_t>(p.padded_rows),
                                         .per_rank = static_cast<std::size_t>(shape[0]),
                                         .tp = tp,
                                         .rank = tp_rank};
    first_row = static_cast<std::int64_t>(part.first());
    real.extent[0] = static_cast<std::int64_t>(part.real_rows());  // the real rows come first
  }
  const std::int64_t real_elements = ckpt::element_count(real);
  end = std::min(end, real_elements);
  std::vector<held_box> out;
  if (begin >= end) return out;
  for (ckpt::region& box : ckpt::regions_of_flat_range(real, begin, end)) {
    if (p.split != tp_split::columns) {
      ckpt::region whole = box;
      if (!whole.offset.empty()) whole.offset[0] += first_row;
      out.push_back({std::move(box), std::move(whole)});
      continue;
    }
    // Local columns [b * part, (b + 1) * part) are whole columns [b * block + tp_rank * part, ...).
    const std::size_t last = shape.size() - 1;
    const std::int64_t part = shape[last] / p.blocks, block = p.whole[last] / p.blocks;
    for (std::int64_t b = 0; b < p.blocks; ++b) {
      const std::int64_t low = std::max(box.offset[last], b * part);
      const std::int64_t high = std::min(box.offset[last] + box.extent[last], (b + 1) * part);
      if (low >= high) continue;
      ckpt::region local = box;
      local.offset[last] = low;
      local.extent[last] = high - low;
      ckpt::region whole = local;
      whole.offset[last] = b * block + tp_rank * part + (low - b * part);
      out.push_back({std::move(local), std::move(whole)});
    }
  }
  return out;
}

/// The local part of `p` from its whole tensor.
inline void cut_local(const param_spec& p, int tp_rank, int tp, std::span<const float> whole, std::span<float> local) {
  for_each_local_run(p, tp_rank, tp, [&](std::size_t w, std::size_t l, std::size_t n) {
    std::copy(whole.begin() + static_cast<std::ptrdiff_t>(w), whole.begin() + static_cast<std::ptrdiff_t>(w + n),
              local.begin() + static_cast<std::ptrdiff_t>(l));
  });
}
/// Writes the local part of `p` into its place in the whole tensor.
inline void place_local(const param_spec& p, int tp_rank, int tp, std::span<const float> local, std::span<float> whole) {
  for_each_local_run(p, tp_rank, tp, [&](std::size_t w, std::size_t l, std::size_t n) {
    std::copy(local.begin() + static_cast<std::ptrdiff_t>(l), local.begin() + static_cast<std::ptrdiff_t>(l + n),
              whole.begin() + static_cast<std::ptrdiff_t>(w));
  });
}

}  // namespace train_gpt
