// The CUDA backend against the float64 reference: the standard scenario matrix, targeted decode
// cases (kv_len 0 / 1, page 1 shuffled and page 16, NaN in unused slots, partial last pages,
// split-KV, every head_dim / group / dtype), both decode kernels (CUDA cores and tensor cores),
// CUDA-graph capture and replay with lengths other than the captured ones, and bad device
// indices (the step writes nothing; check_errors reports it; see test_bad_index_cuda.cpp).
// Skips without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_test_support.h"
#include "cuda/kernels/decode.h"
#include "kvattn/kvattn.h"
#include "reference/float_format.h"
#include "reference/scenario.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

bool io_served_by_prefill(const ScenarioSpec& s) {
  const int vd = s.v_head_dim > 0 ? s.v_head_dim : s.head_dim;
  return s.q_dtype != DType::kFloat32 && vd == s.head_dim;
}

// Rows of the standard matrix the CUDA backend refuses with kNotSupported, each with its reason
// (unsupported_reason, src/reference/scenario_matrix.cpp). Every other row must run and pass: a
// NotSupported elsewhere fails the test, and a listed row that runs fails it too (the list is
// then out of date).
const char* cuda_unsupported_reason(const ScenarioSpec& s) {
  return unsupported_reason(s, BackendKind::kCuda);
}

// Runs a spec; returns whether it ran. kNotSupported is expected exactly where `unsupported`
// gives a reason.
bool run_and_expect(const ScenarioSpec& spec, const char* label, const char* unsupported) {
  ScenarioResult r;
  try {
    auto world = ScenarioWorld::build(spec, BackendKind::kCuda);
    run_world(*world, world->layer);
    r = judge_world(*world);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kNotSupported && unsupported != nullptr) {
      std::printf("  n/s   %-40s %s: %s\n", spec.variant.c_str(), label, e.what());
      return false;
    }
    ADD_FAILURE() << spec.variant << " [" << spec.shape_label() << "] " << label
                  << " threw: " << e.what();
    return false;
  }
  EXPECT_TRUE(unsupported == nullptr)
      << spec.variant << " ran, but is listed as not supported on CUDA (" << unsupported
      << "): update unsupported_reason";
  EXPECT_TRUE(r.passed) << spec.variant << " [" << spec.shape_label() << "] " << label << ": "
                        << r.detail << " (max_rel_err " << r.max_rel_err << ", tolerance "
                        << r.tolerance << ")";
  EXPECT_TRUE(r.kv_pool_ok) << spec.variant << " " << label << ": KV pool wrong: " << r.detail;
  std::printf("  %-5s %-40s %-9s %-34s err %.2e (tol %.0e)\n",
              r.passed && r.kv_pool_ok ? "ok" : "FAIL", spec.variant.c_str(), label,
              spec.shape_label().c_str(), r.max_rel_err, r.tolerance);
  return true;
}

// Host only (runs without a device): which decode-shaped tile a call is planned on. The
// transposed 8-row tile for at most 8 packed rows a request, the narrow 16-row tile up to 16
// rows, the 32-row tile above; each off when the setup lacks it.
TEST(CudaTilePlanShape, DecodeShapedTilesByRowsAndMask) {
  cuda::DecodeSetup setup;
  setup.tc_decode = true;
  setup.tc_decode_tile_rows = 32;
  setup.tc_decode_kv_tile = 64;
  setup.tc_decode_narrow_rows = 16;
  setup.tc_decode_transposed_rows = 8;
  BackendConfig config;
  config.num_q_heads = 32;
  config.num_kv_heads = 8;  // group 4
  auto rows_of = [&](core::MaskMode mask, int q_len) {
    return cuda::prefill_tile_shape(setup, config, mask, -1, /*tc=*/true, 16, q_len).tile_rows;
  };
  EXPECT_EQ(rows_of(core::MaskMode::kNone, 1), 8);     // decode
  EXPECT_EQ(rows_of(core::MaskMode::kCausal, 2), 8);   // MTP decode of 2 tokens
  EXPECT_EQ(rows_of(core::MaskMode::kCustom, 2), 8);   // a draft step of topk 2
  EXPECT_EQ(rows_of(core::MaskMode::kCausal, 3), 16);  // 12 rows
  EXPECT_EQ(rows_of(core::MaskMode::kCustom, 8), 32);  // verify: 8 tokens x 4 heads
  config.num_q_heads = 64;                             // group 8: one tile of 8 rows
  EXPECT_EQ(rows_of(core::MaskMode::kNone, 1), 8);
  EXPECT_EQ(rows_of(core::MaskMode::kNone, 2), 16);
  setup.tc_decode_transposed_rows = 0;  // KVATTN_TC_DECODE_TRANSPOSED=0
  EXPECT_EQ(rows_of(core::MaskMode::kNone, 1), 16);
}

