// The warpgroup-MMA building blocks of the Hopper kernels on their own, against float64: the
// swizzled shared-memory layout (ptx::swizzled_chunk_offset), the K-major and MN-major
// descriptors (ptx::kmajor_desc / mnmajor_desc), the accumulator layout (S = Q K^T read back
// element by element) and the register A operand (O = P V with P packed from S). A layout
// mistake shows here as a wrong element at a predictable place, apart from the pipeline.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cuda/kernels/toolkit/ptx.cuh"
#include "cuda/kernels/toolkit/wgmma.cuh"
#include "kvattn/dtype.h"
#include "kvattn/memory.h"

namespace kvattn::cuda {
namespace {

constexpr int kRows = 64;  // one warpgroup's M

// S = Q K^T (kN keys, kD dims), then O = bf16(S) V: one warpgroup, operands from global memory
// through the swizzled layout. q [64][kD], k [kN][kD], v [kN][kDv] row-major bf16; s_out
// [64][kN], o_out [64][kDv] fp32.
template <int kN, int kD, int kDv>
__global__ void __launch_bounds__(128)
    wgmma_probe_kernel(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v,
                       float* s_out, float* o_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = ptx::smem_address(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* ptr = smem_raw + (base - raw);
  constexpr int kQBytes = kRows * kD * 2, kKBytes = kN * kD * 2;
  const uint32_t sq = base, sk = base + kQBytes, sv = base + kQBytes + kKBytes;
  const int tid = threadIdx.x;
  auto stage = [&](uint32_t tile, const __nv_bfloat16* src, int rows, int cols) {
    for (int i = tid; i < rows * cols / 8; i += 128) {
      const int r = i / (cols / 8), c = i % (cols / 8);
      *reinterpret_cast<uint4*>(ptr + (tile - base) + ptx::swizzled_chunk_offset(rows, r, c)) =
          *reinterpret_cast<const uint4*>(src + r * cols + c * 8);
    }
  };
  stage(sq, q, kRows, kD);
  stage(sk, k, kN, kD);
  stage(sv, v, kN, kDv);
  ptx::fence_proxy_async_shared();
  __syncthreads();

  float s[kN / 2];
  ptx::fence_registers(s);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    ptx::wgmma_ss<__nv_bfloat16, kN>(s, ptx::kmajor_desc<kRows>(sq, kk),
                                     ptx::kmajor_desc<kN>(sk, kk), kk > 0);
  }
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  ptx::fence_registers(s);

  const int warp = tid / 32, lane = tid % 32;
  const int row0 = warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s_out[(row0 + 8 * h) * kN + 8 * j + 2 * (lane % 4) + e] = s[4 * j + 2 * h + e];
      }
    }
  }

  uint32_t pf[kN / 16][4];
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    pf[kk][0] = ptx::pack2<__nv_bfloat16>(s[8 * kk + 0], s[8 * kk + 1]);
    pf[kk][1] = ptx::pack2<__nv_bfloat16>(s[8 * kk + 2], s[8 * kk + 3]);
    pf[kk][2] = ptx::pack2<__nv_bfloat16>(s[8 * kk + 4], s[8 * kk + 5]);
    pf[kk][3] = ptx::pack2<__nv_bfloat16>(s[8 * kk + 6], s[8 * kk + 7]);
  }
  float o[kDv / 2];
#pragma unroll
  for (int i = 0; i < kDv / 2; ++i) o[i] = 0.f;
  ptx::fence_registers(o);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    ptx::wgmma_rs_trans_b<__nv_bfloat16, kDv>(o, pf[kk], ptx::mnmajor_desc<kN>(sv, kk), true);
  }
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  ptx::fence_registers(o);
#pragma unroll
  for (int j = 0; j < kDv / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        o_out[(row0 + 8 * h) * kDv + 8 * j + 2 * (lane % 4) + e] = o[4 * j + 2 * h + e];
      }
    }
  }
