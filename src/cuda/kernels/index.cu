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

// The first zero byte's index in [0, n) of `bytes` (n <= 4 bytes of a word), or -1.
__device__ __forceinline__ int first_zero_byte(uint32_t word) {
  const uint32_t zeros = (word - 0x01010101u) & ~word & 0x80808080u;  // exact for the lowest one
  return zeros == 0 ? -1 : (__ffs(zeros) - 1) / 8;
}

constexpr int kScanThreads = 256;

__global__ void __launch_bounds__(kScanThreads) mask_dense_prefix_kernel(const MaskDensePrefix m) {
  __shared__ int first_zero_key;
  const int request = int(blockIdx.x);
  const int kv_len = m.kv_len[request];
  if (threadIdx.x == 0) first_zero_key = kv_len;
  __syncthreads();
  const int q_len = m.qo_indptr[request + 1] - m.qo_indptr[request];
  const int64_t begin = m.mask_indptr[request];
  const int64_t row_len = q_len > 0 ? (m.mask_indptr[request + 1] - begin) / q_len : 0;
  const int64_t skip = row_len - kv_len;  // columns before key 0 (< 0: keys before column 0)
  const int64_t c0 = skip > 0 ? skip : 0;
  const int lane = int(threadIdx.x) & 31;
  // A warp a row; lanes take the row's bytes in 16-byte chunks (bytes before the first aligned
  // chunk and after the last one singly). found: this lane's smallest zero column, or INT64_MAX.
  for (int i = int(threadIdx.x) / 32; i < q_len; i += kScanThreads / 32) {
    const uint8_t* row = m.mask + begin + i * row_len;
    const int64_t head_end =
        min(row_len, c0 + int64_t((16 - (reinterpret_cast<uintptr_t>(row + c0) & 15)) & 15));
    const int64_t chunks = (row_len - head_end) / 16;
    const int64_t tail = head_end + chunks * 16;
    int64_t found = INT64_MAX;
    for (int64_t c = c0 + lane; c < head_end; c += 32) {
      if (row[c] == 0) found = min(found, c);
    }
    for (int64_t c = tail + lane; c < row_len; c += 32) {
      if (row[c] == 0) found = min(found, c);
    }
    const uint4* body = reinterpret_cast<const uint4*>(row + head_end);
    for (int64_t base = 0; base < chunks; base += 4 * 32) {  // warp-uniform; 4 loads a lane
      const int64_t k = base + lane;
      uint4 v[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        v[t] = k + t * 32 < chunks ? __ldg(body + k + t * 32) : make_uint4(~0u, ~0u, ~0u, ~0u);
      }
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const uint32_t w[4] = {v[t].x, v[t].y, v[t].z, v[t].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int b = first_zero_byte(w[q]);
          if (b >= 0) found = min(found, head_end + (k + t * 32) * 16 + q * 4 + b);
        }
      }
      if (__any_sync(0xffffffffu, found != INT64_MAX)) break;  // later chunks only go higher
    }
    if (found != INT64_MAX) atomicMin(&first_zero_key, int(found - skip));
  }
  __syncthreads();
  if (threadIdx.x == 0) m.dense[request] = max(0, first_zero_key);
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

void launch_mask_dense_prefix(const MaskDensePrefix& m, cudaStream_t stream) {
  if (m.batch_size == 0) return;
  mask_dense_prefix_kernel<<<uint32_t(m.batch_size), kScanThreads, 0, stream>>>(m);
  check_launch("mask_dense_prefix_kernel");
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
