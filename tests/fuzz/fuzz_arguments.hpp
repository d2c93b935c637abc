#pragma once
// The fuzzing input as a command line: the bytes split at newlines into arguments after the
// program name (a NUL byte ends an argument's text as it would in a real argv).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace weft_fuzz {

struct command_line {
  std::vector<std::string> words;
  std::vector<const char*> argv;

  command_line(const std::uint8_t* data, std::size_t size) {
    words.emplace_back("program");
    std::string word;
    for (std::size_t i = 0; i < size; ++i) {
      const char c = static_cast<char>(data[i]);
      if (c == '\n') {
        words.push_back(word.c_str());  // up to a NUL, as the C runtime would see it
        word.clear();
      } else {
        word += c;
      }
    }
    if (!word.empty()) words.push_back(word.c_str());
    for (const std::string& w : words) argv.push_back(w.c_str());
    argv.push_back(nullptr);
  }

  int argc() const { return static_cast<int>(words.size()); }
};

}  // namespace weft_fuzz
