// The online softmax of one MMA row pair, in registers: the GPU form of core::SoftmaxState
// (core/softmax_state.h), shared by the tensor-core prefill kernels.
//
// A thread of an m16 MMA fragment (mma.sync m16n8 or one warp's rows of a wgmma m64) holds, for
// each n8 block j of a score tile, s[4j + 2h + e]: row (lane / 4) + 8h, column 8j + 2 (lane % 4)
// + e. The four lanes of a quad share a row. Scores stay raw (q.k, or soft-capped logits) and
// exponentials run in base 2: p = 2^(s * scale_log2 - max * scale_log2), one FFMA + EX2.
#pragma once

#include <cmath>

#include "cuda/kernels/toolkit/ptx.cuh"

namespace kvattn::cuda {

/// Running max and sum of the two rows a thread holds.
struct RowPairSoftmax {
  /// A row's reference max moves only when a block's max exceeds it by more than this many
  /// log2 units, so p <= 2^8 (exact enough in fp32 sums and in a bf16/fp16 P) and the output is
  /// rescaled only on the rare blocks where some row's max jumps (FA4's trick; with random data
  /// some row of a warp finds a new max on almost every block, so an exact-max rescale would
  /// cost an FMUL per output register per block).
  static constexpr float kRescaleLog2 = 8.f;

  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};  ///< this thread's partial sums (the quad's four add up in finish)

  /// Turns the scores of one block into probabilities in place and folds them into the state.
  /// factor[h] is what the output accumulated so far must be multiplied by; returns true when
  /// some factor is not 1 (the caller rescales only then).
  ///
  /// Wide blocks (>= 8 n8 blocks, the Hopper prefill's 128 keys) reduce a row's max and sum in
  /// four independent chains and add those up at the end: the softmax sits on the critical
  /// path between a block's S and the next products, and with two warps a scheduler a 32-deep
  /// chain of dependent FMNMX / FADD is latency nobody hides. Narrow blocks keep one chain.
  ///
  /// kVotedMax: a row's reference moves only if some thread of its quad holds a score past it
  /// by kRescaleLog2, so each thread tests its own max first and the warp votes; the quad's max
  /// shuffles run only when some thread of the warp moves (the first blocks of a tile, then
  /// rarely). Measured faster only where three consumer warpgroups share an SM (the Hopper
  /// prefill at head_dim 64, bench/NOTES.md, twenty-fourth session); slower at 128 and 256.
  template <int kBlocks, bool kVotedMax = false>
  __device__ __forceinline__ bool update(float (&s)[kBlocks * 4], float scale_log2,
                                         float (&factor)[2]) {
    constexpr int kChains = kBlocks >= 8 ? 4 : 1;
    float thread_max[2];  // the max of this thread's scores of each row
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // Each chain starts from its first block (not from -inf: an FMNMX a chain saved).
      float chain_max[kChains];
#pragma unroll
      for (int c = 0; c < kChains; ++c) {
        chain_max[c] = fmaxf(s[4 * c + 2 * h], s[4 * c + 2 * h + 1]);
      }
#pragma unroll
      for (int j = kChains; j < kBlocks; ++j) {
        chain_max[j % kChains] =
            fmaxf(chain_max[j % kChains], fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      }
      thread_max[h] = chain_max[0];
#pragma unroll
      for (int c = 1; c < kChains; ++c) thread_max[h] = fmaxf(thread_max[h], chain_max[c]);
    }
    // True when the row had no max yet and now has one; false when both are -inf (NaN).
    auto moves = [&](float row_max, int h) {
      return (row_max - max[h]) * scale_log2 > kRescaleLog2;
    };
    bool quad_max = true;  // whether the quad's max is needed (warp-uniform)
    if constexpr (kVotedMax) {
      quad_max = __any_sync(0xffffffffu, moves(thread_max[0], 0) || moves(thread_max[1], 1));
    }
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      factor[h] = 1.f;
      if (quad_max) {
        float row_max = thread_max[h];
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
        const bool move = moves(row_max, h);
        factor[h] = move ? ptx::fast_exp2((max[h] - row_max) * scale_log2) : 1.f;
        max[h] = move ? row_max : max[h];
        sum[h] *= factor[h];
        moved |= move;
      }
      // A row that has seen only masked keys keeps max -inf; exponentiate against 0 then.
      const float offset = max[h] == -INFINITY ? 0.f : -max[h] * scale_log2;
      if constexpr (kChains == 1) {
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = ptx::fast_exp2(fmaf(s[4 * j + 2 * h + e], scale_log2, offset));
            s[4 * j + 2 * h + e] = p;
            sum[h] += p;
          }
        }
      } else {
        float chain_sum[kChains];
#pragma unroll
        for (int c = 0; c < kChains; ++c) chain_sum[c] = 0.f;
#pragma unroll
        for (int j = 0; j < kBlocks; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = ptx::fast_exp2(fmaf(s[4 * j + 2 * h + e], scale_log2, offset));
            s[4 * j + 2 * h + e] = p;
            chain_sum[j % kChains] += p;
          }
        }
        sum[h] += (chain_sum[0] + chain_sum[1]) + (chain_sum[2] + chain_sum[3]);
      }
    }
    return moved;
  }

  /// The final per-row normaliser and natural-log LSE (an empty row: 0 and -inf, the empty
  /// partial). out_scale multiplies the normaliser (fp8 V: v_scale).
  __device__ __forceinline__ void finish(float scale_log2, float out_scale, float (&inv_sum)[2],
                                         float (&lse)[2]) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float total = sum[h];
      total += __shfl_xor_sync(0xffffffffu, total, 1);
      total += __shfl_xor_sync(0xffffffffu, total, 2);
      inv_sum[h] = total > 0.f ? out_scale / total : 0.f;
      lse[h] = total > 0.f ? (max[h] * scale_log2 + __log2f(total)) * ptx::kLn2 : -INFINITY;
    }
  }
};

