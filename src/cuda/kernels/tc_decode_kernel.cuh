// The decode-shaped tensor-core kernel: few query rows per kv head over a long KV (speculative
// verify, draft extend, decode of large GQA groups). Included by one small instance file per
// head_dim (tc_decode_hd64.cu, tc_decode_hd128.cu); the io dtype is a template parameter, the KV
// dtype, masks and soft-cap are runtime branches.
//
// It consumes the batch prefill's plan (core/prefill_tiles.h) with tiles of kTileRows packed rows
// (the tree tokens of a request times the q heads of one kv head) and its split-KV merge: a work
// item is (request, kv head, row tile, key chunk), and the planner splits long KV into chunks so
// that every SM has work even at batch 1.
//
// Why not the prefill kernels: their tiles are 64-128 rows, so a verify step (8 tokens x 4 heads =
// 32 rows) wastes most of every MMA and of every CTA, and one CTA per (request, kv head) runs a
// long prefix on a handful of SMs. Here the 4 warps of a CTA split the *keys*, not the rows:
// warp w takes keys [16 w, 16 w + 16) of every 64-key step, with its own cp.async pipeline of
// kStages 16-key K/V stages that only it reads (no CTA barrier in the main loop), computes
// S = Q K^T for all kTileRows rows (mma.sync m16n8k16, Q read from shared memory with ldmatrix)
// and O += P V with the online softmax of core::SoftmaxState (toolkit/online_softmax.cuh). The
// four warps' states are merged in shared memory at the end, and the CTA writes the tile's output
// (or its partial state for the split merge).
//
// Three instances share this code: 32-row tiles (verify), 16-row (draft extend, the multi-step
// draft) and the transposed 8-row tile of a decode step (a GQA group of <= 8 rows a request:
// S^T = K Q^T puts the 16 keys in the MMA's M and the rows in its N = 8, so a group of 4 wastes
// half of every product instead of three quarters; half the MMAs, half the exponentials and
// O's registers of the 16-row tile, bench/NOTES.md "The transposed decode tile").
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "core/attention_params.h"
#include "core/planner.h"
#include "core/prefill_tiles.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/launch.cuh"
#include "cuda/kernels/prefill.h"
#include "cuda/kernels/split_merge.cuh"
#include "cuda/kernels/step_check.cuh"
#include "cuda/kernels/toolkit/compiled_head_dims.h"
#include "cuda/kernels/toolkit/online_softmax.cuh"
#include "cuda/kernels/toolkit/ptx.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda::tc_decode {

// kMAtoms m16 atoms of rows a tile: 2 (32 rows: 8 tree tokens x 4 q heads) or 1 (16 rows: the
// narrow instance for calls of <= 16 packed rows a request: draft extend, the multi-step draft's
// branches, decode; about 40% fewer instructions a key step, and Q stays in registers).
// kMAtomsOfTile 0: the transposed instance, 8 rows a tile (a decode step's GQA group of <= 8):
// S^T = K Q^T with the warp's 16 keys in the MMA's M and the rows in its N = 8, then O^T = V^T
// P^T, half the MMAs of the 16-row tile (whose rows past the group are padding).
template <int kHeadDim, int kMAtomsOfTile = 2>
struct Traits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr bool kTransposed = kMAtomsOfTile == 0;
  // O is kMAtoms * head_dim / 2 fp32 a thread (transposed: head_dim / 4)
  static constexpr int kMAtoms = kTransposed ? 1 : kMAtomsOfTile;
  static constexpr int kTileRows = kTransposed ? 8 : 16 * kMAtoms;
  static constexpr bool kQInRegisters = kMAtoms == 1;   // head_dim / 4 registers a thread
  static constexpr int kWarpKeys = 16;                  // one k16 step of P V a warp and stage
  static constexpr int kTileKeys = kWarps * kWarpKeys;  // keys a CTA step (the planner's kv_tile)
  static constexpr int kChunks = kHeadDim / 8;          // 16-byte chunks in a 16-bit row
  static constexpr int kRowBytes = kChunks * 16;
  static constexpr int kSubBytes = kWarpKeys * kRowBytes;  // a warp's K (or V) stage, 16-bit
  static constexpr int kStageBytes = 2 * kSubBytes;        // K then V
  // 16-bit KV: 3 stages at head_dim 128 (104 KB, two CTAs an SM: 2 x 4 x 2 stages x 8 KB = 128 KB
  // in flight an SM, several times what Little's law asks for), 4 at head_dim 64.
  static constexpr int kStages = kHeadDim <= 64 ? 4 : 3;
  // Steps an iteration of the main loop: 1 for the 32-row tile (its small batches are bound by
  // the latency of code fetched cold: one copy), UNROLL_NARROW for the 16-row one.
  static constexpr int kStepUnroll = kMAtoms == 1 ? 2 : 1;
  static constexpr int kQBytes = kTileRows * kRowBytes;
  // fp8 KV: raw stages of half the size plus one converted stage a warp.
  static constexpr int kRawStageBytes = kStageBytes / 2;
  static constexpr int kPipeBytes16 = kWarps * kStages * kStageBytes;
  static constexpr int kPipeBytes8 = kWarps * (kStages * kRawStageBytes + kStageBytes);
  // The end of the CTA reuses each warp's own pipeline region (so a warp leaves its state there
  // as soon as its key steps are done, with no CTA barrier): its O in fp32 ([row][kOStride]),
  // then its rows' max and sum; warp 0's region then holds the rows' LSE, and its O becomes the
  // CTA's merged O in place (each element is read and written by one thread), which a
  // cluster-split plan's CTAs read through distributed shared memory. O rows are padded by 4
  // floats so that a quad's float2 stores of 8 rows miss each other's banks.
  static constexpr int kOStride = kHeadDim + 4;
  static constexpr int kWarpStateFloats = kTileRows * (kOStride + 2);
  static constexpr int kWarpRegion16 = kStages * kStageBytes;
  static constexpr int kWarpRegion8 = kStages * kRawStageBytes + kStageBytes;
  static_assert((kWarpStateFloats + kTileRows) * 4 <= kWarpRegion8 &&
                    (kWarpStateFloats + kTileRows) * 4 <= kWarpRegion16,
                "a warp's merge state (and warp 0's LSE row) fits its pipeline region");
  static_assert(kWarpRegion8 % 16 == 0 && kWarpRegion16 % 16 == 0 && kOStride % 4 == 0,
                "16-byte aligned rows");
  static constexpr int kMaxCluster = 16;  // the cluster-split fold reads at most this many CTAs
  static constexpr int smem_bytes(bool fp8) { return kQBytes + (fp8 ? kPipeBytes8 : kPipeBytes16); }
  /// The opt-in the kernel needs for either KV width.
  static constexpr int max_smem_bytes() {
    return smem_bytes(true) > smem_bytes(false) ? smem_bytes(true) : smem_bytes(false);
  }
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim 64 or 128");
  static_assert(kMAtoms == 1 || kMAtoms == 2, "16 or 32 rows a tile");
  static_assert(32 % kChunks == 0 || kChunks % 32 == 0, "whole rows a copy step");
};

using ptx::cp_async_commit;
using ptx::fast_tanh;
using ptx::fp8x2_to;
using ptx::kLog2e;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::mma_16816;
using ptx::pack2;
using ptx::smem_address;

