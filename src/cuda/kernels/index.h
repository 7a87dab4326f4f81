// Building token-level KV index arrays on the device (the in-graph half of
// init_forward_metadata): each batch entry's slots are copied from its req_to_token row. The
// host already placed kv_start / kv_len / kv_indptr in the call's metadata; the kernels only
// copy rows, so they record into a CUDA graph with fixed launch sizes. A slot outside
// [0, num_slots) is written as slot 0 and flagged in the step's error word (step_check.h); a
// request row outside req_to_token is read as an empty row (the step-check kernel reports it).
// No kernel downstream ever reads outside the pool, and the flagged step writes nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/kernels/step_check.h"

namespace kvattn::cuda {

/// Where the rows come from: the engine's req_to_token and the batch's row indices.
struct ReqToTokenSource {
  const int32_t* table = nullptr;  ///< [max_reqs, max_context_len] device
  int64_t row_stride = 0;          ///< elements between rows
  int max_reqs = 0;
  int max_context_len = 0;
  const void* req_pool_indices = nullptr;  ///< [batch_size] int32 or int64 device
  bool req_pool_indices_int64 = false;
};

/// kv_indices[kv_indptr[r] + i] = req_to_token[req_pool_indices[e], kv_start[r] + i] for i in
/// [0, kv_len[r]) and every entry r < batch_size, e = entries[r] (or r when entries is null).
struct KvIndexBuild {
  ReqToTokenSource source;
  /// [batch_size] device: the batch entry whose row call entry r reads (a cascade step's shared
  /// call: each group's leader); null = r itself. Bad slots are flagged for that batch entry.
  const int32_t* entries = nullptr;
  const int32_t* kv_start = nullptr;   ///< [batch_size] device (call metadata)
  const int32_t* kv_len = nullptr;     ///< [batch_size] device
  const int64_t* kv_indptr = nullptr;  ///< [batch_size + 1] device
  int batch_size = 0;
  int32_t* kv_indices = nullptr;  ///< [kv_indptr[batch_size]] device
  int64_t num_slots = 0;
  StepState* step_state = nullptr;  ///< the step's error state (bad slots are flagged there)
  /// Keys the grid is sized for per entry (the step's longest; graph capture: max_context_len).
  int max_kv_len = 0;
};
void launch_build_kv_indices(const KvIndexBuild& build, cudaStream_t stream);

/// Steps one draft-index launch covers (their pointers travel in the kernel parameters).
constexpr int kMaxDraftStepsPerLaunch = 16;

/// Multi-step draft (see MultiStepDraftBackend): for step s and entry e = r * topk + b, the keys
/// are the request's prefix [0, prefix_r) followed by the branch's draft tokens of steps 0..s,
/// at req_to_token positions prefix_r + t * topk + b. Steps [first_step, first_step +
/// num_steps) in one launch; step first_step + i writes kv_indices[i] at its kv_indptr[i].
struct DraftIndexBuild {
  ReqToTokenSource source;  ///< req_pool_indices has batch_size (requests) entries
  int batch_size = 0;
  int topk = 0;
  int first_step = 0;
  int num_steps = 0;  ///< <= kMaxDraftStepsPerLaunch
  /// Per step, the host plan's arrays on the device: kv_len [batch_size * topk] (= prefix + step
  /// + 1, so the copy never outgrows the planned range) and kv_indptr [batch_size * topk + 1].
  const int32_t* kv_len[kMaxDraftStepsPerLaunch] = {};
  const int64_t* kv_indptr[kMaxDraftStepsPerLaunch] = {};
  int32_t* kv_indices[kMaxDraftStepsPerLaunch] = {};
  int64_t num_slots = 0;
  StepState* step_state = nullptr;  ///< flagged entries name the request (not the branch)
  int max_kv_len = 0;  ///< grid sizing, as in KvIndexBuild
};
void launch_build_draft_kv_indices(const DraftIndexBuild& build, cudaStream_t stream);

/// TARGET_VERIFY on a sliding-window layer, on the device (core::fold_window_into_tree_mask is
/// the host definition this follows): tree token i of request r keeps kv column j only when the
/// engine's mask allows it and column j's position (j for the prefix, positions[r * draft + t]
/// for tree token t = j - seq_r) is >= positions[r * draft + i] - window. Launch sizes depend on
/// batch_size and max_kv_len alone, so it records into a CUDA graph.
struct WindowMaskFold {
  const uint8_t* tree_mask = nullptr;    ///< [sum_r draft * kv_len_r] device (SpecInfo layout)
  uint8_t* folded = nullptr;             ///< [sum_r draft * kv_len_r] device
  const int64_t* mask_indptr = nullptr;  ///< [batch_size + 1] device (call metadata)
  const int32_t* kv_len = nullptr;       ///< [batch_size] seq_r + draft (call metadata)
  const void* positions = nullptr;       ///< [batch_size * draft] int32 or int64 device
  bool positions_int64 = false;
  int batch_size = 0;
  int draft_token_num = 0;
  int window = 0;
  int max_kv_len = 0;  ///< grid sizing: the step's longest kv_len (graph capture: max_context_len)
};
void launch_fold_window_mask(const WindowMaskFold& fold, cudaStream_t stream);

/// TARGET_VERIFY: per request, the number of leading keys every row of its tree mask keeps
/// (dense[r] = the smallest key j whose mask byte is 0 in some row, kv_len[r] when none): the
/// prefix columns an engine's mask sets to 1 (SpecInfo::custom_mask). The decode-shaped kernel
/// reads no mask byte below it (AttentionParams::mask_dense). One CTA a request, 16-byte loads;
/// launch sizes depend on batch_size alone (records into a CUDA graph).
struct MaskDensePrefix {
  const uint8_t* mask = nullptr;         ///< the mask the attention reads (folded or the engine's)
  const int64_t* mask_indptr = nullptr;  ///< [batch_size + 1] device (call metadata)
  const int32_t* qo_indptr = nullptr;    ///< [batch_size + 1] device (call metadata)
  const int32_t* kv_len = nullptr;       ///< [batch_size] device (call metadata)
  int32_t* dense = nullptr;              ///< [batch_size] device (call metadata) out
  int batch_size = 0;
};
void launch_mask_dense_prefix(const MaskDensePrefix& scan, cudaStream_t stream);

}  // namespace kvattn::cuda
