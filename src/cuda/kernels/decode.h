// Batch decode over the paged KV cache on CUDA cores (one query row per batch entry), its
// split-KV merge, and the facts the planner needs about it. Host-callable from plain C++.
//
// One CTA runs one (work item, kv head, head pass): a chunk of one request's keys for up to
// kDecodeHeadsPerCta q heads of that kv head's GQA group. K/V rows stream through shared memory
// with cp.async (16-byte copies, kDecodeStages deep; each thread reads back only what it copied,
// so the main loop has no barrier), the online softmax runs in fp32 in the log2 domain, and the
// CTA's token streams are merged in shared memory at the end. Split items write a partial
// (normalized output, natural-log LSE) that launch_decode's merge kernel folds with
// core::merge_weights. (Folding them in the decode kernel, by the CTA that finishes a request's
// last piece, was measured slower: bench/NOTES.md.)
//
// Supported: q/out fp32, bf16 or fp16; KV bf16, fp16, fp8 e4m3 / e5m2 (times k_scale/v_scale);
// head_dim and v_head_dim multiples of 8 up to the largest compiled head_dim (64/128/256);
// soft-cap; any number of q heads per kv head (groups above kDecodeHeadsPerCta run in passes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/attention_params.h"
#include "core/planner.h"

namespace kvattn::cuda {

/// q heads of one GQA group that one CTA handles (its per-thread register budget).
constexpr int kDecodeHeadsPerCta = 4;

/// What the planner and the backend need to know about the decode kernel for a shape.
struct DecodeKernelInfo {
  int compiled_head_dim = 0;  ///< the instance used: the smallest compiled >= both head dims
  int ctas_per_sm = 0;        ///< resident CTAs per SM (occupancy)
  int tile_tokens = 0;        ///< keys a CTA consumes per pipeline step (chunk alignment)
  int head_passes = 0;        ///< ceil(group / kDecodeHeadsPerCta)
};
/// Throws kNotSupported naming the values when no compiled instance serves the shape.
DecodeKernelInfo decode_kernel_info(int head_dim, int v_head_dim, DType kv_dtype, int group_size,
                                    int device);

/// One decode launch. `params` carries q, out, lse (optional), K/V buffers with strides,
/// kv_indptr / kv_indices (device, from the call's metadata), num_slots, scale, soft-cap, fp8
/// scales and the head shape; params.batch_size entries, query row r of entry r.
struct DecodeLaunch {
  core::AttentionParams params;
  const core::DecodeWorkItem* items = nullptr;  ///< [item capacity] device
  const int32_t* num_items = nullptr;           ///< [1] device: items of the current plan
  int grid_items = 0;  ///< items the grid covers (>= *num_items; graph capture: the capacity)
  const int32_t* merge_indptr = nullptr;  ///< [batch_size + 1] device
  float* partial_out = nullptr;           ///< [item capacity, num_q_heads, v_head_dim]
  float* partial_lse = nullptr;           ///< [item capacity, num_q_heads]
  bool has_partials = true;  ///< false when the plan split nothing (skips the merge launch;
                             ///< graph capture must pass true)
};

/// Launches the decode kernel and (when has_partials) the merge, asynchronously on `stream`,
/// both as programmatic dependents of what precedes them (kernels/launch.cuh).
/// Throws kNotSupported for an uncompiled shape and kDeviceError when a launch fails.
void launch_decode(const DecodeLaunch& launch, int device, cudaStream_t stream);

/// Ragged + paged-prefix (and cascade shared + own) merge of two attention states (SPEC §3):
/// out = (o_a * e^(lse_a - m) + o_b * e^(lse_b - m)) / (...), per (token, q head), through
/// core::merge_weights. o_a / o_b are partial_dtype, out is io_dtype, each with its strides
/// (elements); the LSEs are float [num_tokens, num_heads] natural log; lse_out is optional.
/// The backend keeps both partials in fp32, so the output is rounded once, as a one-pass kernel's.
struct MergeStatesLaunch {
  const void* o_a = nullptr;  ///< [num_tokens, num_heads, v_head_dim]
  const float* lse_a = nullptr;
  const void* o_b = nullptr;  ///< [num_tokens, num_heads, v_head_dim]
  const float* lse_b = nullptr;
  void* out = nullptr;  ///< [num_tokens, num_heads, v_head_dim] (may alias o_a when the
                        ///< dtypes and strides agree)
  float* lse_out = nullptr;  ///< [num_tokens, num_heads] or null
  int64_t stride_token = 0;  ///< of out
  int64_t stride_head = 0;
  int64_t a_stride_token = 0;  ///< of o_a
  int64_t a_stride_head = 0;
  int64_t b_stride_token = 0;  ///< of o_b
  int64_t b_stride_head = 0;
  DType partial_dtype = DType::kFloat32;  ///< of o_a and o_b
  DType io_dtype = DType::kBFloat16;      ///< of out
  /// [num_tokens] device, or null: token t's state a is row a_rows[t] of o_a / lse_a (its
  /// token index under a's strides; -1: an empty state, out = b) instead of row t. The cascade
  /// step's shared states are per grouped query, in member order.
  const int32_t* a_rows = nullptr;
  int64_t num_tokens = 0;
  int num_heads = 0;
  int v_head_dim = 0;
  const uint32_t* step_error = nullptr;  ///< the step's error word: nothing is written when set
};
void launch_merge_states(const MergeStatesLaunch& launch, cudaStream_t stream);

/// Attention sinks on a finished output (AttentionLayer::sinks): the merge of each row's state
/// with the sink's (a zero value vector at logit s_h), in place: row (token, head) of `out` is
/// scaled by 1 / (1 + e^(s_h - lse)), lse the row's natural-log LSE without the sink (-inf: the
/// row is zero and stays zero).
struct ApplySinksLaunch {
  void* out = nullptr;  ///< [num_tokens, num_heads, v_head_dim] out_dtype, strides in elements
  DType out_dtype = DType::kBFloat16;
  int64_t stride_token = 0;
  int64_t stride_head = 0;
  const float* lse = nullptr;   ///< [num_tokens, num_heads]
  const void* sinks = nullptr;  ///< [num_heads] sinks_dtype
  DType sinks_dtype = DType::kFloat32;
  int64_t num_tokens = 0;
  int num_heads = 0;
  int v_head_dim = 0;
  const uint32_t* step_error = nullptr;  ///< the step's error word: nothing is written when set
};
void launch_apply_sinks(const ApplySinksLaunch& launch, cudaStream_t stream);

}  // namespace kvattn::cuda

namespace kvattn::cuda::detail {
/// The split-KV merge of launch_decode (merge.cu): folds each split request's partial states.
void launch_decode_merge(const DecodeLaunch& launch, cudaStream_t stream);
}  // namespace kvattn::cuda::detail
