// weft-layout: prints the process groups of a parallel layout, or why the layout is invalid.
//
//   weft-layout --world-size W [--tp T] [--cp C] [--ep E] [--pp P] [--dp D] [--expert-tp T]
//               [--order ORDER] [--gpus-per-node G] [--rank R] [--json]
//               [--heads H] [--kv-heads K] [--layers L] [--virtual-stages V] [--experts X] [--seq-length S]
//
// Exit status: 0 valid, 1 invalid layout or model shape, 2 bad command line.

#include <weft/core/error.hpp>
#include <weft/layout/group_kind.hpp>
#include <weft/layout/layout.hpp>
#include <weft/layout/model_shape.hpp>
#include <weft/layout/node_placement.hpp>

#include "json_output.hpp"
#include "layout_arguments.hpp"

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

namespace wl = weft::layout;

constexpr int exit_invalid_layout = 1;
constexpr int exit_usage = 2;

using weft_programs::json_string;
using weft_programs::json_strings;
using weft_programs::usage_error;
using weft_layout::options;
using weft_layout::usage_text;

// ---- JSON ------------------------------------------------------------------------------------

std::string json_ranks(const std::vector<int>& ranks) {
  std::string out = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i != 0) out += ",";
    out += std::to_string(ranks[i]);
  }
  return out + "]";
}

std::string hex(std::uint64_t value) {
  char buffer[24];
  std::snprintf(buffer, sizeof buffer, "0x%016llx", static_cast<unsigned long long>(value));
  return buffer;
}

void print_json(std::ostream& out, const wl::rank_layout& layout, const options& opts,
                const std::optional<wl::node_report>& nodes) {
  out << "{\n";
  out << "  \"world_size\": " << layout.world_size() << ",\n";
  out << "  \"order\": " << json_string(layout.order().to_string()) << ",\n";
  out << "  \"degrees\": {\"tp\": " << layout.tp() << ", \"cp\": " << layout.cp() << ", \"ep\": " << layout.ep()
      << ", \"dp\": " << layout.dp() << ", \"pp\": " << layout.pp() << ", \"expert_tp\": " << layout.expert_tp()
      << ", \"expert_dp\": " << layout.expert_dp() << "},\n";
  out << "  \"fingerprint\": " << json_string(hex(layout.fingerprint())) << ",\n";
  out << "  \"groups\": {";
  bool first_kind = true;
  for (wl::group_kind kind : wl::all_group_kinds) {
    out << (first_kind ? "\n" : ",\n") << "    " << json_string(wl::to_string(kind)) << ": [";
    first_kind = false;
    bool first_group = true;
    for (const std::vector<int>& ranks : layout.groups(kind)) {
      out << (first_group ? "" : ",") << json_ranks(ranks);
      first_group = false;
    }
    out << "]";
  }
  out << "\n  },\n";
  out << "  \"ranks\": [";
  for (int rank = 0; rank < layout.world_size(); ++rank) {
    if (opts.rank && *opts.rank != rank) continue;
    const wl::rank_coordinates c = layout.coordinates(rank);
    out << ((opts.rank || rank == 0) ? "\n" : ",\n") << "    {\"rank\": " << rank << ", \"tp\": " << c.tp << ", \"cp\": " << c.cp
        << ", \"dp\": " << c.dp << ", \"pp\": " << c.pp << ", \"ep\": " << c.ep << ", \"expert_tp\": " << c.expert_tp
        << ", \"expert_dp\": " << c.expert_dp;
    if (nodes) out << ", \"node\": " << wl::node_of(rank, nodes->gpus_per_node);
    out << "}";
  }
  out << "\n  ]";
  if (nodes) {
    out << ",\n  \"nodes\": {\"gpus_per_node\": " << nodes->gpus_per_node << ", \"node_count\": " << nodes->node_count
        << ", \"groups\": {";
    bool first = true;
    for (const wl::group_placement& p : nodes->groups) {
      out << (first ? "\n" : ",\n") << "    " << json_string(wl::to_string(p.kind)) << ": {\"inside_nodes\": "
          << (p.inside_nodes() ? "true" : "false") << ", \"crossing\": " << p.crossing << ", \"max_nodes\": " << p.max_nodes << "}";
      first = false;
    }
    out << "\n  }}";
  }
  out << ",\n  \"warnings\": " << json_strings(nodes ? nodes->warnings : std::vector<std::string>{}) << "\n}\n";
}

// ---- table -----------------------------------------------------------------------------------

bool shows_expert(const wl::rank_layout& layout) { return layout.ep() > 1 || layout.expert_tp() != layout.tp(); }

std::string group_text(const std::vector<int>& ranks) {
  std::string out = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i != 0) out += " ";
    out += std::to_string(ranks[i]);
  }
  return out + "]";
}