// Time attribution (a build with KVATTN_TC_DECODE_TRACE defined, and the environment variable
// KVATTN_TC_DECODE_TRACE=1: prefill.cu): %globaltimer stamps of a CTA's phases, written by its
// thread 0 (kTraceWarpDone + w: lane 0 of warp w) to PrefillTiles::trace[CTA * kTraceSlots + slot].
enum TraceSlot : int {
  kTraceEntry = 0,       // the CTA runs
  kTraceReleased = 1,    // griddepcontrol.wait returned
  kTraceFacts = 2,       // the work item and the request's facts arrived
  kTraceLoop = 3,        // Q landed; the key steps start
  kTraceWarpDone = 4,    // + warp: that warp's key steps issued
  kTraceMerged = 8,      // the four warps' states merged (row weights ready)
  kTraceStored = 9,      // output (or the cluster's shared-memory O) written
  kTraceClusterIn = 10,  // past the cluster barrier
  kTraceFolded = 11,     // the cluster fold's rows written
  kTraceExit = 12,       // past the exit barrier
  kTraceSm = 13,         // the SM the CTA ran on (%smid; not a time)
  kTraceSink = 15,       // a dependency sink (makes a stamp wait for the values it names)
  kTraceSlots = 16,
};

#if defined(KVATTN_TC_DECODE_TRACE)
/// Whether the environment's KVATTN_TC_DECODE_TRACE asks for the trace (prefill.cu).
bool trace_requested();
#endif

