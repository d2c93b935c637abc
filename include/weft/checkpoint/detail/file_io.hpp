#pragma once
/// \file
/// The POSIX file calls behind checkpoint reading and writing: an owning descriptor, whole reads
/// and writes that survive short transfers and EINTR, and a file replaced atomically
/// (temporary file, fsync, rename, fsync of the directory), so a reader sees the old file or the
/// new one, never a part, even if the machine loses power.

#include <atomic>
#include <cerrno>
#include <chrono>
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

/// A temporary file created next to the file it will replace, and its name.
struct temporary_file {
  std::filesystem::path path;
  file_descriptor out;
};

/// Creates `path.tmp-<pid>-<n>` for writing, a name no file had: O_EXCL refuses an existing name and
/// O_NOFOLLOW a symbolic link, so a link planted at a predictable name (or a leftover from a crashed
/// process whose pid was reused) is never written through; on such a name the next `n` is tried.
/// Returns the open file, or the errno of the failing open (with `path` the last name tried).
inline int create_temporary_file(const std::filesystem::path& path, temporary_file& created) {
  static std::atomic<std::uint64_t> next_number{0};
  const std::uint64_t salt =
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) & 0xffffff;
  int code = EEXIST;
  for (int attempt = 0; attempt < 64 && code == EEXIST; ++attempt) {
    created.path = path;
    created.path += ".tmp-" + std::to_string(::getpid()) + "-" +
                    std::to_string(salt + next_number.fetch_add(1, std::memory_order_relaxed));
    created.out = file_descriptor(::open(created.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (created.out.is_open()) return 0;
    code = errno;
  }
  return code;
}

/// Fsyncs `directory` so a rename inside it survives a crash. Throws weft::error naming `path`
/// when the directory cannot be opened or synced (some network file systems refuse to sync a
/// directory, EINVAL: then only the rename's own durability is left, which is not an error).
inline void sync_directory_of(const std::filesystem::path& path) {
  std::filesystem::path directory = path.parent_path();
  if (directory.empty()) directory = ".";
  file_descriptor dir(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir.is_open()) {
    const int code = errno;
    fail("checkpoint '" + path.string() + "' was written, but its directory '" + directory.string() +
         "' could not be opened to sync the rename: " + errno_text(code) +
         "; after a crash the previous file may reappear: " + std::string(errno_advice(code)));
  }
  if (::fsync(dir.get()) != 0) {
    const int code = errno;
    if (code == EINVAL) return;
    fail("checkpoint '" + path.string() + "' was written, but syncing its directory failed: " + errno_text(code) +
         "; after a crash the previous file may reappear: " + std::string(errno_advice(code)));
  }
}

/// Replaces `path` atomically with what `fill(fd)` writes: the bytes go to a new temporary file
/// beside it (create_temporary_file), which is fsynced, closed and renamed over `path`; then the
/// directory is fsynced so the rename itself survives a crash. `fill` returns 0 or an errno. On
/// any failure the temporary file is removed, `path` is left as it was, and weft::error says what
/// failed and what to do.
inline void replace_file_atomically(const std::filesystem::path& path, const std::function<int(int)>& fill) {
  temporary_file temporary;
  if (int code = create_temporary_file(path, temporary); code != 0) {
    // nothing was created: no temporary file to remove
    fail("cannot write checkpoint '" + path.string() + "': creating '" + temporary.path.string() +
         "' failed: " + errno_text(code) + "; " + std::string(errno_advice(code)) +
         " (the previous file at that path, if any, is unchanged)");
  }
  // `code` is always read from errno before anything else runs (building a message allocates,
  // and unlink can fail and overwrite errno).
  auto failure = [&](const std::string& step, int code) {
    ::unlink(temporary.path.c_str());
    fail("cannot write checkpoint '" + path.string() + "': " + step + " failed: " + errno_text(code) + "; " +
         std::string(errno_advice(code)) + " (the previous file at that path, if any, is unchanged)");
  };
  const std::string name = temporary.path.string();
  if (int code = fill(temporary.out.get()); code != 0) failure("writing '" + name + "'", code);
  if (::fsync(temporary.out.get()) != 0) {
    const int code = errno;
    failure("fsync of '" + name + "'", code);
  }
  if (int code = temporary.out.close(); code != 0) failure("closing '" + name + "'", code);
  if (::rename(temporary.path.c_str(), path.c_str()) != 0) {
    const int code = errno;
    failure("renaming '" + name + "' to it", code);
  }
  sync_directory_of(path);
}

}  // namespace weft::checkpoint::detail
