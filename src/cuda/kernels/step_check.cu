// The step-check kernel (see step_check.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/kernels/step_check.cuh"

namespace kvattn::cuda {
namespace {

// One CTA: a decode step checks a few hundred indices, a 16K-token prefill 32 per thread
// (a few microseconds, once per step).
constexpr int kStepCheckThreads = 512;

// The largest seq_lens[i] of a step planned on the device: max_seq_len, less the request's
// encoder tokens in an encoder-decoder model (clamped as the planner clamps them).
__device__ __forceinline__ int64_t seq_len_bound(const StepCheckLaunch& c, int64_t i) {
  if (c.encoder_lens.data == nullptr) return c.max_seq_len;
  return c.max_seq_len - min(max(detail::index_at(c.encoder_lens, i), int64_t(0)), c.max_seq_len);
}

__global__ void __launch_bounds__(kStepCheckThreads) step_check_kernel(const StepCheckLaunch c) {
  __shared__ unsigned long long scratch;
  using detail::first_out_of_range;
  using detail::index_at;
  const int64_t bad_row = first_out_of_range(c.req_pool_indices, c.max_reqs, &scratch);
  const int64_t bad_loc = first_out_of_range(c.out_cache_loc, c.num_slots, &scratch);
  const int64_t bad_encoder_loc =
      first_out_of_range(c.encoder_out_cache_loc, c.num_slots, &scratch);
  const int64_t bad_encoder_len = first_out_of_range(c.encoder_lens, c.max_seq_len + 1, &scratch);
  // Each seq_len within its row: max_seq_len, less what the request's encoder tokens take in an
  // encoder-decoder model (seq_len_bound). EXTEND-like steps planned on the device: the lengths
  // against each other and the step's rows.
  __shared__ unsigned long long bad_prefix, bad_extend, rows, bad_seq;
  if (threadIdx.x == 0) bad_prefix = bad_extend = bad_seq = ~0ull, rows = 0;
  __syncthreads();
  if (c.seq_lens.data != nullptr) {
    for (int64_t i = threadIdx.x; i < c.seq_lens.length; i += blockDim.x) {
      const int64_t seq = index_at(c.seq_lens, i);
      if (seq < 0 || seq > seq_len_bound(c, i)) {
        atomicMin(&bad_seq, static_cast<unsigned long long>(i));
        break;  // later indices of this thread are larger
      }
    }
  }
  __syncthreads();
  const int64_t bad_seq_len = bad_seq != ~0ull ? int64_t(bad_seq) : INT64_MAX;
  if (c.extend_prefix_lens.data != nullptr) {
    unsigned long long local_rows = 0;
    for (int64_t i = threadIdx.x; i < c.extend_prefix_lens.length; i += blockDim.x) {
      const int64_t seq = index_at(c.seq_lens, i);
      const int64_t prefix = index_at(c.extend_prefix_lens, i);
      if (prefix < 0 || prefix > seq) atomicMin(&bad_prefix, static_cast<unsigned long long>(i));
      if (c.extend_seq_lens.data != nullptr && index_at(c.extend_seq_lens, i) != seq - prefix) {
        atomicMin(&bad_extend, static_cast<unsigned long long>(i));
      }
      local_rows += static_cast<unsigned long long>(seq - prefix);  // (two's complement sum)
    }
    atomicAdd(&rows, local_rows);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;

  StepState* state = c.state;
  StepReport report;
  report.step = __ldcg(reinterpret_cast<const unsigned long long*>(&state->step));
  for (int a = 0; a < kNumStepArguments; ++a) {
    report.position[a] = report.value[a] = report.entry[a] = report.row[a] = -1;
  }
  uint32_t error = __ldcg(&state->error);  // the index kernels' req_to_token flags
  auto record = [&](StepArgument argument, const DeviceIndexArray& a, int64_t first) {
    if (first == INT64_MAX) return;
    error |= 1u << argument;
    report.position[argument] = report.entry[argument] = first;
    report.value[argument] = index_at(a, first);
  };
  record(kArgReqPoolIndices, c.req_pool_indices, bad_row);
  record(kArgOutCacheLoc, c.out_cache_loc, bad_loc);
  record(kArgEncoderOutCacheLoc, c.encoder_out_cache_loc, bad_encoder_loc);
  record(kArgEncoderLens, c.encoder_lens, bad_encoder_len);
  if (bad_encoder_len != INT64_MAX) report.row[kArgEncoderLens] = c.max_seq_len;
  record(kArgSeqLens, c.seq_lens, bad_seq_len);
  if (bad_seq_len != INT64_MAX) report.row[kArgSeqLens] = seq_len_bound(c, bad_seq_len);
  if (bad_prefix != ~0ull) {
    const int64_t i = int64_t(bad_prefix);
    error |= 1u << kArgExtendPrefixLens;
    report.position[kArgExtendPrefixLens] = report.entry[kArgExtendPrefixLens] = i;
    report.value[kArgExtendPrefixLens] = index_at(c.extend_prefix_lens, i);
    report.row[kArgExtendPrefixLens] = index_at(c.seq_lens, i);
  }
  if (bad_extend != ~0ull) {
    const int64_t i = int64_t(bad_extend);
    error |= 1u << kArgExtendSeqLens;
    report.position[kArgExtendSeqLens] = report.entry[kArgExtendSeqLens] = i;
    report.value[kArgExtendSeqLens] = index_at(c.extend_seq_lens, i);
    report.row[kArgExtendSeqLens] = index_at(c.seq_lens, i) - index_at(c.extend_prefix_lens, i);
  } else if (c.extend_prefix_lens.data != nullptr && bad_prefix == ~0ull &&
             static_cast<int64_t>(rows) != c.num_tokens) {
    error |= 1u << kArgExtendSeqLens;
    report.position[kArgExtendSeqLens] = -1;
    report.value[kArgExtendSeqLens] = static_cast<int64_t>(rows);
    report.row[kArgExtendSeqLens] = c.num_tokens;
  }
  if (c.mask_rows_end != nullptr) {
    const int64_t needed = __ldcg(reinterpret_cast<const long long*>(c.mask_rows_end));
    const int64_t elems = __ldcg(reinterpret_cast<const long long*>(c.mask_elems));
    if (needed > elems) {
      error |= 1u << kArgCustomMask;
      report.value[kArgCustomMask] = needed;
      report.row[kArgCustomMask] = elems;
    }
  }
  const uint32_t plan_source = __ldcg(&state->plan_source);
  if (c.plan_source != 0 && plan_source != c.plan_source) {
    error |= 1u << kArgPlanSource;
    report.value[kArgPlanSource] = plan_source;
    report.row[kArgPlanSource] = c.plan_source;
  }
  if (error & (1u << kArgReqToToken)) {
    // The index kernels read only rows inside req_to_token, so the entry's row is valid here.
    const unsigned long long key =
        ~__ldcg(reinterpret_cast<const unsigned long long*>(&state->req_to_token_key));
    const int64_t entry = int64_t(key >> 32);
    const int64_t position = int64_t(key & 0xffffffffull);
    const int64_t row = c.req_pool_indices.data != nullptr && entry < c.req_pool_indices.length
                            ? index_at(c.req_pool_indices, entry)
                            : -1;
    report.entry[kArgReqToToken] = entry;
    report.position[kArgReqToToken] = position;
    report.row[kArgReqToToken] = row;
    if (c.req_to_token != nullptr && row >= 0 && row < c.max_reqs) {
      report.value[kArgReqToToken] = c.req_to_token[row * c.req_to_token_row_stride + position];
    }
  }
  if (error & (1u << kArgSharedPrefix)) {
    // A cascade step (the check kernel flags only there): the entry's row was read inside
    // req_to_token, the leader's too (req_pool_indices is checked above; a bad row reads as
    // empty and flags nothing).
    const unsigned long long key =
        ~__ldcg(reinterpret_cast<const unsigned long long*>(&state->shared_prefix_key));
    const int64_t entry = int64_t(key >> 32);
    const int64_t position = int64_t((key & 0xffffffffull) >> 1);
    report.entry[kArgSharedPrefix] = entry;
    report.position[kArgSharedPrefix] = position;
    report.shared_mask = int64_t(key & 1ull);
    auto row_of = [&](int64_t e) -> int64_t {
      return c.req_pool_indices.data != nullptr && e >= 0 && e < c.req_pool_indices.length
                 ? index_at(c.req_pool_indices, e)
                 : -1;
    };
    auto slot_at = [&](int64_t row) -> int64_t {
      return c.req_to_token != nullptr && row >= 0 && row < c.max_reqs
                 ? c.req_to_token[row * c.req_to_token_row_stride + position]
                 : -1;
    };
    const int64_t row = row_of(entry);
    report.row[kArgSharedPrefix] = row;
    report.value[kArgSharedPrefix] = slot_at(row);
    if (c.entry_group != nullptr && entry < c.req_pool_indices.length) {
      const int64_t group = c.entry_group[entry];
      report.shared_group = group;
      if (group >= 0) {
        report.shared_len = c.group_len[group];
        report.shared_leader = c.group_leader[group];
        report.shared_leader_row = row_of(report.shared_leader);
        report.shared_leader_slot = slot_at(report.shared_leader_row);
      }
    }
  }
  if (error == 0) return;
  state->error = error;  // every later kernel of the step sees it (a kernel boundary apart)
  report.error = error;
  detail::publish_step_report(c.reports, report);
}

}  // namespace

void launch_step_check(const StepCheckLaunch& launch, cudaStream_t stream) {
  step_check_kernel<<<1, kStepCheckThreads, 0, stream>>>(launch);
  check_launch("step_check_kernel");
}

}  // namespace kvattn::cuda
