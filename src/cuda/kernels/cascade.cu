// The cascade step's promise check (see cascade.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/kernels/cascade.h"
#include "cuda/kernels/index.cuh"
#include "cuda/kernels/step_check.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

constexpr int kCheckThreads = 256;
constexpr int kPositionsPerCheckCta = 4 * kCheckThreads;
constexpr int kMaxCheckCtasPerMember = 64;

// One (chunk of positions, member) per CTA: blockIdx.y is the member.
__global__ void __launch_bounds__(kCheckThreads) check_shared_prefix_kernel(
    const SharedPrefixCheck c) {
  const int index = int(blockIdx.y);
  const int entry = c.members[index];
  const int group = c.member_group[index];
  const int leader = c.group_leader[group];
  const int64_t len = c.group_len[group];
  const int32_t* row = detail::source_row(c.source, entry);
  const int32_t* lead = detail::source_row(c.source, leader);
  const bool compare = entry != leader && row != nullptr && lead != nullptr;
  const uint8_t* mask = nullptr;
  int64_t row_len = 0;
  if (c.custom_mask != nullptr && c.draft_token_num > 0) {
    const int64_t begin = c.mask_indptr[entry];
    row_len = (c.mask_indptr[entry + 1] - begin) / c.draft_token_num;
    mask = c.custom_mask + begin;  // shared keys are the first columns (len <= seq_len)
  }
  for (int64_t i = int64_t(blockIdx.x) * kCheckThreads + threadIdx.x; i < len;
       i += int64_t(gridDim.x) * kCheckThreads) {
    if (compare && row[i] != lead[i]) {
      detail::flag_shared_prefix(c.step_state, entry, i, /*mask=*/false);
      continue;
    }
    if (mask != nullptr) {
      for (int t = 0; t < c.draft_token_num; ++t) {
        if (mask[int64_t(t) * row_len + i] == 0) {
          detail::flag_shared_prefix(c.step_state, entry, i, /*mask=*/true);
          break;
        }
      }
    }
  }
}

}  // namespace

void launch_check_shared_prefix(const SharedPrefixCheck& c, cudaStream_t stream) {
  if (c.num_members == 0) return;
  check_arg(c.num_members < 65536, "shared_prefix_group_cpu", "has ", c.num_members,
            " grouped requests, expected < 65536");
  const int wanted = (std::max(c.max_shared_len, 1) + kPositionsPerCheckCta - 1) /
                     kPositionsPerCheckCta;
  const dim3 grid(uint32_t(std::min(wanted, kMaxCheckCtasPerMember)), uint32_t(c.num_members));
  check_shared_prefix_kernel<<<grid, kCheckThreads, 0, stream>>>(c);
  check_launch("check_shared_prefix_kernel");
}

}  // namespace kvattn::cuda
