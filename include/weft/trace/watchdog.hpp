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
/// They are put back as they were when the watchdog stops, and in a forked child (which has no
/// watchdog thread). WEFT_TRACE_SIGNALS=0 leaves the signals alone.
///
/// Dumps from every rank: a rank that times out first leaves a marker,
/// `weft-dump-request-<job id>`, in $WEFT_TRACE_DIR; every other watchdog of the job looks for it
/// on each poll and writes its own dump, without the stuck communicator. The rank that timed out
/// waits for them (three polls at most, and at most half the grace below) before it aborts.
///
/// A second thread, the monitor, watches the watchdog: once the process has started to fail, it
/// ends it with _exit(status) after WEFT_ABORT_GRACE seconds (default 10) if the dump or an abort
/// blocks (a hung $WEFT_TRACE_DIR, an ncclCommAbort that never returns); and when the watchdog
/// thread itself has not come round for longer than the grace (a SIGUSR1 dump that blocks), it
/// checks the deadlines in its place and ends the process, without a dump, if one has passed.
///
/// Aborting is backend-neutral: each communicator registers a callable that aborts it from any
/// thread (NCCL: ncclCommAbort; MPI: MPI_Abort, which ends the whole job and never returns). The
/// watchdog calls those that return first, then those that end the process, then exits.
///
/// Why a thread of its own and not a check inside wait(): a rank stuck inside a blocking MPI call
/// never returns to weft's code, so only another thread can notice and act.

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <condition_variable>
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
#include <pthread.h>
#include <sys/stat.h>
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

inline std::mutex& job_id_mutex() {
  static std::mutex m;
  return m;
}
inline std::string& job_id_override() {
  static std::string id;
  return id;
}

}  // namespace detail

/// Names the job this process belongs to, for dumps (a value every rank of the job agreed on at
/// start-up); overrides what job_id() reads from the launcher.
inline void set_job_id(std::string id) {
  std::lock_guard lock(detail::job_id_mutex());
  detail::job_id_override() = std::move(id);
}

/// The job this process belongs to, the same on every rank of one launch without any
/// communication: set_job_id()'s value; else the launcher's: SLURM_JOB_ID (with
/// ".<SLURM_STEP_ID>": two sruns in one allocation are two runs), PMIX_NAMESPACE (Open MPI and
/// other PMIx launchers), OMPI_MCA_ess_base_jobid, TORCHELASTIC_RUN_ID; else "" (unknown: then
/// weft-trace-diff cannot tell runs apart and says so).
inline std::string job_id() {
  {
    std::lock_guard lock(detail::job_id_mutex());
    if (!detail::job_id_override().empty()) return detail::job_id_override();
  }
  auto variable = [](const char* name) -> std::string {
    const char* value = std::getenv(name);
    return value != nullptr ? std::string(value) : std::string();
  };
  if (std::string slurm = variable("SLURM_JOB_ID"); !slurm.empty()) {
    const std::string step = variable("SLURM_STEP_ID");
    return "slurm-" + slurm + (step.empty() ? std::string() : "." + step);
  }
  for (const char* name : {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "TORCHELASTIC_RUN_ID"})
    if (std::string value = variable(name); !value.empty()) return value;
  return {};
}

/// The marker a rank that timed out leaves so that the job's other ranks dump too.
inline std::string dump_request_path(const std::string& job) {
  std::string safe;
  for (char c : job) safe += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_') ? c : '_';
  return trace_directory() + "/weft-dump-request-" + (safe.empty() ? std::string("unknown-job") : safe);
}

