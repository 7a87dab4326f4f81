// The tile arithmetic of a prefill plan, one definition for core::plan_prefill_tiles (host) and
// the device planner (cuda/kernels/device_plan.cu), whose plans must agree item for item: the
// keys a row tile sees, its kernel steps, a chunk of a split or clustered tile, and the head
// groups of the L2 order.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "core/prefill_tiles.h"

namespace kvattn::core {

/// Keys [begin, end) of a request's kv_len keys that one row tile reads.
struct TileKeys {
  int64_t begin = 0;
  int64_t end = 0;
};

/// The row tile of packed rows [row, row + tile_rows) of a request of q_len query tokens (group
/// rows a token) and kv_len keys: causal rows see the keys up to their token's bottom-right
/// aligned position, a window bounds them from below (no mask: every key).
KVATTN_HOST_DEVICE TileKeys row_tile_keys(const PrefillTileShape& s, int64_t group,
                                          int64_t kv_len, int64_t q_len, int64_t row) {
  const int64_t rows = q_len * group;
  const int64_t row_end = row + s.tile_rows < rows ? row + s.tile_rows : rows;
  const int64_t first_token = row / group;
  const int64_t last_token = (row_end - 1) / group;
  auto clamp = [](int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; };
  TileKeys k;
  k.end = kv_len;
  if (s.mask == MaskMode::kCausal) k.end = clamp(kv_len - q_len + last_token + 1, 0, kv_len);
  if (s.window_left >= 0 && s.mask != MaskMode::kNone)
    k.begin = clamp(kv_len - q_len + first_token - s.window_left, 0, k.end);
  return k;
}

/// Kernel steps (kv_tile keys each) of a tile. (32-bit division: keys < 2^31; a 64-bit one a
/// tile was most of a batch-256 host plan.)
KVATTN_HOST_DEVICE int64_t tile_steps(TileKeys k, int kv_tile) {
  return int64_t((uint32_t(k.end - k.begin) + uint32_t(kv_tile) - 1) / uint32_t(kv_tile));
}

/// Chunk c of `chunks` of a tile of `steps` kernel steps: an even split in whole steps, so no
/// chunk is a sliver.
KVATTN_HOST_DEVICE TileKeys chunk_keys(TileKeys k, int64_t steps, int64_t c, int64_t chunks,
                                       int kv_tile) {
  const int64_t begin = k.begin + steps * c / chunks * kv_tile;
  const int64_t end = k.begin + steps * (c + 1) / chunks * kv_tile;
  return {begin < k.end ? begin : k.end, end < k.end ? end : k.end};
}

/// A tile's cost in the split decision: its steps plus one (the Q load and the epilogue), in
/// keys, for each kv head.
KVATTN_HOST_DEVICE int64_t tile_cost(int64_t steps, const PrefillTileShape& s) {
  return (steps + 1) * s.kv_tile * s.num_kv_heads;
}

/// The split-KV chunk of a plan whose tiles cost total_cost (tile_cost summed): an even share of
/// the device's CTAs, at least min_split_keys, in whole kernel steps; 0: no split
/// (concurrent_ctas 0 or no tile).
KVATTN_HOST_DEVICE int64_t split_chunk_keys(const PrefillTileShape& s, int64_t total_cost,
                                            int64_t num_tiles) {
  if (s.concurrent_ctas <= 0 || num_tiles <= 0) return 0;
  const int64_t share = (total_cost + s.concurrent_ctas - 1) / s.concurrent_ctas;
  const int64_t least = s.min_split_keys > s.kv_tile ? s.min_split_keys : s.kv_tile;
  const int64_t chunk = share > least ? share : least;
  return (chunk + s.kv_tile - 1) / s.kv_tile * s.kv_tile;
}

/// Chunks of a tile of `keys` keys under a split of chunk_keys (1: the tile is not split).
KVATTN_HOST_DEVICE int64_t split_chunks(int64_t keys, int64_t chunk_keys) {
  return chunk_keys > 0 && keys > chunk_keys ? (keys + chunk_keys - 1) / chunk_keys : 1;
}

/// A request's kv heads a group in the L2 order (PrefillTileShape::l2_keys): the largest power
/// of two whose keys x heads stay within a third of the L2.
KVATTN_HOST_DEVICE int l2_group_heads(const PrefillTileShape& s, int64_t kv_len) {
  if (kv_len < 1) kv_len = 1;
  int heads = 1;
  while (heads * 2 <= s.num_kv_heads && kv_len * heads * 2 <= s.l2_keys / 3) heads *= 2;
  return heads;
}

}  // namespace kvattn::core
