// train_gpt's data loader: token files (llm.c's shards, nanoGPT's headerless uint16, byte-level
// text) read as one stream of windows, and one message for each kind of bad shard. The files are
// written here, into a fresh temporary folder.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data.hpp"

using namespace train_gpt;
namespace fs = std::filesystem;

namespace {

/// A temporary folder, removed with what it holds.
struct scratch_folder {
  fs::path path = fs::temp_directory_path() / ("weft-train-gpt-data-" + std::to_string(::getpid()));
  scratch_folder() { fs::create_directories(path); }
  ~scratch_folder() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                             static_cast<std::streamsize>(bytes.size()));
}

/// llm.c's layout, written out byte by byte (little-endian), independently of the reader.
std::vector<unsigned char> shard_bytes(const std::vector<std::uint16_t>& tokens, std::int32_t magic = 20240520,
                                       std::int32_t version = 1, std::int64_t count = -1) {
  std::vector<unsigned char> out(1024, 0);
  auto put = [&](std::size_t at, std::uint32_t v) {
    for (int b = 0; b < 4; ++b) out[at + static_cast<std::size_t>(b)] = static_cast<unsigned char>(v >> (8 * b));
  };
  put(0, static_cast<std::uint32_t>(magic));
  put(4, static_cast<std::uint32_t>(version));
  put(8, static_cast<std::uint32_t>(count < 0 ? static_cast<std::int64_t>(tokens.size()) : count));
  for (std::uint16_t t : tokens) out.push_back(static_cast<unsigned char>(t & 0xff)), out.push_back(static_cast<unsigned char>(t >> 8));
  return out;
}

std::vector<std::uint16_t> iota_tokens(std::size_t n, std::uint16_t first, std::uint16_t modulo) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>((first + i) % modulo);
  return t;
}

