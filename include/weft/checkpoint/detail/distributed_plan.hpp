#pragma once
/// \file
/// The pure part of distributed checkpoints: regions of tensors, which rank writes which piece,
/// which saved pieces a reader needs for a region, and the index's JSON. No files, no threads,
/// no communication, so every decision is tested on its own.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <weft/checkpoint/safetensors.hpp>
#include <weft/core/detail/json.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>

namespace weft::checkpoint {

/// A box of a tensor: in each dimension, the first index and how many indices follow. A scalar
/// (shape []) has one region, with no dimensions.
struct region {
  std::vector<std::int64_t> offset;
  std::vector<std::int64_t> extent;

  friend bool operator==(const region&, const region&) = default;
  friend auto operator<=>(const region&, const region&) = default;
};

/// The whole of a tensor of this shape.
inline region whole_region(std::span<const std::int64_t> shape) {
  return {std::vector<std::int64_t>(shape.size(), 0), std::vector<std::int64_t>(shape.begin(), shape.end())};
}

/// The number of elements of `r`.
inline std::int64_t element_count(const region& r) { return element_count(std::span<const std::int64_t>(r.extent)); }

/// "[0:4, 8:12]": the region's index ranges, for messages and piece names.
inline std::string region_text(const region& r) {
  std::string text = "[";
  for (std::size_t d = 0; d < r.offset.size(); ++d) {
    text += (d != 0 ? ", " : "") + std::to_string(r.offset[d]) + ":" + std::to_string(r.offset[d] + r.extent[d]);
  }
  return text + "]";
}

/// Where `a` and `b` overlap, or nothing (also when either is empty).
inline std::optional<region> intersection(const region& a, const region& b) {
  region both;
  for (std::size_t d = 0; d < a.offset.size(); ++d) {
    const std::int64_t begin = std::max(a.offset[d], b.offset[d]);
    const std::int64_t end = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    if (end <= begin) return std::nullopt;
    both.offset.push_back(begin);
    both.extent.push_back(end - begin);
  }
  return both;
}

/// Elements [begin, end) of `within` in its row-major order, as the fewest regions that tile
/// them (at most 2 per dimension, plus 1): how a ZeRO or FSDP shard, a run of the flattened
/// (tp-local) tensor, becomes pieces of the global tensor.
inline std::vector<region> regions_of_flat_range(const region& within, std::int64_t begin, std::int64_t end) {
  const std::int64_t total = element_count(within);
  if (begin < 0 || end < begin || end > total) {
    fail("elements [" + std::to_string(begin) + ", " + std::to_string(end) + ") are not a range of the " +
         std::to_string(total) + " elements of region " + region_text(within));
  }
  std::vector<region> out;
  if (begin == end) return out;
  if (within.extent.empty()) return {within};
  // Recursive on the leading dimension: a partial first block, whole blocks, a partial last block.
  const std::int64_t inner = total / within.extent[0];
  region rest{{within.offset.begin() + 1, within.offset.end()}, {within.extent.begin() + 1, within.extent.end()}};
  auto with_leading = [&](std::int64_t index, std::int64_t count, region tail) {
    tail.offset.insert(tail.offset.begin(), within.offset[0] + index);
    tail.extent.insert(tail.extent.begin(), count);
    out.push_back(std::move(tail));
  };
  std::int64_t first = begin / inner;
  const std::int64_t last = end / inner;  // the block that holds `end` (exclusive)
  if (begin % inner != 0) {
    const std::int64_t stop = first == last ? end % inner : inner;
    for (region& part : regions_of_flat_range(rest, begin % inner, stop)) with_leading(first, 1, std::move(part));
    if (first == last) return out;
    ++first;
  }
  if (last > first) with_leading(first, last - first, rest);
  if (end % inner != 0) {
    for (region& part : regions_of_flat_range(rest, 0, end % inner)) with_leading(last, 1, std::move(part));
  }
  return out;
}

/// What a rank declares it holds: a region of the global tensor `name`.
struct piece_declaration {
  std::string name;
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;  ///< the global tensor's
  region part;
};

/// Which rank writes which piece: each distinct (tensor, region) is written once, by one of the
/// ranks that declared it.
struct write_plan {
  /// For each rank, the indices (into that rank's declarations) of the pieces it writes.
  std::vector<std::vector<std::size_t>> written_by;
  /// For each rank, the bytes it writes.
  std::vector<std::uint64_t> bytes_of;
  /// Every tensor once, in the order of first declaration (rank 0's first), with its
  /// global shape and dtype.
  std::vector<piece_declaration> tensors;
};

namespace detail {

inline std::uint64_t piece_bytes(const piece_declaration& p) {
  return static_cast<std::uint64_t>(element_count(p.part)) * size_of(p.type);
}

}  // namespace detail

/// Plans a save from every rank's declarations (`by_rank[r]` is rank r's): checks that the ranks
/// agree on each tensor's dtype and shape, that every region lies in its tensor, that two
/// distinct regions of a tensor never overlap (replicas declare the same region) and that the
/// regions cover each tensor; then gives each distinct piece to one of its holders, the
/// biggest pieces first, each to the holder with the fewest bytes so far (ties: the lower
/// rank), so that the writers stay balanced. Deterministic: every rank computes the same plan.
/// Throws weft::error naming the tensor, the ranks and the regions.
inline write_plan plan_writers(const std::vector<std::vector<piece_declaration>>& by_rank) {
  const int ranks = static_cast<int>(by_rank.size());
  write_plan plan;
  plan.written_by.resize(by_rank.size());
  plan.bytes_of.assign(by_rank.size(), 0);

  struct holder {
    int rank;
    std::size_t index;
  };
  struct tensor_pieces {
    std::size_t first;   // in plan.tensors
    int first_rank;
    std::map<region, std::vector<holder>> pieces;
  };
  std::map<std::string, tensor_pieces, std::less<>> tensors;
  for (int rank = 0; rank < ranks; ++rank) {
    for (std::size_t i = 0; i < by_rank[rank].size(); ++i) {
      const piece_declaration& p = by_rank[rank][i];
      const std::string where = "rank " + std::to_string(rank) + "'s piece " + region_text(p.part) + " of tensor '" + p.name + "'";
      if (p.part.offset.size() != p.shape.size() || p.part.extent.size() != p.shape.size()) {
        fail(where + " has " + std::to_string(p.part.offset.size()) + " dimensions, but the tensor's shape " +
             detail::shape_text(p.shape) + " has " + std::to_string(p.shape.size()) + "; declare the region in the global tensor's dimensions");
      }
      for (std::size_t d = 0; d < p.shape.size(); ++d) {
        if (p.part.offset[d] < 0 || p.part.extent[d] < 0 || p.part.offset[d] + p.part.extent[d] > p.shape[d]) {
          fail(where + " does not lie inside the tensor's shape " + detail::shape_text(p.shape) + " (dimension " + std::to_string(d) +
               "); declare regions of the global tensor");
        }
      }
      auto [it, fresh] = tensors.try_emplace(p.name, tensor_pieces{plan.tensors.size(), rank, {}});
      if (fresh) {
        plan.tensors.push_back({p.name, p.type, p.shape, whole_region(p.shape)});
      } else {
        const piece_declaration& known = plan.tensors[it->second.first];
        if (known.type != p.type || known.shape != p.shape) {
          fail("tensor '" + p.name + "' is " + std::string(safetensors_name(p.type)) + " " + detail::shape_text(p.shape) + " on rank " +
               std::to_string(rank) + " but " + std::string(safetensors_name(known.type)) + " " + detail::shape_text(known.shape) +
               " on rank " + std::to_string(it->second.first_rank) + "; every rank must declare a tensor's global shape and dtype alike");
        }
      }
      if (element_count(p.part) == 0) continue;  // holds nothing (an uneven split's empty share): nothing to write
      std::vector<holder>& holders = it->second.pieces[p.part];
      if (!holders.empty() && holders.back().rank == rank) {
        fail(where + " is declared twice by that rank; declare each piece once");
      }
      holders.push_back({rank, i});
    }
  }

  struct distinct_piece {
    std::uint64_t bytes;
    std::string_view name;
    const region* part;
    const std::vector<holder>* holders;
  };
  std::vector<distinct_piece> distinct;
  for (const auto& [name, t] : tensors) {
    const piece_declaration& tensor = plan.tensors[t.first];
    std::int64_t covered = 0;
    for (auto a = t.pieces.begin(); a != t.pieces.end(); ++a) {
      covered += element_count(a->first);
      for (auto b = std::next(a); b != t.pieces.end(); ++b) {
        if (element_count(a->first) > 0 && element_count(b->first) > 0 && intersection(a->first, b->first)) {
          fail("tensor '" + name + "': rank " + std::to_string(a->second.front().rank) + "'s piece " + region_text(a->first) +
               " overlaps rank " + std::to_string(b->second.front().rank) + "'s piece " + region_text(b->first) +
               " without being the same region; replicas must declare the same region, and distinct pieces must not overlap");
        }
      }
      distinct.push_back({static_cast<std::uint64_t>(element_count(a->first)) * size_of(tensor.type), name, &a->first, &a->second});
    }
    const std::int64_t total = element_count(std::span<const std::int64_t>(tensor.shape));
    if (covered != total) {
      fail("tensor '" + name + "' " + detail::shape_text(tensor.shape) + ": the ranks' pieces cover " + std::to_string(covered) +
           " of its " + std::to_string(total) + " elements; every element must be held by some rank");
    }
  }
  std::stable_sort(distinct.begin(), distinct.end(), [](const distinct_piece& a, const distinct_piece& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    if (a.name != b.name) return a.name < b.name;
    return *a.part < *b.part;
  });
  for (const distinct_piece& piece : distinct) {
    const holder* best = nullptr;
    for (const holder& h : *piece.holders) {
      if (best == nullptr || plan.bytes_of[h.rank] < plan.bytes_of[best->rank]) best = &h;
    }
    plan.written_by[best->rank].push_back(best->index);
    plan.bytes_of[best->rank] += piece.bytes;
  }
  for (auto& indices : plan.written_by) std::sort(indices.begin(), indices.end());
  return plan;
}

/// One saved piece, as the index lists it.
struct saved_piece {
  std::string file;  ///< the safetensors file in the checkpoint directory
  std::string key;   ///< the piece's tensor name in that file
  region part;       ///< where it lies in the global tensor
  std::uint32_t crc32 = 0;
};

/// One tensor of a distributed checkpoint.
struct saved_tensor {
  std::string name;
  dtype type = dtype::float32;
  std::vector<std::int64_t> shape;
  std::vector<saved_piece> pieces;
};

/// One rank's file.
struct saved_file {
  int rank = 0;
  std::string file;
  std::uint64_t bytes = 0;
};

/// What index.json says.
struct checkpoint_index {
  std::string model;
  std::int64_t step = 0;
  std::map<std::string, std::int64_t> data_position;
  std::map<std::string, std::int64_t> layout;
  std::vector<saved_file> files;
  std::vector<saved_tensor> tensors;

