// core::FastDivmod against the hardware division: every divisor 1..300 and the powers of two and
// their neighbours up to 2^31 - 1, over dense small numerators, the numerators next to multiples
// of the divisor, random ones, and the top of the int range.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/fast_divmod.h"

namespace kvattn::core {
namespace {

void expect_exact(int32_t d, int32_t n) {
  const FastDivmod f(d);
  int r = -1;
  const int q = f.divmod(n, r);
  ASSERT_EQ(q, n / d) << "n " << n << " d " << d;
  ASSERT_EQ(r, n % d) << "n " << n << " d " << d;
}

std::vector<int32_t> divisors() {
  std::vector<int32_t> ds;
  for (int32_t d = 1; d <= 300; ++d) ds.push_back(d);
  for (int b = 9; b <= 31; ++b) {
    const int64_t p = int64_t{1} << b;
    for (int64_t d : {p - 1, p, p + 1}) {
      if (d >= 1 && d <= INT32_MAX) ds.push_back(static_cast<int32_t>(d));
    }
  }
  return ds;
}

TEST(FastDivmod, SmallNumeratorsAndMultiples) {
  for (const int32_t d : divisors()) {
    for (int32_t n = 0; n < 4096; ++n) expect_exact(d, n);
    for (int64_t k = 1; k * d < INT32_MAX && k < (int64_t{1} << 20); k = k * 3 + 1) {
      for (int64_t delta = -1; delta <= 1; ++delta) {
        const int64_t n = k * d + delta;
        if (n >= 0 && n <= INT32_MAX) expect_exact(d, static_cast<int32_t>(n));
      }
    }
  }
}

TEST(FastDivmod, RandomAndTopOfRange) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> any(0, INT32_MAX);
  for (const int32_t d : divisors()) {
    for (int i = 0; i < 2000; ++i) expect_exact(d, any(rng));
    for (int32_t n = INT32_MAX; n > INT32_MAX - 64; --n) expect_exact(d, n);
  }
}

TEST(FastDivmod, DivisorOneIsTheIdentity) {
  const FastDivmod f(1);
  EXPECT_EQ(f.multiplier, 0u);
  EXPECT_EQ(f.div(0), 0);
  EXPECT_EQ(f.div(INT32_MAX), INT32_MAX);
}

}  // namespace
}  // namespace kvattn::core
