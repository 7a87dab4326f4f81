// kvattn — element types and exact host conversions.
//
// Conversions from float round to nearest, ties to even. fp8 conversions
// saturate to the largest finite value (±448 for e4m3, ±57344 for e5m2), as a
// KV cache wants: an outlier is clipped, not turned into NaN or inf. NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace kvattn {

/// Element type of a tensor. The numbering follows nothing external; use the names.
enum class DType : uint8_t {
  kFloat32,
  kBFloat16,
  kFloat16,
  kFloat8E4M3,  ///< fp8, 4 exponent bits, 3 mantissa bits, no inf ("fn" variant), max 448
  kFloat8E5M2,  ///< fp8, 5 exponent bits, 2 mantissa bits, IEEE-like, max 57344
  kInt32,
  kInt64,
  kUInt8,  ///< bytes; boolean masks
};

/// Bytes per element.
constexpr int dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
    case DType::kUInt8:
      return 1;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

/// "bf16", "fp8_e4m3", ... (the names used in messages, benchmarks and results files).
const char* dtype_name(DType dtype);

/// Parses the names dtype_name() returns; throws kvattn::Error on an unknown name.
DType parse_dtype(const std::string& name);

constexpr bool is_float_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16 ||
         d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2;
}
constexpr bool is_fp8_dtype(DType d) { return d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2; }
constexpr bool is_index_dtype(DType d) { return d == DType::kInt32 || d == DType::kInt64; }

// ---- exact host conversions --------------------------------------------------------------

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// bf16 bits -> float (exact).
inline float bf16_to_float(uint16_t bits) { return bits_float(uint32_t(bits) << 16); }

/// float -> bf16 bits, round to nearest even; NaN stays a quiet NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + rounding_bias) >> 16);
}

/// IEEE half bits -> float (exact, subnormals included).
float fp16_to_float(uint16_t bits);
/// float -> IEEE half bits, round to nearest even; overflow gives inf, as IEEE does.
uint16_t float_to_fp16(float f);

/// fp8 e4m3 ("fn": no inf, 0x7f/0xff are NaN) bits -> float (exact).
float fp8_e4m3_to_float(uint8_t bits);
/// float -> fp8 e4m3 bits, round to nearest even, saturating to ±448; NaN -> 0x7f.
uint8_t float_to_fp8_e4m3(float f);

/// fp8 e5m2 bits -> float (exact; inf and NaN as IEEE).
float fp8_e5m2_to_float(uint8_t bits);
/// float -> fp8 e5m2 bits, round to nearest even, saturating to ±57344 (inf stays inf); NaN -> 0x7f.
uint8_t float_to_fp8_e5m2(float f);

/// Reads element `index` of a buffer of `dtype` as float (float types only).
float load_as_float(const void* data, DType dtype, int64_t index);
/// Writes `value` converted to `dtype` into element `index` (float types only).
void store_from_float(void* data, DType dtype, int64_t index, float value);

}  // namespace kvattn
