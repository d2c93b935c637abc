// Context parallelism on the NCCL backend, compiled: the ring attention schedule and the Ulysses
// exchanges instantiate for nccl_backend with device buffers and a device kernel (a stand-in here:
// a trainer's own flash-attention kernel), and the CPU reference kernel is refused for device
// buffers. Compile-only; running them needs GPUs (the MPI tests cover the behaviour).
#include <catch2/catch.hpp>

#include <weft/backend/nccl/backend.hpp>
#include <weft/cp/attention_reference.hpp>
#include <weft/cp/ring_attention.hpp>
#include <weft/cp/ulysses.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace cp = weft::cp;

namespace {

// What a device kernel provides: the same members as cp::reference_attention, on device memory.
struct device_kernel {
  static constexpr weft::memory_space memory = weft::memory_space::device;
  template <class T>
  std::span<T> allocate(std::size_t) const {
    return {};
  }
  template <class T>
  void fill(std::span<T>, T) const {}
  template <class T>
  void forward(std::span<const T>, std::span<const std::int64_t>, std::span<const T>, std::span<const T>,
               std::span<const std::int64_t>, cp::attention_shape, cp::attention_options, std::span<T>,
               std::span<T>) const {}
  template <class T>
  void merge(std::span<T>, std::span<T>, std::span<const T>, std::span<const T>) const {}
  template <class T>
  void backward(std::span<const T>, std::span<const std::int64_t>, std::span<const T>, std::span<const T>,
                std::span<const std::int64_t>, cp::attention_shape, cp::attention_options, std::span<const T>,
                std::span<const T>, std::span<const T>, std::span<T>, std::span<T>, std::span<T>) const {}
};

}  // namespace

static_assert(cp::attention_kernel<device_kernel, float>);
static_assert(cp::kernel_runs_on<device_kernel, weft::nccl_backend>);
// The CPU reference works on host memory: refused with the NCCL backend's device buffers.
static_assert(!cp::kernel_runs_on<cp::reference_attention, weft::nccl_backend>);

using ring_t = cp::ring_attention<weft::nccl_backend, device_kernel>;
template class cp::ring_attention<weft::nccl_backend, device_kernel>;
template void ring_t::forward<float>(std::span<const float>, std::span<const float>, std::span<const float>,
                                     std::span<float>, std::span<float>);
template void ring_t::backward<float>(std::span<const float>, std::span<const float>, std::span<const float>,
                                      std::span<const float>, std::span<const float>, std::span<const float>,
                                      std::span<float>, std::span<float>, std::span<float>);

using ulysses_t = cp::ulysses<weft::nccl_backend>;
template class cp::ulysses<weft::nccl_backend>;
template void ulysses_t::to_heads<float>(std::span<const float>, std::span<float>);
template void ulysses_t::to_sequence<float>(std::span<const float>, std::span<float>);
template void ulysses_t::to_heads<weft::bfloat16>(std::span<const weft::bfloat16>, std::span<weft::bfloat16>);
template void ulysses_t::forward<float, device_kernel>(std::span<const float>, std::span<const float>,
                                                       std::span<const float>, std::span<float>, std::span<float>,
                                                       cp::attention_options, const device_kernel&);
template void ulysses_t::backward<float, device_kernel>(std::span<const float>, std::span<const float>,
                                                        std::span<const float>, std::span<const float>,
                                                        std::span<const float>, std::span<const float>,
                                                        std::span<float>, std::span<float>, std::span<float>,
                                                        cp::attention_options, const device_kernel&);

TEST_CASE("context parallelism instantiates for the NCCL backend", "[nccl][cp]") {
  CHECK(cp::nearest_head_divisors(12, 5) == std::pair<std::size_t, std::size_t>{4, 6});
}
