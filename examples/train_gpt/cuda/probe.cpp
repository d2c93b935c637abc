// probe_cuda() (device.hpp) in a build with the CUDA runtime: the GPUs this process sees, through
// weft's own device count (weft/launch/device.hpp), whose error says what is missing. Plain C++
// against the runtime's C API (no device code), so it links into train_gpt without nvcc.

#include <exception>

#include <weft/launch/device.hpp>

#include "device.hpp"

namespace train_gpt {

cuda_availability probe_cuda(bool count_devices) {
  cuda_availability a;
  a.runtime = true;
  if (!count_devices) return a;
  try {
    a.gpus = weft::visible_device_count();
  } catch (const std::exception& e) {
    a.gpus = 0;
    a.detail = e.what();
  }
  return a;
}

}  // namespace train_gpt
