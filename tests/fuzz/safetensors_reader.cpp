// libFuzzer harness: weft's safetensors reader on arbitrary file contents. The reader opens a
// path, so each input is written to one in-memory file (memfd) read through /proc/self/fd.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include <weft/checkpoint/safetensors.hpp>

namespace {

const std::string& input_path() {
  static const std::string path = [] {
    const int fd = ::memfd_create("weft-fuzz-safetensors", MFD_CLOEXEC);
    if (fd < 0) std::abort();
    return "/proc/self/fd/" + std::to_string(fd);
  }();
  return path;
}

int input_fd() {
  static const int fd = std::stoi(input_path().substr(input_path().rfind('/') + 1));
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = input_fd();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  try {
    const weft::checkpoint::checkpoint_file file = weft::checkpoint::read_safetensors(input_path());
    // What was read is consistent: every record's bytes match its shape and dtype.
    for (const weft::checkpoint::tensor_record& record : file.tensors) weft::checkpoint::detail::check_record_size(record);
  } catch (const weft::error&) {
  }
  return 0;
}
