#pragma once
/// \file
/// A scaled sum as an NCCL reduction operator (ncclRedOpCreatePreMulSum): each rank's values are
/// multiplied by a factor inside the reduction kernel, so scaling gradients costs no pass over
/// memory of its own. The factor is read on the host when the operator is made; NCCL allows the
/// operator to be destroyed as soon as the call that uses it has returned.

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <nccl.h>

#include <cstdint>
#include <string>

#include <weft/backend/nccl/check.hpp>
#include <weft/backend/nccl/datatypes.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/error.hpp>
#include <weft/core/float16.hpp>

namespace weft::detail::nccl {

class premul_sum {
 public:
  /// A sum of `factor` x each rank's values of type `type` (a floating-point type) on `comm`.
  premul_sum(double factor, dtype type, ncclComm_t comm) : comm_(comm) {
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
      case dtype::bfloat16: scalar.bf16 = bfloat16(static_cast<float>(factor)); break;
      default:
        fail("NCCL scaled sum: " + std::string(to_string(type)) +
             " is not a floating-point type; scale integers with a plain sum and a division of your own");
    }
    WEFT_CHECK_NCCL(ncclRedOpCreatePreMulSum(&op_, &scalar, datatype_of(type), ncclScalarHostImmediate, comm_),
                    comm_);
  }
  premul_sum(const premul_sum&) = delete;
  premul_sum& operator=(const premul_sum&) = delete;
  ~premul_sum() { ncclRedOpDestroy(op_, comm_); }

  ncclRedOp_t op() const noexcept { return op_; }

 private:
  ncclComm_t comm_;
  ncclRedOp_t op_{};
};

}  // namespace weft::detail::nccl

#endif  // WEFT_HAS_NCCL
