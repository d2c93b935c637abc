// Vocabulary parallelism: Megatron's padding rule and partition (pure), and the vocab-parallel
// cross-entropy on a real tp group against the whole-vocabulary loss and gradient computed on
// one rank (written out below in double, independently of weft::tp).
#include <catch2/catch.hpp>

#include <weft/tp/vocab_parallel.hpp>

#include "tp_test_support.hpp"

#include <cmath>
#include <cstdint>
#include <vector>

using namespace tp_test;
using Catch::Contains;

TEST_CASE("the vocabulary is padded to a multiple of divisible_by x tp and split into equal blocks",
          "[tp][vocab]") {
  CHECK(weft::tp::padded_vocab_size(50257, 128, 1) == 50304);  // GPT-2 in Megatron
  CHECK(weft::tp::padded_vocab_size(50257, 128, 2) == 50432);
  CHECK(weft::tp::padded_vocab_size(250, 128, 2) == 256);
  CHECK(weft::tp::padded_vocab_size(256, 128, 2) == 256);
  CHECK(weft::tp::padded_vocab_size(250, 1, 2) == 250);
  const auto last = weft::tp::partition_vocab(250, 2, 1);
  CHECK(last.per_rank == 128);
  CHECK(last.first() == 128);
  CHECK(last.real_rows() == 122);
  CHECK(last.owns(249));
  CHECK_FALSE(last.owns(250));
  CHECK_FALSE(last.owns(127));
  const auto empty = weft::tp::partition_vocab(10, 4, 3, 4);  // 16 rows, 4 a rank: rank 3 is all padding
  CHECK(empty.real_rows() == 0);
  CHECK_FALSE(empty.owns(9));
  CHECK_THROWS_WITH(weft::tp::partition_vocab(250, 2, 2), Contains("rank 2 is outside the tp group of 2"));
  CHECK_THROWS_WITH(weft::tp::padded_vocab_size(250, 0, 2), Contains("must be positive"));
}

namespace {
// The loss of each row over the whole vocabulary, and the gradient of sum x scale, in double.
void whole_cross_entropy(const std::vector<float>& logits, const std::vector<std::int32_t>& labels, std::size_t v,
                         double scale, std::vector<double>& losses, std::vector<double>& grad) {
  losses.assign(labels.size(), 0.0);
  grad.assign(logits.size(), 0.0);
  for (std::size_t t = 0; t < labels.size(); ++t) {
    double max = logits[t * v];
    for (std::size_t j = 0; j < v; ++j) max = std::max(max, static_cast<double>(logits[t * v + j]));
    double sum = 0;
    for (std::size_t j = 0; j < v; ++j) sum += std::exp(logits[t * v + j] - max);
    losses[t] = std::log(sum) + max - logits[t * v + static_cast<std::size_t>(labels[t])];
    for (std::size_t j = 0; j < v; ++j) grad[t * v + j] = scale * std::exp(logits[t * v + j] - max) / sum;
    grad[t * v + static_cast<std::size_t>(labels[t])] -= scale;
  }
}
}  // namespace

TEST_CASE("vocab-parallel cross-entropy equals the whole vocabulary's loss and gradient", "[tp][vocab]") {
  comm_t tp = tp_group();
  const int p = tp.size(), r = tp.rank();
  // 50 tokens with blocks of 4 x tp (the last rank's block part padding); 10 tokens in blocks of 4
  // (at tp 4 the last rank holds only padding).
  for (auto [vocab, divisible_by] : std::vector<std::pair<std::size_t, std::size_t>>{{50, 4}, {10, 1}}) {
    if (vocab == 10) divisible_by = 4 / static_cast<std::size_t>(p) + 1;
    CAPTURE(vocab, divisible_by);
    const std::size_t rows = 6;
    std::vector<float> logits = values(rows * vocab, 5);
    for (std::size_t i = 0; i < logits.size(); ++i) logits[i] *= 8.0f;  // a spread that a softmax notices
    std::vector<std::int32_t> labels;
    for (std::size_t t = 0; t < rows; ++t) labels.push_back(static_cast<std::int32_t>((t * 7 + 3) % vocab));
    labels[0] = static_cast<std::int32_t>(vocab - 1);  // the last real token, beside the padding
    const double scale = 0.25;
    std::vector<double> losses, grad;
    whole_cross_entropy(logits, labels, vocab, scale, losses, grad);

    const auto part = weft::tp::partition_vocab(vocab, p, r, divisible_by);
    const std::size_t cols = part.real_rows();
    std::vector<float> local(rows * cols);
    for (std::size_t t = 0; t < rows; ++t)
      for (std::size_t j = 0; j < cols; ++j) local[t * cols + j] = logits[t * vocab + part.first() + j];
    std::vector<double> got_losses(rows);
    const double total = weft::tp::vocab_parallel_cross_entropy(tp, part, std::span<float>(local), labels,
                                                                static_cast<float>(scale), got_losses);
    double want_total = 0;
    for (std::size_t t = 0; t < rows; ++t) {
      want_total += losses[t];
      CHECK(got_losses[t] == Approx(losses[t]).epsilon(1e-6));
      for (std::size_t j = 0; j < cols; ++j)
        CHECK(local[t * cols + j] == Approx(grad[t * vocab + part.first() + j]).margin(1e-6));
    }
    CHECK(total == Approx(want_total).epsilon(1e-6));
  }
}

TEST_CASE("vocab-parallel cross-entropy refuses bad labels and sizes before communicating", "[tp][vocab]") {
  comm_t tp = tp_group();
  const auto part = weft::tp::partition_vocab(50, tp.size(), tp.rank(), 4);
  std::vector<float> logits(2 * part.real_rows());
  std::vector<std::int32_t> bad{1, 50};
  CHECK_THROWS_WITH(weft::tp::vocab_parallel_cross_entropy(tp, part, std::span<float>(logits), bad, 1.0f),
                    Contains("label 50 of row 1 is outside the vocabulary of 50 tokens"));
  std::vector<std::int32_t> one{1};
  CHECK_THROWS_WITH(weft::tp::vocab_parallel_cross_entropy(tp, part, std::span<float>(logits), one, 1.0f),
                    Contains("rows x real_rows() are needed"));
  const auto other = weft::tp::partition_vocab(50, tp.size() + 1, 0, 4);
  CHECK_THROWS_WITH(weft::tp::vocab_parallel_cross_entropy(tp, other, std::span<float>(logits), bad, 1.0f),
                    Contains("partition the vocabulary for this group"));
  // The group is still usable.
  std::vector<float> ok(2 * part.real_rows(), 0.0f);
  std::vector<std::int32_t> labels{0, 49};
  const double loss = weft::tp::vocab_parallel_cross_entropy(tp, part, std::span<float>(ok), labels, 1.0f);
  CHECK(loss == Approx(2 * std::log(50.0)));
}
