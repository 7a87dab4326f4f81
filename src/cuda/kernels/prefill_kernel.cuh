// The batch prefill kernel: FlashAttention-2 on mma.sync m16n8k16 (fp32 accumulate), K/V tiles
// gathered by slot (paged) or by row (ragged) with cp.async into XOR-swizzled shared memory,
// double buffered. Included by the one-per-head_dim instance files (prefill_hd*.cu); only
// head_dim, the io dtype and kNarrowV are template parameters, everything else is a runtime
// branch.
//
// kNarrowV (instantiated at head_dim 128 only, prefill_hd128_narrow_v.cu): v_head_dim is a
// runtime multiple of 16 below head_dim. The tiles keep the head_dim layout; V copies fill only
// the first v_head_dim columns of a V tile, O += P V stops at v_head_dim, and the epilogue writes
// v_head_dim columns. O's columns past v_head_dim stay zero and are never stored. With kNarrowV
// false every such test folds away at compile time (the v_head_dim == head_dim code is unchanged).
//
// Work split: one CTA per core::PrefillWorkItem (a tile of tile_rows packed rows, see
// core/prefill_tiles.h), 4 warps; warp w owns rows [w * kRowsPerWarp, (w + 1) * kRowsPerWarp) of
// the tile as kMAtoms 16-row MMA atoms, so a K/V fragment read from shared memory feeds kMAtoms
// MMAs. Logits are kept in log2 units: p = 2^(x * scale_log2 - m * scale_log2), one FFMA + EX2.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/prefill.h"
#include "cuda/kernels/step_check.cuh"
#include "cuda/kernels/toolkit/compiled_head_dims.h"
#include "cuda/kernels/toolkit/ptx.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda::prefill_detail {

/// Tile shape per head_dim. Registers bound it: a warp holds kMAtoms * 16 rows of O in fp32
/// (kMAtoms * head_dim / 2 registers a thread), so head_dim 256 keeps one atom a warp.
template <int kHeadDim>
struct PrefillTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMAtoms = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kRowsPerWarp = 16 * kMAtoms;
  static constexpr int kTileRows = kWarps * kRowsPerWarp;
  // 64 keys a step (32 at head_dim 256, so two stages of K and V stay at 64 KiB and two CTAs
  // fit on an SM).
  static constexpr int kTileKeys = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks in a 16-bit row
  static constexpr int kQBytes = kTileRows * kHeadDim * 2;
  static constexpr int kKvTileBytes = kTileKeys * kHeadDim * 2;  // one K (or V) tile, 16-bit
  static constexpr int kStageBytes = 2 * kKvTileBytes;           // K and V
  // Paged: the slots of the next two steps' keys, copied one step ahead of their use.
  static constexpr int kSlotBytes = 2 * kTileKeys * 4;
  // kCustom: the request's mask row base and row length (kept in shared memory rather than in
  // registers the whole loop would carry).
  static constexpr int kMaskInfoBytes = 16;
  static constexpr int kSmemBytes = kQBytes + 2 * kStageBytes + kSlotBytes + kMaskInfoBytes;
  static constexpr int kMinBlocks = 2;
  static_assert(kHeadDim % 64 == 0, "the XOR swizzle needs >= 8 chunks a row");
  static_assert((kTileKeys * kChunks) % kThreads == 0, "whole K/V chunks per thread");
  static_assert((kTileKeys * kChunks / 2) % kThreads == 0, "whole fp8 chunks per thread");
  static_assert((kTileRows * kChunks) % kThreads == 0, "whole Q chunks per thread");
};

// The shared device toolkit (toolkit/ptx.cuh): one definition of every wrapper.
using ptx::cp_async_commit;
using ptx::fast_exp2;
using ptx::fast_tanh;
using ptx::fp8x2_to;
using ptx::kLn2;
using ptx::kLog2e;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_16816;
using ptx::pack2;
using ptx::smem_address;

// ---- the kernel -----------------------------------------------------------------------------