// kMasks false: an instance without the custom-mask code (the transposed tile's decode calls keep
// its loop, and its registers, as small as without the mask support).
template <int kHeadDim, int kMAtomsOfTile, typename T, bool kMasks = true>
__global__ void __launch_bounds__(Traits<kHeadDim, kMAtomsOfTile>::kThreads)
    tc_decode_kernel(const core::AttentionParams p, const core::PrefillTiles tiles) {
  using Tr = Traits<kHeadDim, kMAtomsOfTile>;
  constexpr int kChunks = Tr::kChunks;
  constexpr int kMAtoms = Tr::kMAtoms;
  constexpr int kDimTiles = kHeadDim / 8;
  constexpr uint32_t kRowBytes = Tr::kRowBytes;
  constexpr int kStages = Tr::kStages;
  extern __shared__ __align__(128) unsigned char smem[];

#if defined(KVATTN_TC_DECODE_TRACE)
  unsigned long long* const trace =
      tiles.trace != nullptr ? tiles.trace + size_t(blockIdx.x) * kTraceSlots : nullptr;
  auto stamp = [&](int slot) {
    if (trace != nullptr && threadIdx.x == 0) trace[slot] = ptx::global_timer();
  };
  auto stamp_after = [&](int slot, int64_t value) {  // once `value` has arrived
    if (trace != nullptr && threadIdx.x == 0) {
      trace[kTraceSink] = static_cast<unsigned long long>(value);
      trace[slot] = ptx::global_timer();
    }
  };
#else
  auto stamp = [](int) {};
  auto stamp_after = [](int, int64_t) {};
#endif
  stamp(kTraceEntry);
#if defined(KVATTN_TC_DECODE_TRACE)
  if (trace != nullptr && threadIdx.x == 0) trace[kTraceSm] = ptx::sm_id();
#endif
  // Launched as a programmatic dependent: nothing global is read before the kernels before it
  // completed (they wrote the pool, the plan and the step's error word).
  ptx::grid_dependency_wait();
  stamp(kTraceReleased);
  if (tiles.diag == 4) return;
  // The step's facts in as few dependent memory round trips as their dependencies allow: the
  // error word with the work item, then every fact of the request at once (one after another
  // they were ~8 dependent loads before the first K/V byte: most of a small batch's latency). A
  // refused step is checked before the first write (it reads only clamped slots and host-made
  // plan values until then) and writes nothing (step_check.h); every CTA sees the same word.
  const bool refused = detail::step_refused(p.step_error);
  // The item as three 16-byte loads (its fields arrive together; field by field, the compiler
  // waits for q_row_begin alone before it reads the rest).
  core::PrefillWorkItem item;
  {
    static_assert(sizeof(core::PrefillWorkItem) == 48, "three 16-byte parts");
    const int4* parts = reinterpret_cast<const int4*>(tiles.items + blockIdx.x);
    const int4 lo = parts[0];
    const int4 hi = parts[1];
    item.q_begin = parts[2].x;
    item.q_end = parts[2].y;
    item.request = lo.x;
    item.kv_head = lo.y;
    item.q_row_begin = lo.z;
    item.kv_begin = lo.w;
    item.kv_end = hi.x;
    item.partial = hi.y;
    item.merge = hi.z;
    item.kv_base = hi.w;
  }
  // A graph's padding item (core::pad_prefill_plan; a cluster-split plan pads whole clusters):
  // the CTA returns on the item alone. Any other item past its request's rows (the no-op of
  // prefill_tiles.h) runs as empty work: no keys, no row to write.
  if (item.q_row_begin >= core::kNoOpRow) return;
  const int request = item.request;
  const bool custom = kMasks && p.mask == core::MaskMode::kCustom;
  // (No branch around the mask facts: a call without them reads the indptrs a second time
  // instead, so the compiler issues every load before it waits for any.)
  const int64_t* mask_indptr = custom ? p.mask_indptr : p.kv_indptr;
  const bool dense = custom && p.mask_dense != nullptr;
  const int32_t* dense_of = dense ? p.mask_dense : p.qo_indptr;
  const int64_t mask_begin = mask_indptr[request];
  const int64_t mask_end = mask_indptr[request + 1];
  const int dense_from = dense_of[request];
  // The request's tokens from the item where the plan gives them (Q's copies then wait for no
  // indptr), else from the indptr.
  const bool q_given = item.q_begin >= 0;
  const int q_begin = q_given ? item.q_begin : p.qo_indptr[request];
  const int q_end = q_given ? item.q_end : p.qo_indptr[request + 1];
  const int64_t kv_base = p.kv_indptr[request];
  const int64_t kv_next = p.kv_indptr[request + 1];
  // The first K/V index loads need the request's first index: from the item where the plan
  // gives it (no wait for the indptr), else the indptr's.
  const int64_t kv_first = item.kv_base >= 0 ? int64_t{item.kv_base} : kv_base;
  const int group = tiles.group_size;
  // Packed row -> token by a multiply: one real division a thread instead of one per use (each
  // is ~30 dependent instructions, and at a small batch the kernel's time is the latency of the
  // code it runs once). magic = ceil(2^32 / group) (2^32 for a group of 1), no branch on the
  // group (the compiler would version the code on it); exact for |n| < 2^32 / group, C's
  // truncation for n < 0. (Not the plan's core::FastDivmod: read from the kernel's parameters it
  // cost the 32-row instance, at 255 registers, a spill.)
  const uint64_t group_magic = uint64_t{0xFFFFFFFFu / static_cast<uint32_t>(group)} + 1u;
  auto div_group = [&](int n) -> int {
    const uint64_t m = static_cast<uint32_t>(n < 0 ? -n : n);
    const int q = static_cast<int>((m * group_magic) >> 32);
    return n < 0 ? -q : q;
  };
  const int row0 = item.q_row_begin;
  const int q_len = q_end - q_begin;
  const int rows_total = q_len * group;
  const int kv_len = static_cast<int>(kv_next - kv_base);
  const int kv_head = item.kv_head;
  const int kv_begin = item.kv_begin;
  const int kv_end = item.kv_end;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3 || p.kv_dtype == DType::kFloat8E5M2;
  const bool e5m2 = p.kv_dtype == DType::kFloat8E5M2;
  const bool paged = p.kv_indices != nullptr;
  const bool causal = p.mask == core::MaskMode::kCausal;
  const int window = p.mask == core::MaskMode::kNone ? -1 : p.window_left;
  const bool soft_cap = p.logit_cap > 0.f;
  const float qk_scale = p.sm_scale * p.k_scale;
  const float scale_log2 = soft_cap ? kLog2e : qk_scale * kLog2e;
  const float cap_inner = soft_cap ? qk_scale / p.logit_cap : 0.f;
  const int diagonal = kv_len - q_len;  // token i sees keys <= diagonal + i (causal)
  const int tile_first_token = div_group(row0);
  const int tile_last_token = div_group(min(rows_total, row0 + Tr::kTileRows) - 1);

  // kCustom: the request's mask is [q_len, row_len]; a row's last min(row_len, kv_len) columns
  // are the last keys. Keys before mask_from are visible to every row and their mask bytes are
  // never read: those before the row's first column (row_len < kv_len: the multi-step draft's
  // branch masks) and those below p.mask_dense[request] (TARGET_VERIFY: the all-ones prefix
  // columns). Mask element (token, key j >= mask_from) is custom_mask[mask_offset + token *
  // row_len + j].
  int64_t mask_offset = 0;
  int64_t mask_row_len = 0;
  int mask_from = 0;
  if (custom) {
    mask_row_len = q_len > 0 ? (mask_end - mask_begin) / q_len : 0;
    mask_offset = mask_begin + (mask_row_len - kv_len);
    mask_from = static_cast<int>(max(int64_t(0), int64_t(kv_len) - mask_row_len));
    if (dense) mask_from = max(mask_from, min(kv_len, dense_from));
  }
  stamp_after(kTraceFacts, mask_offset ^ mask_from ^ kv_base ^ q_begin ^ kv_begin ^ refused);
  // DIAG 2: return once the step's facts have arrived (the condition waits for every load).
  if (tiles.diag == 2 &&
      (mask_offset ^ mask_from ^ kv_base ^ q_begin ^ kv_begin ^ int64_t(refused)) != INT64_MIN) {
    return;
  }
  // ---- shared memory: Q, then per warp its stages (and, fp8, its converted stage) -------------
  const uint32_t s_q = smem_address(smem);
  const uint32_t s_pipe = s_q + Tr::kQBytes;
  const int stage_bytes = fp8 ? Tr::kRawStageBytes : Tr::kStageBytes;
  const int warp_region = fp8 ? Tr::kWarpRegion8 : Tr::kWarpRegion16;  // bytes
  const uint32_t s_warp = s_pipe + warp * warp_region;
  const uint32_t s_convert = s_warp + kStages * stage_bytes;  // fp8 only

  {  // Q: the tile's packed rows (zero past the request's rows)
    // (The transposed instance at head_dim 64 has 64 chunks: half the threads copy one.)
    constexpr int kQChunks = Tr::kTileRows * kChunks;
    constexpr int kPerThread = (kQChunks + Tr::kThreads - 1) / Tr::kThreads;
    static_assert(kQChunks % Tr::kThreads == 0 || kQChunks < Tr::kThreads, "whole copy rounds");
    const T* q = static_cast<const T*>(p.q);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int index = tid + i * Tr::kThreads;
      if (kQChunks < Tr::kThreads && index >= kQChunks) break;
      const int r = index / kChunks;
      const int c = index % kChunks;
      const int packed = row0 + r;
      const bool valid = packed < rows_total;
      const T* src = q;
      if (valid) {
        const int token = div_group(packed);
        const int head = kv_head * group + (packed - token * group);
        src = q + (int64_t(q_begin) + token) * p.q_stride_token + int64_t(head) * p.q_stride_head +
              c * 8;
      }
      ptx::cp_async_zfill<16>(s_q + (r * kChunks + (c ^ (r & 7))) * 16, src, valid);
    }
    cp_async_commit();
  }

  // ---- this warp's keys: steps u = 0.. of [kv_begin + 64 u + 16 warp, + 16) --------------------
  const int warp_first = kv_begin + warp * Tr::kWarpKeys;
  const int warp_steps = warp_first < kv_end && tiles.diag != 3
                             ? (kv_end - warp_first + Tr::kTileKeys - 1) / Tr::kTileKeys
                             : 0;
  auto step_key = [&](int u) { return warp_first + u * Tr::kTileKeys; };

  // The row a lane copies for key l % 16 of a step, in a register: paged, its slot (the key's
  // K/V index); otherwise the key itself; -1 for a key past the warp's steps or the chunk. Lane l
  // holds key l % 16 of step u + l / 16 for a pair (the prologue), of step u otherwise (lanes
  // 16-31 repeat lanes 0-15's addresses: no extra bytes).
  const uint32_t row_limit =
      paged ? static_cast<uint32_t>(min(p.num_slots, int64_t(INT32_MAX))) : 0xFFFFFFFFu;
  auto load_slots = [&](int u, bool pair) -> int32_t {
    const int step = u + (pair ? lane >> 4 : 0);
    const int key = step_key(step) + (lane & 15);
    if (step >= warp_steps || key >= kv_end) return -1;
    return paged ? __ldg(p.kv_indices + kv_first + key) : key;
  };
  // The copy geometry of a lane, the same every step: 16-byte chunk copy_c of rows copy_r0 +
  // i * (32 / copy_chunks) of a step's K and V (fp8: raw rows, half the chunks). A row's source
  // is the lane's chunk of the request's row 0 plus a 32-bit row (the slot, or the key) times
  // the row pitch in bytes (< 2^32: launch_tc_decode checks): one wide multiply-add a copy; an
  // invalid row copies nothing (zero fill) from row 0.
  const int copy_chunks = fp8 ? kChunks / 2 : kChunks;
  const int copy_c = lane % copy_chunks;
  const int copy_r0 = lane / copy_chunks;
  const int64_t kv_elem_bytes = fp8 ? 1 : int64_t(sizeof(T));
  const char* const k_src =
      static_cast<const char*>(p.k) + copy_c * 16 +
      (int64_t(kv_head) * p.k_stride_head + (paged ? 0 : kv_first * p.k_stride_token)) *
          kv_elem_bytes;
  const char* const v_src =
      static_cast<const char*>(p.v) + copy_c * 16 +
      (int64_t(kv_head) * p.v_stride_head + (paged ? 0 : kv_first * p.v_stride_token)) *
          kv_elem_bytes;
  const uint32_t k_pitch = static_cast<uint32_t>(p.k_stride_token * kv_elem_bytes);
  const uint32_t v_pitch = static_cast<uint32_t>(p.v_stride_token * kv_elem_bytes);
  // The lane's byte in a stage: 16-bit rows swizzled (chunk c ^ (row & 7)); row copy_r0 + i *
  // step (step a power of two above copy_r0) has (row & 7) = (copy_r0 & 7) ^ (i * step & 7), so
  // row i's offset is copy_dst ^ ((i * step & 7) * 16) plus i * step rows (constants).
  const uint32_t copy_dst =
      fp8 ? uint32_t(copy_r0 * (kChunks / 2) + copy_c) * 16
          : uint32_t(copy_r0) * kRowBytes + uint32_t(copy_c ^ (copy_r0 & 7)) * 16;
  // Issues the K/V copies of step u into stage u % kStages (fp8: raw bytes, converted later).
  // The row of key r comes from lane r + half of `slot` (half: 0, or 16 for the odd step of a
  // load_slots pair).
  auto issue = [&](int u, int32_t slot, int half) {
    if (u >= warp_steps || tiles.diag == 1) {  // past the warp's keys (or DIAG 1: no copies):
      cp_async_commit();                       // an empty group keeps the wait counts
      return;
    }
    const int stage = u % kStages;
    const int from = copy_r0 + half;  // the lane holding row i's slot: from + i * step
    auto copy_row = [&](int i, int step, uint32_t k_dst, uint32_t v_dst) {
      const int32_t s = __shfl_sync(0xffffffffu, slot, from + i * step);
      const bool valid = static_cast<uint32_t>(s) < row_limit;
      const uint32_t row = valid ? static_cast<uint32_t>(s) : 0u;
      ptx::cp_async_zfill<16>(k_dst, ptx::row_address(k_src, row, k_pitch), valid);
      ptx::cp_async_zfill<16>(v_dst, ptx::row_address(v_src, row, v_pitch), valid);
    };
    if (fp8) {
      constexpr int kRawChunks = kChunks / 2;  // 16-byte chunks of an fp8 row
      constexpr int kRowStep = 32 / kRawChunks;
      const uint32_t k_dst = s_warp + stage * Tr::kRawStageBytes + copy_dst;
#pragma unroll
      for (int i = 0; i < Tr::kWarpKeys / kRowStep; ++i) {
        const uint32_t at = k_dst + uint32_t(i * kRowStep * kRawChunks * 16);
        copy_row(i, kRowStep, at, at + Tr::kRawStageBytes / 2);
      }
    } else {
      constexpr int kRowStep = 32 / kChunks;
      const uint32_t stage_base = s_warp + stage * Tr::kStageBytes;
#pragma unroll
      for (int i = 0; i < Tr::kWarpKeys / kRowStep; ++i) {
        const uint32_t at = stage_base + (copy_dst ^ uint32_t(((i * kRowStep) & 7) * 16)) +
                            uint32_t(i * kRowStep) * kRowBytes;
        copy_row(i, kRowStep, at, at + Tr::kSubBytes);
      }
    }
    cp_async_commit();
  };
  // fp8: this lane's raw chunks of stage u -> the warp's converted stage (16-bit, swizzled).
  auto convert = [&](int u) {
    constexpr int kRawChunks = kChunks / 2;
    constexpr int kRowStep = 32 / kRawChunks;
    const int r0 = lane / kRawChunks;
    const int c = lane % kRawChunks;
    const unsigned char* raw = smem + (s_warp - s_q) + (u % kStages) * Tr::kRawStageBytes;
    unsigned char* dst = smem + (s_convert - s_q);
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // K, then V
#pragma unroll
      for (int i = 0; i < Tr::kWarpKeys / kRowStep; ++i) {
        const int r = r0 + i * kRowStep;
        const uint4 bits = *reinterpret_cast<const uint4*>(raw + half * (Tr::kRawStageBytes / 2) +
                                                           (r * kRawChunks + c) * 16);
        uint4 lo, hi;
        ptx::fp8x16_to<T>(bits, e5m2, lo, hi);
        unsigned char* row = dst + half * Tr::kSubBytes + r * kRowBytes;
        *reinterpret_cast<uint4*>(row + ((2 * c) ^ (r & 7)) * 16) = lo;
        *reinterpret_cast<uint4*>(row + ((2 * c + 1) ^ (r & 7)) * 16) = hi;
      }
    }
  };

  // Prologue: kStages - 1 steps in flight, their slots loaded at once (two steps a register)
  // with those of the first two steps the main loop issues (slot_ahead, slot_after), and their
  // copies issued from one copy of the issue code (a rolled loop: code that runs once is
  // fetched cold, and at a small batch that fetch is most of the kernel's time). In the main
  // loop a step's slots load two steps before its copies are issued: with one step, the index
  // load of a long request at batch 1 had not returned when its copies were due (ncu: a fifth
  // of the loop's stall samples at verify b1 waited on it).
  int32_t slot_ahead, slot_after;
  {
    constexpr int kFirst = kStages - 1;  // 2 (head_dim 128) or 3 (64)
    static_assert(kFirst == 2 || kFirst == 3, "the prologue's slots cover steps 0..4");
    const int32_t first01 = load_slots(0, true);
    const int32_t first23 = load_slots(2, true);
    const int32_t third = __shfl_xor_sync(0xffffffffu, first23, 16);  // step 3 in lanes 0-15
    slot_ahead = kFirst == 2 ? first23 : third;
    slot_after = kFirst == 2 ? third : load_slots(4, false);
#pragma unroll 1
    for (int u = 0; u < kFirst; ++u) issue(u, u < 2 ? first01 : first23, (u & 1) * 16);
  }
  ptx::cp_async_wait<kStages - 1>();  // this thread's Q chunks landed
  __syncthreads();                    // ... and everyone's
  stamp(kTraceLoop);

  float o[kMAtoms][kDimTiles][4];
  RowPairSoftmax softmax[kMAtoms];
  // The transposed instance: O^T in m16 blocks of dims (dim 16 m + lane / 4 + 8 (i / 2), row
  // 2 (lane % 4) + i % 2) and its rows' softmax.
  constexpr int kDimBlocks = kHeadDim / 16;
  float ot[kDimBlocks][4];
  ColumnPairSoftmax softmax_t;
  if constexpr (Tr::kTransposed) {
#pragma unroll
    for (int m = 0; m < kDimBlocks; ++m) ot[m][0] = ot[m][1] = ot[m][2] = ot[m][3] = 0.f;
  } else {
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
      for (int d = 0; d < kDimTiles; ++d) o[a][d][0] = o[a][d][1] = o[a][d][2] = o[a][d][3] = 0.f;
    }
  }

  // ldmatrix lane offsets of the m16n8k16 fragments (swizzled chunk (c ^ (row & 7))): see the
  // prefill kernel (prefill_kernel.cuh), whose tiles these warp stages are a 16-key slice of.
  // a_lane: a 16-row A operand (Q; the transposed instance's K, within a stage).
  const uint32_t a_lane = (lane & 15) * kRowBytes + ((lane >> 4) ^ (lane & 7)) * 16;
  const uint32_t q_lane = s_q + a_lane;
  const uint32_t k_lane =
      ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes + (((lane >> 3) & 1) ^ (lane & 7)) * 16;
  const uint32_t v_lane =
      ((lane & 7) + (((lane >> 3) & 1) << 3)) * kRowBytes + ((lane >> 4) ^ (lane & 7)) * 16;
  // The narrow instance keeps its 16 rows of Q in registers (A fragments of every k16 slice).
  uint32_t q_frag[Tr::kQInRegisters && !Tr::kTransposed ? kHeadDim / 16 : 1][4];
  // The transposed instance's Q^T B fragments (k16 slice kk: chunks 2 kk, 2 kk + 1 of the 8 rows),
  // four chunks an ldmatrix: lane l addresses row l % 8, chunk 4 j + l / 8.
  uint32_t qt_frag[Tr::kTransposed ? kHeadDim / 16 : 1][2];
  if constexpr (Tr::kTransposed) {
    const uint32_t qt_lane = s_q + (lane & 7) * kRowBytes + (((lane >> 3) ^ (lane & 7)) * 16);
#pragma unroll
    for (int j = 0; j < kHeadDim / 32; ++j) {
      uint32_t r[4];
      ldmatrix_x4(r, (qt_lane ^ ((j & 1) * 64)) + (j >> 1) * 128);
      qt_frag[2 * j][0] = r[0];
      qt_frag[2 * j][1] = r[1];
      qt_frag[2 * j + 1][0] = r[2];
      qt_frag[2 * j + 1][1] = r[3];
    }
  } else if constexpr (Tr::kQInRegisters) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      ldmatrix_x4(q_frag[kk], (q_lane ^ ((kk % 4) * 32)) + (kk / 4) * 128);
    }
  }
  // Whether step u's keys reach the masked columns (warp-uniform).
  auto step_masked = [&](int u) { return custom && step_key(u) + Tr::kWarpKeys > mask_from; };

  // kCustom: each lane's kMaskBytes mask bytes of a step (rows a * 16 + lane / 4 + 8 h, keys
  // n * 8 + 2 (lane % 4) + e) are loaded one step ahead and packed into bits after that step's
  // work (when they have landed): a mask byte read in the step that needs it would stall the
  // warp on a memory round trip every 16 keys (measured: verify b64 x 4096 took 470 us against
  // 257 us without a mask), and bits move between steps without waiting for anything. The
  // transposed tile's 4 a lane: bit (2 h + e) is key first + lane / 4 + 8 h of row 2 (lane % 4)
  // + e, its accumulator's element order.
  constexpr int kMaskBytes = Tr::kTransposed ? 4 : kMAtoms * 8;
  // The tile row of this lane's accumulator row h of m16 atom a: lane / 4 + 8 h + 16 a, or in the
  // transposed tile (rows in the MMA's N) 2 (lane % 4) + h.
  auto lane_row = [&](int a, int h) {
    return Tr::kTransposed ? 2 * (lane & 3) + h : a * 16 + (lane >> 2) + 8 * h;
  };
  // Its tree token (rows past the tile's last one read as its last token: they are never stored).
  auto lane_token = [&](int a, int h) {
    return div_group(min(row0 + lane_row(a, h), rows_total - 1));
  };
  // Whether key j lies inside the causal / window interval of `token`'s row and the keys.
  auto key_visible = [&](int token, int j) {
    const int last_visible = causal ? diagonal + token : kv_end - 1;
    const int first_visible = window >= 0 ? diagonal + token - window : 0;
    return j < kv_end && j <= last_visible && j >= first_visible;
  };
  auto load_mask = [&](int u, uint8_t(&into)[kMaskBytes]) {
    if (u >= warp_steps || !step_masked(u)) return;  // the step reads no mask byte
    const int first = step_key(u);
    if constexpr (Tr::kTransposed) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint8_t* mask_row = p.custom_mask + (mask_offset + lane_token(0, e) * mask_row_len);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int j = first + (lane >> 2) + 8 * h;
          into[2 * h + e] = j < kv_end && j >= mask_from ? mask_row[j] : 1;
        }
      }
    } else {
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint8_t* mask_row = p.custom_mask + (mask_offset + lane_token(a, h) * mask_row_len);
#pragma unroll
          for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int j = first + n * 8 + (lane & 3) * 2 + e;
              into[a * 8 + h * 4 + n * 2 + e] = j < kv_end && j >= mask_from ? mask_row[j] : 1;
            }
          }
        }
      }
    }
  };

  // Bit i of a step's mask bits: byte i of load_mask is 0 (the element is hidden).
  auto pack_mask = [&](int u, const uint8_t(&bytes)[kMaskBytes]) -> uint32_t {
    if (u >= warp_steps || !step_masked(u)) return 0u;
    uint32_t bits = 0;
#pragma unroll
    for (int i = 0; i < kMaskBytes; ++i) bits |= bytes[i] == 0 ? 1u << i : 0u;
    return bits;
  };

  // One step of the warp. `slot_ahead` holds the slots of the step it issues and receives
  // `slot_after`'s, which receives those of the step after; `mask_bits` holds this step's
  // custom-mask bits (kCustom) and receives the next step's. One copy of this code in a rolled
  // loop: a second copy (two steps an iteration) was ~1800 more instructions to fetch, cold, at a
  // small batch.
  auto run_step = [&](int u, int32_t& slot_ahead, int32_t& slot_after, uint32_t& mask_bits) {
    const int first = step_key(u);
    // Refill the stage read in the previous step (every lane is past it: ldmatrix is warp-wide).
    __syncwarp();
    issue(u + kStages - 1, slot_ahead, 0);
    slot_ahead = slot_after;
    slot_after = load_slots(u + kStages + 1, false);
    uint8_t mask_next[kMaskBytes];
    if (custom) load_mask(u + 1, mask_next);
    uint32_t hidden = 0;  // bit (a * 8 + h * 4 + n * 2 + e): element s[a][4n + 2h + e] masked
    const bool masked = step_masked(u);
    const bool needs_mask = masked || first + Tr::kWarpKeys > kv_end ||
                            (causal && first + Tr::kWarpKeys - 1 > diagonal + tile_first_token) ||
                            (window >= 0 && first < diagonal + tile_last_token - window);
    if (needs_mask && Tr::kTransposed) {
      // bit (2 h + e): key first + lane / 4 + 8 h of row 2 (lane % 4) + e
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int token = lane_token(0, e);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (!key_visible(token, first + (lane >> 2) + 8 * h)) hidden |= 1u << (2 * h + e);
        }
      }
      if (masked) hidden |= mask_bits;
    } else if (needs_mask) {
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int token = lane_token(a, h);
#pragma unroll
          for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (!key_visible(token, first + n * 8 + (lane & 3) * 2 + e)) {
                hidden |= 1u << (a * 8 + h * 4 + n * 2 + e);
              }
            }
          }
        }
      }
      if (masked) hidden |= mask_bits;
    }
    ptx::cp_async_wait<kStages - 1>();  // step u's copies (this lane's) landed
    __syncwarp();                       // ... and every lane's
    uint32_t k_stage, v_stage;
    if (fp8) {
      convert(u);
      __syncwarp();
      k_stage = s_convert;
    } else {
      k_stage = s_warp + (u % kStages) * Tr::kStageBytes;
    }
    v_stage = k_stage + Tr::kSubBytes;

    if constexpr (Tr::kTransposed) {
      // S^T = K Q^T: K as the A operand (rows = the 16 keys), two chains over the k16 slices.
      float st[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t ka[4];
        ldmatrix_x4(ka, ((k_stage + a_lane) ^ ((kk % 4) * 32)) + (kk / 4) * 128);
        mma_16816<T>(st[kk & 1], ka, qt_frag[kk][0], qt_frag[kk][1]);
      }
      float s4[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s4[i] = st[0][i] + st[1][i];
        if (soft_cap) s4[i] = p.logit_cap * fast_tanh(s4[i] * cap_inner);
        if (hidden & (1u << i)) s4[i] = -INFINITY;
      }
      float factor[2];
      const bool moved = softmax_t.update(s4, scale_log2, factor);
      if (u > 0 && __any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int m = 0; m < kDimBlocks; ++m) {
          ot[m][0] *= factor[0];
          ot[m][1] *= factor[1];
          ot[m][2] *= factor[0];
          ot[m][3] *= factor[1];
        }
      }
      // P^T as the B operand of O^T += V^T P^T: each 8-key half of the accumulator transposed.
      const uint32_t pb0 = ptx::movmatrix_trans(pack2<T>(s4[0], s4[1]));
      const uint32_t pb1 = ptx::movmatrix_trans(pack2<T>(s4[2], s4[3]));
