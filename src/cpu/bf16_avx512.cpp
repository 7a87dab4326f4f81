#include "cpu/bf16_avx512.h"

#include <immintrin.h>

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() (a self-initialized local), which
// -Wuninitialized reports at every inlined use; the values are never read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <cstdlib>
#include <cstring>

// Only functions with this attribute use AVX-512; the file is compiled with the library's AVX2
// flags like the rest, so no inline function or template it shares with other files can come
// out in AVX-512 code. No std containers or algorithms here for the same reason.
#define KVATTN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace kvattn::cpu::avx512 {
namespace {

constexpr int kMaxKeys = 64;  // the direct path's block

bool detect() {
  const char* isa = std::getenv("KVATTN_CPU_ISA");
  if (isa != nullptr && std::strcmp(isa, "avx2") == 0) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// The 16 lanes of a folded to 8 (lane i + lane i + 8).
KVATTN_AVX512 inline __m256 fold(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

// Lane i of the result is the sum of the lanes of a_i.
KVATTN_AVX512 inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                                 __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1);
  const __m256 t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5);
  const __m256 t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

KVATTN_AVX512 inline __m512bh load_bf16x32(const void* p) {
  return (__m512bh)_mm512_loadu_si512(p);
}

// Rows r..r+3 x keys k0..k3: 16 accumulators, each dot product 32 dims per instruction.
KVATTN_AVX512 void dot_4x4(const uint16_t* q, int dim, const char* const* k, float scale, float* s,
                           int ld) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int i = 0; i < dim; i += 32) {
    __m512bh kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = load_bf16x32(k[c] + 2 * int64_t(i));
    for (int r = 0; r < 4; ++r) {
      const __m512bh qv = load_bf16x32(q + int64_t(r) * dim + i);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, kv[c]);
    }
  }
  const __m256 f = _mm256_set1_ps(scale);
  const __m256 rows01 =
      _mm256_mul_ps(f, sum8(fold(acc[0][0]), fold(acc[0][1]), fold(acc[0][2]), fold(acc[0][3]),
                            fold(acc[1][0]), fold(acc[1][1]), fold(acc[1][2]), fold(acc[1][3])));
  const __m256 rows23 =
      _mm256_mul_ps(f, sum8(fold(acc[2][0]), fold(acc[2][1]), fold(acc[2][2]), fold(acc[2][3]),
                            fold(acc[3][0]), fold(acc[3][1]), fold(acc[3][2]), fold(acc[3][3])));
  _mm_storeu_ps(s, _mm256_castps256_ps128(rows01));
  _mm_storeu_ps(s + ld, _mm256_extractf128_ps(rows01, 1));
  _mm_storeu_ps(s + 2 * ld, _mm256_castps256_ps128(rows23));
  _mm_storeu_ps(s + 3 * ld, _mm256_extractf128_ps(rows23, 1));
}

// Rows r..r+3 x one key.
KVATTN_AVX512 void dot_4x1(const uint16_t* q, int dim, const char* k, float scale, float* s,
                           int ld) {
  __m512 acc[4];
  for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
  for (int i = 0; i < dim; i += 32) {
    const __m512bh kv = load_bf16x32(k + 2 * int64_t(i));
    for (int r = 0; r < 4; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], load_bf16x32(q + int64_t(r) * dim + i), kv);
    }
  }
  const __m256 zero = _mm256_setzero_ps();
  alignas(32) float sums[8];
  _mm256_store_ps(
      sums, _mm256_mul_ps(_mm256_set1_ps(scale), sum8(fold(acc[0]), fold(acc[1]), fold(acc[2]),
                                                      fold(acc[3]), zero, zero, zero, zero)));
  for (int r = 0; r < 4; ++r) s[r * ld] = sums[r];
}

// One query row's step: a_g += b * k_g for the kGroups key vectors.
template <int kGroups>
KVATTN_AVX512 inline void kt_row(__m512 b, __m512 k0, __m512 k1, __m512 k2, __m512& a0,
                                 __m512& a1, __m512& a2) {
  a0 = _mm512_fmadd_ps(b, k0, a0);
  if (kGroups > 1) a1 = _mm512_fmadd_ps(b, k1, a1);
  if (kGroups > 2) a2 = _mm512_fmadd_ps(b, k2, a2);
}

// Rows r..r+kRows-1 x kGroups vectors of 16 keys. Named accumulators (GCC keeps an array of them
// on the stack).
template <int kRows, int kGroups>
KVATTN_AVX512 void kt_block(const float* q, int dim, const float* kt, int kt_stride, float* s,
                            int ld) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 a00 = zero, a01 = zero, a02 = zero, a10 = zero, a11 = zero, a12 = zero;
  __m512 a20 = zero, a21 = zero, a22 = zero, a30 = zero, a31 = zero, a32 = zero;
  const float* q0 = q;
  const float* q1 = q + (kRows > 1 ? dim : 0);
  const float* q2 = q + (kRows > 2 ? 2 * dim : 0);
  const float* q3 = q + (kRows > 3 ? 3 * dim : 0);
  for (int d = 0; d < dim; ++d) {
    const float* kd = kt + int64_t(d) * kt_stride;
    const __m512 k0 = _mm512_loadu_ps(kd);
    const __m512 k1 = kGroups > 1 ? _mm512_loadu_ps(kd + 16) : zero;
    const __m512 k2 = kGroups > 2 ? _mm512_loadu_ps(kd + 32) : zero;
    kt_row<kGroups>(_mm512_set1_ps(q0[d]), k0, k1, k2, a00, a01, a02);
    if (kRows > 1) kt_row<kGroups>(_mm512_set1_ps(q1[d]), k0, k1, k2, a10, a11, a12);
    if (kRows > 2) kt_row<kGroups>(_mm512_set1_ps(q2[d]), k0, k1, k2, a20, a21, a22);
    if (kRows > 3) kt_row<kGroups>(_mm512_set1_ps(q3[d]), k0, k1, k2, a30, a31, a32);
  }
  const __m512 rows[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) _mm512_storeu_ps(s + int64_t(r) * ld + 16 * g, rows[r][g]);
  }
}

