// Host planning of batch decode (no CUDA here, tested in CI): which (request, KV chunk) work
// items the decode kernel runs, in which order, which of them are split along the KV axis and
// merged afterwards, and how the per-step metadata (the paged layout of one attention call plus
// the decode plan) is laid out in one buffer that the backend copies to the device with a single
// async copy from pinned host memory.
//
// The decode kernel runs one CTA per (work item, kv head, head pass): a work item is a chunk
// [kv_begin, kv_end) of one request's KV tokens, and every CTA of it handles all q heads of its
// GQA group (up to the kernel's heads per pass). Items are launched heaviest first, so the
// hardware block dispatcher (which starts CTAs in index order as slots free up) performs the
// longest-processing-time-first greedy assignment across the SMs.
//
// Split size, worked example (H200: 132 SMs, 4 decode CTAs resident per SM, so 528 CTAs run at
// once; 8 kv heads, group of 4 q heads = 1 head pass, so 8 CTAs per item):
//   * batch 64 x 4096 keys: no split gives 64 items = 512 CTAs, one wave of 4096 + overhead
//     tokens per CTA. Splitting in two gives 1024 CTAs of 2048: two waves, no faster, plus the
//     merge. The planner keeps chunk = 4096.
//   * batch 1 x 32768 keys: no split gives 8 CTAs, 124 of 132 SMs idle. Splitting into k chunks
//     gives 8k CTAs; k = 64 (chunk 512 tokens) gives 512 CTAs, one wave of 512 + overhead tokens:
//     about 60x faster than no split. The merge then folds 64 partial states per q head.
// The planner evaluates candidate chunk sizes (the longest request split into k equal chunks)
// with a greedy LPT simulation over the concurrent CTA slots and keeps the fastest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/batch_layout.h"
#include "core/prefill_tiles.h"