  const saved_tensor* find(std::string_view name) const noexcept {
    for (const saved_tensor& t : tensors) {
      if (t.name == name) return &t;
    }
    return nullptr;
  }
};

inline constexpr std::string_view index_format_name = "weft.distributed_checkpoint";
inline constexpr std::int64_t index_format_version = 1;

/// The piece's name inside its rank's file: the tensor's name and the region's first index,
/// "h.0.mlp.c_fc.weight@0,1536".
inline std::string piece_key(std::string_view name, const region& part) {
  std::string key(name);
  key += '@';
  for (std::size_t d = 0; d < part.offset.size(); ++d) key += (d != 0 ? "," : "") + std::to_string(part.offset[d]);
  return key;
}

/// The name of rank `rank`'s file: rank-00003.safetensors.
inline std::string rank_file_name(int rank) {
  std::string digits = std::to_string(rank);
  if (digits.size() < 5) digits.insert(0, 5 - digits.size(), '0');
  return "rank-" + digits + ".safetensors";
}

namespace detail {

inline void append_integers(std::string& out, std::span<const std::int64_t> values) {
  out += '[';
  for (std::size_t i = 0; i < values.size(); ++i) out += (i != 0 ? "," : "") + std::to_string(values[i]);
  out += ']';
}

inline void append_integer_map(std::string& out, const std::map<std::string, std::int64_t>& values) {
  out += '{';
  bool first = true;
  for (const auto& [key, value] : values) {
    if (!first) out += ',';
    first = false;
    append_json_string(out, key);
    out += ':' + std::to_string(value);
  }
  out += '}';
}

}  // namespace detail

/// index.json's text: one tensor per line, so the file reads and diffs well.
inline std::string index_json(const checkpoint_index& index) {
  std::string out = "{\"format\":";
  detail::append_json_string(out, index_format_name);
  out += ",\"version\":" + std::to_string(index_format_version) + ",\"model\":";
  detail::append_json_string(out, index.model);
  out += ",\"step\":" + std::to_string(index.step) + ",\"data_position\":";
  detail::append_integer_map(out, index.data_position);
  out += ",\"layout\":";
  detail::append_integer_map(out, index.layout);
  out += ",\n\"files\":[";
  for (std::size_t i = 0; i < index.files.size(); ++i) {
    out += i != 0 ? ",\n" : "\n";
    out += "{\"rank\":" + std::to_string(index.files[i].rank) + ",\"file\":";
    detail::append_json_string(out, index.files[i].file);
    out += ",\"bytes\":" + std::to_string(index.files[i].bytes) + "}";
  }
  out += "],\n\"tensors\":{";
  for (std::size_t i = 0; i < index.tensors.size(); ++i) {
    const saved_tensor& t = index.tensors[i];
    out += i != 0 ? ",\n" : "\n";
    detail::append_json_string(out, t.name);
    out += ":{\"dtype\":\"" + std::string(safetensors_name(t.type)) + "\",\"shape\":";
    detail::append_integers(out, t.shape);
    out += ",\"pieces\":[";
    for (std::size_t j = 0; j < t.pieces.size(); ++j) {
      const saved_piece& p = t.pieces[j];
      out += j != 0 ? "," : "";
      out += "{\"file\":";
      detail::append_json_string(out, p.file);
      out += ",\"key\":";
      detail::append_json_string(out, p.key);
      out += ",\"offset\":";
      detail::append_integers(out, p.part.offset);
      out += ",\"extent\":";
      detail::append_integers(out, p.part.extent);
      out += ",\"crc32\":" + std::to_string(p.crc32) + "}";
    }
    out += "]}";
  }
  out += "\n}}\n";
  return out;
}

namespace detail {

/// Reads index.json's values; every refusal names the file and the field.
class index_parser {
 public:
  explicit index_parser(std::string where) : where_(std::move(where)) {}

