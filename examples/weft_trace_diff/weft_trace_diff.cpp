// weft-trace-diff: reads the flight-recorder dumps a job left (weft-flight-<rank>.json, written
// on a timeout, on SIGUSR1, on SIGTERM or on request) and says, per group, which ranks left no
// dump, the first collective where the ranks' calls differ, the ranks that never arrived at the
// newest collective, and the operation each rank was in.
//
//   weft-trace-diff DIR            all weft-flight-*.json files in DIR
//   weft-trace-diff FILE...        those files
//
// Exit status: 0 when the ranks agree and none is missing or behind, 1 when the report names a
// problem, 2 for a bad command line or an unreadable dump.
#include <weft/trace/flight_dump.hpp>
#include <weft/trace/trace_diff.hpp>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr const char* usage_text =
    "usage: weft-trace-diff DIR | FILE...\n"
    "  DIR     a folder holding the ranks' weft-flight-<rank>.json dumps ($WEFT_TRACE_DIR of the job)\n"
    "  FILE    dumps named one by one\n";

std::string read_all(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read '" + path.string() + "'");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fprintf(argc < 2 ? stderr : stdout, "%s", usage_text);
    return argc < 2 ? 2 : 0;
  }
  try {
    std::vector<std::filesystem::path> files;
    for (int i = 1; i < argc; ++i) {
      const std::filesystem::path path(argv[i]);
      if (std::filesystem::is_directory(path)) {
        for (const auto& entry : std::filesystem::directory_iterator(path)) {
          const std::string name = entry.path().filename().string();
          if (name.starts_with("weft-flight-") && name.ends_with(".json")) files.push_back(entry.path());
        }
      } else {
        files.push_back(path);
      }
    }
    std::sort(files.begin(), files.end());
    if (files.empty()) {
      std::fprintf(stderr, "weft-trace-diff: no weft-flight-*.json dumps in %s\n", argv[1]);
      return 2;
    }
    std::vector<weft::trace::flight_dump> dumps;
    for (const auto& file : files) {
      try {
        dumps.push_back(weft::trace::parse_flight_dump(read_all(file)));
      } catch (const std::exception& e) {
        throw std::runtime_error(file.string() + ": " + e.what());
      }
    }
    const auto diff = weft::trace::diff_flight_dumps(dumps);
    std::printf("%zu dumps\n%s", dumps.size(), weft::trace::format_trace_diff(diff).c_str());
    bool problem = false;
    for (const auto& g : diff.groups)
      problem = problem || !g.missing.empty() || g.first_divergent.has_value() || !g.never_arrived.empty();
    return problem ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft-trace-diff: %s\n", e.what());
    return 2;
  }
}
