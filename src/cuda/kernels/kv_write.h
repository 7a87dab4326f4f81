// Writing a step's new K/V into the paged cache on the device (set_kv_buffer). fp8 storage holds
// k / k_scale and v / v_scale, saturated to the largest finite value. Nothing is written when the
// step's error word is set (step_check.h); a slot outside the pool is never written.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/kernels/step_check.h"
#include "kvattn/dtype.h"

namespace kvattn::cuda {

struct KvWriteLaunch {
  const void* k = nullptr;  ///< [num_tokens, num_kv_heads, head_dim] io_dtype
  int64_t k_stride_token = 0;
  int64_t k_stride_head = 0;
  const void* v = nullptr;  ///< [num_tokens, num_kv_heads, v_head_dim] io_dtype
  int64_t v_stride_token = 0;
  int64_t v_stride_head = 0;
  DType io_dtype = DType::kBFloat16;
  const void* loc = nullptr;  ///< [num_tokens] int32 or int64 slots
  bool loc_int64 = false;
  int64_t num_tokens = 0;
  void* k_cache = nullptr;  ///< [num_slots, num_kv_heads, head_dim] kv_dtype
  int64_t k_cache_stride_token = 0;
  int64_t k_cache_stride_head = 0;
  void* v_cache = nullptr;  ///< [num_slots, num_kv_heads, v_head_dim] kv_dtype
  int64_t v_cache_stride_token = 0;
  int64_t v_cache_stride_head = 0;
  DType kv_dtype = DType::kBFloat16;
  float k_scale = 1.f;  ///< fp8 only: stored = k / k_scale
  float v_scale = 1.f;
  int num_kv_heads = 0;
  int head_dim = 0;
  int v_head_dim = 0;
  int64_t num_slots = 0;
  /// The step's error state: the launch writes nothing when its word is set.
  StepState* step_state = nullptr;
  /// true when the step-check kernel did not see `loc` (the draft runner's per-step slots, or a
  /// forward given other slots than its init_forward_metadata): every CTA then checks all of loc
  /// before writing, so one bad slot means no CTA writes; it sets the step's word (refusing the
  /// rest of the step) and publishes the first bad slot as `loc_argument` into `reports`.
  bool check_loc = false;
  StepReport* reports = nullptr;  ///< [kStepReportRing] mapped host memory
  StepArgument loc_argument = kArgOutCacheLoc;
};

/// Asynchronous on `stream`; throws kDeviceError when the launch fails.
void launch_kv_write(const KvWriteLaunch& launch, cudaStream_t stream);

}  // namespace kvattn::cuda

namespace kvattn::cuda {

/// Copies a [rows, heads, dim] view into another of a different io dtype (fp32 <-> bf16/fp16),
/// rounding to nearest (or of the same dtype: a plain copy), optionally gathering rows. The CUDA backend runs fp32 EXTEND-like steps through the 16-bit
/// tensor-core kernel this way.
struct ConvertRowsLaunch {
  const void* src = nullptr;  ///< [rows, heads, dim] src_dtype
  int64_t src_stride_token = 0;
  int64_t src_stride_head = 0;
  DType src_dtype = DType::kFloat32;
  void* dst = nullptr;  ///< [rows, heads, dim] dst_dtype
  int64_t dst_stride_token = 0;
  int64_t dst_stride_head = 0;
  DType dst_dtype = DType::kBFloat16;
  int64_t rows = 0;
  int heads = 0;
  int dim = 0;
  /// [rows] device, or null: dst row i is src row src_rows[i] (a gather: the cascade step's
  /// grouped queries) instead of src row i.
  const int32_t* src_rows = nullptr;
  const uint32_t* step_error = nullptr;  ///< the step's error word: nothing is written when set
};
void launch_convert_rows(const ConvertRowsLaunch& launch, cudaStream_t stream);

}  // namespace kvattn::cuda
