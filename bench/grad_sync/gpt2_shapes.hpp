#pragma once
// The gradient benchmarks' model shapes. GPT-2 small's 148 parameters in forward (registration)
// order, with Hugging Face's names: 124,439,808 elements in all (497.8 MB of float32).
#include <cstddef>
#include <string>
#include <vector>

namespace weft_bench {

struct named_shape {
  std::string name;
  std::vector<std::size_t> dims;
  std::size_t count() const {
    std::size_t n = 1;
    for (std::size_t d : dims) n *= d;
    return n;
  }
};

// `blocks_only`: the transformer blocks without the embeddings and the final layer norm.
inline std::vector<named_shape> gpt2_small_shapes(int layers = 12, bool blocks_only = false) {
  constexpr std::size_t vocab = 50257, context = 1024, d = 768;
  std::vector<named_shape> out;
  if (!blocks_only) {
    out.push_back({"wte.weight", {vocab, d}});
    out.push_back({"wpe.weight", {context, d}});
  }
  for (int l = 0; l < layers; ++l) {
    std::string h = "h." + std::to_string(l) + ".";
    out.push_back({h + "ln_1.weight", {d}});
    out.push_back({h + "ln_1.bias", {d}});
    out.push_back({h + "attn.c_attn.weight", {d, 3 * d}});
    out.push_back({h + "attn.c_attn.bias", {3 * d}});
    out.push_back({h + "attn.c_proj.weight", {d, d}});
    out.push_back({h + "attn.c_proj.bias", {d}});
    out.push_back({h + "ln_2.weight", {d}});
    out.push_back({h + "ln_2.bias", {d}});
    out.push_back({h + "mlp.c_fc.weight", {d, 4 * d}});
    out.push_back({h + "mlp.c_fc.bias", {4 * d}});
    out.push_back({h + "mlp.c_proj.weight", {4 * d, d}});
    out.push_back({h + "mlp.c_proj.bias", {d}});
  }
  if (!blocks_only) {
    out.push_back({"ln_f.weight", {d}});
    out.push_back({"ln_f.bias", {d}});
  }
  return out;
}

// A model of few large tensors, beside GPT-2 small's many small ones: `layers` linear layers of a
// `width`-wide MLP, each a [width, width] weight and a [width] bias, in forward order. At the
// default 16 x 2048 it is 32 tensors, 67,141,632 elements (268.6 MB of float32), every weight 16 MiB.
inline std::vector<named_shape> wide_mlp_shapes(int layers = 16, std::size_t width = 2048) {
  std::vector<named_shape> out;
  for (int l = 0; l < layers; ++l) {
    std::string h = "fc." + std::to_string(l) + ".";
    out.push_back({h + "weight", {width, width}});
    out.push_back({h + "bias", {width}});
  }
  return out;
}

}  // namespace weft_bench