template <int kHeadDim, bool kNarrowV, typename T>
__global__ void __launch_bounds__(PrefillTraits<kHeadDim>::kThreads,
                                  PrefillTraits<kHeadDim>::kMinBlocks)
    batch_prefill_kernel(const core::AttentionParams p, const core::PrefillTiles tiles) {
  using Tr = PrefillTraits<kHeadDim>;
  constexpr int kChunks = Tr::kChunks;
  constexpr int kThreads = Tr::kThreads;
  constexpr int kMAtoms = Tr::kMAtoms;
  constexpr int kTileKeys = Tr::kTileKeys;
  constexpr int kKeyTiles = kTileKeys / 8;      // n8 tiles of S
  constexpr int kDimTiles = kHeadDim / 8;       // n8 tiles of O
  constexpr uint32_t kRowBytes = kChunks * 16;  // one 16-bit row of q/k/v in shared memory
  // Columns of V and O that exist (a multiple of 16, see prefill.cu's check).
  const int v_dim = kNarrowV ? p.v_head_dim : kHeadDim;

  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = smem_address(smem);
  const uint32_t s_kv = s_q + Tr::kQBytes;

  if (detail::step_refused(p.step_error)) return;  // a refused step writes nothing (step_check.h)
  const core::PrefillWorkItem item = tiles.items[blockIdx.x];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int request = item.request;
  const int q_begin = p.qo_indptr[request];
  const int q_len = p.qo_indptr[request + 1] - q_begin;
  const int64_t kv_base = p.kv_indptr[request];
  const int kv_len = static_cast<int>(p.kv_indptr[request + 1] - kv_base);
  const int group = tiles.group_size;
  const int rows_total = q_len * group;
  const int row0 = item.q_row_begin;
  const int kv_head = item.kv_head;
  const int kv_begin = item.kv_begin;
  const int kv_end = item.kv_end;
  const int num_steps = (kv_end - kv_begin + kTileKeys - 1) / kTileKeys;

  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3 || p.kv_dtype == DType::kFloat8E5M2;
  const bool e5m2 = p.kv_dtype == DType::kFloat8E5M2;
  const bool paged = p.kv_indices != nullptr;
  const bool causal = p.mask == core::MaskMode::kCausal;
  const bool custom = p.mask == core::MaskMode::kCustom;
  // The window bounds causal and custom masks; with kNone it is ignored (as the CPU backend).
  const int window = p.mask == core::MaskMode::kNone ? -1 : p.window_left;
  const bool soft_cap = p.logit_cap > 0.f;
  // k_scale folds into the logit scale, v_scale into the output (exact: dequantization is a
  // per-tensor product).
  const float qk_scale = p.sm_scale * p.k_scale;
  const float scale_log2 = soft_cap ? kLog2e : qk_scale * kLog2e;
  const float cap_inner = soft_cap ? qk_scale / p.logit_cap : 0.f;
  // Query token i sees keys j <= kv_len - q_len + i (causal) and j >= that - window.
  const int diagonal = kv_len - q_len;
  const int tile_first_token = row0 / group;
  const int tile_last_token = (min(rows_total, row0 + Tr::kTileRows) - 1) / group;

  // kCustom: the request's mask is [q_len, row_len] with row_len >= kv_len; the keys are the
  // last kv_len columns of a row (the CPU backend's contract). Read after the first barrier.
  int64_t* mask_info =
      reinterpret_cast<int64_t*>(smem + Tr::kQBytes + 2 * Tr::kStageBytes + Tr::kSlotBytes);
  if (custom && tid == 0) {
    const int64_t begin = p.mask_indptr[request];
    const int64_t row_len = q_len > 0 ? (p.mask_indptr[request + 1] - begin) / q_len : 0;
    mask_info[0] = reinterpret_cast<int64_t>(p.custom_mask + begin + (row_len - kv_len));
    mask_info[1] = row_len;
  }
  auto custom_row = [&](int token) -> const uint8_t* {
    return reinterpret_cast<const uint8_t*>(mask_info[0]) + token * mask_info[1];
  };

  // ---- loads ----------------------------------------------------------------------------
  if (num_steps > 0) {
    constexpr int kQChunksPerThread = Tr::kTileRows * kChunks / kThreads;
    const T* q = static_cast<const T*>(p.q);
#pragma unroll
    for (int i = 0; i < kQChunksPerThread; ++i) {
      const int index = tid + i * kThreads;
      const int r = index / kChunks;
      const int c = index % kChunks;
      const int packed = row0 + r;
      const bool valid = packed < rows_total;
      const T* src = q;
      if (valid) {
        const int token = packed / group;
        const int head = kv_head * group + packed % group;
        src = q + (int64_t(q_begin) + token) * p.q_stride_token + int64_t(head) * p.q_stride_head +
              c * 8;
      }
      ptx::cp_async_zfill<16>(s_q + (r * kChunks + (c ^ (r & 7))) * 16, src, valid);
    }
  }

  // Paged: the slot table holds, per buffer, the slots of one step's keys (copied a step ahead,
  // so a copy never waits on the load of its own address).
  const uint32_t s_slots = s_kv + 2 * Tr::kStageBytes;
  const int32_t* slot_table =
      reinterpret_cast<const int32_t*>(smem + Tr::kQBytes + 2 * Tr::kStageBytes);
  auto issue_slots = [&](int kv_start, int buffer) {
    if (tid < kTileKeys) {
      const int j = kv_start + tid;
      const bool valid = j < kv_end;
      ptx::cp_async_zfill<4>(s_slots + (buffer * kTileKeys + tid) * 4,
                             valid ? p.kv_indices + kv_base + j : p.kv_indices, valid);
    }
  };
  // Issues the copies of keys [kv_start, kv_start + kTileKeys) into buffer `buffer`: 16-bit K/V
  // straight into a swizzled stage; fp8 bytes into a raw staging buffer that convert_fp8 turns
  // into a stage (each thread converts the chunks it copied itself). A thread copies chunk
  // column c of rows r0 + i * kRowStep, so every per-chunk offset but the storage row is a
  // constant. Rows past the tile's keys and slots outside the pool are zero-filled, not read.
  const uint32_t slot_limit = static_cast<uint32_t>(min(p.num_slots, int64_t(INT32_MAX)));
  auto issue_tile = [&]<bool kFp8>(int kv_start, int buffer) {
    using E = std::conditional_t<kFp8, uint8_t, T>;
    constexpr int kRowChunks = kFp8 ? kChunks / 2 : kChunks;  // 16-byte chunks a K/V row
    constexpr int kElems = 16 / sizeof(E);
    constexpr int kRowStep = kThreads / kRowChunks;
    constexpr int kPerThread = kTileKeys / kRowStep;
    static_assert(kThreads % kRowChunks == 0 && kRowStep % 4 == 0 && kTileKeys % kRowStep == 0);
    const int r0 = tid / kRowChunks;
    const int c = tid % kRowChunks;
    // kNarrowV: a thread whose chunk column is past v_head_dim copies no V (the columns are
    // never read; v_head_dim % 16 == 0 keeps every chunk wholly in or out).
    const bool copies_v = !kNarrowV || c * kElems < v_dim;
    int64_t rows[kPerThread];
    bool valid[kPerThread];
    const int limit = kv_end - kv_start - r0;  // chunk i holds a key of the tile iff i*step < it
    if (paged) {
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int32_t slot = slot_table[buffer * kTileKeys + r0 + i * kRowStep];
        valid[i] = i * kRowStep < limit && static_cast<uint32_t>(slot) < slot_limit;
        rows[i] = slot;
      }
    } else {
      const int64_t row0 = kv_base + kv_start + r0;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        valid[i] = i * kRowStep < limit;
        rows[i] = row0 + i * kRowStep;
      }
    }
    const E* k_base = static_cast<const E*>(p.k) + int64_t(kv_head) * p.k_stride_head + c * kElems;
    const E* v_base = static_cast<const E*>(p.v) + int64_t(kv_head) * p.v_stride_head + c * kElems;
    uint32_t k_dst, v_dst;
    if constexpr (kFp8) {
      k_dst = s_kv + Tr::kStageBytes + buffer * Tr::kKvTileBytes + tid * 16;
      v_dst = k_dst + Tr::kKvTileBytes / 2;
    } else {
      k_dst = s_kv + buffer * Tr::kStageBytes + r0 * kRowBytes + (c ^ (r0 & 7)) * 16;
      v_dst = k_dst + Tr::kKvTileBytes;
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      // Swizzle: row r0 + i*step has (row & 7) = (r0 & 7) ^ (i*step & 7) since step % 4 == 0.
      const uint32_t offset = kFp8 ? i * kThreads * 16 : i * kRowStep * kRowBytes;
      const uint32_t flip = kFp8 ? 0 : ((i * kRowStep) & 7) * 16;
      const E* k_src = valid[i] ? k_base + rows[i] * p.k_stride_token : k_base;
      const E* v_src = valid[i] ? v_base + rows[i] * p.v_stride_token : v_base;
      ptx::cp_async_zfill<16>((k_dst ^ flip) + offset, k_src, valid[i]);
      if (copies_v) ptx::cp_async_zfill<16>((v_dst ^ flip) + offset, v_src, valid[i]);
    }
  };
  auto issue_kv = [&](int kv_start, int buffer) {
    if (fp8) {
      issue_tile.template operator()<true>(kv_start, buffer);
    } else {
      issue_tile.template operator()<false>(kv_start, buffer);
    }
    cp_async_commit();
  };

  // fp8 only: raw buffer -> stage 0, this thread's own chunks (no barrier between copy and use).
  auto convert_fp8 = [&](int buffer) {
    constexpr int kRawChunks = kChunks / 2;
    constexpr int kPerThread = kTileKeys * kRawChunks / kThreads;
    const unsigned char* raw = smem + Tr::kQBytes + Tr::kStageBytes + buffer * Tr::kKvTileBytes;
    unsigned char* stage = smem + Tr::kQBytes;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // K, then V
      const unsigned char* src = raw + half * (Tr::kKvTileBytes / 2);
      unsigned char* dst = stage + half * Tr::kKvTileBytes;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int index = tid + i * kThreads;
        const int r = index / kRawChunks;
        const int c = index % kRawChunks;
        if (kNarrowV && half == 1 && c * 16 >= v_dim) continue;  // V chunk never copied
        const uint4 bits = *reinterpret_cast<const uint4*>(src + index * 16);
        uint4 lo, hi;
        ptx::fp8x16_to<T>(bits, e5m2, lo, hi);
        *reinterpret_cast<uint4*>(dst + (r * kChunks + ((2 * c) ^ (r & 7))) * 16) = lo;
        *reinterpret_cast<uint4*>(dst + (r * kChunks + ((2 * c + 1) ^ (r & 7))) * 16) = hi;
      }
    }
  };

  if (num_steps > 0) {
    if (paged) {
      // Slots of steps 0 and 1 now; step 0's copies need them at once.
      issue_slots(kv_begin, 0);
      issue_slots(kv_begin + kTileKeys, 1);
      cp_async_commit();
      ptx::cp_async_wait<0>();
      __syncthreads();
    }
    issue_kv(kv_begin, 0);
  }

  // ---- main loop ------------------------------------------------------------------------
  float o[kMAtoms][kDimTiles][4];
  float row_max[kMAtoms][2];  // raw (unscaled) logit units
  float row_sum[kMAtoms][2];  // this thread's share; the quad is summed at the end
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
    for (int d = 0; d < kDimTiles; ++d) o[a][d][0] = o[a][d][1] = o[a][d][2] = o[a][d][3] = 0.f;
    row_max[a][0] = row_max[a][1] = -INFINITY;
    row_sum[a][0] = row_sum[a][1] = 0.f;
  }

  // Per-lane ldmatrix offsets (see the fragment layouts of mma.m16n8k16). The swizzled chunk of
  // column chunk 2 * kk + hi is (2 * kk + hi) ^ (row & 7) = ((hi ^ (row & 7)) ^ 2 * (kk % 4)) +
  // 8 * (kk / 4): one lane base, XORed with a constant, plus a constant. Tile bases are
  // multiples of 128 bytes, so the XOR can be applied after adding them.
  const int warp_row = warp * Tr::kRowsPerWarp;
  const uint32_t q_lane =
      s_q + (warp_row + (lane & 15)) * kRowBytes + ((lane >> 4) ^ (lane & 7)) * 16;
  const uint32_t k_lane =
      ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + (((lane >> 3) & 1) ^ (lane & 7)) * 16;
  const uint32_t v_lane =
      ((lane & 7) + (((lane >> 3) & 1) << 3)) * kRowBytes + ((lane >> 4) ^ (lane & 7)) * 16;

  for (int step = 0; step < num_steps; ++step) {
    const int kv_start = kv_begin + step * kTileKeys;
    ptx::cp_async_wait<0>();
    __syncthreads();  // tile `step` landed for everyone; everyone is done with the other buffer
    if (fp8) convert_fp8(step & 1);
    if (step + 1 < num_steps) {
      // Slots of step + 2 go where step's slots were (read last step, before the barrier).
      if (paged) issue_slots(kv_start + 2 * kTileKeys, step & 1);
      issue_kv(kv_start + kTileKeys, (step + 1) & 1);
    }
    if (fp8) __syncthreads();  // the converted tile is visible
    const int stage = fp8 ? 0 : (step & 1);
    const uint32_t k_base = s_kv + stage * Tr::kStageBytes + k_lane;
    const uint32_t v_base = s_kv + stage * Tr::kStageBytes + Tr::kKvTileBytes + v_lane;

    // S = Q K^T
    float s[kMAtoms][kKeyTiles][4];
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
      for (int n = 0; n < kKeyTiles; ++n) s[a][n][0] = s[a][n][1] = s[a][n][2] = s[a][n][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t qa[kMAtoms][4];
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
        ldmatrix_x4(qa[a], (q_lane ^ ((kk % 4) * 32)) + (kk / 4) * 128 + a * 16 * kRowBytes);
      }
#pragma unroll
      for (int np = 0; np < kTileKeys / 16; ++np) {
        uint32_t kb[4];
        ldmatrix_x4(kb, (k_base ^ ((kk % 4) * 32)) + (kk / 4) * 128 + np * 16 * kRowBytes);
#pragma unroll
        for (int a = 0; a < kMAtoms; ++a) {
          mma_16816<T>(s[a][2 * np], qa[a], kb[0], kb[1]);
          mma_16816<T>(s[a][2 * np + 1], qa[a], kb[2], kb[3]);
        }
      }
    }

    if (soft_cap) {
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[a][n][e] = p.logit_cap * fast_tanh(s[a][n][e] * cap_inner);
        }
      }
    }

    // Masks only where some element of the tile can be hidden.
    const bool needs_mask = custom || kv_start + kTileKeys > kv_end ||
                            (causal && kv_start + kTileKeys - 1 > diagonal + tile_first_token) ||
                            (window >= 0 && kv_start < diagonal + tile_last_token - window);
    if (needs_mask) {
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int packed = row0 + warp_row + a * 16 + (lane >> 2) + 8 * h;
          const int token = min(packed, rows_total - 1) / group;
          const int last_visible = causal ? diagonal + token : kv_end;
          const int first_visible = window >= 0 ? diagonal + token - window : 0;
          const uint8_t* mask_row = custom ? custom_row(token) : nullptr;
#pragma unroll
          for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = kv_start + n * 8 + (lane & 3) * 2 + e;
              bool visible = j < kv_end && j <= last_visible && j >= first_visible;
              if (custom && visible) visible = mask_row[j] != 0;
              if (!visible) s[a][n][2 * h + e] = -INFINITY;
            }
          }
        }
      }
    }

    // Online softmax (rows g and g + 8 of each atom; a quad shares a row). A row's reference
    // max only moves when the tile's max exceeds it by more than kRescaleLog2 in log2 units, so
    // p <= 2^kRescaleLog2 (harmless in the fp32 sums and in a bf16/fp16 P) and O is rescaled
    // only on the rare steps where some row's max jumps (every step would cost 128 FMULs).
    constexpr float kRescaleLog2 = 8.f;
    float factor[kMAtoms][2];
    bool moved = false;
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float block_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
          block_max = fmaxf(block_max, fmaxf(s[a][n][2 * h], s[a][n][2 * h + 1]));
        }
        block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
        block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
        // True when the row had no max yet and now has one; false when both are -inf (NaN).
        const bool move = (block_max - row_max[a][h]) * scale_log2 > kRescaleLog2;
        factor[a][h] = move ? fast_exp2((row_max[a][h] - block_max) * scale_log2) : 1.f;
        row_max[a][h] = move ? block_max : row_max[a][h];
        row_sum[a][h] *= factor[a][h];
        moved |= move;
        // A row that has seen only masked keys keeps max -inf; exponentiate against 0 then.
        const float safe_max = row_max[a][h] == -INFINITY ? 0.f : row_max[a][h];
        const float offset = -safe_max * scale_log2;
