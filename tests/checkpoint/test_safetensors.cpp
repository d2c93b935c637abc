#include <catch2/catch.hpp>

#include <weft/checkpoint/safetensors.hpp>
#include <weft/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint_test_support.hpp"
#include "sample_set.hpp"

using namespace weft::checkpoint;
using checkpoint_test::file_contents;
using checkpoint_test::raw_safetensors;
using checkpoint_test::scratch_directory;
using checkpoint_test::write_contents;
using Catch::Contains;

namespace {

std::uint64_t little_endian_u64(const std::string& bytes, std::size_t at) {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | static_cast<unsigned char>(bytes[at + static_cast<std::size_t>(i)]);
  return value;
}

/// The message read_safetensors throws for the file `bytes` (fails the test if it reads it).
std::string refusal(const scratch_directory& dir, const std::string& bytes, const std::string& name = "bad.safetensors") {
  const auto path = dir / name;
  write_contents(path, bytes);
  try {
    (void)read_safetensors(path);
  } catch (const weft::error& e) {
    return e.what();
  }
  FAIL("read_safetensors accepted a file it must refuse");
  return {};
}

const std::string one_tensor = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";

}  // namespace

TEST_CASE("every dtype, scalars and empty tensors survive a round trip bit for bit") {
  scratch_directory dir("round_trip");
  checkpoint_file file = checkpoint_test::sample_file();
  // Values whose bits matter: signed zero, infinities, NaN payloads, subnormals, extremes.
  const std::vector<float> specials = {-0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                       std::bit_cast<float>(0x7fc12345u), std::numeric_limits<float>::denorm_min(),
                                       std::numeric_limits<float>::max()};
  file.tensors.push_back(make_record<float>("specials.f32", {2, 3}, specials));
  const std::vector<weft::half> half_specials = {weft::half::from_bits(0x8000), weft::half::from_bits(0x7c00),
                                                 weft::half::from_bits(0x7e01), weft::half::from_bits(0x0001)};
  file.tensors.push_back(make_record<weft::half>("specials.f16", {2, 2}, half_specials));
  const std::vector<std::int64_t> extremes = {std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max(), -1};
  file.tensors.push_back(make_record<std::int64_t>("extremes.i64", {3, 1, 1}, extremes));
  const std::vector<std::uint8_t> no_bytes;
  file.tensors.push_back(make_record<std::uint8_t>("empty.u8", {0, 5}, no_bytes));

  const auto path = dir / "all.safetensors";
  write_safetensors(path, file);
  const checkpoint_file back = read_safetensors(path);

  CHECK(back.metadata == file.metadata);
  REQUIRE(back.tensors.size() == file.tensors.size());
  for (std::size_t i = 0; i < file.tensors.size(); ++i) {
    INFO("tensor " << file.tensors[i].name);
    CHECK(back.tensors[i].name == file.tensors[i].name);
    CHECK(back.tensors[i].type == file.tensors[i].type);
    CHECK(back.tensors[i].shape == file.tensors[i].shape);
    CHECK(back.tensors[i].bytes == file.tensors[i].bytes);
  }
  CHECK(values_of<std::int64_t>(back.at("extremes.i64")) == extremes);
  const auto scalar = values_of<double>(back.at("scalar/loss_scale"));
  REQUIRE(scalar.size() == 1);
  CHECK(scalar[0] == checkpoint_test::sample_float(3, 0));
  CHECK(back.at("empty.i64").bytes.empty());
  CHECK(back.at("empty.i64").shape == std::vector<std::int64_t>{3, 0, 2});
  CHECK(back.at("step").shape.empty());

  // The layout, read here without the reader: length, padded header, tensors packed in order.
  const std::string raw = file_contents(path);
  const std::uint64_t header_length = little_endian_u64(raw, 0);
  CHECK(header_length % 8 == 0);
  CHECK(raw.substr(8, 15) == R"({"__metadata__")");
  std::size_t offset = 8 + header_length;
  for (const tensor_record& record : file.tensors) {
    INFO("tensor " << record.name);
    REQUIRE(offset + record.bytes.size() <= raw.size());
    CHECK(std::equal(record.bytes.begin(), record.bytes.end(), reinterpret_cast<const std::byte*>(raw.data() + offset)));
    offset += record.bytes.size();
  }
  CHECK(offset == raw.size());
  CHECK(dir.entries() == std::vector<std::string>{"all.safetensors"});  // no temporary file left
}

