// The C++ side of the interoperability test (check_safetensors.py):
//   checkpoint_sample write FILE                    writes the sample set with write_safetensors
//   checkpoint_sample check FILE [--skip-dtype D]   reads FILE with read_safetensors and checks that it
//                                                   holds the sample set (any order; tensors of dtype D
//                                                   may be absent), value by value and bit for bit
// Exit status 0 when all is well; otherwise what differs goes to stderr.

#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

#include <weft/checkpoint/safetensors.hpp>

#include "sample_set.hpp"

namespace {

int check(const char* path, std::string_view skip_dtype) {
  using namespace weft::checkpoint;
  const checkpoint_file file = read_safetensors(path);
  int wrong = 0;
  if (file.metadata != checkpoint_test::sample_metadata()) {
    std::fprintf(stderr, "metadata differs: %zu entries read\n", file.metadata.size());
    for (const auto& [key, value] : file.metadata) std::fprintf(stderr, "  '%s' = '%s'\n", key.c_str(), value.c_str());
    ++wrong;
  }
  std::size_t expected_count = 0;
  const auto& tensors = checkpoint_test::sample_tensors();
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    if (safetensors_name(tensors[k].type) == skip_dtype) continue;
    ++expected_count;
    const tensor_record* found = file.find(tensors[k].name);
    if (found == nullptr) {
      std::fprintf(stderr, "tensor '%s' is missing\n", tensors[k].name.c_str());
      ++wrong;
      continue;
    }
    const tensor_record expected = checkpoint_test::sample_record(static_cast<std::int64_t>(k));
    if (found->type != expected.type || found->shape != expected.shape || found->bytes != expected.bytes) {
      std::fprintf(stderr, "tensor '%s' differs: dtype %s shape %s (expected %s %s), %zu bytes\n", expected.name.c_str(),
                   std::string(safetensors_name(found->type)).c_str(), detail::shape_text(found->shape).c_str(),
                   std::string(safetensors_name(expected.type)).c_str(), detail::shape_text(expected.shape).c_str(),
                   found->bytes.size());
      ++wrong;
    }
  }
  if (file.tensors.size() != expected_count) {
    std::fprintf(stderr, "%zu tensors read, %zu expected\n", file.tensors.size(), expected_count);
    ++wrong;
  }
  std::printf("%s: %zu tensors, %zu metadata entries, %d wrong\n", path, file.tensors.size(), file.metadata.size(), wrong);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc == 3 && std::strcmp(argv[1], "write") == 0) {
      weft::checkpoint::write_safetensors(argv[2], checkpoint_test::sample_file());
      return 0;
    }
    if (argc == 3 && std::strcmp(argv[1], "check") == 0) return check(argv[2], "");
    if (argc == 5 && std::strcmp(argv[1], "check") == 0 && std::strcmp(argv[3], "--skip-dtype") == 0) return check(argv[2], argv[4]);
    std::fprintf(stderr, "usage: checkpoint_sample write FILE | check FILE [--skip-dtype DTYPE]\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
