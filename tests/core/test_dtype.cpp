// kvattn's host dtype conversions against the independent double-based model of
// src/reference/float_format: every bit pattern decoded; encodes checked on every
// representable value, every exact tie between neighbours and the floats next to it, random
// floats of every magnitude, subnormals, saturation, inf and NaN.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvattn/dtype.h"
#include "kvattn/error.h"
#include "reference/float_format.h"

namespace kvattn::testing {
namespace {

struct Narrow {
  DType dtype;
  int bits;
  float (*decode)(uint32_t);
  uint32_t (*encode)(float);
};

const Narrow kNarrow[] = {
    {DType::kBFloat16, 16, [](uint32_t b) { return bf16_to_float(uint16_t(b)); },
     [](float f) { return uint32_t(float_to_bf16(f)); }},
    {DType::kFloat16, 16, [](uint32_t b) { return fp16_to_float(uint16_t(b)); },
     [](float f) { return uint32_t(float_to_fp16(f)); }},
    {DType::kFloat8E4M3, 8, [](uint32_t b) { return fp8_e4m3_to_float(uint8_t(b)); },
     [](float f) { return uint32_t(float_to_fp8_e4m3(f)); }},
    {DType::kFloat8E5M2, 8, [](uint32_t b) { return fp8_e5m2_to_float(uint8_t(b)); },
     [](float f) { return uint32_t(float_to_fp8_e5m2(f)); }},
};

// Compares kvattn's encoding of `f` with the model's; NaN only needs to stay NaN.
void expect_encode_matches(const Narrow& n, float f) {
  const FloatFormat format = float_format_of(n.dtype);
  const uint32_t got = n.encode(f);
  const uint32_t want = format_encode(format, double(f));
  if (std::isnan(f)) {
    EXPECT_TRUE(std::isnan(format_decode(format, got)))
        << dtype_name(n.dtype) << ": NaN encoded as 0x" << std::hex << got;
    return;
  }
  ASSERT_EQ(got, want) << dtype_name(n.dtype) << ": encode(" << std::hexfloat << f << " = "
                       << std::defaultfloat << f << ") = 0x" << std::hex << got
                       << ", expected 0x" << want;
}

TEST(DType, DecodeEveryBitPattern) {
  for (const Narrow& n : kNarrow) {
    const FloatFormat format = float_format_of(n.dtype);
    for (uint32_t bits = 0; bits < (1u << n.bits); ++bits) {
      const double want = format_decode(format, bits);
      const float got = n.decode(bits);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << dtype_name(n.dtype) << " 0x" << std::hex << bits;
      } else {
        ASSERT_EQ(double(got), want) << dtype_name(n.dtype) << " 0x" << std::hex << bits;
        ASSERT_EQ(std::signbit(got), std::signbit(want)) << dtype_name(n.dtype) << " 0x"
                                                         << std::hex << bits;
      }
    }
  }
}

TEST(DType, ModelSanity) {
  // Fixed points of the formats, so the model itself is not taken on faith.
  EXPECT_EQ(float_format_of(DType::kFloat8E4M3).max_finite(), 448.0);
  EXPECT_EQ(float_format_of(DType::kFloat8E5M2).max_finite(), 57344.0);
  EXPECT_EQ(float_format_of(DType::kFloat16).max_finite(), 65504.0);
  EXPECT_EQ(float_format_of(DType::kBFloat16).max_finite(), 0x1.fep127);
  EXPECT_EQ(format_decode(float_format_of(DType::kFloat8E4M3), 0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(format_decode(float_format_of(DType::kFloat8E5M2), 0x01), std::ldexp(1.0, -16));
  EXPECT_EQ(format_decode(float_format_of(DType::kFloat16), 0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(format_decode(float_format_of(DType::kFloat16), 0x3c00), 1.0);
  EXPECT_EQ(format_decode(float_format_of(DType::kBFloat16), 0x3f80), 1.0);
  EXPECT_TRUE(std::isnan(format_decode(float_format_of(DType::kFloat8E4M3), 0x7f)));
  EXPECT_EQ(format_decode(float_format_of(DType::kFloat8E4M3), 0x7e), 448.0);
  EXPECT_TRUE(std::isinf(format_decode(float_format_of(DType::kFloat8E5M2), 0x7c)));
}

TEST(DType, EncodeEveryValueAndEveryTie) {
  for (const Narrow& n : kNarrow) {
    const FloatFormat format = float_format_of(n.dtype);
    const uint32_t sign_bit = 1u << (n.bits - 1);
    // Positive finite patterns in increasing order of value.
    std::vector<double> values;
    for (uint32_t bits = 0; bits < sign_bit; ++bits) {
      const double v = format_decode(format, bits);
      if (std::isfinite(v)) values.push_back(v);
    }
    for (size_t i = 0; i < values.size(); ++i) {
      for (double s : {1.0, -1.0}) {
        const float exact = float(s * values[i]);
        expect_encode_matches(n, exact);
        if (i + 1 == values.size()) continue;
        // The exact midpoint (a tie: goes to the even neighbour) and the floats on each side.
        const float mid = float(s * (values[i] + values[i + 1]) / 2);
        ASSERT_EQ(double(mid), s * (values[i] + values[i + 1]) / 2) << "midpoint not a float";
        expect_encode_matches(n, mid);
        expect_encode_matches(n, std::nextafter(mid, 0.f));
        expect_encode_matches(n, std::nextafter(mid, s * INFINITY));
      }
    }
    // Beyond the largest value: saturation (fp8) or inf (bf16 / fp16).
    const double top = format.max_finite();
    for (double x : {top * 1.01, top * 1.5, top * 4, 1e30, double(FLT_MAX)}) {
      if (x > FLT_MAX) continue;
      expect_encode_matches(n, float(x));
      expect_encode_matches(n, float(-x));
    }
  }
}

TEST(DType, EncodeSpecials) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const Narrow& n : kNarrow) {
    for (float f : {0.f, -0.f, inf, -inf, nan, -nan, std::numeric_limits<float>::denorm_min(),
                    -std::numeric_limits<float>::denorm_min(), FLT_MIN, -FLT_MIN, FLT_MAX,
                    -FLT_MAX}) {
      expect_encode_matches(n, f);
    }
  }
  // The documented saturation points.
  EXPECT_EQ(float_to_fp8_e4m3(1000.f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-inf), 0xfe);
  EXPECT_EQ(float_to_fp8_e5m2(1e6f), 0x7b);
  EXPECT_EQ(float_to_fp8_e5m2(inf), 0x7c);
  EXPECT_EQ(float_to_fp16(65520.f), 0x7c00);  // the tie above 65504 rounds to inf (IEEE)
  EXPECT_EQ(float_to_fp16(65519.f), 0x7bff);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(float_to_fp8_e4m3(nan))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(nan))));
}

