// The online-softmax state and its merge (core/softmax_state.h) against float64 formulas:
// SPEC §3's merge  m = max(s1,s2); o = (o1 e^(s1-m) + o2 e^(s2-m)) / (e^(s1-m) + e^(s2-m));
// s = m + ln(e^(s1-m) + e^(s2-m)), empty partials (LSE -inf) included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/softmax_state.h"

namespace kvattn::core {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Merged {
  double weight_a, weight_b, lse;
};

Merged merge_f64(double lse_a, double lse_b) {
  const double m = std::max(lse_a, lse_b);
  const double ea = std::exp(lse_a - m);
  const double eb = std::exp(lse_b - m);
  return {ea / (ea + eb), eb / (ea + eb), m + std::log(ea + eb)};
}

TEST(MergeState, WeightsMatchTheFloat64Formula) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> lse(-60.0, 60.0);
  std::uniform_real_distribution<double> gap(-120.0, 120.0);
  for (int i = 0; i < 200000; ++i) {
    const float a = float(lse(rng));
    const float b = i % 3 == 0 ? float(a + gap(rng)) : float(lse(rng));
    float wa = -1, wb = -1, merged = 0;
    merge_weights(a, b, &wa, &wb, &merged);
    const Merged want = merge_f64(a, b);
    ASSERT_NEAR(wa, want.weight_a, 1e-6) << a << " " << b;
    ASSERT_NEAR(wb, want.weight_b, 1e-6) << a << " " << b;
    ASSERT_NEAR(wa + wb, 1.0, 1e-6);
    ASSERT_NEAR(merged, want.lse, 1e-5 * std::max(1.0, std::fabs(want.lse))) << a << " " << b;
  }
}

TEST(MergeState, EmptyPartials) {
  float wa = -1, wb = -1, merged = 0;
  merge_weights(kNegInf, 2.5f, &wa, &wb, &merged);
  EXPECT_EQ(wa, 0.f);
  EXPECT_EQ(wb, 1.f);
  EXPECT_EQ(merged, 2.5f);
  merge_weights(-7.f, kNegInf, &wa, &wb, &merged);
  EXPECT_EQ(wa, 1.f);
  EXPECT_EQ(wb, 0.f);
  EXPECT_EQ(merged, -7.f);
  merge_weights(kNegInf, kNegInf, &wa, &wb, &merged);
  EXPECT_EQ(wa, 0.f) << "both empty: no weight, no NaN";
  EXPECT_EQ(wb, 0.f);
  EXPECT_EQ(merged, kNegInf);
}

// Attention over keys split into chunks, each chunk's (o, lse) merged pairwise with
// merge_weights, equals the attention over all keys at once (computed in float64).
TEST(MergeState, MergingChunksEqualsTheWhole) {
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0.0, 3.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + int(rng() % 300);
    const int dim = 8;
    std::vector<double> logit(static_cast<size_t>(n)), value(size_t(n) * dim);
    for (auto& x : logit) x = normal(rng);
    for (auto& x : value) x = normal(rng);
    auto attend = [&](int begin, int end, std::vector<double>& out) {
      out.assign(dim, 0.0);
      if (begin == end) return -std::numeric_limits<double>::infinity();
      const double m = *std::max_element(logit.begin() + begin, logit.begin() + end);
      double sum = 0;
      for (int j = begin; j < end; ++j) {
        const double w = std::exp(logit[j] - m);
        sum += w;
        for (int d = 0; d < dim; ++d) out[d] += w * value[size_t(j) * dim + d];
      }
      for (double& o : out) o /= sum;
      return m + std::log(sum);
    };
    std::vector<double> whole;
    const double whole_lse = attend(0, n, whole);
    // Chunks of random sizes, some empty.
    std::vector<float> acc(dim, 0.f);
    float acc_lse = kNegInf;
    for (int begin = 0;;) {
      const int end = std::min(n, begin + int(rng() % 40));
      std::vector<double> part;
      const float part_lse = float(attend(begin, end, part));
      float wa, wb, merged;
      merge_weights(acc_lse, part_lse, &wa, &wb, &merged);
      for (int d = 0; d < dim; ++d) acc[d] = wa * acc[d] + wb * float(part[d]);
      acc_lse = merged;
      if (end == n) break;
      begin = end;
    }
    ASSERT_NEAR(acc_lse, whole_lse, 1e-4 * std::max(1.0, std::fabs(whole_lse)));
    for (int d = 0; d < dim; ++d) ASSERT_NEAR(acc[d], whole[d], 1e-4) << "trial " << trial;
  }
}

TEST(SoftmaxState, StreamingLseMatchesFloat64) {
  std::mt19937 rng(9);
  std::normal_distribution<double> normal(0.0, 5.0);
  for (int trial = 0; trial < 500; ++trial) {
    SoftmaxState state;
    EXPECT_EQ(state.lse(), kNegInf) << "an empty state has LSE -inf";
    std::vector<double> all;
    const int blocks = 1 + int(rng() % 8);
    for (int b = 0; b < blocks; ++b) {
      std::vector<float> block(1 + rng() % 16);
      for (auto& x : block) x = float(normal(rng));
      const float block_max = *std::max_element(block.begin(), block.end());
      const float old_max = state.max;
      const float factor = state.rescale_for(block_max);
      if (old_max == kNegInf) EXPECT_EQ(factor, 0.f);
      else EXPECT_NEAR(factor, std::exp(double(old_max) - state.max), 1e-6);
      for (float x : block) {
        state.sum += std::exp(x - state.max);
        all.push_back(x);
      }
    }
    const double m = *std::max_element(all.begin(), all.end());
    double sum = 0;
    for (double x : all) sum += std::exp(x - m);
    ASSERT_NEAR(state.lse(), m + std::log(sum), 1e-5 * std::max(1.0, std::fabs(m)));
  }
}

TEST(SoftmaxState, LogitCap) {
  for (double x : {-100.0, -3.0, -0.5, 0.0, 0.25, 7.0, 1e4}) {
    for (double cap : {1.0, 5.0, 30.0}) {
      EXPECT_NEAR(apply_logit_cap(float(x), float(cap)), cap * std::tanh(x / cap), 1e-5 * cap);
    }
    EXPECT_EQ(apply_logit_cap(float(x), 0.f), float(x)) << "cap 0 is off";
  }
}

}  // namespace
}  // namespace kvattn::core
