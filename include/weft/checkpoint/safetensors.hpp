#pragma once
/// \file
/// Checkpoint files in the safetensors format (the Hugging Face library's, and what GPT-2's
/// published weights use): an 8-byte little-endian header length N, N bytes of JSON
/// (`{"__metadata__": {str: str}, "<name>": {"dtype", "shape", "data_offsets": [begin, end]}, ...}`,
/// padded with spaces to a multiple of 8), then the data buffer, each tensor row-major and
/// little-endian at its offsets. weft writes tensors packed in the order given and the metadata
/// first, as the Rust library does; it reads any file that library accepts, in the dtypes weft has.

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>

#include <weft/checkpoint/detail/file_io.hpp>
#include <weft/core/detail/json.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>

namespace weft::checkpoint {

// Records hold the file's bytes (little-endian) and make_record / values_of copy them as they are.
static_assert(std::endian::native == std::endian::little,
              "weft::checkpoint copies tensor bytes as they are, which is the safetensors layout only on little-endian hosts");

/// One tensor, owning its bytes: element_count(shape) * size_of(type) bytes, row-major, little-endian.
struct tensor_record {
  std::string name;
  weft::dtype type;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};

namespace detail {

// The project's JSON reader and writer (core/detail/json.hpp).
using weft::detail::append_json_string;
using weft::detail::describe;
using weft::detail::json_member;
using weft::detail::json_parser;
using weft::detail::json_syntax_error;
using weft::detail::json_value;
using weft::detail::valid_utf8;

inline std::string shape_text(std::span<const std::int64_t> shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) text += (i != 0 ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

/// Up to `limit` names, quoted and comma-separated, then how many were left out.
inline std::string names_text(const std::vector<std::string_view>& names, std::size_t limit = 20) {
  std::string text;
  for (std::size_t i = 0; i < names.size() && i < limit; ++i) text += (i != 0 ? ", '" : "'") + std::string(names[i]) + "'";
  if (names.size() > limit) text += " and " + std::to_string(names.size() - limit) + " more";
  return text;
}

/// The product of `shape`, or nothing when a dimension is negative or the product overflows.
inline std::optional<std::int64_t> checked_element_count(std::span<const std::int64_t> shape) noexcept {
  std::int64_t count = 1;
  for (std::int64_t dimension : shape) {
    if (dimension < 0 || __builtin_mul_overflow(count, dimension, &count)) return std::nullopt;
  }
  return count;
}

}  // namespace detail

/// The number of elements of a tensor of this shape: the product of its dimensions, so 1 for a
/// scalar (shape []) and 0 when any dimension is 0. Throws weft::error on a negative dimension or overflow.
inline std::int64_t element_count(std::span<const std::int64_t> shape) {
  if (auto count = detail::checked_element_count(shape)) return *count;
  fail("shape " + detail::shape_text(shape) + " has a negative dimension or more elements than fit in 64 bits");
}

/// The safetensors name of a dtype: F32, F64, F16, BF16, I32, I64, U8.
constexpr std::string_view safetensors_name(dtype type) noexcept {
  switch (type) {
    case dtype::float32: return "F32";
    case dtype::float64: return "F64";
    case dtype::float16: return "F16";
    case dtype::bfloat16: return "BF16";
    case dtype::int32: return "I32";
    case dtype::int64: return "I64";
    case dtype::uint8: return "U8";
  }
  return "?";
}

/// The dtype a safetensors name stands for, or nothing for the names weft has no type for
/// (BOOL, I8, I16, U16, U32, U64, the F8 and smaller float formats).
constexpr std::optional<dtype> dtype_from_safetensors_name(std::string_view name) noexcept {
  for (dtype type : {dtype::float32, dtype::float64, dtype::float16, dtype::bfloat16, dtype::int32, dtype::int64, dtype::uint8}) {
    if (safetensors_name(type) == name) return type;
  }
  return std::nullopt;
}

/// What one file holds: string metadata and the tensors in file order.
struct checkpoint_file {
  std::map<std::string, std::string> metadata;
  std::vector<tensor_record> tensors;