/// The online softmax of a transposed score block (S^T = K Q^T, the decode-shaped kernel's
/// 8-row tile): a thread of an m16n8 accumulator holds s[2h + e], key (lane / 4) + 8h of the
/// block and query row 2 (lane % 4) + e, so a row's keys are spread over the eight lanes that
/// share lane % 4. Same rules as RowPairSoftmax (lazy rescale, base-2 exponentials); sum[e] is
/// this thread's partial (the eight lanes' add up in the caller's epilogue).
struct ColumnPairSoftmax {
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};

  /// As RowPairSoftmax::update for one 16-key block.
  __device__ __forceinline__ bool update(float (&s)[4], float scale_log2, float (&factor)[2]) {
    bool moved = false;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float block_max = fmaxf(s[e], s[2 + e]);
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 4));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 8));
      block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 16));
      const bool move = (block_max - max[e]) * scale_log2 > RowPairSoftmax::kRescaleLog2;
      factor[e] = move ? ptx::fast_exp2((max[e] - block_max) * scale_log2) : 1.f;
      max[e] = move ? block_max : max[e];
      sum[e] *= factor[e];
      moved |= move;
      const float offset = max[e] == -INFINITY ? 0.f : -max[e] * scale_log2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float p = ptx::fast_exp2(fmaf(s[2 * h + e], scale_log2, offset));
        s[2 * h + e] = p;
        sum[e] += p;
      }
    }
    return moved;
  }

  /// The sum of row 2 (lane % 4) + e over the eight lanes that hold its keys.
  __device__ __forceinline__ float row_sum(int e) const {
    float total = sum[e];
    total += __shfl_xor_sync(0xffffffffu, total, 4);
    total += __shfl_xor_sync(0xffffffffu, total, 8);
    total += __shfl_xor_sync(0xffffffffu, total, 16);
    return total;
  }
};

}  // namespace kvattn::cuda
