#pragma once
/// \file
/// The little JSON that flight-recorder dumps need: string escaping for the writer, and a strict
/// parser for the reader (weft-trace-diff), which reports where a file stops being JSON.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <weft/core/error.hpp>

namespace weft::trace::detail {

/// `text` as a JSON string literal, quotes included.
inline std::string json_quote(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          static constexpr char hex[] = "0123456789abcdef";
          out += "\\u00";
          out += hex[(c >> 4) & 0xf];
          out += hex[c & 0xf];
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

struct json_value;
using json_object = std::map<std::string, json_value, std::less<>>;
using json_array = std::vector<json_value>;

/// A parsed value. Numbers keep their text as well, so 64-bit integers survive exactly.
struct json_value {
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<json_array>, std::shared_ptr<json_object>>
      value;
  std::string number_text;

  bool is_object() const noexcept { return std::holds_alternative<std::shared_ptr<json_object>>(value); }
  bool is_array() const noexcept { return std::holds_alternative<std::shared_ptr<json_array>>(value); }
  bool is_string() const noexcept { return std::holds_alternative<std::string>(value); }
  bool is_number() const noexcept { return std::holds_alternative<double>(value); }
  const json_object& object() const { return *std::get<std::shared_ptr<json_object>>(value); }
  const json_array& array() const { return *std::get<std::shared_ptr<json_array>>(value); }
  const std::string& string() const { return std::get<std::string>(value); }
  double number() const { return std::get<double>(value); }
};

class json_parser {
 public:
  explicit json_parser(std::string_view text) : text_(text) {}

  json_value parse_document() {
    json_value v = parse_value(0);
    skip_space();
    if (at_ < text_.size()) fail_here("unexpected text after the JSON value");
    return v;
  }

 private:
  static constexpr int deepest = 64;

  [[noreturn]] void fail_here(const std::string& what) const {
    std::size_t line = 1;
    for (std::size_t i = 0; i < at_ && i < text_.size(); ++i) line += text_[i] == '\n' ? 1 : 0;
    throw error("not valid JSON: " + what + " at line " + std::to_string(line) + " (byte " + std::to_string(at_) + ")");
  }

  void skip_space() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\n' || text_[at_] == '\t' || text_[at_] == '\r'))
      ++at_;
  }

  bool take(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  json_value parse_value(int depth) {
    if (depth > deepest) fail_here("nesting deeper than 64 levels");
    skip_space();
    if (at_ >= text_.size()) fail_here("the text ends where a value should be");
    const char c = text_[at_];
    json_value v;
    if (c == '{') {
      ++at_;
      auto object = std::make_shared<json_object>();
      skip_space();
      if (!take("}")) {
        for (;;) {
          skip_space();
          if (at_ >= text_.size() || text_[at_] != '"') fail_here("expected a quoted key");
          std::string key = parse_string();
          skip_space();
          if (!take(":")) fail_here("expected ':' after a key");
          (*object)[key] = parse_value(depth + 1);
          skip_space();
          if (take("}")) break;
          if (!take(",")) fail_here("expected ',' or '}' in an object");
        }
      }
      v.value = std::move(object);
    } else if (c == '[') {
      ++at_;
      auto array = std::make_shared<json_array>();
      skip_space();
      if (!take("]")) {
        for (;;) {
          array->push_back(parse_value(depth + 1));
          skip_space();
          if (take("]")) break;
          if (!take(",")) fail_here("expected ',' or ']' in an array");
        }
      }
      v.value = std::move(array);
    } else if (c == '"') {
      v.value = parse_string();
    } else if (take("true")) {
      v.value = true;
    } else if (take("false")) {
      v.value = false;
    } else if (take("null")) {
      v.value = nullptr;
    } else {
      const std::size_t start = at_;
      if (at_ < text_.size() && text_[at_] == '-') ++at_;
      while (at_ < text_.size() && std::string_view("0123456789.eE+-").find(text_[at_]) != std::string_view::npos) ++at_;
      if (at_ == start) fail_here(std::string("unexpected character '") + c + "'");
      v.number_text = std::string(text_.substr(start, at_ - start));
      char* end = nullptr;
      const double number = std::strtod(v.number_text.c_str(), &end);
      if (end != v.number_text.c_str() + v.number_text.size()) fail_here("malformed number '" + v.number_text + "'");
      v.value = number;
    }
    return v;
  }

  std::string parse_string() {
    ++at_;  // the opening quote
    std::string out;
    while (at_ < text_.size() && text_[at_] != '"') {
      char c = text_[at_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= text_.size()) break;
      const char escaped = text_[at_++];
      switch (escaped) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (at_ + 4 > text_.size()) fail_here("truncated \\u escape");
          const unsigned long code = std::strtoul(std::string(text_.substr(at_, 4)).c_str(), nullptr, 16);
          at_ += 4;
          out += code < 0x80 ? static_cast<char>(code) : '?';  // dumps only escape control characters
          break;
        }
        default: out += escaped;
      }
    }
    if (at_ >= text_.size()) fail_here("a string is not closed");
    ++at_;  // the closing quote
    return out;
  }

  std::string_view text_;
  std::size_t at_ = 0;
};

inline json_value parse_json(std::string_view text) { return json_parser(text).parse_document(); }

}  // namespace weft::trace::detail