TEST(DType, EncodeRandomFloatsOfEveryMagnitude) {
  std::mt19937 rng(12345);
  for (const Narrow& n : kNarrow) {
    for (int i = 0; i < 400000; ++i) {
      // Random bit patterns cover every exponent, subnormals and NaN payloads included.
      const float f = bits_float(uint32_t(rng()));
      expect_encode_matches(n, f);
      // And values near the format's range, where its own subnormals and rounding live.
      const float g = float(std::ldexp(std::uniform_real_distribution<double>(-2, 2)(rng),
                                       std::uniform_int_distribution<int>(-26, 17)(rng)));
      expect_encode_matches(n, g);
    }
  }
}

// format_encode's bit-arithmetic fast path against its definition (format_encode_by_scaling) on
// doubles: random bit patterns, values of every magnitude around each format's range (its
// subnormals, the smallest normal, the top binade, overflow), exact ties and their neighbours.
TEST(DType, EncodeFastPathMatchesScaling) {
  std::mt19937_64 rng(2026);
  auto expect_same = [](const FloatFormat& format, DType dtype, double x) {
    const uint32_t got = format_encode(format, x);
    const uint32_t want = format_encode_by_scaling(format, x);
    ASSERT_EQ(got, want) << dtype_name(dtype) << ": encode(" << std::hexfloat << x << ") = 0x"
                         << std::hex << got << ", by scaling 0x" << want;
  };
  for (const Narrow& n : kNarrow) {
    const FloatFormat format = float_format_of(n.dtype);
    const int min_exp = 1 - format.bias() - format.mantissa_bits - 3;
    const int max_exp = format.bias() + 3;
    for (int i = 0; i < 300000; ++i) {
      double x = 0;
      const uint64_t b = rng();
      std::memcpy(&x, &b, sizeof x);
      expect_same(format, n.dtype, x);
      const double mantissa = std::uniform_real_distribution<double>(-2, 2)(rng);
      const int exponent = std::uniform_int_distribution<int>(min_exp, max_exp)(rng);
      expect_same(format, n.dtype, std::ldexp(mantissa, exponent));
    }
    // Every tie between neighbours of the format (as doubles: exact), and one double ulp to
    // each side, both signs.
    const uint32_t sign_bit = 1u << (n.bits - 1);
    for (uint32_t bits = 0; bits + 1 < sign_bit; ++bits) {
      const double a = format_decode(format, bits);
      const double b = format_decode(format, bits + 1);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      const double mid = (a + b) / 2;
      for (double s : {1.0, -1.0}) {
        for (double x : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, INFINITY), a}) {
          expect_same(format, n.dtype, s * x);
        }
      }
    }
  }
}

TEST(DType, RoundTripEveryPattern) {
  for (const Narrow& n : kNarrow) {
    for (uint32_t bits = 0; bits < (1u << n.bits); ++bits) {
      const float f = n.decode(bits);
      if (std::isnan(f)) continue;
      ASSERT_EQ(n.encode(f), bits) << dtype_name(n.dtype) << " 0x" << std::hex << bits;
    }
  }
}

TEST(DType, LoadStoreElements) {
  std::mt19937 rng(7);
  for (const Narrow& n : kNarrow) {
    std::vector<uint8_t> buffer(64 * 2);
    for (int i = 0; i < 64; ++i) {
      const float x = std::normal_distribution<float>(0.f, 30.f)(rng);
      store_from_float(buffer.data(), n.dtype, i, x);
      EXPECT_EQ(double(load_as_float(buffer.data(), n.dtype, i)),
                format_round(float_format_of(n.dtype), double(x)))
          << dtype_name(n.dtype) << " " << x;
    }
  }
  float f = 0;
  store_from_float(&f, DType::kFloat32, 0, 1.25f);
  EXPECT_EQ(load_as_float(&f, DType::kFloat32, 0), 1.25f);
  int32_t i = 0;
  EXPECT_THROW(load_as_float(&i, DType::kInt32, 0), Error);
  EXPECT_THROW(store_from_float(&i, DType::kInt32, 0, 1.f), Error);
}

TEST(DType, NamesRoundTrip) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
                  DType::kFloat8E5M2, DType::kInt32, DType::kInt64, DType::kUInt8}) {
    EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  }
  try {
    parse_dtype("fp12");
    FAIL() << "parse_dtype accepted fp12";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("fp12"), std::string::npos);
  }
}

}  // namespace
}  // namespace kvattn::testing
