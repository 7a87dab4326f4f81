// Shared-prefix (cascade) steps on the CUDA backend (issue 16; src/cuda/cascade.h): groups the
// engine declares run the shared keys once per group and merge with each request's own keys.
// The check matrix (CudaScenarios.StandardMatrix, "declared groups" rows) compares them with the
// float64 reference, and the bad-index table (BadIndexOnCuda, "declared group" cases) refuses a
// broken promise once and runs the next good step. Here: the shape at small scale (many
// members, one long prefix: split tiles in the shared call), both decode kernels for the own
// call, steps with groups on a backend that holds CUDA-graph buffers (they run eagerly beside
// the graph pool), and the refusal to capture them. Skips without a CUDA device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "core/batch_layout.h"
#include "core/cascade.h"
#include "cuda/cascade.h"
#include "cuda/cuda_test_support.h"
#include "kvattn/kvattn.h"
#include "reference/scenario.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

// Many requests of one long prompt (most of them in the group, a quarter out of it). Sized so
// that the shared call splits its tiles but a world builds in a second or two: at 64 x 2000 keys
// the host-side world (pool fill, float64 reference) took tens of seconds on the H200's host.
ScenarioSpec many_members(uint64_t seed) {
  ScenarioSpec s;
  s.variant = "cascade many members";
  s.mode = ForwardMode::kDecode;
  s.batch_size = 24;
  s.min_kv_len = 1100;
  s.max_kv_len = 1200;
  s.allow_tiny = false;
  s.num_q_heads = 32;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  s.declared_groups = 1;
  s.seed = seed;
  return s;
}

void run_and_judge(ScenarioWorld& w, AttentionBackend& backend, const std::string& label) {
  backend.init_forward_metadata(w.batch);
  for (const ScenarioCall& c : w.calls) {
    backend.forward(c.q, c.k, c.v, c.out, w.layer, w.batch, w.spec.save_kv_cache);
  }
  EXPECT_NO_THROW(backend.check_errors(/*synchronize=*/true)) << label;
  const ScenarioResult r = judge_world(w);
  EXPECT_TRUE(r.passed && r.kv_pool_ok)
      << label << ": " << r.detail << " (max_rel_err " << r.max_rel_err << ", tolerance "
      << r.tolerance << ")";
  std::printf("  %-5s %-46s err %.2e (tol %.0e)\n", r.passed ? "ok" : "FAIL", label.c_str(),
              r.max_rel_err, r.tolerance);
}

TEST(CudaCascade, ManyMembersOfOneLongPrefixOnBothDecodeKernels) {
  REQUIRE_GPU();
  for (const char* kernel : {"0", "1"}) {
    TensorCoreChoice choice(kernel);
    for (int page : {1, 16}) {
      ScenarioSpec spec = many_members(page == 1 ? 11 : 12);
      spec.page_size = page;
      auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
      auto backend = make_backend(BackendKind::kCuda, w->config);
      run_and_judge(*w, *backend,
                    std::string("page ") + std::to_string(page) + ", tensor cores " + kernel);
    }
  }
}

