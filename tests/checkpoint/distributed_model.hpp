#pragma once
// A small model for the distributed checkpoint tests, in any tp x dp layout: what each rank
// holds (its pieces) and, independently of any checkpoint code, the value of every element
// (a function of the tensor and the element's global index), so a loaded region is checked
// against a computation of its own.
//
//   w  [8, 12] F32  rows split over dp, columns over tp (2-D shards, as FSDP x tp)
//   v  [6, 10] F64  rows split over tp (uneven for tp 4), replicated over dp
//   b  [10]    F32  replicated on every rank
//   m  [5, 7]  F32  a ZeRO shard: the flattened tensor split over all ranks (uneven)
//   n  []      I64  a replicated scalar (an optimizer step)
#include <weft/checkpoint/distributed.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace ckpt_test {

namespace ckpt = weft::checkpoint;

struct test_piece {
  std::string name;
  weft::dtype type;
  std::vector<std::int64_t> shape;
  ckpt::region part;
  std::vector<std::byte> bytes;
};

/// [begin, count) of part `i` of `n` indices split into `parts` (the first n % parts one longer).
inline std::pair<std::int64_t, std::int64_t> split(std::int64_t n, int parts, int i) {
  const std::int64_t base = n / parts, extra = n % parts;
  return {i * base + std::min<std::int64_t>(i, extra), base + (i < extra ? 1 : 0)};
}

/// Element `index` (global, row-major) of tensor `name`, as `type`'s bytes; `step` shifts every value.
inline void value_bytes(const std::string& name, weft::dtype type, std::int64_t index, std::int64_t step, std::byte* out) {
  const double base = static_cast<double>(name[0]) * 1000.0 + static_cast<double>(step) * 100000.0;
  const double value = base + 0.25 * static_cast<double>(index);
  switch (type) {
    case weft::dtype::float32: { const auto v = static_cast<float>(value); std::memcpy(out, &v, sizeof v); break; }
    case weft::dtype::float64: std::memcpy(out, &value, sizeof value); break;
    case weft::dtype::int64: { const auto v = static_cast<std::int64_t>(value); std::memcpy(out, &v, sizeof v); break; }
    default: break;
  }
}

/// The values of `part` of a tensor, row-major within the region.
inline std::vector<std::byte> values_of_region(const std::string& name, weft::dtype type, const std::vector<std::int64_t>& shape,
                                               const ckpt::region& part, std::int64_t step = 0) {
  const std::size_t element = weft::size_of(type);
  const std::int64_t count = ckpt::element_count(part);
  std::vector<std::byte> bytes(static_cast<std::size_t>(count) * element);
  const std::size_t dims = shape.size();
  for (std::int64_t i = 0; i < count; ++i) {
    std::int64_t rest = i, global = 0, stride = 1;
    for (std::size_t d = dims; d-- > 0;) {
      global += (part.offset[d] + rest % part.extent[d]) * stride;
      rest /= part.extent[d];
      stride *= shape[d];
    }
    value_bytes(name, type, global, step, bytes.data() + static_cast<std::size_t>(i) * element);
  }
  return bytes;
}

/// What rank `rank` of a tp x dp layout holds (rank = d * tp + t), with its values at `step`.
inline std::vector<test_piece> layout_pieces(int tp, int dp, int rank, std::int64_t step = 0) {
  const int t = rank % tp, d = rank / tp, world = tp * dp;
  std::vector<test_piece> pieces;
  auto add = [&](std::string name, weft::dtype type, std::vector<std::int64_t> shape, ckpt::region part) {
    auto bytes = values_of_region(name, type, shape, part, step);
    pieces.push_back({std::move(name), type, std::move(shape), std::move(part), std::move(bytes)});
  };
  const auto [w_row, w_rows] = split(8, dp, d);
  const auto [w_col, w_cols] = split(12, tp, t);
  add("w", weft::dtype::float32, {8, 12}, {{w_row, w_col}, {w_rows, w_cols}});
  const auto [v_row, v_rows] = split(6, tp, t);
  add("v", weft::dtype::float64, {6, 10}, {{v_row, 0}, {v_rows, 10}});
  add("b", weft::dtype::float32, {10}, ckpt::whole_region(std::vector<std::int64_t>{10}));
  const auto [m_begin, m_count] = split(35, world, rank);
  for (ckpt::region& part : ckpt::regions_of_flat_range({{0, 0}, {5, 7}}, m_begin, m_begin + m_count)) {
    add("m", weft::dtype::float32, {5, 7}, std::move(part));
  }
  add("n", weft::dtype::int64, {}, {});
  return pieces;
}

inline std::vector<ckpt::local_piece> local_pieces(const std::vector<test_piece>& pieces) {
  std::vector<ckpt::local_piece> out;
  for (const test_piece& p : pieces) out.push_back({p.name, p.type, p.shape, p.part, p.bytes});
  return out;
}

/// Reads every piece of `pieces` (another layout's) from `checkpoint` and returns the first
/// region whose bytes differ from the expected values, or "" when all match.
inline std::string first_mismatch(ckpt::distributed_checkpoint& checkpoint, const std::vector<test_piece>& pieces) {
  for (const test_piece& p : pieces) {
    std::vector<std::byte> got(p.bytes.size());
    checkpoint.read(p.name, p.part, got);
    if (got != p.bytes) return p.name + " " + ckpt::region_text(p.part);
  }
  return "";
}

}  // namespace ckpt_test
