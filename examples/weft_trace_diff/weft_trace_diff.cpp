// weft-trace-diff: reads the flight-recorder dumps a job left (weft-flight-<rank>.json, written
// on a timeout, on another rank's timeout, on SIGUSR1, on SIGTERM or on request) and says which
// run they belong to (dumps of another run in the same folder are named and left out), then, per
// group: which ranks left no dump, the first collective where the ranks' calls differ, the ranks
// that never arrived at the newest collective, and the operation each rank was in. Groups that
// diverged come first; the idle, consistent ones are folded into one line.
//
//   weft-trace-diff DIR                 all weft-flight-*.json files in DIR
//   weft-trace-diff FILE...             those files
//   weft-trace-diff --json OUT DIR      also writes the report as JSON to OUT ("-": to standard
//                                       output, instead of the text)
//
// Exit status: 0 when the ranks agree and none is missing or behind, 1 when the report names a
// divergence (a missing rank, calls that differ, a rank behind), 2 for a bad command line or an
// unreadable dump.
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
    "usage: weft-trace-diff [--json OUT] DIR | FILE...\n"
    "  DIR         a folder holding the ranks' weft-flight-<rank>.json dumps ($WEFT_TRACE_DIR of the job)\n"
    "  FILE        dumps named one by one\n"
    "  --json OUT  also write the report as JSON to the file OUT; with OUT '-', write the JSON to standard\n"
    "              output instead of the text report\n"
    "exit status: 0 the ranks agree, 1 a divergence was found (a rank missing, calls that differ, a rank\n"
    "behind), 2 a bad command line or an unreadable dump\n";

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
    std::string json_out;
    bool json_given = false;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--json") {
        if (i + 1 >= argc) {
          std::fprintf(stderr, "weft-trace-diff: --json needs a file to write (or '-' for standard output)\n%s", usage_text);
          return 2;
        }
        json_out = argv[++i];
        json_given = true;
        continue;
      }
      if (arg.starts_with("--")) {
        std::fprintf(stderr, "weft-trace-diff: unknown option '%s'\n%s", arg.c_str(), usage_text);
        return 2;
      }
      const std::filesystem::path path(arg);
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
      std::fprintf(stderr, "weft-trace-diff: no weft-flight-*.json dumps given or found\n");
      return 2;
    }
    std::vector<weft::trace::flight_dump> dumps;
    std::vector<std::string> names;
    for (const auto& file : files) {
      try {
        dumps.push_back(weft::trace::parse_flight_dump(read_all(file)));
        names.push_back(file.string());
      } catch (const std::exception& e) {
        throw std::runtime_error(file.string() + ": " + e.what());
      }
    }
    const auto diff = weft::trace::diff_flight_dumps(dumps);
    if (!json_given || json_out != "-") std::printf("%s", weft::trace::format_trace_diff(diff, names).c_str());
    if (json_given) {
      const std::string json = weft::trace::trace_diff_json(diff, names);
      if (json_out == "-") {
        std::printf("%s", json.c_str());
      } else {
        std::ofstream out(json_out, std::ios::trunc);
        out << json;
        out.flush();
        if (!out) throw std::runtime_error("cannot write the JSON report to '" + json_out + "'");
      }
    }
    return diff.diverged() ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "weft-trace-diff: %s\n", e.what());
    return 2;
  }
}
