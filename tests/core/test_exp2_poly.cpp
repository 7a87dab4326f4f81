// core::exp2_poly, the FMA-pipe exponential of the GPU softmax, against float64 exp2: relative
// error under the stated bound over the range a softmax feeds it (x <= 8 after the lazy max,
// down to where 2^x underflows), and exactly +0 where a masked score lands (-inf) or below.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/softmax_state.h"

namespace kvattn::core {
namespace {

TEST(Exp2Poly, RelativeErrorUnderTheBound) {
  std::mt19937 rng(20261206);
  std::uniform_real_distribution<float> wide(-125.f, 126.f);
  std::uniform_real_distribution<float> near(-12.f, 9.f);  // a softmax's common range
  double worst = 0.0;
  for (int i = 0; i < 400000; ++i) {
    const float x = i % 2 ? wide(rng) : near(rng);
    const double want = std::exp2(static_cast<double>(x));
    const double got = exp2_poly(x);
    ASSERT_TRUE(std::isfinite(got)) << "x=" << x;
    worst = std::max(worst, std::abs(got / want - 1.0));
  }
  // Integers and half-integers: the ends of the polynomial's interval and round-to-even ties.
  for (float x = -125.f; x <= 126.f; x += 0.5f) {
    const double want = std::exp2(static_cast<double>(x));
    worst = std::max(worst, std::abs(exp2_poly(x) / want - 1.0));
  }
  EXPECT_LT(worst, 1.05e-4);
  EXPECT_GT(worst, 1e-6);  // a degree-3 polynomial, not the library's exp2
  EXPECT_EQ(exp2_poly(0.f), 1.f);
}

TEST(Exp2Poly, MaskedAndUnderflowingScoresGiveZero) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {-inf, -1e30f, -1000.f, -128.f, -127.f}) {
    const float got = exp2_poly(x);
    EXPECT_EQ(got, 0.f) << "x=" << x;
    EXPECT_FALSE(std::signbit(got)) << "x=" << x;
  }
  EXPECT_EQ(exp2_poly(std::numeric_limits<float>::quiet_NaN()), 0.f);
  // Between -127 and -125 the result is tiny and never negative (no exponent wrap).
  for (float x = -127.f; x <= -125.f; x += 1.f / 64) {
    const float got = exp2_poly(x);
    EXPECT_GE(got, 0.f) << "x=" << x;
    EXPECT_LE(got, std::ldexp(1.f, -124)) << "x=" << x;
  }
}

TEST(Exp2Poly, MonotoneOverASoftmaxRange) {
  float last = exp2_poly(-30.f);
  for (float x = -30.f + 1.f / 256; x <= 9.f; x += 1.f / 256) {
    const float got = exp2_poly(x);
    EXPECT_GE(got, last * (1.f - 2e-4f)) << "x=" << x;
    last = got;
  }
}

}  // namespace
}  // namespace kvattn::core