#pragma unroll
        for (int n = 0; n < kKeyTiles; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(fmaf(s[a][n][2 * h + e], scale_log2, offset));
            s[a][n][2 * h + e] = pv;
            row_sum[a][h] += pv;
          }
        }
      }
    }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
        for (int d = 0; d < kDimTiles; ++d) {
          o[a][d][0] *= factor[a][0];
          o[a][d][1] *= factor[a][0];
          o[a][d][2] *= factor[a][1];
          o[a][d][3] *= factor[a][1];
        }
      }
    }

    // O += P V, P straight from the S accumulators (the C layout of two n8 tiles is the A
    // layout of one k16 step).
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk) {
      uint32_t pa[kMAtoms][4];
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
        pa[a][0] = pack2<T>(s[a][2 * kk][0], s[a][2 * kk][1]);
        pa[a][1] = pack2<T>(s[a][2 * kk][2], s[a][2 * kk][3]);
        pa[a][2] = pack2<T>(s[a][2 * kk + 1][0], s[a][2 * kk + 1][1]);
        pa[a][3] = pack2<T>(s[a][2 * kk + 1][2], s[a][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        if (kNarrowV && dp * 16 >= v_dim) break;  // O's columns past v_head_dim stay zero
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, (v_base ^ ((dp % 4) * 32)) + (dp / 4) * 128 + kk * 16 * kRowBytes);
#pragma unroll
        for (int a = 0; a < kMAtoms; ++a) {
          mma_16816<T>(o[a][2 * dp], pa[a], vb[0], vb[1]);
          mma_16816<T>(o[a][2 * dp + 1], pa[a], vb[2], vb[3]);
        }
      }
    }
  }

  // ---- epilogue -------------------------------------------------------------------------
  float inv_sum[kMAtoms][2];
  float lse[kMAtoms][2];
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float total = row_sum[a][h];
      total += __shfl_xor_sync(0xffffffffu, total, 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      // An empty row (no visible key) is the empty partial: o = 0, LSE = -inf.
      inv_sum[a][h] = total > 0.f ? p.v_scale / total : 0.f;
      lse[a][h] = total > 0.f ? (row_max[a][h] * scale_log2 + __log2f(total)) * kLn2 : -INFINITY;
    }
  }

  if (item.partial < 0 && !p.out_fp32) {
    // Stage the warp's rows of O in its own rows of the Q tile (no other warp reads them), then
    // store 16-byte chunks.
    unsigned char* s_out = smem;
    __syncwarp();  // every lane's last ldmatrix of these rows is done before any lane overwrites
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row + a * 16 + (lane >> 2) + 8 * h;
#pragma unroll
        for (int d = 0; d < kDimTiles; ++d) {
          const uint32_t value =
              pack2<T>(o[a][d][2 * h] * inv_sum[a][h], o[a][d][2 * h + 1] * inv_sum[a][h]);
          *reinterpret_cast<uint32_t*>(s_out + (r * kChunks + (d ^ (r & 7))) * 16 +
                                       (lane & 3) * 4) = value;
        }
      }
    }
    __syncwarp();
    T* out = static_cast<T*>(p.out);
    constexpr int kOutChunksPerLane = Tr::kRowsPerWarp * kChunks / 32;