#pragma unroll
      for (int m = 0; m < kDimBlocks; ++m) {
        uint32_t va[4];  // V^T rows 16 m.. (dims) x the 16 keys
        ldmatrix_x4_trans(va, ((v_stage + k_lane) ^ ((m % 4) * 32)) + (m / 4) * 128);
        mma_16816<T>(ot[m], va, pb0, pb1);
      }
    } else {
      // S = Q K^T over the warp's 16 keys (two n8 blocks).
      float s[kMAtoms][8];
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
        for (int i = 0; i < 8; ++i) s[a][i] = 0.f;
      }
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t kb[4];
        ldmatrix_x4(kb, ((k_stage + k_lane) ^ ((kk % 4) * 32)) + (kk / 4) * 128);
#pragma unroll
        for (int a = 0; a < kMAtoms; ++a) {
          float(&s0)[4] = *reinterpret_cast<float(*)[4]>(&s[a][0]);
          float(&s1)[4] = *reinterpret_cast<float(*)[4]>(&s[a][4]);
          if constexpr (Tr::kQInRegisters) {
            mma_16816<T>(s0, q_frag[kk], kb[0], kb[1]);
            mma_16816<T>(s1, q_frag[kk], kb[2], kb[3]);
          } else {
            uint32_t qa[4];
            ldmatrix_x4(qa, (q_lane ^ ((kk % 4) * 32)) + (kk / 4) * 128 + a * 16 * kRowBytes);
            mma_16816<T>(s0, qa, kb[0], kb[1]);
            mma_16816<T>(s1, qa, kb[2], kb[3]);
          }
        }
      }
      if (soft_cap) {
#pragma unroll
        for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
          for (int i = 0; i < 8; ++i) s[a][i] = p.logit_cap * fast_tanh(s[a][i] * cap_inner);
        }
      }
      if (hidden != 0) {
#pragma unroll
        for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int n = 0; n < 2; ++n) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                if (hidden & (1u << (a * 8 + h * 4 + n * 2 + e)))
                  s[a][4 * n + 2 * h + e] = -INFINITY;
              }
            }
          }
        }
      }

      bool moved = false;
      float factor[kMAtoms][2];
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) moved |= softmax[a].update<2>(s[a], scale_log2, factor[a]);
      // (Step 0: nothing accumulated yet, O is zero.)
      if (u > 0 && __any_sync(0xffffffffu, moved)) {
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

      // O += P V: P straight from the S accumulators (two n8 blocks = one k16 A fragment).
      uint32_t pa[kMAtoms][4];
#pragma unroll
      for (int a = 0; a < kMAtoms; ++a) {
        pa[a][0] = pack2<T>(s[a][0], s[a][1]);
        pa[a][1] = pack2<T>(s[a][2], s[a][3]);
        pa[a][2] = pack2<T>(s[a][4], s[a][5]);
        pa[a][3] = pack2<T>(s[a][6], s[a][7]);
      }
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, ((v_stage + v_lane) ^ ((dp % 4) * 32)) + (dp / 4) * 128);
#pragma unroll
        for (int a = 0; a < kMAtoms; ++a) {
          mma_16816<T>(o[a][2 * dp], pa[a], vb[0], vb[1]);
          mma_16816<T>(o[a][2 * dp + 1], pa[a], vb[2], vb[3]);
        }
      }
    }
    if (custom) mask_bits = pack_mask(u + 1, mask_next);  // landed during this step's work
  };
  uint32_t mask_bits = 0;
  if (custom) {
    uint8_t first_mask[kMaskBytes];
    load_mask(0, first_mask);
    mask_bits = pack_mask(0, first_mask);
  }
