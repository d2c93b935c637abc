// weft-schedule: prints a pipeline schedule, per rank, with its verified makespan, bubble and
// activations held, or why the schedule is refused.
//
//   weft-schedule --schedule gpipe|1f1b|interleaved|zb-h1 --stages P --micro-batches M [--virtual V]
//                 [--layers L] [--forward-cost F] [--backward-cost B] [--weight-cost W] [--comm-cost C] [--json]
//
// Exit status: 0 valid, 1 refused schedule or costs, 2 bad command line.

#include <weft/core/error.hpp>
#include <weft/pipeline/rules.hpp>
#include <weft/pipeline/schedule.hpp>
#include <weft/pipeline/schedule_kind.hpp>
#include <weft/pipeline/schedules.hpp>
#include <weft/pipeline/verify.hpp>

#include "command_line.hpp"
#include "json_output.hpp"

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace wp = weft::pipeline;

constexpr int exit_refused = 1;
constexpr int exit_usage = 2;

constexpr std::string_view usage_text =
    "usage: weft-schedule --schedule gpipe|1f1b|interleaved|zb-h1 --stages P --micro-batches M [--virtual V]\n"
    "                     [--layers L] [--forward-cost F] [--backward-cost B] [--weight-cost W] [--comm-cost C] [--json]\n"
    "\n"
    "Prints each rank's actions of a pipeline schedule as a timeline (one row per stage, one cell per\n"
    "time unit: F forward, B backward, W weight gradient, . idle; the digit under a cell is the\n"
    "micro-batch), verified by simulation: makespan, bubble (idle time over stages x makespan) and\n"
    "the peak of micro-batches in flight per stage. Costs are per action (per model chunk), in time\n"
    "units: F=1, B=2 (the whole backward), W=B/2 (its weight-gradient part, run apart by zb-h1), C=0.\n"
    "Exit status: 0 valid, 1 refused schedule or costs, 2 bad command line.\n";

using weft_programs::parse_integer;
using weft_programs::json_string;
using weft_programs::json_strings;
using weft_programs::usage_error;

struct options {
  wp::schedule_spec spec;
  wp::costs costs;
  bool json = false;
  bool help = false;
};

options parse_arguments(int argc, char** argv) {
  options opts;
  bool have_schedule = false, have_stages = false, have_micro_batches = false, have_weight = false;
  constexpr int int_max = std::numeric_limits<int>::max();
  constexpr std::int64_t cost_max = std::int64_t{1} << 40;
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
      if (!kind) throw usage_error("--schedule expects one of " + wp::schedule_kind_names() + ", not '" + std::string(name) + "'");
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
      opts.costs.forward = parse_integer<std::int64_t>(flag, value(), 1, cost_max);
    } else if (flag == "--backward-cost") {
      opts.costs.backward = parse_integer<std::int64_t>(flag, value(), 1, cost_max);
    } else if (flag == "--weight-cost") {
      opts.costs.weight = parse_integer<std::int64_t>(flag, value(), 0, cost_max);
      have_weight = true;
    } else if (flag == "--comm-cost") {
      opts.costs.comm = parse_integer<std::int64_t>(flag, value(), 0, cost_max);
    } else {
      throw usage_error("unknown option '" + std::string(arg) + "'");
    }
  }
  if (opts.help) return opts;
  // Left out, the weight gradient is half the backward, as when input and weight gradients cost alike.
  if (!have_weight) opts.costs.weight = opts.costs.backward / 2;
  if (!have_schedule) throw usage_error("--schedule is required: one of " + wp::schedule_kind_names());
  if (!have_stages) throw usage_error("--stages is required: the pipeline-parallel size");
  if (!have_micro_batches) throw usage_error("--micro-batches is required: the micro-batches per step");
  return opts;
}

std::string fixed(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", digits, value);
  return buffer;
}

void print_json(std::ostream& out, const wp::schedule& s, const wp::verify_report& r) {
  out << "{\n";
  out << "  \"schedule\": " << json_string(wp::to_string(s.kind)) << ",\n";
  out << "  \"stages\": " << s.stages << ",\n";
  out << "  \"micro_batches\": " << s.micro_batches << ",\n";
  out << "  \"virtual\": " << s.virtual_stages << ",\n";
  out << "  \"makespan\": " << r.makespan << ",\n";
  out << "  \"bubble_fraction\": " << fixed(r.bubble_fraction, 12) << ",\n";
  out << "  \"peak_in_flight\": [";
  for (std::size_t i = 0; i < r.peak_in_flight.size(); ++i) out << (i ? ", " : "") << r.peak_in_flight[i];
  out << "],\n";
  out << "  \"deadlock_free\": " << (r.deadlock_free ? "true" : "false") << ",\n";
  out << "  \"actions\": [";
  for (std::size_t rank = 0; rank < s.ranks.size(); ++rank) {
    out << (rank ? ",\n" : "\n") << "    [";
    for (std::size_t i = 0; i < s.ranks[rank].size(); ++i) {
      const wp::action& a = s.ranks[rank][i];
      out << (i ? ", " : "") << "{\"kind\": " << json_string(wp::to_string(a.kind)) << ", \"micro_batch\": " << a.micro_batch
          << ", \"chunk\": " << a.chunk << ", \"recv_from\": " << a.recv_from << ", \"send_to\": " << a.send_to
          << ", \"start\": " << r.times[rank][i].start << ", \"finish\": " << r.times[rank][i].finish << "}";
    }
    out << "]";
  }
  out << "\n  ]\n}\n";
}

