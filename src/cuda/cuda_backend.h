// The CUDA backend's internals shared with the multi-step draft runner: the per-call plan and
// buffers, the decode setup chosen at construction, and the launch helpers. Plain C++ (runtime
// API header only); the kernels live in kernels/.
//
// Step flow (SPEC §4):
//   out_graph (host): read lengths, make each index set's layout (core::make_paged_layout), plan
//     it (core::plan_decode or core::plan_prefill_tiles), write the call metadata into pinned
//     staging and copy it to the device with one cudaMemcpyAsync per call. May allocate (buffers
//     grow geometrically; after init_cuda_graph_state the graph buffers are fixed).
//   in_graph (device): build kv_indices from req_to_token with one kernel per paged call.
//   forward_*: save K/V, launch the decode / prefill kernels. Neither syncs nor allocates.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "core/batch_layout.h"
#include "core/planner.h"
#include "core/prefill_tiles.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/decode.h"
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
};
DecodeSetup make_decode_setup(const BackendConfig& config, int device);

/// One batched attention call of a step: its host plan and its buffers, reused step after step.
struct CallState {
  core::PagedLayout layout;
  bool paged = true;     ///< keys from the paged cache through kv_indices (else the new tokens)
  bool prefill = false;  ///< runs the prefill kernel (else the CUDA-core decode kernel)
  core::DecodePlan decode_plan;
  int item_limit = 0;  ///< core::decode_item_capacity(batch_size): a captured grid covers this
  core::PrefillTilePlan prefill_plan;
  core::PrefillTiles prefill_tiles;  ///< device view, filled by upload
  int max_kv_len = 0;
  const uint8_t* custom_mask = nullptr;  ///< device tree mask (TARGET_VERIFY)

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
/// writes its metadata into staging and queues one async copy on `stream`. Throws
/// kOutOfResources when a frozen (graph) buffer is too small.
void upload_call(CallState& call, const core::CallCapacity& capacity, int64_t kv_indices_capacity,
                 int v_head_dim, Device device, cudaStream_t stream);

/// Preallocates `call` for graph replays of up to `capacity` and freezes its buffers.
void reserve_frozen_call(CallState& call, const core::CallCapacity& capacity,
                         int64_t kv_indices_capacity, size_t prefill_region_bytes, Device device);

/// q/out (and the per-head strides of a [tokens, heads, dim] or [tokens, heads * dim] view).
struct HeadStrides {
  int64_t token = 0;
  int64_t head = 0;
};
HeadStrides head_strides(const TensorView& t, int dim);

/// The AttentionParams of one call for one layer: paged K/V from the cache (or the ragged new
/// tokens k/v), the call's device metadata, the layer's scale / cap / fp8 scales.
core::AttentionParams make_params(const CallState& call, const BackendConfig& config,
                                  const AttentionLayer& layer, const TensorView& q,
                                  const TensorView& out, float* lse, const TensorView& ragged_k,
                                  const TensorView& ragged_v);

/// Runs one call (decode kernel or prefill kernel) with `params`.
void run_call(const CallState& call, const core::AttentionParams& params, int device,
              cudaStream_t stream);

/// Saves k/v at `loc` in the layer's cache (device kernel; bad slots are flagged, not written).
void save_kv(const BackendConfig& config, const AttentionLayer& layer, const TensorView& k,
             const TensorView& v, const TensorView& loc, uint32_t* error_word, cudaStream_t stream);

}  // namespace kvattn::cuda
