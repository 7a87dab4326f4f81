// The epilogue of the Hopper prefill kernel: a consumer thread's two rows of O, normalised, to
// the output (io dtype or fp32) or to the tile's split-KV partial slot, plus the LSE.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"
#include "cuda/kernels/sm90/tile_scheduler.cuh"
#include "cuda/kernels/toolkit/online_softmax.cuh"
#include "cuda/kernels/toolkit/ptx.cuh"

namespace kvattn::cuda::sm90 {

/// A 16-bit output's two rows of a consumer thread, 16 bytes a store: each quad transposes its
/// words (ptx::quad_transpose) so that a lane holds 8 consecutive columns of an n8 block instead
/// of 2 of each, a quarter of the store instructions, each writing whole 32-byte sectors. The
/// whole warp transposes before any row guard.
template <typename T, int kOutRegs>
__device__ __forceinline__ void store_rows_vec16(const core::AttentionParams& p,
                                                 const PrefillTile& t,
                                                 const core::FastDivmod& group, int v_dim,
                                                 const int (&rows)[2], int lane,
                                                 const float (&o)[kOutRegs],
                                                 const float (&inv_sum)[2], const float (&lse)[2]) {
  constexpr int kPieces = kOutRegs / 16;  // 16-byte pieces a lane stores per row
  uint32_t words[2][kPieces][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int g = 0; g < kPieces; ++g) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * g + i;
        words[h][g][i] =
            ptx::pack2<T>(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
      }
      ptx::quad_transpose(words[h][g], lane);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int token = 0, head = 0;
    if (!t.output_row(rows[h], group, token, head)) continue;
    T* row = static_cast<T*>(p.out) + (int64_t(t.q_begin) + token) * p.out_stride_token +
             int64_t(head) * p.out_stride_head;
#pragma unroll
    for (int g = 0; g < kPieces; ++g) {
      const int block = 4 * g + (lane & 3);  // this lane's n8 block after the transpose
      if (block * 8 < v_dim) ptx::store_global_v4(row + block * 8, words[h][g]);
    }
    if (p.lse != nullptr && (lane & 3) == 0) {
      p.lse[(int64_t(t.q_begin) + token) * p.num_q_heads + head] = lse[h];
    }
  }
}

