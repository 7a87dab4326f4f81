// The CUDA backend's internals shared with the multi-step draft runner: the per-call plan and
// buffers, the decode setup chosen at construction, and the launch helpers. Plain C++ (runtime
// API header only); the kernels live in kernels/.
//
// Step flow (SPEC §4):
//   out_graph (host): read lengths, make each index set's layout (core::make_paged_layout), plan
//     it (core::plan_decode or core::plan_prefill_tiles), write the call metadata into pinned
//     staging and copy it to the device with one cudaMemcpyAsync per call. May allocate (buffers
//     grow geometrically; after init_cuda_graph_state the graph buffers are fixed).
//   in_graph (device): build kv_indices from req_to_token with one kernel per paged call (and,
//     TARGET_VERIFY on a window layer, fold the window into the tree mask on the device).
//   forward_*: save K/V, launch the decode / prefill kernels. Neither syncs nor allocates.
//
// CUDA graphs (SPEC §4): init_cuda_graph_state(max_bs, max_num_tokens) allocates every buffer a
// captured DECODE / TARGET_VERIFY step of up to max_bs requests touches (the "graph pool": call
// metadata and plans, split-KV scratch, kv_indices, the folded tree mask, the fp32-io copies,
// pinned staging) and freezes it. A batch of a captured bucket runs on the graph pool, with
// launch sizes that depend on the batch size alone: the CUDA-core decode grid covers
// core::decode_item_capacity items (the kernel reads the plan's item count from the device), the
// prefill plan is padded to core::prefill_plan_capacity with no-op items, the index kernels
// cover max_context_len keys. So out_graph at replay only rewrites buffer contents (one async
// copy per call), and a graph captured once for a batch size replays any later batch of that
// size. The engine pads a bucket's unused entries (seq_len = cuda_graph_seq_len_fill_value(), a
// req_to_token row whose slots are valid, out_cache_loc 0) and keeps the batch tensors (q, k, v,
// out, req_pool_indices, seq_lens, out_cache_loc, tree mask, positions) at fixed addresses. The
// buckets share the graph buffers, so a graph is replayed right after an out_graph for a batch
// of its own size and mode (as the reference's replay does).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "core/batch_layout.h"
#include "core/planner.h"
#include "core/prefill_tiles.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/decode.h"
#include "cuda/kernels/device_plan.h"
#include "cuda/kernels/index.h"
#include "cuda/kernels/step_check.h"
#include "kvattn/backend.h"
#include "kvattn/memory.h"

