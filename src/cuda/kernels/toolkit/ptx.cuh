// The device toolkit: the one definition of every PTX wrapper and numeric helper the kvattn
// kernels share (decode, the mma.sync prefill, the Hopper prefill, merges). Plain sm_80+
// instructions here; the sm_90a-only warpgroup instructions live in toolkit/wgmma.cuh.
//
// Shared-memory addresses are 32-bit `.shared` window addresses (smem_address()), as the PTX
// instructions take them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace kvattn::cuda::ptx {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): scores run in the exp2 domain
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): back to natural-log LSEs

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async -------------------------------------------------------------------------------

/// Copies kBytes (4, 8 or 16) from global to shared memory asynchronously; with `valid` false
/// the shared bytes become zeros and nothing is read from `src`. 16-byte copies bypass L1.
template <int kBytes>
__device__ __forceinline__ void cp_async_zfill(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  // The ignore-src predicate (not a src-size register): ptxas turned `valid ? 16 : 0` into
  // four instructions a copy (a sign-bit extract, a shift, an xor, a compare), one with this.
  const uint32_t keep = valid ? 1u : 0u;
  if constexpr (kBytes == 16) {
    asm volatile(
        "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %2, 0;\n"
        " cp.async.cg.shared.global [%0], [%1], 16, ignore;\n}\n" ::"r"(dst),
        "l"(src), "r"(keep)
        : "memory");
  } else {
    asm volatile(
        "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %3, 0;\n"
        " cp.async.ca.shared.global [%0], [%1], %2, ignore;\n}\n" ::"r"(dst),
        "l"(src), "n"(kBytes), "r"(keep)
        : "memory");
  }
}

/// A 16-byte cp.async that copies when `row` >= 0 and zero-fills otherwise, the predicate taken
/// from the row itself (one compare; a bool argument cost three instructions a copy).
__device__ __forceinline__ void cp_async16_unless_negative(uint32_t dst, const void* src,
                                                           int32_t row) {
  asm volatile(
      "{\n .reg .pred ignore;\n setp.lt.s32 ignore, %2, 0;\n"
      " cp.async.cg.shared.global [%0], [%1], 16, ignore;\n}\n" ::"r"(dst),
      "l"(src), "r"(row)
      : "memory");
}

/// base + row * pitch in one wide multiply-add (the copy address of a K/V row: a 32-bit row
/// index and pitch in bytes; written as 64-bit C++ arithmetic the compiler adds a zero high word).
__device__ __forceinline__ const char* row_address(const char* base, uint32_t row, uint32_t pitch) {
  uint64_t address;
  asm("mad.wide.u32 %0, %1, %2, %3;"
      : "=l"(address)
      : "r"(row), "r"(pitch), "l"(reinterpret_cast<uint64_t>(base)));
  return reinterpret_cast<const char*>(address);
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

/// Waits until at most kPending committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

/// Arrives on `mbarrier` once every cp.async this thread issued so far has landed. The arrival
/// counts toward the barrier's expected count (.noinc), so the barrier is initialised with one
/// arrival per producing thread.
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint32_t mbarrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(mbarrier) : "memory");
}

// ---- mbarrier (CTA scope) --------------------------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint32_t mbarrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mbarrier), "r"(arrivals)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t mbarrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(mbarrier) : "memory");
}

/// Arrives and tells the barrier to expect `bytes` more from bulk copies (TMA) of this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t mbarrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mbarrier),
               "r"(bytes)
               : "memory");
}

/// Waits until the phase of parity `parity` of `mbarrier` has completed. A fresh barrier is in
/// phase 0, so waiting on parity 1 returns at once: producers start there for "slot empty".
/// The suspend-time hint lets the hardware park the warp until the phase completes instead of
/// returning at once (a spinning warp takes issue slots from the warps that compute).
__device__ __forceinline__ void mbarrier_wait(uint32_t mbarrier, uint32_t parity) {
  constexpr uint32_t kSuspendTimeHintNs = 0x989680;  // 10 ms: as long as the hardware allows
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(mbarrier), "r"(parity), "n"(kSuspendTimeHintNs)
        : "memory");
  } while (!done);
}

// ---- bulk tensor copies (TMA, sm_90) ----------------------------------------------------------

/// Copies the box at coordinates (c0 innermost, c1, c2) of the 3-d tensor map at generic address
/// `tensor_map` (a __grid_constant__ kernel parameter) into shared memory at `dst`; the bytes
/// complete on `mbarrier` (which must expect them). Elements outside the tensor read as zeros.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tensor_map, int c0, int c1,
                                            int c2, uint32_t mbarrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(c0), "r"(c1), "r"(c2), "r"(mbarrier)
      : "memory");
}

// ---- named barriers (ids 1..15; 0 is __syncthreads) ---------------------------------------

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// Orders this thread's ordinary shared-memory writes before later async-proxy reads (wgmma,
/// bulk copies) that a barrier makes wait for them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- programmatic dependent launch -------------------------------------------------------

/// Waits until the grids this one depends on have completed (a no-op without PDL).
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

