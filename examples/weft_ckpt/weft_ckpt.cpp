// weft-ckpt: looks at, checks and converts a distributed checkpoint (docs/checkpoint.md), in
// any layout it was saved from, without MPI and without holding the model.
//
//   weft-ckpt inspect DIR        the step, the layout it was saved from, the data position, the
//                                rank files and every tensor (dtype, shape, pieces, size)
//   weft-ckpt verify DIR         every piece's checksum, every file's size, each tensor's
//                                coverage; names the file and tensor of each problem
//   weft-ckpt export DIR FILE    one whole-model safetensors file in Hugging Face GPT-2 names
//                                (the model's tensors; optimizer state is left out), verified
//                                first, then streamed tensor by tensor in 16 MiB parts
//
// DIR is a step directory (with index.json) or a directory of them (then the newest complete).
// Exit status: 0 done (verify: no problem found), 1 a missing, corrupt or unsuitable checkpoint
// or file (one message naming it), 2 a bad command line (with the usage).
#include <weft/checkpoint/distributed.hpp>

#include "command_line.hpp"

#include <cinttypes>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace ckpt = weft::checkpoint;
using weft_programs::input_error;
using weft_programs::usage_error;

constexpr const char* usage_text =
    "usage: weft-ckpt inspect DIR\n"
    "       weft-ckpt verify DIR\n"
    "       weft-ckpt export DIR FILE\n"
    "  inspect  the step, the layout saved from, the data position, the rank files and every tensor\n"
    "  verify   every piece's checksum, every file's size and each tensor's coverage\n"
    "  export   one safetensors file of the model in Hugging Face GPT-2 names (no optimizer state),\n"
    "           verified first, then streamed with bounded memory\n"
    "  DIR      a checkpoint step directory (with index.json), or a directory of them (the newest\n"
    "           complete one is used)\n"
    "exit status: 0 done, 1 a missing, corrupt or unsuitable checkpoint or file, 2 a bad command line\n";

constexpr std::size_t export_part_bytes = std::size_t{16} << 20;

std::string bytes_text(std::uint64_t bytes) {
  char text[32];
  if (bytes >= 1'000'000'000) {
    std::snprintf(text, sizeof text, "%.2f GB", static_cast<double>(bytes) / 1e9);
  } else if (bytes >= 1'000'000) {
    std::snprintf(text, sizeof text, "%.2f MB", static_cast<double>(bytes) / 1e6);
  } else {
    std::snprintf(text, sizeof text, "%" PRIu64 " B", bytes);
  }
  return text;
}

std::string map_text(const std::map<std::string, std::int64_t>& values) {
  std::string text;
  for (const auto& [key, value] : values) text += (text.empty() ? "" : " ") + key + "=" + std::to_string(value);
  return text.empty() ? "(none)" : text;
}

std::uint64_t tensor_bytes(const ckpt::saved_tensor& t) {
  return static_cast<std::uint64_t>(ckpt::element_count(std::span<const std::int64_t>(t.shape))) * weft::size_of(t.type);
}

/// The rank files that are missing or have another size than the index says (a stat each).
std::vector<std::string> file_problems(const ckpt::distributed_checkpoint& checkpoint) {
  std::vector<std::string> problems;
  for (const ckpt::saved_file& f : checkpoint.index().files) {
    std::error_code error;
    const auto size = std::filesystem::file_size(checkpoint.directory() / f.file, error);
    if (error) {
      problems.push_back("file '" + f.file + "' of rank " + std::to_string(f.rank) + " is missing or unreadable: " + error.message());
    } else if (size != f.bytes) {
      problems.push_back("file '" + f.file + "' of rank " + std::to_string(f.rank) + " has " + std::to_string(size) +
                         " bytes; the index says " + std::to_string(f.bytes) + " (truncated or replaced)");
    }
  }
  return problems;
}

