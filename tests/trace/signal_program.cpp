// The watchdog's process-level behaviour, each case in a child process of its own (they change
// signal dispositions, fork, and end processes): returns 0 when every case passes, else names the
// failed ones. No MPI.
//
//   teardown   SIGTERM raised after the watchdog stopped (an exit handler) still ends the process
//   fork       a forked child has the default SIGTERM disposition and its SIGTERM does not reach
//              the parent's watchdog
//   monitor    an abort that never returns: the monitor ends the process with status 124 within
//              deadline + WEFT_ABORT_GRACE
//   fifo       a FIFO planted where the dump's temporary file goes neither blocks nor is followed:
//              the process dumps and exits 124
//   once       two threads failing at once run the abort actions once
//   request    a dump-request marker in WEFT_TRACE_DIR makes the watchdog dump (reason
//              "peer-timeout"); a marker older than the process does not
#include <weft/trace/flight_dump.hpp>
#include <weft/trace/flight_recorder.hpp>
#include <weft/trace/watchdog.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

using namespace std::chrono_literals;
using weft::trace::flight_recorder;
using weft::trace::watchdog;

std::string temp_dir() {
  char pattern[] = "/tmp/weft-signals-XXXXXX";
  const char* made = mkdtemp(pattern);
  if (made == nullptr) {
    std::perror("mkdtemp");
    std::exit(2);
  }
  return made;
}

std::shared_ptr<flight_recorder> recorder(std::chrono::milliseconds timeout) {
  return std::make_shared<flight_recorder>("case", 0, 1, 16, timeout);
}

/// Runs `body` in a child; returns its wait status, or -1 when it ran past `limit` (then killed).
int run_child(const std::function<void()>& body, std::chrono::milliseconds limit, double* seconds = nullptr) {
  const auto begin = std::chrono::steady_clock::now();
  const pid_t child = fork();
  if (child == 0) {
    body();
    _exit(0);
  }
  int status = 0;
  while (waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() - begin > limit) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(5ms);
  }
  if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return status;
}

std::string describe(int status) {
  if (status == -1) return "still running at the limit";
  if (WIFEXITED(status)) return "exit status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "status " + std::to_string(status);
}

extern "C" void raise_sigterm_at_exit() { raise(SIGTERM); }

bool teardown() {
  // The exit handler is registered before the watchdog exists, so it runs after ~watchdog.
  const int status = run_child([] {
    std::atexit(raise_sigterm_at_exit);
    auto r = recorder(0ms);
    auto registration = watchdog::instance().watch(r);
    std::this_thread::sleep_for(50ms);  // the thread is up, the handlers installed
    std::exit(0);                        // static destructors, then the exit handler
  }, 10s);
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) return true;
  std::printf("teardown: SIGTERM after the watchdog stopped should end the process; got %s\n", describe(status).c_str());
  return false;
}

bool fork_case() {
  const std::string dir = temp_dir();
  const int status = run_child([&] {
    setenv("WEFT_TRACE_DIR", dir.c_str(), 1);
    auto r = recorder(0ms);
    auto registration = watchdog::instance().watch(r);
    std::this_thread::sleep_for(50ms);
    const int grandchild = run_child([] {
      struct sigaction current {};
      sigaction(SIGTERM, nullptr, &current);
      if (current.sa_handler != SIG_DFL) _exit(3);  // weft's handler survived the fork
      raise(SIGTERM);
      _exit(4);
    }, 10s);
    std::this_thread::sleep_for(300ms);  // time for the parent's watchdog to act if a byte reached it
    const bool dumped = std::filesystem::exists(dir + "/weft-flight-pid" + std::to_string(getpid()) + ".json");
    if (!(WIFSIGNALED(grandchild) && WTERMSIG(grandchild) == SIGTERM)) {
      std::printf("fork: the forked child should die of its SIGTERM with the default disposition; got %s\n",
                  describe(grandchild).c_str());
      _exit(5);
    }
    if (dumped) {
      std::printf("fork: the child's SIGTERM reached the parent's watchdog (it dumped)\n");
      _exit(6);
    }
  }, 20s);
  std::filesystem::remove_all(dir);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  std::printf("fork: %s\n", describe(status).c_str());
  return false;
}

bool monitor() {
  const std::string dir = temp_dir();
  double seconds = 0;
  const int status = run_child([&] {
    setenv("WEFT_TRACE_DIR", dir.c_str(), 1);
    setenv("WEFT_ABORT_GRACE", "0.5", 1);
    auto r = recorder(200ms);
    weft::trace::abort_action blocks{[](int) {
                                       for (;;) std::this_thread::sleep_for(1s);
                                     },
                                     false};
    auto registration = watchdog::instance().watch(r, blocks);
    r->issue(weft::trace::operation::all_reduce, weft::dtype::float32, 8, -1, 0, true);  // never finishes
    for (;;) std::this_thread::sleep_for(1s);
  }, 20s, &seconds);
  std::filesystem::remove_all(dir);
  // deadline 0.2 s + one poll (20 ms) + grace 0.5 s; the rest is slack for a loaded machine.
  if (WIFEXITED(status) && WEXITSTATUS(status) == 124 && seconds < 3.0) return true;
  std::printf("monitor: an abort that never returns should end the process with 124 within 0.7 s (+ slack); got %s "
              "after %.2f s\n", describe(status).c_str(), seconds);
  return false;
}

