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
constexpr uint64_t kMatrixSeeds[] = {1, 2, 3, 4, 5};

class CpuScenarioMatrix : public ::testing::TestWithParam<uint64_t> {};

TEST_P(CpuScenarioMatrix, EveryRowMatchesTheReference) {
  const std::vector<ScenarioSpec> rows = standard_scenarios(GetParam());
  ASSERT_GE(rows.size(), 85u);
  const bool verbose = std::getenv("KVATTN_TEST_VERBOSE") != nullptr;
  for (const ScenarioSpec& spec : rows) {
    const ScenarioResult result = run_scenario(spec, BackendKind::kCpu);
    // A known gap (listed with its reason in the matrix) must be refused as not supported,
    // with the pool untouched; it never counts as passed.
    if (const char* why = unsupported_reason(spec, BackendKind::kCpu)) {
      EXPECT_TRUE(result.not_supported) << spec.variant << " is listed as a gap (" << why
                                        << ") but: " << result.detail;
      EXPECT_TRUE(result.kv_pool_ok) << spec.variant << " (seed " << spec.seed << ")";
      continue;
    }
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

void expect_passes(const ScenarioSpec& spec) {
  const ScenarioResult result = run_scenario(spec, BackendKind::kCpu);
  EXPECT_TRUE(result.passed) << spec.variant << " (seed " << spec.seed << "): " << result.detail;
}

ScenarioSpec targeted(const char* variant, ForwardMode mode, uint64_t seed) {
  ScenarioSpec spec;
  spec.variant = variant;
  spec.mode = mode;
  spec.seed = seed;
  return spec;
}

TEST(CpuScenarios, KvLenZeroAndOne) {
  for (uint64_t seed : {11, 12}) {
    // Every request sees exactly one key (its own new token).
    ScenarioSpec decode = targeted("decode kv_len 1", ForwardMode::kDecode, seed);
    decode.min_kv_len = decode.max_kv_len = 1;
    decode.allow_tiny = false;
    expect_passes(decode);
    ScenarioSpec extend = targeted("extend kv_len 1", ForwardMode::kExtend, seed);
    extend.min_kv_len = extend.max_kv_len = 1;
    extend.allow_tiny = false;
    expect_passes(extend);
    // A padded decode entry (seq_len 0) and an encoder of length 0: rows with no keys are 0.
    ScenarioSpec padded = targeted("decode with padding entry", ForwardMode::kDecode, seed);
    padded.batch_size = 3;
    expect_passes(padded);
    ScenarioSpec cross = targeted("cross layer, encoder 0 and 1", ForwardMode::kDecode, seed);
    cross.cross_attention = true;
    cross.max_kv_len = 2;
    expect_passes(cross);
    ScenarioSpec verify = targeted("verify, empty prefix", ForwardMode::kTargetVerify, seed);
    verify.draft_token_num = 3;
    verify.max_kv_len = 2;
    expect_passes(verify);
  }
}

TEST(CpuScenarios, PageBoundaries) {
  // Lengths just below, at and just above page multiples, for decode and extend.
  for (int page_size : {16, 128}) {
    for (int len : {page_size - 1, page_size, page_size + 1, 2 * page_size, 2 * page_size + 1}) {
      for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
        ScenarioSpec spec = targeted("page boundary", mode, uint64_t(len * 31 + page_size));
        spec.page_size = page_size;
        spec.min_kv_len = spec.max_kv_len = len;
        spec.min_q_len = 1;
        spec.max_q_len = page_size == 16 ? 20 : 3;
        spec.allow_tiny = false;
        spec.num_q_heads = 4;
        spec.num_kv_heads = 2;
        spec.head_dim = 64;
        expect_passes(spec);
      }
    }
  }
}

TEST(CpuScenarios, ContiguousAndShuffledSlots) {
  for (bool shuffled : {false, true}) {
    for (int page_size : {1, 8}) {
      ScenarioSpec spec = targeted(shuffled ? "shuffled" : "contiguous", ForwardMode::kExtend,
                                   uint64_t(100 + page_size + shuffled));
      spec.shuffled_slots = shuffled;
      spec.page_size = page_size;
      expect_passes(spec);
    }
  }
}

TEST(CpuScenarios, LongDecodeSplitsTheKv) {
  // Long sequences with a small batch: the CPU backend splits the KV across threads and merges.
  for (int page_size : {1, 16}) {
    ScenarioSpec spec = targeted("long decode", ForwardMode::kDecode, uint64_t(200 + page_size));
    spec.batch_size = 2;
    spec.min_kv_len = 3000;
    spec.max_kv_len = 5000;
    spec.allow_tiny = false;
    spec.page_size = page_size;
    expect_passes(spec);
    spec.variant = "long decode fp8 window";
    spec.kv_dtype = DType::kFloat8E4M3;
    spec.k_scale = 0.7f;
    spec.sliding_window = 1000;
    expect_passes(spec);
  }
}

TEST(CpuScenarios, LargeExtendTakesTheDefaultRaggedPath) {
  // At least 4096 new tokens: with the default threshold the backend takes the ragged + paged
  // prefix path (the harness models which path reads rounded K/V).
  ScenarioSpec spec = targeted("extend >= 4096 new tokens", ForwardMode::kExtend, 300);
  spec.batch_size = 1;
  spec.min_q_len = spec.max_q_len = 4100;
  spec.min_kv_len = 4100;
  spec.max_kv_len = 4160;
  spec.allow_tiny = false;
  spec.num_q_heads = 2;
  spec.num_kv_heads = 1;
  spec.head_dim = 64;
  spec.q_dtype = DType::kFloat32;  // tight bar: the rounded/unrounded K/V difference would show
  expect_passes(spec);
}

}  // namespace
}  // namespace kvattn::testing