#pragma unroll(Tr::kStepUnroll)
  for (int u = 0; u < warp_steps; ++u) run_step(u, slot_ahead, slot_after, mask_bits);
#if defined(KVATTN_TC_DECODE_TRACE)
  if (trace != nullptr && lane == 0) trace[kTraceWarpDone + warp] = ptx::global_timer();
#endif
  // ---- merge the four warps' states ---------------------------------------------------------
  // Each warp leaves its unnormalized O and its rows' max (raw logit units) and sum in its own
  // pipeline region as soon as its copies have landed (no other warp reads that region), then
  // one CTA barrier: a warp that finished early has run this code once before the last one does.
  float* const state0 = reinterpret_cast<float*>(smem + Tr::kQBytes);
  auto o_of = [&](int w) { return state0 + w * (warp_region / 4); };  // [row][kOStride]
  auto max_of = [&](int w) { return o_of(w) + Tr::kTileRows * Tr::kOStride; };
  auto sum_of = [&](int w) { return max_of(w) + Tr::kTileRows; };
  float* const row_lse = sum_of(0) + Tr::kTileRows;  // [row], read by the cluster fold
  const bool in_cluster = tiles.cluster > 1;         // a cluster-split plan's chunk
  ptx::cp_async_wait<0>();
  __syncwarp();  // every lane's last ldmatrix of the region is done
  if constexpr (Tr::kTransposed) {
    float* const o_warp = o_of(warp);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float total = softmax_t.row_sum(e);
      const int r = lane_row(0, e);
      if (lane < 4) {
        max_of(warp)[r] = softmax_t.max[e];
        sum_of(warp)[r] = total;
      }
    }