#pragma unroll
    for (int i = 0; i < kOutChunksPerLane; ++i) {
      const int index = lane + i * 32;
      const int r = warp_row + index / kChunks;
      const int c = index % kChunks;
      const int packed = row0 + r;
      if (packed < rows_total && (!kNarrowV || c * 8 < v_dim)) {
        const int token = packed / group;
        const int head = kv_head * group + packed % group;
        T* dst = out + (int64_t(q_begin) + token) * p.out_stride_token +
                 int64_t(head) * p.out_stride_head + c * 8;
        *reinterpret_cast<uint4*>(dst) =
            *reinterpret_cast<const uint4*>(s_out + (r * kChunks + (c ^ (r & 7))) * 16);
      }
    }
    if (p.lse != nullptr && (lane & 3) == 0) {
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int packed = row0 + warp_row + a * 16 + (lane >> 2) + 8 * h;
          if (packed < rows_total) {
            const int token = packed / group;
            const int head = kv_head * group + packed % group;
            p.lse[(int64_t(q_begin) + token) * p.num_q_heads + head] = lse[a][h];
          }
        }
      }
    }
  } else {
    // fp32 rows, each lane's two columns as a float2: a chunk of a split tile (the partial output,
    // already normalized, and its LSE in the tile's partial slots) or, with p.out_fp32, the
    // output itself (a partial state another kernel merges).
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row + a * 16 + (lane >> 2) + 8 * h;
        if (row0 + r >= rows_total) continue;
        float* dst;
        float* lse_dst = nullptr;
        if (item.partial >= 0) {
          const int64_t slot_row = int64_t(item.partial) * tiles.tile_rows + r;
          dst = tiles.partial_out + slot_row * v_dim;
          lse_dst = tiles.partial_lse + slot_row;
        } else {
          const int token = (row0 + r) / group;
          const int head = kv_head * group + (row0 + r) % group;
          dst = static_cast<float*>(p.out) + (int64_t(q_begin) + token) * p.out_stride_token +
                int64_t(head) * p.out_stride_head;
          if (p.lse != nullptr) {
            lse_dst = p.lse + (int64_t(q_begin) + token) * p.num_q_heads + head;
          }
        }
        dst += (lane & 3) * 2;
#pragma unroll
        for (int d = 0; d < kDimTiles; ++d) {
          if (kNarrowV && d * 8 >= v_dim) break;
          *reinterpret_cast<float2*>(dst + d * 8) =
              make_float2(o[a][d][2 * h] * inv_sum[a][h], o[a][d][2 * h + 1] * inv_sum[a][h]);
        }
        if ((lane & 3) == 0 && lse_dst != nullptr) *lse_dst = lse[a][h];
      }
    }
  }
}

