// Warpgroup matrix instructions of Hopper (sm_90a): shared-memory matrix descriptors, the
// wgmma fence / commit / wait protocol, register reallocation between warpgroups. Every
// instruction here is executed by all 128 threads of a warpgroup (4 consecutive warps whose
// first warp index is a multiple of 4); fewer is an illegal instruction.
//
// Shared-memory operand layout used by the kvattn kernels (the "128-byte swizzle" canonical
// layout of the PTX ISA): a tile of R rows x C 16-bit columns is stored as C / 64 column blocks
// ("sub-tiles"), each R rows of 128 bytes; the 16-byte chunk c of row r sits at chunk position
// c ^ (r % 8) of its row. Sub-tiles start on 1024-byte boundaries. The same bytes serve as a
// K-major operand (rows = M or N, the contraction along a row: Q and K) and as an MN-major one
// (rows = the contraction index, N along a row: V in O += P V).
#pragma once

#include <cstdint>

#include "cuda/kernels/toolkit/wgmma_ops.cuh"

namespace kvattn::cuda::ptx {

constexpr int kSwizzleRowBytes = 128;                    // one row of a sub-tile
constexpr int kSwizzleAtomBytes = 8 * kSwizzleRowBytes;  // 8 rows: the swizzle's period
constexpr int kSubTileColumns = kSwizzleRowBytes / 2;    // 16-bit columns in a sub-tile

/// Byte offset of 16-byte chunk `chunk` (of a row of 16-bit values, any width) of row `row` in a
/// tile of `rows` rows stored as swizzled sub-tiles.
__host__ __device__ constexpr uint32_t swizzled_chunk_offset(int rows, int row, int chunk) {
  return uint32_t(chunk / 8) * uint32_t(rows) * kSwizzleRowBytes +
         uint32_t(row) * kSwizzleRowBytes + uint32_t((chunk % 8) ^ (row % 8)) * 16;
}

/// A wgmma shared-memory matrix descriptor for the 128-byte swizzle. kLeadingBytes (LBO) and
/// kStrideBytes (SBO) as the PTX ISA defines them:
///  - K-major (Q, K): SBO = 1024, the step between groups of 8 rows; LBO unused (16).
///  - MN-major (V): LBO = the step between 64-column sub-tiles (rows x 128 bytes), SBO = 1024,
///    the step between groups of 8 rows of the contraction index.
/// The start address must keep the atom's 1024-byte alignment except for the 32-byte steps along
/// a K-major row (k16 blocks inside a sub-tile), which the hardware swizzles like the data. The
/// high word is a constant, the low word one shift and OR of the address.
template <uint32_t kLeadingBytes, uint32_t kStrideBytes>
__device__ __forceinline__ uint64_t make_smem_desc(uint32_t start) {
  static_assert(kLeadingBytes % 16 == 0 && kLeadingBytes < (16u << 14), "LBO field");
  static_assert(kStrideBytes % 16 == 0 && kStrideBytes < (16u << 14), "SBO field");
  constexpr uint32_t kHigh = (kStrideBytes >> 4) | (1u << 30);  // layout type 1: 128B swizzle
  const uint32_t low = ((start & 0x3ffff) >> 4) | ((kLeadingBytes >> 4) << 16);
  return (uint64_t(kHigh) << 32) | low;
}

/// A descriptor that moves by constant steps: the low word holds the start address (>> 4)
/// and LBO, the high word SBO and the layout; a step adds to the low word only (a shared-memory
/// start address never carries out of its 14 bits). One integer add per wgmma operand.
struct SmemDescriptor {
  uint32_t lo = 0;
  uint32_t hi = 0;
  __device__ __forceinline__ uint64_t at(uint32_t byte_offset) const {
    return (uint64_t(hi) << 32) | uint64_t(lo + (byte_offset >> 4));
  }
  __device__ __forceinline__ SmemDescriptor plus(uint32_t byte_offset) const {
    return {lo + (byte_offset >> 4), hi};
  }
};

template <uint32_t kLeadingBytes, uint32_t kStrideBytes>
__device__ __forceinline__ SmemDescriptor smem_descriptor(uint32_t start) {
  const uint64_t d = make_smem_desc<kLeadingBytes, kStrideBytes>(start);
  return {uint32_t(d), uint32_t(d >> 32)};
}

/// Byte step of k16 block `kk` in a K-major swizzled tile of kRows rows.
template <int kRows>
__host__ __device__ constexpr uint32_t kmajor_step(int kk) {
  return uint32_t((kk / 4) * kRows * kSwizzleRowBytes + (kk % 4) * 32);
}
/// Byte step of k16 block `kk` in an MN-major swizzled tile.
__host__ __device__ constexpr uint32_t mnmajor_step(int kk) {
  return uint32_t(kk * 16 * kSwizzleRowBytes);
}

/// Descriptor of k16 block `kk` of a K-major swizzled tile of kRows rows (Q, K: rows are M or
/// N, the contraction runs along a row), starting at row `first_row` (a multiple of 8).
template <int kRows>
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile, int kk, int first_row = 0) {
  return make_smem_desc<16, kSwizzleAtomBytes>(tile + (kk / 4) * kRows * kSwizzleRowBytes +
                                               first_row * kSwizzleRowBytes + (kk % 4) * 32);
}

/// Descriptor of k16 block `kk` (contraction rows 16 kk .. 16 kk + 15) of an MN-major swizzled
/// tile of kRows contraction rows (V: rows are keys, N runs along a row, 64 per sub-tile).
template <int kRows>
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile, int kk) {
  return make_smem_desc<kRows * kSwizzleRowBytes, kSwizzleAtomBytes>(tile +
                                                                     kk * 16 * kSwizzleRowBytes);
}

/// Orders register writes (accumulators, A fragments) before the wgmma that read them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/// Waits until at most kPending committed wgmma groups of the warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

/// Keeps the compiler from moving reads or writes of accumulator registers across the
/// asynchronous wgmma (which reads and writes them behind the compiler's back).
template <int N>
__device__ __forceinline__ void fence_registers(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

/// Pins register work ahead of a later wgmma_wait_group: ptxas otherwise hoists the wait's
/// WARPGROUP.DEPBAR above independent arithmetic (seen on nvcc 13.0: the whole online softmax of
/// the Hopper prefill ran after the wait, so it no longer overlapped the P V product). A store
/// of a value that depends on that work, to the thread's own scratch word in shared memory, is
/// a memory operation ptxas keeps before the wait. Costs one STS a call.
__device__ __forceinline__ void pin_before_wgmma_wait(uint32_t scratch_word, float value) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scratch_word), "f"(value) : "memory");
}

/// Gives registers back (producer warpgroups) or takes them (consumers); the kernel must have a
/// register cap at entry (__launch_bounds__ with min blocks 1) for the compiler to honour it.
template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void warpgroup_registers_take() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

/// One m64nNk16 product, A and B from shared memory: d (+)= A B.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                         bool accumulate) {
  WgmmaSs<T, N>::issue(d, desc_a, desc_b, accumulate);
}

/// One m64nNk16 product, A from registers, B MN-major from shared memory: d (+)= A B.
template <typename T, int N>
__device__ __forceinline__ void wgmma_rs_trans_b(float (&d)[N / 2], const uint32_t (&a)[4],
                                                 uint64_t desc_b, bool accumulate) {
  WgmmaRs<T, N, true>::issue(d, a, desc_b, accumulate);
}

}  // namespace kvattn::cuda::ptx
