// Shapes, shared-memory layout and register budget of the Hopper (sm_90a) prefill kernel.
//
// A CTA is three warpgroups: warpgroup 0 loads (each tile's description and Q into one of
// kQBuffers buffers, then K and V blocks through a ring of kStages shared-memory stages, all
// guarded by mbarriers), warpgroups 1 and 2 compute, each on 64 of the tile's 128 packed rows (a
// wgmma is m64; at head_dim 64 a third consumer warpgroup and 192-row tiles). One CTA per SM (the
// stages fill shared memory), so the tile scheduler is persistent, and the producer owns it: the
// consumers take tiles from shared memory in the order the producer publishes them.
//
// Worked example, head_dim 128: Q 128 x 128 bf16 = 32 KiB, two buffers (the next tile's Q lands
// while this one computes; a finished tile stages its output in its own Q buffer); a K or V
// block 128 keys x 128 = 32 KiB; two stages of K and V = 128 KiB; 192 KiB plus tables of the
// 227 KiB an SM offers. A consumer thread holds S (64 x 128 fp32 over 128 threads = 64
// registers), P (32), O (64).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/kernels/toolkit/ptx.cuh"
#include "cuda/kernels/toolkit/wgmma.cuh"

namespace kvattn::cuda::sm90 {

/// Stages of the K/V ring that fit in shared memory next to Q: three at head_dim <= 128
/// (Q 32 KiB + 3 x 64 KiB of K and V), two above.
constexpr int max_prefill_stages(int head_dim) {
  return head_dim <= 128 ? 3 : 2;
}

template <int kHeadDim_, int kHeadDimV_, int kStages_ = 2>
struct PrefillTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  // Consumer warpgroups, each 64 of the tile's rows: three at head_dim 64 (FA3's 192-row tile
  // there: the softmax costs as much a block as at 128 for half the tensor work, so a third
  // warpgroup hides its latency), two above (the registers of S, P and a wider O).
  static constexpr int kConsumerWarpgroups = kHeadDim <= 64 ? 3 : 2;
  // The softmax's row max through a warp vote first (RowPairSoftmax::update's kVotedMax):
  // measured faster with three consumer warpgroups only (bench/NOTES.md, twenty-fourth session).
  static constexpr bool kVotedMax = kConsumerWarpgroups == 3;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kTileRows = 64 * kConsumerWarpgroups;  // packed rows (GQA group x tokens)
  // Keys a block: 128 (FA3's choice for causal head_dim <= 192); head_dim 256 halves it so two
  // stages of K and V (2 x 2 x 32 KiB) and Q (64 KiB) fit, and O (128 registers) + S fit the
  // consumers' register budget.
  static constexpr int kKvTile = kHeadDim <= 192 ? 128 : 64;
  // Stages of the K/V ring (an instance parameter, see launch_for_dtype): two by default (the
  // row copies measured faster with two since v5, the tensor-map path with two and two Q
  // buffers since the seventeenth session, bench/NOTES.md); three for A/B runs where they fit.
  static constexpr int kStages = kStages_;
  // Registers per thread after setmaxnreg: 128 x 72 + 256 x 216 (or 56 + 224 where O is 256
  // wide) = 64512 of 65536; with three consumer warpgroups 128 x 32 + 384 x 160 = 65536. The
  // producer's hd128 row copies spilled at 56 (~50 local loads/stores); an hd64 row is half.
  static constexpr int kProducerRegisters =
      kConsumerWarpgroups == 3 ? 32 : (kHeadDimV <= 128 ? 72 : 56);
  static constexpr int kConsumerRegisters =
      kConsumerWarpgroups == 3 ? 160 : (kHeadDimV <= 128 ? 216 : 224);
  static_assert(128 * kProducerRegisters + 128 * kConsumerWarpgroups * kConsumerRegisters <= 65536,
                "the register file");

