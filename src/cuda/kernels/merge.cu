// Merging attention states: the split-KV reduction of decode and the ragged + paged-prefix merge
// of EXTEND. Both go through core::merge_weights, the one definition of the merge numerics.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/softmax_state.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/decode.h"
#include "cuda/kernels/decode_numerics.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace detail {
namespace {

constexpr int kMergeThreads = 128;

// One CTA per (batch entry, q head): folds the entry's partial rows in chunk order. Entries
// that were not split (an empty partial range) were written by the decode kernel itself.
__global__ void __launch_bounds__(kMergeThreads) decode_merge_kernel(const DecodeLaunch launch) {
  const core::AttentionParams& p = launch.params;
  const int request = int(blockIdx.x);
  const int head = int(blockIdx.y);
  const int first = launch.merge_indptr[request];
  const int last = launch.merge_indptr[request + 1];
  if (first == last) return;
  for (int dim = int(threadIdx.x); dim < p.v_head_dim; dim += kMergeThreads) {
    float lse = -INFINITY;
    float out = 0.f;
    for (int part = first; part < last; ++part) {
      const int64_t row = int64_t(part) * p.num_q_heads + head;
      float w_acc, w_part, merged;
      core::merge_weights(lse, launch.partial_lse[row], &w_acc, &w_part, &merged);
      out = w_acc * out + w_part * launch.partial_out[row * p.v_head_dim + dim];
      lse = merged;
    }
    store_io(p.out, p.io_dtype,
             int64_t(request) * p.out_stride_token + int64_t(head) * p.out_stride_head + dim, out);
    if (dim == 0 && p.lse != nullptr) p.lse[int64_t(request) * p.num_q_heads + head] = lse;
  }
}

constexpr int kRowsPerMergeCta = kMergeThreads / 32;

// One warp per (token, head) row.
__global__ void __launch_bounds__(kMergeThreads) merge_states_kernel(const MergeStatesLaunch m) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerMergeCta + threadIdx.x / 32;
  if (row >= m.num_tokens * m.num_heads) return;
  const int64_t token = row / m.num_heads;
  const int head = int(row % m.num_heads);
  float w_a, w_b, lse;
  core::merge_weights(m.lse_a[row], m.lse_b[row], &w_a, &w_b, &lse);
  const int64_t base = token * m.stride_token + int64_t(head) * m.stride_head;
  const int64_t base_b = token * m.b_stride_token + int64_t(head) * m.b_stride_head;
  for (int dim = int(threadIdx.x % 32); dim < m.v_head_dim; dim += 32) {
    // An empty side has weight 0 but may hold anything (even NaN): never multiply it in.
    float out = 0.f;
    if (w_a > 0.f) out += w_a * load_io(m.o_a, m.io_dtype, base + dim);
    if (w_b > 0.f) out += w_b * load_io(m.o_b, m.io_dtype, base_b + dim);
    store_io(m.out, m.io_dtype, base + dim, out);
  }
  if (threadIdx.x % 32 == 0 && m.lse_out != nullptr) m.lse_out[row] = lse;
}

}  // namespace

void launch_decode_merge(const DecodeLaunch& launch, cudaStream_t stream) {
  const core::AttentionParams& p = launch.params;
  if (p.batch_size == 0) return;
  decode_merge_kernel<<<dim3(uint32_t(p.batch_size), uint32_t(p.num_q_heads)),
                        dim3(kMergeThreads), 0, stream>>>(launch);
  check_launch("decode_merge_kernel");
}

}  // namespace detail

void launch_merge_states(const MergeStatesLaunch& m, cudaStream_t stream) {
  check_arg(m.io_dtype == DType::kFloat32 || m.io_dtype == DType::kBFloat16 ||
                m.io_dtype == DType::kFloat16,
            "out", "dtype ", dtype_name(m.io_dtype), ", expected fp32, bf16 or fp16");
  const int64_t rows = m.num_tokens * m.num_heads;
  if (rows == 0) return;
  const int64_t grid = (rows + detail::kRowsPerMergeCta - 1) / detail::kRowsPerMergeCta;
  check_arg(grid < (int64_t(1) << 31), "num_tokens", m.num_tokens, " rows exceed the launch limit");
  detail::merge_states_kernel<<<dim3(uint32_t(grid)), dim3(detail::kMergeThreads), 0, stream>>>(m);
  check_launch("merge_states_kernel");
}

}  // namespace kvattn::cuda