#pragma unroll
    for (int m = 0; m < kDimBlocks; ++m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        o_warp[(2 * (lane & 3) + (i & 1)) * Tr::kOStride + 16 * m + (lane >> 2) + 8 * (i >> 1)] =
            ot[m][i];
      }
    }
  } else {
    float* const o_warp = o_of(warp);
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float total = softmax[a].sum[h];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const int r = lane_row(a, h);
        if ((lane & 3) == 0) {
          max_of(warp)[r] = softmax[a].max[h];
          sum_of(warp)[r] = total;
        }
        float* dst = o_warp + r * Tr::kOStride + (lane & 3) * 2;
#pragma unroll
        for (int d = 0; d < kDimTiles; ++d) {
          *reinterpret_cast<float2*>(dst + d * 8) = make_float2(o[a][d][2 * h], o[a][d][2 * h + 1]);
        }
      }
    }
  }
  // The split merge (a programmatic dependent) may be scheduled now; it waits for this grid. (A
  // cluster-split grid lets the next grid in only at its end: launch.cuh.)
  if (!in_cluster) ptx::grid_launch_dependents();
  __syncthreads();
  // The output loop below gives thread tid the rows (tid + k * kThreads) / kOutThreads, k <
  // kOutSteps: a warp's rows are known in advance, kTileRows / 4 of them. Lane j of the warp
  // computes row j's weights (the CTA max, each warp's weight, the LSE: no CTA-wide phase and
  // no barrier for it) and the loop takes them by shuffles.
  constexpr int kOutThreads = kHeadDim / 4;  // threads a row: 4 dims each
  constexpr int kOutSteps = Tr::kTileRows * kOutThreads / Tr::kThreads;
  constexpr int kOutRowsAStep = 32 / kOutThreads;  // a warp's rows in one step
  static_assert(Tr::kTileRows * kOutThreads % Tr::kThreads == 0 && 32 % kOutThreads == 0,
                "whole rows a warp and step");
  static_assert(kOutSteps * kOutRowsAStep <= 32, "a lane a row of the warp");
  auto out_row_of = [&](int k, int sub) {
    return warp * kOutRowsAStep + sub + k * (Tr::kThreads / kOutThreads);
  };
  float row_weight[Tr::kWarps];
  float row_lse_mine = -INFINITY;
  {
    const int r = out_row_of(lane / kOutRowsAStep, lane % kOutRowsAStep);
    const bool mine = lane < kOutSteps * kOutRowsAStep;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      row_weight[w] = mine ? max_of(w)[r] : -INFINITY;
      top = fmaxf(top, row_weight[w]);
    }
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float m = row_weight[w];
      row_weight[w] = m == -INFINITY ? 0.f : ptx::fast_exp2((m - top) * scale_log2);
      total += (mine ? sum_of(w)[r] : 0.f) * row_weight[w];
    }
    const bool empty = !(total > 0.f);
    const float inv_total = empty ? 0.f : p.v_scale / total;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) row_weight[w] *= inv_total;
    row_lse_mine = empty ? -INFINITY : (top * scale_log2 + __log2f(total)) * ptx::kLn2;
    if (mine) row_lse[r] = row_lse_mine;  // read by the cluster fold (distributed)
  }

  stamp(kTraceMerged);
  if (refused) return;  // before the first write (every CTA of the grid returns here)

  // Output: 4 dims a thread at a time; a split chunk writes its partial state (fp32), a chunk of
  // a cluster-split tile its merged O into shared memory (warp 0's O, in place) for the
  // cluster's fold below, a whole tile its rows of out (io dtype, or fp32 with p.out_fp32) and
  // the LSE.
  const int v_dim = p.v_head_dim;
  float* const cl_out = o_of(0);  // [row][kOStride]
  auto store_out = [&](int r, int d0, const float4& acc, float lse) {
    const int packed = row0 + r;
    const int token = div_group(packed);
    const int head = kv_head * group + (packed - token * group);
    const int64_t out_row =
        (int64_t(q_begin) + token) * p.out_stride_token + int64_t(head) * p.out_stride_head + d0;
    if (p.out_fp32) {
      *reinterpret_cast<float4*>(static_cast<float*>(p.out) + out_row) = acc;
    } else {
      uint2 packed2;
      packed2.x = pack2<T>(acc.x, acc.y);
      packed2.y = pack2<T>(acc.z, acc.w);
      *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + out_row) = packed2;
    }
    if (d0 == 0 && p.lse != nullptr) {
      p.lse[(int64_t(q_begin) + token) * p.num_q_heads + head] = lse;
    }
  };
  const int d0 = (lane % kOutThreads) * 4;  // this thread's dims of every row it writes