TEST(CudaScenarios, StandardMatrix) {
  REQUIRE_GPU();
  TensorCoreChoice choice(nullptr);
  int ran = 0;
  int expected_unsupported = 0;
  const std::vector<ScenarioSpec> rows = standard_scenarios(7);
  for (const ScenarioSpec& spec : rows) {
    const char* unsupported = cuda_unsupported_reason(spec);
    if (unsupported != nullptr) ++expected_unsupported;
    if (run_and_expect(spec, "auto", unsupported)) ++ran;
  }
  std::printf("standard matrix: %d of %zu rows ran, %d not supported on CUDA (listed)\n", ran,
              rows.size(), expected_unsupported);
  EXPECT_EQ(ran + expected_unsupported, int(rows.size()));
}

// A step with no cached prefix takes the ragged path at any size (core::use_ragged_extend): with
// the step's k/v it attends them directly; an engine that wrote the K/V itself and passes none
// must get the paged pass over the cache instead, with the same answers.
TEST(CudaScenarios, PrefixFreeExtendWithAndWithoutKv) {
  REQUIRE_GPU();
  ScenarioSpec spec;
  spec.variant = "prefix-free extend";
  spec.mode = ForwardMode::kExtend;
  spec.batch_size = 3;
  spec.min_kv_len = 1;
  spec.max_kv_len = 700;
  spec.min_q_len = spec.max_q_len = 1 << 20;  // every request's whole sequence is new
  spec.allow_tiny = false;
  spec.seed = 23;
  for (const bool with_kv : {true, false}) {
    SCOPED_TRACE(with_kv ? "k/v passed (ragged)" : "no k/v (paged)");
    spec.save_kv_cache = with_kv;  // false: the world writes the K/V into the pool beforehand
    auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
    ASSERT_TRUE(w->ragged) << "the scenario must predict the ragged path for a prefix-free step";
    if (!with_kv) {
      for (ScenarioCall& c : w->calls) c.k = c.v = TensorView();
    }
    run_world(*w, w->layer);
    const ScenarioResult r = judge_world(*w);
    EXPECT_TRUE(r.passed) << r.detail;
  }
}

TEST(CudaScenarios, DecodeRowsOnBothKernels) {
  REQUIRE_GPU();
  for (const char* forced : {"0", "1"}) {
    TensorCoreChoice choice(forced);
    for (const ScenarioSpec& spec : standard_scenarios(11)) {
      if (spec.mode != ForwardMode::kDecode) continue;
      run_and_expect(spec, forced[0] == '0' ? "cuda-core" : "tensor",
                     cuda_unsupported_reason(spec));
    }
  }
}

// ---- targeted decode cases ---------------------------------------------------------------------

ScenarioSpec decode_base(const char* variant, uint64_t seed) {
  ScenarioSpec s;
  s.variant = variant;
  s.mode = ForwardMode::kDecode;
  s.batch_size = 9;
  s.min_kv_len = 1;
  s.max_kv_len = 300;
  s.num_q_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  s.seed = seed;
  return s;
}