TEST_CASE("a file without metadata or tensors is the smallest valid file") {
  scratch_directory dir("empty");
  write_safetensors(dir / "empty.safetensors", {});
  CHECK(file_contents(dir / "empty.safetensors") == raw_safetensors("{}      ", ""));
  const checkpoint_file back = read_safetensors(dir / "empty.safetensors");
  CHECK(back.metadata.empty());
  CHECK(back.tensors.empty());
}

TEST_CASE("make_record and values_of check sizes and types and say what they found") {
  const std::vector<float> five(5, 1.0f);
  CHECK_THROWS_WITH(make_record<float>("w", {2, 3}, five),
                    Contains("tensor 'w': shape [2, 3] holds 6 elements but 5 values were given"));
  CHECK_THROWS_WITH(make_record<float>("w", {-1, 5}, five), Contains("shape [-1, 5] has a negative dimension"));
  CHECK_THROWS_WITH(make_record<float>("w", {1ll << 40, 1ll << 40}, five), Contains("more elements than fit in 64 bits"));

  const std::vector<weft::bfloat16> values = {weft::bfloat16(1.5f), weft::bfloat16(-2.0f)};
  const tensor_record record = make_record<weft::bfloat16>("h.0.attn.c_attn.weight", {2}, values);
  CHECK(values_of<weft::bfloat16>(record) == values);
  CHECK_THROWS_WITH(values_of<float>(record),
                    Contains("tensor 'h.0.attn.c_attn.weight' holds BF16 values, not F32; read it with values_of<weft::bfloat16>"));
  tensor_record broken = record;
  broken.bytes.pop_back();
  CHECK_THROWS_WITH(values_of<weft::bfloat16>(broken), Contains("needs 4 bytes but the record holds 3"));
  CHECK(element_count(std::vector<std::int64_t>{}) == 1);
  CHECK(element_count(std::vector<std::int64_t>{4, 0}) == 0);
}

TEST_CASE("at() names the tensors the file has, and near matches") {
  checkpoint_file file;
  const std::vector<float> one = {1.0f};
  file.tensors.push_back(make_record<float>("h.0.attn.bias", {1}, one));
  file.tensors.push_back(make_record<float>("wte.weight", {1}, one));
  CHECK(file.find("wte.weight") == &file.tensors[1]);
  CHECK(file.find("wpe.weight") == nullptr);
  CHECK_THROWS_WITH(file.at("wpe.weight"), Contains("no tensor named 'wpe.weight'") &&
                                                  Contains("it holds 2 tensors: 'h.0.attn.bias', 'wte.weight'"));
  CHECK_THROWS_WITH(file.at("transformer.wte.weight"), Contains("similar names: 'wte.weight'"));
  CHECK_THROWS_WITH(checkpoint_file{}.at("x"), Contains("it holds no tensors"));
}

