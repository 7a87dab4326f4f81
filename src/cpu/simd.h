// AVX2 + FMA + F16C building blocks of the CPU kernels: 8-wide loads that widen every storage
// dtype to float, a vector exp, and horizontal sums. The build targets exactly this baseline
// (-mavx2 -mfma -mf16c, never -march=native), so the code uses no wider instructions.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvattn::cpu::simd {

/// 8 bf16 -> 8 float: a bf16 is the top half of a float, so widening is a shift.
inline __m256 load8_bf16(const uint16_t* p /*[8]*/) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

/// 8 IEEE half -> 8 float (F16C, exact).
inline __m256 load8_fp16(const uint16_t* p /*[8]*/) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

/// 8 fp8 -> 8 float through a 256-entry table of the format's values (exact).
inline __m256 load8_fp8(const uint8_t* p /*[8]*/, const float* table /*[256]*/) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(raw), 4);
}

/// Sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// Largest of the 8 lanes.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// The lane sums of eight vectors at once: lane i of the result is hsum(a_i). Three rounds of
/// hadd and one cross-lane add instead of eight separate reductions.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                    __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1);
  const __m256 t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5);
  const __m256 t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [a0 a1 a2 a3 | a0 a1 a2 a3] partial sums
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // [a4 a5 a6 a7 | a4 a5 a6 a7]
  const __m256 low = _mm256_permute2f128_ps(u0, u1, 0x20);
  const __m256 high = _mm256_permute2f128_ps(u0, u1, 0x31);
  return _mm256_add_ps(low, high);
}

/// exp(x) for 8 lanes, within 2 ulp of expf over the normal range. Lanes below about -87.3
/// (masked logits are -inf) give exactly 0, so a masked key never adds weight.
inline __m256 exp8(__m256 x) {
  const __m256 kLog2e = _mm256_set1_ps(1.44269504088896341f);
  // ln 2 split in a part exact in float and a remainder (Cody-Waite), so x - n ln 2 is exact.
  const __m256 kLn2High = _mm256_set1_ps(0.693359375f);
  const __m256 kLn2Low = _mm256_set1_ps(-2.12194440e-4f);
  // Above 88.02, n would reach 128 and 2^n overflow; the kernels only feed x <= 0 anyway.
  const __m256 kMaxInput = _mm256_set1_ps(88.02f);
  const __m256 kMinInput = _mm256_set1_ps(-87.3365478515625f);
  const __m256 underflow = _mm256_cmp_ps(x, kMinInput, _CMP_GE_OQ);  // false for -inf and NaN
  const __m256 nan_lanes = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  x = _mm256_min_ps(_mm256_max_ps(x, kMinInput), kMaxInput);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, kLog2e),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, kLn2High, x);
  r = _mm256_fnmadd_ps(n, kLn2Low, r);
  // exp(r) on [-ln2/2, ln2/2]: 1 + r + r^2 * p(r), p of degree 5 (the classic expf fit).
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  // Scale by 2^n through the exponent bits (n is in [-126, 127] after the clamp).
  const __m256i exponent =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  result = _mm256_and_ps(result, underflow);
  return _mm256_or_ps(result, _mm256_and_ps(nan_lanes, _mm256_set1_ps(__builtin_nanf(""))));
}

/// cap * tanh(x / cap) for 8 lanes (soft-cap), through exp: tanh|y| = (1 - e^-2|y|) / (1 + e^-2|y|).
/// The absolute error is about 1e-7 * cap, which is what the softmax sees.
inline __m256 soft_cap8(__m256 x, float cap) {
  const __m256 sign_mask = _mm256_set1_ps(-0.f);
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.f / cap));
  const __m256 abs_y = _mm256_andnot_ps(sign_mask, y);
  const __m256 t = exp8(_mm256_mul_ps(abs_y, _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 tanh_abs = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
  const __m256 tanh_y = _mm256_or_ps(tanh_abs, _mm256_and_ps(y, sign_mask));
  return _mm256_mul_ps(tanh_y, _mm256_set1_ps(cap));
}

}  // namespace kvattn::cpu::simd
