// Whole-row conversions between the tensor dtypes and float, shared by the attention kernels
// (widening q, K and V rows) and the KV write (narrowing new K/V to the storage dtype).
#pragma once

#include <cstdint>

#include "kvattn/dtype.h"

namespace kvattn::cpu {

/// The 256 values of an fp8 format (exact), for table-driven widening; null for other dtypes.
const float* fp8_value_table(DType dtype);

/// Widens `n` elements of `src` (fp32, bf16, fp16, fp8 e4m3/e5m2) to float and multiplies them
/// by `scale`. `n` is a multiple of 8.
void load_row(const void* src /*[n]*/, DType dtype, int n, float scale, float* dst /*[n]*/);

/// Narrows `n` floats to `dtype` (round to nearest even; fp8 saturates, as dtype.h specifies).
void store_row(const float* src /*[n]*/, int n, DType dtype, void* dst /*[n]*/);

}  // namespace kvattn::cpu
