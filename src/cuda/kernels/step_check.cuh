// Device helpers of the step error word (step_check.h): the check every writing kernel makes at
// its start, and the two ways a kernel records a bad index.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/step_check.h"

namespace kvattn::cuda::detail {

/// True when the step was refused: the kernel must return without writing anything. Every CTA
/// of a launch reads the same word (no kernel of the step clears it), so either all CTAs write
/// or none does. Read after griddepcontrol.wait in a programmatic-dependent kernel; the load
/// bypasses L1 (the word was written by an earlier kernel).
__device__ __forceinline__ bool step_refused(const uint32_t* step_error) {
  return step_error != nullptr && __ldcg(step_error) != 0u;
}

/// An index kernel met req_to_token[row][position] (read by batch entry `entry`) outside the
/// pool: sets the word and keeps the smallest (entry, position) of the step.
__device__ __forceinline__ void flag_bad_req_to_token(StepState* state, int64_t entry,
                                                      int64_t position) {
  if (state == nullptr) return;
  atomicOr(&state->error, 1u << kArgReqToToken);
  const unsigned long long key =
      (static_cast<unsigned long long>(entry) << 32) | static_cast<uint32_t>(position);
  atomicMax(reinterpret_cast<unsigned long long*>(&state->req_to_token_key), ~key);
}

/// The cascade check kernel met a broken shared-prefix promise at (entry, position): a slot that
/// differs from the leader's (mask = false) or a tree mask hiding the key (mask = true). Sets the
/// word and keeps the smallest (entry, position, mask) of the step.
__device__ __forceinline__ void flag_shared_prefix(StepState* state, int64_t entry,
                                                   int64_t position, bool mask) {
  if (state == nullptr) return;
  atomicOr(&state->error, 1u << kArgSharedPrefix);
  const unsigned long long key = (static_cast<unsigned long long>(entry) << 32) |
                                 (static_cast<uint32_t>(position) << 1) | (mask ? 1u : 0u);
  atomicMax(reinterpret_cast<unsigned long long*>(&state->shared_prefix_key), ~key);
}

/// Writes `report` into the host ring (one thread). The fields land before `step`, which the
/// host reads first.
__device__ __forceinline__ void publish_step_report(StepReport* ring, const StepReport& report) {
  if (ring == nullptr) return;
  StepReport* r = ring + (report.step % kStepReportRing);
  r->error = report.error;
  for (int a = 0; a < kNumStepArguments; ++a) {
    r->position[a] = report.position[a];
    r->value[a] = report.value[a];
    r->entry[a] = report.entry[a];
    r->row[a] = report.row[a];
  }
  r->shared_group = report.shared_group;
  r->shared_len = report.shared_len;
  r->shared_leader = report.shared_leader;
  r->shared_leader_row = report.shared_leader_row;
  r->shared_leader_slot = report.shared_leader_slot;
  r->shared_mask = report.shared_mask;
  __threadfence_system();
  *reinterpret_cast<volatile uint64_t*>(&r->step) = report.step;
  __threadfence_system();
}

__device__ __forceinline__ int64_t index_at(const DeviceIndexArray& a, int64_t i) {
  return a.int64 ? static_cast<const int64_t*>(a.data)[i]
                 : static_cast<const int32_t*>(a.data)[i];
}

/// The first i in [0, a.length) with a[i] outside [0, limit), or INT64_MAX; one CTA, every
/// thread of it must call (it synchronises the block). `scratch` is a __shared__ word.
__device__ __forceinline__ int64_t first_out_of_range(const DeviceIndexArray& a, int64_t limit,
                                                      unsigned long long* scratch) {
  if (threadIdx.x == 0) *scratch = ~0ull;
  __syncthreads();
  if (a.data != nullptr) {
    for (int64_t i = threadIdx.x; i < a.length; i += blockDim.x) {
      const int64_t value = index_at(a, i);
      if (value < 0 || value >= limit) {
        atomicMin(scratch, static_cast<unsigned long long>(i));
        break;  // later indices of this thread are larger
      }
    }
  }
  __syncthreads();
  const unsigned long long first = *scratch;
  __syncthreads();
  return first == ~0ull ? INT64_MAX : static_cast<int64_t>(first);
}

}  // namespace kvattn::cuda::detail
