// Deterministic mode (BackendConfig::deterministic, issue 16) on the CPU backend: a probe request
// gives the same bytes alone and inside batches of other requests, in every mode, with several
// workers (so the non-deterministic planner would split its KV differently by batch). The
// control run without the mode shows that the batches do change the bytes otherwise (the test
// can fail).
#include <gtest/gtest.h>

#include "support/batch_invariance.h"

namespace kvattn::testing {
namespace {

class CpuDeterministic : public ::testing::TestWithParam<ForwardMode> {};

TEST_P(CpuDeterministic, ProbeIsBitwiseEqualInEveryBatch) {
  const ForwardMode mode = GetParam();
  const BatchInvarianceResult r =
      run_batch_invariance(BackendKind::kCpu, mode, /*deterministic=*/true, 6, 2, 17);
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(r.identical, r.batches) << forward_mode_name(mode) << ": " << r.first_diff;
}

INSTANTIATE_TEST_SUITE_P(Modes, CpuDeterministic,
                         ::testing::Values(ForwardMode::kDecode, ForwardMode::kExtend,
                                           ForwardMode::kMixed, ForwardMode::kTargetVerify),
                         [](const auto& info) {
                           return std::string(forward_mode_name(info.param));
                         });

// Without the mode, the probe's KV is split by how much else the batch holds (decode alone on 2
// workers splits its 3000 keys; beside 12 neighbours it does not), and the bytes move.
TEST(CpuDeterministicControl, WithoutTheModeSomeBatchChangesTheProbe) {
  const BatchInvarianceResult r = run_batch_invariance(BackendKind::kCpu, ForwardMode::kDecode,
                                                       /*deterministic=*/false, 6, 2, 17);
  EXPECT_TRUE(r.finite);
  EXPECT_LT(r.identical, r.batches) << "the batches never changed the probe: the test above "
                                       "could not fail";
}

}  // namespace
}  // namespace kvattn::testing