  [[noreturn]] void refuse(const std::string& message) const {
    fail("checkpoint index '" + where_ + "': " + message + "; the index is corrupt or from another program: save the checkpoint again or pick another");
  }

  const json_value& member(const json_value& object, std::string_view key, json_value::kind kind) const {
    const json_value* found = nullptr;
    for (const json_member& m : object.members) {
      if (m.key == key) found = &m.value;
    }
    if (found == nullptr) refuse("'" + std::string(key) + "' is missing");
    if (found->type != kind) {
      refuse("'" + std::string(key) + "' is " + std::string(describe(found->type)) + ", not " + std::string(describe(kind)));
    }
    return *found;
  }

  std::int64_t integer(const json_value& value, std::string_view what, std::int64_t minimum) const {
    if (value.type != json_value::kind::number || !value.integer || *value.integer < minimum) {
      refuse(std::string(what) + " is not an integer of at least " + std::to_string(minimum));
    }
    return *value.integer;
  }

  std::vector<std::int64_t> integers(const json_value& object, std::string_view key, std::int64_t minimum) const {
    std::vector<std::int64_t> values;
    for (const json_value& item : member(object, key, json_value::kind::array).items) values.push_back(integer(item, key, minimum));
    return values;
  }

  std::map<std::string, std::int64_t> integer_map(const json_value& object, std::string_view key) const {
    std::map<std::string, std::int64_t> values;
    for (const json_member& m : member(object, key, json_value::kind::object).members) {
      values[m.key] = integer(m.value, std::string(key) + "." + m.key, std::numeric_limits<std::int64_t>::min());
    }
    return values;
  }

