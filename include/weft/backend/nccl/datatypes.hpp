#pragma once
/// \file
/// weft's dtypes and reduce ops as NCCL's. NCCL has every one natively, avg included (ncclAvg:
/// integer types divide after summing, as weft specifies).

#include <weft/config.hpp>

#if WEFT_HAS_NCCL

#include <nccl.h>

#include <weft/core/dtype.hpp>
#include <weft/core/reduce_op.hpp>

namespace weft::detail::nccl {

constexpr ncclDataType_t datatype_of(dtype type) noexcept {
  switch (type) {
    case dtype::float32: return ncclFloat32;
    case dtype::float64: return ncclFloat64;
    case dtype::float16: return ncclFloat16;
    case dtype::bfloat16: return ncclBfloat16;
    case dtype::int32: return ncclInt32;
    case dtype::int64: return ncclInt64;
    case dtype::uint8: return ncclUint8;
  }
  return ncclFloat32;
}

constexpr ncclRedOp_t op_of(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::prod: return ncclProd;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::avg: return ncclAvg;
  }
  return ncclSum;
}

}  // namespace weft::detail::nccl

#endif  // WEFT_HAS_NCCL
