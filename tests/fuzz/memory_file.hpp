#pragma once
// For harnesses whose reader opens a path: each input is written to one in-memory file (memfd),
// read through /proc/self/fd, so fuzzing touches no disk.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace weft_fuzz {

/// Writes `data` as the whole content of this process's in-memory file and returns its path.
inline const std::string& write_memory_file(const std::uint8_t* data, std::size_t size) {
  static const int fd = ::memfd_create("weft-fuzz-input", MFD_CLOEXEC);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  if (fd < 0) std::abort();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  return path;
}

}  // namespace weft_fuzz
