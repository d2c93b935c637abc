#pragma once
/// \file
/// The POSIX file calls behind checkpoint reading and writing: an owning descriptor, whole reads
/// and writes that survive short transfers and EINTR, and a file replaced atomically
/// (temporary file, fsync, rename, fsync of the directory), so a reader sees the old file or the
/// new one, never a part, even if the machine loses power.

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <weft/core/error.hpp>

namespace weft::checkpoint::detail {

inline std::string errno_text(int code) { return std::strerror(code); }

/// What a failed call's errno usually means for someone saving a checkpoint.
inline std::string_view errno_advice(int code) noexcept {
  switch (code) {
    case ENOSPC: return "free space on that file system or save elsewhere";
    case EDQUOT: return "the disk quota is used up: free space or save elsewhere";
    case EFBIG: return "the file is larger than this process or file system allows (ulimit -f)";
    case EACCES:
    case EPERM: return "check the permissions of the directory";
    case EROFS: return "the file system is read-only: save elsewhere";
    case ENOENT: return "check that the directory exists";
    case ENOTDIR: return "a part of the path is a file, not a directory: fix the path";
    case EISDIR: return "the path names a directory: name a file inside it";
    case EIO: return "the storage reported an I/O error: check the device and save elsewhere";
    default: return "check the path and the file system";
  }
}

/// An open file descriptor, closed on destruction.
class file_descriptor {
 public:
  file_descriptor() = default;
  explicit file_descriptor(int fd) noexcept : fd_(fd) {}
  file_descriptor(file_descriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  file_descriptor& operator=(file_descriptor&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  file_descriptor(const file_descriptor&) = delete;
  file_descriptor& operator=(const file_descriptor&) = delete;
  ~file_descriptor() { reset(); }

  int get() const noexcept { return fd_; }
  bool is_open() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Closes and reports the result (close can report a write-back error on some file systems).
  int close() noexcept {
    int result = ::close(std::exchange(fd_, -1));
    return result == 0 ? 0 : errno;
  }

 private:
  int fd_ = -1;
};

/// Writes all of `bytes`; returns 0 or the errno of the failing call.
inline int write_all(int fd, std::span<const std::byte> bytes) noexcept {
  while (!bytes.empty()) {
    // Linux moves at most about 2 GiB per call; larger requests come back short, which the loop handles.
    ssize_t written = ::write(fd, bytes.data(), bytes.size());
    if (written < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (written == 0) return EIO;
    bytes = bytes.subspan(static_cast<std::size_t>(written));
  }
  return 0;
}

/// Reads exactly `bytes.size()` bytes at `offset`; returns 0, the errno of the failing call, or
/// -1 when the file ended first.
inline int read_exact(int fd, std::span<std::byte> bytes, std::uint64_t offset) noexcept {
  while (!bytes.empty()) {
    ssize_t got = ::pread(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return -1;
    bytes = bytes.subspan(static_cast<std::size_t>(got));
    offset += static_cast<std::uint64_t>(got);
  }
  return 0;
}

/// The temporary name a file is written under before it replaces `path`.
inline std::filesystem::path temporary_path_for(const std::filesystem::path& path) {
  std::filesystem::path temporary = path;
  temporary += ".tmp-" + std::to_string(::getpid());
  return temporary;
}

/// Replaces `path` atomically with what `fill(fd)` writes: the bytes go to `path.tmp-<pid>`,
/// which is fsynced, closed and renamed over `path`; then the directory is fsynced so the rename
/// itself survives a crash. `fill` returns 0 or an errno. On any failure the temporary file is
/// removed, `path` is left as it was, and weft::error says what failed and what to do.
inline void replace_file_atomically(const std::filesystem::path& path, const std::function<int(int)>& fill) {
  const std::filesystem::path temporary = temporary_path_for(path);
  auto failure = [&](const std::string& step, int code) {
    ::unlink(temporary.c_str());
    fail("cannot write checkpoint '" + path.string() + "': " + step + " failed: " + errno_text(code) + "; " +
         std::string(errno_advice(code)) + " (the previous file at that path, if any, is unchanged)");
  };
  file_descriptor out(::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!out.is_open()) {
    const int code = errno;  // nothing was created: no temporary file to remove
    fail("cannot write checkpoint '" + path.string() + "': creating '" + temporary.string() +
         "' failed: " + errno_text(code) + "; " + std::string(errno_advice(code)) +
         " (the previous file at that path, if any, is unchanged)");
  }
  if (int code = fill(out.get()); code != 0) failure("writing '" + temporary.string() + "'", code);
  if (::fsync(out.get()) != 0) failure("fsync of '" + temporary.string() + "'", errno);
  if (int code = out.close(); code != 0) failure("closing '" + temporary.string() + "'", code);
  if (::rename(temporary.c_str(), path.c_str()) != 0) failure("renaming '" + temporary.string() + "' to it", errno);

  std::filesystem::path directory = path.parent_path();
  if (directory.empty()) directory = ".";
  file_descriptor dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  // The new file is in place now; a directory that cannot be synced (some network file systems
  // refuse, EINVAL) leaves only the rename's durability to the file system.
  if (dir.is_open() && ::fsync(dir.get()) != 0 && errno != EINVAL) {
    const int code = errno;
    fail("checkpoint '" + path.string() + "' was written, but syncing its directory failed: " + errno_text(code) +
         "; after a crash the previous file may reappear: " + std::string(errno_advice(code)));
  }
}

}  // namespace weft::checkpoint::detail