/// How long the monitor lets a failing process dump and abort before it ends it with _exit:
/// WEFT_ABORT_GRACE seconds, default 10, from 0.1 to 3600.
inline std::chrono::milliseconds abort_grace_from_environment() {
  const char* value = std::getenv("WEFT_ABORT_GRACE");
  if (value == nullptr || *value == '\0') return std::chrono::seconds(10);
  char* end = nullptr;
  const double seconds = std::strtod(value, &end);
  if (end == value || *end != '\0' || !(seconds >= 0.1) || seconds > 3600)
    throw error(std::string("weft: WEFT_ABORT_GRACE='") + value +
                "' is not a number of seconds from 0.1 to 3600; the default is 10");
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
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

inline void write_stderr(const std::string& text) noexcept {
  [[maybe_unused]] auto written = write(STDERR_FILENO, text.data(), text.size());
}

/// Writes `text` to `path` through `path`.partial, opened so that nothing planted there is
/// followed or blocks: O_EXCL (a stale one is removed and created anew), O_NOFOLLOW, O_NONBLOCK.
inline void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string partial = path + ".partial";
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  int fd = open(partial.c_str(), flags, 0644);
  if (fd < 0 && errno == EEXIST && unlink(partial.c_str()) == 0) fd = open(partial.c_str(), flags, 0644);
  if (fd < 0)
    throw error("weft: cannot create '" + partial + "': " + std::strerror(errno) +
                "; set WEFT_TRACE_DIR to a writable folder");
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string reason = std::strerror(errno);
      close(fd);
      unlink(partial.c_str());
      throw error("weft: cannot write the flight recorder to '" + partial + "': " + reason +
                  "; set WEFT_TRACE_DIR to a writable folder");
    }
    done += static_cast<std::size_t>(n);
  }
  close(fd);
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    unlink(partial.c_str());
    throw error("weft: cannot rename '" + partial + "' to '" + path + "': " + reason);
  }
}

inline std::int64_t modified_ns(const struct stat& st) noexcept {
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
}