int report_problems(const ckpt::distributed_checkpoint& checkpoint, const std::vector<std::string>& problems, const char* what) {
  std::fprintf(stderr, "weft-ckpt: checkpoint '%s' %s: %zu problem%s\n", checkpoint.directory().c_str(), what, problems.size(),
               problems.size() == 1 ? "" : "s");
  for (const std::string& p : problems) std::fprintf(stderr, "  %s\n", p.starts_with("weft: ") ? p.c_str() + 6 : p.c_str());
  return 1;
}

int inspect(const std::filesystem::path& dir) {
  ckpt::distributed_checkpoint checkpoint(dir);
  const ckpt::checkpoint_index& index = checkpoint.index();
  std::uint64_t file_bytes = 0;
  for (const ckpt::saved_file& f : index.files) file_bytes += f.bytes;
  std::printf("checkpoint %s\n", checkpoint.directory().c_str());
  std::printf("step: %" PRId64 "\nmodel: %s\nlayout: %s\ndata position: %s\n", index.step, index.model.c_str(),
              map_text(index.layout).c_str(), map_text(index.data_position).c_str());
  std::printf("files: %zu rank files, %s\n", index.files.size(), bytes_text(file_bytes).c_str());
  for (const ckpt::saved_file& f : index.files) std::printf("  rank %d  %s  %s\n", f.rank, f.file.c_str(), bytes_text(f.bytes).c_str());
  std::uint64_t total = 0;
  std::size_t pieces = 0;
  for (const ckpt::saved_tensor& t : index.tensors) {
    total += tensor_bytes(t);
    pieces += t.pieces.size();
  }
  std::printf("tensors: %zu, %zu pieces, %s\n", index.tensors.size(), pieces, bytes_text(total).c_str());
  for (const ckpt::saved_tensor& t : index.tensors) {
    std::printf("  %-40s %-4s %-16s %3zu piece%s  %s\n", t.name.c_str(), std::string(ckpt::safetensors_name(t.type)).c_str(),
                ckpt::detail::shape_text(t.shape).c_str(), t.pieces.size(), t.pieces.size() == 1 ? " " : "s",
                bytes_text(tensor_bytes(t)).c_str());
  }
  const auto problems = file_problems(checkpoint);
  return problems.empty() ? 0 : report_problems(checkpoint, problems, "is incomplete");
}

int verify(const std::filesystem::path& dir) {
  ckpt::distributed_checkpoint checkpoint(dir);
  const auto problems = checkpoint.verify();
  if (!problems.empty()) return report_problems(checkpoint, problems, "failed verification");
  std::size_t pieces = 0;
  std::uint64_t bytes = 0;
  for (const ckpt::saved_tensor& t : checkpoint.index().tensors) {
    pieces += t.pieces.size();
    bytes += tensor_bytes(t);
  }
  std::printf("ok: %s: %zu tensors in %zu pieces (%s) in %zu files, every checksum matches and every tensor is covered once\n",
              checkpoint.directory().c_str(), checkpoint.index().tensors.size(), pieces, bytes_text(bytes).c_str(),
              checkpoint.index().files.size());
  return 0;
}

/// GPT-2's tensors: the embeddings, the blocks and the final norm (Hugging Face's names).
bool is_gpt2_tensor(std::string_view name) {
  return name == "wte.weight" || name == "wpe.weight" || name == "ln_f.weight" || name == "ln_f.bias" || name.starts_with("h.");
}