 private:
  std::string where_;
};

}  // namespace detail

/// Parses and checks index.json's text (`where` names it in messages): the format and version,
/// each tensor's dtype and shape, each piece inside its tensor, with as many dimensions, in a
/// listed file. Coverage and overlap are verify()'s and the reader's to check.
inline checkpoint_index parse_index(std::string_view text, const std::string& where) {
  using detail::json_member;
  using detail::json_parser;
  using detail::json_value;
  detail::index_parser p(where);
  json_value root;
  try {
    root = json_parser::parse(text);
  } catch (const detail::json_syntax_error& e) {
    p.refuse("not valid JSON at byte " + std::to_string(e.offset()) + ": " + e.what());
  }
  if (root.type != json_value::kind::object) p.refuse("it is " + std::string(detail::describe(root.type)) + ", not a JSON object");
  if (p.member(root, "format", json_value::kind::string).text != index_format_name) {
    p.refuse("its format is '" + p.member(root, "format", json_value::kind::string).text + "', not '" + std::string(index_format_name) + "'");
  }
  const std::int64_t version = p.integer(p.member(root, "version", json_value::kind::number), "version", 1);
  if (version != index_format_version) {
    fail("checkpoint index '" + where + "' has format version " + std::to_string(version) + "; this weft reads version " +
         std::to_string(index_format_version) + ": use the weft that wrote it");
  }
  checkpoint_index index;
  index.model = p.member(root, "model", json_value::kind::string).text;
  index.step = p.integer(p.member(root, "step", json_value::kind::number), "step", 0);
  index.data_position = p.integer_map(root, "data_position");
  index.layout = p.integer_map(root, "layout");
  for (const json_value& f : p.member(root, "files", json_value::kind::array).items) {
    if (f.type != json_value::kind::object) p.refuse("an entry of 'files' is not an object");
    index.files.push_back({static_cast<int>(p.integer(p.member(f, "rank", json_value::kind::number), "files.rank", 0)),
                           p.member(f, "file", json_value::kind::string).text,
                           static_cast<std::uint64_t>(p.integer(p.member(f, "bytes", json_value::kind::number), "files.bytes", 0))});
    const std::string& name = index.files.back().file;
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
      p.refuse("file name '" + name + "' is not a plain file name in the checkpoint directory");
    }
  }
  for (const json_member& m : p.member(root, "tensors", json_value::kind::object).members) {
    saved_tensor t;
    t.name = m.key;
    if (m.value.type != json_value::kind::object) p.refuse("tensor '" + m.key + "' is not an object");
    const std::string& type_name = p.member(m.value, "dtype", json_value::kind::string).text;
    const auto type = dtype_from_safetensors_name(type_name);
    if (!type) p.refuse("tensor '" + m.key + "' has dtype '" + type_name + "', which weft does not read");
    t.type = *type;
    t.shape = p.integers(m.value, "shape", 0);
    if (!detail::checked_element_count(t.shape)) p.refuse("tensor '" + m.key + "' has a shape too large for 64 bits");
    for (const json_value& item : p.member(m.value, "pieces", json_value::kind::array).items) {
      if (item.type != json_value::kind::object) p.refuse("a piece of tensor '" + m.key + "' is not an object");
      saved_piece piece;
      piece.file = p.member(item, "file", json_value::kind::string).text;
      piece.key = p.member(item, "key", json_value::kind::string).text;
      piece.part.offset = p.integers(item, "offset", 0);
      piece.part.extent = p.integers(item, "extent", 0);
      const std::int64_t crc = p.integer(p.member(item, "crc32", json_value::kind::number), "crc32", 0);
      if (crc > 0xffffffffLL) p.refuse("a piece of tensor '" + m.key + "' has a crc32 over 32 bits");
      piece.crc32 = static_cast<std::uint32_t>(crc);
      bool inside = piece.part.offset.size() == t.shape.size() && piece.part.extent.size() == t.shape.size();
      for (std::size_t d = 0; inside && d < t.shape.size(); ++d) inside = piece.part.offset[d] + piece.part.extent[d] <= t.shape[d];
      if (!inside) {
        p.refuse("piece '" + piece.key + "' of tensor '" + m.key + "' does not lie inside its shape " + detail::shape_text(t.shape));
      }
      bool listed = false;
      for (const saved_file& f : index.files) listed = listed || f.file == piece.file;
      if (!listed) p.refuse("piece '" + piece.key + "' of tensor '" + m.key + "' is in file '" + piece.file + "', which 'files' does not list");
      t.pieces.push_back(std::move(piece));
    }
    if (index.find(t.name) != nullptr) p.refuse("tensor '" + t.name + "' appears twice");
    index.tensors.push_back(std::move(t));
  }
  return index;
}

