#pragma once
/// \file
/// The memory a sharded model keeps per unit (master and gradient shards, gathered parameters,
/// the gradients of a unit's backward), as one type with a host and a device implementation, so
/// that sharded_model says once what happens to a unit's memory and the backend's memory space
/// decides where it lives. Host memory: plain vectors. Device memory (NCCL):
/// fsdp/detail/device_unit_buffer.hpp.

#include <weft/config.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include <weft/backend/backend.hpp>
#include <weft/core/dtype.hpp>

namespace weft::fsdp::detail {

/// What orders work on a unit's memory: nothing on the host (every operation is complete when it
/// returns); on a device, the stream compute runs on and the shard group's stream.
template <memory_space M>
struct streams;

template <>
struct streams<memory_space::host> {};

/// The stream compute runs on, where there is one (a device).
template <memory_space M>
struct compute_stream {};

/// `n` elements of T in memory space M, owned, resizable.
template <element T, memory_space M>
class unit_buffer;

template <element T>
class unit_buffer<T, memory_space::host> {
 public:
  using context = streams<memory_space::host>;

  std::size_t size() const noexcept { return data_.size(); }
  std::span<T> span() noexcept { return data_; }
  std::span<const T> span() const noexcept { return data_; }
  /// Bytes held (capacity, which is what a vector keeps).
  std::size_t bytes() const noexcept { return data_.capacity() * sizeof(T); }

  /// `n` zeroed elements.
  void assign_zeros(std::size_t n, const context&) { data_.assign(n, T{}); }
  /// `n` elements the caller overwrites before reading (zeroed here anyway: vectors initialise).
  void allocate(std::size_t n, const context& c) {
    if (data_.size() != n) assign_zeros(n, c);
  }
  void zero(const context&) noexcept { std::fill(data_.begin(), data_.end(), T{}); }
  /// Gives the memory back.
  void release(const context&) noexcept { std::vector<T>().swap(data_); }

 private:
  std::vector<T> data_;
};

/// dst = src (`src` in host memory; `dst` in M's memory).
template <element T>
void copy_from_host(std::span<T> dst, std::span<const T> src, const streams<memory_space::host>&) noexcept {
  std::copy(src.begin(), src.end(), dst.begin());
}
/// The values of `src` (in M's memory; every operation that writes it has completed).
template <element T>
std::vector<T> copy_to_host(std::span<const T> src, const streams<memory_space::host>&) {
  return std::vector<T>(src.begin(), src.end());
}
/// dst = src, both in M's memory, in compute's order.
template <element T>
void copy_in_compute_order(std::span<T> dst, std::span<const T> src, const streams<memory_space::host>&) noexcept {
  std::copy(src.begin(), src.end(), dst.begin());
}
/// Makes the communication issued from now on wait for the compute queued so far.
inline void order_communication_after_compute(const streams<memory_space::host>&) noexcept {}

}  // namespace weft::fsdp::detail

#if WEFT_HAS_CUDA
#include <weft/fsdp/detail/device_unit_buffer.hpp>
#endif
