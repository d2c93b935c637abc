#pragma once
/// \file
/// A flat buffer laid out by a bucket plan: one contiguous allocation with a view per parameter
/// and a slice per bucket. The synchronizer keeps gradients in one; a trainer that shards its
/// optimizer state keeps its parameters in another with the same plan, so updated shards can be
/// all-gathered in place.
///
/// `M` says where the elements live: host memory (the MPI backend's buffers) or a CUDA device's
/// memory (the NCCL backend's: the current device, or the one given). Views of a device buffer are spans of device
/// memory: pass them to kernels and to the backend, never dereference them on the host.

#include <weft/config.hpp>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#if WEFT_HAS_CUDA
#include <cuda_runtime_api.h>

#include <weft/backend/cuda/device_memory.hpp>
#endif

#include <weft/backend/backend.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/grad/bucket_plan.hpp>

namespace weft::grad {

namespace detail {

/// Owns `n` zeroed elements in memory space M.
template <element T, memory_space M>
class buffer_storage;

template <element T>
class buffer_storage<T, memory_space::host> {
 public:
  buffer_storage() = default;
  explicit buffer_storage(std::size_t n) : data_(n, T{}) {}
  T* data() noexcept { return data_.data(); }
  const T* data() const noexcept { return data_.data(); }
  void zero() noexcept { std::fill(data_.begin(), data_.end(), T{}); }

 private:
  std::vector<T> data_;
};

#if WEFT_HAS_CUDA
template <element T>
class buffer_storage<T, memory_space::device> {
 public:
  buffer_storage() = default;
  /// Zeroed, on `device` (negative: the current device); complete when the constructor returns,
  /// so work on any stream queued afterwards sees zeros.
  buffer_storage(std::size_t n, int device) : memory_(n * sizeof(T), device) { memory_.zero(); }
  T* data() noexcept { return static_cast<T*>(memory_.data()); }
  const T* data() const noexcept { return static_cast<const T*>(memory_.data()); }
  int device() const noexcept { return memory_.device(); }
  /// Zeroes the elements in `stream`'s order (all-zero bits are 0 in every floating-point type);
  /// the buffer's release waits for it.
  void zero(cudaStream_t stream) { memory_.zero_async(stream); }
  void upload(const void* host, std::size_t bytes) { memory_.copy_from_host(host, bytes); }
  void download(void* host, std::size_t bytes) const { memory_.copy_to_host(host, bytes); }

 private:
  cuda::device_memory memory_;
};
#endif

}  // namespace detail

template <element T, memory_space M = memory_space::host>
class flat_buffer {
 public:
  static constexpr memory_space memory = M;

  flat_buffer() = default;

  /// A zeroed buffer laid out by `plan` (whose element type must be T); a device buffer is
  /// allocated on the current CUDA device.
  explicit flat_buffer(std::shared_ptr<const bucket_plan> plan) : plan_(std::move(plan)) {
    check_plan();
    if constexpr (M == memory_space::device)
      storage_ = detail::buffer_storage<T, M>(size_, -1);
    else
      storage_ = detail::buffer_storage<T, M>(size_);
  }

#if WEFT_HAS_CUDA
  /// A zeroed device buffer laid out by `plan` on CUDA device `device` (a communicator's
  /// `device()`), whatever the calling thread's current device is.
  flat_buffer(std::shared_ptr<const bucket_plan> plan, int device)
    requires(M == memory_space::device)
      : plan_(std::move(plan)) {
    check_plan();
    storage_ = detail::buffer_storage<T, M>(size_, device);
  }

  /// The CUDA device a device buffer is on (-1 when empty).
  int device() const noexcept
    requires(M == memory_space::device)
  {
    return storage_.device();
  }
#endif

  const bucket_plan& plan() const noexcept { return *plan_; }
  std::shared_ptr<const bucket_plan> shared_plan() const noexcept { return plan_; }

  /// The whole buffer, padding included.
  std::span<T> all() noexcept { return {storage_.data(), size_}; }
  std::span<const T> all() const noexcept { return {storage_.data(), size_}; }

  /// The elements of parameter `param` (registration index).
  std::span<T> view(std::size_t param) { return all().subspan(plan_->offset_of(param), count(param)); }
  std::span<const T> view(std::size_t param) const { return all().subspan(plan_->offset_of(param), count(param)); }

  /// Bucket `index` as one slice, padding included.
  std::span<T> bucket_slice(std::size_t index) {
    const bucket& b = plan_->buckets()[index];
    return all().subspan(b.offset, b.count);
  }

  /// Sets every element (padding included) to zero.
  void zero() noexcept
    requires(M == memory_space::host)
  {
    storage_.zero();
  }

#if WEFT_HAS_CUDA
  /// Sets every element (padding included) to zero, in `stream`'s order.
  void zero(cudaStream_t stream)
    requires(M == memory_space::device)
  {
    storage_.zero(stream);
  }

  /// Copies `host` (the whole buffer's worth of elements) into the device buffer; complete when
  /// it returns, so work on any stream queued afterwards sees the new values. It is not ordered
  /// after work on other streams (waiting for the whole device could wait forever on a stuck NCCL
  /// kernel): make sure nothing in flight uses the buffer, e.g. synchronize the compute stream.
  void upload(std::span<const T> host)
    requires(M == memory_space::device)
  {
    check_host_size(host.size(), "upload");
    storage_.upload(host.data(), host.size_bytes());
  }

  /// Copies the device buffer into `host` (room for the whole buffer); blocking. It is not
  /// ordered after work on other streams: synchronize the streams that write the buffer first.
  void download(std::span<T> host) const
    requires(M == memory_space::device)
  {
    check_host_size(host.size(), "download");
    storage_.download(host.data(), host.size_bytes());
  }
#endif

 private:
  void check_plan() {
    if (!plan_) fail("flat_buffer: no bucket plan given");
    if (plan_->type() != dtype_of<T>)
      fail("flat_buffer: the plan is for " + std::string(to_string(plan_->type())) + " but the buffer holds " +
           std::string(to_string(dtype_of<T>)));
    size_ = plan_->total_elements();
  }

  std::size_t count(std::size_t param) const {
    if (param >= plan_->params().size())
      fail("flat_buffer: parameter index " + std::to_string(param) + " is out of range (" +
           std::to_string(plan_->params().size()) + " parameters registered)");
    return plan_->params()[param].count;
  }

  void check_host_size(std::size_t n, const char* what) const {
    if (n != size_)
      fail(std::string("flat_buffer::") + what + ": the host span has " + std::to_string(n) +
           " elements, the buffer " + std::to_string(size_) + " (padding included); pass a span of all().size() elements");
  }

  std::shared_ptr<const bucket_plan> plan_;
  std::size_t size_ = 0;
  detail::buffer_storage<T, M> storage_;
};

}  // namespace weft::grad