  /// The tensor named `name`, or nullptr.
  const tensor_record* find(std::string_view name) const noexcept {
    for (const tensor_record& tensor : tensors) {
      if (tensor.name == name) return &tensor;
    }
    return nullptr;
  }

  /// The tensor named `name`; throws weft::error listing the tensors there are (and those whose
  /// name ends with the one asked for, or the other way round: a missing "transformer." prefix).
  const tensor_record& at(std::string_view name) const {
    if (const tensor_record* tensor = find(name)) return *tensor;
    std::vector<std::string_view> names;
    std::vector<std::string_view> similar;
    for (const tensor_record& tensor : tensors) {
      names.push_back(tensor.name);
      const std::string_view other = tensor.name;
      if (!name.empty() && !other.empty() && (other.ends_with(name) || name.ends_with(other))) similar.push_back(other);
    }
    std::string message = "the checkpoint has no tensor named '" + std::string(name) + "'";
    if (!similar.empty()) message += "; similar names: " + detail::names_text(similar, 5);
    if (names.empty()) {
      message += "; it holds no tensors";
    } else {
      message += "; it holds " + std::to_string(names.size()) + " tensors: " + detail::names_text(names);
    }
    fail(message + "; check the name, or that this is the checkpoint you meant to load");
  }
};

/// A record of `values` with this name and shape; throws weft::error when the shape's element
/// count differs from the number of values.
template <element T>
tensor_record make_record(std::string name, std::vector<std::int64_t> shape, std::span<const T> values) {
  const std::int64_t count = element_count(shape);
  if (static_cast<std::uint64_t>(count) != values.size()) {
    fail("tensor '" + name + "': shape " + detail::shape_text(shape) + " holds " + std::to_string(count) +
         " elements but " + std::to_string(values.size()) + " values were given; pass a shape that matches the values");
  }
  tensor_record record{.name = std::move(name), .type = dtype_of<T>, .shape = std::move(shape), .bytes = {}};
  record.bytes.resize(values.size_bytes());
  if (!values.empty()) std::memcpy(record.bytes.data(), values.data(), values.size_bytes());
  return record;
}

namespace detail {

/// The C++ element type of a dtype, as a reader would write it in values_of<...>.
constexpr std::string_view cpp_type_name(dtype type) noexcept {
  switch (type) {
    case dtype::float32: return "float";
    case dtype::float64: return "double";
    case dtype::float16: return "weft::half";
    case dtype::bfloat16: return "weft::bfloat16";
    case dtype::int32: return "std::int32_t";
    case dtype::int64: return "std::int64_t";
    case dtype::uint8: return "std::uint8_t";
  }
  return "?";
}

/// Throws unless `record.bytes` has the size its shape and dtype call for.
inline void check_record_size(const tensor_record& record) {
  const auto count = checked_element_count(record.shape);
  std::uint64_t expected = 0;
  if (!count || __builtin_mul_overflow(static_cast<std::uint64_t>(*count), size_of(record.type), &expected)) {
    fail("tensor '" + record.name + "': shape " + shape_text(record.shape) +
         " has a negative dimension or too many elements; fix the shape");
  }
  if (record.bytes.size() != expected) {
    fail("tensor '" + record.name + "': shape " + shape_text(record.shape) + " of " +
         std::string(safetensors_name(record.type)) + " needs " + std::to_string(expected) + " bytes but the record holds " +
         std::to_string(record.bytes.size()) + "; build records with make_record or fix the shape");
  }
}

}  // namespace detail

/// The record's values as T; throws weft::error when the record's dtype is not T's (saying which
/// type it holds) or its size does not match its shape.
template <element T>
std::vector<T> values_of(const tensor_record& record) {
  if (record.type != dtype_of<T>) {
    fail("tensor '" + record.name + "' holds " + std::string(safetensors_name(record.type)) + " values, not " +
         std::string(safetensors_name(dtype_of<T>)) + "; read it with values_of<" +
         std::string(detail::cpp_type_name(record.type)) + ">, then convert");
  }
  detail::check_record_size(record);
  std::vector<T> values(record.bytes.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), record.bytes.data(), record.bytes.size());
  return values;
}

namespace detail {

/// The largest header the safetensors library reads (its MAX_HEADER_SIZE).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

/// The header of `file` as written (JSON plus the padding to a multiple of 8), after checking
/// every record; `data_bytes` receives the size of the data buffer. With `bytes_given` false the
/// records' bytes are not there yet (a streamed write): sizes come from shapes and dtypes.
inline std::string header_text(const checkpoint_file& file, std::uint64_t& data_bytes, bool bytes_given = true) {
  std::vector<std::string_view> names;
  names.reserve(file.tensors.size());
  for (const tensor_record& record : file.tensors) {
    if (record.name.empty()) fail("a tensor has an empty name; give every tensor a name");
    if (record.name == "__metadata__") fail("no tensor may be named '__metadata__' (safetensors keeps the metadata under that name); rename it");
    if (!valid_utf8(record.name)) fail("tensor name '" + record.name + "' is not valid UTF-8; safetensors names are UTF-8 text");
    if (bytes_given) check_record_size(record);
    names.push_back(record.name);
  }
  std::sort(names.begin(), names.end());
  if (auto twin = std::adjacent_find(names.begin(), names.end()); twin != names.end()) {
    fail("two tensors are named '" + std::string(*twin) + "'; every tensor in a file needs its own name");
  }
  for (const auto& [key, value] : file.metadata) {
    if (!valid_utf8(key) || !valid_utf8(value)) fail("metadata entry '" + key + "' is not valid UTF-8; metadata is UTF-8 text");
  }

  std::string header = "{";
  if (!file.metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : file.metadata) {
      if (!first) header += ',';
      first = false;
      append_json_string(header, key);
      header += ':';
      append_json_string(header, value);
    }
    header += '}';
  }
  std::uint64_t offset = 0;
  for (const tensor_record& record : file.tensors) {
    if (header.size() > 1) header += ',';
    append_json_string(header, record.name);
    header += ":{\"dtype\":\"";
    header += safetensors_name(record.type);
    header += "\",\"shape\":[";
    for (std::size_t i = 0; i < record.shape.size(); ++i) {
      if (i != 0) header += ',';
      header += std::to_string(record.shape[i]);
    }
    const std::uint64_t end =
        offset + (bytes_given ? record.bytes.size() : static_cast<std::uint64_t>(element_count(record.shape)) * size_of(record.type));
    header += "],\"data_offsets\":[" + std::to_string(offset) + ',' + std::to_string(end) + "]}";
    offset = end;
  }
  header += '}';
  // The data buffer starts 8-byte aligned, as in files the safetensors library writes.
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > max_header_bytes) {
    fail("the header of this checkpoint would take " + std::to_string(header.size()) + " bytes, more than the " +
         std::to_string(max_header_bytes) + " the safetensors library reads; use fewer tensors or shorter names and metadata");
  }
  data_bytes = offset;
  return header;
}

