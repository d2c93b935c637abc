#pragma once
// Training data: byte-level tokens from a file, sampled deterministically from the seed, and a
// loader thread that prepares the next steps' batches while the current one runs.
//
// Sequence i of step s starts at a position drawn from (seed, s, i) alone, so every rank finds
// the same global batch without talking, each data-parallel rank reads only its slice, and a
// resumed run sees exactly the batches the uninterrupted run would have (the data position is
// the step number).

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace train_gpt {

class corpus {
 public:
  /// Reads `path` whole; each byte is a token. Throws, saying what to do, when the file is
  /// missing, too short for one sequence, or holds bytes the vocabulary cannot represent.
  static corpus load(const std::filesystem::path& path, int seq, int vocab) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr)
      throw std::runtime_error("cannot open the data file '" + path.string() +
                               "': give an existing text file with --data (bytes are the tokens)");
    corpus c;
    unsigned char block[1 << 16];
    std::size_t got = 0;
    while ((got = std::fread(block, 1, sizeof(block), f)) > 0) c.bytes_.insert(c.bytes_.end(), block, block + got);
    std::fclose(f);
    if (c.bytes_.size() < static_cast<std::size_t>(seq) + 2)
      throw std::runtime_error("the data file '" + path.string() + "' has " + std::to_string(c.bytes_.size()) +
                               " bytes, fewer than one sequence of --seq " + std::to_string(seq) +
                               " tokens plus its label: give a longer file or a shorter --seq");
    unsigned max = 0;
    for (unsigned char b : c.bytes_) max = b > max ? b : max;
    if (static_cast<int>(max) >= vocab)
      throw std::runtime_error("the data file '" + path.string() + "' holds byte value " + std::to_string(max) +
                               ", which a vocabulary of " + std::to_string(vocab) +
                               " tokens cannot represent: use --vocab 256 (or more) for byte-level text");
    return c;
  }

  std::size_t size() const noexcept { return bytes_.size(); }

  /// Where sequence `index` of step `step` starts.
  std::size_t start(std::uint64_t seed, std::int64_t step, std::int64_t index, int seq) const noexcept {
    std::uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (static_cast<std::uint64_t>(step) << 24) ^
                      static_cast<std::uint64_t>(index);
    // splitmix64
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return static_cast<std::size_t>(x % (bytes_.size() - static_cast<std::size_t>(seq) - 1));
  }

  /// Sequences [first, first + count) of step `step`, each seq + 1 tokens (inputs, then the last
  /// label), row after row.
  std::vector<std::int32_t> sequences(std::uint64_t seed, std::int64_t step, std::int64_t first, std::int64_t count,
                                      int seq) const {
    std::vector<std::int32_t> out(static_cast<std::size_t>(count) * static_cast<std::size_t>(seq + 1));
    for (std::int64_t i = 0; i < count; ++i) {
      const std::size_t s = start(seed, step, first + i, seq);
      for (int t = 0; t <= seq; ++t)
        out[static_cast<std::size_t>(i) * static_cast<std::size_t>(seq + 1) + static_cast<std::size_t>(t)] =
            bytes_[s + static_cast<std::size_t>(t)];
    }
    return out;
  }

 private:
  std::vector<unsigned char> bytes_;
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
