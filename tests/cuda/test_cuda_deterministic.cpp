// Deterministic mode (BackendConfig::deterministic, issue 16) on the CUDA backend: the probe
// request of tests/support/batch_invariance.h gives the same bytes alone and inside batches of
// other requests, in every mode; without the mode the split-KV plan follows the batch and the
// bytes move (the control: the test can fail).
#include <gtest/gtest.h>

#include "cuda_test_support.h"
#include "support/batch_invariance.h"

namespace kvattn::testing {
namespace {

class CudaDeterministic : public ::testing::TestWithParam<ForwardMode> {};

TEST_P(CudaDeterministic, ProbeIsBitwiseEqualInEveryBatch) {
  REQUIRE_GPU();
  const ForwardMode mode = GetParam();
  const BatchInvarianceResult r =
      run_batch_invariance(BackendKind::kCuda, mode, /*deterministic=*/true, 8, 0, 23);
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(r.identical, r.batches) << forward_mode_name(mode) << ": " << r.first_diff;
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaDeterministic,
                         ::testing::Values(ForwardMode::kDecode, ForwardMode::kExtend,
                                           ForwardMode::kMixed, ForwardMode::kTargetVerify),
                         [](const auto& info) {
                           return std::string(forward_mode_name(info.param));
                         });

TEST(CudaDeterministicControl, WithoutTheModeSomeBatchChangesTheProbe) {
  REQUIRE_GPU();
  const BatchInvarianceResult r = run_batch_invariance(BackendKind::kCuda, ForwardMode::kDecode,
                                                       /*deterministic=*/false, 8, 0, 23);
  EXPECT_TRUE(r.finite);
  EXPECT_LT(r.identical, r.batches) << "the batches never changed the probe: the test above "
                                       "could not fail";
}

}  // namespace
}  // namespace kvattn::testing
