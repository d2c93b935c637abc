// Distributed checkpoints in one process: the planning (regions of a flat shard, who writes
// which piece, which pieces a reader needs, the index's JSON), then saves by ranks simulated
// with threads (exchange through a barrier) loaded into other layouts, corruption and missing
// files, keep, and a save killed with SIGKILL at random moments.
#include <catch2/catch.hpp>

#include <weft/checkpoint/detail/crc32.hpp>
#include <weft/checkpoint/distributed.hpp>

#include "distributed_model.hpp"

#include <array>
#include <barrier>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

namespace {

using namespace ckpt_test;
namespace fs = std::filesystem;

/// Ranks simulated by threads: the exchange is two barriers around a shared table.
class thread_exchange {
 public:
  explicit thread_exchange(int ranks) : texts_(static_cast<std::size_t>(ranks)), barrier_(ranks) {}
  ckpt::exchange_function for_rank(int rank) {
    return [this, rank](std::string mine) {
      texts_[static_cast<std::size_t>(rank)] = std::move(mine);
      barrier_.arrive_and_wait();
      std::vector<std::string> all = texts_;
      barrier_.arrive_and_wait();
      return all;
    };
  }

 private:
  std::vector<std::string> texts_;
  std::barrier<> barrier_;
};

fs::path fresh_directory(const std::string& name) {
  const fs::path path = fs::path("distributed_checkpoint_unit") / name;
  fs::remove_all(path);
  fs::create_directories(path);
  return path;
}

/// Saves steps with a tp x dp layout of simulated ranks, waiting for each save.
void save_steps(const fs::path& root, int tp, int dp, std::vector<std::int64_t> steps, std::size_t keep = 0) {
  const int world = tp * dp;
  thread_exchange exchange(world);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        ckpt::distributed_saver saver(rank, world, exchange.for_rank(rank), root, {.keep = keep});
        for (std::int64_t step : steps) {
          const auto pieces = layout_pieces(tp, dp, rank, step);
          const auto local = local_pieces(pieces);
          if (!saver.save({.step = step, .data_position = {{"sample", step * 8}}, .layout = {{"tp", tp}, {"dp", dp}}, .model = "test"},
                          local)) {
            throw std::runtime_error("the save was skipped although the previous one was waited for");
          }
          saver.wait();
        }
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(rank)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) REQUIRE(e.empty());
}

std::vector<ckpt::piece_declaration> declarations(int tp, int dp, int rank) {
  std::vector<ckpt::piece_declaration> out;
  for (const test_piece& p : layout_pieces(tp, dp, rank)) out.push_back({p.name, p.type, p.shape, p.part});
  return out;
}

std::vector<std::vector<ckpt::piece_declaration>> all_declarations(int tp, int dp) {
  std::vector<std::vector<ckpt::piece_declaration>> all;
  for (int r = 0; r < tp * dp; ++r) all.push_back(declarations(tp, dp, r));
  return all;
}

}  // namespace

TEST_CASE("a flat range becomes the regions that tile exactly its elements", "[checkpoint][distributed]") {
  std::mt19937 random(7);
  const std::vector<std::vector<std::int64_t>> shapes = {{7}, {3, 5}, {2, 3, 4}, {4, 1, 3, 2}};
  for (const auto& shape : shapes) {
    ckpt::region within{std::vector<std::int64_t>(shape.size(), 1), shape};  // offset 1: the regions are in global indices
    std::vector<std::int64_t> global_shape = shape;
    for (auto& n : global_shape) n += 2;
    const std::int64_t total = ckpt::element_count(shape);
    for (int trial = 0; trial < 30; ++trial) {
      std::int64_t begin = std::uniform_int_distribution<std::int64_t>(0, total)(random);
      std::int64_t end = std::uniform_int_distribution<std::int64_t>(begin, total)(random);
      const auto regions = ckpt::regions_of_flat_range(within, begin, end);
      REQUIRE(regions.size() <= 2 * shape.size() + 1);
      // Mark each region's elements by their index within `within`, counted independently.
      std::vector<int> hits(static_cast<std::size_t>(total), 0);
      for (const auto& r : regions) {
        const std::int64_t n = ckpt::element_count(r);
        REQUIRE(n > 0);
        for (std::int64_t i = 0; i < n; ++i) {
          std::int64_t rest = i, flat = 0, stride = 1;
          for (std::size_t d = shape.size(); d-- > 0;) {
            const std::int64_t index = r.offset[d] + rest % r.extent[d] - within.offset[d];
            REQUIRE((index >= 0 && index < shape[d]));
            rest /= r.extent[d];
            flat += index * stride;
            stride *= shape[d];
          }
          ++hits[static_cast<std::size_t>(flat)];
        }
      }
      for (std::int64_t i = 0; i < total; ++i) REQUIRE(hits[static_cast<std::size_t>(i)] == (i >= begin && i < end ? 1 : 0));
    }
  }
  REQUIRE_THROWS_WITH(ckpt::regions_of_flat_range({{0}, {4}}, 2, 5), Catch::Contains("are not a range of the 4 elements"));
}