/// Writes `file` to `path` atomically and returns the file's size in bytes.
inline std::uint64_t write_safetensors_file(const std::filesystem::path& path, const checkpoint_file& file) {
  std::uint64_t data_bytes = 0;
  const std::string header = header_text(file, data_bytes);
  std::byte length[8];
  const std::uint64_t header_length = header.size();
  std::memcpy(length, &header_length, sizeof length);
  replace_file_atomically(path, [&](int fd) {
    if (int code = write_all(fd, length); code != 0) return code;
    if (int code = write_all(fd, std::as_bytes(std::span(header))); code != 0) return code;
    for (const tensor_record& record : file.tensors) {
      if (int code = write_all(fd, record.bytes); code != 0) return code;
    }
    return 0;
  });
  return sizeof length + header.size() + data_bytes;
}

/// One tensor's entry while a header is checked.
struct header_entry {
  std::string name;
  dtype type;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::size_t position = 0;  ///< in the header, to keep the header's order among empty tensors at one offset
};

/// Reads and checks one safetensors file; every error names the file.
class safetensors_reader {
 public:
  explicit safetensors_reader(const std::filesystem::path& path) : path_(path) {}

  checkpoint_file read() {
    file_descriptor in;
    std::vector<header_entry> entries;
    checkpoint_file file;
    const std::uint64_t data_start = read_header(in, entries, file.metadata);
    file.tensors.reserve(entries.size());
    for (header_entry& entry : entries) {
      tensor_record record{.name = std::move(entry.name), .type = entry.type, .shape = std::move(entry.shape), .bytes = {}};
      record.bytes.resize(entry.end - entry.begin);
      tensor_ = record.name;
      read_bytes(in.get(), record.bytes, data_start + entry.begin);
      file.tensors.push_back(std::move(record));
    }
    return file;
  }

