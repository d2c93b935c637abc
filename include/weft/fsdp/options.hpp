#pragma once
/// \file
/// Options of a fully sharded model, as one aggregate:
/// `weft::fsdp::sharded_model<B, bfloat16> model(dp, {.level = weft::tune::sharding::full,
///                                                     .reduce_dtype = weft::dtype::float32});`
///
/// The mixed-precision choices are PyTorch FSDP2's `MixedPrecisionPolicy`: master shards are fp32
/// (double when the parameters are double); `param_dtype` is the sharded_model's element type
/// (the type parameters are gathered in and gradients are produced in); `reduce_dtype` is the type
/// gradients are reduce-scattered in; reduced gradients are accumulated in the master type.

#include <cstddef>

#include <weft/core/dtype.hpp>
#include <weft/grad/options.hpp>
#include <weft/tune/layout.hpp>

namespace weft::fsdp {

struct fsdp_options {
  /// `sharding::full` (ZeRO-3 / FSDP: parameters, gradients and optimizer state sharded) or
  /// `sharding::gradients` (ZeRO-2: gradients and optimizer state sharded, parameters kept whole
  /// on every rank and gathered once after each optimizer step). The tuner's names.
  tune::sharding level = tune::sharding::full;
  /// ZeRO-3: free a unit's gathered parameters after its forward and gather them again for its
  /// backward (false: keep them from forward to backward, trading memory for one gather per unit).
  /// The last unit is never freed between its forward and backward, which follows at once.
  bool reshard_after_forward = true;
  /// Issue the next unit's all-gather (forward order in forward, reverse order in backward) when a
  /// unit begins, so that it runs while the unit computes.
  bool prefetch = true;
  /// Unit 0 is the root, as FSDP2's `fully_shard` on the whole model after its layers: its scope
  /// encloses the other units' scopes, in forward (forward(0) first, ended after the last unit's
  /// forward) and in backward (backward(0) first, ended after unit 1's backward), so that its
  /// parameters can be used at both ends of the model: a token embedding tied to the output
  /// layer, a final norm. Its gathered copy is kept from its forward to the end of its backward;
  /// its gradients are reduced after every other unit's.
  bool enclosing_root = false;
  /// Micro-steps per optimizer step: each micro-step's gradients are reduce-scattered and added
  /// into the master-type shard; finish() of the k-th returns true.
  int accumulation_steps = 1;
  grad::scaling scale = grad::scaling::mean;
  /// The type gradients are reduce-scattered in: the parameters' own type, float32, or bfloat16.
  dtype reduce_dtype = dtype::float32;
  /// Each unit is padded to a multiple of lcm(pad_elements, shard ranks) elements.
  std::size_t pad_elements = 128;
  /// Keep a log of the gathers and reductions in the order they were issued and waited for
  /// (schedule()), for tests and for checking a trainer's prefetch order.
  bool record_schedule = false;
};

}  // namespace weft::fsdp
