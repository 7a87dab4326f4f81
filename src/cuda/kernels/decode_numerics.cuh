// Device helpers shared by the decode, merge and KV-write kernels: element conversions for the
// storage and io dtypes (the PTX wrappers are the toolkit's, toolkit/ptx.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/toolkit/ptx.cuh"
#include "kvattn/dtype.h"

namespace kvattn::cuda::detail {

using ptx::kLn2;
using ptx::kLog2e;

// ---- io tensors (q, out): dtype chosen at run time, one element at a time ------------------

__device__ __forceinline__ float load_io(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[index];
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(base)[index]);
    default:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
  }
}

__device__ __forceinline__ void store_io(void* base, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(base)[index] = value;
      break;
    case DType::kFloat16:
      static_cast<__half*>(base)[index] = __float2half_rn(value);
      break;
    default:
      static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value);
      break;
  }
}

// ---- KV storage: 8 consecutive elements of a chunk -> float -----------------------------

/// Bytes of one 8-element chunk of storage dtype `kKv`.
template <DType kKv>
constexpr int kv_chunk_bytes() {
  return (kKv == DType::kFloat8E4M3 || kKv == DType::kFloat8E5M2) ? 8 : 16;
}

template <DType kKv>
__device__ __forceinline__ void chunk_to_float(const void* chunk, float (&out)[8]) {
  if constexpr (kKv == DType::kBFloat16) {
    const uint4 raw = *static_cast<const uint4*>(chunk);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // bf16 -> fp32 is a shift: exact
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else if constexpr (kKv == DType::kFloat16) {
    const uint4 raw = *static_cast<const uint4*>(chunk);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &words[i], 4);
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
    constexpr __nv_fp8_interpretation_t kind = kKv == DType::kFloat8E4M3 ? __NV_E4M3 : __NV_E5M2;
    const uint2 raw = *static_cast<const uint2*>(chunk);
    const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {  // fp8x2 -> half2 is exact (cvt on sm_89+)
        const __nv_fp8x2_storage_t pair = __nv_fp8x2_storage_t(words[i] >> (16 * j));
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pair, kind);
        __half2 h;
        memcpy(&h, &hr, 4);
        const float2 f = __half22float2(h);
        out[4 * i + 2 * j] = f.x;
        out[4 * i + 2 * j + 1] = f.y;
      }
    }
  }
}

/// float -> storage element bits, saturating for fp8 (as the host conversions do).
template <DType kKv>
__device__ __forceinline__ void store_kv(void* base, int64_t index, float value) {
  if constexpr (kKv == DType::kBFloat16) {
    static_cast<__nv_bfloat16*>(base)[index] = __float2bfloat16_rn(value);
  } else if constexpr (kKv == DType::kFloat16) {
    static_cast<__half*>(base)[index] = __float2half_rn(value);
  } else {
    constexpr __nv_fp8_interpretation_t kind = kKv == DType::kFloat8E4M3 ? __NV_E4M3 : __NV_E5M2;
    static_cast<__nv_fp8_storage_t*>(base)[index] =
        __nv_cvt_float_to_fp8(value, __NV_SATFINITE, kind);
  }
}

}  // namespace kvattn::cuda::detail
