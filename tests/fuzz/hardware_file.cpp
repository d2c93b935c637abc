// libFuzzer harness: the JSON reader as weft-plan --hardware uses it (a hardware description),
// then what weft-plan derives from an accepted one; an accepted description must read back the
// same after being written again.
#include <cstdlib>
#include <string_view>

#include <weft/tune/hardware_file.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const weft::tune::measured_hardware hw = weft::tune::parse_hardware(text);
    const weft::tune::cluster_desc cluster = weft::tune::cluster_of(hw);
    if (cluster.node.gpus_per_node < 1 || cluster.nodes < 1) std::abort();  // weft-plan divides by them
    (void)weft::tune::calibration_of(hw);
    const weft::tune::measured_hardware again = weft::tune::parse_hardware(weft::tune::to_json(hw));
    if (again.ranks_per_node != hw.ranks_per_node || again.nodes != hw.nodes || again.cpus_per_node != hw.cpus_per_node ||
        again.gemm_samples.size() != hw.gemm_samples.size())
      std::abort();
    if (!hw.gemm_samples.empty()) (void)weft::tune::fit_gemm_curve(hw.gemm_samples);
  } catch (const weft::error&) {
  }
  return 0;
}
