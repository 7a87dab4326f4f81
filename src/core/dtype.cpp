// Exact host conversions between float and the narrow float formats.
//
// One generic encoder serves fp16, fp8 e4m3 and fp8 e5m2: it scales |x| by the format's
// quantum at x's binade (a power of two, so exact in double), rounds to nearest-even with
// nearbyint (the default FE_TONEAREST mode), then packs exponent and mantissa.
#include <cfenv>
#include <cmath>

#include "kvattn/dtype.h"
#include "kvattn/error.h"

namespace kvattn {
namespace {

struct NarrowFormat {
  int exponent_bits;
  int mantissa_bits;
  double max_finite;
  bool saturate;     // clip overflow to ±max_finite (fp8) instead of producing inf (fp16)
  bool has_inf;      // e4m3 "fn" has no inf
  uint32_t nan_bits; // the NaN this encoder writes (sign added separately)
};

constexpr NarrowFormat kFp16{5, 10, 65504.0, false, true, 0x7e00u};
constexpr NarrowFormat kE4M3{4, 3, 448.0, true, false, 0x7fu};
constexpr NarrowFormat kE5M2{5, 2, 57344.0, true, true, 0x7fu};

uint32_t encode_narrow(float f, const NarrowFormat& fmt) {
  const int total_bits = 1 + fmt.exponent_bits + fmt.mantissa_bits;
  const uint32_t sign = std::signbit(f) ? (1u << (total_bits - 1)) : 0u;
  const int bias = (1 << (fmt.exponent_bits - 1)) - 1;
  const uint32_t exp_all_ones = (1u << fmt.exponent_bits) - 1;
  if (std::isnan(f)) return sign | fmt.nan_bits;
  double x = std::fabs(double(f));
  if (std::isinf(f)) {
    if (fmt.saturate && !fmt.has_inf) x = fmt.max_finite;
    else return sign | (exp_all_ones << fmt.mantissa_bits);
  }
  if (x == 0.0) return sign;

  const int min_normal_exp = 1 - bias;
  int binade;
  std::frexp(x, &binade);
  binade -= 1;  // x in [2^binade, 2^(binade+1))
  const int quantum_exp = (binade < min_normal_exp ? min_normal_exp : binade) - fmt.mantissa_bits;
  double rounded = std::nearbyint(std::ldexp(x, -quantum_exp));  // ties to even
  double value = std::ldexp(rounded, quantum_exp);

  if (value > fmt.max_finite) {
    if (fmt.saturate) value = fmt.max_finite;
    else return sign | (exp_all_ones << fmt.mantissa_bits);  // fp16 overflow -> inf
  }
  if (value == 0.0) return sign;
  if (value < std::ldexp(1.0, min_normal_exp)) {  // subnormal: exponent field 0
    const uint32_t mantissa = uint32_t(std::ldexp(value, -(min_normal_exp - fmt.mantissa_bits)));
    return sign | mantissa;
  }
  int value_binade;
  std::frexp(value, &value_binade);
  value_binade -= 1;
  const uint32_t exponent_field = uint32_t(value_binade + bias);
  const uint32_t mantissa = uint32_t(std::ldexp(value, fmt.mantissa_bits - value_binade)) -
                            (1u << fmt.mantissa_bits);
  return sign | (exponent_field << fmt.mantissa_bits) | mantissa;
}

float decode_narrow(uint32_t bits, const NarrowFormat& fmt) {
  const int total_bits = 1 + fmt.exponent_bits + fmt.mantissa_bits;
  const bool negative = (bits >> (total_bits - 1)) & 1u;
  const uint32_t exp_all_ones = (1u << fmt.exponent_bits) - 1;
  const uint32_t exponent_field = (bits >> fmt.mantissa_bits) & exp_all_ones;
  const uint32_t mantissa = bits & ((1u << fmt.mantissa_bits) - 1);
  const int bias = (1 << (fmt.exponent_bits - 1)) - 1;
  double value;
  if (fmt.has_inf && exponent_field == exp_all_ones) {
    value = mantissa == 0 ? INFINITY : NAN;
  } else if (!fmt.has_inf && exponent_field == exp_all_ones &&
             mantissa == (1u << fmt.mantissa_bits) - 1) {
    value = NAN;  // e4m3fn: only S.1111.111 is NaN
  } else if (exponent_field == 0) {
    value = std::ldexp(double(mantissa), 1 - bias - fmt.mantissa_bits);
  } else {
    value = std::ldexp(double(mantissa + (1u << fmt.mantissa_bits)),
                       int(exponent_field) - bias - fmt.mantissa_bits);
  }
  return float(negative ? -value : value);
}

}  // namespace

float fp16_to_float(uint16_t bits) { return decode_narrow(bits, kFp16); }
uint16_t float_to_fp16(float f) { return uint16_t(encode_narrow(f, kFp16)); }
float fp8_e4m3_to_float(uint8_t bits) { return decode_narrow(bits, kE4M3); }
uint8_t float_to_fp8_e4m3(float f) { return uint8_t(encode_narrow(f, kE4M3)); }
float fp8_e5m2_to_float(uint8_t bits) { return decode_narrow(bits, kE5M2); }
uint8_t float_to_fp8_e5m2(float f) { return uint8_t(encode_narrow(f, kE5M2)); }

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
    case DType::kFloat8E4M3: return "fp8_e4m3";
    case DType::kFloat8E5M2: return "fp8_e5m2";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

DType parse_dtype(const std::string& name) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
                  DType::kFloat8E5M2, DType::kInt32, DType::kInt64, DType::kUInt8}) {
    if (name == dtype_name(d)) return d;
  }
  throw_error(ErrorKind::kInvalidArgument, "dtype", "got '", name,
              "', expected one of fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, int32, int64, uint8");
}

float load_as_float(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[index];
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kFloat16: return fp16_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kFloat8E4M3: return fp8_e4m3_to_float(static_cast<const uint8_t*>(data)[index]);
    case DType::kFloat8E5M2: return fp8_e5m2_to_float(static_cast<const uint8_t*>(data)[index]);
    default: break;
  }
  throw_error(ErrorKind::kInvalidArgument, "dtype", "got ", dtype_name(dtype),
              ", expected a float type");
}

void store_from_float(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[index] = value; return;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[index] = float_to_bf16(value); return;
    case DType::kFloat16: static_cast<uint16_t*>(data)[index] = float_to_fp16(value); return;
    case DType::kFloat8E4M3: static_cast<uint8_t*>(data)[index] = float_to_fp8_e4m3(value); return;
    case DType::kFloat8E5M2: static_cast<uint8_t*>(data)[index] = float_to_fp8_e5m2(value); return;
    default: break;
  }
  throw_error(ErrorKind::kInvalidArgument, "dtype", "got ", dtype_name(dtype),
              ", expected a float type");
}

}  // namespace kvattn
