// Merging attention states: the split-KV reduction of decode and the ragged + paged-prefix merge
// of EXTEND. Both go through core::merge_weights, the one definition of the merge numerics.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/softmax_state.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/decode.h"
#include "cuda/kernels/decode_numerics.cuh"
#include "cuda/kernels/launch.cuh"
#include "cuda/kernels/step_check.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace detail {
namespace {

constexpr int kMergeThreads = 128;

// Split-KV reduction: one CTA per (batch entry, q head). Each warp folds every kMergeWarps-th
// partial, loading kMergeBatch of them at once so their latencies overlap (a one-at-a-time fold
// over 64 partials waited 64 L2 round trips), then the warps' states are folded in shared
// memory. Entries that were not split (an empty partial range) were written by the decode
// kernel itself.
constexpr int kDecodeMergeThreads = 256;
constexpr int kMergeWarps = kDecodeMergeThreads / 32;
constexpr int kMergeBatch = 8;  // 64 partials: one round of loads per warp

// kMaxDimsPerLane = 4 serves v_head_dim <= 128, 8 up to 256: sized to the shape, the registers
// stay under 64 and 4 CTAs fit an SM (a batch-16 split step has 512 merge CTAs: one wave, not
// two, which the 8-wide arrays cost at v_head_dim 128).
template <int kMaxDimsPerLane>
__global__ void __launch_bounds__(kDecodeMergeThreads, kMaxDimsPerLane == 4 ? 4 : 2)
    decode_merge_kernel(const DecodeLaunch launch) {
  const core::AttentionParams& p = launch.params;
  const int request = int(blockIdx.x);
  const int head = int(blockIdx.y);
  // The partial ranges came with the call's metadata, copied before the decode kernel started
  // (and this grid starts only after it has): readable before the wait, overlapping it.
  const int first = launch.merge_indptr[request];
  const int last = launch.merge_indptr[request + 1];
  // Launched as a programmatic dependent of the decode kernel: wait until its partial states
  // are complete and visible.
  ptx::grid_dependency_wait();
  // The next kernel (the next layer's decode, also a programmatic dependent) may be scheduled
  // now; it waits for this grid's completion before reading anything.
  ptx::grid_launch_dependents();
  if (first == last || step_refused(p.step_error)) return;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  float lse = -INFINITY;
  float out[kMaxDimsPerLane];
#pragma unroll
  for (int j = 0; j < kMaxDimsPerLane; ++j) out[j] = 0.f;
  for (int base = first + warp * kMergeBatch; base < last; base += kMergeWarps * kMergeBatch) {
    float part_lse[kMergeBatch];
    float part_out[kMergeBatch][kMaxDimsPerLane];
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      const int part = base + b;
      const bool valid = part < last;
      const int64_t row = int64_t(valid ? part : first) * p.num_q_heads + head;
      part_lse[b] = valid ? launch.partial_lse[row] : -INFINITY;
#pragma unroll
      for (int j = 0; j < kMaxDimsPerLane; ++j) {
        const int dim = lane + 32 * j;
        part_out[b][j] =
            valid && dim < p.v_head_dim ? launch.partial_out[row * p.v_head_dim + dim] : 0.f;
      }
    }
#pragma unroll
    for (int b = 0; b < kMergeBatch; ++b) {
      float w_acc, w_part, merged;
      core::merge_weights(lse, part_lse[b], &w_acc, &w_part, &merged);
#pragma unroll
      for (int j = 0; j < kMaxDimsPerLane; ++j) out[j] = w_acc * out[j] + w_part * part_out[b][j];
      lse = merged;
    }
  }
  __shared__ float warp_lse[kMergeWarps];
  __shared__ float warp_out[kMergeWarps][32 * kMaxDimsPerLane];
  if (lane == 0) warp_lse[warp] = lse;
#pragma unroll
  for (int j = 0; j < kMaxDimsPerLane; ++j) warp_out[warp][lane + 32 * j] = out[j];
  __syncthreads();
  for (int dim = int(threadIdx.x); dim < p.v_head_dim; dim += kDecodeMergeThreads) {
    float total_lse = -INFINITY;
    float value = 0.f;
    for (int w = 0; w < kMergeWarps; ++w) {
      float w_acc, w_part, merged;
      core::merge_weights(total_lse, warp_lse[w], &w_acc, &w_part, &merged);
      value = w_acc * value + w_part * warp_out[w][dim];
      total_lse = merged;
    }
    store_io(p.out, p.out_fp32 ? DType::kFloat32 : p.io_dtype,
             int64_t(request) * p.out_stride_token + int64_t(head) * p.out_stride_head + dim,
             value);
    if (dim == 0 && p.lse != nullptr) p.lse[int64_t(request) * p.num_q_heads + head] = total_lse;
  }
}

constexpr int kRowsPerMergeCta = kMergeThreads / 32;

