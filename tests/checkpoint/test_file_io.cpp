// The atomic replacement's file handling: the temporary file is always a new one (never a link
// or a leftover written through), and a directory that cannot be synced is reported.

#include <catch2/catch.hpp>

#include <weft/checkpoint/detail/file_io.hpp>
#include <weft/checkpoint/safetensors.hpp>
#include <weft/core/error.hpp>

#include <filesystem>
#include <set>
#include <string>

#include <unistd.h>

#include "checkpoint_test_support.hpp"
#include "sample_set.hpp"

using namespace weft::checkpoint;
using checkpoint_test::file_contents;
using checkpoint_test::scratch_directory;
using Catch::Contains;

TEST_CASE("a symbolic link or a leftover at the old temporary name is never written through") {
  scratch_directory dir("temporary_links");
  const auto path = dir / "model.safetensors";
  const auto victim = dir / "victim.txt";
  checkpoint_test::write_contents(victim, "precious");
  // The name earlier versions wrote to, `path.tmp-<pid>`: predictable, so another user of a shared
  // directory could plant a link there and have the checkpoint truncate and overwrite its target.
  const std::filesystem::path planted = path.string() + ".tmp-" + std::to_string(::getpid());
  std::filesystem::create_symlink(victim, planted);

  write_safetensors(path, checkpoint_test::sample_file());

  CHECK(file_contents(victim) == "precious");
  CHECK(std::filesystem::is_symlink(planted));
  CHECK_FALSE(std::filesystem::is_symlink(path));
  CHECK(read_safetensors(path).tensors.size() == checkpoint_test::sample_tensors().size());
  // No temporary file is left besides the planted link.
  std::set<std::string> left;
  for (const std::string& name : dir.entries()) left.insert(name);
  CHECK(left == std::set<std::string>{"model.safetensors", "victim.txt", planted.filename().string()});
}

TEST_CASE("each temporary file has a name no file had, and is created, not opened") {
  scratch_directory dir("temporary_names");
  const auto path = dir / "model.safetensors";
  detail::temporary_file first, second;
  REQUIRE(detail::create_temporary_file(path, first) == 0);
  REQUIRE(detail::create_temporary_file(path, second) == 0);
  CHECK(first.path != second.path);
  CHECK(first.path.string().starts_with(path.string() + ".tmp-" + std::to_string(::getpid()) + "-"));
  CHECK(std::filesystem::is_regular_file(first.path));
  CHECK(std::filesystem::is_regular_file(second.path));
}

TEST_CASE("a directory that cannot be opened for its sync is reported, not skipped") {
  scratch_directory dir("directory_sync");
  CHECK_NOTHROW(detail::sync_directory_of(dir / "model.safetensors"));
  CHECK_THROWS_WITH(detail::sync_directory_of(dir / "gone" / "model.safetensors"),
                    Contains("model.safetensors' was written, but its directory") && Contains("gone") &&
                        Contains("could not be opened to sync the rename: No such file or directory"));
}