std::vector<ScenarioSpec> decode_cases() {
  std::vector<ScenarioSpec> rows;
  uint64_t seed = 100;
  auto add = [&](const char* variant, auto change) {
    ScenarioSpec s = decode_base(variant, ++seed);
    change(s);
    rows.push_back(s);
  };
  add("tiny lengths 0/1, page 1 shuffled", [](ScenarioSpec& s) { s.max_kv_len = 40; });
  add("page 16, partial last pages", [](ScenarioSpec& s) {
    s.page_size = 16;
    s.min_kv_len = 17;
    s.max_kv_len = 333;
  });
  add("page 16 contiguous", [](ScenarioSpec& s) {
    s.page_size = 16;
    s.shuffled_slots = false;
  });
  add("split-KV single long request", [](ScenarioSpec& s) {
    s.batch_size = 1;
    s.allow_tiny = false;
    s.min_kv_len = 20000;
    s.max_kv_len = 33000;
  });
  add("split-KV uneven batch", [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.min_kv_len = 0;
    s.max_kv_len = 12000;
  });
  add("soft-cap 30", [](ScenarioSpec& s) { s.logit_cap = 30.f; });
  add("fp8 e4m3 scaled", [](ScenarioSpec& s) {
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.5f;
    s.v_scale = 2.f;
  });
  add("fp8 e5m2 split", [](ScenarioSpec& s) {
    s.kv_dtype = DType::kFloat8E5M2;
    s.batch_size = 2;
    s.max_kv_len = 6000;
  });
  add("fp16 io and KV", [](ScenarioSpec& s) {
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });
  add("fp32 io", [](ScenarioSpec& s) { s.q_dtype = DType::kFloat32; });
  add("head_dim 64", [](ScenarioSpec& s) { s.head_dim = 64; });
  add("head_dim 256 split", [](ScenarioSpec& s) {
    s.head_dim = 256;
    s.batch_size = 2;
    s.max_kv_len = 5000;
  });
  add("head_dim 128, v_head_dim 64", [](ScenarioSpec& s) { s.v_head_dim = 64; });
  add("head_dim 96 (runs the 128 instance)", [](ScenarioSpec& s) { s.head_dim = 96; });
  add("MHA group 1", [](ScenarioSpec& s) { s.num_q_heads = 8; });
  add("group 8 (two head passes)", [](ScenarioSpec& s) { s.num_q_heads = 64; });
  add("group 6 (partial pass)", [](ScenarioSpec& s) { s.num_q_heads = 48; });
  add("MQA 16/1", [](ScenarioSpec& s) {
    s.num_q_heads = 16;
    s.num_kv_heads = 1;
  });
  add("window 100, page 16", [](ScenarioSpec& s) {
    s.sliding_window = 100;
    s.page_size = 16;
    s.max_kv_len = 2000;
  });
  add("cross-attention layer", [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.save_kv_cache = false;
  });
  add("no save (K/V pre-written)", [](ScenarioSpec& s) { s.save_kv_cache = false; });
  add("multi-step draft topk 2 x 3", [](ScenarioSpec& s) {
    s.topk = 2;
    s.num_steps = 3;
    s.batch_size = 3;
  });
  add("large batch", [](ScenarioSpec& s) {
    s.batch_size = 150;
    s.max_kv_len = 700;
  });
  return rows;
}

TEST(CudaDecode, TargetedCasesCudaCoreKernel) {
  REQUIRE_GPU();
  TensorCoreChoice choice("0");
  for (const ScenarioSpec& spec : decode_cases()) run_and_expect(spec, "cuda-core", nullptr);
}

TEST(CudaDecode, TargetedCasesTensorCoreKernel) {
  REQUIRE_GPU();
  TensorCoreChoice choice("1");
  for (const ScenarioSpec& spec : decode_cases()) {
    // Rows the prefill kernel cannot serve fall back to the CUDA-core kernel (covered above).
    if (!io_served_by_prefill(spec)) continue;
    run_and_expect(spec, "tensor", nullptr);
  }
}

