// The merge of one row of a split prefill tile (core::PrefillMergeItem): the chunks' partial
// states (fp32 out, natural-log LSE) folded into out / lse. One definition for the merge grid
// (prefill.cu, prefill_merge_kernel) and the decode-shaped kernel's in-kernel merge (the last
// chunk of a tile to finish merges it: tc_decode_kernel.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"

namespace kvattn::cuda::detail {

/// Row r of `merge`'s tile, by the 32 lanes of one warp (all of them call it: shuffles). The
/// lanes first take the chunks' LSEs (the merged LSE, each chunk's weight e^(lse_c - lse)), then
/// 4 output dims each, with the chunks' loads independent of each other (unrolled), so a tile
/// split into many chunks costs a few memory latencies, not one per chunk (bench/NOTES.md: at
/// verify b1 the fold of 17 chunks one after another cost ~60 us). The partials are read through
/// L2 only (ld.global.cg): the in-kernel merge reads what other CTAs of the same grid wrote.
template <typename T>
__device__ __forceinline__ void merge_split_row(const core::AttentionParams& p,
                                                const core::PrefillTiles& tiles,
                                                const core::PrefillMergeItem& merge, int r,
                                                int lane) {
  if (r >= tiles.tile_rows) return;
  const int q_begin = p.qo_indptr[merge.request];
  const int q_len = p.qo_indptr[merge.request + 1] - q_begin;
  const core::FastDivmod& group = tiles.group_div;
  const int packed = merge.q_row_begin + r;
  if (packed >= q_len * group.divisor) return;  // (a graph's padding merge has no rows)
  const int n = merge.num_partials;
  const float* lse_of = tiles.partial_lse + int64_t(merge.first_partial) * tiles.tile_rows + r;
  const float* out_of = tiles.partial_out +
                        (int64_t(merge.first_partial) * tiles.tile_rows + r) * p.v_head_dim;
  const int64_t chunk_stride = int64_t(tiles.tile_rows) * p.v_head_dim;
  auto lse_at = [&](int c) { return __ldcg(lse_of + int64_t(c) * tiles.tile_rows); };

  // Lane c holds chunk c's LSE (the first 32 chunks; more are read again where needed).
  const float lse_first = lane < n ? lse_at(lane) : -INFINITY;
  float top = lse_first;
  for (int c = lane + 32; c < n; c += 32) top = fmaxf(top, lse_at(c));
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
  float total = 0.f;
  if (top != -INFINITY) {
    total = __expf(lse_first - top);
    for (int c = lane + 32; c < n; c += 32) total += __expf(lse_at(c) - top);
  }
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  const bool empty = !(total > 0.f);  // every chunk empty: o = 0, LSE -inf
  const float inv_total = empty ? 0.f : 1.f / total;
  const float weight_first = empty ? 0.f : __expf(lse_first - top) * inv_total;

  int in_group;
  const int token = group.divmod(packed, in_group);
  const int head = merge.kv_head * group.divisor + in_group;
  const int64_t out_row =
      (int64_t(q_begin) + token) * p.out_stride_token + int64_t(head) * p.out_stride_head;
  for (int base = 0; base < p.v_head_dim; base += 128) {  // uniform: the shuffles need all lanes
    const int d0 = base + lane * 4;
    const bool active = d0 < p.v_head_dim;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c0 = 0; c0 < n; c0 += 32) {
      float weight = weight_first;  // lane i: chunk c0 + i
      if (c0 > 0) {
        weight = !empty && c0 + lane < n ? __expf(lse_at(c0 + lane) - top) * inv_total : 0.f;
      }
      const int count = min(32, n - c0);
#pragma unroll 8
      for (int i = 0; i < count; ++i) {
        const float w = __shfl_sync(0xffffffffu, weight, i);
        if (active) {
          const float4 part =
              __ldcg(reinterpret_cast<const float4*>(out_of + (c0 + i) * chunk_stride + d0));
          acc.x = fmaf(part.x, w, acc.x);
          acc.y = fmaf(part.y, w, acc.y);
          acc.z = fmaf(part.z, w, acc.z);
          acc.w = fmaf(part.w, w, acc.w);
        }
      }
    }
    if (!active) continue;
    if (p.out_fp32) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.out) + out_row + d0) = acc;
    } else if constexpr (std::is_same_v<T, __half>) {
      __half* out = static_cast<__half*>(p.out) + out_row;
      out[d0] = __float2half_rn(acc.x);
      out[d0 + 1] = __float2half_rn(acc.y);
      out[d0 + 2] = __float2half_rn(acc.z);
      out[d0 + 3] = __float2half_rn(acc.w);
    } else {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + out_row;
      out[d0] = __float2bfloat16_rn(acc.x);
      out[d0 + 1] = __float2bfloat16_rn(acc.y);
      out[d0 + 2] = __float2bfloat16_rn(acc.z);
      out[d0 + 3] = __float2bfloat16_rn(acc.w);
    }
  }
  if (p.lse != nullptr && lane == 0) {
    p.lse[(int64_t(q_begin) + token) * p.num_q_heads + head] =
        empty ? -INFINITY : top + __logf(total);
  }
}

}  // namespace kvattn::cuda::detail
