// Independent, double-based models of kvattn's storage formats (bf16, fp16, fp8 e4m3/e5m2).
//
// Written from the format definitions, not from src/: the oracle rounds new K/V through these
// and the dtype tests check kvattn's own conversions against them. Everything is exact in
// double (every format here has at most 11 significant bits and a small exponent range).
#pragma once

#include <cstdint>

#include "kvattn/dtype.h"

namespace kvattn::testing {

/// A binary floating-point format: 1 sign bit, exponent_bits, mantissa_bits.
struct FloatFormat {
  int exponent_bits = 0;
  int mantissa_bits = 0;
  /// IEEE-like: all-ones exponent means inf (mantissa 0) or NaN. Otherwise (e4m3 "fn") only the
  /// all-ones pattern is NaN and there is no inf.
  bool ieee_specials = true;
  /// Saturating conversion: values beyond max_finite (inf included, for formats without inf)
  /// clamp to ±max_finite instead of becoming inf.
  bool saturate = false;

  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  int total_bits() const { return 1 + exponent_bits + mantissa_bits; }
  double max_finite() const;
  /// The canonical NaN pattern kvattn writes.
  uint32_t nan_bits() const;
};

/// The format of a storage / io dtype (float types other than fp32).
FloatFormat float_format_of(DType dtype);

/// Bits -> exact value (NaN and ±inf as such).
double format_decode(const FloatFormat& format, uint32_t bits);
/// Value -> bits: round to nearest, ties to even; saturation or overflow to inf per the format;
/// NaN -> nan_bits() with the sign dropped; the sign of zero is kept.
uint32_t format_encode(const FloatFormat& format, double x);
/// format_encode by scaling (frexp / ldexp / nearbyint), the definition format_encode's bit
/// arithmetic fast path is tested against.
uint32_t format_encode_by_scaling(const FloatFormat& format, double x);
/// format_decode(format_encode(x)).
double format_round(const FloatFormat& format, double x);

/// Value of element `index` of a host buffer of float `dtype` (fp32 included), exactly.
double decode_element(const void* data, DType dtype, int64_t index);
/// Writes `x` rounded to `dtype` (fp32: rounded to float) into element `index`.
void encode_element(void* data, DType dtype, int64_t index, double x);
/// `x` rounded to `dtype` (fp32: to float).
double round_to_dtype(double x, DType dtype);

/// Distance between `a` and the next representable value of `dtype` above |a| (the unit in the
/// last place at |a|); used to accept a one-ulp difference where two roundings may differ.
double ulp_of(double a, DType dtype);

}  // namespace kvattn::testing
