#pragma once
/// \file
/// The process's watchdog: one thread, started by the first communicator, that
///  - finds operations in flight past their communicator's deadline (WEFT_COMM_TIMEOUT, a
///    program's --comm-timeout, or communicator::set_timeout), writes every flight recorder of
///    this process to `weft-flight-<rank>.json` in $WEFT_TRACE_DIR (default: the working
///    directory), prints one message naming the rank, host, group, operation, sequence number and
///    time waited, aborts every communicator of the process, and exits with status 124;
///  - on SIGUSR1, writes the same file and carries on;
///  - on SIGTERM, writes the file, says which operations were in flight, and lets SIGTERM end the
///    process as it would have without weft.
/// Signal handlers are installed only where the program left the default in place, and they
/// only write one byte to a pipe: the dump runs on the watchdog thread, where it may allocate.
/// WEFT_TRACE_SIGNALS=0 leaves the signals alone.
///
/// Aborting is backend-neutral: each communicator registers a callable that aborts it from any
/// thread (NCCL: ncclCommAbort; MPI: MPI_Abort, which ends the whole job and never returns). The
/// watchdog calls those that return first, then those that end the process, then exits.
///
/// Why a thread of its own and not a check inside wait(): a rank stuck inside a blocking MPI call
/// never returns to weft's code, so only another thread can notice and act.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <weft/core/error.hpp>
#include <weft/trace/abort_action.hpp>
#include <weft/trace/flight_dump.hpp>
#include <weft/trace/flight_recorder.hpp>

namespace weft::trace {

/// The exit status of a process ended by a communication timeout (as coreutils' `timeout`).
inline constexpr int comm_timeout_exit_status = 124;

/// The folder dumps go to: $WEFT_TRACE_DIR, or the working directory.
inline std::string trace_directory() {
  const char* dir = std::getenv("WEFT_TRACE_DIR");
  return dir != nullptr && *dir != '\0' ? std::string(dir) : std::string(".");
}

/// Where this process's dump goes: <trace_directory()>/weft-flight-<world rank>.json.
inline std::string flight_dump_path() {
  const int rank = weft::detail::world_rank_for_messages();
  const std::string id = rank >= 0 ? std::to_string(rank) : "pid" + std::to_string(static_cast<long>(getpid()));
  return trace_directory() + "/weft-flight-" + id + ".json";
}

namespace detail {

inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), seconds < 10 ? "%.2f s" : "%.0f s", seconds);
  return text;
}

inline std::string describe_record(const flight_record& r) {
  std::string text = std::string(to_string(r.op)) + " #" + std::to_string(r.sequence) + " (" +
                     std::to_string(r.count) + " x " + std::string(to_string(r.type));
  if (r.op == operation::send || r.op == operation::recv) text += ", peer " + std::to_string(r.peer);
  else if (r.peer >= 0) text += ", root " + std::to_string(r.peer);
  return text + ")";
}

/// The signal pipe's write end, for the handlers (which may only write to it).
inline std::atomic<int>& signal_pipe() {
  static std::atomic<int> fd{-1};
  return fd;
}

extern "C" inline void weft_trace_on_signal(int signal_number) {
  const int saved = errno;
  const char code = signal_number == SIGUSR1 ? 'U' : 'T';
  const int fd = signal_pipe().load(std::memory_order_relaxed);
  if (fd >= 0) [[maybe_unused]] auto written = write(fd, &code, 1);
  errno = saved;
}

}  // namespace detail

class watchdog {
 public:
  /// The process's watchdog (created on first use; its thread starts with the first watch()).
  static watchdog& instance() {
    static watchdog the_watchdog;
    return the_watchdog;
  }

  /// Keeps a communicator under watch while alive; movable, unregisters on destruction.
  class registration {
   public:
    registration() = default;
    registration(registration&& other) noexcept : id_(std::exchange(other.id_, 0)) {}
    registration& operator=(registration&& other) noexcept {
      if (this != &other) {
        reset();
        id_ = std::exchange(other.id_, 0);
      }
      return *this;
    }
    registration(const registration&) = delete;
    registration& operator=(const registration&) = delete;
    ~registration() { reset(); }
    void reset() noexcept {
      if (id_ != 0) watchdog::instance().unwatch(std::exchange(id_, 0));
    }

   private:
    friend class watchdog;
    explicit registration(std::uint64_t id) : id_(id) {}
    std::uint64_t id_ = 0;
  };