// A backend with CUDA-graph buffers: a batch of a captured size with groups runs eagerly (its
// cascade calls beside the graph pool), and asking to capture it is refused, naming why; the
// backend then serves the next steps as before.
TEST(CudaCascade, GroupsRunEagerlyOnAGraphBackendAndCaptureIsRefused) {
  REQUIRE_GPU();
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify}) {
    ScenarioSpec spec;
    spec.variant = "cascade graph backend";
    spec.mode = mode;
    spec.batch_size = 9;
    spec.min_kv_len = 30;
    spec.max_kv_len = 400;
    spec.declared_groups = 2;
    spec.num_q_heads = 16;
    spec.num_kv_heads = 4;
    spec.seed = mode == ForwardMode::kDecode ? 21 : 22;
    if (mode == ForwardMode::kTargetVerify) spec.draft_token_num = 4;
    const std::string label = forward_mode_name(mode);
    auto w = ScenarioWorld::build(spec, BackendKind::kCuda);
    auto backend = make_backend(BackendKind::kCuda, w->config);
    const int tokens = spec.batch_size * std::max(1, spec.draft_token_num);
    backend->init_cuda_graph_state(spec.batch_size, tokens);
    run_and_judge(*w, *backend, label + " eager on a graph backend");

    // Capturing a step with groups: refused by out_graph ...
    try {
      backend->init_forward_metadata_out_graph(w->batch, /*in_capture=*/true);
      ADD_FAILURE() << label << ": capturing a step with groups was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(int(e.kind()), int(ErrorKind::kNotSupported)) << e.what();
      EXPECT_NE(std::string(e.what()).find("shared_prefix_group_cpu"), std::string::npos)
          << e.what();
    }
    // ... and by in_graph when the capture begins after an eager out_graph.
    cudaStream_t stream = nullptr;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    backend->set_cuda_stream(stream);
    backend->init_forward_metadata_out_graph(w->batch, /*in_capture=*/false);
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    bool refused = false;
    try {
      backend->init_forward_metadata_in_graph(w->batch);
    } catch (const Error& e) {
      refused = e.kind() == ErrorKind::kNotSupported;
      EXPECT_TRUE(refused) << e.what();
    }
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    if (graph != nullptr) cudaGraphDestroy(graph);
    EXPECT_TRUE(refused) << label << ": in_graph captured a step with groups";

    // The next step, without groups, on the same backend and stream: still right.
    w->batch.shared_prefix_group_cpu = TensorView();
    w->batch.shared_prefix_lens_cpu = TensorView();
    run_and_judge(*w, *backend, label + " next step without groups");
    backend->set_cuda_stream(nullptr);
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// Host only (runs without a device): the two layouts of a cascade step from the step's full
// layout and the declared groups.
TEST(CudaCascadeHost, LayoutsOfDeclaredGroups) {
  core::HostLengths lens;
  lens.seq_lens = {50, 60, 70, 80, 0, 100};
  lens.groups_declared = true;
  lens.shared_group = {1, -1, 0, 1, -1, 0};
  lens.shared_prefix_lens = {40, 25};
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify}) {
    const bool verify = mode == ForwardMode::kTargetVerify;
    const int draft = verify ? 3 : 0;
    const core::PagedLayout full =
        core::make_paged_layout(mode, core::IndexSet::kFull, -1, lens, draft);
    cuda::CascadeStep step;
    cuda::make_cascade_layouts(step, core::declared_cascade_plan(lens), full);
    const int q = verify ? 3 : 1;
    // Group 0: requests 2 and 5 over 40 keys; group 1: requests 0 and 3 over 25.
    const core::PagedLayout& shared = step.shared.layout;
    EXPECT_EQ(shared.batch_size, 2);
    EXPECT_EQ(shared.qo_indptr, (std::vector<int32_t>{0, 2 * q, 4 * q}));
    EXPECT_EQ(shared.kv_start, (std::vector<int32_t>{0, 0}));
    EXPECT_EQ(shared.kv_len, (std::vector<int32_t>{40, 25}));
    EXPECT_EQ(shared.kv_indptr, (std::vector<int64_t>{0, 40, 65}));
    EXPECT_EQ(int(shared.mask), int(core::MaskMode::kNone));
    EXPECT_EQ(step.shared_tokens, 4 * q);
    EXPECT_EQ(step.num_tokens, 6 * q);
    EXPECT_EQ(step.max_shared_len, 40);
    // Every request over its own keys: members past their group's shared ones.
    const core::PagedLayout& own = step.own.layout;
    const std::vector<int32_t> skip = {25, 0, 40, 25, 0, 40};
    int64_t keys = 0;
    for (int r = 0; r < 6; ++r) {
      EXPECT_EQ(own.kv_start[size_t(r)], skip[size_t(r)]) << r;
      EXPECT_EQ(own.kv_len[size_t(r)], full.kv_len[size_t(r)] - skip[size_t(r)]) << r;
      keys += own.kv_len[size_t(r)];
      EXPECT_EQ(own.kv_indptr[size_t(r) + 1], keys) << r;
    }
    EXPECT_EQ(own.qo_indptr, full.qo_indptr);
    EXPECT_EQ(own.mask_indptr, full.mask_indptr);  // verify: the step's mask, as it is
    EXPECT_EQ(int(own.mask), int(full.mask));
  }
}

}  // namespace
}  // namespace kvattn::testing
