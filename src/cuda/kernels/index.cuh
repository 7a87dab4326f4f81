// Device helpers of the kernels that read req_to_token rows (index.cu, cascade.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/index.h"

namespace kvattn::cuda::detail {

/// The req_to_token row of batch entry `entry`, or null when its row index is outside the table
/// (the step-check kernel reports that; the entry then reads as an empty row).
__device__ __forceinline__ const int32_t* source_row(const ReqToTokenSource& s, int entry) {
  const int64_t row = s.req_pool_indices_int64
                          ? static_cast<const int64_t*>(s.req_pool_indices)[entry]
                          : static_cast<const int32_t*>(s.req_pool_indices)[entry];
  if (row < 0 || row >= s.max_reqs) return nullptr;
  return s.table + row * s.row_stride;
}

}  // namespace kvattn::cuda::detail
