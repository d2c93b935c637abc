#pragma once
/// \file
/// Checkpoints written in the background: the trainer hands over a snapshot (one or more
/// checkpoint_files it owns no more) and goes on training while one thread writes them with
/// write_safetensors. One submission is in flight at a time; a failed write is reported at the
/// next submit or wait, so a trainer never believes a checkpoint exists that does not. Waiting for
/// a write has a deadline: a disk that stalls is reported on the rank that writes, naming the
/// file and the time, before the ranks waiting for that one time out without a word.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <weft/checkpoint/safetensors.hpp>
#include <weft/core/error.hpp>
#include <weft/core/timeout.hpp>

namespace weft::checkpoint {

/// How long a caller waits for one file's write by default: half the default deadline of a
/// communication, so a rank held up by its disk reports it before its peers' collectives expire.
inline constexpr std::chrono::milliseconds default_write_deadline = weft::default_comm_timeout / 2;

/// One file of a submission: where to write it, and what.
struct write_request {
  std::filesystem::path path;
  checkpoint_file file;
  /// When set, called on the writing thread instead of writing `file` (which then stays empty)
  /// and returns the bytes it wrote; `path` names the step in messages. A distributed checkpoint
  /// uses it for its steps after a rank's file (the rank's manifest, the index).
  std::function<std::uint64_t()> write = {};
};

/// One background thread that writes checkpoint files.
///
///     async_writer writer;
///     writer.submit({{dir / "step-1000.optimizer", snapshot_of(optimizer)},   // written first
///                    {dir / "step-1000.safetensors", snapshot_of(model)}});    // returns at once
///     ... train ...
///     writer.wait();                                                            // before exit, or to be sure
class async_writer {
  using clock = std::chrono::steady_clock;

 public:
  /// `deadline`: how long a submit, wait or the destructor waits for one file's write, counted
  /// from that write's start (0: no deadline). Keep it below the communication deadline of the
  /// ranks that may wait for this one.
  explicit async_writer(std::chrono::milliseconds deadline = default_write_deadline)
      : state_(std::make_shared<shared_state>()), deadline_(deadline), thread_([s = state_] { run(*s); }) {}

  /// Finishes the pending writes, then stops the thread. Does not throw: an error nobody
  /// collected with wait() is printed to stderr instead. A write past its deadline is reported
  /// there too and left to the thread, which is detached, so a stalled disk cannot keep the
  /// process from exiting.
  ~async_writer() {
    std::unique_lock lock(state_->mutex);
    state_->stopping = true;
    state_->changed.notify_all();
    bool stalled = false;
    try {
      wait_until_idle(lock);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      stalled = true;
    }
    std::exception_ptr error = std::exchange(state_->error, nullptr);
    lock.unlock();
    if (stalled) {
      thread_.detach();  // it owns its share of the state
    } else {
      thread_.join();
    }
    if (error) {
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "weft: a background checkpoint write failed and no wait() reported it: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "weft: a background checkpoint write failed and no wait() reported it\n");
      }
    }
  }

  async_writer(const async_writer&) = delete;
  async_writer& operator=(const async_writer&) = delete;

  /// Queues `files` to be written in order, one after another, and returns without writing: a
  /// model and its optimizer state are one submission, so the caller never waits for the first
  /// file's write before handing over the second. A later file is not written when an earlier
  /// one failed. If the previous submission is still being written, waits for it first (at
  /// most until its write in flight is past the deadline: then throws weft::error naming the
  /// file and the time, and queues nothing). If the previous submission failed, throws its
  /// error here and queues nothing (submit again to write this snapshot).
  void submit(std::vector<write_request> files) {
    std::unique_lock lock(state_->mutex);
    wait_until_idle(lock);
    rethrow_error();
    state_->pending = std::move(files);
    busy_store(true);
    lock.unlock();
    state_->changed.notify_all();
  }

  /// One file: submit({{path, file}}).
  void submit(std::filesystem::path path, checkpoint_file file) {
    std::vector<write_request> files;
    files.push_back({std::move(path), std::move(file)});
    submit(std::move(files));
  }

  /// Blocks until nothing is pending; throws the error of a failed write (once), or weft::error
  /// when the write in flight is past the deadline (naming the file and how long it has run).
  void wait() {
    std::unique_lock lock(state_->mutex);
    wait_until_idle(lock);
    rethrow_error();
  }

