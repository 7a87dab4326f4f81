// Merging attention states: the ragged + paged-prefix merge of EXTEND, through
// core::merge_weights, the one definition of the merge numerics (the decode kernel's split-KV
// merge uses it too).
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
