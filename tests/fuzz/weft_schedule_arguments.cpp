// libFuzzer harness: weft-schedule's command line, then, for schedules small enough to simulate
// in a moment, what the program does with it: validation, the schedule and its verification.
#include <weft/pipeline/schedules.hpp>
#include <weft/pipeline/verify.hpp>

#include "fuzz_arguments.hpp"
#include "weft_schedule/schedule_arguments.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const weft_fuzz::command_line line(data, size);
  try {
    const weft_schedule::options opts = weft_schedule::parse_arguments(line.argc(), line.argv.data());
    if (opts.help || !weft::pipeline::validate(opts.spec).empty() || !weft::pipeline::validate(opts.costs).empty()) return 0;
    if (std::int64_t{opts.spec.stages} * opts.spec.micro_batches * opts.spec.virtual_stages > 4096) return 0;
    const weft::pipeline::schedule s = weft::pipeline::make_schedule(opts.spec);
    (void)weft::pipeline::verify(s, opts.costs);
  } catch (const weft_programs::usage_error&) {
  } catch (const weft::error&) {
  }
  return 0;
}