  // Shared memory (byte offsets from a 1024-byte aligned base).
  static constexpr int kQBytes = kTileRows * kHeadDim * 2;
  static constexpr int kKBytes = kKvTile * kHeadDim * 2;
  static constexpr int kVBytes = kKvTile * kHeadDimV * 2;
  // Everything but the Q buffers: the K/V ring, the slot tables, the tile descriptions, the
  // scratch words and the barriers (at most 2 x 2 + 4 x kStages of them), rounded up.
  static constexpr int kSlotTables = 3;
  static constexpr int kTileInfoBytes = 64;  // one PrefillTile (static_assert in the kernel)
  static constexpr int kRingAndTables = kStages * (kKBytes + kVBytes) + kSlotTables * kKvTile * 4 +
                                        2 * kTileInfoBytes + 64 + (4 + 4 * kStages) * 8;
  /// Two Q buffers where they fit next to the ring, else one (then the next tile's Q is loaded
  /// only after this tile's last S, and the output is stored from registers).
  static constexpr int kQBuffers = 2 * kQBytes + kRingAndTables + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBuffers * kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKBytes;
  // Paged K/V: the slot of each key of a block, written by the producer warpgroup; three tables
  // in rotation (see the producer) so a table is never rewritten while a V copy still reads it.
  static constexpr int kSlotOffset = kVOffset + kStages * kVBytes;
  // The description of the tile whose Q is in buffer b (written by the producer).
  static constexpr int kTileInfoOffset = kSlotOffset + kSlotTables * kKvTile * 4;
  // One word per consumer warp: the target of ptx::pin_before_wgmma_wait (never read).
  static constexpr int kScratchOffset = kTileInfoOffset + kQBuffers * kTileInfoBytes;
  // Two words: the producer's next item under the dynamic schedule, alternating by tile (thread
  // 0 writes, the warpgroup reads after a barrier).
  static constexpr int kNextItemOffset = kScratchOffset + kConsumerWarpgroups * 4 * 4;
  static constexpr int kBarrierOffset = kNextItemOffset + 16;
  // q_full / q_empty per Q buffer, then k_full / v_full / k_empty / v_empty per stage.
  static constexpr int kNumBarriers = 2 * kQBuffers + 4 * kStages;
  static constexpr int kSmemBytes = kBarrierOffset + kNumBarriers * 8;
  static constexpr int kSmemAllocBytes = kSmemBytes + 1024;  // slack to align the base

  static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0, "columns come in 64-wide sub-tiles");
  static_assert(kKvTile % 16 == 0 && kKvTile <= 128, "one slot per producer thread and block key");
  static_assert(kTileInfoOffset % 16 == 0, "tile descriptions are read as vectors");
  static_assert(kQOffset % 1024 == 0 && kKOffset % 1024 == 0 && kVOffset % 1024 == 0 &&
                    kKBytes % 1024 == 0 && kVBytes % 1024 == 0,
                "swizzled tiles start on 1024-byte boundaries");
  static_assert(kStages >= 2 && kStages <= max_prefill_stages(kHeadDim), "stages that fit");
  static_assert(kSmemAllocBytes <= 227 * 1024, "shared memory of one SM");
};

/// Ragged K/V by tensor map (TMA): 3-d maps over [rows, heads, dim] of k and v with a box of
/// [kKvTile rows, 1 head, 64 columns] in the 128-byte swizzle, which lands as one sub-tile of the
/// stage's layout. `enabled` false: the producer copies row by row (paged K/V, fp8, or maps the
/// driver could not encode). Passed as a __grid_constant__ kernel parameter.
struct PrefillTensorMaps {
  CUtensorMap k;
  CUtensorMap v;
  int enabled = 0;
};

/// Launch choices of the Hopper prefill kernel that are not part of the plan (defaults are the
/// tuned ones; KVATTN_SM90_PINGPONG=0 and KVATTN_SM90_CTAS=<n> override them for A/B runs).
struct LaunchOptions {
  int max_ctas = 0;  ///< persistent grid size: min(items, max_ctas); the SM count by default
  /// The consumer warpgroups take turns issuing their products, round robin (FA3's scheduler
  /// barrier). The host turns it on at head_dim 64 (three consumer warpgroups: -2.6% cycles)
  /// and leaves it off above (no gain at 128; bench/NOTES.md, eighteenth session: the hd256
  /// 8 x 2048 check failure seen with it on in 2026-12-02's kernel did not come back in three
  /// runs, racecheck and synccheck clean); KVATTN_SM90_PINGPONG=0|1 forces it.
  bool ping_pong = false;
  /// Benchmarking only (KVATTN_SM90_DIAG, trace builds; the output is then garbage): bit 0
  /// skips the K/V copies (the stages are signalled full at once), bit 1 skips the softmax
  /// (P = S). Times with a part left out say where the kernel's time goes.
  int diagnostic = 0;
  /// K/V ring depth: 0 = the instance's choice (launch_for_dtype); 2 or 3 forces one
  /// (KVATTN_SM90_STAGES, A/B runs; 3 only where it fits).
  int stages = 0;
  /// Time attribution only (a build with KVATTN_SM90_TRACE; prefill.cu allocates it when
  /// KVATTN_SM90_TRACE=1): %globaltimer stamps (ns) of each consumer warpgroup's tile phases
  /// (TraceSlot), kTraceTiles tiles a warpgroup; nullptr: none.
  unsigned long long* trace = nullptr;
  /// The dynamic tile schedule (DynamicTileScheduler; needs PrefillTiles::scheduler), else the
  /// static one (StaticTileScheduler). KVATTN_SM90_SCHEDULE=static|dynamic overrides for A/B.
  bool dynamic_schedule = true;
};

