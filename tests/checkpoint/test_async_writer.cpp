#include <catch2/catch.hpp>

#include <weft/checkpoint/async_writer.hpp>
#include <weft/checkpoint/safetensors.hpp>
#include <weft/core/error.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <unistd.h>

#include "checkpoint_test_support.hpp"
#include "sample_set.hpp"

using namespace weft::checkpoint;
using checkpoint_test::scratch_directory;
using Catch::Contains;

namespace {

using seconds = std::chrono::duration<double>;

/// A disk that stalls: while set, every fsync in this process waits until it is cleared (fsync
/// is defined below, ahead of the C library's), as a write to a hung network file system would.
std::atomic<bool> stall_fsync{false};
std::atomic<int> fsyncs_stalled{0};

/// Holds fsync for its lifetime.
struct stalled_disk {
  stalled_disk() {
    fsyncs_stalled.store(0);
    stall_fsync.store(true);
  }
  ~stalled_disk() { release(); }
  void release() { stall_fsync.store(false); }
  stalled_disk(const stalled_disk&) = delete;
  stalled_disk& operator=(const stalled_disk&) = delete;
};

/// Waits up to `limit` for `done()`.
template <class Done>
bool eventually(Done done, std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

/// A one-tensor checkpoint of `elements` int32 values, element i = i * 3 + seed.
checkpoint_file numbered_file(std::int64_t elements, std::int32_t seed) {
  std::vector<std::int32_t> values(static_cast<std::size_t>(elements));
  for (std::int64_t i = 0; i < elements; ++i) values[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i * 3) + seed;
  checkpoint_file file;
  file.metadata["seed"] = std::to_string(seed);
  file.tensors.push_back(make_record<std::int32_t>("values", {elements}, values));
  return file;
}

/// Whether `path` holds numbered_file(elements, seed), checked from the formula.
bool holds_numbered_file(const std::filesystem::path& path, std::int64_t elements, std::int32_t seed) {
  const checkpoint_file file = read_safetensors(path);
  if (file.metadata.at("seed") != std::to_string(seed)) return false;
  const auto values = values_of<std::int32_t>(file.at("values"));
  if (values.size() != static_cast<std::size_t>(elements)) return false;
  for (std::int64_t i = 0; i < elements; ++i) {
    if (values[static_cast<std::size_t>(i)] != static_cast<std::int32_t>(i * 3) + seed) return false;
  }
  return true;
}

}  // namespace

extern "C" int fsync(int fd) {
  using fsync_function = int (*)(int);
  static const auto real = reinterpret_cast<fsync_function>(dlsym(RTLD_NEXT, "fsync"));
  if (stall_fsync.load()) {
    fsyncs_stalled.fetch_add(1);
    while (stall_fsync.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return real(fd);
}

TEST_CASE("submit returns while a 200 MB write proceeds; wait sees it complete") {
  scratch_directory dir("async_large");
  const auto path = dir / "large.safetensors";
  constexpr std::int64_t elements = 50'000'000;  // 200 MB of int32
  checkpoint_file file = numbered_file(elements, 7);

  async_writer writer;
  const auto before_submit = std::chrono::steady_clock::now();
  writer.submit(path, std::move(file));
  const auto after_submit = std::chrono::steady_clock::now();
  const bool busy_after_submit = writer.busy();
  writer.wait();
  const auto after_wait = std::chrono::steady_clock::now();

  CHECK_FALSE(writer.busy());
  CHECK(writer.last_write_bytes() == std::filesystem::file_size(path));
  CHECK(writer.last_write_bytes() > static_cast<std::uint64_t>(elements) * 4);
  CHECK(writer.last_write_seconds() > 0.0);
  CHECK(holds_numbered_file(path, elements, 7));
  // Numbers for the record, not assertions: the machine's load decides them.
  std::printf("async_writer, 200 MB: submit returned in %.6f s (busy: %s), the write took %.3f s (%.0f MB/s), "
              "wait returned %.3f s after submit\n",
              seconds(after_submit - before_submit).count(), busy_after_submit ? "yes" : "no", writer.last_write_seconds(),
              static_cast<double>(writer.last_write_bytes()) / 1e6 / writer.last_write_seconds(),
              seconds(after_wait - after_submit).count());
}

TEST_CASE("submit waits for the write in flight before queuing the next") {
  scratch_directory dir("async_order");
  constexpr std::int64_t elements = 4'000'000;  // 16 MB
  async_writer writer;
  writer.submit(dir / "first.safetensors", numbered_file(elements, 1));
  writer.submit(dir / "second.safetensors", numbered_file(elements, 2));
  // The first write finished before the second submit returned.
  CHECK(holds_numbered_file(dir / "first.safetensors", elements, 1));
  writer.wait();
  CHECK(holds_numbered_file(dir / "second.safetensors", elements, 2));
  // The same path again: the newer snapshot replaces the older.
  writer.submit(dir / "first.safetensors", numbered_file(elements, 3));
  writer.wait();
  CHECK(holds_numbered_file(dir / "first.safetensors", elements, 3));
}

TEST_CASE("a failed write is reported once, at the next wait or submit") {
  scratch_directory dir("async_errors");
  const auto blocker = dir / "a_file";
  checkpoint_test::write_contents(blocker, "not a directory");
  const auto bad_path = blocker / "model.safetensors";
  async_writer writer;

  SECTION("at wait") {
    writer.submit(bad_path, checkpoint_test::sample_file());
    CHECK_THROWS_WITH(writer.wait(), Contains("model.safetensors") && Contains("Not a directory"));
    CHECK_NOTHROW(writer.wait());  // reported once
    CHECK_FALSE(writer.busy());
  }
  SECTION("at submit, which then queues nothing") {
    writer.submit(bad_path, checkpoint_test::sample_file());
    CHECK_THROWS_WITH(writer.submit(dir / "good.safetensors", checkpoint_test::sample_file()), Contains("Not a directory"));
    writer.wait();
    CHECK_FALSE(std::filesystem::exists(dir / "good.safetensors"));
    writer.submit(dir / "good.safetensors", checkpoint_test::sample_file());
    writer.wait();
    CHECK(read_safetensors(dir / "good.safetensors").tensors.size() == checkpoint_test::sample_tensors().size());
  }
  SECTION("a bad snapshot is an error of the write too") {
    checkpoint_file broken = checkpoint_test::sample_file();
    broken.tensors[0].bytes.pop_back();
    writer.submit(dir / "broken.safetensors", std::move(broken));
    CHECK_THROWS_WITH(writer.wait(), Contains("tensor 'wte.weight'") && Contains("needs 192 bytes but the record holds 191"));
    CHECK_FALSE(std::filesystem::exists(dir / "broken.safetensors"));
  }
}

TEST_CASE("the destructor completes the pending write and does not throw") {
  scratch_directory dir("async_destructor");
  constexpr std::int64_t elements = 8'000'000;  // 32 MB
  {
    async_writer writer;
    writer.submit(dir / "last.safetensors", numbered_file(elements, 5));
  }
  CHECK(holds_numbered_file(dir / "last.safetensors", elements, 5));

  // A failure nobody waited for goes to stderr; the destructor still returns normally.
  CHECK_NOTHROW([&] {
    async_writer writer;
    writer.submit(dir / "last.safetensors" / "x", checkpoint_test::sample_file());
  }());
  CHECK(holds_numbered_file(dir / "last.safetensors", elements, 5));

  // Nothing submitted: construction and destruction alone.
  CHECK_NOTHROW([] { async_writer idle; }());
}

TEST_CASE("one submission carries several files: it returns at once, and they are written in order") {
  scratch_directory dir("async_several");
  constexpr std::int64_t elements = 1'000'000;  // 4 MB
  async_writer writer;
  {
    stalled_disk disk;  // nothing can finish while the caller submits
    std::vector<write_request> files;
    files.push_back({dir / "state.safetensors", numbered_file(elements, 1)});
    files.push_back({dir / "model.safetensors", numbered_file(elements, 2)});
    const auto before = std::chrono::steady_clock::now();
    writer.submit(std::move(files));
    const double submit_s = seconds(std::chrono::steady_clock::now() - before).count();
    CHECK(submit_s < 1.0);  // it would wait for the stalled disk if it waited for a write
    REQUIRE(eventually([] { return fsyncs_stalled.load() > 0; }));
    CHECK(writer.busy());
    // The first file is being synced; the second has not been started.
    CHECK_FALSE(std::filesystem::exists(dir / "state.safetensors"));
    CHECK_FALSE(std::filesystem::exists(dir / "model.safetensors"));
  }
  writer.wait();
  CHECK(holds_numbered_file(dir / "state.safetensors", elements, 1));
  CHECK(holds_numbered_file(dir / "model.safetensors", elements, 2));
  CHECK(writer.last_write_bytes() ==
        std::filesystem::file_size(dir / "state.safetensors") + std::filesystem::file_size(dir / "model.safetensors"));

  SECTION("a file after a failed one is not written") {
    const auto blocker = dir / "a_file";
    checkpoint_test::write_contents(blocker, "not a directory");
    std::vector<write_request> files;
    files.push_back({blocker / "state.safetensors", numbered_file(10, 3)});
    files.push_back({dir / "model.safetensors", numbered_file(10, 4)});
    writer.submit(std::move(files));
    CHECK_THROWS_WITH(writer.wait(), Contains("state.safetensors") && Contains("Not a directory"));
    CHECK(holds_numbered_file(dir / "model.safetensors", elements, 2));  // the earlier model is kept
  }
}

TEST_CASE("a write past its deadline is reported by wait and submit, naming the file and the time") {
  scratch_directory dir("async_deadline");
  const auto path = dir / "stalled.safetensors";
  async_writer writer(std::chrono::milliseconds(300));
  CHECK(writer.deadline() == std::chrono::milliseconds(300));
  stalled_disk disk;
  writer.submit(path, numbered_file(1000, 1));
  const auto before = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(writer.wait(), Contains("background checkpoint write of '" + path.string() + "'") &&
                                       Contains("past its deadline of 0.3 s") && Contains("has run for "));
  const double waited = seconds(std::chrono::steady_clock::now() - before).count();
  CHECK(waited >= 0.25);
  CHECK(waited < 5.0);
  // Still stalled: the next submit says so at once and queues nothing.
  CHECK_THROWS_WITH(writer.submit(dir / "next.safetensors", numbered_file(10, 2)), Contains("stalled.safetensors"));
  // The disk recovers: the write completes, and the writer is usable again.
  disk.release();
  REQUIRE(eventually([&] { return !writer.busy(); }));
  writer.wait();
  CHECK(holds_numbered_file(path, 1000, 1));
  CHECK_FALSE(std::filesystem::exists(dir / "next.safetensors"));
  writer.submit(dir / "next.safetensors", numbered_file(10, 2));
  writer.wait();
  CHECK(holds_numbered_file(dir / "next.safetensors", 10, 2));
}

TEST_CASE("a slow write within its deadline is waited for") {
  scratch_directory dir("async_slow");
  async_writer writer(std::chrono::seconds(30));
  stalled_disk disk;
  writer.submit(dir / "slow.safetensors", numbered_file(1000, 1));
  REQUIRE(eventually([] { return fsyncs_stalled.load() > 0; }));
  std::thread recover([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    disk.release();
  });
  CHECK_NOTHROW(writer.wait());
  recover.join();
  CHECK(holds_numbered_file(dir / "slow.safetensors", 1000, 1));
}

TEST_CASE("the destructor does not wait past the deadline for a stalled write") {
  scratch_directory dir("async_stalled_destructor");
  const auto path = dir / "stalled.safetensors";
  stalled_disk disk;
  const auto before = std::chrono::steady_clock::now();
  {
    async_writer writer(std::chrono::milliseconds(200));
    writer.submit(path, numbered_file(1000, 1));
  }
  const double waited = seconds(std::chrono::steady_clock::now() - before).count();
  CHECK(waited < 5.0);
  // The detached thread finishes the write once the disk recovers.
  disk.release();
  CHECK(eventually([&] { return std::filesystem::exists(path); }));
  CHECK(eventually([&] {
    try {
      return holds_numbered_file(path, 1000, 1);
    } catch (const weft::error&) {
      return false;
    }
  }));
}
