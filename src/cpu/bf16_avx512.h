// AVX-512 BF16 kernels of the CPU attention (scores and P . V of decode, verify and prefill
// tiles when q and K/V are bf16), picked at run time on CPUs that have them (Intel Cooper Lake
// and Sapphire Rapids onward, AMD Zen 4 onward). The library's baseline stays AVX2 + FMA: these
// functions are compiled for the wider ISA through function attributes only, and nothing calls them
// unless bf16_available().
//
// Decode and verify tiles (few rows) score with vdpbf16ps on bf16 q and K as the pool stores
// them (products of bf16 pairs are exact in fp32; q is used as given, so the scores carry no
// rounding that the AVX2 path does not). Prefill tiles score with keys in 16 lanes (the block's
// keys transposed in fp32, no horizontal sums). P . V is 16-lane fp32 FMAs on the widened values.
#pragma once

#include <cstdint>

namespace kvattn::cpu::avx512 {

/// True when the CPU (and the OS) support AVX-512 F/BW/VL/DQ and BF16, and the environment
/// variable KVATTN_CPU_ISA is not "avx2" (which keeps the baseline kernels, e.g. to compare).
bool bf16_available();

/// s[r * ld + j] = scale * (q[r] . k_j) for r < rows, j < nk, with key j's bf16 row at
/// keys[j] + head_offset bytes. q: [rows, dim] bf16 in natural order. rows % 4 == 0,
/// dim % 32 == 0, 1 <= nk <= 4.
void scores_bf16(const uint16_t* q, int rows, const char* const* keys, int64_t head_offset, int nk,
                 int dim, float scale, float* s, int ld);

/// s[r * ld + j] = q[r] . k_j for r < rows, j < nk (<= kt_stride), keys in 16 lanes: kt is the
/// keys transposed, [dim, kt_stride] fp32 (key j of dim d at kt[d * kt_stride + j]), zero up to
/// the next multiple of 16 keys; q: [rows, dim] fp32, already scaled. Columns up to that multiple
/// of 16 are written too. No horizontal sums: 4 rows x 3 key vectors of accumulators.
void scores_keys_in_lanes(const float* q, int rows, const float* kt, int kt_stride, int nk,
                          int dim, float* s, int ld);

/// o[r] += sum_j p[r * ld + j] * v_j for r < rows, j < nk (nk <= 64), with value j's bf16 row
/// at values[j] + head_offset bytes. o: [rows, dv] fp32 in the AVX2 direct path's pair order (per
/// 16 dims: the 8 even elements, then the 8 odd ones). rows % 4 == 0, dv % 32 == 0.
void accumulate_pv_bf16(const float* p, int ld, int rows, const char* const* values,
                        int64_t head_offset, int nk, int dv, float* o);

}  // namespace kvattn::cpu::avx512
