// Shared-prefix (cascade) attention on the CUDA backend (issue 16), for steps whose groups the
// engine declares (ForwardBatch::shared_prefix_group_cpu / shared_prefix_lens_cpu; the host
// cannot detect groups itself: req_to_token lives on the device). A cascade step of a DECODE or
// TARGET_VERIFY batch runs, for every full-attention layer:
//   1. a gather of the grouped requests' query rows, group after group, into a 16-bit scratch
//      (convert_rows with a row list; fp32 q is rounded to the compute dtype on the way);
//   2. the shared call: each group's queries over the first shared_len slots of its leader's
//      req_to_token row, no mask, on the tensor-core prefill family (plan_prefill_tiles packs
//      members x q heads of a kv head into the tile rows, so the shared keys are read once a
//      tile, not once a request), fp32 output + natural-log LSE;
//   3. the own call: every request over its own keys [shared_len, seq_len) (an ungrouped one:
//      all of them) on the kernel a plain step would use, fp32 output + LSE;
//   4. one merge (merge_states, the ragged EXTEND's) of the two states into `out` (an ungrouped
//      request's shared state is empty: its own state passes through), leaving the merged LSE
//      where the layer's sinks want it.
// Window layers of the same model and encoder-decoder models keep the plain path.
//
// Step flow: out_graph plans both calls (CudaBackend::plan_call, upload_call) and uploads the
// group arrays below with one async copy; in_graph builds both calls' kv_indices (the shared
// call reads each leader's row) and runs the promise check (kernels/cascade.h) before the
// step-check kernel, which reports a broken promise like a bad index. Eager steps only: the
// cascade calls live outside the graph pool, and capturing a cascade step is refused.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "core/cascade.h"
#include "cuda/cuda_backend.h"
#include "cuda/kernels/index.h"

namespace kvattn::cuda {

/// One cascade step's plan and buffers (reused step after step; eager, never frozen).
struct CascadeStep {
  core::CascadePlan groups;
  CallState shared;  ///< groups' queries x shared keys (prefill family, kNone)
  CallState own;     ///< every request x its own keys (the full set's layout, keys shifted)
  int64_t shared_tokens = 0;  ///< query rows of the shared call
  int64_t num_tokens = 0;     ///< query rows of the step
  int max_shared_len = 0;

  /// int32 device arrays, one async copy from `staging` (offsets in bytes):
  size_t members = 0;       ///< [num members] batch entries, group after group
  size_t member_group = 0;  ///< [num members]
  size_t group_leader = 0;  ///< [num groups] a group's first member (its row gives the keys)
  size_t group_len = 0;     ///< [num groups]
  size_t entry_group = 0;   ///< [batch_size] group of each batch entry, -1 = none
  size_t gather_rows = 0;   ///< [shared_tokens] the step's query row of each shared-call row
  size_t shared_row = 0;    ///< [num_tokens] a token's row in the shared call, -1 = none
  Buffer arrays;
  PinnedBuffer staging;
  std::unique_ptr<CopyFence> fence;
  /// gathered q (compute dtype) | shared out (fp32) | shared LSE | own out (fp32) | own LSE
  Buffer scratch;

  const int32_t* array(size_t offset) const {
    return reinterpret_cast<const int32_t*>(static_cast<const char*>(arrays.data()) + offset);
  }
};

/// out_graph, first half: the groups and both calls' layouts, from the step's full-attention
/// layout (DECODE or TARGET_VERIFY, as core::make_paged_layout made it). The caller then plans
/// and uploads both calls (plan_call, upload_call), and calls upload_cascade_arrays.
void make_cascade_layouts(CascadeStep& step, core::CascadePlan groups,
                          const core::PagedLayout& full);

/// out_graph, second half: sizes the scratch for this step's layers (q heads, head dims, the
/// 16-bit compute dtype of the shared call) and copies the group arrays to the device.
void upload_cascade_arrays(CascadeStep& step, const BackendConfig& config, DType compute_dtype,
                           Device device, cudaStream_t stream);

/// in_graph: both calls' kv_indices (bad slots flagged in `state`), then the promise check.
/// `custom_mask` is the step's tree mask (TARGET_VERIFY; null for DECODE).
void build_cascade_indices(const CascadeStep& step, const ReqToTokenSource& source,
                           int64_t num_slots, const uint8_t* custom_mask, int draft_token_num,
                           StepState* state, cudaStream_t stream);

/// in_graph: the arrays the step-check kernel reads to describe a broken promise.
void describe_cascade_for_step_check(const CascadeStep& step, StepCheckLaunch& check);

/// forward, a full-attention layer: gather, shared call, own call, merge into `out` (io in
/// cfg.q_dtype: the config's, or the 16-bit copies'); `lse` (optional) receives the merged LSE.
void attend_cascade(const CascadeStep& step, const BackendConfig& cfg, DType compute_dtype,
                    const AttentionLayer& layer, const TensorView& q, const TensorView& out,
                    float* lse, const StepState* state, Device device, cudaStream_t stream);

}  // namespace kvattn::cuda