  /// Whether a submitted write has not finished yet.
  bool busy() const noexcept { return state_->busy.load(std::memory_order_acquire); }

  /// The deadline of one file's write (0: none).
  std::chrono::milliseconds deadline() const noexcept { return deadline_; }

  /// How long the last successful submission took (serialising, writing, fsync and rename of
  /// every file), in seconds.
  double last_write_seconds() const noexcept { return state_->last_seconds.load(std::memory_order_relaxed); }
  /// The size of the files of the last successful submission, in bytes.
  std::uint64_t last_write_bytes() const noexcept { return state_->last_bytes.load(std::memory_order_relaxed); }

 private:
  /// What the writing thread and the owner share; the thread holds its own reference, so a
  /// writer whose thread is stuck in the kernel can be destroyed.
  struct shared_state {
    std::mutex mutex;
    std::condition_variable changed;
    std::optional<std::vector<write_request>> pending;  // guarded by mutex
    bool writing = false;                                // guarded by mutex: a submission was taken and is being written
    bool stopping = false;                               // guarded by mutex
    std::exception_ptr error;                            // guarded by mutex
    std::filesystem::path current_path;                  // guarded by mutex: the file being written
    clock::time_point current_start;                     // guarded by mutex: when its write began
    std::atomic<bool> busy{false};
    std::atomic<double> last_seconds{0.0};
    std::atomic<std::uint64_t> last_bytes{0};
  };

  void busy_store(bool value) noexcept { state_->busy.store(value, std::memory_order_release); }

  /// Called with the lock held.
  void rethrow_error() {
    if (state_->error) std::rethrow_exception(std::exchange(state_->error, nullptr));
  }

  /// Waits (lock held) until nothing is pending or being written; throws once the file being
  /// written has been at it for longer than the deadline.
  void wait_until_idle(std::unique_lock<std::mutex>& lock) {
    shared_state& s = *state_;
    while (s.pending || s.writing) {
      if (deadline_.count() <= 0 || !s.writing) {
        s.changed.wait(lock);  // the thread notifies as each file's write begins
        continue;
      }
      const clock::time_point limit = s.current_start + deadline_;
      const clock::time_point now = clock::now();
      if (now >= limit) {
        const double ran = std::chrono::duration<double>(now - s.current_start).count();
        char times[96];
        std::snprintf(times, sizeof times, "has run for %.1f s, past its deadline of %.1f s", ran,
                      std::chrono::duration<double>(deadline_).count());
        fail("the background checkpoint write of '" + s.current_path.string() + "' " + times +
             ": the storage is stalled or too slow for it. Stopped waiting, so this rank reports it instead of "
             "leaving the ranks that wait for it to time out; the file at that path is replaced only if the write "
             "still completes. Save to faster storage, or give the writer a longer deadline");
      }
      s.changed.wait_until(lock, limit);
    }
  }

  static void run(shared_state& s) {
    std::unique_lock lock(s.mutex);
    while (true) {
      s.changed.wait(lock, [&] { return s.pending.has_value() || s.stopping; });
      if (!s.pending) return;  // stopping, and every write is done
      std::vector<write_request> files = std::move(*s.pending);
      s.pending.reset();
      s.writing = true;

      std::exception_ptr failure;
      std::uint64_t bytes = 0;
      const auto start = clock::now();
      for (const write_request& request : files) {
        s.current_path = request.path;
        s.current_start = clock::now();
        s.changed.notify_all();  // a waiter now measures the deadline from here
        lock.unlock();
        try {
          bytes += request.write ? request.write() : detail::write_safetensors_file(request.path, request.file);
        } catch (...) {
          failure = std::current_exception();
        }
        lock.lock();
        if (failure) break;  // a later file is not written after an earlier one failed
      }
      const std::chrono::duration<double> elapsed = clock::now() - start;
      lock.unlock();
      files.clear();  // free the snapshot here, not on the trainer's thread
      lock.lock();

      if (failure) {
        s.error = failure;
      } else {
        s.last_seconds.store(elapsed.count(), std::memory_order_relaxed);
        s.last_bytes.store(bytes, std::memory_order_relaxed);
      }
      s.writing = false;
      s.busy.store(false, std::memory_order_release);
      s.changed.notify_all();
    }
  }

  std::shared_ptr<shared_state> state_;
  std::chrono::milliseconds deadline_;
  std::thread thread_;  // last: starts after every member it reads is constructed
};

}  // namespace weft::checkpoint