TEST_CASE("write_safetensors refuses bad records and leaves the old file alone") {
  scratch_directory dir("bad_records");
  const auto path = dir / "model.safetensors";
  write_safetensors(path, checkpoint_test::sample_file());
  const std::string old_bytes = file_contents(path);

  const std::vector<float> two = {1.0f, 2.0f};
  auto refused = [&](checkpoint_file file) {
    try {
      write_safetensors(path, file);
    } catch (const weft::error& e) {
      return std::string(e.what());
    }
    FAIL("write_safetensors accepted a bad file");
    return std::string();
  };
  checkpoint_file twins;
  twins.tensors = {make_record<float>("w", {2}, two), make_record<float>("w", {2}, two)};
  CHECK_THAT(refused(twins), Contains("two tensors are named 'w'"));
  checkpoint_file short_bytes;
  short_bytes.tensors = {make_record<float>("w", {2}, two)};
  short_bytes.tensors[0].shape = {3};
  CHECK_THAT(refused(short_bytes), Contains("tensor 'w': shape [3] of F32 needs 12 bytes but the record holds 8"));
  checkpoint_file reserved;
  reserved.tensors = {make_record<float>("__metadata__", {2}, two)};
  CHECK_THAT(refused(reserved), Contains("no tensor may be named '__metadata__'"));
  checkpoint_file not_utf8;
  not_utf8.tensors = {make_record<float>("w\xff", {2}, two)};
  CHECK_THAT(refused(not_utf8), Contains("is not valid UTF-8"));
  checkpoint_file bad_metadata;
  bad_metadata.metadata["k"] = "\xc0\xaf";  // an overlong '/'
  CHECK_THAT(refused(bad_metadata), Contains("metadata entry 'k' is not valid UTF-8"));

  CHECK(file_contents(path) == old_bytes);
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("refused files: each error names the file, the tensor and what to do") {
  scratch_directory dir("refused");
  const std::string eight(8, '\0');

  SECTION("fewer bytes than the length field") {
    const std::string message = refusal(dir, "abc");
    CHECK_THAT(message, Contains("bad.safetensors") && Contains("the file is truncated: it has 3 bytes") &&
                            Contains("re-save or pick another checkpoint"));
  }
  SECTION("header length beyond the file") {
    CHECK_THAT(refusal(dir, raw_safetensors(one_tensor, eight, 1000)),
               Contains("the file is truncated: header says 1000 bytes, file has " +
                        std::to_string(8 + one_tensor.size() + 8)));
    CHECK_THAT(refusal(dir, raw_safetensors("", "", 0xfffffffffffffffeull)), Contains("header says 18446744073709551614 bytes"));
  }
  SECTION("data cut short") {
    CHECK_THAT(refusal(dir, raw_safetensors(one_tensor, "1234567")),
               Contains("tensor 'a'") && Contains("the file is truncated: the tensor's bytes [0, 8) end past the data buffer's 7 bytes"));
  }
  SECTION("bytes after the last tensor") {
    CHECK_THAT(refusal(dir, raw_safetensors(one_tensor, eight + "x")), Contains("1 more bytes follow"));
  }
  SECTION("JSON syntax") {
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a": {"dtype": "F32", )", "")),
               Contains("its header is not valid JSON: at byte 23 of the header: expected a member name"));
    CHECK_THAT(refusal(dir, raw_safetensors("", "")), Contains("not valid JSON") && Contains("found the end of the text"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a":1} x)", "")), Contains("unexpected 'x' after the end of the JSON value"));
    CHECK_THAT(refusal(dir, raw_safetensors("{\"a\n\":1}", "")), Contains("control character (\\x0a) inside a string"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"\ud800":1})", "")), Contains("high surrogate without its low half"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"\q":1})", "")), Contains("unknown escape '\\q'"));
    CHECK_THAT(refusal(dir, raw_safetensors("{\"\xe2\x82\":1}", "")), Contains("not valid UTF-8"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a":01})", "")), Contains("expected '}', found '1'"));
    CHECK_THAT(refusal(dir, raw_safetensors(std::string(100000, '['), "")), Contains("nesting deeper than 64 levels"));
  }
  SECTION("header that is not an object of tensors") {
    CHECK_THAT(refusal(dir, raw_safetensors("[1,2]", "")), Contains("its header is an array, not a JSON object"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a":[1]})", "")), Contains("tensor 'a'") && Contains("its entry is an array"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"__metadata__":{"step":1200}})", "")),
               Contains("metadata entry 'step' is a number; safetensors metadata values are strings"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"__metadata__":[]})", "")), Contains("its '__metadata__' is an array"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"__metadata__":{"k":"1","k":"2"}})", "")),
               Contains("metadata entry 'k' appears twice"));
  }
  SECTION("fields of a tensor") {
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}})", "ab")),
               Contains("tensor 'w'") && Contains("dtype 'F8_E4M3' is not one weft reads (F32, F64, F16, BF16, I32, I64, U8)"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", eight)),
               Contains("tensor 'w'") && Contains("its entry has no 'dtype' field"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", eight)),
               Contains("its entry has two 'dtype' fields"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", eight)),
               Contains("its 'shape' is a string, not an array"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", eight)),
               Contains("a dimension of its shape holds 2.5, not a non-negative integer"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", eight)),
               Contains("holds -2, not a non-negative integer"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}})", eight)),
               Contains("holds 99999999999999999999, not a non-negative integer"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", eight)),
               Contains("more elements than fit in 64 bits"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", eight)),
               Contains("its data_offsets has 1 numbers, not 2"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", eight)),
               Contains("data_offsets [8, 0] end before they begin"));
  }
  SECTION("shape against offsets") {
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight)),
               Contains("tensor 'w'") && Contains("shape [3] of F32 needs 12 bytes but data_offsets [0, 8] span 8"));
  }
  SECTION("overlapping, holey and duplicate tensors") {
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                            eight + "1234")),
               Contains("tensor 'b'") && Contains("its bytes [4, 12) overlap those of tensor 'a' [0, 8)"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                            R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                            eight + "1234")),
               Contains("tensor 'b'") && Contains("bytes [4, 8) of the data buffer belong to no tensor"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight)),
               Contains("bytes [0, 4) of the data buffer belong to no tensor"));
    CHECK_THAT(refusal(dir, raw_safetensors(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                            R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                            eight)),
               Contains("two tensors are named 'a'"));
  }
  SECTION("not a file") {
    CHECK_THROWS_WITH(read_safetensors(dir / "missing.safetensors"),
                      Contains("missing.safetensors") && Contains("cannot open it: No such file or directory; check the path"));
    CHECK_THROWS_WITH(read_safetensors(dir.path()), Contains("it is not a regular file"));
  }
}