namespace kvattn::core {

/// One unit of decode work (32 bytes, two vector loads per CTA).
struct alignas(16) DecodeWorkItem {
  int32_t request = 0;   ///< batch entry (index into the layout's kv_indptr / the q rows)
  int32_t kv_begin = 0;  ///< tokens [kv_begin, kv_end) of the request's KV range
  int32_t kv_end = 0;
  int32_t partial = -1;  ///< -1: writes the final output itself; else its partial-state row
  /// kv_indptr[request] + kv_begin: where the item's indices start (filled by
  /// write_call_metadata), so a CTA goes from its item straight to kv_indices (one dependent
  /// load less at the start of every CTA).
  int64_t kv_offset = 0;
  int64_t reserved = 0;
};
static_assert(sizeof(DecodeWorkItem) == 32);

/// What the planner must know about the kernel and the device.
struct DecodePlanConfig {
  int ctas_per_item = 1;    ///< CTAs launched per work item: num_kv_heads x head passes
  int concurrent_ctas = 0;  ///< SMs x resident CTAs per SM; 0 disables split-KV
  int chunk_align = 32;     ///< tokens a CTA consumes per pipeline step; chunks are multiples
  int min_chunk = 256;      ///< no split chunk shorter than this (the merge would cost more)
  /// Fixed cost of one CTA (q load, in-CTA state merge, store) in token-equivalents: 1 token =
  /// one key and one value row of one kv head. Measured order of magnitude, see bench/NOTES.md.
  int cta_overhead_tokens = 64;
  int merge_overhead_tokens = 16;  ///< extra cost per split item (partial store + merge read)
  /// > 0: split every request longer than this into chunks of this many tokens (rounded up to
  /// chunk_align) instead of searching, when the items fit the capacity (tuning and tests).
  int fixed_chunk = 0;
};

/// Upper bound on the work items of a batch of `batch_size` entries, a function of the batch
/// size alone: a CUDA graph captured for that size launches this many items' CTAs, and every
/// later plan for the same size must fit (the planner never exceeds it).
int decode_item_capacity(int batch_size, const DecodePlanConfig& config);

/// The plan on the host.
struct DecodePlan {
  std::vector<DecodeWorkItem> items;  ///< launch order: heaviest first
  std::vector<int32_t> merge_indptr;  ///< [batch_size + 1] partial rows of each request;
                                      ///< an empty range: the request was not split
  int num_partials = 0;
  int chunk = 0;  ///< tokens per chunk chosen (>= the longest request: no split)
  /// Makespan estimate of the chosen chunk in token-equivalents per CTA slot (for tests); 0
  /// when no split was feasible, so nothing was compared (the estimate is skipped then).
  double estimated_cost = 0;
};

/// Builds the plan for requests of `kv_len` tokens. At most `item_capacity` items.
DecodePlan plan_decode(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                       int item_capacity);

/// The closed-form rule a device planner can compute from device lengths (issue 15: one CTA,
/// block reductions, one scan and one sort; no search): chunk = the even share of the step's
/// cost per CTA slot, total x ctas_per_item / concurrent_ctas (with cta_overhead_tokens a
/// request), rounded up to chunk_align, at least min_chunk; no split unless that is below 0.97
/// of the longest request; doubled until the items fit `item_capacity`. A request's chunks at
/// multiples of the chunk, partial rows as plan_decode numbers them, items heaviest first (the
/// same keys as plan_decode). The host runs it as the reference the device plan must equal;
/// tests/core/test_planner.cpp compares its in-order makespan with plan_decode's (bench/NOTES.md,
/// "device-plan rule").
DecodePlan plan_decode_rule(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                            int item_capacity);

/// Estimated makespan (token-equivalents) of running `chunk`-sized items on
/// config.concurrent_ctas slots with LPT assignment; exposed for tests. Runs once per candidate
/// chunk at every step, so it is cheap: when the slots split into groups of ctas_per_item it
/// simulates the groups (an item's identical CTAs always land on one group of equally loaded
/// slots, see planner.cpp), else every CTA.
double estimate_decode_makespan(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                                int chunk);

// ---- the per-call metadata buffer ----------------------------------------------------------

/// Capacities a metadata buffer is sized for (graph mode: the bucket's batch size).
struct CallCapacity {
  int batch_size = 0;
  int decode_items = 0;  ///< 0: the call has no decode plan
  bool custom_mask = false;
  int num_q_heads = 0;  ///< for the decode partial-state scratch
  int v_head_dim = 0;
};

/// Bytes at the start of every call's metadata for the CUDA backend's per-step error state
/// (cuda::StepState in cuda/kernels/step_check.h): the host writes zeros and the step number
/// there, so the metadata copy that starts each step also resets the step's error word.
constexpr size_t kStepStateBytes = 32;

/// Byte offsets of every array of one attention call's metadata. [0, metadata_bytes) is filled
/// on the host and copied to the device in one go; the partial states live in a separate
/// device scratch buffer of scratch_bytes (nothing copies it).
struct CallMetadataLayout {
  size_t step_state = 0;    ///< kStepStateBytes, zero-filled (see kStepStateBytes)
  size_t qo_indptr = 0;     ///< int32 [batch_size + 1]
  size_t kv_indptr = 0;     ///< int64 [batch_size + 1]
  size_t kv_start = 0;      ///< int32 [batch_size]
  size_t kv_len = 0;        ///< int32 [batch_size]
  size_t mask_indptr = 0;   ///< int64 [batch_size + 1] (custom mask only)
  size_t mask_dense = 0;    ///< int32 [batch_size] (custom mask only; zeros, a device kernel
                            ///< may raise them: AttentionParams::mask_dense)
  /// int64 [1] (custom mask only): the tree mask's length, mask_indptr[batch_size] of the host
  /// layout; a step planned on the device writes the batch's mask length here instead, which
  /// its planner and step check read (a captured graph's replays bring masks of other lengths).
  size_t mask_elems = 0;
  size_t decode_items = 0;  ///< DecodeWorkItem [decode_items]
  size_t merge_indptr = 0;  ///< int32 [batch_size + 1]
  size_t num_items = 0;     ///< int32 [1]: items of the current plan (graph grids are larger)
  size_t metadata_bytes = 0;
  size_t partial_out = 0;  ///< float [decode_items, num_q_heads, v_head_dim] in the scratch
  size_t partial_lse = 0;  ///< float [decode_items, num_q_heads] in the scratch
  size_t scratch_bytes = 0;
};

/// The one routine that sizes and fills a call's metadata: always returns the layout for
/// `capacity`; with `host` != nullptr also writes `layout` (and `plan`, when given) there,
/// checking that they fit the capacity and that host_capacity >= metadata_bytes. A dry run
/// (host == nullptr, layout and plan ignored) sizes the buffers once, so the two cannot disagree.
CallMetadataLayout write_call_metadata(const CallCapacity& capacity, const PagedLayout* layout,
                                       const DecodePlan* plan, void* host, size_t host_capacity);

// ---- fixed-size prefill plans (CUDA-graph capture) -----------------------------------------

/// Upper bounds on a plan_prefill_tiles plan for a batch of batch_size requests of at most q_len
/// query tokens each, whatever their KV lengths: a graph captured for that batch launches this
/// many items and merges, and every later plan for the same batch fits. With T = batch_size x
/// num_kv_heads x ceil(q_len x group / tile_rows) tiles and C = concurrent_ctas (split-KV gives a
/// tile more than one chunk only when its keys exceed the chunk, itself >= total cost / C):
///   items <= T + C, merges <= min(T, C), partials <= min(T + C, 2 C); a cluster-split shape
///   (PrefillTileShape::cluster = K > 1): items = T x K, no merges, no partials.
/// Worked example (H200 verify at head_dim 128: 32 q / 8 kv heads, tiles of 128 rows, 8 tree
/// tokens, 132 SMs x 2 CTAs = 264): batch 64 -> T = 64 x 8 x ceil(32 / 128) = 512 tiles; 776
/// items, 264 merges, 528 partials (about 25 KB of plan and 35 MB of fp32 partial scratch).
struct PrefillPlanCapacity {
  int items = 0;
  int merges = 0;
  int partials = 0;
  int row_tiles = 0;  ///< (request, row tile) pairs at most: T / num_kv_heads
};
PrefillPlanCapacity prefill_plan_capacity(int batch_size, int q_len, const PrefillTileShape& shape);

/// The same bounds for a batch of batch_size requests of num_tokens query tokens in all, split
/// among them any way (an EXTEND-like step planned on the device, whose lengths the host never
/// sees): at most min(batch_size, num_tokens) requests have rows, each with at most tile_rows -
/// 1 rows of slack in its last tile, so T = num_kv_heads x floor((num_tokens x group +
/// min(batch_size, num_tokens) x (tile_rows - 1)) / tile_rows). Not for cluster-split shapes.
/// Worked example (H200 hd128 EXTEND: 32 q / 8 kv heads, tiles of 128 rows, 264 CTAs): 16
/// requests of 4096 tokens in all -> T = 8 x floor((16384 + 16 x 127) / 128) = 8 x 143 = 1144;
/// 1408 items, 264 merges, 528 partials.
PrefillPlanCapacity prefill_plan_capacity_for_tokens(int batch_size, int64_t num_tokens,
                                                     const PrefillTileShape& shape);

/// The packed row no-op items start at: past the rows of any request a capacity admits.
constexpr int32_t kNoOpRow = INT32_MAX / 2;

/// Pads `plan` to exactly `capacity` with no-op items and merges (prefill_tiles.h: q_row_begin
/// kNoOpRow, kv_begin == kv_end == 0, partial -1; merges with num_partials 0) after the real
/// ones, and raises num_partials to the capacity (the partial buffers are sized for it). The real
/// items keep their order and slots, so a padded plan computes exactly what the unpadded one
/// does. Throws kOutOfResources when the plan exceeds the capacity.
void pad_prefill_plan(PrefillTilePlan& plan, const PrefillPlanCapacity& capacity);

}  // namespace kvattn::core