/// One piece a reader takes values from, and the part of it that it takes.
struct read_step {
  const saved_piece* piece = nullptr;
  region overlap;
};

/// The saved pieces that hold values of `wanted` (a region of `tensor`), in index order, each with
/// the part of `wanted` it holds. Throws weft::error when `wanted` is outside the tensor or the
/// pieces do not cover it.
inline std::vector<read_step> plan_read(const saved_tensor& tensor, const region& wanted) {
  bool inside = wanted.offset.size() == tensor.shape.size() && wanted.extent.size() == tensor.shape.size();
  for (std::size_t d = 0; inside && d < tensor.shape.size(); ++d) {
    inside = wanted.offset[d] >= 0 && wanted.extent[d] >= 0 && wanted.offset[d] + wanted.extent[d] <= tensor.shape[d];
  }
  if (!inside) {
    fail("region " + region_text(wanted) + " is not inside tensor '" + tensor.name + "' of shape " + detail::shape_text(tensor.shape) +
         " in the checkpoint; the model being loaded does not match the saved one (other sizes?)");
  }
  std::vector<read_step> steps;
  const std::int64_t needed = element_count(wanted);
  if (needed == 0) return steps;
  std::int64_t found = 0;
  for (const saved_piece& piece : tensor.pieces) {
    if (auto overlap = intersection(piece.part, wanted)) {
      found += element_count(*overlap);
      steps.push_back({&piece, std::move(*overlap)});
    }
  }
  for (std::size_t i = 0; i < steps.size(); ++i) {
    for (std::size_t j = i + 1; j < steps.size(); ++j) {
      if (intersection(steps[i].overlap, steps[j].overlap)) {
        fail("tensor '" + tensor.name + "': pieces '" + steps[i].piece->key + "' and '" + steps[j].piece->key +
             "' overlap in the index (corrupt or edited): run weft-ckpt verify on it");
      }
    }
  }
  if (found != needed) {
    fail("tensor '" + tensor.name + "': the checkpoint's pieces hold " + std::to_string(found) + " values of region " +
         region_text(wanted) + ", which has " + std::to_string(needed) +
         "; the index does not tile the tensor (corrupt or edited): run weft-ckpt verify on it");
  }
  return steps;
}

}  // namespace weft::checkpoint