TEST_CASE("reader accepts what the format allows: any key order, whitespace, escapes, extra fields, empty tensors anywhere") {
  scratch_directory dir("accepted");
  const std::string header =
      "{ \"b\\u00e9\" : {\"shape\":[],\"data_offsets\":[4, 8],\"dtype\":\"I32\",\"extra\":[true,null,{\"x\":1.5e3}]},\n"
      "  \"empty\": {\"dtype\":\"BF16\",\"shape\":[0,3],\"data_offsets\":[4,4]},\n"
      "  \"__metadata__\": {\"format\":\"pt\",\"emoji\":\"\\ud83d\\ude00\\/\"},\n"
      "  \"a\": {\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]} }\t\r\n";
  const std::string data("\x01\x02\x03\x04\x2a\x00\x00\x00", 8);
  write_contents(dir / "ok.safetensors", raw_safetensors(header, data));
  const checkpoint_file file = read_safetensors(dir / "ok.safetensors");
  REQUIRE(file.tensors.size() == 3);
  CHECK(file.tensors[0].name == "a");  // file order is offset order
  CHECK(file.tensors[1].name == "empty");
  CHECK(file.tensors[2].name == "b\xc3\xa9");
  CHECK(values_of<std::uint8_t>(file.tensors[0]) == std::vector<std::uint8_t>{1, 2, 3, 4});
  CHECK(values_of<std::int32_t>(file.tensors[2]) == std::vector<std::int32_t>{42});
  CHECK(file.tensors[1].shape == std::vector<std::int64_t>{0, 3});
  CHECK(file.metadata.at("emoji") == "\xf0\x9f\x98\x80/");
  CHECK(file.metadata.at("format") == "pt");
}

TEST_CASE("damaged copies of a valid file are refused or read, never crash") {
  scratch_directory dir("damaged");
  const auto good_path = dir / "good.safetensors";
  write_safetensors(good_path, checkpoint_test::sample_file());
  const std::string good = file_contents(good_path);
  const std::uint64_t header_length = little_endian_u64(good, 0);

  // Every truncation is refused (the last tensor holds bytes, so every cut loses some).
  int refused = 0;
  for (std::size_t size = 0; size < good.size(); ++size) {
    write_contents(dir / "cut.safetensors", good.substr(0, size));
    CHECK_THROWS_AS(read_safetensors(dir / "cut.safetensors"), weft::error);
    ++refused;
  }
  CHECK(refused == static_cast<int>(good.size()));

  // Each header byte replaced by a few others: read or refused with weft::error, nothing else.
  int read_anyway = 0;
  for (std::size_t at = 8; at < 8 + header_length; ++at) {
    for (char replacement : {'"', '}', '9', '\\', '\xff', ','}) {
      std::string damaged = good;
      damaged[at] = replacement;
      write_contents(dir / "damaged.safetensors", damaged);
      try {
        (void)read_safetensors(dir / "damaged.safetensors");
        ++read_anyway;  // e.g. a changed letter inside a name
      } catch (const weft::error&) {
      }
    }
  }
  INFO("damaged headers read anyway: " << read_anyway);
  SUCCEED();
}

