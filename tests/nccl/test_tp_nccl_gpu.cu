// The tensor-parallel mappings on the NCCL backend, on device memory (label gpu). Every mapping
// (copy_to / reduce_from / scatter_to / gather_from along each dimension of a [4, 8, 12] tensor, and
// the sequence-parallel all-gather / reduce-scatter with their backward) runs on cudaMalloc'd
// buffers; the result is copied back and compared exactly with values computed on the host from
// the formula that generated every rank's input (small integers: the sums are exact in float).
// A second test produces each input with a slow kernel on the communicator's stream: the mapping
// must be ordered after it, and (as mappings.hpp promises) return with its result in place.
#include <catch2/catch.hpp>

#include "device_test_support.hpp"
#include "gpu_test_support.hpp"

#include <cuda_runtime_api.h>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/tp/mappings.hpp>

#include <array>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

using Catch::Contains;

namespace {

using weft::tp::tensor_view;
using weft_test::cuda_ok;
using weft_test::device_array;
using weft_test::nccl_comm;
using weft_test::world;

// The full tensor's shape: every dimension divides by 1, 2 and 4 ranks.
const std::vector<std::size_t> full_shape = {4, 8, 12};
constexpr std::size_t full_n = 4 * 8 * 12;

// The value at global index (i, j, k) of the whole tensor; rank r's partial sums add 1000·r.
double v(std::size_t i, std::size_t j, std::size_t k) { return static_cast<double>(i * 256 + j * 16 + k); }
constexpr double rank_term = 1000.0;

std::vector<std::size_t> shard_shape(std::size_t dim, int p) {
  std::vector<std::size_t> s = full_shape;
  s[dim] /= static_cast<std::size_t>(p);
  return s;
}

// scale·v + add over the whole tensor.
std::vector<double> full_values(double scale = 1.0, double add = 0.0) {
  std::vector<double> out;
  for (std::size_t i = 0; i < full_shape[0]; ++i)
    for (std::size_t j = 0; j < full_shape[1]; ++j)
      for (std::size_t k = 0; k < full_shape[2]; ++k) out.push_back(scale * v(i, j, k) + add);
  return out;
}

// scale·v + add over rank `rank`'s part along `dim` (its slice [rank·n/p, (rank+1)·n/p) of that dimension).
std::vector<double> shard_values(std::size_t dim, int rank, int p, double scale = 1.0, double add = 0.0) {
  const std::vector<std::size_t> s = shard_shape(dim, p);
  std::array<std::size_t, 3> offset{0, 0, 0};
  offset[dim] = static_cast<std::size_t>(rank) * s[dim];
  std::vector<double> out;
  for (std::size_t i = 0; i < s[0]; ++i)
    for (std::size_t j = 0; j < s[1]; ++j)
      for (std::size_t k = 0; k < s[2]; ++k)
        out.push_back(scale * v(i + offset[0], j + offset[1], k + offset[2]) + add);
  return out;
}

std::vector<float> as_float(const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); }

// Rank r's partial of the whole tensor (v + 1000·r), and the sum of all ranks' partials.
std::vector<double> partial_full(int rank) { return full_values(1.0, rank_term * rank); }
double partial_sum_add(int p) { return rank_term * p * (p - 1) / 2.0; }

enum class producer { upload, slow_kernel };

struct mapping_io {
  std::span<float> in;         // the input (in place: also the output)
  std::span<float> out;        // the output (empty in place)
  std::span<float> workspace;  // the whole tensor's size, on device
};