/// The global nanosecond timer (the same clock on every SM): time attribution only.
__device__ __forceinline__ uint64_t global_timer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t)::"memory");
  return t;
}

/// The SM this thread runs on (placement diagnostics only).
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

/// Lets the next grid of the stream be scheduled (its griddepcontrol.wait still waits for us).
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
}

// ---- thread-block clusters (sm_90): rank, barrier, distributed shared memory -------------------

/// This CTA's rank in its cluster (0 without a cluster launch).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

/// Every thread of every CTA of the cluster arrives and waits; shared-memory writes before it
/// (release) are seen by the cluster's reads after it (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release;\n"
      "barrier.cluster.wait.acquire;\n" ::
          : "memory");
}

/// The exit guard of a cluster that read each other's shared memory: this CTA's reads are done
/// (their values were used) and it publishes nothing, so the arrive is relaxed: no memory fence,
/// which on sm_90 would wait for every global store issued before it (MEMBAR.ALL.GPU).
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile(
      "barrier.cluster.arrive.relaxed.aligned;\n"
      "barrier.cluster.wait.aligned;\n" ::
          : "memory");
}

/// The address of this CTA's shared-memory `address` in the CTA of cluster rank `rank`.
__device__ __forceinline__ uint32_t cluster_map(uint32_t address, uint32_t rank) {
  uint32_t mapped;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(mapped) : "r"(address), "r"(rank));
  return mapped;
}

__device__ __forceinline__ float cluster_load_f32(uint32_t address) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(address) : "memory");
  return v;
}

__device__ __forceinline__ float4 cluster_load_f32x4(uint32_t address) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(address)
               : "memory");
  return v;
}

// ---- warp-level matrix instructions (mma.sync) ---------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

/// The transpose of the 8x8 16-bit matrix whose fragment the warp holds (thread: row lane / 4,
/// columns 2 (lane % 4) + {0, 1}): an MMA accumulator, packed, into an operand of the other side.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

/// d += a * b for one m16n8k16 tile, fp32 accumulate; T is __nv_bfloat16 or __half.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// Transposes a 4 x 4 matrix of words held by the four lanes of a quad (lane % 4 = q holds row
/// q in w[0..3]): afterwards lane q holds column q (w[j] = old row j's word q). Two exchange
/// rounds (xor 2 swaps the off-diagonal 2 x 2 blocks, xor 1 transposes inside them), two
/// shuffles each; every lane of the warp must call it. Used to turn an accumulator fragment
/// (a lane: 2 columns of each n8 block) into whole 16-byte pieces of a row (a lane: 8 columns).
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int lane) {
  const bool hi2 = (lane & 2) != 0;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, hi2 ? w[k] : w[k + 2], 2);
    if (hi2) {
      w[k] = got;
    } else {
      w[k + 2] = got;
    }
  }
  const bool hi1 = (lane & 1) != 0;
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const uint32_t got = __shfl_xor_sync(0xffffffffu, hi1 ? w[k] : w[k + 1], 1);
    if (hi1) {
      w[k] = got;
    } else {
      w[k + 1] = got;
    }
  }
}

/// One 16-byte global store of four words (dst 16-byte aligned); the inline store keeps it one
/// instruction whatever registers the words are in.
__device__ __forceinline__ void store_global_v4(void* dst, const uint32_t (&w)[4]) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(w[0]), "r"(w[1]),
               "r"(w[2]), "r"(w[3])
               : "memory");
}

// ---- numerics ---------------------------------------------------------------------------------

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/// Two floats -> one register of two T (lo in the low half), round to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

/// Two fp8 values (low byte first) -> two T, exactly (every e4m3 and e5m2 value is a half and a
/// bf16 value).
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to(uint16_t bits, bool e5m2) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits),
                                                   e5m2 ? __NV_E5M2 : __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack2<T>(f.x, f.y);
  }
}

/// 16 fp8 values (one 16-byte chunk, low byte first) -> 16 T in two 16-byte chunks, exactly.
template <typename T>
__device__ __forceinline__ void fp8x16_to(const uint4& bits, bool e5m2, uint4& lo, uint4& hi) {
  lo.x = fp8x2_to<T>(static_cast<uint16_t>(bits.x & 0xffffu), e5m2);
  lo.y = fp8x2_to<T>(static_cast<uint16_t>(bits.x >> 16), e5m2);
  lo.z = fp8x2_to<T>(static_cast<uint16_t>(bits.y & 0xffffu), e5m2);
  lo.w = fp8x2_to<T>(static_cast<uint16_t>(bits.y >> 16), e5m2);
  hi.x = fp8x2_to<T>(static_cast<uint16_t>(bits.z & 0xffffu), e5m2);
  hi.y = fp8x2_to<T>(static_cast<uint16_t>(bits.z >> 16), e5m2);
  hi.z = fp8x2_to<T>(static_cast<uint16_t>(bits.w & 0xffffu), e5m2);
  hi.w = fp8x2_to<T>(static_cast<uint16_t>(bits.w >> 16), e5m2);
}

}  // namespace kvattn::cuda::ptx
