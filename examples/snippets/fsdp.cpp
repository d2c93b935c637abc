// docs/data_parallel.md's fully sharded example as a program: ZeRO-3 units in bfloat16 over the dp
// group (every rank of the job), one optimizer step of 4 micro-steps with AdamW. Forward checks
// the gathered parameters against their initial values; backward adds rank + 1 into every
// gradient; after the step every rank gathers the whole parameters and checks them against
// AdamW's first step on the mean gradient. Rank 0 prints "fsdp: ok" when every check passed on
// every rank.
#include <weft/backend/mpi/backend.hpp>
#include <weft/fsdp/adamw.hpp>
#include <weft/fsdp/sharded_model.hpp>

#include <weft/launch/mpi_environment.hpp>

#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace {

int failures = 0;
float gradient_value = 0;  // what this rank's backward adds into every gradient

void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fsdp: FAILED: %s\n", what);
    ++failures;
  }
}

/// Parameter `param` of every layer starts as multiples of 1/8 (exact in bfloat16).
std::vector<float> initial_values(std::size_t elements, std::size_t param) {
  std::vector<float> v(elements);
  for (std::size_t i = 0; i < elements; ++i) v[i] = static_cast<float>(static_cast<int>((i + param) % 7) - 3) * 0.125f;
  return v;
}

void forward_layer(int, std::span<const weft::bfloat16> qkv, std::span<const weft::bfloat16> proj,
                   std::span<const weft::bfloat16> fc) {
  const std::span<const weft::bfloat16> params[] = {qkv, proj, fc};
  for (std::size_t p = 0; p < 3; ++p) {
    const std::vector<float> want = initial_values(params[p].size(), p);
    for (std::size_t i = 0; i < want.size(); ++i)
      if (static_cast<float>(params[p][i]) != want[i]) return expect(false, "a gathered parameter in forward");
  }
}

void backward_layer(int, std::span<const weft::bfloat16>, std::span<const weft::bfloat16>,
                    std::span<weft::bfloat16> dqkv, std::span<weft::bfloat16> dproj, std::span<weft::bfloat16> dfc) {
  for (std::span<weft::bfloat16> g : {dqkv, dproj, dfc})
    for (weft::bfloat16& x : g) x = weft::bfloat16(static_cast<float>(x) + gradient_value);
}

void train(weft::communicator<weft::mpi_backend>& dp) {
  const int layers = 3;
  const std::size_t h = 8;
  gradient_value = static_cast<float>(dp.rank() + 1);

  weft::fsdp::sharded_model<weft::mpi_backend, weft::bfloat16> model(dp, {
      .level = weft::tune::sharding::full,     // ZeRO-3 (gradients: ZeRO-2)
      .reshard_after_forward = true,           // free gathered parameters after forward
      .accumulation_steps = 4,
      .reduce_dtype = weft::dtype::float32});  // FSDP2's reduce_dtype; Param is its param_dtype
  for (int l = 0; l < layers; ++l)             // once, in forward order
    model.add_unit("layer" + std::to_string(l), {{"qkv", 3 * h * h}, {"proj", h * h}, {"fc", 4 * h * h}});
  model.freeze();                              // collective: same shards on every rank (fingerprint)
  for (std::size_t unit = 0; unit < static_cast<std::size_t>(layers); ++unit) for (std::size_t param = 0; param < 3; ++param) model.load_whole(unit, param, initial_values((param == 0 ? 3 : param == 1 ? 1 : 4) * h * h, param));   // or reshard_params_from_whole(checkpoint)
  weft::fsdp::shard_adamw<float> adam(model, {.lr = 3e-4, .weight_decay = 0.1});

  for (int micro = 0; micro < 4; ++micro) {
    for (int l = 0; l < layers; ++l) {           // forward
      auto unit = model.forward(l);              // waits for layer l, prefetches layer l+1
      forward_layer(l, unit.param(0), unit.param(1), unit.param(2));
    }                                            // scope end: layer l freed (reshard_after_forward)
    for (int l = layers; l-- > 0;) {             // backward
      auto unit = model.backward(l);             // waits for layer l, prefetches layer l-1
      backward_layer(l, unit.param(0), unit.param(1), unit.grad(0), unit.grad(1), unit.grad(2));  // add into grad(p)
    }                                            // scope end: reduce-scatter of layer l's gradients
    if (model.finish()) {                        // true on the window's last micro-step
      adam.step(model);                          // on shard_params(u) / shard_grads(u)
      model.zero_grad();
    }
  }
  expect(model.steps() == 1, "the 4th micro-step's finish() returns true");

  // AdamW's first step moves each parameter by lr x g / (|g| + eps) against the mean gradient g,
  // after the decay: the same on every rank, whatever its shard.
  const double g = (dp.size() + 1) / 2.0, lr = 3e-4, decay = 0.1, eps = 1e-8;
  for (const auto& whole : model.gather_whole_params()) {
    const std::size_t param = whole.name.ends_with(".qkv") ? 0 : whole.name.ends_with(".proj") ? 1 : 2;
    const std::vector<float> start = initial_values(whole.values.size(), param);
    for (std::size_t i = 0; i < start.size(); ++i) {
      const double want = start[i] * (1 - lr * decay) - lr * g / (std::abs(g) + eps);
      if (std::abs(whole.values[i] - want) > 1e-6) return expect(false, "a parameter after the AdamW step");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  weft::mpi_environment mpi(weft::mpi_init_mode::init_if_needed, &argc, &argv);
  weft::communicator<weft::mpi_backend> world(weft::mpi_backend::comm::world(), "dp");
  train(world);
  std::vector<int> failed{failures};
  world.all_reduce(failed);
  if (world.rank() == 0 && failed[0] == 0) std::printf("fsdp: ok\n");
  return failed[0] == 0 ? 0 : 1;
}
