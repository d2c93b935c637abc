#pragma once
/// \file
/// weft's one JSON reader and string writer, for the files it reads and writes (safetensors
/// headers, flight-recorder dumps, hardware descriptions): a parser for one document (objects
/// keep their members in order, duplicates included, so a caller can name a duplicate; numbers
/// keep their text and, when they are integers that fit, their value) and RFC 8259 string
/// escaping, matching what Python's `json` and Rust's `serde_json` read and write (a byte-exact
/// safetensors header needs that).

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace weft::detail {

struct json_member;

/// One parsed JSON value.
struct json_value {
  enum class kind { null, boolean, number, string, array, object };
  kind type = kind::null;
  bool boolean = false;
  std::string text;                     ///< a string's value, or a number's literal text
  std::optional<std::int64_t> integer;  ///< a number without fraction or exponent that fits int64
  std::vector<json_value> items;        ///< an array's elements
  std::vector<json_member> members;     ///< an object's members, in document order
};

struct json_member {
  std::string key;
  json_value value;
};

/// What kind of value this is, in words, for error messages.
inline std::string_view describe(json_value::kind kind) noexcept {
  switch (kind) {
    case json_value::kind::null: return "null";
    case json_value::kind::boolean: return "a boolean";
    case json_value::kind::number: return "a number";
    case json_value::kind::string: return "a string";
    case json_value::kind::array: return "an array";
    case json_value::kind::object: return "an object";
  }
  return "?";
}

/// A syntax error: where (byte offset in the text) and what was expected.
class json_syntax_error : public std::runtime_error {
 public:
  json_syntax_error(std::size_t offset, const std::string& message)
      : std::runtime_error(message), offset_(offset) {}
  std::size_t offset() const noexcept { return offset_; }

 private:
  std::size_t offset_;
};

/// Whether `text` is well-formed UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF).
/// Rust's safetensors reads the header as UTF-8 and refuses anything else.
inline bool valid_utf8(std::string_view text) noexcept {
  std::size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    std::size_t length = 0;
    std::uint32_t code = 0;
    std::uint32_t minimum = 0;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if ((lead & 0xe0) == 0xc0) {
      length = 2, code = lead & 0x1fu, minimum = 0x80;
    } else if ((lead & 0xf0) == 0xe0) {
      length = 3, code = lead & 0x0fu, minimum = 0x800;
    } else if ((lead & 0xf8) == 0xf0) {
      length = 4, code = lead & 0x07u, minimum = 0x10000;
    } else {
      return false;
    }
    if (text.size() - i < length) return false;
    for (std::size_t k = 1; k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next & 0xc0) != 0x80) return false;
      code = (code << 6) | (next & 0x3fu);
    }
    if (code < minimum || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) return false;
    i += length;
  }
  return true;
}