TEST_CASE("a failed write leaves the old file intact and no temporary file behind") {
  scratch_directory dir("atomic");
  const auto path = dir / "model.safetensors";
  write_safetensors(path, checkpoint_test::sample_file());
  const std::string old_bytes = file_contents(path);

  SECTION("the parent is a file") {
    CHECK_THROWS_WITH(write_safetensors(path / "x.safetensors", checkpoint_test::sample_file()),
                      Contains("x.safetensors") && Contains("Not a directory") && Contains("fix the path"));
  }
  SECTION("the directory does not exist") {
    CHECK_THROWS_WITH(write_safetensors(dir / "no" / "x.safetensors", checkpoint_test::sample_file()),
                      Contains("No such file or directory; check that the directory exists"));
  }
  SECTION("the path is a directory: the rename fails after the data was written") {
    std::filesystem::create_directory(dir / "sub");
    CHECK_THROWS_WITH(write_safetensors(dir / "sub", checkpoint_test::sample_file()),
                      Contains("renaming") && Contains("(the previous file at that path, if any, is unchanged)"));
    CHECK(std::filesystem::is_directory(dir / "sub"));
  }
  SECTION("the disk fills up in the middle of the data (a file size limit stands in for it)") {
    std::vector<float> large(1 << 20, 3.0f);  // 4 MiB, over the 1 MiB limit
    checkpoint_file big;
    big.tensors.push_back(make_record<float>("large", {1 << 20}, large));
    rlimit saved{};
    REQUIRE(getrlimit(RLIMIT_FSIZE, &saved) == 0);
    auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);  // the write then fails with EFBIG
    rlimit limited = saved;
    limited.rlim_cur = 1 << 20;
    REQUIRE(setrlimit(RLIMIT_FSIZE, &limited) == 0);
    std::string message;
    try {
      write_safetensors(path, big);
    } catch (const weft::error& e) {
      message = e.what();
    }
    setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, previous_handler);
    CHECK_THAT(message, Contains("File too large") && Contains("is unchanged"));
  }
  if (geteuid() != 0) {  // root writes anywhere: this case runs only for other users
    SECTION("the directory is not writable") {
      std::filesystem::create_directory(dir / "locked");
      write_safetensors(dir / "locked" / "m.safetensors", checkpoint_test::sample_file());
      chmod((dir / "locked").c_str(), 0555);
      CHECK_THROWS_WITH(write_safetensors(dir / "locked" / "m.safetensors", {}), Contains("Permission denied"));
      chmod((dir / "locked").c_str(), 0755);
      CHECK(read_safetensors(dir / "locked" / "m.safetensors").tensors.size() == checkpoint_test::sample_tensors().size());
      std::filesystem::remove_all(dir / "locked");
    }
  }
  CHECK(file_contents(path) == old_bytes);
  std::vector<std::string> left = dir.entries();
  std::erase(left, "sub");
  CHECK(left == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("a reader polling during large writes only ever sees a complete file") {
  scratch_directory dir("polling");
  const auto path = dir / "model.safetensors";
  constexpr std::int64_t elements = 4 << 20;  // 16 MiB per file
  auto generation_file = [&](int generation) {
    checkpoint_file file;
    file.metadata["generation"] = std::to_string(generation);
    std::vector<std::int32_t> values(elements, generation);
    file.tensors.push_back(make_record<std::int32_t>("weights", {elements}, values));
    return file;
  };
  write_safetensors(path, generation_file(0));

  constexpr int generations = 8;
  std::atomic<bool> done{false};
  int reads = 0;
  int inconsistent = 0;
  std::string first_problem;
  std::thread reader([&] {
    do {
      try {
        const checkpoint_file file = read_safetensors(path);
        const int generation = std::stoi(file.metadata.at("generation"));
        const auto values = values_of<std::int32_t>(file.at("weights"));
        if (values.size() != static_cast<std::size_t>(elements) ||
            std::any_of(values.begin(), values.end(), [&](std::int32_t v) { return v != generation; })) {
          ++inconsistent;
        }
      } catch (const std::exception& e) {
        if (first_problem.empty()) first_problem = e.what();
        ++inconsistent;
      }
      ++reads;
    } while (!done.load());
  });
  for (int generation = 1; generation <= generations; ++generation) write_safetensors(path, generation_file(generation));
  done.store(true);
  reader.join();
  INFO("first problem: " << first_problem);
  CHECK(inconsistent == 0);
  CHECK(reads > 0);
  CHECK(std::stoi(read_safetensors(path).metadata.at("generation")) == generations);
  std::printf("polling reader: %d complete reads during %d replacements of a 16 MiB file\n", reads, generations);
}
