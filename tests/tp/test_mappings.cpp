// Every tp mapping on a real group against the same data handled on one rank: scatter and gather
// along each dimension of a 3-d tensor, copy_to / reduce_from (f and g), the sequence-parallel
// all-gather / reduce-scatter and their backward counterparts, and the errors (raised before
// anything is sent, the group usable afterwards).
#include <catch2/catch.hpp>

#include <weft/tp/mappings.hpp>

#include "tp_test_support.hpp"

#include <string>
#include <vector>

using namespace tp_test;
using weft::tp::tensor_view;
using Catch::Contains;

namespace {

// A 12 x 12 x 12 tensor (12 divides by 2, 3 and 4); rank-dependent when `rank` >= 0.
const std::vector<std::size_t> shape3 = {12, 12, 12};

std::vector<float> tensor_of(int rank) { return values(12 * 12 * 12, 3 + rank); }

// Part `part` of `parts` along `dim`, cut out on one rank by index arithmetic.
std::vector<float> slice(const std::vector<float>& full, std::size_t dim, std::size_t part, std::size_t parts) {
  std::vector<float> out;
  const std::size_t n = shape3[dim] / parts;
  for (std::size_t a = 0; a < 12; ++a)
    for (std::size_t b = 0; b < 12; ++b)
      for (std::size_t c = 0; c < 12; ++c) {
        const std::size_t index[3] = {a, b, c};
        if (index[dim] / n == part) out.push_back(full[(a * 12 + b) * 12 + c]);
      }
  return out;
}

}  // namespace

TEST_CASE("scatter_to / gather_from along each dimension match one-rank slicing", "[tp][mappings]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  const std::vector<float> full = tensor_of(-1);  // the same on every rank
  for (std::size_t dim = 0; dim < 3; ++dim) {
    CAPTURE(dim);
    std::vector<float> shard(full.size() / p);
    weft::tp::scatter_to_tp_region(tp, tensor_view<const float>(std::span<const float>(full), shape3),
                                   std::span<float>(shard), dim);
    CHECK(shard == slice(full, dim, r, p));

    std::vector<std::size_t> shard_shape = shape3;
    shard_shape[dim] /= p;
    std::vector<float> gathered(full.size(), -99.0f);
    weft::tp::gather_from_tp_region(tp, tensor_view<const float>(std::span<const float>(shard), shard_shape),
                                    std::span<float>(gathered), dim);
    CHECK(gathered == full);

    // Backward forms: scatter's backward gathers, gather's backward keeps this rank's part.
    std::vector<float> grad_full(full.size());
    weft::tp::scatter_to_tp_region_backward(tp, tensor_view<const float>(std::span<const float>(shard), shard_shape),
                                            std::span<float>(grad_full), dim);
    CHECK(grad_full == full);
    std::vector<float> grad_shard(shard.size());
    weft::tp::gather_from_tp_region_backward(tp, tensor_view<const float>(std::span<const float>(full), shape3),
                                             std::span<float>(grad_shard), dim);
    CHECK(grad_shard == shard);

    // A caller's workspace gives the same result as the internal one.
    std::vector<float> workspace(full.size());
    std::vector<float> again(full.size());
    weft::tp::gather_from_tp_region(tp, tensor_view<const float>(std::span<const float>(shard), shard_shape),
                                    std::span<float>(again), dim, std::span<float>(workspace));
    CHECK(again == full);
  }
}

TEST_CASE("copy_to and reduce_from: identity one way, the sum over ranks the other", "[tp][mappings]") {
  comm_t tp = tp_group();
  std::vector<float> mine = tensor_of(tp.rank());
  std::vector<float> sum(mine.size(), 0.0f);
  for (int q = 0; q < tp.size(); ++q) {
    const std::vector<float> theirs = tensor_of(q);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += theirs[i];
  }
  tensor_view<float> view(std::span<float>(mine), shape3);
  auto same = weft::tp::copy_to_tp_region(tp, view);
  CHECK(same.data.data() == mine.data());
  auto same_back = weft::tp::reduce_from_tp_region_backward(tp, view);
  CHECK(same_back.data.data() == mine.data());

  std::vector<float> grad = mine;
  weft::tp::copy_to_tp_region_backward(tp, std::span<float>(grad));
  CHECK(close(grad, sum));
  std::vector<float> out = mine;
  weft::tp::reduce_from_tp_region(tp, std::span<float>(out));
  CHECK(close(out, sum));
}

