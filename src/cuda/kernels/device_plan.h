// DECODE and TARGET_VERIFY steps planned on the device from the engine's device seq_lens (issue
// 15), so that a step needs no host copy of its lengths and plans inside a CUDA graph:
//  - DeviceLengths: the call's KV ranges (core::make_paged_layout's layout) and tree-mask rows;
//  - launch_device_plan_decode: the CUDA-core decode kernel's plan, core::plan_decode_rule's
//    item for item;
//  - launch_device_plan_tiles: the tensor-core kernels' plan, core::plan_prefill_tiles's (the
//    same query tokens every request) item for item, padded like core::pad_prefill_plan.
// Each is one CTA (block reductions, scans, one bitonic sort for the heaviest-first order). The
// GPU tests (tests/cuda/test_device_plan.cpp) compare them with the host planners.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/planner.h"
#include "core/prefill_tiles.h"

namespace kvattn::cuda {

/// A call's KV ranges (and, EXTEND-like, its query rows) from ForwardBatch's device lengths, as
/// make_paged_layout lays them out on the host:
///  - DECODE (q_len 1, tree_tokens 0): kv_len = seq_len (window < 0) or min(seq_len, window + 1),
///    kv_start = seq_len - kv_len;
///  - TARGET_VERIFY (q_len = tree_tokens = draft_token_num): kv_len = seq_len + tree_tokens,
///    kv_start 0, and mask_indptr the prefix sums of q_len x kv_len (the tree mask's rows);
///  - EXTEND-like (prefix_lens set): query tokens q = seq_len - prefix_len a request, qo_indptr
///    their prefix sums, kv_len = seq_len (window < 0) or min(seq_len, window + q), kv_start =
///    seq_len - kv_len;
///  - encoder-decoder models (encoder_lens set): the decoder-self set's keys sit after the
///    request's encoder_len encoder tokens (kv_start += encoder_len); the encoder set
///    (encoder_keys) reads the encoder tokens, kv_start 0, kv_len = encoder_len.
/// A seq_len outside [0, max_context_len - tree_tokens - encoder_len] is clamped into it here
/// (nothing reads outside req_to_token), and an encoder_len into [0, max_context_len -
/// tree_tokens]; the step-check kernel refuses that step (kArgSeqLens, kArgEncoderLens). Likewise a
/// prefix_len outside [0, seq_len] is clamped, and qo_indptr is clamped to num_tokens (nothing
/// reads past q): the step check refuses lengths that do not add up to num_tokens. A tree mask
/// shorter than mask_indptr[batch_size] zeroes every kv_len (nothing reads past the mask; the
/// step check refuses the step: kArgCustomMask).
struct DeviceLengths {
  const void* seq_lens = nullptr;  ///< [batch_size] int32 or int64, device
  bool seq_lens_int64 = false;
  int window = -1;  ///< the window index set: W; -1: every key
  int max_context_len = 0;
  int q_len = 1;        ///< query tokens a request (DECODE, TARGET_VERIFY)
  /// Keys a request has after seq_len: TARGET_VERIFY its tree tokens; draft step s of the
  /// multi-step draft its draft tokens of steps 0..s ((s + 1) x topk, or s + 1 a branch).
  int tree_tokens = 0;
  /// Entries a request: entry r of the call reads seq_lens[r / per_request] (the multi-step
  /// draft's branch entries: topk); else 1.
  int per_request = 1;
  /// EXTEND-like: [batch_size] int32 or int64 prefix lengths, device (q_len is then unused).
  const void* prefix_lens = nullptr;
  bool prefix_lens_int64 = false;
  /// Encoder-decoder models: [batch_size] int32 or int64 encoder lengths, device; null else.
  const void* encoder_lens = nullptr;
  bool encoder_lens_int64 = false;
  bool encoder_keys = false;            ///< the encoder index set (cross-attention layers)
  int64_t num_tokens = 0;               ///< EXTEND-like: the step's query rows (out_cache_loc's)
  int32_t* qo_indptr = nullptr;         ///< [batch_size + 1] out, EXTEND-like only
  int32_t* kv_start = nullptr;          ///< [batch_size] out (call metadata)
  int32_t* kv_len = nullptr;            ///< [batch_size] out (call metadata)
  /// [batch_size + 1] out, custom mask only: q_len x kv_len rows a request. Null with a custom
  /// mask: the rows do not follow the lengths (the draft's branch masks: the host wrote them).
  int64_t* mask_indptr = nullptr;
  const int64_t* mask_elems = nullptr;  ///< [1] device: the tree mask's length (custom mask)
};

/// One decode call's plan, from kv_len on the device into the call's metadata arrays.
struct DevicePlanDecode {
  /// The KV lengths: given (kv_len), or derived from seq_lens first (lengths.seq_lens set: the
  /// kernel writes lengths.kv_start / kv_len and plans from those; kv_len is then ignored).
  const int32_t* kv_len = nullptr;  ///< [batch_size] device
  DeviceLengths lengths;
  int batch_size = 0;
  core::DecodePlanConfig config;
  int item_capacity = 0;                  ///< items the buffers hold (core::decode_item_capacity)
  int64_t* kv_indptr = nullptr;           ///< [batch_size + 1] out
  core::DecodeWorkItem* items = nullptr;  ///< [item_capacity] out (the first num_items)
  int32_t* merge_indptr = nullptr;        ///< [batch_size + 1] out
  int32_t* num_items = nullptr;           ///< [1] out
  int32_t* chunk = nullptr;               ///< [1] out (the plan's chunk; may be null)
};

/// Largest batch and item capacity one planning CTA takes (its shared memory).
constexpr int kDevicePlanMaxBatch = 4096;
constexpr int kDevicePlanMaxItems = 4096;

/// Whether one planning CTA takes a decode plan of batch_size requests in item_capacity items
/// (the bounds launch_device_plan_decode checks; a caller refuses a step before writing it).
bool device_plan_decode_fits(int batch_size, int item_capacity);

/// Throws kvattn::Error (kInvalidArgument naming the field) for a plan beyond those bounds or a
/// bad config; launches one CTA on `stream` (records into a CUDA graph).
void launch_device_plan_decode(const DevicePlanDecode& plan, cudaStream_t stream);

/// The tensor-core plan of a call from its device lengths, written where the host's padded plan
/// would be: items [capacity.items] (the plan, then no-op items), merges [capacity.merges] (then
/// empty merges), the scheduler counters zeroed; partial slots are numbered below
/// capacity.partials. It is core::plan_prefill_tiles's plan item for item for the same shape
/// (every tile heaviest first, or the L2 order of head groups where shape.l2_keys asks for it;
/// causal and window bounds a row tile, split-KV, cluster split). capacity =
/// core::prefill_plan_capacity(batch_size, q_len, shape) (DECODE, TARGET_VERIFY) or
/// core::prefill_plan_capacity_for_tokens(batch_size, num_tokens, shape) (EXTEND-like:
/// lengths.prefix_lens set; no cluster split).
struct DevicePlanTiles {
  DeviceLengths lengths;  ///< seq_lens required
  int batch_size = 0;
  core::PrefillTileShape shape;
  core::PrefillPlanCapacity capacity;
  int64_t* kv_indptr = nullptr;              ///< [batch_size + 1] out
  core::PrefillWorkItem* items = nullptr;    ///< [capacity.items] out
  core::PrefillMergeItem* merges = nullptr;  ///< [capacity.merges] out
  int* scheduler = nullptr;                  ///< PrefillTiles::scheduler (4 ints) or null
};

/// Largest batch and sorted keys (items, a power of two) one tile-planning CTA takes, and its
/// shared memory.
constexpr int kDevicePlanTilesMaxBatch = 2048;
constexpr int kDevicePlanTilesMaxKeys = 16384;
constexpr size_t kDevicePlanTilesMaxSmem = 227 * 1024;  // sm_90: the most a CTA opts into

/// Whether one tile-planning CTA takes a plan of batch_size requests of this capacity (the
/// bounds launch_device_plan_tiles checks; a caller refuses a step before writing it).
bool device_plan_tiles_fit(int batch_size, const core::PrefillPlanCapacity& capacity,
                           const core::PrefillTileShape& shape);

/// Throws kvattn::Error (kInvalidArgument naming the field) for a plan beyond those bounds or a
/// shape it does not plan; launches one CTA on `stream` (records into a CUDA graph).
void launch_device_plan_tiles(const DevicePlanTiles& plan, cudaStream_t stream);

}  // namespace kvattn::cuda
