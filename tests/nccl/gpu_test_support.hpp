#pragma once
// What the GPU tests share: one NCCL world communicator for the whole run (building one costs far
// more than the tests; it lives until the process exits), a CUDA status check that names the
// error, and device arrays filled from and read back into host vectors.
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <vector>

#include <weft/backend/nccl/backend.hpp>
#include <weft/comm/communicator.hpp>
#include <weft/launch/nccl_bootstrap.hpp>

namespace weft_test {

using nccl_comm = weft::communicator<weft::nccl_backend>;

inline nccl_comm& world() {
  static nccl_comm* comm = new nccl_comm(weft::nccl_world());
  return *comm;
}

inline void cuda_ok(cudaError_t status) {
  INFO(cudaGetErrorName(status) << ": " << cudaGetErrorString(status));
  REQUIRE(status == cudaSuccess);
}

// Device memory holding n elements of T (cudaMalloc), filled from and read back into host vectors.
template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n) : n_(n) {
    if (n_ > 0) cuda_ok(cudaMalloc(reinterpret_cast<void**>(&data_), n_ * sizeof(T)));
  }
  explicit device_array(const std::vector<T>& host) : device_array(host.size()) { upload(host); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() {
    if (data_ != nullptr) cudaFree(data_);
  }
  T* data() const { return data_; }
  std::size_t size() const { return n_; }
  std::span<T> span() const { return {data_, n_}; }
  std::span<const T> cspan() const { return {data_, n_}; }
  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    if (n_ == 0) return;
    cuda_ok(cudaMemcpy(data_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    cuda_ok(cudaDeviceSynchronize());  // the communicator's (non-blocking) stream does not order after this copy
  }
  // Call after settle(): cudaMemcpy does not wait for the communicator's non-blocking stream.
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ > 0) cuda_ok(cudaMemcpy(host.data(), data_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* data_ = nullptr;
  std::size_t n_;
};

}  // namespace weft_test
