// libFuzzer harness: the JSON reader as weft-trace-diff uses it (a flight-recorder dump), then the
// comparison and report weft-trace-diff makes of the dump with itself and with an empty rank.
#include <exception>
#include <limits>
#include <string_view>
#include <vector>

#include <weft/trace/flight_dump.hpp>
#include <weft/trace/trace_diff.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const weft::trace::flight_dump dump = weft::trace::parse_flight_dump(text);
    weft::trace::flight_dump other = dump;
    other.rank = dump.rank == std::numeric_limits<int>::max() ? dump.rank - 1 : dump.rank + 1;
    for (weft::trace::group_dump& g : other.groups) g.entries.clear();
    const std::vector<weft::trace::flight_dump> dumps{dump, other};
    (void)weft::trace::format_trace_diff(weft::trace::diff_flight_dumps(dumps));
  } catch (const std::exception&) {  // weft-trace-diff reports any of these as an unreadable dump
  }
  return 0;
}
