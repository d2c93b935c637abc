#pragma once
// Training data: a token stream read from files (byte-level text, llm.c's token shards or
// nanoGPT's headerless uint16 files), and a loader thread that prepares the next steps' batches
// while the current one runs.
//
// Every sequence is a window of seq + 1 consecutive tokens of the stream: the first seq are the
// inputs, the last seq their labels (the next tokens). Which windows a step takes is a function of
// its `data_position` alone, so every rank finds the same global batch without talking, each
// data-parallel rank reads only its slice, and a resumed run sees exactly the batches the
// uninterrupted run would have:
// - byte-level text: windows start at positions drawn from (seed, step, index);
// - token files: windows are read in order, as llm.c does: sequence k of the run covers tokens
//   [k seq, k seq + seq] of the stream (the files one after another), wrapping around at its end.
//   The position is the number of sequences taken before the step, which checkpoints record.

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace train_gpt {

/// How the data files hold their tokens (--data-format).
enum class data_format {
  detect,  ///< llm.c's shards by their header; other files are byte-level text (.bin files are refused)
  text,    ///< each byte is a token
  llmc,    ///< llm.c's shards: a header of 256 int32 (magic, version, token count), then uint16 tokens
  u16,     ///< nanoGPT's .bin: uint16 tokens, no header
};

/// llm.c's token shard header (dev/data/data_common.py): 256 little-endian int32, of which the
/// first three are the magic, the version (1: uint16 tokens) and the number of tokens.
inline constexpr std::int32_t shard_magic = 20240520;
inline constexpr std::int32_t shard_version = 1;
inline constexpr std::size_t shard_header_bytes = 256 * sizeof(std::int32_t);

/// What a file's first bytes say, checked against its size.
struct shard_header {
  std::int64_t tokens = 0;  ///< from the header
};

/// Reads and checks llm.c's header from a file's first `size` bytes (all of them, or at least
/// the header), given the file's whole size. Throws one message naming `path` when the magic or
/// the version is wrong or the file is shorter or longer than its header says.
inline shard_header read_shard_header(std::span<const unsigned char> head, std::uint64_t file_bytes,
                                      const std::string& path) {
  auto int_at = [&](std::size_t i) {
    std::int32_t v = 0;
    std::memcpy(&v, head.data() + i * sizeof(v), sizeof(v));
    return v;
  };
  if (head.size() >= sizeof(std::int32_t) && int_at(0) != shard_magic)
    throw std::runtime_error(
        "the data file '" + path + "' is not an llm.c token shard: its first int32 is " + std::to_string(int_at(0)) +
        ", not the magic " + std::to_string(shard_magic) +
        ": give --data-format u16 for nanoGPT's headerless uint16 .bin, --data-format text for text, or re-write "
        "the shard with scripts/prepare_tokens.py");
  if (head.size() < 3 * sizeof(std::int32_t))
    throw std::runtime_error("the data file '" + path + "' is truncated: it has " + std::to_string(file_bytes) +
                             " bytes, fewer than llm.c's header of " + std::to_string(shard_header_bytes) +
                             " bytes: write it again (scripts/prepare_tokens.py)");
  if (int_at(1) != shard_version)
    throw std::runtime_error("the data file '" + path + "' is an llm.c shard of version " + std::to_string(int_at(1)) +
                             "; train_gpt reads version " + std::to_string(shard_version) +
                             " (uint16 tokens): re-write it with scripts/prepare_tokens.py");
  const std::int64_t tokens = int_at(2);
  if (file_bytes < shard_header_bytes || tokens < 0 ||
      file_bytes - shard_header_bytes != static_cast<std::uint64_t>(tokens) * 2)
    throw std::runtime_error(
        "the data file '" + path + "' is " + (file_bytes < shard_header_bytes + static_cast<std::uint64_t>(std::max<std::int64_t>(tokens, 0)) * 2 ? "truncated" : "longer than its header says") +
        ": its header says " + std::to_string(tokens) + " tokens (" + std::to_string(shard_header_bytes) +
        " header bytes + 2 bytes a token = " + std::to_string(shard_header_bytes + 2 * static_cast<std::uint64_t>(std::max<std::int64_t>(tokens, 0))) +
        " bytes), but the file has " + std::to_string(file_bytes) + " bytes: write it again (scripts/prepare_tokens.py)");
  return {tokens};
}

/// A file mapped read-only (the shards of a real corpus are larger than one wants to copy).
class mapped_file {
 public:
  explicit mapped_file(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      throw std::runtime_error("cannot open the data file '" + path + "': " + std::strerror(errno) +
                               "; give existing files with --data (see docs/train_gpt.md, \"Data\")");
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw std::runtime_error("the data file '" + path + "' is not a regular file");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* at = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (at == MAP_FAILED) {
        ::close(fd);
        throw std::runtime_error("cannot map the data file '" + path + "': " + std::strerror(errno));
      }
      bytes_ = static_cast<const unsigned char*>(at);
    }
    ::close(fd);
  }
  ~mapped_file() {
    if (bytes_ != nullptr) ::munmap(const_cast<unsigned char*>(bytes_), size_);
  }
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;

  std::span<const unsigned char> bytes() const noexcept { return {bytes_, size_}; }
  const std::string& path() const noexcept { return path_; }

 private:
  std::string path_;
  const unsigned char* bytes_ = nullptr;
  std::size_t size_ = 0;
};

