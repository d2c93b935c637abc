#pragma once
/// \file
/// Checkpoints written in the background: the trainer hands over a snapshot (a checkpoint_file it
/// owns no more) and goes on training while one thread writes it with write_safetensors. One
/// write is in flight at a time; a failed write is reported at the next submit or wait, so a
/// trainer never believes a checkpoint exists that does not.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include <weft/checkpoint/safetensors.hpp>

namespace weft::checkpoint {

/// One background thread that writes checkpoint files.
///
///     async_writer writer;
///     writer.submit(dir / "step-1000.safetensors", snapshot_of(model));   // returns at once
///     ... train ...
///     writer.wait();                                                       // before exit, or to be sure
class async_writer {
 public:
  async_writer() : thread_([this] { run(); }) {}

  /// Finishes the pending write, then stops the thread. Does not throw: an error nobody collected
  /// with wait() is printed to stderr instead.
  ~async_writer() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    thread_.join();
    if (error_) {
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "weft: a background checkpoint write failed and no wait() reported it: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "weft: a background checkpoint write failed and no wait() reported it\n");
      }
    }
  }

  async_writer(const async_writer&) = delete;
  async_writer& operator=(const async_writer&) = delete;

  /// Queues `file` to be written to `path` and returns without writing. If a write is still in
  /// flight, waits for it first. If the previous write failed, throws its error here and queues
  /// nothing (submit again to write this snapshot).
  void submit(std::filesystem::path path, checkpoint_file file) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return !pending_ && !writing_; });
    rethrow_error();
    pending_.emplace(job{std::move(path), std::move(file)});
    busy_.store(true, std::memory_order_release);
    lock.unlock();
    changed_.notify_all();
  }

  /// Blocks until nothing is pending; throws the error of a failed write (once).
  void wait() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return !pending_ && !writing_; });
    rethrow_error();
  }

  /// Whether a submitted write has not finished yet.
  bool busy() const noexcept { return busy_.load(std::memory_order_acquire); }

  /// How long the last successful write took (serialising, writing, fsync and rename), in seconds.
  double last_write_seconds() const noexcept { return last_seconds_.load(std::memory_order_relaxed); }
  /// The size of the last successfully written file, in bytes.
  std::uint64_t last_write_bytes() const noexcept { return last_bytes_.load(std::memory_order_relaxed); }

 private:
  struct job {
    std::filesystem::path path;
    checkpoint_file file;
  };

  /// Called with the lock held.
  void rethrow_error() {
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

  void run() {
    std::unique_lock lock(mutex_);
    while (true) {
      changed_.wait(lock, [this] { return pending_.has_value() || stopping_; });
      if (!pending_) return;  // stopping, and every write is done
      std::optional<job> current = std::move(pending_);
      pending_.reset();
      writing_ = true;
      lock.unlock();

      std::exception_ptr failure;
      std::uint64_t bytes = 0;
      const auto start = std::chrono::steady_clock::now();
      try {
        bytes = detail::write_safetensors_file(current->path, current->file);
      } catch (...) {
        failure = std::current_exception();
      }
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      current.reset();  // free the snapshot here, not on the trainer's thread

      lock.lock();
      if (failure) {
        error_ = failure;
      } else {
        last_seconds_.store(elapsed.count(), std::memory_order_relaxed);
        last_bytes_.store(bytes, std::memory_order_relaxed);
      }
      writing_ = false;
      busy_.store(false, std::memory_order_release);
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<job> pending_;  // guarded by mutex_
  bool writing_ = false;        // guarded by mutex_: a job was taken and is being written
  bool stopping_ = false;       // guarded by mutex_
  std::exception_ptr error_;    // guarded by mutex_; read without it only after the thread has joined
  std::atomic<bool> busy_{false};
  std::atomic<double> last_seconds_{0.0};
  std::atomic<std::uint64_t> last_bytes_{0};
  std::thread thread_;  // last: starts after every member it reads is constructed
};

}  // namespace weft::checkpoint
