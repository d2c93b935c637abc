#pragma once
/// \file
/// Vocabulary parallelism (Megatron-Core's VocabParallelEmbedding and vocab-parallel
/// cross-entropy): each rank of a tp group holds a contiguous block of the vocabulary's rows of
/// the token embedding (and of the tied output layer), so no rank ever holds or computes
/// full-vocabulary logits.
///
///  - `partition_vocab`: the vocabulary padded to a multiple of `divisible_by` x tp (Megatron's
///    `--make-vocab-size-divisible-by`, 128 by default) so every rank holds the same number of
///    rows; rank r holds padded rows [r * per_rank, (r + 1) * per_rank), of which the first
///    `real_rows()` are real tokens and the rest padding.
///  - `vocab_parallel_cross_entropy`: the loss of rows whose logits are split by vocabulary over
///    the tp group. The row maxima are all-reduced (max), then the sums of exponentials and the
///    target logits (picked by the rank that owns each label) in one all-reduce (sum); each
///    rank then turns its own logits into their gradient. Padding takes no part: a rank passes
///    only the logits of its real rows, so padded rows get no probability and no gradient.
///
/// Pure planning (the partition) needs no communicator; the cross-entropy works on host memory
/// with any backend's communicator (MPI; NCCL with host-visible buffers is not supported here).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/core/error.hpp>

namespace weft::tp {

/// Megatron's padding rule: `vocab` rounded up to a multiple of `divisible_by` x `tp`.
inline std::size_t padded_vocab_size(std::size_t vocab, std::size_t divisible_by, int tp) {
  if (vocab == 0 || divisible_by == 0 || tp < 1)
    fail("padded_vocab_size: the vocabulary (" + std::to_string(vocab) + "), the multiple (" +
         std::to_string(divisible_by) + ") and tp (" + std::to_string(tp) + ") must be positive");
  const std::size_t multiple = divisible_by * static_cast<std::size_t>(tp);
  return (vocab + multiple - 1) / multiple * multiple;
}

/// One tp rank's block of a padded vocabulary.
struct vocab_partition {
  std::size_t vocab = 0;     ///< the true vocabulary size
  std::size_t padded = 0;    ///< padded to a multiple of divisible_by x tp
  std::size_t per_rank = 0;  ///< padded / tp: the rows every rank holds
  int tp = 1, rank = 0;

