#pragma once
// Scratch directories and raw file bytes for the checkpoint tests. Files go under the test's
// working directory (the build tree), never elsewhere.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

namespace checkpoint_test {

/// A fresh directory under the working directory, removed with everything in it at the end.
class scratch_directory {
 public:
  explicit scratch_directory(const std::string& name)
      : path_(std::filesystem::current_path() / ("checkpoint_" + name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~scratch_directory() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  scratch_directory(const scratch_directory&) = delete;
  scratch_directory& operator=(const scratch_directory&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

  /// The names of the files in the directory (to find leftover temporary files).
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(path_)) names.push_back(entry.path().filename().string());
    return names;
  }

 private:
  std::filesystem::path path_;
};

inline std::string file_contents(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_contents(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// A file laid out as safetensors with this header text and data buffer; the length field holds
/// the header's size unless `length` says otherwise.
inline std::string raw_safetensors(std::string_view header, std::string_view data,
                                   std::optional<std::uint64_t> length = std::nullopt) {
  const std::uint64_t field = length.value_or(header.size());
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>((field >> (8 * i)) & 0xff);
  bytes += header;
  bytes += data;
  return bytes;
}

}  // namespace checkpoint_test
