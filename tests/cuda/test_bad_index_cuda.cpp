// Bad input on the device (issues 13 and 21): a step with a bad index writes nothing and is
// reported once, by check_errors, attributed to its step; a refused allocation leaves no device
// memory behind; the CUDA context stays healthy and the next good step is correct. The table of
// tests/support/bad_index.h runs here as on the CPU backend (same ErrorKind, same argument). The
// CUDA-graph path of the same contract is in test_cuda_graphs.cpp (CudaGraphsBadInput). Skips
// without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/cuda_memory.h"
#include "cuda/cuda_test_support.h"
#include "kvattn/kvattn.h"
#include "support/bad_index.h"

namespace kvattn::testing {
namespace {

const std::vector<BadIndexCase>& cases() { return bad_index_case_table(); }

std::string test_name(const ::testing::TestParamInfo<int>& info) {
  return bad_index_case_name(info.param);
}

// The context is healthy: no error pending, the device synchronises.
void expect_context_healthy(const std::string& what) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << what;
}

size_t free_bytes() {
  size_t free = 0, total = 0;
  cudaDeviceSynchronize();
  cudaMemGetInfo(&free, &total);
  return free;
}

// cudaMemGetInfo moves in pages of the driver's allocator: "as before" within 2 MiB.
constexpr long long kMemorySlack = 2ll << 20;

class BadIndexOnCuda : public ::testing::TestWithParam<int> {};

TEST_P(BadIndexOnCuda, RefusedWholeReportedOnceThenTheNextStepRuns) {
  REQUIRE_GPU();
  const BadIndexCase& c = cases()[size_t(GetParam())];
  for (const char* kernel : {"0", "1"}) {  // both decode kernels (the others have one path)
    if (c.spec.mode != ForwardMode::kDecode && kernel[0] == '1') continue;
    TensorCoreChoice choice(kernel);
    const BadIndexOutcome o = run_bad_index_case(c, BackendKind::kCuda);
    EXPECT_EQ(bad_index_failure(c, o, /*deferred=*/true), "") << c.label << " kernel " << kernel;
    // Only the host-checkable lengths are thrown by the call; device indices by check_errors,
    // and so are the lengths of a step planned on the device.
    const bool host_checked =
        c.label.find("seq_len") != std::string::npos && !c.spec.device_lengths;
    if (c.expect_refused) EXPECT_EQ(o.refused_by_check_errors, !host_checked) << o.message;
    expect_context_healthy(c.label);
    std::printf("  %-62s kernel %s -> %s\n", c.label.c_str(), kernel,
                o.refused ? o.message.substr(0, 110).c_str() : "(ran)");
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, BadIndexOnCuda, ::testing::Range(0, int(cases().size())),
                         test_name);

// ---- attribution: a bad step between good ones ---------------------------------------------------

ScenarioSpec small_decode(uint64_t seed) {
  ScenarioSpec spec;
  spec.variant = "attribution";
  spec.mode = ForwardMode::kDecode;
  spec.batch_size = 3;
  spec.min_kv_len = 8;
  spec.max_kv_len = 60;
  spec.allow_tiny = false;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.seed = seed;
  return spec;
}

TEST(CudaStepErrors, EachRefusedStepIsReportedOnceWithItsOwnNumber) {
  REQUIRE_GPU();
  auto w = ScenarioWorld::build(small_decode(41), BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  const TensorView good_loc = w->batch.out_cache_loc;
  const TensorView bad_loc =
      w->index_tensor({1, w->kv_cache->num_slots(), 2}, DType::kInt32, w->device);
  auto step = [&](bool bad) {
    w->batch.out_cache_loc = bad ? bad_loc : good_loc;
    backend->init_forward_metadata(w->batch);
    for (const ScenarioCall& c : w->calls) {
      backend->forward(c.q, c.k, c.v, c.out, w->layer, w->batch, true);
    }
    return backend->step_id();
  };
  // good, bad, good, bad, good with no check in between: the engine synchronises once.
  const uint64_t s1 = step(false);
  const uint64_t s2 = step(true);
  const uint64_t s3 = step(false);
  const uint64_t s4 = step(true);
  const uint64_t s5 = step(false);
  EXPECT_EQ(s5, s1 + 4);
  const std::vector<StepError> errors = backend->take_step_errors(/*synchronize=*/true);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0].step, s2);
  EXPECT_EQ(errors[1].step, s4);
  for (const StepError& e : errors) {
    EXPECT_EQ(e.argument, "out_cache_loc[1]") << e.message;
    EXPECT_EQ(e.kind, ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message.find("step " + std::to_string(e.step) + " (DECODE, batch_size 3)"),
              std::string::npos)
        << e.message;
  }
  EXPECT_TRUE(backend->take_step_errors(true).empty()) << "reported twice";
  (void)s3;
  // check_errors throws the oldest and names the others; afterwards nothing is left.
  step(true);
  const uint64_t s7 = step(true);
  try {
    backend->check_errors(true);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.step(), int64_t(s7 - 1));
    EXPECT_NE(std::string(e.what()).find("1 more refused step"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(backend->check_errors(true));
  // A good step after all that is correct (the pool only ever got the good steps' saves).
  w->batch.out_cache_loc = good_loc;
  step(false);
  EXPECT_NO_THROW(backend->check_errors(true));
  const ScenarioResult r = judge_world(*w);
  EXPECT_TRUE(r.passed && r.kv_pool_ok) << r.detail;
  expect_context_healthy("attribution");
}

TEST(CudaStepErrors, ForwardGivenOtherSlotsChecksThemItself) {
  REQUIRE_GPU();
  // in_graph checked the batch's slots; a forward handed another out_cache_loc tensor (same
  // length, one bad slot) must not write half of it: the save checks its own slots first.
  auto w = ScenarioWorld::build(small_decode(42), BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  backend->init_forward_metadata(w->batch);
  ForwardBatch other = w->batch;
  other.out_cache_loc = w->index_tensor({1, 2, -4}, DType::kInt64, w->device);
  for (const ScenarioCall& c : w->calls) {
    backend->forward(c.q, c.k, c.v, c.out, w->layer, other, true);
  }
  try {
    backend->check_errors(true);
    ADD_FAILURE() << "the bad slot was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "out_cache_loc[2]") << e.what();
    EXPECT_EQ(e.step(), int64_t(backend->step_id()));
  }
  EXPECT_TRUE(w->pool_unchanged());
  expect_context_healthy("other slots");
}

// ---- the multi-step draft --------------------------------------------------------------------

TEST(CudaStepErrors, DraftStepWithBadSlotsIsRefusedWithTheStepsAfterIt) {
  REQUIRE_GPU();
  ScenarioSpec spec = small_decode(43);
  spec.topk = 2;
  spec.num_steps = 3;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  MultiStepDraftBackend draft(BackendKind::kCuda, w->config, spec.topk, spec.num_steps);
  draft.init_forward_metadata(w->batch);
  const uint64_t step = draft.step_id();
  // Draft step 0 saves; step 1 has a bad slot: it and step 2 write nothing.
  std::vector<TensorView> locs;
  for (const ScenarioCall& c : w->calls) locs.push_back(c.out_cache_loc);
  locs[1] = w->index_tensor({1, 2, 3, 4, 5, w->kv_cache->num_slots() + 1}, DType::kInt32,
                            w->device);
  const ScenarioCall& c0 = w->calls[0];
  draft.forward_step(0, c0.q, c0.k, c0.v, c0.out, w->layer, locs[0]);
  cudaDeviceSynchronize();
  const auto after_step0_k = w->pool_bytes(ScenarioWorld::kTestedLayer, 0);
  const auto after_step0_v = w->pool_bytes(ScenarioWorld::kTestedLayer, 1);
  for (int s = 1; s < spec.num_steps; ++s) {
    const ScenarioCall& c = w->calls[size_t(s)];
    draft.forward_step(s, c.q, c.k, c.v, c.out, w->layer, locs[size_t(s)]);
  }
  try {
    draft.check_errors(true);
    ADD_FAILURE() << "the bad draft slot was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "out_cache_loc[5]") << e.what();
    EXPECT_EQ(e.step(), int64_t(step));
  }
  EXPECT_EQ(w->pool_bytes(ScenarioWorld::kTestedLayer, 0), after_step0_k);
  EXPECT_EQ(w->pool_bytes(ScenarioWorld::kTestedLayer, 1), after_step0_v);
  // The next draft step set (good) runs and is right.
  draft.init_forward_metadata(w->batch);
  for (int s = 0; s < spec.num_steps; ++s) {
    const ScenarioCall& c = w->calls[size_t(s)];
    draft.forward_step(s, c.q, c.k, c.v, c.out, w->layer, c.out_cache_loc);
  }
  EXPECT_NO_THROW(draft.check_errors(true));
  const ScenarioResult r = judge_world(*w);
  EXPECT_TRUE(r.passed && r.kv_pool_ok) << r.detail;
  expect_context_healthy("draft");
}

TEST(CudaStepErrors, DraftWithBadReqToTokenWritesNothing) {
  REQUIRE_GPU();
  ScenarioSpec spec = small_decode(44);
  spec.topk = 2;
  spec.num_steps = 2;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  const int row = w->ref_batch.req_pool_indices.at(1);
  const std::vector<int32_t> old = w->req_to_token_pool->read(row, 2, 1);
  const std::vector<int32_t> bad = {-3};
  w->req_to_token_pool->write(row, 2, bad);
  MultiStepDraftBackend draft(BackendKind::kCuda, w->config, spec.topk, spec.num_steps);
  draft.init_forward_metadata(w->batch);
  for (int s = 0; s < spec.num_steps; ++s) {
    const ScenarioCall& c = w->calls[size_t(s)];
    draft.forward_step(s, c.q, c.k, c.v, c.out, w->layer, c.out_cache_loc);
  }
  try {
    draft.check_errors(true);
    ADD_FAILURE() << "not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "req_to_token[" + std::to_string(row) + "][2]") << e.what();
  }
  EXPECT_TRUE(w->pool_unchanged());
  w->req_to_token_pool->write(row, 2, old);
  expect_context_healthy("draft req_to_token");
}

// ---- refused allocations leave nothing behind (issue 21) --------------------------------------

TEST(CudaAllocation, HugeGraphStateIsRefusedAtOnceAndHoldsNothing) {
  REQUIRE_GPU();
  // max_context_len about 4096, as an engine's: 10^7 requests need 160 GB of kv_indices alone.
  ScenarioSpec spec = small_decode(51);
  spec.min_kv_len = 4000;
  spec.max_kv_len = 4090;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  backend->init_cuda_graph_state(4, 4);  // a sane one first: it must survive the refusal
  const size_t before = free_bytes();
  const auto start = std::chrono::steady_clock::now();
  try {
    backend->init_cuda_graph_state(10'000'000, 1'000'000'000);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfResources) << e.what();
    EXPECT_NE(std::string(e.what()).find("bytes"), std::string::npos) << e.what();
    std::printf("  refused: %s\n", e.what());
  }
  // Reported, not asserted (no test asserts a duration): the refusal is arithmetic.
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("  refused in %.3f ms\n", ms);
  EXPECT_LE(std::llabs((long long)free_bytes() - (long long)before), kMemorySlack);
  // The backend serves the next step (on its old graph buffers too: batch 3 <= 4).
  backend->init_forward_metadata(w->batch);
  for (const ScenarioCall& c : w->calls) {
    backend->forward(c.q, c.k, c.v, c.out, w->layer, w->batch, true);
  }
  EXPECT_NO_THROW(backend->check_errors(true));
  const ScenarioResult r = judge_world(*w);
  EXPECT_TRUE(r.passed && r.kv_pool_ok) << r.detail;
  expect_context_healthy("huge graph state");
}

TEST(CudaAllocation, GraphStateFailingHalfwayHoldsNothing) {
  REQUIRE_GPU();
  auto w = ScenarioWorld::build(small_decode(52), BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  const size_t before = free_bytes();
  // Fail the call's first allocation, then its second, ... until it has none left to fail.
  int failures = 0;
  for (int succeed = 0; succeed < 64; ++succeed) {
    cuda::debug::limit_device_mallocs(succeed);
    bool refused = false;
    try {
      backend->init_cuda_graph_state(64, 64);
    } catch (const Error& e) {
      refused = true;
      EXPECT_EQ(e.kind(), ErrorKind::kOutOfResources) << e.what();
    }
    cuda::debug::limit_device_mallocs(-1);
    if (!refused) break;  // every allocation of the call has failed once
    ++failures;
    EXPECT_LE(std::llabs((long long)free_bytes() - (long long)before), kMemorySlack)
        << "after " << succeed << " allocations succeeded";
  }
  EXPECT_GE(failures, 2) << "init_cuda_graph_state makes several allocations";
  backend->init_forward_metadata(w->batch);
  for (const ScenarioCall& c : w->calls) {
    backend->forward(c.q, c.k, c.v, c.out, w->layer, w->batch, true);
  }
  EXPECT_NO_THROW(backend->check_errors(true));
  EXPECT_TRUE(judge_world(*w).passed);
  expect_context_healthy("graph state halfway");
}

TEST(CudaAllocation, HugeOrFailingKvCacheHoldsNothing) {
  REQUIRE_GPU();
  const size_t before = free_bytes();
  KvCacheConfig config;
  config.num_layers = 64;
  config.num_slots = int64_t(1) << 32;
  config.num_kv_heads = 8;
  config.head_dim = 128;
  config.device = Device::cuda(0);
  const auto start = std::chrono::steady_clock::now();
  try {
    KvCache::allocate(config);
    ADD_FAILURE() << "a 64 x 2^32-slot pool was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfResources) << e.what();
    std::printf("  refused: %s\n", e.what());
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("  refused in %.3f ms\n", ms);
  // Overflowing sizes are refused by arithmetic, not wrapped.
  config.num_slots = int64_t(1) << 60;
  EXPECT_THROW(KvCache::allocate(config), Error);
  // A pool that fits, failing at its 5th allocation: the first four are freed.
  config.num_layers = 4;
  config.num_slots = 1 << 20;
  cuda::debug::limit_device_mallocs(4);
  EXPECT_THROW(KvCache::allocate(config), Error);
  cuda::debug::limit_device_mallocs(-1);
  EXPECT_LE(std::llabs((long long)free_bytes() - (long long)before), kMemorySlack);
  EXPECT_THROW(ReqToTokenPool::allocate(1 << 30, 1 << 30, Device::cuda(0)), Error);
  EXPECT_LE(std::llabs((long long)free_bytes() - (long long)before), kMemorySlack);
  expect_context_healthy("kv cache");
}

TEST(CudaAllocation, WorkspaceThatCannotGrowRefusesTheStepOnly) {
  REQUIRE_GPU();
  // A step of one request first (the workspaces fit it), then the whole batch, whose metadata
  // and index buffers must grow: the growth fails, the step is refused, nothing stays allocated,
  // and the next step (growth allowed again) is correct.
  ScenarioSpec large = small_decode(54);
  large.mode = ForwardMode::kExtend;
  large.batch_size = 16;
  large.max_kv_len = 400;
  large.max_q_len = 64;
  auto w = ScenarioWorld::build(large, BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  ForwardBatch one = w->batch;  // the first request alone
  one.batch_size = 1;
  one.req_pool_indices = one.req_pool_indices.slice0(0, 1);
  one.seq_lens = one.seq_lens.slice0(0, 1);
  if (one.seq_lens_cpu.defined()) one.seq_lens_cpu = one.seq_lens_cpu.slice0(0, 1);
  one.extend_prefix_lens = one.extend_prefix_lens.slice0(0, 1);
  if (one.extend_prefix_lens_cpu.defined())
    one.extend_prefix_lens_cpu = one.extend_prefix_lens_cpu.slice0(0, 1);
  one.extend_seq_lens = one.extend_seq_lens.slice0(0, 1);
  if (one.extend_seq_lens_cpu.defined())
    one.extend_seq_lens_cpu = one.extend_seq_lens_cpu.slice0(0, 1);
  one.seq_lens_sum = -1;
  one.out_cache_loc = TensorView();
  backend->init_forward_metadata(one);
  const size_t before = free_bytes();
  const uint64_t allocations_before = cuda::debug::device_malloc_count();
  cuda::debug::limit_device_mallocs(0);
  try {
    backend->init_forward_metadata(w->batch);
    ADD_FAILURE() << "the large step needed no growth (the test no longer tests growth)";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfResources) << e.what();
    std::printf("  refused: %s\n", e.what());
  }
  cuda::debug::limit_device_mallocs(-1);
  EXPECT_EQ(cuda::debug::device_malloc_count(), allocations_before);
  EXPECT_LE(std::llabs((long long)free_bytes() - (long long)before), kMemorySlack);
  const ScenarioCall& c = w->calls[0];
  EXPECT_THROW(backend->forward(c.q, c.k, c.v, c.out, w->layer, w->batch, true), Error)
      << "a forward of the refused step must be refused too";
  EXPECT_TRUE(w->pool_unchanged());
  backend->init_forward_metadata(w->batch);
  for (const ScenarioCall& call : w->calls) {
    backend->forward(call.q, call.k, call.v, call.out, w->layer, w->batch, true);
  }
  EXPECT_NO_THROW(backend->check_errors(true));
  const ScenarioResult r = judge_world(*w);
  EXPECT_TRUE(r.passed && r.kv_pool_ok) << r.detail;
  expect_context_healthy("workspace growth");
}

}  // namespace
}  // namespace kvattn::testing