#pragma unroll
  for (int k = 0; k < kOutSteps; ++k) {
    const int sub = lane / kOutThreads;
    const int r = out_row_of(k, sub);
    const int holder = k * kOutRowsAStep + sub;  // the lane that computed row r's weights
    float weight[Tr::kWarps];
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) weight[w] = __shfl_sync(0xffffffffu, row_weight[w], holder);
    const float lse_r = __shfl_sync(0xffffffffu, row_lse_mine, holder);
    if (row0 + r >= rows_total || d0 >= v_dim) continue;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float4 part = *reinterpret_cast<const float4*>(o_of(w) + r * Tr::kOStride + d0);
      acc.x = fmaf(part.x, weight[w], acc.x);
      acc.y = fmaf(part.y, weight[w], acc.y);
      acc.z = fmaf(part.z, weight[w], acc.z);
      acc.w = fmaf(part.w, weight[w], acc.w);
    }
    if (in_cluster) {
      *reinterpret_cast<float4*>(cl_out + r * Tr::kOStride + d0) = acc;
    } else if (item.partial >= 0) {
      const int64_t slot_row = int64_t(item.partial) * tiles.tile_rows + r;
      *reinterpret_cast<float4*>(tiles.partial_out + slot_row * v_dim + d0) = acc;
      if (d0 == 0) tiles.partial_lse[slot_row] = lse_r;
    } else {
      store_out(r, d0, acc, lse_r);
    }
  }

  // ---- cluster split: the tile's chunks are this CTA's cluster; each folds a share of the rows
  // from every chunk's cl_out / row_lse through distributed shared memory, then no CTA leaves
  // before the others have read it.
  stamp(kTraceStored);
  if (in_cluster) {
    ptx::cluster_sync();
    stamp(kTraceClusterIn);
    const int n = tiles.cluster;  // a power of two, 2..Tr::kMaxCluster
    const int rank = static_cast<int>(ptx::cluster_rank());
    const uint32_t lse_local = smem_address(row_lse);
    const uint32_t out_local = smem_address(cl_out);
    // A row's kRowThreads threads (lanes of one warp) fold it, 4 dims each: thread t < n reads
    // chunk t's LSE, the row's max and sum go round by shuffles, and chunk c's weight comes from
    // thread c. All chunks' O in flight at once (four batches of four were ~2 us at batch 1:
    // five dependent distributed round trips).
    constexpr int kRowThreads = kHeadDim / 4;
    constexpr int kRowsAPass = Tr::kThreads / kRowThreads;
    static_assert(Tr::kMaxCluster <= kRowThreads && 32 % kRowThreads == 0, "a row in one warp");
    const int t = tid % kRowThreads;
    const int d0 = t * 4;
#pragma unroll 1
    for (int i0 = 0; rank + i0 * n < Tr::kTileRows; i0 += kRowsAPass) {  // rows rank, rank + n..
      const int r = rank + (i0 + tid / kRowThreads) * n;
      const bool row_ok = r < Tr::kTileRows && row0 + r < rows_total;  // the same for a row
      const bool reads = row_ok && d0 < v_dim;
      // Every chunk's O and this thread's LSE requested at once (one distributed round trip;
      // the weights are applied after they arrive).
      float lse_t = -INFINITY;
      if (row_ok && t < n) lse_t = ptx::cluster_load_f32(ptx::cluster_map(lse_local + r * 4, t));
      float4 part[Tr::kMaxCluster];
#pragma unroll
      for (int c = 0; c < Tr::kMaxCluster; ++c) {
        part[c] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (reads && c < n) {
          part[c] =
              ptx::cluster_load_f32x4(ptx::cluster_map(out_local + (r * Tr::kOStride + d0) * 4, c));
        }
      }
      float top = lse_t;
#pragma unroll
      for (int o = kRowThreads / 2; o > 0; o /= 2) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o, kRowThreads));
      }
      const float e = top == -INFINITY ? 0.f : __expf(lse_t - top);  // exp(-inf) = 0: empty
      float total = e;
#pragma unroll
      for (int o = kRowThreads / 2; o > 0; o /= 2) {
        total += __shfl_xor_sync(0xffffffffu, total, o, kRowThreads);
      }
      const bool empty = !(total > 0.f);
      const float w_t = empty ? 0.f : e / total;  // 0 for t >= n (its LSE is -inf)
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int c = 0; c < Tr::kMaxCluster; ++c) {
        const float w = __shfl_sync(0xffffffffu, w_t, c, kRowThreads);
        acc.x = fmaf(part[c].x, w, acc.x);
        acc.y = fmaf(part[c].y, w, acc.y);
        acc.z = fmaf(part[c].z, w, acc.z);
        acc.w = fmaf(part[c].w, w, acc.w);
      }
      if (reads) store_out(r, d0, acc, empty ? -INFINITY : top + __logf(total));
    }
    stamp(kTraceFolded);
    ptx::grid_launch_dependents();
    // No CTA leaves before the others have read it (relaxed: nothing to publish).
    ptx::cluster_sync_relaxed();
    stamp(kTraceExit);
    return;
  }

  // ---- a split tile's last chunk to finish merges the tile (tiles.merge_in_kernel) ----------
  // The chunks publish their partials (fence, then count): the CTA that brings the count to
  // num_partials sees every chunk's partial in L2 and folds them (merge_split_row reads through
  // L2), then resets the count for the plan's next launch (the next layer).
  if (item.partial < 0 || tiles.merge_in_kernel == 0) return;
  __shared__ int merges_here;
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    int* arrived = const_cast<int*>(&tiles.merges[item.merge].arrived);
    const int before = atomicAdd(arrived, 1);
    merges_here = before == tiles.merges[item.merge].num_partials - 1;
    if (merges_here) *arrived = 0;  // every chunk has counted itself
  }
  __syncthreads();
  if (!merges_here) return;
  __threadfence();
  const core::PrefillMergeItem merge = tiles.merges[item.merge];
  for (int r = warp; r < Tr::kTileRows; r += Tr::kWarps) {
    detail::merge_split_row<T>(p, tiles, merge, r, lane);
  }
}