TEST_CASE("each distinct piece is written once, replicas by balanced writers", "[checkpoint][distributed]") {
  const auto all = all_declarations(2, 2);
  const ckpt::write_plan plan = ckpt::plan_writers(all);
  std::map<std::pair<std::string, ckpt::region>, int> writers;
  for (int r = 0; r < 4; ++r) {
    for (std::size_t i : plan.written_by[r]) ++writers[{all[r][i].name, all[r][i].part}];
  }
  // Every piece any rank declared is written exactly once.
  for (const auto& rank : all) {
    for (const auto& p : rank) REQUIRE(writers[{p.name, p.part}] == 1);
  }
  REQUIRE(plan.tensors.size() == 5);
  REQUIRE(plan.tensors[0].name == "w");

  // Replicated tensors alone: 8 equal tensors on 4 ranks, two each.
  std::vector<std::vector<ckpt::piece_declaration>> replicated(4);
  for (int t = 0; t < 8; ++t) {
    for (auto& rank : replicated) rank.push_back({"t" + std::to_string(t), weft::dtype::float32, {16}, ckpt::whole_region(std::vector<std::int64_t>{16})});
  }
  // An empty region (an uneven split's empty share) is not written; it would share its name in
  // the file with the piece at the same offset.
  const std::vector<std::vector<ckpt::piece_declaration>> with_empty = {
      {{"e", weft::dtype::float32, {4}, {{0}, {4}}}, {"f", weft::dtype::float32, {2}, {{0}, {0}}}},
      {{"e", weft::dtype::float32, {4}, {{0}, {0}}}, {"f", weft::dtype::float32, {2}, {{0}, {2}}}}};
  const auto skipping = ckpt::plan_writers(with_empty);
  REQUIRE(skipping.written_by[0] == std::vector<std::size_t>{0});
  REQUIRE(skipping.written_by[1] == std::vector<std::size_t>{1});

  const auto balanced = ckpt::plan_writers(replicated);
  for (int r = 0; r < 4; ++r) {
    REQUIRE(balanced.written_by[r].size() == 2);
    REQUIRE(balanced.bytes_of[r] == 2 * 16 * 4);
  }
}

TEST_CASE("inconsistent declarations are refused, naming the tensor and the ranks", "[checkpoint][distributed][errors]") {
  auto all = all_declarations(2, 2);
  SECTION("another shape on one rank") {
    all[1][0].shape = {8, 13};
    REQUIRE_THROWS_WITH(ckpt::plan_writers(all), Catch::Contains("tensor 'w' is F32 [8, 13] on rank 1 but F32 [8, 12] on rank 0"));
  }
  SECTION("overlapping regions that are not replicas") {
    all[1][0].part.offset[1] -= 1;
    REQUIRE_THROWS_WITH(ckpt::plan_writers(all), Catch::Contains("overlaps") && Catch::Contains("tensor 'w'"));
  }
  SECTION("an element nobody holds") {
    all[3].erase(all[3].begin());
    REQUIRE_THROWS_WITH(ckpt::plan_writers(all), Catch::Contains("tensor 'w' [8, 12]: the ranks' pieces cover 72 of its 96 elements"));
  }
  SECTION("a region outside the tensor") {
    all[2][1].part.extent[1] = 11;
    REQUIRE_THROWS_WITH(ckpt::plan_writers(all), Catch::Contains("rank 2's piece") && Catch::Contains("does not lie inside"));
  }
}

