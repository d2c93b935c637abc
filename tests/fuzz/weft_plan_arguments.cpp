// libFuzzer harness: weft-plan's command line, read and checked as the program does (model,
// cluster, job and layout options), everything short of the search.
#include <exception>

#include "fuzz_arguments.hpp"
#include "weft_plan/plan_arguments.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const weft_fuzz::command_line line(data, size);
  try {
    const weft_plan::arguments a = weft_plan::parse(line.argc(), line.argv.data());
    const weft::tune::model_desc model = weft_plan::read_model(a);
    // --hardware reads a file: the hardware_file harness covers that reader.
    if (a.has("--hardware")) return 0;
    const weft::tune::cluster_desc cluster = weft_plan::read_cluster(a, std::nullopt);
    const weft::tune::job_desc job = weft_plan::read_job(a);
    const weft::tune::search_options options = weft_plan::read_options(a);
    (void)model, (void)cluster, (void)job, (void)options;
  } catch (const weft_programs::usage_error&) {
  } catch (const weft::error&) {
  }
  return 0;
}