// ---- host side of an instance ----------------------------------------------------------------

template <int kHeadDim>
PrefillKernelShape shape_of() {
  using Tr = PrefillTraits<kHeadDim>;
  PrefillKernelShape shape;
  shape.tile_rows = Tr::kTileRows;
  shape.kv_tile = Tr::kTileKeys;
  shape.ctas_per_sm = Tr::kMinBlocks;
  return shape;
}

template <int kHeadDim, bool kNarrowV, typename T>
void launch_instance(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                     cudaStream_t stream) {
  using Tr = PrefillTraits<kHeadDim>;
  auto kernel = batch_prefill_kernel<kHeadDim, kNarrowV, T>;
  // The shared-memory opt-in is per device; set it once per device (a host call per launch
  // would show in the timing of small batches).
  static std::atomic<uint64_t> devices_ready{0};
  int device = 0;
  const cudaError_t got = cudaGetDevice(&device);
  const uint64_t bit = (got == cudaSuccess && device < 64) ? (uint64_t{1} << device) : 0;
  if (bit == 0 || (devices_ready.load(std::memory_order_acquire) & bit) == 0) {
    const cudaError_t attr =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tr::kSmemBytes);
    if (attr != cudaSuccess) {
      throw_error(ErrorKind::kDeviceError, "batch_prefill",
                  "cudaFuncSetAttribute: ", cudaGetErrorString(attr));
    }
    devices_ready.fetch_or(bit, std::memory_order_release);
  }
  kernel<<<tiles.num_items, Tr::kThreads, Tr::kSmemBytes, stream>>>(p, tiles);
  check_launch("batch_prefill");
}

/// The launcher of one instance file: throws kNotSupported when the head_dim was left out of
/// KVATTN_CUDA_HEAD_DIMS (the template keeps the kernel from being instantiated at all then).
template <int kHeadDim, bool kNarrowV>
void launch_if_compiled(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                        cudaStream_t stream) {
  if constexpr (head_dim_compiled(kHeadDim)) {
    if (p.io_dtype == DType::kBFloat16) {
      launch_instance<kHeadDim, kNarrowV, __nv_bfloat16>(p, tiles, stream);
    } else {
      launch_instance<kHeadDim, kNarrowV, __half>(p, tiles, stream);
    }
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim", "not compiled: head_dim=", kHeadDim,
                " (KVATTN_CUDA_HEAD_DIMS)");
  }
}

// One per instance file (prefill_hd<D>.cu).
void launch_prefill_hd64(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                         cudaStream_t stream);
void launch_prefill_hd128(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                          cudaStream_t stream);
void launch_prefill_hd256(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                          cudaStream_t stream);
/// head_dim 128 with v_head_dim a multiple of 16 below 128 (prefill_hd128_narrow_v.cu).
void launch_prefill_hd128_narrow_v(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                                   cudaStream_t stream);

}  // namespace kvattn::cuda::prefill_detail