TEST_CASE("a reader needs the pieces that overlap its region, and the index reads back", "[checkpoint][distributed]") {
  ckpt::saved_tensor w{"w", weft::dtype::float32, {8, 12}, {}};
  for (int r = 0; r < 4; ++r) {
    const test_piece p = layout_pieces(2, 2, r)[0];
    w.pieces.push_back({ckpt::rank_file_name(r), ckpt::piece_key("w", p.part), p.part, 100u + static_cast<unsigned>(r)});
  }
  // Rows 2..5 of all columns: the first two ranks' pieces (rows 0-3) and the last two's (4-7).
  const auto steps = ckpt::plan_read(w, {{2, 0}, {4, 12}});
  REQUIRE(steps.size() == 4);
  REQUIRE(steps[0].overlap == ckpt::region{{2, 0}, {2, 6}});
  REQUIRE(steps[3].overlap == ckpt::region{{4, 6}, {2, 6}});
  // Columns 0..5 of rows 0..3: only rank 0's piece.
  REQUIRE(ckpt::plan_read(w, {{0, 0}, {4, 6}}).size() == 1);
  REQUIRE_THROWS_WITH(ckpt::plan_read(w, {{0, 0}, {9, 12}}), Catch::Contains("is not inside tensor 'w'"));
  ckpt::saved_tensor gap = w;
  gap.pieces.pop_back();
  REQUIRE_THROWS_WITH(ckpt::plan_read(gap, {{0, 0}, {8, 12}}), Catch::Contains("hold 72 values of region [0:8, 0:12], which has 96"));

  ckpt::checkpoint_index index{.model = "m \"1\"", .step = 12, .data_position = {{"sample", 96}}, .layout = {{"tp", 2}, {"world_size", 4}},
                               .files = {}, .tensors = {w}};
  for (int r = 0; r < 4; ++r) index.files.push_back({r, ckpt::rank_file_name(r), 1000u + static_cast<unsigned>(r)});
  const auto back = ckpt::parse_index(ckpt::index_json(index), "test");
  REQUIRE(back.model == index.model);
  REQUIRE(back.step == 12);
  REQUIRE(back.data_position == index.data_position);
  REQUIRE(back.layout == index.layout);
  REQUIRE(back.files.size() == 4);
  REQUIRE(back.files[3].bytes == 1003);
  REQUIRE(back.tensors.size() == 1);
  REQUIRE(back.tensors[0].shape == w.shape);
  for (std::size_t i = 0; i < 4; ++i) {
    REQUIRE(back.tensors[0].pieces[i].part == w.pieces[i].part);
    REQUIRE(back.tensors[0].pieces[i].crc32 == w.pieces[i].crc32);
    REQUIRE(back.tensors[0].pieces[i].file == w.pieces[i].file);
  }
  REQUIRE_THROWS_WITH(ckpt::parse_index("{\"format\":\"other\"}", "x.json"), Catch::Contains("x.json") && Catch::Contains("its format is 'other'"));
  std::string newer = ckpt::index_json(index);
  newer.replace(newer.find("\"version\":1"), 11, "\"version\":9");
  REQUIRE_THROWS_WITH(ckpt::parse_index(newer, "x.json"), Catch::Contains("has format version 9"));
}

TEST_CASE("CRC-32 is zlib's", "[checkpoint][distributed]") {
  const std::string text = "123456789";
  REQUIRE(ckpt::detail::crc32(std::as_bytes(std::span(text))) == 0xCBF43926u);
  // In parts, across the 8-byte steps.
  const std::string longer = "The quick brown fox jumps over the lazy dog";
  const auto bytes = std::as_bytes(std::span(longer));
  REQUIRE(ckpt::detail::crc32(bytes) == 0x414FA339u);
  REQUIRE(ckpt::detail::crc32_update(ckpt::detail::crc32(bytes.first(13)), bytes.subspan(13)) == 0x414FA339u);
}