// ---- host side of an instance ----------------------------------------------------------------

/// The plan shape and occupancy on the current device (tc_decode_kernel_shape selects it): the
/// 32-row instance's, with the narrow (16-row) instance's tile in narrow_tile_rows (the same
/// kv_tile, CTAs an SM and clusters: shared memory bounds both the same way).
template <int kHeadDim>
PrefillKernelShape shape_of() {
  using Tr = Traits<kHeadDim>;
  PrefillKernelShape shape;
  shape.tile_rows = Tr::kTileRows;
  shape.narrow_tile_rows = Traits<kHeadDim, 1>::kTileRows;
  shape.transposed_tile_rows = Traits<kHeadDim, 0>::kTileRows;
  shape.kv_tile = Tr::kTileKeys;
  shape.family = PrefillKernelFamily::kTcDecode;
  static_assert(Traits<kHeadDim, 1>::kTileKeys == Tr::kTileKeys &&
                    Traits<kHeadDim, 1>::max_smem_bytes() <= Tr::max_smem_bytes() &&
                    Traits<kHeadDim, 0>::kTileKeys == Tr::kTileKeys &&
                    Traits<kHeadDim, 0>::max_smem_bytes() <= Tr::max_smem_bytes(),
                "the narrow and transposed instances plan and fit like the wide one");
  int ctas = 0;
  auto kernel = tc_decode_kernel<kHeadDim, 2, __nv_bfloat16>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  Tr::max_smem_bytes()),
             "cudaFuncSetAttribute(tc_decode_kernel)");
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, Tr::kThreads,
                                                           Tr::smem_bytes(false)),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor(tc_decode_kernel)");
  shape.ctas_per_sm = ctas > 0 ? ctas : 1;
  // The largest cluster that fits the device at this occupancy (sizes above 8 are non-portable:
  // Hopper runs 16).
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
             "cudaFuncSetAttribute(tc_decode_kernel, non-portable clusters)");
  // Clusters of `cluster` CTAs with `smem` bytes of dynamic shared memory that run at once (0
  // where the size is refused: an answer, not an error to report later).
  auto clusters_at_once = [&](int cluster, int smem) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(cluster));
    config.blockDim = dim3(Tr::kThreads);
    config.dynamicSmemBytes = size_t(smem);
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = unsigned(cluster);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) clusters = 0;
    (void)cudaGetLastError();
    return clusters;
  };
  for (int cluster = Tr::kMaxCluster; cluster >= 2 && shape.max_cluster == 0; cluster /= 2) {
    if (clusters_at_once(cluster, Tr::smem_bytes(false)) > 0) shape.max_cluster = cluster;
  }
#if defined(KVATTN_TC_DECODE_TRACE)
  // Placement diagnostics of a trace build: the clusters that fit at once, at this occupancy and
  // at one CTA an SM (a dynamic shared memory request over half an SM's).
  if (trace_requested()) {
    const int spread = 120 * 1024;
    (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, spread);
    for (const int smem : {Tr::smem_bytes(false), spread}) {
      for (const int cluster : {16, 12, 8, 4}) {
        std::fprintf(stderr,
                     "tc_decode placement: cluster %2d, %6d B shared: %d clusters at once\n",
                     cluster, smem, clusters_at_once(cluster, smem));
      }
    }
    (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Tr::max_smem_bytes());
  }
#endif
  return shape;
}

template <int kHeadDim, int kMAtoms, typename T, bool kMasks = true>
void launch_typed(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                  cudaStream_t stream) {
  using Tr = Traits<kHeadDim, kMAtoms>;
  auto kernel = tc_decode_kernel<kHeadDim, kMAtoms, T, kMasks>;
  static std::atomic<uint64_t> devices_ready{0};
  int device = 0;
  const cudaError_t got = cudaGetDevice(&device);
  const uint64_t bit = (got == cudaSuccess && device < 64) ? (uint64_t{1} << device) : 0;
  if (bit == 0 || (devices_ready.load(std::memory_order_acquire) & bit) == 0) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Tr::max_smem_bytes()),
               "cudaFuncSetAttribute(tc_decode_kernel)");
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
               "cudaFuncSetAttribute(tc_decode_kernel, non-portable clusters)");
    devices_ready.fetch_or(bit, std::memory_order_release);
  }
  const bool fp8 = p.kv_dtype == DType::kFloat8E4M3 || p.kv_dtype == DType::kFloat8E5M2;
  detail::launch_programmatic_dependent(kernel, dim3(uint32_t(tiles.num_items)), dim3(Tr::kThreads),
                                        size_t(Tr::smem_bytes(fp8)), stream, "tc_decode_kernel",
                                        tiles.cluster, p, tiles);
}

/// The launcher of one instance file (kNotSupported when the head_dim was not compiled).
template <int kHeadDim>
void launch_if_compiled(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                        cudaStream_t stream) {
  if constexpr (head_dim_compiled(kHeadDim)) {
    // The plan's tile picks the instance (validated against the shape by launch_tc_decode).
    const bool narrow = tiles.tile_rows == Traits<kHeadDim, 1>::kTileRows;
    const bool transposed = tiles.tile_rows == Traits<kHeadDim, 0>::kTileRows;
    const bool masked = p.mask == core::MaskMode::kCustom;
    auto launch = [&]<typename T>() {
      if (transposed) {
        if (masked) {
          launch_typed<kHeadDim, 0, T>(p, tiles, stream);
        } else {
          launch_typed<kHeadDim, 0, T, false>(p, tiles, stream);
        }
      } else if (narrow) {
        launch_typed<kHeadDim, 1, T>(p, tiles, stream);
      } else {
        launch_typed<kHeadDim, 2, T>(p, tiles, stream);
      }
    };
    if (p.io_dtype == DType::kBFloat16) {
      launch.template operator()<__nv_bfloat16>();
    } else {
      launch.template operator()<__half>();
    }
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim", "not compiled: head_dim=", kHeadDim,
                " (KVATTN_CUDA_HEAD_DIMS)");
  }
}

template <int kHeadDim>
PrefillKernelShape shape_if_compiled() {
  if constexpr (head_dim_compiled(kHeadDim)) {
    return shape_of<kHeadDim>();
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim", "not compiled: head_dim=", kHeadDim,
                " (KVATTN_CUDA_HEAD_DIMS)");
  }
}

// One pair per instance file (tc_decode_hd<D>.cu).
void launch_tc_decode_hd64(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                           cudaStream_t stream);
void launch_tc_decode_hd128(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                            cudaStream_t stream);
PrefillKernelShape tc_decode_shape_hd64();
PrefillKernelShape tc_decode_shape_hd128();

}  // namespace kvattn::cuda::tc_decode
