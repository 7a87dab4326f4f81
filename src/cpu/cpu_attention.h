// The CPU attention kernels: one batched attention call (decode, prefill/extend, verify, ragged)
// described by core::AttentionParams, run on a thread pool, and the merge of two partial
// attention states.
//
// Work split: a tile is (request, kv head, up to 64 packed query rows = tokens x the q heads of
// the kv head's GQA group), so every K/V element is widened to float once per tile and serves all
// of the group's heads. Prefill tiles widen a block of keys into scratch; decode-like tiles (few
// rows per kv head) read K/V straight from the pool and take every kv head of the request in one
// work item, so each key's slot is read front to back. Work items holding much more than a fair
// share per thread are split along the KV axis; each piece leaves a partial (output, LSE) and a
// second pass merges them with core::merge_weights (the same merge as the ragged + prefix path).
#pragma once

#include <cstdint>
#include <memory>

#include "core/attention_params.h"
#include "kvattn/tensor.h"
#include "cpu/thread_pool.h"

namespace kvattn::cpu {

/// Scratch memory that attention calls reuse (per-thread tiles, split-KV partials, the plan).
/// One per backend; not shared by concurrent calls.
class AttentionWorkspace {
 public:
  AttentionWorkspace();
  ~AttentionWorkspace();
  AttentionWorkspace(const AttentionWorkspace&) = delete;
  AttentionWorkspace& operator=(const AttentionWorkspace&) = delete;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// Runs the attention `params` describes. q is in params.io_dtype; params.out is written in
/// `out_dtype` (fp32/bf16/fp16; the ragged path asks for fp32 to merge without rounding). Rows
/// that see no key get a zero output and LSE -inf. head_dim and v_head_dim must be multiples of
/// 8 (throws kNotSupported otherwise). Paged calls check every kv_indices entry against
/// params.num_slots before reading (throws kInvalidArgument naming "kv_indices[i]").
void run_attention(const core::AttentionParams& params, DType out_dtype, ThreadPool& pool,
                   AttentionWorkspace& workspace);

/// out = merge of two partial states per (token, q head) with core::merge_weights:
///   out_a, out_b  [num_tokens, num_q_heads, v_head_dim] fp32, each normalized
///   lse_a, lse_b  [num_tokens, num_q_heads] natural-log LSE (-inf: empty)
///   out           rows at out + token * out_stride_token + head * out_stride_head (elements)
///   lse_out       [num_tokens, num_q_heads] merged LSE, optional
void merge_attention_states(const float* out_a, const float* lse_a, const float* out_b,
                            const float* lse_b, int64_t num_tokens, int num_q_heads,
                            int v_head_dim, void* out, int64_t out_stride_token,
                            int64_t out_stride_head, DType out_dtype, float* lse_out,
                            ThreadPool& pool);

/// Attention sinks on finished outputs: row (token, head) of `out` (out_dtype, strides in
/// elements) is scaled by e^(lse) / (e^(lse) + e^(s_h)) = 1 / (1 + e^(s_h - lse)), the softmax
/// with the sink as one more key whose value is zero (lse: the row's natural-log LSE without the
/// sink; -inf leaves the zero row as it is). `sinks` is a host [num_q_heads] fp32/bf16/fp16
/// vector. lse is updated to include the sink when lse_out is given.
void apply_sinks(const TensorView& sinks, const float* lse, int64_t num_tokens, int num_q_heads,
                 int v_head_dim, void* out, int64_t out_stride_token, int64_t out_stride_head,
                 DType out_dtype, ThreadPool& pool);

}  // namespace kvattn::cpu
