// libFuzzer harness: the number and spelling readers every program shares (examples/common):
// the first input line is a value, the second a list of choices.
#include <string>
#include <string_view>

#include "command_line.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::size_t newline = input.find('\n');
  const std::string value(input.substr(0, newline));
  const std::string_view rest = newline == std::string_view::npos ? std::string_view() : input.substr(newline + 1);
  using namespace weft_programs;
  constexpr unit_suffix units[] = {{"K", 1e3}, {"M", 1e6}, {"T", 1e12}};
  try { (void)parse_integer<int>("--n", value, -5, 1 << 20); } catch (const usage_error&) {}
  try { (void)parse_integer<long long>("--n", value, 0, 1LL << 40); } catch (const usage_error&) {}
  try { (void)parse_real("--x", value, 1e-3, 1e6, units); } catch (const usage_error&) {}
  try { (void)parse_bytes("--bytes", value); } catch (const usage_error&) {}
  (void)did_you_mean(value, listed_words(rest));
  (void)did_you_mean(value, options_in_usage(rest));
  return 0;
}
