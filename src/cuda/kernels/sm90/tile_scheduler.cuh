// Which work item a CTA of the Hopper prefill kernel runs next, and what every warp role
// derives from an item (the tile's rows, its keys, its blocks, its masks).
//
// The plan (core/prefill_tiles.h) lists items heaviest first (within L2 groups of kv heads
// where the batch's K/V exceeds the L2). The grid is persistent (at most one CTA per SM): the
// producer warpgroup of a CTA takes its items (DynamicTileScheduler by default, else
// StaticTileScheduler) and publishes each tile's description next to its Q
// (prefill_mainloop.cuh), so the consumers never read the plan.
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
    // The request's facts from the item where the plan gives them (no dependent load of the
    // indptrs on the producer's way to the tile's Q), else from the indptrs.
    if (item.kv_base >= 0 && item.q_begin >= 0 && item.kv_len >= 0) {
      t.q_begin = item.q_begin;
      t.q_len = item.q_end - item.q_begin;
      t.kv_base = item.kv_base;
      t.kv_len = item.kv_len;
    } else {
      t.q_begin = p.qo_indptr[item.request];
      t.q_len = p.qo_indptr[item.request + 1] - t.q_begin;
      t.kv_base = p.kv_indptr[item.request];
      t.kv_len = static_cast<int>(p.kv_indptr[item.request + 1] - t.kv_base);
    }
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

  /// The output row of the tile's row `row` (0 .. kTileRows - 1): the token within the request
  /// and the q head; false past the request's rows (nothing to write).
  __device__ __forceinline__ bool output_row(int row, const core::FastDivmod& group, int& token,
                                             int& head) const {
    const int packed = row0 + row;
    if (packed >= rows_total) return false;
    int in_group;
    token = group.divmod(packed, in_group);
    head = kv_head * group.divisor + in_group;
    return true;
  }
};

/// Static persistent schedule over the plan's items, walked by the producer warpgroup alone
/// (the consumers take the tiles it publishes). Round r hands items r G .. r G + G - 1 (G CTAs)
/// out one per CTA, in CTA order on even rounds and in reverse on odd ones: with the items sorted
/// heaviest first, the CTA that took the heaviest item of a round takes the lightest of the next,
/// so the CTAs' totals even out (a plain stride leaves CTA 0 up to one whole item behind).
struct StaticTileScheduler {
  int num_items = 0;
  __device__ __forceinline__ bool more(int round) const {
    return round * static_cast<int>(gridDim.x) < num_items;
  }
  /// This CTA's item of round `round` (may be >= num_items in the last round: none then).
  __device__ __forceinline__ int item(int round) const {
    const int g = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
    return round * g + ((round & 1) ? g - 1 - c : c);
  }
};

/// Dynamic persistent schedule (LaunchOptions::dynamic_schedule, with the plan's counters
/// PrefillTiles::scheduler): a CTA's first two items are the static schedule's (rounds 0 and 1),
/// every later one the next ticket of a device counter, taken by the producer's thread 0 when the
/// CTA starts the item before it (so the atomic's round trip hides under that item's loads, and
/// CTAs ask in about the order they run out of work). With the items heaviest first this is
/// greedy longest-first: a CTA that finishes early takes the next heaviest item, where the static
/// schedule fixes every CTA's items in advance and leaves its imbalance as the kernel's tail.
/// The last CTA to finish (counted in counters[1]) sets both counters back to 0, so the next
/// launch of the plan starts from 0.
struct DynamicTileScheduler {
  int* counters = nullptr;

  __device__ __forceinline__ static int first() { return static_cast<int>(blockIdx.x); }
  /// Round 1 of the static schedule (the snake pairs the heaviest first item with the lightest
  /// second one); tickets take over from item 2 G.
  __device__ __forceinline__ static int second() {
    return 2 * static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  }
  /// The next item (thread 0 of the producer only).
  __device__ __forceinline__ int take() const {
    return 2 * static_cast<int>(gridDim.x) + atomicAdd(counters, 1);
  }
  /// After this CTA's last take (thread 0 of the producer only).
  __device__ __forceinline__ void finish() const {
    __threadfence();  // this CTA's last ticket is taken before it counts itself finished
    if (atomicAdd(counters + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      // Every CTA has taken its last ticket: no one touches the counters again this launch.
      atomicExch(counters, 0);
      atomicExch(counters + 1, 0);
    }
  }
};

}  // namespace kvattn::cuda::sm90