  /// The checked header alone: entries in file order with offsets made absolute (from the file's start).
  std::vector<header_entry> read_layout(std::map<std::string, std::string>& metadata) {
    file_descriptor in;
    std::vector<header_entry> entries;
    const std::uint64_t data_start = read_header(in, entries, metadata);
    for (header_entry& entry : entries) {
      entry.begin += data_start;
      entry.end += data_start;
    }
    return entries;
  }

 private:
  /// Opens the file into `in`, reads and checks its header; returns where the data buffer starts.
  std::uint64_t read_header(file_descriptor& in, std::vector<header_entry>& entries, std::map<std::string, std::string>& metadata) {
    in = file_descriptor(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
    if (!in.is_open()) {
      const int code = errno;
      refuse("cannot open it: " + errno_text(code) + "; check the path");
    }
    struct stat status {};
    if (::fstat(in.get(), &status) != 0) refuse("cannot stat it: " + errno_text(errno) + "; check the path");
    if (!S_ISREG(status.st_mode)) refuse("it is not a regular file; name a .safetensors file");
    const auto file_bytes = static_cast<std::uint64_t>(status.st_size);

    std::byte length_bytes[8];
    if (file_bytes < sizeof length_bytes) {
      refuse("the file is truncated: it has " + std::to_string(file_bytes) +
             " bytes, fewer than the 8-byte header length; re-save or pick another checkpoint");
    }
    read_bytes(in.get(), length_bytes, 0);
    std::uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, length_bytes, sizeof header_bytes);
    if (header_bytes > file_bytes - sizeof length_bytes) {
      refuse("the file is truncated: header says " + std::to_string(header_bytes) + " bytes, file has " +
             std::to_string(file_bytes) + " (" + std::to_string(file_bytes - sizeof length_bytes) +
             " after the length); re-save or pick another checkpoint");
    }
    if (header_bytes > max_header_bytes) {
      refuse("its header length " + std::to_string(header_bytes) + " is more than the " + std::to_string(max_header_bytes) +
             " bytes safetensors allows; it is not a safetensors file or it is corrupt");
    }
    std::string header(header_bytes, '\0');
    read_bytes(in.get(), std::as_writable_bytes(std::span(header)), sizeof length_bytes);

    entries = parse_header(header, metadata);
    const std::uint64_t data_start = sizeof length_bytes + header_bytes;
    check_offsets(entries, file_bytes - data_start);
    return data_start;
  }

  [[noreturn]] void refuse(const std::string& message) const {
    std::string text = "checkpoint '" + path_.string() + "'";
    if (!tensor_.empty()) text += ", tensor '" + tensor_ + "'";
    fail(text + ": " + message);
  }

