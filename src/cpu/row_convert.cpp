#include "cpu/row_convert.h"

#include <array>
#include <cstring>

#include "cpu/simd.h"
#include "kvattn/error.h"

namespace kvattn::cpu {
namespace {

std::array<float, 256> make_fp8_table(DType dtype) {
  std::array<float, 256> table{};
  for (int bits = 0; bits < 256; ++bits) {
    table[bits] = dtype == DType::kFloat8E4M3 ? fp8_e4m3_to_float(uint8_t(bits))
                                               : fp8_e5m2_to_float(uint8_t(bits));
  }
  return table;
}

// float -> bf16 for 8 lanes, round to nearest even, NaN kept quiet (as float_to_bf16 does).
__m128i narrow8_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i bits = _mm256_blendv_epi8(rounded, quiet, is_nan);
  // Every lane holds <= 0xffff, so the unsigned-saturating pack is exact; packus works per
  // 128-bit half, hence the cross-lane permute.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
  return _mm256_castsi256_si128(packed);
}

}  // namespace

const float* fp8_value_table(DType dtype) {
  static const std::array<float, 256> e4m3 = make_fp8_table(DType::kFloat8E4M3);
  static const std::array<float, 256> e5m2 = make_fp8_table(DType::kFloat8E5M2);
  if (dtype == DType::kFloat8E4M3) return e4m3.data();
  if (dtype == DType::kFloat8E5M2) return e5m2.data();
  return nullptr;
}

void load_row(const void* src /*[n]*/, DType dtype, int n, float scale, float* dst /*[n]*/) {
  const __m256 s = _mm256_set1_ps(scale);
  switch (dtype) {
    case DType::kFloat32: {
      const float* p = static_cast<const float*>(src);
      for (int i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(p + i), s));
      return;
    }
    case DType::kBFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(src);
      for (int i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(simd::load8_bf16(p + i), s));
      return;
    }
    case DType::kFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(src);
      for (int i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(simd::load8_fp16(p + i), s));
      return;
    }
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: {
      const uint8_t* p = static_cast<const uint8_t*>(src);
      const float* table = fp8_value_table(dtype);
      for (int i = 0; i < n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(simd::load8_fp8(p + i, table), s));
      }
      return;
    }
    default:
      break;
  }
  throw_error(ErrorKind::kInvalidArgument, "dtype", "got ", dtype_name(dtype),
              ", expected a float type");
}

void store_row(const float* src /*[n]*/, int n, DType dtype, void* dst /*[n]*/) {
  switch (dtype) {
    case DType::kFloat32:
      std::memcpy(dst, src, size_t(n) * sizeof(float));
      return;
    case DType::kBFloat16: {
      uint16_t* p = static_cast<uint16_t*>(dst);
      int i = 0;
      for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i), narrow8_bf16(_mm256_loadu_ps(src + i)));
      }
      for (; i < n; ++i) p[i] = float_to_bf16(src[i]);
      return;
    }
    case DType::kFloat16: {
      uint16_t* p = static_cast<uint16_t*>(dst);
      int i = 0;
      for (; i + 8 <= n; i += 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
      }
      for (; i < n; ++i) p[i] = float_to_fp16(src[i]);
      return;
    }
    case DType::kFloat8E4M3: {
      uint8_t* p = static_cast<uint8_t*>(dst);
      for (int i = 0; i < n; ++i) p[i] = float_to_fp8_e4m3(src[i]);
      return;
    }
    case DType::kFloat8E5M2: {
      uint8_t* p = static_cast<uint8_t*>(dst);
      for (int i = 0; i < n; ++i) p[i] = float_to_fp8_e5m2(src[i]);
      return;
    }
    default:
      break;
  }
  throw_error(ErrorKind::kInvalidArgument, "dtype", "got ", dtype_name(dtype),
              ", expected a float type");
}

}  // namespace kvattn::cpu
