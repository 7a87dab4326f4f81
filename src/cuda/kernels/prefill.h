// The batch prefill kernels and their split-KV merge. Two families run a core::PrefillTiles
// plan: the Hopper kernel (sm90/prefill_kernel.cuh: warp-specialised, wgmma, persistent) on
// compute capability 9.0 when the build holds sm_90a code, and the FlashAttention-2 style
// mma.sync kernel (prefill_kernel.cuh) elsewhere. Host-callable from plain C++ (no CUDA headers
// needed beyond cudaStream_t).
//
// Supported (anything else throws kvattn::Error kNotSupported naming the values):
//   io dtype bf16 or fp16; KV dtype equal to io dtype, or fp8 e4m3 / e5m2 (dequantized exactly
//   to the io dtype in shared memory; k_scale folds into the logit scale, v_scale into the
//   output); head_dim 64, 128 or 256 (those compiled, see KVATTN_CUDA_HEAD_DIMS) with
//   v_head_dim == head_dim, head_dim 128 with v_head_dim a multiple of 16 below 128 (the q.k
//   product over head_dim, O over v_head_dim; out and v rows are v_head_dim wide), and on the
//   Hopper kernel head_dim 192 with v_head_dim 128 (DeepSeek's MHA prefill); paged
//   (kv_indices, any page size; a slot outside [0, num_slots) is never read, its key and value
//   count as zero vectors) or ragged (kv_indices == nullptr) K/V; masks none / causal
//   (bottom-right) / custom (per request [q_len, row_len], row_len >= kv_len, keys = the last
//   kv_len columns); window_left (bounds causal and custom masks, ignored with kNone as in the CPU
//   backend: query i sees j >= kv_len - q_len + i - window_left); soft-cap; optional natural-log
//   LSE. sm_scale and k_scale must be positive; k_scale / v_scale apply to every KV dtype. Strides
//   are in elements; the last dim of q/k/v/out must be contiguous and every row 16-byte aligned.
#pragma once

#include <cuda_runtime_api.h>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"

namespace kvattn::cuda {

/// The prefill kernel families.
enum class PrefillKernelFamily {
  kMmaSync,  ///< mma.sync m16n8k16, cp.async double buffer (sm_80+; the A/B baseline on sm_90)
  kSm90,     ///< Hopper: warp-specialised, wgmma, mbarrier pipeline, persistent grid (sm_90a)
  /// Decode-shaped (tc_decode_kernel.cuh): tiles of 32 rows, the 4 warps of a CTA split the keys;
  /// for calls of few query rows per kv head over long KV (verify, draft extend, decode of large
  /// GQA groups). sm_80+.
  kTcDecode,
};

/// The kernel's tile shape for a head_dim: feed tile_rows / kv_tile into
/// core::PrefillTileShape. ctas_per_sm is how many CTAs fit on one SM (for concurrent_ctas).
struct PrefillKernelShape {
  int tile_rows = 0;
  int kv_tile = 0;
  int ctas_per_sm = 0;
  PrefillKernelFamily family = PrefillKernelFamily::kMmaSync;
  /// kTcDecode: the largest thread-block cluster (a power of two <= 16) a cluster-split plan
  /// may use on the device (core::cluster_split_size), 0 where clusters do not run or
  /// KVATTN_TC_DECODE_MERGE=grid|kernel asks for the split merge of the plan's merge items.
  int max_cluster = 0;
  /// kTcDecode: the narrow instance's tile (16 rows; 0 none): a plan of calls with at most that
  /// many packed rows a request may use it (same kv_tile, occupancy and clusters).
  int narrow_tile_rows = 0;
  /// kTcDecode: the transposed instance's tile (8 rows; 0 none): calls of at most that many
  /// packed rows a request (decode with a GQA group <= 8, a draft step of topk x group <= 8)
  /// may use it.
  int transposed_tile_rows = 0;
  /// The prefill families: core::PrefillTileShape::l2_keys for this device and head dims (the
  /// L2 over a key's K and V bytes in the 16-bit io dtype; 0 where the L2 size is unknown).
  /// KVATTN_PREFILL_L2_KEYS=0 turns the L2 order off, =<n> sets it (A/B runs).
  int64_t l2_keys = 0;
};

/// Which family runs (head_dim, v_head_dim) on `device` (-1: the current device): the Hopper
/// kernel on a compute capability 9.0 device when the build holds sm_90a code and the pair has
/// an instance, else mma.sync. The environment variable KVATTN_PREFILL_KERNEL=mma or =sm90
/// forces a family (A/B runs); forcing sm90 where it cannot run throws kNotSupported.
PrefillKernelFamily prefill_kernel_family(int head_dim, int v_head_dim, int device = -1);

/// Whether some prefill kernel serves this pair (v_head_dim == head_dim, head_dim 128 with
/// v_head_dim a multiple of 16 below 128, or 192 / 128); says nothing about which head_dims
/// are compiled or which GPU runs it.
bool prefill_v_head_dim_supported(int head_dim, int v_head_dim);

/// The shape of the family that runs the pair on `device` (-1: current): throws kNotSupported
/// naming both values for a pair no kernel serves there, and for a head_dim not compiled.
PrefillKernelShape prefill_kernel_shape(int head_dim, int v_head_dim, int device = -1);

/// prefill_kernel_shape(head_dim, head_dim) on the current device.
PrefillKernelShape prefill_kernel_shape(int head_dim);

/// The decode-shaped tensor-core kernel (kTcDecode) serves bf16/fp16 io, KV in the io dtype or
/// fp8, head_dim == v_head_dim in {64, 128} (those compiled), paged or ragged K/V, every mask,
/// window and soft-cap the prefill kernels serve. tc_decode_serves says whether it serves the
/// pair; tc_decode_kernel_shape gives its plan shape (throws kNotSupported where it does not).
bool tc_decode_serves(int head_dim, int v_head_dim);
PrefillKernelShape tc_decode_kernel_shape(int head_dim, int v_head_dim, int device = -1);

/// Runs a plan made with tc_decode_kernel_shape's tile_rows / kv_tile (and its split merge),
/// as launch_batch_prefill does for the prefill families. The kernel and the merge are launched
/// as programmatic dependents (kernels/launch.cuh).
void launch_tc_decode(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                      cudaStream_t stream);

/// Runs the prefill over every tile of `tiles` (device pointers, from core::write_prefill_buffer)
/// and, when tiles.num_merges > 0, the merge of split tiles, on the current device (whose family
/// must be the one the plan's shape came from: tiles.tile_rows is checked). All pointers in `p`
/// are device pointers. Asynchronous on `stream`; throws kvattn::Error kDeviceError when a launch
/// fails and kNotSupported / kInvalidArgument on an unsupported or inconsistent call.
void launch_batch_prefill(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                          cudaStream_t stream);

}  // namespace kvattn::cuda