void print_timeline(std::ostream& out, const wp::schedule& s, const wp::verify_report& r, const wp::costs& c) {
  out << wp::to_string(s.kind) << " schedule: " << s.stages << " stages, " << s.micro_batches << " micro-batches";
  if (s.virtual_stages > 1) out << ", " << s.virtual_stages << " model chunks per rank";
  out << "; costs F=" << c.forward << " B=" << c.backward;
  if (s.split_backward) out << " (input " << c.backward - c.weight << " + weight W=" << c.weight << ")";
  if (c.comm > 0) out << " comm=" << c.comm;
  out << "\n\n";
  constexpr std::int64_t max_width = 240;
  if (r.makespan > max_width) {
    out << "(timeline of " << r.makespan << " time units not drawn: more than " << max_width << "; use --json)\n";
  } else {
    const auto width = static_cast<std::size_t>(r.makespan);
    out << "time     ";
    for (std::size_t t = 0; t < width; ++t) out << (t % 10 == 0 ? static_cast<char>('0' + t / 10 % 10) : ' ');
    out << "\n";
    for (std::size_t rank = 0; rank < s.ranks.size(); ++rank) {
      std::string kinds(width, '.'), micro(width, ' '), chunks(width, ' ');
      for (std::size_t i = 0; i < s.ranks[rank].size(); ++i) {
        const wp::action& a = s.ranks[rank][i];
        const wp::action_time& t = r.times[rank][i];
        if (t.start < 0) continue;
        for (std::int64_t u = t.start; u < t.finish; ++u) {
          const auto cell = static_cast<std::size_t>(u);
          kinds[cell] = wp::letter(a.kind);
          micro[cell] = static_cast<char>('0' + a.micro_batch % 10);
          chunks[cell] = static_cast<char>('0' + a.chunk % 10);
        }
      }
      char label[32];
      std::snprintf(label, sizeof label, "stage %-3zu", rank);
      out << label << kinds << "\n";
      out << "  mb     " << micro << "\n";
      if (s.virtual_stages > 1) out << "  chunk  " << chunks << "\n";
    }
  }
  out << "\nmakespan " << r.makespan << ", bubble " << fixed(100 * r.bubble_fraction, 2) << " % (idle / (stages x makespan)), "
      << (r.deadlock_free ? "deadlock-free" : "DEADLOCK") << "\n";
  out << "peak micro-batches in flight per stage" << (s.virtual_stages > 1 ? " (micro-batch, chunk pairs)" : "") << ":";
  for (int peak : r.peak_in_flight) out << " " << peak;
  out << "\n";
}

int report_problems(const options& opts, const std::vector<std::string>& problems) {
  for (const std::string& problem : problems) std::cerr << "weft-schedule: error: " << problem << "\n";
  if (opts.json) {
    std::cout << "{\"errors\": " << json_strings(problems) << "}\n";
  }
  return exit_refused;
}

}  // namespace

int main(int argc, char** argv) {
  options opts;
  try {
    opts = parse_arguments(argc, argv);
  } catch (const usage_error& e) {
    std::cerr << "weft-schedule: " << e.what() << "\n\n" << usage_text;
    return exit_usage;
  }
  if (opts.help) {
    std::cout << usage_text;
    return 0;
  }
  try {
    std::vector<std::string> problems = wp::validate(opts.spec);
    for (std::string& problem : wp::validate(opts.costs)) problems.push_back(std::move(problem));
    if (!problems.empty()) return report_problems(opts, problems);
    const wp::schedule s = wp::make_schedule(opts.spec);
    const wp::verify_report report = wp::verify(s, opts.costs);
    std::ostringstream text;
    if (opts.json) {
      print_json(text, s, report);
    } else {
      print_timeline(text, s, report, opts.costs);
    }
    std::cout << text.str();
    if (!report.ok()) {
      problems = report.problems;
      for (const std::string& wait : report.waits) problems.push_back(wait);
      for (const std::string& problem : problems) std::cerr << "weft-schedule: error: " << problem << "\n";
      return exit_refused;
    }
    return 0;
  } catch (const weft::error& e) {
    return report_problems(opts, {e.what()});
  }
}
