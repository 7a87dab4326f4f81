// The scenario matrix on the CPU backend: every mode x variant over several seeds, each checked
// against the float64 reference (max relative error per row, NaN and unwritten elements, the KV
// pool after the run).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "reference/scenario.h"

namespace kvattn::testing {
namespace {

// Seeds of the matrix. Each row derives its own seed from these; a failure prints it.
constexpr uint64_t kMatrixSeeds[] = {1, 2, 3};

class CpuScenarioMatrix : public ::testing::TestWithParam<uint64_t> {};

TEST_P(CpuScenarioMatrix, EveryRowMatchesTheReference) {
  const std::vector<ScenarioSpec> rows = standard_scenarios(GetParam());
  ASSERT_GE(rows.size(), 40u);
  const bool verbose = std::getenv("KVATTN_TEST_VERBOSE") != nullptr;
  for (const ScenarioSpec& spec : rows) {
    const ScenarioResult result = run_scenario(spec, BackendKind::kCpu);
    if (verbose) {
      std::printf("%-34s %-40s %-9s %-9s err %.3g (tol %.0e)%s\n", spec.variant.c_str(),
                  spec.shape_label().c_str(), dtype_name(spec.q_dtype), dtype_name(spec.kv_dtype),
                  result.max_rel_err, result.tolerance, result.passed ? "" : "  FAILED");
    }
    EXPECT_TRUE(result.passed) << spec.variant << " (seed " << spec.seed << "): " << result.detail;
    EXPECT_TRUE(result.kv_pool_ok) << spec.variant << " (seed " << spec.seed << ")";
    EXPECT_LE(result.max_rel_err, result.tolerance) << spec.variant << " (seed " << spec.seed << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, CpuScenarioMatrix, ::testing::ValuesIn(kMatrixSeeds));

}  // namespace
}  // namespace kvattn::testing