int export_gpt2(const std::filesystem::path& dir, const std::filesystem::path& out) {
  ckpt::distributed_checkpoint checkpoint(dir, {.chunk_bytes = export_part_bytes, .check_checksums = false});
  const ckpt::checkpoint_index& index = checkpoint.index();
  const ckpt::saved_tensor* wte = index.find("wte.weight");
  const ckpt::saved_tensor* wpe = index.find("wpe.weight");
  if (wte == nullptr || wpe == nullptr || wte->shape.size() != 2 || wpe->shape.size() != 2 || index.find("h.0.ln_1.weight") == nullptr) {
    throw input_error("checkpoint '" + checkpoint.directory().string() + "' (model '" + index.model +
                      "') is not a GPT-2 model: it lacks wte.weight, wpe.weight (2-D) or h.0.ln_1.weight; export writes GPT-2 "
                      "checkpoints in Hugging Face names (inspect shows what this one holds)");
  }
  const auto problems = checkpoint.verify();
  if (!problems.empty()) return report_problems(checkpoint, problems, "failed verification; nothing was exported");

  ckpt::checkpoint_file layout;
  int layers = 0;
  while (index.find("h." + std::to_string(layers) + ".ln_1.weight") != nullptr) ++layers;
  layout.metadata = {{"format", "pt"},
                     {"n_layer", std::to_string(layers)},
                     {"n_embd", std::to_string(wte->shape[1])},
                     {"n_positions", std::to_string(wpe->shape[0])},
                     {"vocab_size", std::to_string(wte->shape[0])},
                     {"step", std::to_string(index.step)}};
  std::vector<const ckpt::saved_tensor*> tensors;
  for (const ckpt::saved_tensor& t : index.tensors) {
    if (!is_gpt2_tensor(t.name)) continue;
    tensors.push_back(&t);
    layout.tensors.push_back({t.name, t.type, t.shape, {}});
  }
  std::vector<std::byte> part;
  const std::uint64_t bytes = ckpt::write_safetensors_streamed(out, layout, [&](std::size_t i, const auto& write) {
    const ckpt::saved_tensor& t = *tensors[i];
    const ckpt::region whole = ckpt::whole_region(t.shape);
    const std::int64_t count = ckpt::element_count(whole);
    const std::int64_t step = std::max<std::int64_t>(1, static_cast<std::int64_t>(export_part_bytes / weft::size_of(t.type)));
    for (std::int64_t begin = 0; begin < count; begin += step) {
      // A run of the flattened tensor, read as the regions that tile it, in order.
      for (const ckpt::region& r : ckpt::regions_of_flat_range(whole, begin, std::min(count, begin + step))) {
        part.resize(static_cast<std::size_t>(ckpt::element_count(r)) * weft::size_of(t.type));
        checkpoint.read(t.name, r, part);
        write(part);
      }
    }
  });
  std::printf("wrote %s: %zu tensors in GPT-2 names, %s, step %" PRId64 " of %s\n", out.c_str(), tensors.size(),
              bytes_text(bytes).c_str(), index.step, checkpoint.directory().c_str());
  return 0;
}

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const std::string& a : args) {
    if (a == "-h" || a == "--help") {
      std::printf("%s", usage_text);
      return -1;
    }
    if (a.starts_with("-")) throw weft_programs::unknown_option(a, usage_text);
  }
  if (args.empty()) throw usage_error("name a subcommand: inspect, verify or export");
  const std::string& command = args[0];
  auto expect_arguments = [&](std::size_t n, const char* what) {
    if (args.size() - 1 != n) {
      throw usage_error(command + " takes " + what + ", given " + std::to_string(args.size() - 1) + " argument" +
                        (args.size() == 2 ? "" : "s"));
    }
  };
  if (command == "inspect") {
    expect_arguments(1, "one directory");
    return inspect(args[1]);
  }
  if (command == "verify") {
    expect_arguments(1, "one directory");
    return verify(args[1]);
  }
  if (command == "export") {
    expect_arguments(2, "a directory and the file to write");
    return export_gpt2(args[1], args[2]);
  }
  const std::string_view commands[] = {"inspect", "verify", "export"};
  throw usage_error("unknown subcommand '" + command + "'; give inspect, verify or export" +
                    weft_programs::did_you_mean(command, commands));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int status = run(argc, argv);
    return status < 0 ? 0 : status;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "weft-ckpt: %s\n%s", e.what(), usage_text);
    return 2;
  } catch (const std::exception& e) {
    std::string message = e.what();
    if (message.starts_with("weft: ")) message.erase(0, 6);
    std::fprintf(stderr, "weft-ckpt: %s\n", message.c_str());
    return 1;
  }
}