// One warp per (token, head) row.
__global__ void __launch_bounds__(kMergeThreads) merge_states_kernel(const MergeStatesLaunch m) {
  if (step_refused(m.step_error)) return;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerMergeCta + threadIdx.x / 32;
  if (row >= m.num_tokens * m.num_heads) return;
  const int64_t token = row / m.num_heads;
  const int head = int(row % m.num_heads);
  const int64_t token_a = m.a_rows != nullptr ? m.a_rows[token] : token;
  const float lse_a = token_a >= 0 ? m.lse_a[token_a * m.num_heads + head] : -INFINITY;
  float w_a, w_b, lse;
  core::merge_weights(lse_a, m.lse_b[row], &w_a, &w_b, &lse);
  const int64_t base = token * m.stride_token + int64_t(head) * m.stride_head;
  const int64_t base_a = token_a * m.a_stride_token + int64_t(head) * m.a_stride_head;
  const int64_t base_b = token * m.b_stride_token + int64_t(head) * m.b_stride_head;
  for (int dim = int(threadIdx.x % 32); dim < m.v_head_dim; dim += 32) {
    // An empty side has weight 0 but may hold anything (even NaN): never multiply it in.
    float out = 0.f;
    if (w_a > 0.f) out += w_a * load_io(m.o_a, m.partial_dtype, base_a + dim);
    if (w_b > 0.f) out += w_b * load_io(m.o_b, m.partial_dtype, base_b + dim);
    store_io(m.out, m.io_dtype, base + dim, out);
  }
  if (threadIdx.x % 32 == 0 && m.lse_out != nullptr) m.lse_out[row] = lse;
}

// Attention sinks: one warp per (token, head) row, scaled in place by 1 / (1 + e^(s_h - lse)).
__global__ void __launch_bounds__(kMergeThreads) apply_sinks_kernel(const ApplySinksLaunch a) {
  if (step_refused(a.step_error)) return;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerMergeCta + threadIdx.x / 32;
  if (row >= a.num_tokens * a.num_heads) return;
  const int64_t token = row / a.num_heads;
  const int head = int(row % a.num_heads);
  const float lse = a.lse[row];
  const float sink = load_io(a.sinks, a.sinks_dtype, head);
  // A row without keys is zero and stays zero (the sink has no value vector).
  const float factor = lse == -INFINITY ? 0.f : 1.f / (1.f + expf(sink - lse));
  const int64_t base = token * a.stride_token + int64_t(head) * a.stride_head;
  for (int dim = int(threadIdx.x % 32); dim < a.v_head_dim; dim += 32) {
    store_io(a.out, a.out_dtype, base + dim, load_io(a.out, a.out_dtype, base + dim) * factor);
  }
}

}  // namespace

void launch_decode_merge(const DecodeLaunch& launch, cudaStream_t stream) {
  const core::AttentionParams& p = launch.params;
  if (p.batch_size == 0) return;
  // Programmatic dependent launch: the merge's CTAs are scheduled while the decode grid drains
  // instead of after it (griddepcontrol.wait in the kernel keeps the data dependency).
  auto* kernel = p.v_head_dim <= 128 ? decode_merge_kernel<4> : decode_merge_kernel<8>;
  launch_programmatic_dependent(kernel, dim3(uint32_t(p.batch_size), uint32_t(p.num_q_heads)),
                                dim3(kDecodeMergeThreads), 0, stream, "decode_merge_kernel",
                                /*cluster=*/0, launch);
}

}  // namespace detail

namespace {

void check_float_io(DType dtype, const char* argument) {
  const bool ok = dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
  check_arg(ok, argument, "dtype ", dtype_name(dtype), ", expected fp32, bf16 or fp16");
}

/// Launches a warp-per-(token, head)-row kernel over num_tokens x num_heads rows.
template <typename Launch>
void launch_rows(void (*kernel)(Launch), const Launch& launch, int64_t num_tokens, int num_heads,
                 cudaStream_t stream, const char* name) {
  const int64_t rows = num_tokens * num_heads;
  if (rows == 0) return;
  const int64_t grid = (rows + detail::kRowsPerMergeCta - 1) / detail::kRowsPerMergeCta;
  check_arg(grid < (int64_t(1) << 31), "num_tokens", num_tokens, " rows exceed the launch limit");
  kernel<<<dim3(uint32_t(grid)), dim3(detail::kMergeThreads), 0, stream>>>(launch);
  check_launch(name);
}

}  // namespace

void launch_merge_states(const MergeStatesLaunch& m, cudaStream_t stream) {
  check_float_io(m.io_dtype, "out");
  check_float_io(m.partial_dtype, "o_a");
  launch_rows(detail::merge_states_kernel, m, m.num_tokens, m.num_heads, stream,
              "merge_states_kernel");
}

void launch_apply_sinks(const ApplySinksLaunch& a, cudaStream_t stream) {
  check_float_io(a.out_dtype, "out");
  check_float_io(a.sinks_dtype, "sinks");
  launch_rows(detail::apply_sinks_kernel, a, a.num_tokens, a.num_heads, stream,
              "apply_sinks_kernel");
}

}  // namespace kvattn::cuda