/// Phases a consumer warpgroup stamps per tile (KVATTN_SM90_TRACE builds).
enum TraceSlot : int {
  kTraceTileStart = 0,  // before the wait for the tile's Q
  kTraceQArrived = 1,   // the tile's description and Q are in shared memory
  kTraceFirstDone = 2,  // the first block's S and softmax are done (the loop starts)
  kTraceLoopDone = 3,   // the last P V has completed
  kTraceStored = 4,     // the output is written
  kTraceBlocks = 5,     // the tile's block count (not a time)
  kTraceFirstK = 6,     // inside the first block: its K has arrived
  kTraceFirstS = 7,     // inside the first block: its S is done (the softmax follows)
  kTraceKWait = 8,      // the later blocks' waits for K to arrive, summed (ns, not a time)
  kTraceVWait = 9,      // the blocks' waits for V to arrive, summed (ns, not a time)
  // One steady-state block of a long tile (loop step kTraceBlockStep), in %clock64 cycles (the
  // CTA's warpgroups share the SM's clock, so their stamps line up): the loop's top (before the
  // K wait), S and P V issued, S done, softmax done, P V done, the next step's top.
  kTraceBlockTop = 10,
  kTraceBlockIssued = 11,
  kTraceBlockS = 12,
  kTraceBlockSoftmax = 13,
  kTraceBlockPv = 14,
  kTraceBlockNext = 15,
  kTraceSlots = 16,
};
constexpr int kTraceBlockStep = 4;  // the loop step whose block is stamped (tiles of > 8 blocks)
constexpr int kTraceTiles = 96;  // tiles a warpgroup keeps (later ones are not stamped)
constexpr int kTraceWarpgroups = 3;  // trace records a CTA keeps (its most consumer warpgroups)

/// Stamps phase `slot` of a tile's trace (nothing when `tile` is null: untraced builds pass a
/// compile-time null, so the stamps fold away).
__device__ __forceinline__ void stamp(unsigned long long* tile, int slot) {
  if (tile != nullptr) tile[slot] = ptx::global_timer();
}

/// Stamps %clock64 into phase `slot` of a tile's trace when `on` (a traced tile's chosen block).
__device__ __forceinline__ void stamp_clock(unsigned long long* tile, bool on, int slot) {
  if (tile != nullptr && on) tile[slot] = clock64();
}

/// Waits on an mbarrier phase; in a traced tile also adds the wait's duration to *waited.
__device__ __forceinline__ void timed_wait(uint32_t mbarrier, uint32_t parity,
                                           unsigned long long* tile, unsigned long long& waited) {
  if (tile == nullptr) {
    ptx::mbarrier_wait(mbarrier, parity);
    return;
  }
  const unsigned long long start = ptx::global_timer();
  ptx::mbarrier_wait(mbarrier, parity);
  waited += ptx::global_timer() - start;
}
constexpr int kDiagnosticNoKvLoads = 1;
constexpr int kDiagnosticNoSoftmax = 2;
/// LaunchOptions::diagnostic is honoured by trace builds only: in the kernel that is measured,
/// its tests would be a branch a block for nothing (the host refuses KVATTN_SM90_DIAG there).
#if defined(KVATTN_SM90_TRACE)
constexpr bool kDiagnosticsBuilt = true;
#else
constexpr bool kDiagnosticsBuilt = false;
#endif

// Named barriers (0 is __syncthreads).
enum NamedBarrier : int {
  kProducerTable = 2,  // the producer warpgroup: a slot table is written
  kScheduleFirst = 3,  // ping-pong of the consumer warpgroups: ids 3, 4 (and 5 with three)
};

}  // namespace kvattn::cuda::sm90