TEST_CASE("saved by 4 ranks as 2 x 2 shards, loaded into other layouts", "[checkpoint][distributed]") {
  const fs::path root = fresh_directory("layouts");
  save_steps(root, 2, 2, {5});
  ckpt::distributed_checkpoint checkpoint(root, {.chunk_bytes = 40});  // small chunks: pieces read in several parts
  REQUIRE(checkpoint.directory() == root / "5");
  REQUIRE(checkpoint.index().step == 5);
  REQUIRE(checkpoint.index().data_position.at("sample") == 40);
  REQUIRE(checkpoint.index().layout.at("world_size") == 4);
  REQUIRE(checkpoint.index().files.size() == 4);
  // The replicated tensors are written once.
  REQUIRE(checkpoint.tensor("b").pieces.size() == 1);
  REQUIRE(checkpoint.tensor("n").pieces.size() == 1);
  REQUIRE(checkpoint.tensor("v").pieces.size() == 2);
  REQUIRE(checkpoint.tensor("w").pieces.size() == 4);
  for (auto [tp, dp] : std::vector<std::pair<int, int>>{{2, 2}, {1, 2}, {2, 1}, {1, 1}, {4, 1}, {1, 3}}) {
    for (int rank = 0; rank < tp * dp; ++rank) {
      INFO("tp " << tp << " dp " << dp << " rank " << rank);
      REQUIRE(first_mismatch(checkpoint, layout_pieces(tp, dp, rank, 5)).empty());
    }
  }
  REQUIRE(checkpoint.verify().empty());
  // Reading only the overlaps, without checksums, gives the same values.
  ckpt::distributed_checkpoint unchecked(root, {.chunk_bytes = 40, .check_checksums = false});
  for (auto [tp, dp] : std::vector<std::pair<int, int>>{{1, 1}, {4, 1}, {1, 3}, {3, 2}}) {
    for (int rank = 0; rank < tp * dp; ++rank) REQUIRE(first_mismatch(unchecked, layout_pieces(tp, dp, rank, 5)).empty());
  }
  REQUIRE(checkpoint.read<std::int64_t>("n") == std::vector<std::int64_t>{static_cast<std::int64_t>('n' * 1000.0 + 5 * 100000.0)});
  REQUIRE_THROWS_WITH(checkpoint.read<double>("w"), Catch::Contains("tensor 'w' is F32") && Catch::Contains("read it as float"));
  REQUIRE_THROWS_WITH(checkpoint.tensor("x.w"), Catch::Contains("no tensor named 'x.w'") && Catch::Contains("similar names: 'w'"));
}

TEST_CASE("a corrupt piece and a missing rank file are named", "[checkpoint][distributed][errors]") {
  const fs::path root = fresh_directory("corrupt");
  save_steps(root, 2, 2, {1});
  const fs::path dir = root / "1";
  ckpt::distributed_checkpoint clean(dir);
  const ckpt::saved_piece& piece = clean.tensor("w").pieces[1];
  const auto layout = ckpt::read_safetensors_layout(dir / piece.file);
  std::uint64_t at = 0;
  for (const auto& e : layout.tensors) {
    if (e.name == piece.key) at = e.begin + 5;
  }
  REQUIRE(at != 0);
  {
    std::fstream f(dir / piece.file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(at));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(static_cast<std::streamoff>(at));
    f.write(&c, 1);
  }
  ckpt::distributed_checkpoint corrupt(dir);
  const std::string expected = "file '" + piece.file + "', tensor 'w', piece '" + piece.key + "': checksum mismatch";
  REQUIRE_THROWS_WITH(corrupt.read<float>("w"), Catch::Contains(expected));
  auto problems = corrupt.verify();
  REQUIRE(problems.size() == 1);
  REQUIRE_THAT(problems[0], Catch::Contains(expected));
  // The other tensors still read.
  const test_piece v = layout_pieces(1, 1, 0, 1)[1];
  std::vector<std::byte> got(v.bytes.size());
  corrupt.read("v", v.part, got);
  REQUIRE(got == v.bytes);

  fs::remove(dir / ckpt::rank_file_name(3));
  ckpt::distributed_checkpoint missing(dir);
  problems = missing.verify();
  REQUIRE(problems.size() >= 2);
  REQUIRE_THAT(problems[0], Catch::Contains("file 'rank-00003.safetensors' of rank 3 is missing"));
  bool reading_says = false;
  try {
    (void)missing.read<float>("w", layout_pieces(2, 2, 3)[0].part);  // only rank 3 held this piece of w
  } catch (const std::exception& e) {
    reading_says = std::string(e.what()).find("file 'rank-00003.safetensors' of rank 3") != std::string::npos;
  }
  REQUIRE(reading_says);
  REQUIRE_THROWS_WITH(ckpt::distributed_checkpoint(root / "7"), Catch::Contains("does not exist"));
  REQUIRE_THROWS_WITH(ckpt::distributed_checkpoint(fresh_directory("empty")), Catch::Contains("holds no complete checkpoint"));
}