bool fifo() {
  const std::string dir = temp_dir();
  const std::string target = dir + "/elsewhere";
  double seconds = 0;
  const int status = run_child([&] {
    setenv("WEFT_TRACE_DIR", dir.c_str(), 1);
    setenv("WEFT_ABORT_GRACE", "30", 1);  // longer than the limit: the dump itself must not block
    const std::string dump = dir + "/weft-flight-pid" + std::to_string(getpid()) + ".json";
    if (mkfifo((dump + ".partial").c_str(), 0644) != 0) _exit(7);
    auto r = recorder(200ms);
    auto registration = watchdog::instance().watch(r);
    r->issue(weft::trace::operation::broadcast, weft::dtype::int32, 3, 0, -1, true);
    for (;;) std::this_thread::sleep_for(1s);
  }, 10s, &seconds);
  bool dumped = false;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("weft-flight-pid") && name.ends_with(".json") && entry.is_regular_file()) {
      std::ifstream in(entry.path());
      std::stringstream text;
      text << in.rdbuf();
      dumped = weft::trace::parse_flight_dump(text.str()).reason == "timeout";
    }
  }
  std::filesystem::remove_all(dir);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 124 && dumped) return true;
  std::printf("fifo: a FIFO at the dump's temporary name should neither block nor stop the dump; got %s after %.2f s, "
              "dump %s\n", describe(status).c_str(), seconds, dumped ? "written" : "missing");
  return false;
}

bool once() {
  int counter[2];
  if (pipe(counter) != 0) return false;
  const int status = run_child([&] {
    close(counter[0]);
    setenv("WEFT_TRACE_DIR", "/nonexistent-weft-dir", 1);  // the dump fails fast; not what is tested
    auto r = recorder(0ms);
    const int fd = counter[1];
    weft::trace::abort_action counts{[fd](int) {
                                       [[maybe_unused]] auto written = write(fd, "A", 1);
                                       std::this_thread::sleep_for(200ms);
                                     },
                                     false};
    auto registration = watchdog::instance().watch(r, counts);
    std::thread other([] { watchdog::instance().fail_process("weft: first failure", "test", 9); });
    watchdog::instance().fail_process("weft: second failure", "test", 9);
  }, 20s);
  close(counter[1]);
  char buffer[16];
  const ssize_t aborts = read(counter[0], buffer, sizeof(buffer));
  close(counter[0]);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 9 && aborts == 1) return true;
  std::printf("once: two failing threads should abort once and exit 9; got %s, %zd aborts\n", describe(status).c_str(),
              aborts);
  return false;
}

bool request() {
  const std::string dir = temp_dir();
  const int status = run_child([&] {
    setenv("WEFT_TRACE_DIR", dir.c_str(), 1);
    weft::trace::set_job_id("job-under-test");
    const std::string marker = weft::trace::dump_request_path("job-under-test");
    const std::string dump = dir + "/weft-flight-pid" + std::to_string(getpid()) + ".json";
    std::ofstream(marker) << "rank 9: an earlier run\n";  // older than the watchdog: ignored
    std::this_thread::sleep_for(20ms);
    auto r = recorder(1000ms);  // polls every 100 ms
    auto registration = watchdog::instance().watch(r);
    std::this_thread::sleep_for(400ms);
    if (std::filesystem::exists(dump)) _exit(10);
    std::filesystem::remove(marker);
    std::ofstream(marker) << "rank 3: all_reduce timed out\n";
    for (int i = 0; i < 100 && !std::filesystem::exists(dump); ++i) std::this_thread::sleep_for(20ms);
    if (!std::filesystem::exists(dump)) _exit(11);
    std::ifstream in(dump);
    std::stringstream text;
    text << in.rdbuf();
    const auto parsed = weft::trace::parse_flight_dump(text.str());
    if (parsed.reason != "peer-timeout" || parsed.job != "job-under-test" ||
        parsed.message.find("rank 3: all_reduce timed out") == std::string::npos)
      _exit(12);
  }, 20s);
  std::filesystem::remove_all(dir);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  std::printf("request: %s (10: dumped for a marker older than the process, 11: no dump for a new marker, 12: the dump "
              "does not carry the reason, job and request)\n", describe(status).c_str());
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::pair<std::string, bool (*)()>> cases = {
      {"teardown", teardown}, {"fork", fork_case}, {"monitor", monitor}, {"fifo", fifo}, {"once", once}, {"request", request}};
  int failed = 0;
  for (const auto& [name, run] : cases) {
    if (argc > 1 && name != argv[1]) continue;
    const bool ok = run();
    std::printf("%s: %s\n", name.c_str(), ok ? "passed" : "FAILED");
    std::fflush(stdout);
    failed += ok ? 0 : 1;
  }
  return failed == 0 ? 0 : 1;
}
