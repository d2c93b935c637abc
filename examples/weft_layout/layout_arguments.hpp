#pragma once
// weft-layout's command line: read and checked without printing or exiting, so the program and
// the fuzzing harness (tests/fuzz) call the same code.

#include <weft/layout/layout.hpp>
#include <weft/layout/model_shape.hpp>

#include "command_line.hpp"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weft_layout {

namespace wl = weft::layout;

inline constexpr std::string_view usage_text =
    "usage: weft-layout --world-size W [--tp T] [--cp C] [--ep E] [--pp P] [--dp D] [--expert-tp T]\n"
    "                   [--order ORDER] [--gpus-per-node G] [--rank R] [--json]\n"
    "                   [--heads H] [--kv-heads K] [--layers L] [--virtual-stages V] [--experts X] [--seq-length S]\n"
    "\n"
    "Prints every process group of a parallel layout: per rank its coordinates, per group kind its\n"
    "groups of world ranks, and which groups cross nodes. Degrees left out are 1; dp is derived as\n"
    "world size / (tp x cp x pp); expert-tp defaults to tp; ORDER names the dimensions fastest-varying\n"
    "first (default tp-cp-ep-dp-pp). Model sizes, when given, are checked against the degrees.\n"
    "Limits: W and G up to 1048576; H, K, L, V and X up to 1048576; S up to 2^40.\n"
    "Exit status: 0 valid, 1 invalid layout or model, 2 bad command line.\n";

/// The most ranks weft-layout lays out: every group of every kind is built, 2.6 s of CPU and
/// 560 MB with --json at this size (more than any job runs; 2^31 ranks would ask for hundreds of GB).
inline constexpr int max_world_size = 1 << 20;
/// Heads, layers, virtual stages and experts: far above any model, far below int overflow in
/// pp x virtual stages.
inline constexpr int max_model_size = 1 << 20;
inline constexpr std::int64_t max_seq_length = std::int64_t{1} << 40;

struct options {
  wl::layout_spec spec;
  wl::model_shape model;
  std::optional<int> gpus_per_node;
  std::optional<int> rank;
  bool json = false;
  bool help = false;
  /// Values out of their range, reported with the layout's problems (exit status 1).
  std::vector<std::string> problems;
};

/// Reads the command line; throws weft_programs::usage_error for a mistake in it. Values that are
/// integers but out of range go to `options::problems`.
inline options parse_arguments(int argc, const char* const* argv) {
  using weft_programs::usage_error;
  // Any int: degrees, sizes and ranks out of their range are reported with the layout's problems.
  auto parse_int = [](std::string_view flag, std::string_view text) {
    return weft_programs::parse_integer(flag, text, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  };
  options opts;
  bool have_world = false;
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    std::string_view flag = arg;
    std::optional<std::string_view> inline_value;
    if (auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
      flag = arg.substr(0, eq);
      inline_value = arg.substr(eq + 1);
    }
    auto value = [&]() -> std::string_view {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw usage_error(std::string(flag) + " needs a value");
      return argv[++i];
    };
    auto flag_only = [&] {
      if (inline_value) throw usage_error(std::string(flag) + " takes no value");
    };
    // An explicit degree of 0 would otherwise mean "derive" for dp and expert-tp.
    auto degree = [&](std::string_view name) {
      int v = parse_int(flag, value());
      if (v < 1) opts.problems.push_back(std::string(name) + "=" + std::to_string(v) + " is invalid: every degree must be at least 1" +
                                         (name == "dp" ? " (leave --dp out to derive it)" : name == "expert-tp" ? " (leave --expert-tp out to use tp)" : ""));
      return v < 1 ? 1 : v;
    };
    // A size out of [low, high]: named with its flag and range.
    auto size = [&](int low, int high) {
      const int v = parse_int(flag, value());
      if (v < low || v > high) {
        opts.problems.push_back(std::string(flag) + " " + std::to_string(v) + " is out of range: give " + std::to_string(low) +
                                " to " + std::to_string(high) + (low == 0 ? " (0: unknown, not checked)" : ""));
        return low;
      }
      return v;
    };
    if (flag == "--help" || flag == "-h") {
      flag_only();
      opts.help = true;
    } else if (flag == "--json") {
      flag_only();
      opts.json = true;
    } else if (flag == "--world-size") {
      opts.spec.world_size = parse_int(flag, value());
      if (opts.spec.world_size > max_world_size) {
        opts.problems.push_back("world size " + std::to_string(opts.spec.world_size) + " is more than the " +
                                std::to_string(max_world_size) + " ranks weft-layout lays out: give --world-size up to " +
                                std::to_string(max_world_size));
        opts.spec.world_size = 1;
      }
      have_world = true;
    } else if (flag == "--tp") {
      opts.spec.tp = degree("tp");
    } else if (flag == "--cp") {
      opts.spec.cp = degree("cp");
    } else if (flag == "--ep") {
      opts.spec.ep = degree("ep");
    } else if (flag == "--pp") {
      opts.spec.pp = degree("pp");
    } else if (flag == "--dp") {
      opts.spec.dp = degree("dp");
    } else if (flag == "--expert-tp") {
      opts.spec.expert_tp = degree("expert-tp");
    } else if (flag == "--order") {
      opts.spec.order = std::string(value());
    } else if (flag == "--gpus-per-node") {
      const int v = parse_int(flag, value());  // below 1: the program says what to give
      if (v > max_world_size)
        opts.problems.push_back("--gpus-per-node " + std::to_string(v) + " is out of range: give 1 to " +
                                std::to_string(max_world_size));
      opts.gpus_per_node = v > max_world_size ? 1 : v;
    } else if (flag == "--rank") {
      opts.rank = parse_int(flag, value());
    } else if (flag == "--heads") {
      opts.model.heads = size(0, max_model_size);
    } else if (flag == "--kv-heads") {
      opts.model.kv_heads = size(0, max_model_size);
    } else if (flag == "--layers") {
      opts.model.layers = size(0, max_model_size);
    } else if (flag == "--virtual-stages") {
      opts.model.virtual_stages = size(1, max_model_size);
    } else if (flag == "--experts") {
      opts.model.experts = size(0, max_model_size);
    } else if (flag == "--seq-length") {
      opts.model.seq_length = weft_programs::parse_integer(flag, value(), std::numeric_limits<std::int64_t>::min(),
                                                           std::numeric_limits<std::int64_t>::max());
      if (opts.model.seq_length < 0 || opts.model.seq_length > max_seq_length) {
        opts.problems.push_back("--seq-length " + std::to_string(opts.model.seq_length) + " is out of range: give 0 to " +
                                std::to_string(max_seq_length) + " (0: unknown, not checked)");
        opts.model.seq_length = 0;
      }
    } else {
      throw weft_programs::unknown_option(flag, usage_text);
    }
  }
  if (!opts.help && !have_world) throw usage_error("--world-size is required: the number of ranks in the job");
  return opts;
}

}  // namespace weft_layout
