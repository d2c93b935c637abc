// docs/checkpoint.md's example as a program: a snapshot written by the background writer, then a
// safetensors file read back, compared value by value with what was written. Prints
// "checkpoint: ok" when they are the same. Files go to the working directory.
#include <weft/checkpoint/async_writer.hpp>
namespace ckpt = weft::checkpoint;

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace {

void save(const std::filesystem::path& dir, int step, const std::vector<float>& wte) {
  const std::int64_t vocab = 50, channels = 8;

  ckpt::checkpoint_file snapshot;
  snapshot.metadata = {{"format", "pt"}, {"step", std::to_string(step)}};   // values are strings
  snapshot.tensors.push_back(ckpt::make_record<float>("wte.weight", {vocab, channels}, wte));  // copies the values
  ckpt::async_writer writer;                       // keep it alive for the whole run
  writer.submit(dir / "step.safetensors", std::move(snapshot));   // returns at once
  // ... train; the next submit waits for this write and throws if it failed ...
  writer.wait();                                   // before exiting, to see the last write's error
}

std::vector<float> load() {
  const ckpt::checkpoint_file file = ckpt::read_safetensors("model.safetensors");
  std::vector<float> wte = ckpt::values_of<float>(file.at("wte.weight"));   // throws if the dtype is not F32
  return wte;
}

}  // namespace

int main() {
  const std::filesystem::path dir = "snippet_checkpoint";
  std::filesystem::create_directories(dir);
  std::vector<float> written(50 * 8);
  for (std::size_t i = 0; i < written.size(); ++i) written[i] = static_cast<float>(i) * 0.25f - 3.0f;
  save(dir, 7, written);
  // The file just written stands in for a published model.
  std::filesystem::copy_file(dir / "step.safetensors", "model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  if (load() != written) {
    std::fprintf(stderr, "checkpoint: FAILED: the values read back differ from those written\n");
    return 1;
  }
  std::printf("checkpoint: ok\n");
  return 0;
}
