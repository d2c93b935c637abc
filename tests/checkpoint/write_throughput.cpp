// Checkpoint write throughput against plain stdio writes of the same bytes:
//   checkpoint_write_throughput [--megabytes 200] [--repeats 5] [--dir .]
// Each repeat writes, in turn: write_safetensors (temporary file, fsync, rename, directory fsync);
// fwrite + fflush + fsync of the same data; fwrite without fsync (page cache only); then times
// read_safetensors of the file just written and async_writer::submit (the caller's share of a
// background write). Prints the median of each and the ratios, then checks that the file reads
// back with every byte in place (exit status 1 if not).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include <weft/checkpoint/async_writer.hpp>
#include <weft/checkpoint/safetensors.hpp>

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

/// Writes `bytes` with stdio; fsyncs when asked. Throws on any failure.
void plain_write(const std::filesystem::path& path, const std::vector<std::byte>& bytes, bool sync) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) throw std::runtime_error("cannot open " + path.string() + ": " + std::strerror(errno));
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), out) == bytes.size() && std::fflush(out) == 0 &&
                  (!sync || ::fsync(fileno(out)) == 0);
  if (std::fclose(out) != 0 || !ok) throw std::runtime_error("writing " + path.string() + " failed: " + std::strerror(errno));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace weft::checkpoint;
  double megabytes = 200;
  int repeats = 5;
  std::filesystem::path dir = ".";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--megabytes") megabytes = std::stod(argv[i + 1]);
    else if (flag == "--repeats") repeats = std::stoi(argv[i + 1]);
    else if (flag == "--dir") dir = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s; usage: checkpoint_write_throughput [--megabytes MB] [--repeats N] [--dir DIR]\n", argv[i]);
      return 2;
    }
  }
  if (argc % 2 == 0 || repeats < 1 || megabytes <= 0) {
    std::fprintf(stderr, "usage: checkpoint_write_throughput [--megabytes MB] [--repeats N>=1] [--dir DIR]\n");
    return 2;
  }
  try {
    std::filesystem::create_directories(dir);
    const auto elements = static_cast<std::int64_t>(megabytes * 1e6 / 4);
    std::vector<float> values(static_cast<std::size_t>(elements));
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 1000) * 0.5f;
    checkpoint_file file;
    file.metadata["format"] = "pt";
    file.tensors.push_back(make_record<float>("weights", {elements}, values));
    const std::vector<std::byte>& data = file.tensors[0].bytes;

    const auto weft_path = dir / "weft.safetensors";
    const auto plain_path = dir / "plain.bin";
    std::vector<double> weft_times, plain_sync_times, plain_cache_times, read_times, submit_times;
    for (int r = 0; r < repeats; ++r) {
      auto start = clock_type::now();
      write_safetensors(weft_path, file);
      weft_times.push_back(seconds_since(start));
      start = clock_type::now();
      plain_write(plain_path, data, true);
      plain_sync_times.push_back(seconds_since(start));
      start = clock_type::now();
      plain_write(plain_path, data, false);
      plain_cache_times.push_back(seconds_since(start));
      start = clock_type::now();
      const checkpoint_file back = read_safetensors(weft_path);
      read_times.push_back(seconds_since(start));
      checkpoint_file snapshot = file;  // the trainer's copy, not timed: submit takes it by value
      async_writer writer;
      start = clock_type::now();
      writer.submit(weft_path, std::move(snapshot));
      submit_times.push_back(seconds_since(start));
      writer.wait();
    }
    const double file_mb = static_cast<double>(std::filesystem::file_size(weft_path)) / 1e6;
    auto row = [&](const char* what, const std::vector<double>& times) {
      const double m = median(times);
      std::printf("%-44s median %9.4f s  %8.0f MB/s  (%d runs)\n", what, m, file_mb / m, repeats);
    };
    std::printf("%.1f MB checkpoint (one F32 tensor), %d repeats, directory %s\n", file_mb, repeats, dir.c_str());
    row("write_safetensors (tmp, fsync, rename, dir fsync)", weft_times);
    row("fwrite + fsync of the same bytes", plain_sync_times);
    row("fwrite without fsync (page cache)", plain_cache_times);
    row("read_safetensors (page cache)", read_times);
    std::printf("%-44s median %9.6f s\n", "async_writer::submit (caller's share)", median(submit_times));
    std::printf("ratio write_safetensors / (fwrite + fsync): %.2f\n", median(weft_times) / median(plain_sync_times));

    const checkpoint_file back = read_safetensors(weft_path);
    const bool same = back.metadata == file.metadata && back.tensors.size() == 1 && back.tensors[0].bytes == data;
    std::filesystem::remove(weft_path);
    std::filesystem::remove(plain_path);
    std::printf("read back: %s\n", same ? "OK" : "WRONG");
    return same ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
