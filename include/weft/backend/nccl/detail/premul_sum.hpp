#pragma once
/// \file
/// A scaled sum as an NCCL reduction operator (ncclRedOpCreatePreMulSum): each rank's values are
/// multiplied by a factor inside the reduction kernel, so scaling gradients costs no pass over
/// memory of its own. NCCL converts the factor to the element type, so a factor that type cannot
/// hold accurately (1/4M tokens in float16 is subnormal, 1/33.5M is zero) is refused before
/// anything is enqueued (see fold_scale_factor in policy.hpp). NCCL allows the operator to be
/// destroyed as soon as the call that uses it has returned.

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <nccl.h>

#include <cstdint>
#include <mutex>
#include <string>

#include <weft/backend/nccl/check.hpp>
#include <weft/backend/nccl/datatypes.hpp>
#include <weft/backend/nccl/detail/policy.hpp>
#include <weft/backend/nccl/detail/shared_state.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/core/float16.hpp>

namespace weft::detail::nccl {

class premul_sum {
 public:
  /// A sum of `factor` x each rank's values of type `type` (a floating-point type) on `state`'s
  /// communicator, whose handle the caller is using (holding `state.use`).
  premul_sum(double factor, dtype type, shared_state& state) : state_(state) {
    if (!is_floating(type))
      fail("NCCL scaled sum: " + std::string(to_string(type)) +
           " is not a floating-point type; scale integers with a plain sum and a division of your own");
    const scale_fold fold = fold_scale_factor(factor, type);
    if (!fold.fold) fail(unfoldable_factor_message(factor, type, fold));
    // The scalar has the data's own type.
    union {
      float f32;
      double f64;
      half f16;
      bfloat16 bf16;
    } scalar{};
    switch (type) {
      case dtype::float32: scalar.f32 = static_cast<float>(factor); break;
      case dtype::float64: scalar.f64 = factor; break;
      case dtype::float16: scalar.f16 = half(static_cast<float>(factor)); break;
      default: scalar.bf16 = bfloat16(static_cast<float>(factor)); break;
    }
    comm_ = state_.handle.load(std::memory_order_acquire);
    WEFT_CHECK_NCCL(ncclRedOpCreatePreMulSum(&op_, &scalar, datatype_of(type), ncclScalarHostImmediate, comm_),
                    comm_);
    made_ = true;
  }
  premul_sum(const premul_sum&) = delete;
  premul_sum& operator=(const premul_sum&) = delete;
  /// Destroyed only while its communicator lives (an aborted one took its operators with it).
  ~premul_sum() {
    if (!made_) return;
    std::lock_guard lock(state_.use);
    if (state_.handle.load(std::memory_order_acquire) == comm_) ncclRedOpDestroy(op_, comm_);
  }

  ncclRedOp_t op() const noexcept { return op_; }

 private:
  shared_state& state_;
  ncclComm_t comm_ = nullptr;
  ncclRedOp_t op_{};
  bool made_ = false;
};

}  // namespace weft::detail::nccl

#endif  // WEFT_HAS_NCCL
