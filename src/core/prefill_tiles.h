// Host planning of the batch prefill kernel: which (request, query tile, kv head) tiles exist, in
// which order they run, which of them are split along the KV axis, and how the plan is laid out
// in one device buffer. No CUDA here: the backend copies the metadata with one async copy and the
// kernel only reads it.
//
// Rows of a tile are *packed*: the q heads of one GQA group share a kv head, so a tile's row r is
// (token = (q_row_begin + r) / group_size, q head = kv_head * group_size + (q_row_begin + r) %
// group_size). One K/V tile then serves the whole group, and decode (q_len 1) still fills the
// matrix unit with group_size rows per request.
//
// Worked example (causal 1 x 16384, 32 q / 8 kv heads, tile 128 rows): group 4, 65536 packed rows
// per kv head -> 512 tiles x 8 kv heads = 4096 tiles; a tile of tokens [t, t+32) sees keys
// [0, t+32), so costs run from 32 to 16384 keys and the heaviest start first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/batch_layout.h"
#include "core/fast_divmod.h"

namespace kvattn::core {

/// One unit of work of the prefill kernel (48 bytes, read once per CTA). An item whose
/// q_row_begin is at or past its request's q_len * group_size rows, with kv_begin == kv_end and
/// partial -1, is a no-op (reads no K/V, writes nothing): a CUDA graph captured with a fixed item
/// count can be padded with such items (likewise a merge item with num_partials 0).
struct PrefillWorkItem {
  int32_t request = 0;  ///< index into qo_indptr / kv_indptr
  int32_t kv_head = 0;
  int32_t q_row_begin = 0;  ///< first packed row (token * group_size + head in group)
  int32_t kv_begin = 0;     ///< keys [kv_begin, kv_end) of the request, already clipped to what
  int32_t kv_end = 0;       ///< the tile can see (causal / window); multiples of kv_tile inside
  int32_t partial = -1;     ///< -1: writes out/lse itself; else its slot in the partial buffers
  int32_t merge = -1;       ///< a split chunk: its tile's merge item (else -1)
  /// kv_indptr[request], qo_indptr[request], qo_indptr[request + 1] and the request's kv
  /// length as the call's indptrs have them (the host plans from the same layout it uploads), or
  /// -1 where not given (kv_base: kv_indptr[request] at or above 2^31): the kernels address Q
  /// and the first K/V from the item without waiting for the indptrs, one dependent memory round
  /// trip less before a tile's first Q and K/V bytes. Where these are -1 the kernels read the
  /// indptrs.
  int32_t kv_base = -1;
  int32_t q_begin = -1;
  int32_t q_end = -1;
  int32_t kv_len = -1;
  int32_t reserved = 0;  ///< 48 bytes: three 16-byte loads
};

/// One split tile to finish: merges num_partials consecutive partial slots into out/lse.
struct PrefillMergeItem {
  int32_t request = 0;
  int32_t kv_head = 0;
  int32_t q_row_begin = 0;
  int32_t first_partial = 0;
  int32_t num_partials = 0;
  /// Device counter, 0 as the host writes the plan: chunks of the tile done so far, when the
  /// attention kernel merges its split tiles itself (PrefillTiles::merge_in_kernel: the chunk
  /// that finishes last merges and sets it back to 0 for the next launch of the plan).
  int32_t arrived = 0;
  int32_t reserved1 = 0;
  int32_t reserved2 = 0;
};

/// What the planner must know about the kernel and the call.
struct PrefillTileShape {
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int tile_rows = 0;  ///< packed rows per tile (the kernel's; see cuda::prefill_kernel_shape)
  int kv_tile = 0;    ///< keys per kernel step; split chunks are multiples of it
  MaskMode mask = MaskMode::kCausal;
  int window_left = -1;  ///< -1 = none; bounds causal and custom masks, ignored with kNone
  /// CTAs the device runs at once (SMs x CTAs per SM). 0 disables split-KV. Split happens only
  /// when the tiles are too few or too uneven to fill this many CTAs.
  int concurrent_ctas = 0;
  int min_split_keys = 512;  ///< no chunk shorter than this (below it the merge costs more)
  /// > 1: cluster split (the decode-shaped kernel): every tile is cut into exactly `cluster`
  /// chunks (even in kv_tile steps, empty where the tile has fewer steps), consecutive items in
  /// the plan, that one thread-block cluster runs and merges in distributed shared memory: no
  /// merge items, no partials; concurrent_ctas and min_split_keys are then unused. The caller
  /// picks it from the batch shape alone (cluster_split_size), so a CUDA graph's plan and every
  /// replay's have the same cluster. 0 or 1: the split above.
  int cluster = 0;
  /// The device's L2 in keys x kv heads (its bytes over a key's K and V bytes); 0: unknown.
  /// Where the batch's K/V is larger than the L2 and no tile splits, the tiles are ordered for
  /// it: a request's kv heads in groups (the largest power of two whose keys x heads stay within
  /// a third of l2_keys), each group's tiles together (heaviest first, the group's heads
  /// consecutive), the groups heaviest first. The K/V that the CTAs running at once read is then
  /// one or two groups' instead of every head's at that causal depth (the plain order read 5x
  /// the inputs from HBM at 8 x 2048; bench/NOTES.md, eleventh session). Otherwise every tile
  /// heaviest first (LPT; measured faster where the K/V fits: hd256 1 x 4096).
  int64_t l2_keys = 0;
};

/// The cluster of a cluster-split plan (PrefillTileShape::cluster) for a batch of batch_size
/// requests of at most q_len query tokens (the tiles T = batch_size x num_kv_heads x
/// ceil(q_len x group / tile_rows)): the largest power of two <= max_cluster with T x cluster <=
/// concurrent_ctas, or 0 (no cluster split) when that is below 2, when concurrent_ctas is 0
/// (split-KV off) or max_cluster < 2. Depends on no KV length: a graph captured for the batch
/// and the eager call of the same batch plan the same cluster.
/// Worked example (H200 verify: 32 q / 8 kv heads, 8 tree tokens, tiles of 32 rows, 264
/// concurrent CTAs, max_cluster 16): batch 1 -> T = 8, cluster 16 (128 CTAs, 256 keys each at
/// prefix 4096); batch 16 -> T = 128, cluster 2; batch 64 -> T = 512, 0.
int cluster_split_size(int batch_size, int q_len, const PrefillTileShape& shape, int max_cluster);

/// The plan on the host: items already in launch order (heaviest first).
struct PrefillTilePlan {
  std::vector<PrefillWorkItem> items;
  std::vector<PrefillMergeItem> merges;
  int num_partials = 0;
  int tile_rows = 0;
  int group_size = 0;
  int cluster = 0;  ///< > 1: a cluster-split plan (PrefillTileShape::cluster)
};

/// Builds the work list from host lengths: qo_indptr [batch_size + 1] (query tokens) and
/// kv_indptr [batch_size + 1] (prefix sums of kv lengths). Throws kInvalidArgument on lengths
/// that break the contract (negative, q_len > kv_len under a causal mask, heads not divisible).
PrefillTilePlan plan_prefill_tiles(std::span<const int32_t> qo_indptr,
                                   std::span<const int64_t> kv_indptr,
                                   const PrefillTileShape& shape);

/// The same plan into `plan`, whose vectors keep their storage: a caller that plans every step
/// (out_graph) allocates nothing once they are large enough (at batch 256 a fresh ~100 KB vector
/// a step cost more in page faults than the planning itself; bench/NOTES.md).
void plan_prefill_tiles(std::span<const int32_t> qo_indptr, std::span<const int64_t> kv_indptr,
                        const PrefillTileShape& shape, PrefillTilePlan& plan);

/// The plan as the kernel sees it: pointers into one device buffer.
struct PrefillTiles {
  const PrefillWorkItem* items = nullptr;  ///< [num_items]
  int num_items = 0;
  const PrefillMergeItem* merges = nullptr;  ///< [num_merges]
  int num_merges = 0;
  float* partial_out = nullptr;  ///< [num_partials, tile_rows, v_head_dim]
  float* partial_lse = nullptr;  ///< [num_partials, tile_rows], natural log
  int num_partials = 0;
  int tile_rows = 0;
  int group_size = 0;
  /// group_size as a fast divisor (packed row -> token, head in group); launches check that the
  /// two agree.
  FastDivmod group_div;
  /// The attention kernel merges the split tiles itself (the decode-shaped kernel: the last
  /// chunk of a tile to finish, counted in PrefillMergeItem::arrived); else a merge grid does.
  int merge_in_kernel = 0;
  /// > 1: a cluster-split plan: items [c * cluster, (c + 1) * cluster) are the chunks of one
  /// tile, launched as one thread-block cluster that merges them (PrefillTileShape::cluster).
  int cluster = 0;
  /// Time attribution only (KVATTN_TC_DECODE_DIAG, garbage output): the decode-shaped kernel
  /// 1 issues no K/V copies, 2 returns after its prologue, 3 runs no key step, 4 returns at entry.
  int diag = 0;
  /// Time attribution only (KVATTN_TC_DECODE_TRACE): the decode-shaped kernel writes
  /// %globaltimer stamps of its phases here, tc_decode::kTraceSlots a CTA (nullptr: none).
  unsigned long long* trace = nullptr;
  /// Device counters, 0 as the host writes the plan (the plan buffer's first 16 bytes): the
  /// Hopper prefill's dynamic tile schedule takes its items' tickets from [0] and counts its
  /// finished CTAs in [1]; the last CTA to finish sets both back to 0 for the next launch of the
  /// plan. Like PrefillMergeItem::arrived, two launches of one plan must not overlap in time.
  int* scheduler = nullptr;
};

/// Byte layout of the plan buffer: [scheduler counters | items | merges] is metadata copied from
/// the host (the counters as zeros); the partial buffers after it are device scratch that nothing
/// copies.
struct PrefillBufferLayout {
  size_t metadata_bytes = 0;  ///< bytes to copy host -> device (from offset 0)
  size_t total_bytes = 0;     ///< bytes the device buffer needs
};

/// The layout write_prefill_buffer gives a plan of these counts (a padded CUDA-graph plan is
/// sized from its capacity this way, without building it). Throws kOutOfResources when the
/// bytes overflow.
PrefillBufferLayout prefill_buffer_layout(int64_t items, int64_t merges, int64_t partials,
                                          int tile_rows, int v_head_dim);

/// The one routine that sizes and fills the plan buffer. Always returns the layout; with
/// host_metadata != nullptr (capacity >= layout.metadata_bytes) also writes the metadata there,
/// and with device_base != nullptr fills *view with pointers into the device buffer.
PrefillBufferLayout write_prefill_buffer(const PrefillTilePlan& plan, int v_head_dim,
                                         void* host_metadata, size_t host_capacity,
                                         void* device_base, PrefillTiles* view);

}  // namespace kvattn::core