std::string load_error(const std::string& pattern, int seq, int vocab, data_format format = data_format::detect) {
  try {
    corpus::load(pattern, seq, vocab, format);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("token shards: each sequence is seq + 1 consecutive tokens, read in order across shards") {
  scratch_folder dir;
  // Two shards whose tokens are their stream positions (mod 1000), so a window's values say where it is.
  const std::vector<std::uint16_t> a = iota_tokens(50, 0, 1000), b = iota_tokens(30, 50, 1000);
  write_bytes(dir.file("tok_train_000000.bin"), shard_bytes(a));
  write_bytes(dir.file("tok_train_000001.bin"), shard_bytes(b));
  const int seq = 8;
  const corpus c = corpus::load(dir.file("tok_train_*.bin"), seq, 1000);
  REQUIRE(c.size() == 80);
  CHECK_FALSE(c.sampled());
  // Sequence k covers stream positions [k seq, k seq + seq]: its inputs, then its labels shifted by one.
  const int windows = (80 - 1) / seq;  // 9
  const data_position step0{.seed = 1, .step = 0, .sequence = 0};
  const std::vector<std::int32_t> all = c.sequences(step0, 0, windows + 2, seq);
  for (int k = 0; k < windows + 2; ++k)
    for (int t = 0; t <= seq; ++t) {
      INFO("sequence " << k << " token " << t);
      CHECK(all[static_cast<std::size_t>(k * (seq + 1) + t)] == ((k % windows) * seq + t));  // wraps after the last whole window
    }
  // Sequence 6 crosses from the first shard into the second (positions 48..56).
  CHECK(all[6 * (seq + 1) + 1] == 49);
  CHECK(all[6 * (seq + 1) + 2] == 50);
  // A step's slice is the same sequences as the whole batch's; the position, not the seed or step, decides.
  const data_position later{.seed = 99, .step = 7, .sequence = 3};
  CHECK(c.sequences(later, 2, 2, seq) == std::vector<std::int32_t>(all.begin() + 5 * (seq + 1), all.begin() + 7 * (seq + 1)));
  // The labels of every window are the next tokens of its inputs.
  for (std::size_t i = 0; i + 1 < all.size(); ++i)
    if ((i + 1) % (seq + 1) != 0) CHECK(all[i + 1] == all[i] + 1);
}

TEST_CASE("nanoGPT's headerless uint16 files and byte-level text give the same stream") {
  scratch_folder dir;
  std::vector<unsigned char> u16, text;
  for (int i = 0; i < 40; ++i) {
    const unsigned v = static_cast<unsigned>(i * 7 % 256);
    u16.push_back(static_cast<unsigned char>(v)), u16.push_back(0);
    text.push_back(static_cast<unsigned char>(v));
  }
  write_bytes(dir.file("train.bin"), u16);
  write_bytes(dir.file("train.txt"), text);
  const corpus tokens = corpus::load(dir.file("train.bin"), 8, 256, data_format::u16);
  const corpus bytes = corpus::load(dir.file("train.txt"), 8, 256);
  REQUIRE(tokens.size() == 40);
  REQUIRE(bytes.size() == 40);
  CHECK(bytes.sampled());  // text keeps its (seed, step) windows
  for (std::int64_t i = 0; i < 40; ++i) CHECK(tokens.token(i) == bytes.token(i));
  CHECK(tokens.sequences({.sequence = 1}, 0, 1, 8)[0] == bytes.token(8));
  // A headerless .bin read by detection is refused, pointing at --data-format u16.
  CHECK_THAT(load_error(dir.file("train.bin"), 8, 256), Catch::Contains("--data-format u16"));
}

TEST_CASE("bad shards get one message naming the file and what is wrong") {
  scratch_folder dir;
  const std::vector<std::uint16_t> good = iota_tokens(64, 0, 256);
  SECTION("wrong magic") {
    write_bytes(dir.file("magic.bin"), shard_bytes(good, 20240521));
    const std::string e = load_error(dir.file("magic.bin"), 8, 256, data_format::llmc);
    CHECK_THAT(e, Catch::Contains(dir.file("magic.bin")) && Catch::Contains("20240521") &&
                      Catch::Contains("not the magic 20240520"));
  }
  SECTION("another version") {
    write_bytes(dir.file("v2.bin"), shard_bytes(good, 20240520, 2));
    CHECK_THAT(load_error(dir.file("v2.bin"), 8, 256), Catch::Contains("version 2; train_gpt reads version 1"));
  }
  SECTION("truncated: fewer tokens than the header says") {
    std::vector<unsigned char> bytes = shard_bytes(good);
    bytes.resize(bytes.size() - 3);
    write_bytes(dir.file("short.bin"), bytes);
    CHECK_THAT(load_error(dir.file("short.bin"), 8, 256),
               Catch::Contains("'" + dir.file("short.bin") + "' is truncated") && Catch::Contains("says 64 tokens") &&
                   Catch::Contains("1152 bytes") && Catch::Contains("has 1149 bytes"));
  }
  SECTION("truncated inside the header") {
    std::vector<unsigned char> bytes = shard_bytes(good);
    bytes.resize(100);
    write_bytes(dir.file("header.bin"), bytes);
    CHECK_THAT(load_error(dir.file("header.bin"), 8, 256), Catch::Contains("is truncated"));
    bytes.resize(8);  // the magic and the version, no count
    write_bytes(dir.file("header.bin"), bytes);
    CHECK_THAT(load_error(dir.file("header.bin"), 8, 256),
               Catch::Contains("is truncated: it has 8 bytes, fewer than llm.c's header of 1024 bytes"));
    write_bytes(dir.file("empty.bin"), {});
    CHECK_THAT(load_error(dir.file("empty.bin"), 8, 256, data_format::llmc), Catch::Contains("is truncated: it has 0 bytes"));
  }
  SECTION("an odd number of bytes in a headerless file") {
    write_bytes(dir.file("odd.bin"), std::vector<unsigned char>(101, 1));
    CHECK_THAT(load_error(dir.file("odd.bin"), 8, 256, data_format::u16), Catch::Contains("is truncated") &&
                                                                               Catch::Contains("odd number"));
  }
  SECTION("a token at or above the vocabulary") {
    std::vector<std::uint16_t> tokens = good;
    tokens[37] = 256;
    write_bytes(dir.file("a.bin"), shard_bytes(good));
    write_bytes(dir.file("b.bin"), shard_bytes(tokens));
    CHECK_THAT(load_error(dir.file("*.bin"), 8, 256),
               Catch::Contains("'" + dir.file("b.bin") + "' holds token 256 (token 37, byte offset 1098)") &&
                   Catch::Contains("not below the vocabulary of 256"));
    CHECK_NOTHROW(corpus::load(dir.file("*.bin"), 8, 257));
  }
  SECTION("shards and text mixed, a missing file, no match, too little data") {
    write_bytes(dir.file("a.bin"), shard_bytes(good));
    write_bytes(dir.file("b.txt"), std::vector<unsigned char>(64, 'x'));
    CHECK_THAT(load_error(dir.file("*"), 8, 256), Catch::Contains("give files of one format"));
    CHECK_THAT(load_error(dir.file("none.bin"), 8, 256), Catch::Contains("cannot open the data file"));
    CHECK_THAT(load_error(dir.file("none*.bin"), 8, 256), Catch::Contains("no file matches the data pattern"));
    CHECK_THAT(load_error(dir.file("a.bin"), 63, 256), Catch::Contains("fewer than one sequence of --seq 63"));
  }
}