#else
  __trap();
#endif
}

template <int kN, int kD, int kDv>
void run_probe(uint32_t seed) {
  SCOPED_TRACE(testing::Message() << "N " << kN << " D " << kD << " Dv " << kDv);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  auto fill = [&](std::vector<uint16_t>& bits, std::vector<double>& ref, size_t n) {
    bits.resize(n);
    ref.resize(n);
    for (size_t i = 0; i < n; ++i) {
      bits[i] = float_to_bf16(uni(rng));
      ref[i] = bf16_to_float(bits[i]);
    }
  };
  std::vector<uint16_t> qb, kb, vb;
  std::vector<double> qr, kr, vr;
  fill(qb, qr, size_t(kRows) * kD);
  fill(kb, kr, size_t(kN) * kD);
  fill(vb, vr, size_t(kN) * kDv);
  void *q, *k, *v, *s, *o;
  ASSERT_EQ(cudaMalloc(&q, qb.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&k, kb.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&v, vb.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&s, size_t(kRows) * kN * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&o, size_t(kRows) * kDv * 4), cudaSuccess);
  cudaMemcpy(q, qb.data(), qb.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(k, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(v, vb.data(), vb.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(s, 0xff, size_t(kRows) * kN * 4);  // NaN: an element nothing wrote fails
  cudaMemset(o, 0xff, size_t(kRows) * kDv * 4);
  const int smem = kRows * kD * 2 + kN * kD * 2 + kN * kDv * 2 + 1024;
  auto kernel = wgmma_probe_kernel<kN, kD, kDv>;
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
            cudaSuccess);
  kernel<<<1, 128, smem>>>(
      static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k),
      static_cast<const __nv_bfloat16*>(v), static_cast<float*>(s), static_cast<float*>(o));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> sh(size_t(kRows) * kN), oh(size_t(kRows) * kDv);
  cudaMemcpy(sh.data(), s, sh.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(oh.data(), o, oh.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(s);
  cudaFree(o);

  int bad = 0;
  std::vector<double> p(size_t(kRows) * kN);
  for (int r = 0; r < kRows; ++r) {
    for (int n = 0; n < kN; ++n) {
      double ref = 0;
      for (int d = 0; d < kD; ++d) ref += qr[r * kD + d] * kr[n * kD + d];
      const double got = sh[r * kN + n];
      if (!(std::abs(got - ref) <= 1e-3 * (1 + std::abs(ref))) && bad++ < 8) {
        ADD_FAILURE() << "S[" << r << "][" << n << "] = " << got << ", expected " << ref;
      }
      // P as the kernel packs it: S rounded to bf16.
      p[r * kN + n] = bf16_to_float(float_to_bf16(sh[r * kN + n]));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kDv; ++c) {
      double ref = 0, scale = 0;
      for (int n = 0; n < kN; ++n) {
        ref += p[r * kN + n] * vr[n * kDv + c];
        scale += std::abs(p[r * kN + n] * vr[n * kDv + c]);
      }
      const double got = oh[r * kDv + c];
      if (!(std::abs(got - ref) <= 1e-4 * (1 + scale)) && bad++ < 16) {
        ADD_FAILURE() << "O[" << r << "][" << c << "] = " << got << ", expected " << ref;
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

class Sm90Wgmma : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kvattn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    if (major != 9) GTEST_SKIP() << "wgmma needs compute capability 9.0";
  }
};

// The shapes the prefill kernel issues: S with N = 128 (head_dim 64 / 128 / 192) and 64
// (head_dim 256); O with N = 64, 128, 256.
TEST_F(Sm90Wgmma, ScoresAndOutputLayouts) {
  run_probe<128, 128, 128>(1);
  run_probe<128, 64, 64>(2);
  run_probe<128, 192, 128>(3);
  run_probe<64, 256, 256>(4);
}

}  // namespace
}  // namespace kvattn::cuda
