// The tp mappings on device memory: every mapping instantiated for nccl_backend (device spans,
// collectives and strided copies on the communicator's stream) compiles and warns about nothing.
// Compile only: the GPU runs come with the gpu-labelled tests. The reference layers and the host
// collective matmul are refused on this backend at compile time (a static_assert that says so).
#include <catch2/catch.hpp>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/tp/mappings.hpp>

#include <cstddef>
#include <span>

namespace tp_nccl_compile {

using nccl_comm = weft::communicator<weft::nccl_backend>;
using weft::tp::tensor_view;

// Calls every mapping on device spans; instantiated below for three element types, never run.
template <class T>
void use_all(nccl_comm& tp, std::span<T> full, std::span<T> shard, std::span<T> workspace) {
  const tensor_view<const T> whole(std::span<const T>(full), {4, 6, 8});
  const tensor_view<const T> part(std::span<const T>(shard), {2, 6, 8});
  (void)weft::tp::copy_to_tp_region(tp, tensor_view<T>(full, {4, 6, 8}));
  weft::tp::copy_to_tp_region_backward(tp, full);
  weft::tp::reduce_from_tp_region(tp, full);
  (void)weft::tp::reduce_from_tp_region_backward(tp, tensor_view<T>(full, {4, 6, 8}));
  weft::tp::scatter_to_tp_region(tp, whole, shard, 1);
  weft::tp::scatter_to_tp_region_backward(tp, part, full, 1, workspace);
  weft::tp::gather_from_tp_region(tp, part, full, 2, workspace);
  weft::tp::gather_from_tp_region_backward(tp, whole, shard, 2);
  weft::tp::reduce_scatter_along(tp, whole, shard, 1, workspace);
  weft::tp::all_gather_sequence(tp, part, full);
  weft::tp::all_gather_sequence_backward(tp, whole, shard);
  weft::tp::reduce_scatter_sequence(tp, whole, shard, 0, workspace);
  weft::tp::reduce_scatter_sequence_backward(tp, part, full, 0, workspace);
}

template void use_all<float>(nccl_comm&, std::span<float>, std::span<float>, std::span<float>);
template void use_all<weft::half>(nccl_comm&, std::span<weft::half>, std::span<weft::half>, std::span<weft::half>);
template void use_all<weft::bfloat16>(nccl_comm&, std::span<weft::bfloat16>, std::span<weft::bfloat16>,
                                      std::span<weft::bfloat16>);

}  // namespace tp_nccl_compile

TEST_CASE("the tp mappings compile for nccl_backend on device spans", "[tp][nccl]") {
  // Reaching here means every mapping compiled for device memory.
  CHECK(weft::buffer_memory_v<weft::nccl_backend> == weft::memory_space::device);
}