  void read_bytes(int fd, std::span<std::byte> bytes, std::uint64_t offset) const {
    const int code = read_exact(fd, bytes, offset);
    if (code == -1) refuse("the file ended while reading it (it shrank while being read?); re-save or pick another checkpoint");
    if (code != 0) refuse("reading " + std::to_string(bytes.size()) + " bytes at offset " + std::to_string(offset) + " failed: " + errno_text(code));
  }

  const json_value* single_member(const json_value& object, std::string_view key) const {
    const json_value* found = nullptr;
    for (const json_member& member : object.members) {
      if (member.key != key) continue;
      if (found != nullptr) refuse("its entry has two '" + std::string(key) + "' fields; re-save the checkpoint");
      found = &member.value;
    }
    return found;
  }

  const json_value& required_member(const json_value& object, std::string_view key, json_value::kind kind) const {
    const json_value* value = single_member(object, key);
    if (value == nullptr) refuse("its entry has no '" + std::string(key) + "' field; re-save the checkpoint");
    if (value->type != kind) {
      refuse("its '" + std::string(key) + "' is " + std::string(describe(value->type)) + ", not " + std::string(describe(kind)) +
             "; re-save the checkpoint");
    }
    return *value;
  }

  std::int64_t non_negative_integer(const json_value& value, std::string_view what) const {
    if (value.type != json_value::kind::number || !value.integer || *value.integer < 0) {
      const std::string shown = value.type == json_value::kind::number ? value.text : std::string(describe(value.type));
      refuse(std::string(what) + " holds " + shown + ", not a non-negative integer; re-save the checkpoint");
    }
    return *value.integer;
  }

