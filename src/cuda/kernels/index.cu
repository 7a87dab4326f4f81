// Device index building (see index.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/kernels/index.cuh"
#include "cuda/kernels/step_check.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

constexpr int kIndexThreads = 256;
// Each CTA copies this many keys per pass: one int32 per thread, 4 passes in flight.
constexpr int kKeysPerIndexCta = 4 * kIndexThreads;
// More CTAs per entry than this only adds launch size (a 32K-key row needs 32).
constexpr int kMaxIndexCtasPerEntry = 64;

using detail::source_row;

// The slot at `position` of `row`; a slot outside the pool (or a position outside the row, which
// the host's length checks rule out) reads as slot 0 and is flagged for batch entry `entry`.
__device__ __forceinline__ int32_t checked_slot(const int32_t* row, int64_t position,
                                                const ReqToTokenSource& s, int64_t num_slots,
                                                StepState* state, int64_t entry) {
  if (row == nullptr) return 0;
  if (position < 0 || position >= s.max_context_len) {
    detail::flag_bad_req_to_token(state, entry, position < 0 ? 0 : s.max_context_len - 1);
    return 0;
  }
  const int32_t slot = row[position];
  if (slot < 0 || slot >= num_slots) {
    detail::flag_bad_req_to_token(state, entry, position);
    return 0;
  }
  return slot;
}

__global__ void __launch_bounds__(kIndexThreads) build_kv_indices_kernel(const KvIndexBuild b) {
  const int request = int(blockIdx.y);
  const int entry = b.entries != nullptr ? b.entries[request] : request;
  const int32_t* row = source_row(b.source, entry);
  const int64_t start = b.kv_start[request];
  const int64_t len = b.kv_len[request];
  int32_t* out = b.kv_indices + b.kv_indptr[request];
  for (int64_t i = int64_t(blockIdx.x) * kIndexThreads + threadIdx.x; i < len;
       i += int64_t(gridDim.x) * kIndexThreads) {
    out[i] = checked_slot(row, start + i, b.source, b.num_slots, b.step_state, entry);
  }
}

__global__ void __launch_bounds__(kIndexThreads)
    build_draft_kv_indices_kernel(const DraftIndexBuild b) {
  const int entry = int(blockIdx.y);  // request * topk + branch
  const int local_step = int(blockIdx.z);
  const int step = b.first_step + local_step;
  const int request = entry / b.topk;
  const int branch = entry % b.topk;
  const int32_t* row = source_row(b.source, request);
  const int64_t len = b.kv_len[local_step][entry];
  const int64_t prefix = len - step - 1;
  int32_t* out = b.kv_indices[local_step] + b.kv_indptr[local_step][entry];
  for (int64_t i = int64_t(blockIdx.x) * kIndexThreads + threadIdx.x; i < len;
       i += int64_t(gridDim.x) * kIndexThreads) {
    // Key i: a prefix token, or the branch's draft token of step i - prefix.
    const int64_t position = i < prefix ? i : prefix + (i - prefix) * b.topk + branch;
    out[i] = checked_slot(row, position, b.source, b.num_slots, b.step_state, request);
  }
}

__device__ __forceinline__ int64_t position_at(const WindowMaskFold& f, int64_t index) {
  return f.positions_int64 ? static_cast<const int64_t*>(f.positions)[index]
                           : static_cast<const int32_t*>(f.positions)[index];
}

__global__ void __launch_bounds__(kIndexThreads) fold_window_mask_kernel(const WindowMaskFold f) {
  const int request = int(blockIdx.y);
  const int64_t kv_len = f.kv_len[request];
  const int64_t seq = kv_len - f.draft_token_num;
  const int64_t base = f.mask_indptr[request];
  const int64_t count = kv_len * f.draft_token_num;
  const int64_t tree = int64_t(request) * f.draft_token_num;
  for (int64_t e = int64_t(blockIdx.x) * kIndexThreads + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * kIndexThreads) {
    const int64_t i = e / kv_len;
    const int64_t j = e - i * kv_len;
    const int64_t lowest = position_at(f, tree + i) - f.window;
    const int64_t pos_j = j < seq ? j : position_at(f, tree + (j - seq));
    f.folded[base + e] = f.tree_mask[base + e] != 0 && pos_j >= lowest ? 1 : 0;
  }
}

uint32_t ctas_per_entry(int max_kv_len) {
  const int wanted = (std::max(max_kv_len, 1) + kKeysPerIndexCta - 1) / kKeysPerIndexCta;
  return uint32_t(std::min(wanted, kMaxIndexCtasPerEntry));
}

}  // namespace

void launch_fold_window_mask(const WindowMaskFold& f, cudaStream_t stream) {
  if (f.batch_size == 0 || f.draft_token_num == 0) return;
  check_arg(f.batch_size < 65536, "batch_size", "got ", f.batch_size, ", expected < 65536");
  // A request's mask holds draft x kv_len bytes: size the grid as for that many keys.
  const int64_t elements = int64_t(std::max(f.max_kv_len, 1)) * f.draft_token_num;
  const int ctas = int(std::min<int64_t>((elements + kKeysPerIndexCta - 1) / kKeysPerIndexCta,
                                         kMaxIndexCtasPerEntry));
  const dim3 grid(uint32_t(ctas), uint32_t(f.batch_size));
  fold_window_mask_kernel<<<grid, kIndexThreads, 0, stream>>>(f);
  check_launch("fold_window_mask_kernel");
}

void launch_build_kv_indices(const KvIndexBuild& b, cudaStream_t stream) {
  if (b.batch_size == 0) return;
  check_arg(b.batch_size < 65536, "batch_size", "got ", b.batch_size, ", expected < 65536");
  const dim3 grid(ctas_per_entry(b.max_kv_len), uint32_t(b.batch_size));
  build_kv_indices_kernel<<<grid, kIndexThreads, 0, stream>>>(b);
  check_launch("build_kv_indices_kernel");
}

void launch_build_draft_kv_indices(const DraftIndexBuild& b, cudaStream_t stream) {
  if (b.batch_size == 0) return;
  check_arg(int64_t(b.batch_size) * b.topk < 65536, "batch_size",
            "batch_size * topk = ", int64_t(b.batch_size) * b.topk, ", expected < 65536");
  check_arg(b.num_steps >= 1 && b.num_steps <= kMaxDraftStepsPerLaunch, "num_steps", "got ",
            b.num_steps, ", expected 1..", kMaxDraftStepsPerLaunch, " per launch");
  const dim3 grid(ctas_per_entry(b.max_kv_len), uint32_t(b.batch_size * b.topk),
                  uint32_t(b.num_steps));
  build_draft_kv_indices_kernel<<<grid, kIndexThreads, 0, stream>>>(b);
  check_launch("build_draft_kv_indices_kernel");
}

}  // namespace kvattn::cuda
