// The parameters of one batched attention call, as every kernel (CPU or CUDA) receives them.
// Plain data, no methods that allocate, so the same struct goes to a CUDA kernel by value.
#pragma once

#include <cstdint>

#include "core/batch_layout.h"
#include "kvattn/dtype.h"

namespace kvattn::core {

struct AttentionParams {
  // ---- queries and outputs -------------------------------------------------------------
  const void* q = nullptr;  ///< [num_tokens, num_q_heads, head_dim], io_dtype
  int64_t q_stride_token = 0;
  int64_t q_stride_head = 0;
  void* out = nullptr;  ///< [num_tokens, num_q_heads, v_head_dim], io_dtype
  int64_t out_stride_token = 0;
  int64_t out_stride_head = 0;
  float* lse = nullptr;  ///< [num_tokens, num_q_heads] natural-log LSE, optional
  DType io_dtype = DType::kBFloat16;
  /// CUDA prefill kernel: out is fp32 instead of io_dtype (a partial state another kernel
  /// merges: the ragged + prefix EXTEND keeps both partial outputs unrounded). The CPU kernels
  /// take their output dtype as an argument instead.
  bool out_fp32 = false;
  /// BackendConfig::deterministic: the CPU kernels' tiles and KV split chunks depend on the
  /// request alone (not on the batch's longest request or the thread count).
  bool deterministic = false;

  // ---- keys and values ---------------------------------------------------------------------
  /// Paged: [num_slots, num_kv_heads, dim] and kv_indices gives each token's slot.
  /// Ragged (kv_indices == nullptr): token j of request r is row kv_indptr[r] + j.
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t k_stride_token = 0;
  int64_t k_stride_head = 0;
  int64_t v_stride_token = 0;
  int64_t v_stride_head = 0;
  DType kv_dtype = DType::kBFloat16;
  float k_scale = 1.f;  ///< fp8 storage: stored value * k_scale is the key
  float v_scale = 1.f;

  // ---- the batch ----------------------------------------------------------------------------
  int batch_size = 0;
  const int32_t* qo_indptr = nullptr;   ///< [batch_size + 1]
  const int64_t* kv_indptr = nullptr;   ///< [batch_size + 1]
  const int32_t* kv_indices = nullptr;  ///< [kv_indptr[batch_size]] slot per token, or null
  /// Paged: slots in the pool (kernels never read outside it). Ragged: rows of k and v
  /// (0 = unknown; the Hopper prefill then copies row by row instead of by tensor map).
  int64_t num_slots = 0;

  // ---- mask and logits ------------------------------------------------------------------
  MaskMode mask = MaskMode::kCausal;
  const uint8_t* custom_mask = nullptr;  ///< kCustom: per request [q_len, kv_len], row-major
  const int64_t* mask_indptr = nullptr;  ///< [batch_size + 1] offsets into custom_mask
  /// kCustom, optional (null: none): keys j < mask_dense[r] are visible to every query of
  /// request r, so a kernel may skip reading the mask there (TARGET_VERIFY: the prefix columns,
  /// found on the device by launch_mask_dense_prefix). The decode-shaped kernel (kTcDecode)
  /// also takes mask rows shorter than kv_len: a row then covers the last row_len keys and the
  /// keys before them are visible (the multi-step draft's branch masks); the other kernels
  /// need row_len >= kv_len.
  const int32_t* mask_dense = nullptr;
  int window_left = -1;
  float sm_scale = 1.f;
  float logit_cap = 0.f;

  // ---- shape --------------------------------------------------------------------------------
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int v_head_dim = 0;

  // ---- the step's error word (CUDA; null on the CPU backend, which validates on the host) ----
  /// Device pointer to the step's error word (cuda::StepState::error, cuda/kernels/step_check.h),
  /// or null (no check). Contract for every CUDA kernel that receives these params: read the word
  /// once at the start of each CTA, before any global write (in a kernel launched as a
  /// programmatic dependent: after griddepcontrol.wait, since earlier kernels of the step set
  /// it), with a load that bypasses L1 (cuda::detail::step_refused does both the null test and
  /// the __ldcg); when it is not 0, return at once and write nothing: no out, no lse, no
  /// partial-state scratch, no K/V. The word does not change while a step's attention kernels run
  /// (only the step-check kernel and the K/V save before them set it), so all CTAs of a launch
  /// agree. The caller then discards out/lse: they hold what they held before the call.
  const uint32_t* step_error = nullptr;
};

}  // namespace kvattn::core