  std::vector<header_entry> parse_header(const std::string& header, std::map<std::string, std::string>& metadata) {
    json_value root;
    try {
      root = json_parser::parse(header);
    } catch (const json_syntax_error& e) {
      refuse("its header is not valid JSON: at byte " + std::to_string(e.offset()) + " of the header: " + e.what() +
             "; it is not a safetensors file or it is corrupt");
    }
    if (root.type != json_value::kind::object) {
      refuse("its header is " + std::string(describe(root.type)) + ", not a JSON object; it is not a safetensors file");
    }
    std::vector<std::string_view> names;
    for (const json_member& member : root.members) names.push_back(member.key);
    std::sort(names.begin(), names.end());
    if (auto twin = std::adjacent_find(names.begin(), names.end()); twin != names.end()) {
      if (*twin == "__metadata__") refuse("its header has two '__metadata__' entries; re-save the checkpoint");
      refuse("two tensors are named '" + std::string(*twin) + "'; re-save the checkpoint with distinct names");
    }

    std::vector<header_entry> entries;
    for (const json_member& member : root.members) {
      if (member.key == "__metadata__") {
        if (member.value.type != json_value::kind::object) {
          refuse("its '__metadata__' is " + std::string(describe(member.value.type)) + ", not an object of strings; re-save the checkpoint");
        }
        for (const json_member& item : member.value.members) {
          if (item.value.type != json_value::kind::string) {
            refuse("metadata entry '" + item.key + "' is " + std::string(describe(item.value.type)) +
                   "; safetensors metadata values are strings: re-save with the value as a string");
          }
          if (!metadata.emplace(item.key, item.value.text).second) {
            refuse("metadata entry '" + item.key + "' appears twice; re-save the checkpoint");
          }
        }
        continue;
      }
      tensor_ = member.key;
      if (member.value.type != json_value::kind::object) {
        refuse("its entry is " + std::string(describe(member.value.type)) + ", not an object with dtype, shape and data_offsets; re-save the checkpoint");
      }
      header_entry entry;
      entry.name = member.key;
      entry.position = entries.size();
      const std::string& dtype_name = required_member(member.value, "dtype", json_value::kind::string).text;
      const auto type = dtype_from_safetensors_name(dtype_name);
      if (!type) {
        refuse("dtype '" + dtype_name + "' is not one weft reads (F32, F64, F16, BF16, I32, I64, U8); convert the tensor to one of them before saving");
      }
      entry.type = *type;
      for (const json_value& dimension : required_member(member.value, "shape", json_value::kind::array).items) {
        entry.shape.push_back(non_negative_integer(dimension, "a dimension of its shape"));
      }
      const auto& offsets = required_member(member.value, "data_offsets", json_value::kind::array).items;
      if (offsets.size() != 2) {
        refuse("its data_offsets has " + std::to_string(offsets.size()) + " numbers, not 2 ([begin, end]); re-save the checkpoint");
      }
      entry.begin = static_cast<std::uint64_t>(non_negative_integer(offsets[0], "data_offsets"));
      entry.end = static_cast<std::uint64_t>(non_negative_integer(offsets[1], "data_offsets"));
      if (entry.end < entry.begin) {
        refuse("its data_offsets [" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) +
               "] end before they begin; re-save the checkpoint");
      }
      const auto count = checked_element_count(entry.shape);
      std::uint64_t needed = 0;
      if (!count || __builtin_mul_overflow(static_cast<std::uint64_t>(*count), size_of(entry.type), &needed)) {
        refuse("shape " + shape_text(entry.shape) + " has more elements than fit in 64 bits; re-save the checkpoint");
      }
      if (needed != entry.end - entry.begin) {
        refuse("shape " + shape_text(entry.shape) + " of " + dtype_name + " needs " + std::to_string(needed) +
               " bytes but data_offsets [" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) + "] span " +
               std::to_string(entry.end - entry.begin) + "; the header is inconsistent: re-save or pick another checkpoint");
      }
      entries.push_back(std::move(entry));
      tensor_.clear();
    }
    return entries;
  }

  /// Puts the entries in file order and checks that they tile the data buffer exactly: no
  /// overlap, no gap, nothing past its end, nothing after the last tensor.
  void check_offsets(std::vector<header_entry>& entries, std::uint64_t buffer_bytes) {
    std::sort(entries.begin(), entries.end(), [](const header_entry& a, const header_entry& b) {
      if (a.begin != b.begin) return a.begin < b.begin;
      if (a.end != b.end) return a.end < b.end;
      return a.position < b.position;
    });
    std::uint64_t covered = 0;
    const header_entry* previous = nullptr;  // the last tensor with bytes
    for (const header_entry& entry : entries) {
      tensor_ = entry.name;
      const std::string range = "[" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) + ")";
      if (entry.begin < covered) {
        refuse("its bytes " + range + " overlap those of tensor '" + previous->name + "' [" + std::to_string(previous->begin) +
               ", " + std::to_string(previous->end) + "); the header is corrupt: re-save or pick another checkpoint");
      }
      if (entry.begin > covered) {
        refuse("bytes [" + std::to_string(covered) + ", " + std::to_string(entry.begin) +
               ") of the data buffer belong to no tensor (safetensors files are packed); re-save or pick another checkpoint");
      }
      if (entry.end > buffer_bytes) {
        refuse("the file is truncated: the tensor's bytes " + range + " end past the data buffer's " +
               std::to_string(buffer_bytes) + " bytes; re-save or pick another checkpoint");
      }
      covered = entry.end;
      if (entry.end > entry.begin) previous = &entry;
    }
    tensor_.clear();
    if (covered < buffer_bytes) {
      refuse("the file is truncated or corrupt: its tensors end at byte " + std::to_string(covered) + " of the data buffer, " +
             "but " + std::to_string(buffer_bytes - covered) + " more bytes follow; re-save or pick another checkpoint");
    }
  }

  std::filesystem::path path_;
  std::string tensor_;  ///< the tensor being checked, for messages
};

}  // namespace detail