namespace kvattn::cuda {

/// How decode runs for one backend config, fixed at construction.
struct DecodeSetup {
  bool tensor_cores = false;       ///< decode through the prefill (tensor-core) kernel
  bool prefill_supported = false;  ///< the prefill kernel serves this config (EXTEND & co.)
  /// The io dtype the prefill kernel runs in: q_dtype when 16-bit, else (fp32 q) the cache's
  /// 16-bit dtype (bf16 for bf16 / fp8 caches, fp16 for fp16 caches).
  DType compute_dtype = DType::kBFloat16;
  DecodeKernelInfo info;  ///< the CUDA-core decode kernel's facts
  core::DecodePlanConfig plan_config;
  int concurrent_prefill_ctas = 0;
  int prefill_tile_rows = 0;
  int prefill_kv_tile = 0;
  int64_t prefill_l2_keys = 0;  ///< core::PrefillTileShape::l2_keys of the family
  /// The decode-shaped tensor-core kernel (kernels/prefill.h, kTcDecode) serves this config: calls
  /// of at most kTcDecodeMaxRows packed rows a request (verify, draft extend, tensor-core decode)
  /// run on it. KVATTN_TC_DECODE=0 turns it off (A/B runs).
  bool tc_decode = false;
  int tc_decode_tile_rows = 0;
  int tc_decode_kv_tile = 0;
  int concurrent_tc_decode_ctas = 0;
  int tc_decode_min_split = 0;  ///< keys (KVATTN_TC_DECODE_MIN_SPLIT; default 256)
  int tc_decode_max_cluster = 0;  ///< largest cluster of a cluster-split plan (0: none)
  /// The narrow (16-row) instance's tile, for calls of at most that many packed rows a request
  /// (0: none; KVATTN_TC_DECODE_NARROW=0 turns it off).
  int tc_decode_narrow_rows = 0;
  int tc_decode_transposed_rows = 0;     ///< its transposed instance's tile (0: not used)
  bool tc_decode_narrow_always = false;  ///< KVATTN_TC_DECODE_NARROW=2 (A/B knob)
};
/// cudaMalloc'd bases are 256-byte aligned; the regions a buffer is cut into (the prefill
/// region of a call's metadata, the io copies, the cascade scratch) start on such a boundary too.
constexpr size_t kRegionAlignment = 256;
inline size_t align_region(size_t bytes) {
  return (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

/// Packed rows a request (q tokens x GQA group) up to which a call runs on the decode-shaped
/// kernel: two of its 32-row tiles (each reads the request's KV; beyond that the prefill
/// kernels' larger tiles read it fewer times).
constexpr int kTcDecodeMaxRows = 64;
DecodeSetup make_decode_setup(const BackendConfig& config, int device);

/// One batched attention call of a step: its host plan and its buffers, reused step after step.
struct CallState {
  core::PagedLayout layout;
  bool paged = true;       ///< keys from the paged cache through kv_indices (else the new tokens)
  bool prefill = false;    ///< runs the prefill kernel (else the CUDA-core decode kernel)
  bool tc_decode = false;  ///< prefill: the plan is for the decode-shaped tensor-core kernel
  core::DecodePlan decode_plan;
  int item_limit = 0;  ///< core::decode_item_capacity(batch_size): a captured grid covers this
  core::PrefillTilePlan prefill_plan;  ///< padded to a fixed capacity on the graph pool
  bool padded = false;                 ///< prefill_plan was padded: a captured grid covers it
  int prefill_items = 0;               ///< the plan's real items and merges (before padding)
  int prefill_merges = 0;
  core::PrefillTiles prefill_tiles;  ///< device view, filled by upload (padded counts)
  int max_kv_len = 0;
  /// A DECODE call planned on the device (core::StepFacts::device_lengths): out_graph uploads
  /// the query layout and the step state only; in_graph's planner (kernels/device_plan.h) writes
  /// kv_start / kv_len / kv_indptr and the plan, padded to its fixed capacity, and every launch
  /// covers that capacity.
  bool device_plan = false;
  int64_t mask_elems = 0;  ///< device_plan && TARGET_VERIFY: the batch's tree mask length
  core::PrefillTileShape plan_shape;        ///< device_plan && prefill: the planner's shape ...
  core::PrefillPlanCapacity plan_capacity;  ///< ... and the capacity it pads to
  const uint8_t* custom_mask = nullptr;  ///< device tree mask the kernel reads (TARGET_VERIFY)
  /// TARGET_VERIFY on a window layer: in_graph folds the window into `folded_mask` from the
  /// engine's mask (tree_mask) and positions.
  bool fold_window = false;
  const uint8_t* tree_mask = nullptr;

  core::CallCapacity capacity;  ///< what the buffers hold now
  core::CallMetadataLayout offsets;
  bool frozen = false;  ///< graph buffers: never reallocated (captured graphs hold their address)
  PinnedBuffer staging;
  std::unique_ptr<CopyFence> fence;
  Buffer metadata;     ///< [call metadata | prefill region (metadata, then its scratch)]
  Buffer scratch;      ///< decode partial states
  Buffer kv_indices;   ///< int32 [total keys]
  Buffer folded_mask;  ///< TARGET_VERIFY on a window layer: the tree mask with the window folded in

  template <typename T>
  const T* meta(size_t offset) const {
    return reinterpret_cast<const T*>(static_cast<const char*>(metadata.data()) + offset);
  }
};

/// Sizes `call`'s buffers for `capacity` (and kv_indices for `kv_indices_capacity` keys),
/// writes its metadata into staging and queues one async copy on `stream`. The copy also resets
/// the call's StepState (zeros, `step`): the first call of a step's pool holds the step's error
/// word (step_state_of). Throws kOutOfResources when a frozen (graph) buffer is too small.
void upload_call(CallState& call, const core::CallCapacity& capacity, int64_t kv_indices_capacity,
                 int v_head_dim, uint64_t step, Device device, cudaStream_t stream);

/// The step's error state (kernels/step_check.h): in the metadata of the first call of the pool
/// the step runs on (device memory; reset by that call's upload_call).
StepState* step_state_of(const CallState& first_call);

/// The keys `call`'s kv_indices must hold: graph_kv_capacity on the graph pool, else its
/// layout's keys, or max_context_len a request for a call planned on the device (its lengths are
/// on the device only).
int64_t call_kv_capacity(const CallState& call, bool graph_pool, int64_t graph_kv_capacity,
                         int max_context_len);

/// out_graph's half of a tensor-core call planned on the device: its tile shape and fixed
/// capacity, and the plan's sizes (write_prefill_buffer lays the buffer out from them; in_graph's
/// planner writes the contents). Every launch covers the capacity (call.padded).
void size_device_tile_plan(CallState& call, const core::PrefillTileShape& shape,
                           const core::PrefillPlanCapacity& capacity, int group_size);

/// A call planned on the device (CallState::device_plan), in in_graph: its KV ranges into its
/// metadata (kv_start, kv_len, kv_indptr) and its plan from `lengths` (whose output pointers
/// other than kv_start / kv_len / qo_indptr / mask_indptr this fills): the tile planner for a
/// tensor-core call (plan_shape, plan_capacity, the prefill region), else the CUDA-core decode
/// plan of config. One planning CTA on `stream` (records into a CUDA graph).
void launch_call_plan(const CallState& call, DeviceLengths lengths,
                      const core::DecodePlanConfig& config, cudaStream_t stream);

/// All-or-nothing growth of several buffers (init_cuda_graph_state): need() records what each
/// buffer must hold; apply() checks the bytes to add against the device's free memory (refusing
/// with the numbers before allocating anything), allocates every buffer that is too small while
/// the old ones stay in place, and swaps them in only when all allocations succeeded. A failure
/// frees what apply() allocated and leaves every buffer as it was.
class BufferGrowth {
 public:
  void need(Buffer& target, size_t bytes);
  void need(PinnedBuffer& target, size_t bytes);
  void need(std::unique_ptr<CopyFence>& fence);
  /// Throws kOutOfResources naming `what` (and changes nothing) when the memory is not there.
  void apply(Device device, const std::string& what);
  /// Bytes apply() would add on the device / in pinned host memory.
  size_t device_bytes() const;
  size_t pinned_bytes() const;

 private:
  struct DeviceNeed {
    Buffer* target;
    size_t bytes;
  };
  struct PinnedNeed {
    PinnedBuffer* target;
    size_t bytes;
  };
  std::vector<DeviceNeed> device_;
  std::vector<PinnedNeed> pinned_;
  std::vector<std::unique_ptr<CopyFence>*> fences_;
};

/// Records in `growth` what `call` needs for graph replays of up to `capacity` (and a prefill
/// plan region of `prefill_region`'s size: zero for none), pinned staging included; after
/// growth.apply() succeeded, freeze_call marks it frozen.
void plan_frozen_call(CallState& call, const core::CallCapacity& capacity,
                      int64_t kv_indices_capacity, const core::PrefillBufferLayout& prefill_region,
                      BufferGrowth& growth);
void freeze_call(CallState& call);

/// Grows `buffer` to at least `bytes` (by half again when that fits, else exactly), allocating
/// the new buffer before freeing the old one, so a failed growth (kOutOfResources) leaves the
/// buffer as it was. A frozen buffer that is too small throws kOutOfResources naming `what`
/// instead (captured graphs hold its address).
void ensure_bytes(Buffer& buffer, size_t bytes, bool frozen, Device device, const char* what);

/// The AttentionParams of one call for one layer: paged K/V from the cache (or the ragged new
/// tokens k/v), the call's device metadata, the layer's scale / cap / fp8 scales, and the step's
/// error word (`state`, see step_state_of).
core::AttentionParams make_params(const CallState& call, const BackendConfig& config,
                                  const AttentionLayer& layer, const TensorView& q,
                                  const TensorView& out, float* lse, const TensorView& ragged_k,
                                  const TensorView& ragged_v, const StepState* state);

/// The tile shape a prefill plan (core::plan_prefill_tiles) is made for: the decode-shaped
/// kernel's (tc, setup.tc_decode) or the prefill family's; deterministic mode never splits KV.
/// With batch_size > 0, a decode-shaped plan of that many requests of at most q_len query tokens
/// gets the transposed instance's 8-row tiles where q_len x group fits them, else the narrow
/// instance's 16-row tiles where they fit, and the cluster split
/// where the batch is small (core::cluster_split_size: from the batch
/// shape alone, so a graph's plan and the eager one agree); without it, the shape sizes buffers
/// (a cluster plan never needs more than the plain split's capacity).
core::PrefillTileShape prefill_tile_shape(const DecodeSetup& setup, const BackendConfig& config,
                                          core::MaskMode mask, int window_left, bool tc,
                                          int batch_size = 0, int q_len = 0);

/// The engine's req_to_token and a batch's rows of it, as the index kernels read them.
ReqToTokenSource req_to_token_source(const ReqToTokenPool& pool,
                                     const TensorView& req_pool_indices);

/// in_graph, a call with a tree mask on the decode-shaped kernel: the mask's all-ones prefix
/// columns of each request into the call's mask_dense (launch_mask_dense_prefix); else nothing.
void scan_mask_dense_prefix(const CallState& call, cudaStream_t stream);

/// Runs one call (decode kernel or prefill kernel) with `params`.
void run_call(const CallState& call, const core::AttentionParams& params, int device,
              cudaStream_t stream);

/// How a K/V save meets the step's error state (kernels/kv_write.h).
struct SaveGuard {
  StepState* state = nullptr;     ///< the step's error word: nothing is written when set
  bool check_loc = false;         ///< the step-check kernel did not see `loc`: check it here
  StepReport* reports = nullptr;  ///< where check_loc publishes a bad slot
  StepArgument loc_argument = kArgOutCacheLoc;
};

/// Attention sinks on a finished output: out's rows (num_tokens x sinks.size(0) heads) scaled
/// by 1 / (1 + e^(s_h - lse)), lse the rows' LSE the attention left (launch_apply_sinks).
void fold_sinks(const TensorView& out, int v_head_dim, const float* lse, const TensorView& sinks,
                int64_t num_tokens, const uint32_t* step_error, cudaStream_t stream);

/// Saves k/v at `loc` in the layer's cache (device kernel; a refused step writes nothing).
void save_kv(const BackendConfig& config, const AttentionLayer& layer, const TensorView& k,
             const TensorView& v, const TensorView& loc, const SaveGuard& guard,
             cudaStream_t stream);

/// `t` (a 1-D int32 / int64 device tensor, or absent) as the step-check kernel reads it.
DeviceIndexArray device_index_array(const TensorView& t);

namespace debug {
/// Device and pinned-host allocations the CUDA backend and the draft runner have made in this
/// process (tests: nothing may allocate during a graph replay).
uint64_t allocation_count();
}  // namespace debug

}  // namespace kvattn::cuda