TEST_CASE("a folder checkpoints cannot be written to is named on every rank before any save", "[checkpoint][distributed][errors]") {
  const fs::path root = fresh_directory("writable");
  // A path below a regular file: no rank can make it (root, too, cannot).
  const fs::path file = root / "a_file";
  std::ofstream(file) << "x";
  const fs::path bad = file / "ckpt";
  // Each rank's message when two ranks check `folder`, rank r writing when writes[r].
  const auto check = [](const fs::path& folder, std::array<bool, 2> writes) {
    thread_exchange exchange(2);
    std::array<std::string, 2> errors;
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          ckpt::check_writable(rank, 2, exchange.for_rank(rank), folder, writes[static_cast<std::size_t>(rank)]);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(rank)] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    return errors;
  };
  const auto both = check(bad, {true, true});
  CHECK(both[0] == both[1]);  // the same message on every rank
  CHECK(both[0].find("'" + bad.string() + "' is not a folder checkpoints can be written to") != std::string::npos);
  CHECK(both[0].find("(ranks 0, 1 cannot make the folder (") != std::string::npos);
  const auto rank0 = check(bad, {true, false});  // --save: rank 0 writes the file
  CHECK(rank0[0] == rank0[1]);
  CHECK(rank0[0].find("(rank 0 cannot make the folder (") != std::string::npos);
  CHECK(rank0[0].find("rank 1") == std::string::npos);
  const auto none = check(bad, {false, false});
  CHECK((none[0].empty() && none[1].empty()));
  const auto good = check(root / "good", {true, true});
  CHECK((good[0].empty() && good[1].empty()));
  CHECK(fs::is_directory(root / "good"));
  CHECK(fs::is_empty(root / "good"));  // the check's files are gone
}

TEST_CASE("keep leaves the newest checkpoints, and a save of the same step replaces it", "[checkpoint][distributed]") {
  const fs::path root = fresh_directory("keep");
  save_steps(root, 1, 2, {1, 2, 3}, 2);
  REQUIRE(!fs::exists(root / "1"));
  REQUIRE(fs::exists(root / "2" / "index.json"));
  REQUIRE(ckpt::latest_checkpoint(root) == root / "3");
  // An incomplete directory of an earlier step (an interrupted save) goes at the next save.
  fs::create_directories(root / "0");
  save_steps(root, 2, 1, {3}, 2);
  REQUIRE(!fs::exists(root / "0"));
  ckpt::distributed_checkpoint again(root);
  REQUIRE(again.index().layout.at("tp") == 2);
  REQUIRE(first_mismatch(again, layout_pieces(1, 1, 0, 3)).empty());
  REQUIRE(again.verify().empty());
}

TEST_CASE("a save killed at any moment leaves the previous checkpoint loadable", "[checkpoint][distributed][fault]") {
  std::mt19937 random(12345);
  for (int trial = 0; trial < 20; ++trial) {
    const fs::path root = fresh_directory("killed");
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // Saves steps 1, 2, ... on 4 simulated ranks until killed.
      try {
        std::vector<std::int64_t> steps;
        for (std::int64_t s = 1; s < 100000; ++s) steps.push_back(s);
        save_steps(root, 2, 2, steps, 2);
      } catch (...) {
      }
      ::_exit(3);
    }
    // Kill it at a random moment once its first checkpoint exists.
    const auto start = std::chrono::steady_clock::now();
    while (!ckpt::latest_checkpoint(root)) {
      REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(60));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 20000)(random)));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));

    ckpt::distributed_checkpoint checkpoint(root);
    INFO("trial " << trial << ": " << checkpoint.directory());
    REQUIRE(checkpoint.verify().empty());
    REQUIRE(first_mismatch(checkpoint, layout_pieces(1, 1, 0, checkpoint.index().step)).empty());
  }
}
