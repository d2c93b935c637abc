// libFuzzer harness: weft's safetensors reader on arbitrary file contents. The reader opens a
// path, so each input is written to an in-memory file (memory_file.hpp).
#include <cstdlib>
#include <string>

#include "memory_file.hpp"

#include <weft/checkpoint/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& input_path = weft_fuzz::write_memory_file(data, size);
  try {
    const weft::checkpoint::checkpoint_file file = weft::checkpoint::read_safetensors(input_path);
    // What was read is consistent: every record's bytes match its shape and dtype.
    for (const weft::checkpoint::tensor_record& record : file.tensors) weft::checkpoint::detail::check_record_size(record);
  } catch (const weft::error&) {
  }
  return 0;
}