/// Writes rows tile_row(0) and tile_row(1) of tile t. o is in the wgmma accumulator layout
/// (per n8 block j: o[4j + 2h + e] is column 8j + 2 (lane % 4) + e of row h). An empty tile
/// (no visible key) passes o = 0 and a fresh softmax: output 0, LSE -inf (the empty partial).
/// vec16: a 16-bit output whose rows are 16-byte vectors (out 16-byte aligned, strides and
/// v_dim multiples of 8) goes out 16 bytes a store (store_rows_vec16).
template <typename T, int kOutRegs>
__device__ __forceinline__ void store_tile_rows(
    const core::AttentionParams& p, const core::PrefillTiles& tiles, const PrefillTile& t,
    const core::FastDivmod& group, int v_dim, const int (&rows)[2], int lane,
    const float (&o)[kOutRegs], const RowPairSoftmax& softmax, float scale_log2, bool vec16) {
  float inv_sum[2], lse[2];
  softmax.finish(scale_log2, p.v_scale, inv_sum, lse);
  if constexpr (kOutRegs % 16 == 0) {
    if (vec16 && t.partial < 0 && !p.out_fp32) {
      store_rows_vec16<T>(p, t, group, v_dim, rows, lane, o, inv_sum, lse);
      return;
    }
  }
  const int column = (lane & 3) * 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int token = 0, head = 0;
    if (!t.output_row(rows[h], group, token, head)) continue;
    float* lse_dst = nullptr;
    if (t.partial >= 0) {
      // A chunk of a split tile: fp32 rows of its partial slot (already normalised).
      const int64_t slot_row = int64_t(t.partial) * tiles.tile_rows + rows[h];
      float* dst = tiles.partial_out + slot_row * v_dim + column;
#pragma unroll
      for (int j = 0; j < kOutRegs / 4; ++j) {
        if (j * 8 >= v_dim) break;
        *reinterpret_cast<float2*>(dst + j * 8) =
            make_float2(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
      }
      lse_dst = tiles.partial_lse + slot_row;
    } else {
      const int64_t offset = (int64_t(t.q_begin) + token) * p.out_stride_token +
                             int64_t(head) * p.out_stride_head + column;
      if (p.out_fp32) {
        float* dst = static_cast<float*>(p.out) + offset;
#pragma unroll
        for (int j = 0; j < kOutRegs / 4; ++j) {
          if (j * 8 >= v_dim) break;
          *reinterpret_cast<float2*>(dst + j * 8) =
              make_float2(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
        }
      } else {
        T* dst = static_cast<T*>(p.out) + offset;
#pragma unroll
        for (int j = 0; j < kOutRegs / 4; ++j) {
          if (j * 8 >= v_dim) break;
          *reinterpret_cast<uint32_t*>(dst + j * 8) =
              ptx::pack2<T>(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
        }
      }
      if (p.lse != nullptr) lse_dst = p.lse + (int64_t(t.q_begin) + token) * p.num_q_heads + head;
    }
    if (lse_dst != nullptr && (lane & 3) == 0) *lse_dst = lse[h];
  }
}

/// The same for a 16-bit output through shared memory: this warp's 16 rows of O (the rows its
/// wgmma fragments hold, tile rows warp_row0 .. warp_row0 + 15) are normalised into Q buffer
/// `q_buffer` (free once the tile's last S is done) in Q's 128-byte swizzled layout, then
/// written out a whole row per 16-byte lane group (a row of O is contiguous in the output), so
/// a store instruction covers whole rows instead of a 16-byte piece of each of eight rows.
/// Needs out 16-byte aligned with strides and v_dim multiples of 8 (prefill_kernel.cuh checks).
template <class Tr, typename T, int kOutRegs>
__device__ __forceinline__ void store_tile_rows_staged(
    const core::AttentionParams& p, const PrefillTile& t, const core::FastDivmod& group, int v_dim,
    const int (&rows)[2], int warp_row0, int lane, const float (&o)[kOutRegs],
    const RowPairSoftmax& softmax, float scale_log2, unsigned char* q_buffer) {
  static_assert(kOutRegs * 2 == Tr::kHeadDimV && Tr::kHeadDimV <= Tr::kHeadDim, "O fits Q");
  constexpr int kSubTileBytes = Tr::kTileRows * 128;  // a 64-column sub-tile of the buffer
  float inv_sum[2], lse[2];
  softmax.finish(scale_log2, p.v_scale, inv_sum, lse);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = rows[h];
    unsigned char* row = q_buffer + r * 128 + (lane & 3) * 4;
#pragma unroll
    for (int j = 0; j < kOutRegs / 4; ++j) {
      *reinterpret_cast<uint32_t*>(row + (j / 8) * kSubTileBytes + (((j % 8) ^ (r & 7)) << 4)) =
          ptx::pack2<T>(o[4 * j + 2 * h] * inv_sum[h], o[4 * j + 2 * h + 1] * inv_sum[h]);
    }
    int token = 0, head = 0;
    if (p.lse != nullptr && (lane & 3) == 0 && t.output_row(r, group, token, head)) {
      p.lse[(int64_t(t.q_begin) + token) * p.num_q_heads + head] = lse[h];
    }
  }
  __syncwarp();
  constexpr int kChunks = Tr::kHeadDimV / 8;  // 16-byte chunks of a row
  static_assert(kChunks <= 32 && 32 % kChunks == 0, "a row per lane group");
  constexpr int kRowsPerPass = 32 / kChunks;
  const int c = lane % kChunks;
  const bool column = c * 8 < v_dim;
#pragma unroll
  for (int i = 0; i < 16 / kRowsPerPass; ++i) {
    const int r = warp_row0 + lane / kChunks + i * kRowsPerPass;
    int token = 0, head = 0;
    if (column && t.output_row(r, group, token, head)) {
      const uint4 value = *reinterpret_cast<const uint4*>(
          q_buffer + (c / 8) * kSubTileBytes + r * 128 + (((c % 8) ^ (r & 7)) << 4));
      T* dst = static_cast<T*>(p.out) + (int64_t(t.q_begin) + token) * p.out_stride_token +
               int64_t(head) * p.out_stride_head + c * 8;
      *reinterpret_cast<uint4*>(dst) = value;
    }
  }
}

}  // namespace kvattn::cuda::sm90