/// The files a --data value names: a file, or a glob pattern's matches in sorted order.
inline std::vector<std::string> data_files(const std::string& pattern) {
  if (pattern.find_first_of("*?[") == std::string::npos) return {pattern};
  glob_t found{};
  const int status = ::glob(pattern.c_str(), 0, nullptr, &found);
  std::vector<std::string> files;
  if (status == 0)
    for (std::size_t i = 0; i < found.gl_pathc; ++i) files.emplace_back(found.gl_pathv[i]);
  ::globfree(&found);
  if (files.empty())
    throw std::runtime_error("no file matches the data pattern '" + pattern +
                             "': give a file or a glob pattern of existing files (quoted, so the shell leaves it)");
  return files;  // glob sorts its matches
}

/// Where a step's sequences come from: (seed, step) for sampled text, the number of sequences
/// taken before the step for token files.
struct data_position {
  std::uint64_t seed = 0;
  std::int64_t step = 0;
  std::int64_t sequence = 0;
};

class corpus {
 public:
  /// Reads the files `pattern` names (a file or a glob; several are one stream, in sorted order)
  /// in `format`. Throws one message, naming the file and what to do, when a file is missing, is
  /// not in the format, is truncated, holds a token the vocabulary cannot represent, or when the
  /// stream is too short for one sequence.
  static corpus load(const std::string& pattern, int seq, int vocab, data_format format = data_format::detect) {
    corpus c;
    for (const std::string& path : data_files(pattern)) {
      auto file = std::make_shared<const mapped_file>(path);
      const std::span<const unsigned char> bytes = file->bytes();
      data_format kind = format;
      if (kind == data_format::detect) {
        std::int32_t first = 0;
        if (bytes.size() >= sizeof(first)) std::memcpy(&first, bytes.data(), sizeof(first));
        const bool bin = std::filesystem::path(path).extension() == ".bin";
        kind = first == shard_magic || bin ? data_format::llmc : data_format::text;  // a .bin without it: refused below
      }
      if (!c.parts_.empty() && (kind == data_format::text) != c.sampled_)
        throw std::runtime_error("the data file '" + path + "' is " +
                                 (kind == data_format::text ? "text" : "an llm.c token shard") + ", but '" +
                                 c.parts_.front().file->path() + "' is " +
                                 (c.sampled_ ? "text" : "token data") + ": give files of one format");
      c.sampled_ = kind == data_format::text;
      part p{file, 0, 1, 0, 0};
      if (kind == data_format::text) {
        p.tokens = static_cast<std::int64_t>(bytes.size());
      } else if (kind == data_format::u16) {
        if (bytes.size() % 2 != 0)
          throw std::runtime_error("the data file '" + path + "' is truncated: it has " + std::to_string(bytes.size()) +
                                   " bytes, an odd number, so it does not hold whole uint16 tokens (--data-format u16)");
        p.width = 2, p.tokens = static_cast<std::int64_t>(bytes.size() / 2);
      } else {
        p.offset = shard_header_bytes, p.width = 2;
        p.tokens = read_shard_header(bytes.first(std::min(bytes.size(), shard_header_bytes)), bytes.size(), path).tokens;
      }
      p.first = c.size_;
      c.size_ += p.tokens;
      c.check_vocabulary(p, vocab, kind);
      c.parts_.push_back(std::move(p));
    }
    if (c.size_ < static_cast<std::int64_t>(seq) + 2)
      throw std::runtime_error("the data '" + pattern + "' has " + std::to_string(c.size_) +
                               " tokens, fewer than one sequence of --seq " + std::to_string(seq) +
                               " tokens plus its label: give more data or a shorter --seq");
    return c;
  }

  /// Tokens in the stream (all files).
  std::int64_t size() const noexcept { return size_; }
  /// Whether windows are sampled from (seed, step) (text) rather than read in order (token files).
  bool sampled() const noexcept { return sampled_; }
  /// The stream's token at `index`.
  std::int32_t token(std::int64_t index) const {
    auto it = std::upper_bound(parts_.begin(), parts_.end(), index, [](std::int64_t i, const part& p) { return i < p.first; });
    const part& p = *std::prev(it);
    return p.at(index - p.first);
  }

