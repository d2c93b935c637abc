// libFuzzer harness: weft-layout's command line, then, for layouts small enough to build in a
// moment, what the program does with it: validation, the groups, the model check, node placement.
#include <weft/layout/layout.hpp>
#include <weft/layout/model_shape.hpp>
#include <weft/layout/node_placement.hpp>

#include "fuzz_arguments.hpp"
#include "weft_layout/layout_arguments.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const weft_fuzz::command_line line(data, size);
  try {
    const weft_layout::options opts = weft_layout::parse_arguments(line.argc(), line.argv.data());
    if (opts.help || !opts.problems.empty() || !weft::layout::validate(opts.spec).empty()) return 0;
    if (opts.spec.world_size > 4096) return 0;  // the program's limit is checked above; building takes longer
    const weft::layout::rank_layout layout(opts.spec);
    (void)weft::layout::check_model_shape(layout, opts.model);
    if (opts.gpus_per_node && *opts.gpus_per_node >= 1) (void)weft::layout::place_on_nodes(layout, *opts.gpus_per_node);
    for (weft::layout::group_kind kind : weft::layout::all_group_kinds) (void)layout.groups(kind);
  } catch (const weft_programs::usage_error&) {
  } catch (const weft::error&) {
  }
  return 0;
}