// A short case for compute-sanitizer (memcheck / racecheck): small, both kernels, split and not.
TEST(CudaDecode, SanitizerSmoke) {
  REQUIRE_GPU();
  TensorCoreChoice choice("0");
  ScenarioSpec s = decode_base("sanitizer smoke", 77);
  s.batch_size = 3;
  s.max_kv_len = 1500;
  s.page_size = 16;
  run_and_expect(s, "cuda-core", nullptr);
  s.batch_size = 1;
  s.allow_tiny = false;
  s.min_kv_len = 4000;
  s.max_kv_len = 5000;
  s.page_size = 1;
  run_and_expect(s, "split", nullptr);
}

// Split requests (partials in a reused scratch buffer, merged by a programmatic-dependent launch):
// every relaunch over a poisoned output must write the whole output again.
TEST(CudaDecode, SplitMergeRunsOnEveryLaunch) {
  REQUIRE_GPU();
  TensorCoreChoice choice("0");
  ScenarioSpec spec = decode_base("split merge on every launch", 909);
  spec.batch_size = 3;
  spec.allow_tiny = false;
  spec.min_kv_len = 3000;
  spec.max_kv_len = 9000;
  spec.save_kv_cache = false;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  backend->init_forward_metadata(w->batch);
  const ScenarioCall& c = w->calls[0];
  for (int launch = 0; launch < 4; ++launch) {
    CUDA_OK(cudaMemset(c.out.data(), 0xff, size_t(c.out.nbytes())));  // NaN in every element
    backend->forward(c.q, c.k, c.v, c.out, w->layer, w->batch, false);
    CUDA_OK(cudaDeviceSynchronize());
    const ScenarioResult r = judge_world(*w);
    EXPECT_TRUE(r.passed) << "launch " << launch << ": " << r.detail << " (max_rel_err "
                          << r.max_rel_err << ")";
  }
}

// The planner and the bandwidth both assume 4 resident CTAs per SM at head_dim 128 (registers
// <= 128, 48 KB of shared memory each): a change that loses one shows up here first.
TEST(CudaDecode, KernelKeepsFourCtasPerSm) {
  REQUIRE_GPU();
  const cuda::DecodeKernelInfo info = cuda::decode_kernel_info(128, 128, DType::kBFloat16, 4, 0);
  EXPECT_EQ(info.compiled_head_dim, 128);
  EXPECT_GE(info.ctas_per_sm, 4);
  EXPECT_EQ(info.head_passes, 1);
}

// ---- CUDA graphs --------------------------------------------------------------------------------

// Captures init_forward_metadata_in_graph + forward planned for a batch of all-1 lengths, then
// replays it after planning the real lengths: the captured grids must cover any later plan for
// the same batch size (split-KV included).
TEST(CudaDecode, GraphReplayWithOtherLengths) {
  REQUIRE_GPU();
  TensorCoreChoice choice("0");
  ScenarioSpec spec = decode_base("graph replay", 555);
  spec.batch_size = 4;
  spec.min_kv_len = 1;
  spec.max_kv_len = 9000;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  w->config.cuda_stream = stream;
  auto backend = make_backend(BackendKind::kCuda, w->config);
  backend->init_cuda_graph_state(/*max_bs=*/8, /*max_num_tokens=*/8);

  // Capture-time batch: same tensors, host lengths all 1.
  ForwardBatch capture_batch = w->batch;
  std::vector<int32_t> ones(size_t(spec.batch_size), 1);
  capture_batch.seq_lens_cpu =
      TensorView(ones.data(), DType::kInt32, Device::cpu(), {spec.batch_size});
  capture_batch.seq_lens_sum = -1;
  const ScenarioCall& c = w->calls[0];
  backend->init_forward_metadata_out_graph(capture_batch, /*in_capture=*/true);
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  backend->init_forward_metadata_in_graph(capture_batch);
  backend->forward(c.q, c.k, c.v, c.out, w->layer, capture_batch, spec.save_kv_cache);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  // Replay with the real lengths.
  backend->init_forward_metadata_out_graph(w->batch, /*in_capture=*/false);
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const ScenarioResult r = judge_world(*w);
  EXPECT_TRUE(r.passed) << r.detail << " (max_rel_err " << r.max_rel_err << ")";
  EXPECT_TRUE(r.kv_pool_ok) << r.detail;
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  backend.reset();
  CUDA_OK(cudaStreamDestroy(stream));
}

