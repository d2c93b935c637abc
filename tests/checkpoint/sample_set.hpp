#pragma once
// The sample checkpoint the interoperability tests write and check: every dtype, scalars, empty
// tensors, and names and metadata that need escaping. check_safetensors.py builds the same set
// from the same formulas, written out again in Python; change both together.

#include <bit>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <weft/checkpoint/safetensors.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/float16.hpp>

namespace checkpoint_test {

struct sample_tensor {
  std::string name;
  weft::dtype type;
  std::vector<std::int64_t> shape;
};

inline const std::vector<sample_tensor>& sample_tensors() {
  using weft::dtype;
  static const std::vector<sample_tensor> tensors = {
      {"wte.weight", dtype::float32, {8, 6}},
      {"h.0.ln_1.bias", dtype::float16, {6}},
      {"h.0.attn.c_attn.weight", dtype::bfloat16, {6, 18}},
      {"scalar/loss_scale", dtype::float64, {}},
      {"empty.f32", dtype::float32, {0}},
      {"empty.i64", dtype::int64, {3, 0, 2}},
      {"step", dtype::int64, {}},
      {"positions", dtype::int32, {4, 5}},
      {"mask", dtype::uint8, {13}},
      {"na\xc3\xafve.\xe5\x90\x8d\xe5\x89\x8d.\"q\"\\t\n\x01", dtype::float32, {2}},
      {"h.0.mlp.c_fc.weight", dtype::float64, {3, 4}},
  };
  return tensors;
}

inline std::map<std::string, std::string> sample_metadata() {
  return {{"format", "pt"}, {"step", "1200"}, {"note", "\xc3\xa9 \"quoted\"\ttab\x01 back\\slash /"}};
}

/// Element i of the tensor at position k of the sample set, as a double (floating types) ...
inline double sample_float(std::int64_t k, std::int64_t i) { return static_cast<double>((i * 37 + k * 11) % 101 - 50) / 8.0; }
/// ... or as an integer of the tensor's type.
inline std::int64_t sample_integer(weft::dtype type, std::int64_t k, std::int64_t i) {
  const auto ui = static_cast<std::uint64_t>(i);
  const auto uk = static_cast<std::uint64_t>(k);
  switch (type) {
    case weft::dtype::int32: return static_cast<std::int64_t>((ui * 2654435761u + uk * 97u) % (1ull << 31)) - (1ll << 30);
    case weft::dtype::int64: return std::bit_cast<std::int64_t>(ui * 0x9E3779B97F4A7C15ull + uk);
    case weft::dtype::uint8: return static_cast<std::int64_t>((ui * 7u + uk * 3u) % 256u);
    default: return 0;
  }
}

template <class T>
std::vector<T> sample_values(weft::dtype type, std::int64_t k, std::int64_t count) {
  std::vector<T> values;
  for (std::int64_t i = 0; i < count; ++i) {
    if constexpr (std::is_same_v<T, weft::half> || std::is_same_v<T, weft::bfloat16>) {
      values.push_back(T(static_cast<float>(sample_float(k, i))));
    } else if constexpr (std::is_floating_point_v<T>) {
      values.push_back(static_cast<T>(sample_float(k, i)));
    } else {
      values.push_back(static_cast<T>(sample_integer(type, k, i)));
    }
  }
  return values;
}

/// Calls `f(T{})` with T the element type of `type`.
template <class F>
decltype(auto) visit_dtype(weft::dtype type, F&& f) {
  switch (type) {
    case weft::dtype::float32: return f(float{});
    case weft::dtype::float64: return f(double{});
    case weft::dtype::float16: return f(weft::half{});
    case weft::dtype::bfloat16: return f(weft::bfloat16{});
    case weft::dtype::int32: return f(std::int32_t{});
    case weft::dtype::int64: return f(std::int64_t{});
    case weft::dtype::uint8: return f(std::uint8_t{});
  }
  return f(float{});
}

/// The record of the tensor at position k of the sample set.
inline weft::checkpoint::tensor_record sample_record(std::int64_t k) {
  const sample_tensor& tensor = sample_tensors()[static_cast<std::size_t>(k)];
  return visit_dtype(tensor.type, [&]<class T>(T) {
    auto values = sample_values<T>(tensor.type, k, weft::checkpoint::element_count(tensor.shape));
    return weft::checkpoint::make_record<T>(tensor.name, tensor.shape, values);
  });
}

inline weft::checkpoint::checkpoint_file sample_file() {
  weft::checkpoint::checkpoint_file file;
  file.metadata = sample_metadata();
  for (std::size_t k = 0; k < sample_tensors().size(); ++k) file.tensors.push_back(sample_record(static_cast<std::int64_t>(k)));
  return file;
}

}  // namespace checkpoint_test
