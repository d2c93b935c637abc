#pragma once
/// \file
/// Why a thread: Open MPI's non-blocking collectives only advance inside MPI calls, so an
/// MPI_Iallreduce started before a backward pass barely moves until the trainer calls MPI again
/// (measured here: a bucketed scheme on MPI_Iallreduce took about twice as long as blocking
/// calls). weft instead gives each communicator one thread that runs *blocking* MPI calls in the
/// order they were issued (as PyTorch's MPI process group and Horovod do); while that thread sits
/// in MPI, MPI progresses, and the caller's thread is free to compute. Issue order is the order on
/// every rank, so the ranks meet in the same collective. This needs MPI_THREAD_MULTIPLE.

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace weft::detail::mpi {

/// One queued operation: what to run, whether it is done, and how it failed.
struct task {
  std::function<void()> work;
  std::atomic<bool> done{false};
  std::exception_ptr failure;

  /// Once done: rethrows the failure, if any, handing the caller the task's reference to it. Left
  /// shared, the exception's last release could fall to the progress thread dropping its task
  /// after the caller's handler had read the exception; that order is kept by a reference count
  /// inside the C++ runtime, which ThreadSanitizer cannot see, so it reported a race.
  void rethrow_failure() {
    if (failure) std::rethrow_exception(std::exchange(failure, nullptr));
  }
};

class progress_thread {
 public:
  progress_thread() : worker_([this] { loop(); }) {}
  progress_thread(const progress_thread&) = delete;
  progress_thread& operator=(const progress_thread&) = delete;

  /// Finishes every queued operation, then stops the thread.
  ~progress_thread() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    worker_.join();
  }

  std::shared_ptr<task> submit(std::function<void()> work) {
    auto item = std::make_shared<task>();
    item->work = std::move(work);
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(item);
      // Counted only once queued: a push that throws must not leave drain() waiting for it.
      pending_.fetch_add(1, std::memory_order_acq_rel);
    }
    wake_.notify_one();
    return item;
  }

  /// True when nothing is queued or running: the caller may then use MPI on this communicator
  /// directly, in order with everything issued before.
  bool idle() const noexcept { return pending_.load(std::memory_order_acquire) == 0; }

  /// Blocks until everything issued so far has finished.
  void drain() {
    std::shared_ptr<task> last;
    {
      std::lock_guard lock(mutex_);
      if (!queue_.empty()) last = queue_.back();
    }
    if (last) last->done.wait(false, std::memory_order_acquire);
    while (!idle()) std::this_thread::yield();  // the running one, if the queue was already empty
  }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<task> item;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        item = queue_.front();
      }
      try {
        item->work();
      } catch (...) {
        item->failure = std::current_exception();
      }
      item->work = nullptr;  // release captured state before signalling
      {
        std::lock_guard lock(mutex_);
        queue_.pop_front();
      }
      item->done.store(true, std::memory_order_release);
      item->done.notify_all();
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<task>> queue_;
  std::atomic<int> pending_{0};
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace weft::detail::mpi