TEST_CASE("sequence parallelism: all-gather and reduce-scatter along the sequence, and their backward",
          "[tp][sp]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  const auto r = static_cast<std::size_t>(tp.rank());
  const std::vector<float> mine = tensor_of(tp.rank());
  std::vector<float> sum(mine.size(), 0.0f);
  for (int q = 0; q < tp.size(); ++q) {
    const std::vector<float> theirs = tensor_of(q);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += theirs[i];
  }
  // Dimension 0 is Megatron's [s, b, h]; dimension 1 a [b, s, h] layout.
  for (std::size_t seq_dim : {std::size_t{0}, std::size_t{1}}) {
    CAPTURE(seq_dim);
    std::vector<std::size_t> local_shape = shape3;
    local_shape[seq_dim] /= p;
    const std::vector<float> expected_shard = slice(sum, seq_dim, r, p);

    // After a row-parallel layer: partial sums -> this rank's sequence shard of the total.
    std::vector<float> local(mine.size() / p);
    weft::tp::reduce_scatter_sequence(tp, tensor_view<const float>(std::span<const float>(mine), shape3),
                                      std::span<float>(local), seq_dim);
    CHECK(close(local, expected_shard));
    // Its backward: every rank's shard gathered back into the whole sequence.
    std::vector<float> whole(mine.size());
    weft::tp::reduce_scatter_sequence_backward(tp, tensor_view<const float>(std::span<const float>(local), local_shape),
                                               std::span<float>(whole), seq_dim);
    CHECK(close(whole, sum));

    // Before a column-parallel layer: the shards gathered; backward reduce-scatters the gradient.
    const std::vector<float> my_shard = slice(mine, seq_dim, r, p);
    std::vector<float> gathered(mine.size());
    weft::tp::all_gather_sequence(tp, tensor_view<const float>(std::span<const float>(my_shard), local_shape),
                                  std::span<float>(gathered), seq_dim);
    for (std::size_t q = 0; q < p; ++q) CHECK(slice(gathered, seq_dim, q, p) == slice(tensor_of(static_cast<int>(q)), seq_dim, q, p));
    std::vector<float> grad_local(mine.size() / p);
    weft::tp::all_gather_sequence_backward(tp, tensor_view<const float>(std::span<const float>(mine), shape3),
                                           std::span<float>(grad_local), seq_dim);
    CHECK(close(grad_local, expected_shard));
  }
}

TEST_CASE("mapping errors say what is wrong before anything is sent", "[tp][errors]") {
  comm_t tp = tp_group();
  const auto p = static_cast<std::size_t>(tp.size());
  std::vector<float> odd(5 * 12);  // 5 rows divide by none of 2, 3, 4
  std::vector<float> out(odd.size());
  auto odd_view = tensor_view<const float>(std::span<const float>(odd), {5, 12});
  CHECK_THROWS_WITH(weft::tp::scatter_to_tp_region(tp, odd_view, std::span<float>(out).first(12), 0),
                    Contains("scatter_to_tp_region on group 'tp'") && Contains("5 rows, not a multiple of the group size " + std::to_string(p)));
  CHECK_THROWS_WITH(weft::tp::reduce_scatter_sequence(tp, odd_view, std::span<float>(out).first(12), 0),
                    Contains("not a multiple of the group size"));
  CHECK_THROWS_WITH(weft::tp::gather_from_tp_region(tp, odd_view, std::span<float>(out), 2),
                    Contains("dimension 2 does not exist in a tensor of shape [5, 12]"));
  CHECK_THROWS_WITH(weft::tp::gather_from_tp_region(tp, odd_view, std::span<float>(out), 0),
                    Contains("the output has 60 elements but must have " + std::to_string(60 * p)));
  CHECK_THROWS_WITH(weft::tp::gather_from_tp_region(tp, tensor_view<const float>(std::span<const float>(odd), {6, 12}),
                                                    std::span<float>(out), 0),
                    Contains("span has 60 elements but its shape [6, 12] has 72"));
  // Nothing was sent: the group still works.
  std::vector<float> one{1.0f};
  tp.all_reduce(std::span<float>(one));
  CHECK(one[0] == static_cast<float>(p));
}
