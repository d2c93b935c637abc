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

#include "json_output.hpp"
#include "schedule_arguments.hpp"

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

using weft_programs::json_string;
using weft_programs::json_strings;
using weft_programs::usage_error;
using weft_schedule::options;
using weft_schedule::usage_text;

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
    opts = weft_schedule::parse_arguments(argc, argv);
  } catch (const usage_error& e) {
    std::cerr << "weft-schedule: " << e.what() << "\n\n" << usage_text;
    return exit_usage;
  } catch (const std::exception& e) {
    std::cerr << "weft-schedule: error: " << e.what() << "\n";
    return exit_refused;
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
  } catch (const std::exception& e) {  // e.g. std::bad_alloc: one line, not an abort
    std::cerr << "weft-schedule: error: " << e.what() << "\n";
    return exit_refused;
  }
}