  /// The first token id of this rank's block.
  std::size_t first() const noexcept { return static_cast<std::size_t>(rank) * per_rank; }
  /// Rows of this rank's block that are real tokens (the rest is padding): per_rank, fewer on
  /// the rank where the vocabulary ends, 0 on ranks wholly in the padding.
  std::size_t real_rows() const noexcept {
    return vocab <= first() ? 0 : std::min(per_rank, vocab - first());
  }
  /// Whether token id `token` falls in this rank's block.
  bool owns(std::int64_t token) const noexcept {
    return token >= 0 && static_cast<std::size_t>(token) >= first() &&
           static_cast<std::size_t>(token) < first() + real_rows();
  }
};

/// Rank `rank`'s block of `vocab` tokens over `tp` ranks, padded by Megatron's rule.
inline vocab_partition partition_vocab(std::size_t vocab, int tp, int rank, std::size_t divisible_by = 128) {
  if (rank < 0 || rank >= tp)
    fail("partition_vocab: rank " + std::to_string(rank) + " is outside the tp group of " + std::to_string(tp));
  const std::size_t padded = padded_vocab_size(vocab, divisible_by, tp);
  return {.vocab = vocab, .padded = padded, .per_rank = padded / static_cast<std::size_t>(tp), .tp = tp, .rank = rank};
}

/// e^x through std::exp (the default of vocab_parallel_cross_entropy; a caller may pass a faster one).
struct standard_exp {
  float operator()(float x) const noexcept { return std::exp(x); }
};

/// The cross-entropy of `labels.size()` rows whose logits are split by vocabulary over `tp`
/// (collective: every rank of `tp` calls it with the same rows and labels). `logits` holds this
/// rank's real columns, [rows, part.real_rows()] row-major, and is overwritten with the gradient
/// of (sum of the rows' losses) x `scale`. `row_losses` (size rows, or empty) receives each row's
/// loss; the sum of all rows' losses is returned (the same on every rank). Sums of exponentials
/// are kept in double. Throws, before any communication, on a label outside the vocabulary or
/// sizes that disagree.
template <backend B, class Exp = standard_exp>
double vocab_parallel_cross_entropy(communicator<B>& tp, const vocab_partition& part, std::span<float> logits,
                                    std::span<const std::int32_t> labels, float scale,
                                    std::span<double> row_losses = {}, Exp exp = {}) {
  const std::size_t rows = labels.size(), cols = part.real_rows();
  const std::string where = "vocab_parallel_cross_entropy on group '" + tp.name() + "' (rank " +
                            std::to_string(tp.rank()) + " of " + std::to_string(tp.size()) + ")";
  if (tp.size() != part.tp || tp.rank() != part.rank)
    fail(where + ": the partition is for rank " + std::to_string(part.rank) + " of " + std::to_string(part.tp) +
         "; partition the vocabulary for this group");
  if (logits.size() != rows * cols)
    fail(where + ": " + std::to_string(logits.size()) + " logits for " + std::to_string(rows) + " rows of this rank's " +
         std::to_string(cols) + " vocabulary entries (rows x real_rows() are needed)");
  if (!row_losses.empty() && row_losses.size() != rows)
    fail(where + ": row_losses has " + std::to_string(row_losses.size()) + " entries for " + std::to_string(rows) +
         " rows");
  for (std::size_t t = 0; t < rows; ++t)
    if (labels[t] < 0 || static_cast<std::size_t>(labels[t]) >= part.vocab)
      fail(where + ": label " + std::to_string(labels[t]) + " of row " + std::to_string(t) +
           " is outside the vocabulary of " + std::to_string(part.vocab) + " tokens");
  // Each row's maximum over the whole vocabulary (a rank without real rows offers the lowest float).
  std::vector<float> max(rows, std::numeric_limits<float>::lowest());
  for (std::size_t t = 0; t < rows; ++t)
    if (cols > 0) max[t] = *std::max_element(logits.begin() + static_cast<std::ptrdiff_t>(t * cols),
                                             logits.begin() + static_cast<std::ptrdiff_t>((t + 1) * cols));
  tp.all_reduce(std::span<float>(max), reduce_op::max);
  // Per row: the sum of exponentials, and the target logit (from its owner; 0 elsewhere).
  std::vector<double> sums(2 * rows, 0.0);
  const std::size_t first = part.first();
  for (std::size_t t = 0; t < rows; ++t) {
    float* row = logits.data() + t * cols;
    if (part.owns(labels[t])) sums[rows + t] = static_cast<double>(row[static_cast<std::size_t>(labels[t]) - first]);
    for (std::size_t j = 0; j < cols; ++j) row[j] = exp(row[j] - max[t]);
    double sum = 0;
    for (std::size_t j = 0; j < cols; ++j) sum += static_cast<double>(row[j]);
    sums[t] = sum;
  }
  tp.all_reduce(std::span<double>(sums));
  double total = 0;
  for (std::size_t t = 0; t < rows; ++t) {
    const double loss = std::log(sums[t]) + static_cast<double>(max[t]) - sums[rows + t];
    if (!row_losses.empty()) row_losses[t] = loss;
    total += loss;
    float* row = logits.data() + t * cols;
    const float to_probability = static_cast<float>(static_cast<double>(scale) / sums[t]);
    for (std::size_t j = 0; j < cols; ++j) row[j] *= to_probability;
    if (part.owns(labels[t])) row[static_cast<std::size_t>(labels[t]) - first] -= scale;
  }
  return total;
}

}  // namespace weft::tp