  /// Watches `recorder`'s operations; `abort` is how to abort its communicator.
  registration watch(std::shared_ptr<flight_recorder> recorder, abort_action abort = {}) {
    std::lock_guard lock(mutex_);
    const std::uint64_t id = ++last_id_;
    watched_.push_back({id, std::move(recorder), std::move(abort)});
    if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { loop(); });
    return registration(id);
  }

  /// Every watched recorder's snapshot, as one dump of this process.
  flight_dump collect(std::string reason, std::string message = {}) const {
    flight_dump dump;
    dump.rank = weft::detail::world_rank_for_messages();
    dump.host = weft::detail::host_name();
    dump.pid = static_cast<long>(getpid());
    dump.reason = std::move(reason);
    dump.message = std::move(message);
    dump.dumped_at_ns = monotonic_ns();
    dump.unix_time_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
    std::lock_guard lock(mutex_);
    for (const watched& w : watched_) dump.groups.push_back(capture(*w.recorder));
    return dump;
  }

  /// Writes this process's dump to flight_dump_path() (through a temporary file, so a reader
  /// never sees half a dump) and returns the path. @throws weft::error when it cannot write.
  std::string dump(std::string reason, std::string message = {}) const {
    const std::string path = flight_dump_path();
    const std::string text = to_json(collect(std::move(reason), std::move(message)));
    const std::string partial = path + ".partial";
    {
      std::ofstream out(partial, std::ios::trunc);
      out << text;
      out.flush();
      if (!out)
        throw error("weft: cannot write the flight recorder to '" + partial +
                    "'; set WEFT_TRACE_DIR to a writable folder");
    }
    if (std::rename(partial.c_str(), path.c_str()) != 0)
      throw error("weft: cannot rename '" + partial + "' to '" + path + "': " + std::strerror(errno));
    return path;
  }

  /// Ends the process as a timeout does, from any thread: dump, `message` on stderr, abort
  /// every communicator, exit with `status`. For a backend's own fatal errors (an NCCL async
  /// error found by its poll) as much as for the deadline.
  [[noreturn]] void fail_process(const std::string& message, std::string reason = "timeout",
                                 int status = comm_timeout_exit_status) {
    std::string where;
    try {
      where = dump(reason, message);
    } catch (const std::exception& e) {
      where = std::string("not written: ") + e.what();
    }
    const std::string text = message + "; flight recorder: " + where + "; aborting every communicator of this process\n";
    [[maybe_unused]] auto written = write(STDERR_FILENO, text.data(), text.size());
    std::vector<abort_action> actions;
    {
      std::lock_guard lock(mutex_);
      for (const watched& w : watched_) actions.push_back(w.abort);
    }
    std::stable_partition(actions.begin(), actions.end(), [](const abort_action& a) { return !a.ends_process; });
    for (abort_action& action : actions) {
      if (!action.run) continue;
      try {
        action.run(status);
      } catch (...) {
        // Aborting is best effort: the exit below ends the process either way.
      }
    }
    std::_Exit(status);
  }

  /// How often the thread looks: a tenth of the shortest deadline, between 10 ms and 1 s.
  std::chrono::milliseconds poll_interval() const {
    std::lock_guard lock(mutex_);
    return interval_locked();
  }

  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;

  ~watchdog() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake();
    if (thread_.joinable()) thread_.join();
    detail::signal_pipe().store(-1, std::memory_order_relaxed);
    if (pipe_[0] >= 0) close(pipe_[0]);
    if (pipe_[1] >= 0) close(pipe_[1]);
  }

 private:
  struct watched {
    std::uint64_t id;
    std::shared_ptr<flight_recorder> recorder;
    abort_action abort;
  };

  watchdog() {
    if (pipe(pipe_) == 0) {
      for (int fd : pipe_) {
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        fcntl(fd, F_SETFD, FD_CLOEXEC);
      }
    } else {
      pipe_[0] = pipe_[1] = -1;
    }
  }

  void unwatch(std::uint64_t id) noexcept {
    std::lock_guard lock(mutex_);
    std::erase_if(watched_, [id](const watched& w) { return w.id == id; });
  }

  void wake() const noexcept {
    const char code = 'W';
    if (pipe_[1] >= 0) [[maybe_unused]] auto written = write(pipe_[1], &code, 1);
  }

  std::chrono::milliseconds interval_locked() const {
    std::int64_t shortest = 0;
    for (const watched& w : watched_) {
      const std::int64_t t = w.recorder->timeout().count();
      if (t > 0 && (shortest == 0 || t < shortest)) shortest = t;
    }
    const std::int64_t tenth = shortest > 0 ? shortest / 10 : 1000;
    return std::chrono::milliseconds(std::clamp<std::int64_t>(tenth, 10, 1000));
  }

  void install_signal_handlers() {
    const char* enabled = std::getenv("WEFT_TRACE_SIGNALS");
    if (enabled != nullptr && std::string_view(enabled) == "0") return;
    detail::signal_pipe().store(pipe_[1], std::memory_order_relaxed);
    for (int signal_number : {SIGUSR1, SIGTERM}) {
      struct sigaction current {};
      if (sigaction(signal_number, nullptr, &current) != 0 || current.sa_handler != SIG_DFL) continue;
      struct sigaction handler {};
      handler.sa_handler = &detail::weft_trace_on_signal;
      sigemptyset(&handler.sa_mask);
      handler.sa_flags = SA_RESTART;
      sigaction(signal_number, &handler, nullptr);
    }
  }

  void loop() {
    install_signal_handlers();
    for (;;) {
      std::chrono::milliseconds interval;
      {
        std::lock_guard lock(mutex_);
        if (stopping_) return;
        interval = interval_locked();
      }
      pollfd wait_on{pipe_[0], POLLIN, 0};
      const int ready = poll(&wait_on, pipe_[0] >= 0 ? 1 : 0, static_cast<int>(interval.count()));
      if (ready > 0) {
        char codes[64];
        const ssize_t n = read(pipe_[0], codes, sizeof(codes));
        for (ssize_t i = 0; i < n; ++i) {
          if (codes[i] == 'U') dump_on_request();
          if (codes[i] == 'T') end_on_sigterm();
        }
      }
      check_deadlines();
    }
  }

  void dump_on_request() {
    try {
      const std::string path = dump("signal");
      std::fprintf(stderr, "weft: rank %d: SIGUSR1: flight recorder written to %s\n",
                   weft::detail::world_rank_for_messages(), path.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weft: SIGUSR1: %s\n", e.what());
    }
  }

  /// What each watched communicator is waiting in, for the SIGTERM message.
  std::string in_flight_summary() const {
    std::string text;
    const std::int64_t now = monotonic_ns();
    std::lock_guard lock(mutex_);
    for (const watched& w : watched_) {
      if (auto r = w.recorder->oldest_unfinished()) {
        text += (text.empty() ? "" : "; ") + detail::describe_record(*r) + " on group '" + w.recorder->group() +
                "' for " + detail::seconds_text(static_cast<double>(now - r->issued_ns) / 1e9);
      }
    }
    return text.empty() ? "no operation in flight" : "in flight: " + text;
  }

  [[noreturn]] void end_on_sigterm() {
    const std::string message = "weft: rank " + std::to_string(weft::detail::world_rank_for_messages()) + " (host " +
                                weft::detail::host_name() + "): terminated by SIGTERM; " + in_flight_summary();
    std::string where;
    try {
      where = dump("terminate", message);
    } catch (const std::exception& e) {
      where = std::string("not written: ") + e.what();
    }
    const std::string text = message + "; flight recorder: " + where + "\n";
    [[maybe_unused]] auto written = write(STDERR_FILENO, text.data(), text.size());
    // End exactly as SIGTERM would have without weft's handler.
    std::signal(SIGTERM, SIG_DFL);
    kill(getpid(), SIGTERM);
    for (;;) pause();
  }

  void check_deadlines() {
    const std::int64_t now = monotonic_ns();
    std::shared_ptr<flight_recorder> late;
    flight_record record;
    {
      std::lock_guard lock(mutex_);
      for (const watched& w : watched_) {
        const std::int64_t timeout_ms = w.recorder->timeout().count();
        if (timeout_ms <= 0) continue;
        auto r = w.recorder->oldest_unfinished();
        if (r && now - r->issued_ns > timeout_ms * 1'000'000) {
          late = w.recorder;
          record = *r;
          break;
        }
      }
    }
    if (late) fail_process(timeout_message(*late, record, now));
  }

  static std::string timeout_message(const flight_recorder& recorder, const flight_record& r, std::int64_t now) {
    const double waited = static_cast<double>(now - r.issued_ns) / 1e9;
    const double deadline = static_cast<double>(recorder.timeout().count()) / 1e3;
    std::string missing;
    if (r.op == operation::send || r.op == operation::recv) {
      missing = "rank " + std::to_string(r.peer) + " of the group (the peer) never matched it";
    } else {
      missing = "ranks that never arrived: not knowable from this rank; run weft-trace-diff on the folder of "
                "the ranks' weft-flight-*.json dumps to name them";
    }
    return "weft: rank " + std::to_string(weft::detail::world_rank_for_messages()) + " (host " +
           weft::detail::host_name() + "): " + detail::describe_record(r) + " on group '" + recorder.group() +
           "' (rank " + std::to_string(recorder.rank()) + " of " + std::to_string(recorder.size()) +
           ") timed out: waited " + detail::seconds_text(waited) + ", deadline " + detail::seconds_text(deadline) +
           " (WEFT_COMM_TIMEOUT or --comm-timeout); " + missing;
  }

  mutable std::mutex mutex_;
  std::vector<watched> watched_;
  std::uint64_t last_id_ = 0;
  bool stopping_ = false;
  int pipe_[2] = {-1, -1};
  std::thread thread_;
};

/// Writes this process's flight recorders now (the on-demand dump) and returns the file's path.
inline std::string dump_flight_recorders(std::string reason = "request") {
  return watchdog::instance().dump(std::move(reason));
}

}  // namespace weft::trace