// Runs one mapping on device copies of `input` and returns its output (the input buffer when
// out_n is 0: in place). The input is written by a plain upload, or by a slow kernel on the
// communicator's stream; in that case the mapping must have waited for its stream to reach the
// result when it returns (the stream is idle). Checks that an out-of-place mapping left its input
// alone.
std::vector<float> run_mapping(nccl_comm& comm, const std::string& what, const std::vector<float>& input,
                               std::size_t out_n, producer how, const std::function<void(mapping_io)>& call) {
  INFO(what << " (rank " << comm.rank() << " of " << comm.size() << ")");
  device_array<float> in(input.size()), out(out_n), workspace(full_n);
  device_array<float> source(input);
  if (how == producer::slow_kernel) {
    weft_test::spin_then_copy<<<4, 128, 0, comm.native().stream()>>>(in.data(), source.data(),
                                                                     static_cast<long>(input.size()),
                                                                     weft_test::slow_producer_cycles);
    cuda_ok(cudaGetLastError());
  } else {
    in.upload(input);
  }
  call({in.span(), out.span(), workspace.span()});
  if (how == producer::slow_kernel) {
    const cudaError_t idle = cudaStreamQuery(comm.native().stream());
    (void)cudaGetLastError();  // cudaErrorNotReady is an answer, not an error to keep
    weft_test::settle(comm);
    INFO("the mapping returned while work it queued (or its input's producer, which it must wait for) was still "
         "running on the communicator's stream: cudaStreamQuery says "
         << cudaGetErrorName(idle) << "; mappings.hpp promises blocking calls (the result in place on return)");
    CHECK(idle == cudaSuccess);
  }
  weft_test::settle(comm);
  if (out_n == 0) return in.download();
  std::vector<float> input_after = in.download();
  {
    INFO("the mapping changed its (const) input");
    CHECK(input_after == input);
  }
  return out.download();
}

// Every mapping, each compared with its expected values; `how` chooses the inputs' producer.
void check_every_mapping(nccl_comm& tp, producer how) {
  const int p = tp.size(), r = tp.rank();
  const std::string ranks = " at " + std::to_string(p) + " rank(s)";
  const std::vector<double> sum_of_partials = full_values(p, partial_sum_add(p));

  // f: identity forward (the same view back), all-reduce backward.
  {
    device_array<float> x(as_float(full_values()));
    tensor_view<float> view(x.span(), {4, 8, 12});
    tensor_view<float> same = weft::tp::copy_to_tp_region(tp, view);
    CHECK(same.data.data() == x.data());
    CHECK(same.data.size() == full_n);
    CHECK(same.shape == full_shape);
    tensor_view<float> g_same = weft::tp::reduce_from_tp_region_backward(tp, view);
    CHECK(g_same.data.data() == x.data());
    CHECK(g_same.shape == full_shape);
  }
  weft_test::check_exact("copy_to_tp_region_backward (all-reduce of v + 1000 r)" + ranks,
                         run_mapping(tp, "copy_to_tp_region_backward", as_float(partial_full(r)), 0, how,
                                     [&](mapping_io io) { weft::tp::copy_to_tp_region_backward(tp, io.in); }),
                         sum_of_partials);
  weft_test::check_exact("reduce_from_tp_region (all-reduce of v + 1000 r)" + ranks,
                         run_mapping(tp, "reduce_from_tp_region", as_float(partial_full(r)), 0, how,
                                     [&](mapping_io io) { weft::tp::reduce_from_tp_region(tp, io.in); }),
                         sum_of_partials);

  for (std::size_t dim = 0; dim < 3; ++dim) {
    const std::string along = " along dimension " + std::to_string(dim) + ranks;
    const std::vector<std::size_t> part = shard_shape(dim, p);
    const std::size_t shard_n = full_n / static_cast<std::size_t>(p);
    const std::vector<double> my_shard = shard_values(dim, r, p);
    const std::vector<double> my_reduced_shard = shard_values(dim, r, p, p, partial_sum_add(p));
    auto whole = [&](mapping_io io) { return tensor_view<const float>(std::span<const float>(io.in), full_shape); };
    auto piece = [&](mapping_io io) { return tensor_view<const float>(std::span<const float>(io.in), part); };

    // Keep this rank's slice (no communication): scatter forward, gather backward.
    weft_test::check_exact("scatter_to_tp_region" + along,
                           run_mapping(tp, "scatter_to_tp_region" + along, as_float(full_values()), shard_n, how,
                                       [&](mapping_io io) { weft::tp::scatter_to_tp_region(tp, whole(io), io.out, dim); }),
                           my_shard);
    weft_test::check_exact(
        "gather_from_tp_region_backward" + along,
        run_mapping(tp, "gather_from_tp_region_backward" + along, as_float(full_values()), shard_n, how,
                    [&](mapping_io io) { weft::tp::gather_from_tp_region_backward(tp, whole(io), io.out, dim); }),
        my_shard);

    // Every rank's slice, concatenated in rank order: gather forward, scatter backward, SP all-gather,
    // SP reduce-scatter backward.
    weft_test::check_exact(
        "gather_from_tp_region" + along,
        run_mapping(tp, "gather_from_tp_region" + along, as_float(my_shard), full_n, how,
                    [&](mapping_io io) { weft::tp::gather_from_tp_region(tp, piece(io), io.out, dim, io.workspace); }),
        full_values());
    weft_test::check_exact("scatter_to_tp_region_backward" + along,
                           run_mapping(tp, "scatter_to_tp_region_backward" + along, as_float(my_shard), full_n, how,
                                       [&](mapping_io io) {
                                         weft::tp::scatter_to_tp_region_backward(tp, piece(io), io.out, dim, io.workspace);
                                       }),
                           full_values());
    weft_test::check_exact(
        "all_gather_sequence" + along,
        run_mapping(tp, "all_gather_sequence" + along, as_float(my_shard), full_n, how,
                    [&](mapping_io io) { weft::tp::all_gather_sequence(tp, piece(io), io.out, dim, io.workspace); }),
        full_values());
    weft_test::check_exact("reduce_scatter_sequence_backward" + along,
                           run_mapping(tp, "reduce_scatter_sequence_backward" + along, as_float(my_shard), full_n, how,
                                       [&](mapping_io io) {
                                         weft::tp::reduce_scatter_sequence_backward(tp, piece(io), io.out, dim,
                                                                                    io.workspace);
                                       }),
                           full_values());

    // This rank's slice of the sum of every rank's partial: reduce-scatter, SP reduce-scatter, SP
    // all-gather backward.
    weft_test::check_exact(
        "reduce_scatter_along" + along,
        run_mapping(tp, "reduce_scatter_along" + along, as_float(partial_full(r)), shard_n, how,
                    [&](mapping_io io) { weft::tp::reduce_scatter_along(tp, whole(io), io.out, dim, io.workspace); }),
        my_reduced_shard);
    weft_test::check_exact("reduce_scatter_sequence" + along,
                           run_mapping(tp, "reduce_scatter_sequence" + along, as_float(partial_full(r)), shard_n, how,
                                       [&](mapping_io io) {
                                         weft::tp::reduce_scatter_sequence(tp, whole(io), io.out, dim, io.workspace);
                                       }),
                           my_reduced_shard);
    weft_test::check_exact("all_gather_sequence_backward" + along,
                           run_mapping(tp, "all_gather_sequence_backward" + along, as_float(partial_full(r)), shard_n,
                                       how,
                                       [&](mapping_io io) {
                                         weft::tp::all_gather_sequence_backward(tp, whole(io), io.out, dim,
                                                                                io.workspace);
                                       }),
                           my_reduced_shard);
  }
}

}  // namespace