void print_table(std::ostream& out, const wl::rank_layout& layout, const options& opts,
                 const std::optional<wl::node_report>& nodes) {
  const bool expert = shows_expert(layout);
  out << "layout: world size " << layout.world_size() << ", order " << layout.order().to_string() << "\n";
  out << "  dense layers:  tp=" << layout.tp() << " cp=" << layout.cp() << " dp=" << layout.dp() << " pp=" << layout.pp() << "\n";
  out << "  expert layers: expert-tp=" << layout.expert_tp() << " ep=" << layout.ep() << " expert-dp=" << layout.expert_dp()
      << " pp=" << layout.pp() << "\n";
  out << "  fingerprint " << hex(layout.fingerprint()) << "\n";
  if (nodes) out << "  " << nodes->node_count << " node(s) of " << nodes->gpus_per_node << " GPUs, ranks filling nodes in order\n";

  constexpr int max_rank_rows = 256;
  out << "\nranks (coordinates = place in each group):\n";
  out << "  rank" << (nodes ? "  node" : "") << "    tp    cp    dp    pp" << (expert ? "    ep  e-tp  e-dp" : "") << "\n";
  char line[128];
  int shown = 0;
  for (int rank = 0; rank < layout.world_size(); ++rank) {
    if (opts.rank && *opts.rank != rank) continue;
    if (!opts.rank && shown == max_rank_rows) {
      out << "  ... " << layout.world_size() - shown << " more (use --rank R or --json)\n";
      break;
    }
    const wl::rank_coordinates c = layout.coordinates(rank);
    std::snprintf(line, sizeof line, "  %4d", rank);
    out << line;
    if (nodes) {
      std::snprintf(line, sizeof line, "  %4d", wl::node_of(rank, nodes->gpus_per_node));
      out << line;
    }
    std::snprintf(line, sizeof line, "  %4d  %4d  %4d  %4d", c.tp, c.cp, c.dp, c.pp);
    out << line;
    if (expert) {
      std::snprintf(line, sizeof line, "  %4d  %4d  %4d", c.ep, c.expert_tp, c.expert_dp);
      out << line;
    }
    out << "\n";
    ++shown;
  }

  constexpr std::size_t max_groups_shown = 32;
  out << "\ngroups (kind: size x count" << (nodes ? ", node placement" : "") << "):\n";
  for (wl::group_kind kind : wl::all_group_kinds) {
    if (wl::is_expert(kind) && !expert) continue;
    out << "  " << wl::to_string(kind) << ": " << layout.group_size(kind) << " x " << layout.group_count(kind);
    if (nodes) {
      const wl::group_placement& p = (*nodes)[kind];
      if (p.inside_nodes()) {
        out << ", inside nodes";
      } else {
        out << ", " << p.crossing << " cross nodes (up to " << p.max_nodes << ")";
      }
    }
    out << "\n    ";
    if (opts.rank) {
      const wl::rank_group g = layout.group_of(kind, *opts.rank);
      out << (g.member() ? group_text(g.ranks) + " (rank " + std::to_string(*opts.rank) + " at position " + std::to_string(g.position) + ")"
                         : std::string("(rank ") + std::to_string(*opts.rank) + " is in none)");
    } else {
      const std::vector<std::vector<int>> groups = layout.groups(kind);
      for (std::size_t i = 0; i < groups.size() && i < max_groups_shown; ++i) out << (i ? " " : "") << group_text(groups[i]);
      if (groups.size() > max_groups_shown) out << " ... " << groups.size() - max_groups_shown << " more";
    }
    out << "\n";
  }
  if (!expert) out << "  (expert groups not shown: ep=1 and expert-tp=tp; --json lists them)\n";

  if (nodes) {
    out << "\n";
    if (nodes->warnings.empty()) out << "no node warnings\n";
    for (const std::string& warning : nodes->warnings) out << "warning: " << warning << "\n";
  }
}

int report_problems(const options& opts, const std::vector<std::string>& problems) {
  for (const std::string& problem : problems) std::cerr << "weft-layout: error: " << problem << "\n";
  if (opts.json) std::cout << "{\"errors\": " << json_strings(problems) << "}\n";
  return exit_invalid_layout;
}

}  // namespace

int main(int argc, char** argv) {
  options opts;
  try {
    opts = weft_layout::parse_arguments(argc, argv);
  } catch (const usage_error& e) {
    std::cerr << "weft-layout: " << e.what() << "\n\n" << usage_text;
    return exit_usage;
  } catch (const std::exception& e) {
    std::cerr << "weft-layout: error: " << e.what() << "\n";
    return exit_invalid_layout;
  }
  if (opts.help) {
    std::cout << usage_text;
    return 0;
  }
  try {
    std::vector<std::string> problems = opts.problems;
    if (problems.empty()) problems = wl::validate(opts.spec);
    if (opts.gpus_per_node && *opts.gpus_per_node < 1) {
      problems.push_back("gpus per node " + std::to_string(*opts.gpus_per_node) +
                         " is invalid: give the number of ranks on each node (the launcher's local world size), at least 1");
    }
    if (!problems.empty()) return report_problems(opts, problems);
    const wl::rank_layout layout(opts.spec);
    problems = wl::check_model_shape(layout, opts.model);
    if (opts.rank && (*opts.rank < 0 || *opts.rank >= layout.world_size())) {
      problems.push_back("--rank " + std::to_string(*opts.rank) + " is outside the world: give 0.." + std::to_string(layout.world_size() - 1));
    }
    if (!problems.empty()) return report_problems(opts, problems);
    std::optional<wl::node_report> nodes;
    if (opts.gpus_per_node) nodes = wl::place_on_nodes(layout, *opts.gpus_per_node);
    std::ostringstream text;
    if (opts.json) {
      print_json(text, layout, opts, nodes);
    } else {
      print_table(text, layout, opts, nodes);
    }
    std::cout << text.str();
    if (nodes && opts.json) {
      for (const std::string& warning : nodes->warnings) std::cerr << "weft-layout: warning: " << warning << "\n";
    }
    return 0;
  } catch (const weft::error& e) {
    return report_problems(opts, {e.what()});
  } catch (const std::exception& e) {  // e.g. std::bad_alloc: one line, not an abort
    std::cerr << "weft-layout: error: " << e.what() << "\n";
    return exit_invalid_layout;
  }
}
