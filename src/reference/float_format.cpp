#include "reference/float_format.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace kvattn::testing {
namespace {

int min_normal_exponent(const FloatFormat& format) { return 1 - format.bias(); }

int max_exponent(const FloatFormat& format) {
  // IEEE-like formats keep the all-ones exponent for inf/NaN; e4m3 "fn" uses it for normals.
  const int all_ones = (1 << format.exponent_bits) - 1;
  return (format.ieee_specials ? all_ones - 1 : all_ones) - format.bias();
}

uint32_t inf_bits(const FloatFormat& format) {
  return uint32_t((1 << format.exponent_bits) - 1) << format.mantissa_bits;
}

// Bits of a non-negative value that the format represents exactly.
uint32_t magnitude_bits(const FloatFormat& format, double value) {
  if (value == 0) return 0;
  const int m = format.mantissa_bits;
  int frexp_exponent = 0;
  std::frexp(value, &frexp_exponent);
  const int exponent = frexp_exponent - 1;  // value in [2^exponent, 2^(exponent+1))
  if (exponent < min_normal_exponent(format)) {
    const double mantissa = std::ldexp(value, m - min_normal_exponent(format));
    return uint32_t(mantissa);
  }
  const double mantissa = std::ldexp(value, m - exponent) - std::ldexp(1.0, m);
  return (uint32_t(exponent + format.bias()) << m) | uint32_t(mantissa);
}

}  // namespace

double FloatFormat::max_finite() const {
  // e4m3 "fn": the all-ones mantissa of the top exponent is NaN, so the largest mantissa is one
  // step below it.
  const double top_mantissa = ieee_specials ? 2.0 - std::ldexp(1.0, -mantissa_bits)
                                            : 2.0 - std::ldexp(2.0, -mantissa_bits);
  return std::ldexp(top_mantissa, max_exponent(*this));
}

uint32_t FloatFormat::nan_bits() const {
  if (!ieee_specials) return (1u << (exponent_bits + mantissa_bits)) - 1u;
  // Quiet NaN: top mantissa bit set. e5m2 has room for 0x7e or 0x7f; kvattn writes 0x7f.
  if (mantissa_bits == 2) return (1u << (exponent_bits + mantissa_bits)) - 1u;
  return inf_bits(*this) | (1u << (mantissa_bits - 1));
}

FloatFormat float_format_of(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return {8, 7, true, false};
    case DType::kFloat16:
      return {5, 10, true, false};
    case DType::kFloat8E4M3:
      return {4, 3, false, true};
    case DType::kFloat8E5M2:
      return {5, 2, true, true};
    default:
      throw std::invalid_argument("float_format_of: not a 8/16-bit float dtype");
  }
}

double format_decode(const FloatFormat& format, uint32_t bits) {
  const int m = format.mantissa_bits;
  const int e = format.exponent_bits;
  const bool negative = (bits >> (e + m)) & 1u;
  const uint32_t exponent_field = (bits >> m) & ((1u << e) - 1u);
  const uint32_t mantissa_field = bits & ((1u << m) - 1u);
  const uint32_t all_ones = (1u << e) - 1u;
  double magnitude;
  if (format.ieee_specials && exponent_field == all_ones) {
    magnitude = mantissa_field == 0 ? std::numeric_limits<double>::infinity()
                                    : std::numeric_limits<double>::quiet_NaN();
  } else if (!format.ieee_specials && exponent_field == all_ones &&
             mantissa_field == (1u << m) - 1u) {
    magnitude = std::numeric_limits<double>::quiet_NaN();
  } else if (exponent_field == 0) {
    magnitude = std::ldexp(double(mantissa_field), min_normal_exponent(format) - m);
  } else {
    magnitude = std::ldexp(double(mantissa_field + (1u << m)),
                           int(exponent_field) - format.bias() - m);
  }
  return negative ? -magnitude : magnitude;
}

uint32_t format_encode(const FloatFormat& format, double x) {
  // A normal double whose rounded value is a normal of the format below its top binade: the
  // same round-to-nearest-even on the double's bits (worlds encode tens of millions of K/V
  // elements; the scaling path below costs a frexp, two ldexp and a nearbyint each). A value
  // just below the smallest normal that rounds up to it rounds up at the subnormal quantum
  // too (it is within half the finer quantum of it), so both paths agree there; everything
  // else (zero, subnormal results, the top binade, overflow, inf, NaN, double subnormals)
  // takes the scaling path. Both are compared on millions of values in test_dtype.cpp.
  uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  const uint64_t magnitude = bits & ~(uint64_t{1} << 63);
  const int double_exponent = int(magnitude >> 52);
  if (double_exponent != 0 && double_exponent != 0x7FF) {
    const int m = format.mantissa_bits;
    const int shift = 52 - m;
    const uint64_t lsb = (magnitude >> shift) & 1u;
    const uint64_t rounded = (magnitude + ((uint64_t{1} << (shift - 1)) - 1) + lsb) >> shift;
    const int exponent_field = int(rounded >> m) - 1023 + format.bias();
    if (exponent_field >= 1 && exponent_field < (1 << format.exponent_bits) - 1) {
      const uint32_t sign = (bits >> 63) != 0 ? 1u << (format.exponent_bits + m) : 0u;
      return sign | (uint32_t(exponent_field) << m) | uint32_t(rounded & ((uint64_t{1} << m) - 1));
    }
  }
  return format_encode_by_scaling(format, x);
}