  /// Where sequence `index` of the step at `at` starts in the stream.
  std::int64_t start(const data_position& at, std::int64_t index, int seq) const noexcept {
    if (!sampled_) {  // in order: whole windows of seq inputs and one more label, then around again
      const std::int64_t windows = (size_ - 1) / seq;
      return ((at.sequence + index) % windows) * seq;
    }
    std::uint64_t x = at.seed * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(at.step) << 24) ^
                      static_cast<std::uint64_t>(index);
    // splitmix64
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return static_cast<std::int64_t>(x % static_cast<std::uint64_t>(size_ - seq - 1));
  }

  /// Sequences [first, first + count) of the step at `at`, each seq + 1 tokens (inputs, then the
  /// last label), row after row.
  std::vector<std::int32_t> sequences(const data_position& at, std::int64_t first, std::int64_t count, int seq) const {
    std::vector<std::int32_t> out(static_cast<std::size_t>(count) * static_cast<std::size_t>(seq + 1));
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t s = start(at, first + i, seq);
      for (int t = 0; t <= seq; ++t)
        out[static_cast<std::size_t>(i) * static_cast<std::size_t>(seq + 1) + static_cast<std::size_t>(t)] = token(s + t);
    }
    return out;
  }

 private:
  struct part {
    std::shared_ptr<const mapped_file> file;
    std::size_t offset;     // bytes before the first token
    std::size_t width;      // bytes a token: 1 (text) or 2 (uint16, little-endian)
    std::int64_t tokens;    // in this file
    std::int64_t first;     // the stream index of its first token
    std::int32_t at(std::int64_t i) const noexcept {
      const unsigned char* b = file->bytes().data() + offset + static_cast<std::size_t>(i) * width;
      return width == 1 ? b[0] : static_cast<std::int32_t>(b[0] | (b[1] << 8));
    }
  };

  /// Every token below `vocab`, else one message naming the file, the token's place, its value
  /// and the limit.
  void check_vocabulary(const part& p, int vocab, data_format kind) const {
    for (std::int64_t i = 0; i < p.tokens; ++i) {
      const std::int32_t t = p.at(i);
      if (t < vocab) continue;
      const std::string path = p.file->path();
      if (kind == data_format::text)
        throw std::runtime_error("the data file '" + path + "' holds byte value " + std::to_string(t) + " at offset " +
                                 std::to_string(i) + ", which a vocabulary of " + std::to_string(vocab) +
                                 " tokens cannot represent: use --vocab 256 (or more) for byte-level text");
      throw std::runtime_error("the data file '" + path + "' holds token " + std::to_string(t) + " (token " +
                               std::to_string(i) + ", byte offset " +
                               std::to_string(p.offset + static_cast<std::size_t>(i) * p.width) +
                               "), not below the vocabulary of " + std::to_string(vocab) + " (--vocab " +
                               std::to_string(vocab) + "): give the --vocab of the tokenizer that wrote it (GPT-2: "
                               "50257), or the data written for this vocabulary");
    }
  }

  std::vector<part> parts_;
  std::int64_t size_ = 0;
  bool sampled_ = true;
};

/// A background thread that prepares batch `step` for steps [first, last) in order, up to
/// `ahead` steps before they are taken.
class batch_loader {
 public:
  using produce = std::function<std::vector<std::int32_t>(std::int64_t step)>;

  batch_loader(produce make, std::int64_t first, std::int64_t last, std::size_t ahead = 2)
      : make_(std::move(make)), next_(first), last_(last), ahead_(ahead), thread_([this] { loop(); }) {}
  ~batch_loader() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  batch_loader(const batch_loader&) = delete;
  batch_loader& operator=(const batch_loader&) = delete;

  /// The batch of `step` (steps are taken in order); rethrows the loader's error.
  std::vector<std::int32_t> take(std::int64_t step) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return !ready_.empty() || error_; });
    if (error_) std::rethrow_exception(error_);
    auto [s, batch] = std::move(ready_.front());
    ready_.pop_front();
    changed_.notify_all();
    if (s != step)
      throw std::logic_error("batch loader: step " + std::to_string(step) + " asked, " + std::to_string(s) + " ready");
    return std::move(batch);
  }

 private:
  void loop() {
    try {
      for (;;) {
        std::int64_t step = 0;
        {
          std::unique_lock lock(mutex_);
          changed_.wait(lock, [&] { return stop_ || (ready_.size() < ahead_ && next_ < last_); });
          if (stop_) return;
          step = next_++;
        }
        auto batch = make_(step);
        {
          std::lock_guard lock(mutex_);
          ready_.emplace_back(step, std::move(batch));
        }
        changed_.notify_all();
      }
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      changed_.notify_all();
    }
  }

  produce make_;
  std::int64_t next_, last_;
  std::size_t ahead_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::pair<std::int64_t, std::vector<std::int32_t>>> ready_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace train_gpt
