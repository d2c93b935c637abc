// probe_cuda() and train_on_cuda() (device.hpp) in a train_gpt built without its CUDA operations:
// there is nothing to probe, so choose_device never chooses CUDA.

#include <stdexcept>

#include "device.hpp"

namespace train_gpt {

cuda_availability probe_cuda(bool /*count_devices*/) { return {}; }

int train_on_cuda(const options&, const gpt_config&, const run_layout&, const corpus&) {
  throw std::logic_error("train_gpt: train_on_cuda in a build without CUDA (choose_device never chooses it there)");
}

}  // namespace train_gpt
