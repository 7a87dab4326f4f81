// Bad indices refuse the whole step on the CPU backend: the table of tests/support/bad_index.h (every
// index kind, every mode), one parameterised test per case. The CUDA tests run the same table
// on the device (tests/cuda/test_bad_index_cuda.cpp): both backends must name the same argument
// with the same ErrorKind.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvattn/kvattn.h"
#include "support/bad_index.h"

namespace kvattn::testing {
namespace {

const std::vector<BadIndexCase>& cases() { return bad_index_case_table(); }

std::string test_name(const ::testing::TestParamInfo<int>& info) {
  return bad_index_case_name(info.param);
}

class BadIndexOnCpu : public ::testing::TestWithParam<int> {};

TEST_P(BadIndexOnCpu, RefusedWholeThenTheNextStepRuns) {
  const BadIndexCase& c = cases()[size_t(GetParam())];
  const BadIndexOutcome o = run_bad_index_case(c, BackendKind::kCpu);
  EXPECT_EQ(bad_index_failure(c, o, /*deferred=*/false), "") << c.label;
  // The CPU backend validates before writing: the call itself throws, check_errors has nothing.
  if (c.expect_refused) EXPECT_FALSE(o.refused_by_check_errors) << o.message;
  if (std::getenv("KVATTN_TEST_VERBOSE")) std::printf("  %s -> %s\n", c.label.c_str(), o.message.c_str());
}

INSTANTIATE_TEST_SUITE_P(Cases, BadIndexOnCpu, ::testing::Range(0, int(cases().size())),
                         test_name);

TEST(StepErrors, CpuNumbersStepsAndHasNothingToReport) {
  ScenarioSpec spec;
  spec.variant = "step ids";
  spec.batch_size = 2;
  spec.max_kv_len = 20;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  auto w = ScenarioWorld::build(spec, BackendKind::kCpu);
  auto backend = make_backend(BackendKind::kCpu, w->config);
  EXPECT_EQ(backend->step_id(), 0u);
  for (uint64_t step = 1; step <= 3; ++step) {
    backend->init_forward_metadata(w->batch);
    EXPECT_EQ(backend->step_id(), step);
  }
  EXPECT_TRUE(backend->take_step_errors(true).empty());
  EXPECT_NO_THROW(backend->check_errors());
  // A refused call still counts as a step (the engine's numbering stays in step).
  ForwardBatch bad = w->batch;
  bad.batch_size = -1;
  EXPECT_THROW(backend->init_forward_metadata(bad), Error);
  EXPECT_EQ(backend->step_id(), 4u);
}

}  // namespace
}  // namespace kvattn::testing
