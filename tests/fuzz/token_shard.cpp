// libFuzzer harness: train_gpt's token-shard reader (llm.c's header, then uint16 tokens) on
// arbitrary file contents. The reader maps a path, so each input is written to an in-memory file
// (memory_file.hpp).
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "memory_file.hpp"

#include "train_gpt/data.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string& input_path = weft_fuzz::write_memory_file(data, size);
  try {
    const train_gpt::corpus c = train_gpt::corpus::load(input_path, 4, 50257, train_gpt::data_format::llmc);
    // What was accepted is consistent: the header's count fills the file exactly, and every window
    // of the stream reads tokens below the vocabulary.
    if (1024 + 2 * static_cast<std::size_t>(c.size()) != size) std::abort();
    for (std::int64_t k = 0; k < 4; ++k)
      for (std::int32_t t : c.sequences({.sequence = k}, 0, 1, 4))
        if (t < 0 || t >= 50257) std::abort();
  } catch (const std::runtime_error&) {
  }
  return 0;
}