/// Appends `text` as a JSON string literal: `"` and `\` escaped, control characters as `\n`-style
/// short escapes where JSON has one and `\u00xx` otherwise, everything else (UTF-8 included) as is.
inline void append_json_string(std::string& out, std::string_view text) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (byte < 0x20) {
          out += "\\u00";
          out += hex[byte >> 4];
          out += hex[byte & 0xf];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

/// Parses one JSON document; whitespace may follow it (safetensors pads its header with spaces).
/// Throws json_syntax_error. Nesting is limited so a hostile file cannot exhaust the stack.
class json_parser {
 public:
  static json_value parse(std::string_view text) {
    json_parser parser(text);
    parser.skip_whitespace();
    json_value value = parser.parse_value(0);
    parser.skip_whitespace();
    if (parser.position_ != text.size()) parser.error("unexpected '" + parser.shown(parser.peek()) + "' after the end of the JSON value");
    return value;
  }

 private:
  static constexpr int max_depth = 64;

  explicit json_parser(std::string_view text) : text_(text) {}

  [[noreturn]] void error(const std::string& message) const { throw json_syntax_error(position_, message); }

  bool at_end() const noexcept { return position_ >= text_.size(); }
  char peek() const noexcept { return at_end() ? '\0' : text_[position_]; }

  std::string shown(char c) const {
    if (at_end()) return "end of text";
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte >= 0x7f) {
      static constexpr char hex[] = "0123456789abcdef";
      return std::string("\\x") + hex[byte >> 4] + hex[byte & 0xf];
    }
    return std::string(1, c);
  }

  void skip_whitespace() noexcept {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++position_;
  }

  void expect(char c) {
    if (peek() != c || at_end()) error(std::string("expected '") + c + "', found '" + shown(peek()) + "'");
    ++position_;
  }

  json_value parse_value(int depth) {
    if (depth > max_depth) error("nesting deeper than " + std::to_string(max_depth) + " levels");
    if (at_end()) error("expected a value, found the end of the text");
    json_value value;
    switch (peek()) {
      case '{': parse_object(value, depth); break;
      case '[': parse_array(value, depth); break;
      case '"':
        value.type = json_value::kind::string;
        value.text = parse_string();
        break;
      case 't':
        parse_literal("true");
        value.type = json_value::kind::boolean;
        value.boolean = true;
        break;
      case 'f':
        parse_literal("false");
        value.type = json_value::kind::boolean;
        break;
      case 'n': parse_literal("null"); break;
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) {
          parse_number(value);
        } else {
          error("expected a value, found '" + shown(peek()) + "'");
        }
    }
    return value;
  }

  void parse_literal(std::string_view word) {
    if (text_.substr(position_, word.size()) != word) error("expected '" + std::string(word) + "'");
    position_ += word.size();
  }

  void parse_object(json_value& value, int depth) {
    value.type = json_value::kind::object;
    expect('{');
    skip_whitespace();
    if (peek() == '}' && !at_end()) {
      ++position_;
      return;
    }
    while (true) {
      skip_whitespace();
      if (peek() != '"' || at_end()) error("expected a member name in quotes, found '" + shown(peek()) + "'");
      json_member member;
      member.key = parse_string();
      skip_whitespace();
      expect(':');
      skip_whitespace();
      member.value = parse_value(depth + 1);
      value.members.push_back(std::move(member));
      skip_whitespace();
      if (peek() == ',' && !at_end()) {
        ++position_;
        continue;
      }
      expect('}');
      return;
    }
  }

  void parse_array(json_value& value, int depth) {
    value.type = json_value::kind::array;
    expect('[');
    skip_whitespace();
    if (peek() == ']' && !at_end()) {
      ++position_;
      return;
    }
    while (true) {
      skip_whitespace();
      value.items.push_back(parse_value(depth + 1));
      skip_whitespace();
      if (peek() == ',' && !at_end()) {
        ++position_;
        continue;
      }
      expect(']');
      return;
    }
  }

  void parse_number(json_value& value) {
    value.type = json_value::kind::number;
    const std::size_t start = position_;
    bool integral = true;
    if (peek() == '-') ++position_;
    if (peek() == '0') {
      ++position_;
    } else if (peek() >= '1' && peek() <= '9') {
      while (!at_end() && peek() >= '0' && peek() <= '9') ++position_;
    } else {
      error("expected a digit in a number, found '" + shown(peek()) + "'");
    }
    if (!at_end() && peek() == '.') {
      integral = false;
      ++position_;
      if (at_end() || peek() < '0' || peek() > '9') error("expected a digit after '.' in a number");
      while (!at_end() && peek() >= '0' && peek() <= '9') ++position_;
    }
    if (!at_end() && (peek() == 'e' || peek() == 'E')) {
      integral = false;
      ++position_;
      if (!at_end() && (peek() == '+' || peek() == '-')) ++position_;
      if (at_end() || peek() < '0' || peek() > '9') error("expected a digit in a number's exponent");
      while (!at_end() && peek() >= '0' && peek() <= '9') ++position_;
    }
    value.text = std::string(text_.substr(start, position_ - start));
    if (integral) {
      std::int64_t parsed = 0;
      const char* first = value.text.data();
      const char* last = first + value.text.size();
      if (auto [end, code] = std::from_chars(first, last, parsed); code == std::errc() && end == last) value.integer = parsed;
    }
  }

  unsigned parse_hex4() {
    if (text_.size() - position_ < 4) error("expected four hex digits after \\u");
    unsigned code = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = text_[position_++];
      code <<= 4;
      if (c >= '0' && c <= '9') code |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') code |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') code |= static_cast<unsigned>(c - 'A' + 10);
      else error("expected four hex digits after \\u");
    }
    return code;
  }

  static void append_utf8(std::string& out, std::uint32_t code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xc0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xe0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    }
  }

  std::string parse_string() {
    const std::size_t start = position_;
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) {
        position_ = start;
        error("a string that starts here is not closed");
      }
      const char c = text_[position_];
      if (c == '"') {
        ++position_;
        break;
      }
      if (static_cast<unsigned char>(c) < 0x20) error("a control character (" + shown(c) + ") inside a string must be escaped");
      if (c != '\\') {
        out += c;
        ++position_;
        continue;
      }
      ++position_;
      if (at_end()) error("a string ends inside an escape");
      const char escape = text_[position_++];
      switch (escape) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t code = parse_hex4();
          if (code >= 0xdc00 && code <= 0xdfff) error("a \\u escape holds a lone low surrogate");
          if (code >= 0xd800 && code <= 0xdbff) {
            if (text_.substr(position_, 2) != "\\u") error("a \\u escape holds a high surrogate without its low half");
            position_ += 2;
            const std::uint32_t low = parse_hex4();
            if (low < 0xdc00 || low > 0xdfff) error("a \\u escape holds a high surrogate without its low half");
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
          }
          append_utf8(out, code);
          break;
        }
        default:
          --position_;
          error("unknown escape '\\" + shown(escape) + "' in a string");
      }
    }
    if (!valid_utf8(out)) {
      position_ = start;
      error("a string is not valid UTF-8");
    }
    return out;
  }

  std::string_view text_;
  std::size_t position_ = 0;
};

/// The first member named `key` of an object; nullptr when it has none or is not an object.
inline const json_value* find_member(const json_value& object, std::string_view key) noexcept {
  if (object.type != json_value::kind::object) return nullptr;
  for (const json_member& member : object.members)
    if (member.key == key) return &member.value;
  return nullptr;
}

/// A number's value as a double (the parser checked its literal).
inline double number_value(const json_value& number) { return std::strtod(number.text.c_str(), nullptr); }

/// `text` as a JSON string literal, quotes included.
inline std::string json_string(std::string_view text) {
  std::string out;
  append_json_string(out, text);
  return out;
}

}  // namespace weft::detail