/// Writes `file` to `path` atomically: the bytes go to `path.tmp-<pid>`, which is fsynced and
/// renamed over `path`, then the directory is fsynced. On any failure the previous file at
/// `path` is untouched, the temporary file is removed, and weft::error says what failed. Checks
/// first that every record's size matches its shape and that names are unique.
/// One writer per path at a time (the temporary name is per process).
inline void write_safetensors(const std::filesystem::path& path, const checkpoint_file& file) {
  detail::write_safetensors_file(path, file);
}

/// Writes a safetensors file atomically without holding its tensors: `file` gives the metadata and
/// each tensor's name, dtype and shape (its bytes empty), and `produce(i, write)` hands tensor i's
/// bytes, in order, to `write` in as many parts as it likes (`write` throws on a failed write).
/// Throws weft::error when a tensor gets more or fewer bytes than its shape needs; on any failure
/// the previous file at `path` is untouched. Returns the file's size.
inline std::uint64_t write_safetensors_streamed(
    const std::filesystem::path& path, const checkpoint_file& file,
    const std::function<void(std::size_t, const std::function<void(std::span<const std::byte>)>&)>& produce) {
  std::uint64_t data_bytes = 0;
  const std::string header = detail::header_text(file, data_bytes, false);
  std::byte length[8];
  const std::uint64_t header_length = header.size();
  std::memcpy(length, &header_length, sizeof length);
  std::exception_ptr failure;
  try {
    detail::replace_file_atomically(path, [&](int fd) {
      try {
        auto check = [](int code) {
          if (code != 0) throw code;
        };
        check(detail::write_all(fd, length));
        check(detail::write_all(fd, std::as_bytes(std::span(header))));
        for (std::size_t i = 0; i < file.tensors.size(); ++i) {
          const tensor_record& t = file.tensors[i];
          const std::uint64_t expected = static_cast<std::uint64_t>(element_count(t.shape)) * size_of(t.type);
          std::uint64_t written = 0;
          produce(i, [&](std::span<const std::byte> bytes) {
            if (written + bytes.size() > expected) fail("tensor '" + t.name + "' was given more than its " + std::to_string(expected) + " bytes");
            check(detail::write_all(fd, bytes));
            written += bytes.size();
          });
          if (written != expected) {
            fail("tensor '" + t.name + "' was given " + std::to_string(written) + " of its " + std::to_string(expected) + " bytes");
          }
        }
        return 0;
      } catch (int code) {
        return code;
      } catch (...) {
        failure = std::current_exception();
        return EIO;
      }
    });
  } catch (...) {
    if (failure) std::rethrow_exception(failure);  // the producer's own error, not the EIO standing for it
    throw;
  }
  return sizeof length + header.size() + data_bytes;
}

/// One tensor of a safetensors file, located but not read: its bytes are [begin, end) counted
/// from the start of the file.
struct safetensors_entry {
  std::string name;
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// A safetensors file's checked header: its metadata and where each tensor lies, in file order.
struct safetensors_layout {
  std::map<std::string, std::string> metadata;
  std::vector<safetensors_entry> tensors;
};

/// Reads and checks only the header of a safetensors file (every check read_safetensors makes
/// except reading the data), so a reader can then fetch just the byte ranges it needs.
inline safetensors_layout read_safetensors_layout(const std::filesystem::path& path) {
  safetensors_layout layout;
  for (detail::header_entry& entry : detail::safetensors_reader(path).read_layout(layout.metadata)) {
    layout.tensors.push_back({std::move(entry.name), entry.type, std::move(entry.shape), entry.begin, entry.end});
  }
  return layout;
}

/// Reads a safetensors file, checking everything (header length against the file size, JSON,
/// dtype names, each shape against its offsets, offsets packed in order and within the file,
/// duplicate names); a refused file gives weft::error naming the file, the tensor and what to do.
/// Tensors come in file order (by offset).
inline checkpoint_file read_safetensors(const std::filesystem::path& path) {
  return detail::safetensors_reader(path).read();
}

}  // namespace weft::checkpoint
