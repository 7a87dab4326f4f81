// Which work item a CTA of the Hopper prefill kernel runs next, and what every warp role
// derives from an item (the tile's rows, its keys, its blocks, its masks).
//
// The plan (core/prefill_tiles.h) lists items heaviest first. The grid is persistent (at most
// one CTA per SM): CTA b runs items b, b + grid, b + 2 grid, ... With items sorted by cost this
// static stride is a greedy schedule; both warp roles walk the same sequence without talking.
#pragma once

#include <cstdint>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"

namespace kvattn::cuda::sm90 {

/// One work item as the kernel's warp roles see it. Keys are processed in blocks of kKvTile
/// from the item's kv_begin; block k covers keys [kv_begin + k kKvTile, min(+kKvTile, kv_end)).
/// Blocks run last to first, so the blocks that need a causal mask come first.
struct PrefillTile {
  int request = 0;
  int kv_head = 0;
  int row0 = 0;        ///< first packed row of the tile
  int rows_total = 0;  ///< packed rows of the request (q_len x group)
  int q_begin = 0;     ///< the request's first query token
  int q_len = 0;
  int kv_len = 0;
  int64_t kv_base = 0;  ///< the request's first key in kv_indices (paged) or in K/V (ragged)
  int kv_begin = 0;
  int kv_end = 0;
  int num_blocks = 0;
  int partial = -1;

  template <int kKvTile>
  static __device__ __forceinline__ PrefillTile load(const core::AttentionParams& p,
                                                     const core::PrefillTiles& tiles, int index) {
    const core::PrefillWorkItem item = tiles.items[index];
    PrefillTile t;
    t.request = item.request;
    t.kv_head = item.kv_head;
    t.row0 = item.q_row_begin;
    t.q_begin = p.qo_indptr[item.request];
    t.q_len = p.qo_indptr[item.request + 1] - t.q_begin;
    t.kv_base = p.kv_indptr[item.request];
    t.kv_len = static_cast<int>(p.kv_indptr[item.request + 1] - t.kv_base);
    t.rows_total = t.q_len * tiles.group_size;
    t.kv_begin = item.kv_begin;
    t.kv_end = item.kv_end;
    // A padding item (row0 past the request's rows) has kv_begin == kv_end: no blocks.
    t.num_blocks = t.row0 < t.rows_total && t.kv_end > t.kv_begin
                       ? (t.kv_end - t.kv_begin + kKvTile - 1) / kKvTile
                       : 0;
    t.partial = item.partial;
    return t;
  }

  /// Whether this tile writes anything (a padding item writes nothing).
  __device__ __forceinline__ bool has_rows() const { return row0 < rows_total; }
};

/// Static persistent schedule over the plan's items.
struct StaticTileScheduler {
  int num_items = 0;
  __device__ __forceinline__ int first() const { return static_cast<int>(blockIdx.x); }
  __device__ __forceinline__ int next(int index) const {
    return index + static_cast<int>(gridDim.x);
  }
  __device__ __forceinline__ bool valid(int index) const { return index < num_items; }
};

}  // namespace kvattn::cuda::sm90
