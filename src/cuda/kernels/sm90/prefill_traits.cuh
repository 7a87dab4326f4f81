// Shapes, shared-memory layout and register budget of the Hopper (sm_90a) prefill kernel.
//
// A CTA is three warpgroups: warpgroup 0 loads (Q once per tile, then K and V blocks through a
// ring of kStages shared-memory stages guarded by mbarriers), warpgroups 1 and 2 compute, each
// on 64 of the tile's 128 packed rows (a wgmma is m64). One CTA per SM (the stages fill shared
// memory), so the tile scheduler is persistent.
//
// Worked example, head_dim 128: Q 128 x 128 bf16 = 32 KiB; a K or V block 128 keys x 128 =
// 32 KiB; two stages of K and V = 128 KiB; 160 KiB in all of the 227 KiB an SM offers. A
// consumer thread holds S (64 x 128 fp32 over 128 threads = 64 registers), P (32) and O (64).
#pragma once

#include <cstdint>

#include "cuda/kernels/toolkit/wgmma.cuh"

namespace kvattn::cuda::sm90 {

template <int kHeadDim_, int kHeadDimV_>
struct PrefillTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kTileRows = 64 * kConsumerWarpgroups;  // packed rows (GQA group x tokens)
  // Keys a block: 128 (FA3's choice for causal head_dim <= 192); head_dim 256 halves it so two
  // stages of K and V (2 x 2 x 32 KiB) and Q (64 KiB) fit, and O (128 registers) + S fit the
  // consumers' register budget.
  static constexpr int kKvTile = kHeadDim <= 192 ? 128 : 64;
  static constexpr int kStages = 2;
  // Registers per thread after setmaxnreg: 128 x 40 + 256 x 232 = 64512 of 65536.
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 224;

  // Shared memory (byte offsets from a 1024-byte aligned base).
  static constexpr int kQBytes = kTileRows * kHeadDim * 2;
  static constexpr int kKBytes = kKvTile * kHeadDim * 2;
  static constexpr int kVBytes = kKvTile * kHeadDimV * 2;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKBytes;
  // Paged K/V: the slot of each key of a block, written by the producer warpgroup; three tables
  // in rotation (see the producer) so a table is never rewritten while a V copy still reads it.
  static constexpr int kSlotTables = 3;
  static constexpr int kSlotOffset = kVOffset + kStages * kVBytes;
  // One word per consumer thread: the target of ptx::pin_before_wgmma_wait (never read).
  static constexpr int kScratchOffset = kSlotOffset + kSlotTables * kKvTile * 4;
  static constexpr int kBarrierOffset = kScratchOffset + kConsumerWarpgroups * 128 * 4;
  // q_full, then k_full / v_full / k_empty / v_empty per stage.
  static constexpr int kNumBarriers = 1 + 4 * kStages;
  static constexpr int kSmemBytes = kBarrierOffset + kNumBarriers * 8;
  static constexpr int kSmemAllocBytes = kSmemBytes + 1024;  // slack to align the base

  static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0, "columns come in 64-wide sub-tiles");
  static_assert(kKvTile % 16 == 0 && kKvTile <= 128, "one slot per producer thread and block key");
  static_assert(kQOffset % 1024 == 0 && kKOffset % 1024 == 0 && kVOffset % 1024 == 0 &&
                    kKBytes % 1024 == 0 && kVBytes % 1024 == 0,
                "swizzled tiles start on 1024-byte boundaries");
  static_assert(kSmemAllocBytes <= 227 * 1024, "shared memory of one SM");
};

/// Launch choices of the Hopper prefill kernel that are not part of the plan (defaults are the
/// tuned ones; KVATTN_SM90_PINGPONG=0 and KVATTN_SM90_CTAS=<n> override them for A/B runs).
struct LaunchOptions {
  int max_ctas = 0;       ///< persistent grid size: min(items, max_ctas); the SM count by default
  bool ping_pong = true;  ///< the two consumer warpgroups take turns issuing their products
  /// Benchmarking only (KVATTN_SM90_DIAG; the output is then garbage): bit 0 skips the K/V
  /// copies (the stages are signalled full at once), bit 1 skips the softmax (P = S). Times with
  /// a part left out say where the kernel's time goes.
  int diagnostic = 0;
};
constexpr int kDiagnosticNoKvLoads = 1;
constexpr int kDiagnosticNoSoftmax = 2;

// Named barriers (0 is __syncthreads).
enum NamedBarrier : int {
  kQueryEmpty = 1,      // consumers (arrive) -> producer (sync): Q may be overwritten
  kProducerTable = 2,   // the producer warpgroup: a slot table is written
  kScheduleFirst = 3,   // ping-pong of the two consumer warpgroups: ids 3 and 4
};

}  // namespace kvattn::cuda::sm90
