// The device check of a cascade step's promise (ForwardBatch::shared_prefix_lens_cpu): the
// engine declares which requests share how many leading req_to_token slots; the host cannot read
// req_to_token (device memory) without a sync, so this kernel compares, in in_graph before the
// step-check kernel, every member's shared slots with its group leader's and (TARGET_VERIFY)
// checks that every tree token's mask shows the shared keys. A broken promise is flagged in the
// step's error word (kArgSharedPrefix, step_check.h): the step writes nothing and check_errors
// reports it, naming shared_prefix_lens_cpu[g] and the request. The kernel reads only rows and
// positions inside req_to_token (the host validated every length against max_context_len) and
// reads no KV.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/kernels/index.h"
#include "cuda/kernels/step_check.h"

namespace kvattn::cuda {

struct SharedPrefixCheck {
  ReqToTokenSource source;                ///< the batch's rows (req_pool_indices of the batch)
  const int32_t* members = nullptr;       ///< [num_members] batch entries, group after group
  const int32_t* member_group = nullptr;  ///< [num_members] group of each member
  const int32_t* group_leader = nullptr;  ///< [num_groups] batch entry of each group's leader
  const int32_t* group_len = nullptr;     ///< [num_groups] shared positions of each group
  int num_members = 0;
  int max_shared_len = 0;  ///< grid sizing: the longest shared length of the step
  /// TARGET_VERIFY: the step's tree mask (SpecInfo layout), its per-entry offsets (int64
  /// [batch_size + 1]) and tree tokens per request; null mask = DECODE (no mask to check).
  const uint8_t* custom_mask = nullptr;
  const int64_t* mask_indptr = nullptr;
  int draft_token_num = 0;
  StepState* step_state = nullptr;
};
void launch_check_shared_prefix(const SharedPrefixCheck& check, cudaStream_t stream);

}  // namespace kvattn::cuda
