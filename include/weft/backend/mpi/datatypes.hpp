#pragma once
/// \file
/// weft dtypes and reduce ops as MPI sees them. MPI has no 16-bit floating types: half and
/// bfloat16 travel as MPI_UINT16_T, and their reductions are user-defined MPI ops that compute in
/// float and round back. Those ops are created on first use and freed at MPI_Finalize (through a
/// delete callback on MPI_COMM_SELF, the hook MPI guarantees runs first in MPI_Finalize).

#include <mpi.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>

#include <weft/backend/mpi/check.hpp>
#include <weft/core/dtype.hpp>
#include <weft/core/reduce_op.hpp>

namespace weft::detail::mpi {

inline MPI_Datatype datatype_of(dtype type) {
  switch (type) {
    case dtype::float32: return MPI_FLOAT;
    case dtype::float64: return MPI_DOUBLE;
    case dtype::float16: return MPI_UINT16_T;
    case dtype::bfloat16: return MPI_UINT16_T;
    case dtype::int32: return MPI_INT32_T;
    case dtype::int64: return MPI_INT64_T;
    case dtype::uint8: return MPI_UINT8_T;
  }
  return MPI_DATATYPE_NULL;
}

constexpr bool is_16bit_float(dtype type) noexcept { return type == dtype::float16 || type == dtype::bfloat16; }

template <class T, reduce_op Op>
void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = float(a[i]);
    float y = float(b[i]);
    float r = 0;
    if constexpr (Op == reduce_op::sum) r = x + y;
    else if constexpr (Op == reduce_op::prod) r = x * y;
    else if constexpr (Op == reduce_op::min) r = std::min(x, y);
    else r = std::max(x, y);
    b[i] = T(r);
  }
}

/// The user-defined ops for half and bfloat16, indexed [type][op] (sum, prod, min, max).
struct op_registry {
  std::array<std::array<MPI_Op, 4>, 2> ops{};
  bool created = false;
  std::mutex mutex;
};

inline op_registry& registry() {
  static op_registry instance;
  return instance;
}

inline int free_ops_at_finalize(MPI_Comm, int, void*, void*) {
  op_registry& reg = registry();
  std::lock_guard lock(reg.mutex);
  if (reg.created) {
    for (auto& per_type : reg.ops)
      for (MPI_Op& op : per_type) MPI_Op_free(&op);
    reg.created = false;
  }
  return MPI_SUCCESS;
}

inline void create_ops_locked(op_registry& reg) {
  auto make = [](MPI_User_function* fn) {
    MPI_Op op = MPI_OP_NULL;
    WEFT_CHECK_MPI(MPI_Op_create(fn, /*commute=*/1, &op));
    return op;
  };
  reg.ops[0] = {make(&reduce_16bit<half, reduce_op::sum>), make(&reduce_16bit<half, reduce_op::prod>),
                make(&reduce_16bit<half, reduce_op::min>), make(&reduce_16bit<half, reduce_op::max>)};
  reg.ops[1] = {make(&reduce_16bit<bfloat16, reduce_op::sum>), make(&reduce_16bit<bfloat16, reduce_op::prod>),
                make(&reduce_16bit<bfloat16, reduce_op::min>), make(&reduce_16bit<bfloat16, reduce_op::max>)};
  int keyval = MPI_KEYVAL_INVALID;
  WEFT_CHECK_MPI(MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &free_ops_at_finalize, &keyval, nullptr));
  WEFT_CHECK_MPI(MPI_Comm_set_attr(MPI_COMM_SELF, keyval, nullptr));
  WEFT_CHECK_MPI(MPI_Comm_free_keyval(&keyval));
  reg.created = true;
}

/// The MPI op that reduces `type` with `op`. `avg` is reduced as a sum; the caller divides.
inline MPI_Op op_of(dtype type, reduce_op op) {
  reduce_op base = op == reduce_op::avg ? reduce_op::sum : op;
  if (!is_16bit_float(type)) {
    switch (base) {
      case reduce_op::sum: return MPI_SUM;
      case reduce_op::prod: return MPI_PROD;
      case reduce_op::min: return MPI_MIN;
      case reduce_op::max: return MPI_MAX;
      case reduce_op::avg: break;
    }
    return MPI_OP_NULL;
  }
  op_registry& reg = registry();
  std::lock_guard lock(reg.mutex);
  if (!reg.created) create_ops_locked(reg);
  return reg.ops[type == dtype::float16 ? 0 : 1][static_cast<std::size_t>(base)];
}

/// Divides `count` elements of `type` in place by `divisor` (the `avg` epilogue).
inline void divide_in_place(void* data, std::size_t count, dtype type, int divisor) {
  auto apply = [&]<class T>(T*) {
    T* p = static_cast<T*>(data);
    for (std::size_t i = 0; i < count; ++i) {
      if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>)
        p[i] = T(float(p[i]) / static_cast<float>(divisor));
      else
        p[i] = static_cast<T>(p[i] / static_cast<T>(divisor));
    }
  };
  switch (type) {
    case dtype::float32: apply(static_cast<float*>(nullptr)); break;
    case dtype::float64: apply(static_cast<double*>(nullptr)); break;
    case dtype::float16: apply(static_cast<half*>(nullptr)); break;
    case dtype::bfloat16: apply(static_cast<bfloat16*>(nullptr)); break;
    case dtype::int32: apply(static_cast<std::int32_t*>(nullptr)); break;
    case dtype::int64: apply(static_cast<std::int64_t*>(nullptr)); break;
    case dtype::uint8: apply(static_cast<std::uint8_t*>(nullptr)); break;
  }
}

}  // namespace weft::detail::mpi