TEST_CASE("tp mappings on NCCL device memory: every mapping along every dimension, exact", "[tp][nccl][gpu]") {
  check_every_mapping(world(), producer::upload);
}

TEST_CASE("tp mappings on NCCL: ordered after a slow producer on the communicator's stream, blocking on return",
          "[tp][nccl][gpu]") {
  check_every_mapping(world(), producer::slow_kernel);
}

TEST_CASE("tp mappings on NCCL: a strided gather or reduce-scatter of device memory without a workspace is refused",
          "[tp][nccl][gpu]") {
  nccl_comm& tp = world();
  const int p = tp.size();
  device_array<float> full(full_n), shard(full_n / static_cast<std::size_t>(p));
  const tensor_view<const float> part(shard.cspan(), shard_shape(1, p));
  const tensor_view<const float> whole(full.cspan(), full_shape);
  // Refused on every rank before anything is sent, so the group stays usable.
  REQUIRE_THROWS_WITH(weft::tp::gather_from_tp_region(tp, part, full.span(), 1),
                      Contains("workspace") && Contains("device memory"));
  REQUIRE_THROWS_WITH(weft::tp::reduce_scatter_along(tp, whole, shard.span(), 2),
                      Contains("workspace") && Contains("device memory"));
  // Along dimension 0 the collective works on the caller's buffers: no workspace needed.
  const std::vector<double> my_shard = shard_values(0, tp.rank(), p);
  device_array<float> piece(as_float(my_shard));
  weft::tp::gather_from_tp_region(tp, tensor_view<const float>(piece.cspan(), shard_shape(0, p)), full.span(), 0);
  weft_test::settle(tp);
  weft_test::check_exact("gather_from_tp_region along dimension 0 without a workspace", full.download(), full_values());
}
