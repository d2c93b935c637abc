#pragma once
// weft-schedule's command line: read and checked without printing or exiting, so the program
// and the fuzzing harness (tests/fuzz) call the same code.

#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule_kind.hpp>
#include <weft/pipeline/verify.hpp>

#include "command_line.hpp"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weft_schedule {

namespace wp = weft::pipeline;

inline constexpr std::string_view usage_text =
    "usage: weft-schedule --schedule gpipe|1f1b|interleaved|zb-h1 --stages P --micro-batches M [--virtual V]\n"
    "                     [--layers L] [--forward-cost F] [--backward-cost B] [--weight-cost W] [--comm-cost C] [--json]\n"
    "\n"
    "Prints each rank's actions of a pipeline schedule as a timeline (one row per stage, one cell per\n"
    "time unit: F forward, B backward, W weight gradient, . idle; the digit under a cell is the\n"
    "micro-batch), verified by simulation: makespan, bubble (idle time over stages x makespan) and\n"
    "the peak of micro-batches in flight per stage. Costs are per action (per model chunk), in time\n"
    "units: F=1, B=2 (the whole backward), W=B/2 (its weight-gradient part, run apart by zb-h1), C=0.\n"
    "Limits: P <= 4096, M <= 65536, V <= 1024, at most 2097152 actions in all (stages x micro-batches\n"
    "x virtual x 2, or x 3 for zb-h1), costs <= 2^30.\n"
    "Exit status: 0 valid, 1 refused schedule or costs, 2 bad command line.\n";

/// The most actions (forward, backward and weight passes over all ranks) weft-schedule builds and
/// simulates: up to 4 s of CPU and 460 MB (gpipe, 4096 x 256; with --json 5.5 s, 960 MB and 250 MB
/// of output). More is no schedule anyone reads, and 4096 stages x 65536 micro-batches x 1024
/// chunks would ask for 5.5e11.
inline constexpr std::int64_t max_actions = std::int64_t{1} << 21;
/// Per-action costs: with max_actions, every finish time stays far inside 64 bits.
inline constexpr std::int64_t max_cost = std::int64_t{1} << 30;

struct options {
  wp::schedule_spec spec;
  wp::costs costs;
  bool json = false;
  bool help = false;
};

/// Reads the command line; throws weft_programs::usage_error for a mistake in it.
inline options parse_arguments(int argc, const char* const* argv) {
  using weft_programs::parse_integer;
  using weft_programs::usage_error;
  options opts;
  bool have_schedule = false, have_stages = false, have_micro_batches = false, have_weight = false;
  constexpr int int_max = std::numeric_limits<int>::max();
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
    if (flag == "--help" || flag == "-h") {
      flag_only();
      opts.help = true;
    } else if (flag == "--json") {
      flag_only();
      opts.json = true;
    } else if (flag == "--schedule") {
      const std::string_view name = value();
      const std::optional<wp::schedule_kind> kind = wp::parse_schedule_kind(name);
      if (!kind) {
        const std::string names = wp::schedule_kind_names();
        throw usage_error("--schedule expects one of " + names + ", not '" + std::string(name) + "'" +
                          weft_programs::did_you_mean(name, weft_programs::listed_words(names)));
      }
      opts.spec.kind = *kind;
      have_schedule = true;
    } else if (flag == "--stages") {
      opts.spec.stages = parse_integer(flag, value(), 1, 4096);
      have_stages = true;
    } else if (flag == "--micro-batches") {
      opts.spec.micro_batches = parse_integer(flag, value(), 1, 65536);
      have_micro_batches = true;
    } else if (flag == "--virtual") {
      opts.spec.virtual_stages = parse_integer(flag, value(), 1, 1024);
    } else if (flag == "--layers") {
      opts.spec.layers = parse_integer(flag, value(), 0, int_max);
    } else if (flag == "--forward-cost") {
      opts.costs.forward = parse_integer<std::int64_t>(flag, value(), 1, max_cost);
    } else if (flag == "--backward-cost") {
      opts.costs.backward = parse_integer<std::int64_t>(flag, value(), 1, max_cost);
    } else if (flag == "--weight-cost") {
      opts.costs.weight = parse_integer<std::int64_t>(flag, value(), 0, max_cost);
      have_weight = true;
    } else if (flag == "--comm-cost") {
      opts.costs.comm = parse_integer<std::int64_t>(flag, value(), 0, max_cost);
    } else {
      throw weft_programs::unknown_option(flag, usage_text);
    }
  }
  if (opts.help) return opts;
  // Left out, the weight gradient is half the backward, as when input and weight gradients cost alike.
  if (!have_weight) opts.costs.weight = opts.costs.backward / 2;
  if (!have_schedule) throw usage_error("--schedule is required: one of " + wp::schedule_kind_names());
  if (!have_stages) throw usage_error("--stages is required: the pipeline-parallel size");
  if (!have_micro_batches) throw usage_error("--micro-batches is required: the micro-batches per step");
  const std::int64_t passes = opts.spec.kind == wp::schedule_kind::zb_h1 ? 3 : 2;
  const std::int64_t actions = std::int64_t{opts.spec.stages} * opts.spec.micro_batches * opts.spec.virtual_stages * passes;
  if (actions > max_actions)
    throw usage_error("--stages " + std::to_string(opts.spec.stages) + " x --micro-batches " +
                      std::to_string(opts.spec.micro_batches) + " x --virtual " + std::to_string(opts.spec.virtual_stages) +
                      " x " + std::to_string(passes) + " passes = " + std::to_string(actions) +
                      " actions, more than the " + std::to_string(max_actions) +
                      " weft-schedule builds; give fewer stages, micro-batches or virtual stages");
  return opts;
}

}  // namespace weft_schedule