uint32_t format_encode_by_scaling(const FloatFormat& format, double x) {
  if (std::isnan(x)) return format.nan_bits();
  const uint32_t sign = std::signbit(x) ? 1u << (format.exponent_bits + format.mantissa_bits) : 0u;
  const double magnitude = std::fabs(x);
  const double max_value = format.max_finite();
  if (std::isinf(magnitude)) {
    if (format.ieee_specials) return sign | inf_bits(format);
    return format.saturate ? sign | magnitude_bits(format, max_value) : format.nan_bits();
  }
  if (magnitude == 0) return sign;
  int frexp_exponent = 0;
  std::frexp(magnitude, &frexp_exponent);
  const int exponent = std::max(frexp_exponent - 1, min_normal_exponent(format));
  const double quantum = std::ldexp(1.0, exponent - format.mantissa_bits);
  // nearbyint under the default rounding mode rounds ties to even; magnitude / quantum is exact.
  const double rounded = std::nearbyint(magnitude / quantum) * quantum;
  if (rounded > max_value) {
    if (format.saturate) return sign | magnitude_bits(format, max_value);
    return format.ieee_specials ? sign | inf_bits(format) : format.nan_bits();
  }
  return sign | magnitude_bits(format, rounded);
}

double format_round(const FloatFormat& format, double x) {
  return format_decode(format, format_encode(format, x));
}

namespace {

// format_decode of every bit pattern of a 8/16-bit dtype, computed once: worlds decode
// millions of elements.
const std::vector<double>& decode_table(DType dtype) {
  auto make = [](DType d) {
    const FloatFormat format = float_format_of(d);
    std::vector<double> table(size_t(1) << format.total_bits());
    for (uint32_t bits = 0; bits < table.size(); ++bits) table[bits] = format_decode(format, bits);
    return table;
  };
  static const std::vector<double> bf16 = make(DType::kBFloat16);
  static const std::vector<double> fp16 = make(DType::kFloat16);
  static const std::vector<double> e4m3 = make(DType::kFloat8E4M3);
  static const std::vector<double> e5m2 = make(DType::kFloat8E5M2);
  switch (dtype) {
    case DType::kBFloat16: return bf16;
    case DType::kFloat16: return fp16;
    case DType::kFloat8E4M3: return e4m3;
    case DType::kFloat8E5M2: return e5m2;
    default: throw std::invalid_argument("decode_table: not a 8/16-bit float dtype");
  }
}

}  // namespace

double decode_element(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, static_cast<const char*>(data) + index * 4, 4);
      return f;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      uint16_t bits;
      std::memcpy(&bits, static_cast<const char*>(data) + index * 2, 2);
      return decode_table(dtype)[bits];
    }
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return decode_table(dtype)[static_cast<const uint8_t*>(data)[index]];
    default:
      throw std::invalid_argument("decode_element: not a float dtype");
  }
}

void encode_element(void* data, DType dtype, int64_t index, double x) {
  switch (dtype) {
    case DType::kFloat32: {
      const float f = float(x);
      std::memcpy(static_cast<char*>(data) + index * 4, &f, 4);
      return;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      const uint16_t bits = uint16_t(format_encode(float_format_of(dtype), x));
      std::memcpy(static_cast<char*>(data) + index * 2, &bits, 2);
      return;
    }
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      static_cast<uint8_t*>(data)[index] = uint8_t(format_encode(float_format_of(dtype), x));
      return;
    default:
      throw std::invalid_argument("encode_element: not a float dtype");
  }
}

double round_to_dtype(double x, DType dtype) {
  if (dtype == DType::kFloat32) return double(float(x));
  return format_round(float_format_of(dtype), x);
}

double ulp_of(double a, DType dtype) {
  int mantissa_bits = 23;
  int min_exponent = -126;
  if (dtype != DType::kFloat32) {
    const FloatFormat format = float_format_of(dtype);
    mantissa_bits = format.mantissa_bits;
    min_exponent = min_normal_exponent(format);
  }
  int frexp_exponent = 0;
  std::frexp(std::fabs(a), &frexp_exponent);
  const int exponent = a == 0 ? min_exponent : std::max(frexp_exponent - 1, min_exponent);
  return std::ldexp(1.0, exponent - mantissa_bits);
}

}  // namespace kvattn::testing