template <int kRows>
KVATTN_AVX512 void kt_rows(int groups, const float* q, int dim, const float* kt, int kt_stride,
                           float* s, int ld) {
  if (groups == 1) {
    kt_block<kRows, 1>(q, dim, kt, kt_stride, s, ld);
  } else if (groups == 2) {
    kt_block<kRows, 2>(q, dim, kt, kt_stride, s, ld);
  } else {
    kt_block<kRows, 3>(q, dim, kt, kt_stride, s, ld);
  }
}

}  // namespace

KVATTN_AVX512 void scores_keys_in_lanes(const float* q, int rows, const float* kt,
                                        int kt_stride, int nk, int dim, float* s, int ld) {
  const int groups = (nk + 15) / 16;  // <= 3
  for (int r = 0; r < rows; r += 4) {
    const float* qr = q + int64_t(r) * dim;
    float* sr = s + int64_t(r) * ld;
    const int n = rows - r < 4 ? rows - r : 4;
    if (n == 1) {
      kt_rows<1>(groups, qr, dim, kt, kt_stride, sr, ld);
    } else if (n == 2) {
      kt_rows<2>(groups, qr, dim, kt, kt_stride, sr, ld);
    } else if (n == 3) {
      kt_rows<3>(groups, qr, dim, kt, kt_stride, sr, ld);
    } else {
      kt_rows<4>(groups, qr, dim, kt, kt_stride, sr, ld);
    }
  }
}

bool bf16_available() {
  static const bool available = detect();
  return available;
}

KVATTN_AVX512 void scores_bf16(const uint16_t* q, int rows, const char* const* keys,
                               int64_t head_offset, int nk, int dim, float scale, float* s,
                               int ld) {
  for (int r = 0; r < rows; r += 4) {
    const uint16_t* qr = q + int64_t(r) * dim;
    float* sr = s + int64_t(r) * ld;
    if (nk == 4) {
      const char* k[4] = {keys[0] + head_offset, keys[1] + head_offset, keys[2] + head_offset,
                          keys[3] + head_offset};
      dot_4x4(qr, dim, k, scale, sr, ld);
      continue;
    }
    for (int j = 0; j < nk; ++j) dot_4x1(qr, dim, keys[j] + head_offset, scale, sr + j, ld);
  }
}

KVATTN_AVX512 void accumulate_pv_bf16(const float* p, int ld, int rows, const char* const* values,
                                      int64_t head_offset, int nk, int dv, float* o) {
  const char* v[kMaxKeys];
  if (nk > kMaxKeys) nk = kMaxKeys;  // callers pass at most a block
  for (int j = 0; j < nk; ++j) v[j] = values[j] + head_offset;
  const __m512i odd_mask = _mm512_set1_epi32(int(0xffff0000u));
  for (int r = 0; r < rows; r += 4) {
    const float* pr = p + int64_t(r) * ld;
    for (int c = 0; c < dv; c += 32) {
      // o holds 32 dims as [even 0-14 | odd 1-15 | even 16-30 | odd 17-31] (8 floats each);
      // in registers: the 16 even elements in one vector, the 16 odd ones in another.
      __m512 even[4], odd[4];
      for (int rr = 0; rr < 4; ++rr) {
        const float* orow = o + int64_t(r + rr) * dv + c;
        const __m512 lo = _mm512_loadu_ps(orow);
        const __m512 hi = _mm512_loadu_ps(orow + 16);
        even[rr] = _mm512_shuffle_f32x4(lo, hi, 0x44);
        odd[rr] = _mm512_shuffle_f32x4(lo, hi, 0xEE);
      }
      for (int j = 0; j < nk; ++j) {
        const __m512i raw = _mm512_loadu_si512(v[j] + 2 * int64_t(c));
        const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(raw, odd_mask));
        for (int rr = 0; rr < 4; ++rr) {
          const __m512 w = _mm512_set1_ps(pr[rr * ld + j]);
          even[rr] = _mm512_fmadd_ps(w, ve, even[rr]);
          odd[rr] = _mm512_fmadd_ps(w, vo, odd[rr]);
        }
      }
      for (int rr = 0; rr < 4; ++rr) {
        float* orow = o + int64_t(r + rr) * dv + c;
        _mm512_storeu_ps(orow, _mm512_shuffle_f32x4(even[rr], odd[rr], 0x44));
        _mm512_storeu_ps(orow + 16, _mm512_shuffle_f32x4(even[rr], odd[rr], 0xEE));
      }
    }
  }
}

}  // namespace kvattn::cpu::avx512