// ---- bad device indices ----------------------------------------------------------------------

TEST(CudaDecode, BadSlotInReqToTokenIsReportedNotRead) {
  REQUIRE_GPU();
  TensorCoreChoice choice("0");
  ScenarioSpec spec = decode_base("bad slot", 901);
  spec.allow_tiny = false;
  spec.min_kv_len = 20;
  spec.max_kv_len = 50;
  spec.save_kv_cache = false;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  // Request 0's token 3 now names a slot far outside the pool.
  const int row = w->ref_batch.req_pool_indices.at(0);
  const int32_t bad[1] = {int32_t(w->kv_cache->num_slots() + 1000000)};
  w->req_to_token_pool->write(row, 3, bad);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  backend->init_forward_metadata(w->batch);
  const ScenarioCall& c = w->calls[0];
  backend->forward(c.q, c.k, c.v, c.out, w->layer, w->batch, false);
  try {
    backend->check_errors(/*synchronize=*/true);
    ADD_FAILURE() << "the bad slot was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.argument(), "req_to_token[" + std::to_string(row) + "][3]") << e.what();
    EXPECT_EQ(e.step(), int64_t(backend->step_id()));
  }
  // Reported once, and never by a later step's calls.
  EXPECT_NO_THROW(backend->check_errors(true));
  EXPECT_NO_THROW(backend->init_forward_metadata(w->batch));
  EXPECT_TRUE(w->pool_unchanged());
}

TEST(CudaDecode, BadDeviceCacheLocIsReportedAndNothingWritten) {
  REQUIRE_GPU();
  ScenarioSpec spec = decode_base("bad loc", 902);
  spec.batch_size = 3;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  // A device out_cache_loc with slots outside the pool (the host cannot check it).
  ForwardBatch batch = w->batch;
  batch.out_cache_loc =
      w->index_tensor({1, -5, w->kv_cache->num_slots() + 7}, DType::kInt64, w->device);
  backend->init_forward_metadata(batch);
  const ScenarioCall& c = w->calls[0];
  backend->forward(c.q, c.k, c.v, c.out, w->layer, batch, true);
  try {
    backend->check_errors(true);
    ADD_FAILURE() << "not reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "out_cache_loc[1]") << e.what();
  }
  // Every byte of every layer's K and V is as built: slot 1 is valid, but the step was refused
  // as a whole (issue 13: a bad step writes nothing).
  EXPECT_TRUE(w->pool_unchanged()) << "the refused step wrote into the pool";
  EXPECT_NO_THROW(backend->check_errors(true)) << "reported twice";
  EXPECT_NO_THROW(backend->init_forward_metadata(w->batch)) << "a later step failed by it";
}

TEST(CudaDecode, ForwardBeforeMetadataIsRefused) {
  REQUIRE_GPU();
  ScenarioSpec spec = decode_base("order", 903);
  spec.batch_size = 2;
  auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
  auto backend = make_backend(BackendKind::kCuda, w->config);
  const ScenarioCall& c = w->calls[0];
  EXPECT_THROW(backend->forward(c.q, c.k, c.v, c.out, w->layer, w->batch, true), Error);
  EXPECT_TRUE(w->pool_unchanged());
}

}  // namespace
}  // namespace kvattn::testing