inline std::int64_t wall_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
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
    if (!thread_ && !stopping_) {
      grace_ = abort_grace_from_environment();
      job_ = job_id();
      started_wall_ns_ = detail::wall_ns();
      heartbeat_ns_.store(monotonic_ns(), std::memory_order_relaxed);
      install_signal_handlers();
      thread_ = std::make_unique<std::thread>([this] { loop(); });
      monitor_ = std::make_unique<std::thread>([this] { monitor_loop(); });
    }
    return registration(id);
  }

  /// Every watched recorder's snapshot, as one dump of this process.
  flight_dump collect(std::string reason, std::string message = {}) const {
    flight_dump dump;
    dump.rank = weft::detail::world_rank_for_messages();
    dump.host = weft::detail::host_name();
    dump.pid = static_cast<long>(getpid());
    dump.job = job_id();
    dump.reason = std::move(reason);
    dump.message = std::move(message);
    dump.dumped_at_ns = monotonic_ns();
    dump.unix_time_ns = detail::wall_ns();
    std::lock_guard lock(mutex_);
    for (const watched& w : watched_) dump.groups.push_back(capture(*w.recorder));
    return dump;
  }

  /// Writes this process's dump to flight_dump_path() (through a temporary file, so a reader
  /// never sees half a dump) and returns the path. @throws weft::error when it cannot write.
  std::string dump(std::string reason, std::string message = {}) const {
    const std::string path = flight_dump_path();
    detail::write_file_atomically(path, to_json(collect(std::move(reason), std::move(message))));
    return path;
  }

  /// Ends the process as a timeout does, from any thread: asks the job's other ranks to dump,
  /// dumps, `message` on stderr, waits (briefly) for the other ranks' dumps, aborts every
  /// communicator, exits with `status`. For a backend's own fatal errors (an NCCL async error
  /// found by its poll) as much as for the deadline. The first call wins: a second one, from
  /// another thread, waits for the first to end the process. The monitor ends the process with
  /// `status` if this has not within the grace (WEFT_ABORT_GRACE).
  [[noreturn]] void fail_process(const std::string& message, std::string reason = "timeout",
                                 int status = comm_timeout_exit_status) {
    if (failing_.exchange(true, std::memory_order_acq_rel)) {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // the first call ends the process
    }
    {
      std::lock_guard lock(monitor_mutex_);
      failing_message_ = message;
      failing_status_ = status;
      failing_since_ns_ = monotonic_ns();
    }
    monitor_wake_.notify_all();
    const std::int64_t requested_at = request_dumps_from_other_ranks(message);
    std::string where;
    try {
      where = dump(reason, message);
    } catch (const std::exception& e) {
      where = std::string("not written: ") + e.what();
    }
    detail::write_stderr(message + "; flight recorder: " + where + "; aborting every communicator of this process\n");
    if (requested_at != 0) wait_for_other_dumps(requested_at);
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
    {
      std::lock_guard lock(monitor_mutex_);
      monitor_stopping_ = true;
    }
    monitor_wake_.notify_all();
    wake();
    if (thread_ && thread_->joinable()) thread_->join();
    if (monitor_ && monitor_->joinable()) monitor_->join();
    // The handlers go before the pipe does: with the pipe closed, they would swallow SIGTERM.
    restore_signal_handlers();
    detail::signal_pipe().store(-1, std::memory_order_relaxed);
    const bool terminate_now = drain_pipe_for_sigterm();
    if (pipe_[0] >= 0) close(pipe_[0]);
    if (pipe_[1] >= 0) close(pipe_[1]);
    current().store(nullptr, std::memory_order_release);
    // A SIGTERM that came while the watchdog stopped ends the process as it would without weft.
    if (terminate_now) raise(SIGTERM);
  }

 private:
  struct watched {
    std::uint64_t id;
    std::shared_ptr<flight_recorder> recorder;
    abort_action abort;
  };

  /// The watchdog the fork handlers act on (null once it is destroyed).
  static std::atomic<watchdog*>& current() {
    static std::atomic<watchdog*> self{nullptr};
    return self;
  }

  watchdog() {
    open_pipe();
    current().store(this, std::memory_order_release);
    pthread_atfork(&watchdog::before_fork, &watchdog::after_fork_in_parent, &watchdog::after_fork_in_child);
  }

  void open_pipe() {
    if (pipe(pipe_) == 0) {
      for (int fd : pipe_) {
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        fcntl(fd, F_SETFD, FD_CLOEXEC);
      }
    } else {
      pipe_[0] = pipe_[1] = -1;
    }
  }

  // fork(): the child has no watchdog thread and no monitor. Its copy of the handlers would write
  // into the parent's pipe (a SIGTERM to the child would end the parent), so the child gets the
  // signal dispositions the program had, a pipe of its own, nothing watched (the communicators
  // it copied belong to the parent), and a watchdog that starts afresh on its first watch().
  static void before_fork() {
    if (watchdog* w = current().load(std::memory_order_acquire)) {
      w->mutex_.lock();
      w->monitor_mutex_.lock();
    }
  }
  static void after_fork_in_parent() {
    if (watchdog* w = current().load(std::memory_order_acquire)) {
      w->monitor_mutex_.unlock();
      w->mutex_.unlock();
    }
  }
  static void after_fork_in_child() {
    watchdog* w = current().load(std::memory_order_acquire);
    if (w == nullptr) return;
    w->monitor_mutex_.unlock();
    w->mutex_.unlock();
    w->restore_signal_handlers();
    detail::signal_pipe().store(-1, std::memory_order_relaxed);
    if (w->pipe_[0] >= 0) close(w->pipe_[0]);
    if (w->pipe_[1] >= 0) close(w->pipe_[1]);
    w->open_pipe();
    // The threads do not exist in the child: let their handles go without joining.
    [[maybe_unused]] std::thread* gone = w->thread_.release();
    [[maybe_unused]] std::thread* monitor_gone = w->monitor_.release();
    w->watched_.clear();
    w->failing_.store(false, std::memory_order_relaxed);
    w->failing_since_ns_ = 0;
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
    for (std::size_t i = 0; i < handled_signals.size(); ++i) {
      struct sigaction current {};
      if (sigaction(handled_signals[i], nullptr, &current) != 0 || current.sa_handler != SIG_DFL) continue;
      struct sigaction handler {};
      handler.sa_handler = &detail::weft_trace_on_signal;
      sigemptyset(&handler.sa_mask);
      handler.sa_flags = SA_RESTART;
      if (sigaction(handled_signals[i], &handler, &previous_[i]) == 0) installed_[i] = true;
    }
  }

  /// Puts back what the program had for each signal whose handler is still weft's.
  void restore_signal_handlers() noexcept {
    for (std::size_t i = 0; i < handled_signals.size(); ++i) {
      if (!installed_[i]) continue;
      struct sigaction current {};
      if (sigaction(handled_signals[i], nullptr, &current) == 0 && current.sa_handler == &detail::weft_trace_on_signal)
        sigaction(handled_signals[i], &previous_[i], nullptr);
      installed_[i] = false;
    }
  }

  /// Reads what is left in the pipe; true when a SIGTERM was among it.
  bool drain_pipe_for_sigterm() noexcept {
    if (pipe_[0] < 0) return false;
    bool terminate = false;
    char codes[64];
    for (ssize_t n; (n = read(pipe_[0], codes, sizeof(codes))) > 0;)
      for (ssize_t i = 0; i < n; ++i) terminate = terminate || codes[i] == 'T';
    return terminate;
  }

  void loop() {
    for (;;) {
      std::chrono::milliseconds interval;
      {
        std::lock_guard lock(mutex_);
        if (stopping_) return;
        interval = interval_locked();
      }
      heartbeat_ns_.store(monotonic_ns(), std::memory_order_relaxed);
      pollfd wait_on{pipe_[0], POLLIN, 0};
      const int ready = poll(&wait_on, pipe_[0] >= 0 ? 1 : 0, static_cast<int>(interval.count()));
      heartbeat_ns_.store(monotonic_ns(), std::memory_order_relaxed);
      if (ready > 0) {
        char codes[64];
        const ssize_t n = read(pipe_[0], codes, sizeof(codes));
        // While fail_process runs on another thread, it alone dumps and ends the process.
        for (ssize_t i = 0; i < n && !failing_.load(std::memory_order_acquire); ++i) {
          if (codes[i] == 'U') dump_on_request();
          if (codes[i] == 'T') end_on_sigterm();
        }
      }
      if (failing_.load(std::memory_order_acquire)) continue;  // fail_process, on another thread, ends it
      check_deadlines();
      dump_if_requested();
    }
  }

  // ---- dumps from every rank -----------------------------------------------------------------

  /// Leaves the marker the job's other watchdogs look for; returns when (wall clock), 0 if it
  /// could not be written (then nobody waits for the others).
  std::int64_t request_dumps_from_other_ranks(const std::string& message) const noexcept {
    try {
      const std::string marker = dump_request_path(job_);
      detail::write_file_atomically(marker, "rank " + std::to_string(weft::detail::world_rank_for_messages()) + ": " +
                                                message + "\n");
      struct stat st {};
      if (stat(marker.c_str(), &st) != 0) return 0;
      return detail::modified_ns(st);
    } catch (...) {
      return 0;
    }
  }

  /// The world ranks of every watched group (empty when some group does not know its members).
  std::vector<int> expected_ranks() const {
    std::vector<int> ranks;
    std::lock_guard lock(mutex_);
    for (const watched& w : watched_) {
      if (w.recorder->members().empty()) return {};
      ranks.insert(ranks.end(), w.recorder->members().begin(), w.recorder->members().end());
    }
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    return ranks;
  }

  /// Waits until every member of a watched group has dumped since `requested_at` (a stopped rank
  /// never does), then removes the marker. The others look once a poll, so the wait is three
  /// polls (0.3 of the shortest deadline: the job still ends well within twice it), and at most
  /// half the grace.
  void wait_for_other_dumps(std::int64_t requested_at) const noexcept {
    try {
      const std::vector<int> ranks = expected_ranks();
      if (ranks.empty()) {  // members unknown: nobody to wait for by name
        unlink(dump_request_path(job_).c_str());
        return;
      }
      const auto end = std::chrono::steady_clock::now() + std::min<std::chrono::milliseconds>(grace_ / 2, 3 * poll_interval());
      const std::string dir = trace_directory();
      while (std::chrono::steady_clock::now() < end) {
        bool all = true;
        for (int rank : ranks) {
          struct stat st {};
          const std::string path = dir + "/weft-flight-" + std::to_string(rank) + ".json";
          if (stat(path.c_str(), &st) != 0 || detail::modified_ns(st) < requested_at) {
            all = false;
            break;
          }
        }
        if (all) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      unlink(dump_request_path(job_).c_str());
    } catch (...) {
      // Waiting is a courtesy to the other ranks: the abort goes on regardless.
    }
  }

  /// Dumps when another rank of this job asked for it (a marker newer than this watchdog and
  /// than the last one answered).
  void dump_if_requested() {
    const std::string marker = dump_request_path(job_);
    struct stat st {};
    if (stat(marker.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;
    const std::int64_t at = detail::modified_ns(st);
    if (at < started_wall_ns_ || at == answered_request_ns_) return;
    answered_request_ns_ = at;
    std::string request = "another rank";
    if (const int fd = open(marker.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC); fd >= 0) {
      char text[512];
      const ssize_t n = read(fd, text, sizeof(text));
      close(fd);
      if (n > 0) request = std::string(text, static_cast<std::size_t>(n)).substr(0, std::string(text, static_cast<std::size_t>(n)).find('\n'));
    }
    try {
      const std::string path = dump("peer-timeout", "dump requested by " + request);
      std::fprintf(stderr, "weft: rank %d: another rank of the job timed out; flight recorder written to %s\n",
                   weft::detail::world_rank_for_messages(), path.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weft: rank %d: another rank of the job timed out: %s\n",
                   weft::detail::world_rank_for_messages(), e.what());
    }
  }

  // ---- the monitor ---------------------------------------------------------------------------

  void monitor_loop() {
    std::unique_lock lock(monitor_mutex_);
    for (;;) {
      const auto interval = std::chrono::milliseconds(std::clamp<std::int64_t>(grace_.count() / 10, 10, 1000));
      monitor_wake_.wait_for(lock, interval);
      if (monitor_stopping_) return;
      const std::int64_t now = monotonic_ns();
      const std::int64_t grace_ns = grace_.count() * 1'000'000;
      if (failing_since_ns_ != 0 && now - failing_since_ns_ > grace_ns) {
        detail::write_stderr(failing_message_ + "; the flight recorder dump or an abort did not finish within " +
                             detail::seconds_text(static_cast<double>(grace_.count()) / 1e3) +
                             " (WEFT_ABORT_GRACE): ending the process with status " + std::to_string(failing_status_) +
                             " without them\n");
        _exit(failing_status_);
      }
      // The watchdog comes round at least once a second (its longest poll).
      const std::int64_t stuck_for = now - heartbeat_ns_.load(std::memory_order_relaxed);
      if (failing_since_ns_ == 0 && stuck_for > grace_ns + 1'000'000'000) {
        lock.unlock();
        check_deadlines_for_stuck_watchdog(stuck_for);
        lock.lock();
      }
    }
  }

  /// The watchdog thread has not come round for `stuck_for` (blocked in a dump): a deadline that
  /// passed meanwhile ends the process here, without a dump.
  void check_deadlines_for_stuck_watchdog(std::int64_t stuck_for) {
    std::string message;
    if (!late_operation_message(message)) return;
    detail::write_stderr(message + "; the watchdog thread has been blocked for " +
                         detail::seconds_text(static_cast<double>(stuck_for) / 1e9) +
                         " (a flight recorder dump that does not finish?): ending the process without a dump\n");
    _exit(comm_timeout_exit_status);
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
    {
      // A dump that blocks must not keep SIGTERM from ending the process.
      std::lock_guard lock(monitor_mutex_);
      failing_message_ = message;
      failing_status_ = 128 + SIGTERM;
      failing_since_ns_ = monotonic_ns();
    }
    std::string where;
    try {
      where = dump("terminate", message);
    } catch (const std::exception& e) {
      where = std::string("not written: ") + e.what();
    }
    detail::write_stderr(message + "; flight recorder: " + where + "\n");
    // End exactly as SIGTERM would have without weft's handler.
    std::signal(SIGTERM, SIG_DFL);
    kill(getpid(), SIGTERM);
    for (;;) pause();
  }

  /// Finds an operation past its deadline; true with its message if one is.
  bool late_operation_message(std::string& message) const {
    const std::int64_t now = monotonic_ns();
    std::lock_guard lock(mutex_);
    for (const watched& w : watched_) {
      const std::int64_t timeout_ms = w.recorder->timeout().count();
      if (timeout_ms <= 0) continue;
      auto r = w.recorder->oldest_unfinished();
      if (r && now - r->issued_ns > timeout_ms * 1'000'000) {
        message = timeout_message(*w.recorder, *r, now);
        return true;
      }
    }
    return false;
  }

  void check_deadlines() {
    std::string message;
    if (late_operation_message(message)) fail_process(message);
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

  static constexpr std::array<int, 2> handled_signals = {SIGUSR1, SIGTERM};

  mutable std::mutex mutex_;
  std::vector<watched> watched_;
  std::uint64_t last_id_ = 0;
  bool stopping_ = false;
  int pipe_[2] = {-1, -1};
  std::unique_ptr<std::thread> thread_;
  std::array<struct sigaction, 2> previous_{};
  std::array<bool, 2> installed_{};
  // Fixed when the threads start (under mutex_), read by them afterwards.
  std::chrono::milliseconds grace_{std::chrono::seconds(10)};
  std::string job_;
  std::int64_t started_wall_ns_ = 0;
  std::int64_t answered_request_ns_ = 0;  ///< the watchdog thread's own
  std::atomic<std::int64_t> heartbeat_ns_{0};
  std::atomic<bool> failing_{false};
  // The monitor's state, under monitor_mutex_.
  std::mutex monitor_mutex_;
  std::condition_variable monitor_wake_;
  bool monitor_stopping_ = false;
  std::int64_t failing_since_ns_ = 0;
  int failing_status_ = comm_timeout_exit_status;
  std::string failing_message_;
  std::unique_ptr<std::thread> monitor_;
};

/// Writes this process's flight recorders now (the on-demand dump) and returns the file's path.
inline std::string dump_flight_recorders(std::string reason = "request") {
  return watchdog::instance().dump(std::move(reason));
}

}  // namespace weft::trace
