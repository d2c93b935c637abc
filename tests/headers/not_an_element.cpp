// Must not compile: std::string is not an element type weft can send.
#include <weft/comm/buffer.hpp>

#include <string>
#include <vector>

template <weft::buffer B>
void takes_buffer(const B&) {}

int main() {
  std::vector<std::string> strings(3);
  takes_buffer(strings);
}
