// Bad input (SPEC §5) on any backend, one test per rule: every public entry point answers with a
// kvattn::Error of the right kind whose message names the argument at fault, and the KV pool is
// byte for byte what it was (bad input never corrupts the pool, not even partly).
//
// The suite is parameterised by the backend: tests/cpu/test_bad_input.cpp instantiates it for the
// CPU backend, tests/cuda/test_cuda_bad_input.cpp for the CUDA backend (skipped without a GPU).
// One rule differs in *when*, not in what: index contents that live on the device
// (req_pool_indices, out_cache_loc, encoder_out_cache_loc, req_to_token) cannot be read by the
// host without a synchronisation, so the CUDA backend checks them on the device before the step
// writes anything, refuses the whole step (nothing written) and reports it through
// check_errors(), attributed to that step; the CPU backend reads them on the host and rejects the
// call itself. Both name the same argument with the same kind. expect_bad_index_reported checks
// whichever applies (kvattn/backend.h, "Bad indices refuse the whole step").
//
// Include this header from exactly one test file of a binary, then INSTANTIATE_TEST_SUITE_P(...,
// BadInput, ::testing::Values(BackendKind::...)).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "kvattn/kvattn.h"
#include "reference/scenario.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

ScenarioSpec bad_input_spec(ForwardMode mode) {
  ScenarioSpec spec;
  spec.variant = "bad input";
  spec.mode = mode;
  spec.batch_size = 3;
  spec.max_kv_len = 60;
  spec.max_q_len = 9;
  spec.allow_tiny = false;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.seed = 5;
  if (mode == ForwardMode::kTargetVerify) spec.draft_token_num = 3;
  return spec;
}

// One whole step as an engine runs it: make the backend, plan, run every call.
void run_step(ScenarioWorld& w) { run_world(w, w.layer); }

// Runs `step`, which must throw kvattn::Error of `kind` naming `argument` (in argument() and in
// the message), and checks that the KV pool did not change.
void expect_rejected(ScenarioWorld& w, const std::function<void()>& step,
                     const std::string& argument,
                     ErrorKind kind = ErrorKind::kInvalidArgument) {
  ASSERT_FALSE(argument.empty()) << "name the argument the error must name";
  try {
    step();
    ADD_FAILURE() << "accepted bad " << argument;
  } catch (const Error& e) {
    if (std::getenv("KVATTN_TEST_VERBOSE")) std::printf("  rejected: %s\n", e.what());
    EXPECT_EQ(int(e.kind()), int(kind)) << e.what();
    EXPECT_NE(e.argument().find(argument), std::string::npos)
        << "argument() is '" << e.argument() << "', expected it to name " << argument << " ("
        << e.what() << ")";
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-kvattn exception for bad " << argument << ": " << e.what();
  }
  EXPECT_TRUE(w.pool_unchanged()) << "the KV pool changed on bad " << argument;
}

void expect_rejected(ScenarioWorld& w, const std::string& argument,
                     ErrorKind kind = ErrorKind::kInvalidArgument) {
  expect_rejected(w, [&] { run_step(w); }, argument, kind);
}

// The values of an index tensor wherever it lives.
std::vector<int64_t> values_of(const TensorView& t) {
  std::vector<int64_t> out;
  if (t.device().is_cpu()) {
    for (int64_t i = 0; i < t.size(0); ++i) out.push_back(read_index(t, i));
    return out;
  }
  const std::vector<uint8_t> bytes = ScenarioWorld::download(t);
  for (int64_t i = 0; i < t.size(0); ++i) {
    if (t.dtype() == DType::kInt64) {
      int64_t v = 0;
      std::memcpy(&v, bytes.data() + i * 8, 8);
      out.push_back(v);
    } else {
      int32_t v = 0;
      std::memcpy(&v, bytes.data() + i * 4, 4);
      out.push_back(v);
    }
  }
  return out;
}

// Replaces a length tensor and its host copy (when the world gave one).
void set_lengths(ScenarioWorld& w, TensorView& device_view, TensorView& host_view,
                 const std::vector<int64_t>& values) {
  device_view = w.index_tensor(values, w.index_dtype, w.device);
  if (host_view.defined()) host_view = w.index_tensor(values, w.index_dtype, Device::cpu());
}

// Slots whose bytes differ from the build in any layer, K or V.
std::set<int64_t> changed_slots(const ScenarioWorld& w) {
  std::set<int64_t> changed;
  const int elem = dtype_size(w.kv_cache->config().dtype);
  for (int layer = 0; layer < w.kv_cache->num_layers(); ++layer) {
    for (int which = 0; which < 2; ++which) {
      const std::vector<uint8_t> now = w.pool_bytes(layer, which);
      const std::vector<uint8_t>& before = w.pool_bytes_before[size_t(layer)][size_t(which)];
      const int dim = which == 0 ? w.ref_pool.head_dim : w.ref_pool.v_head_dim;
      const size_t slot_bytes = size_t(w.ref_pool.num_kv_heads) * dim * elem;
      for (int64_t slot = 0; slot < w.ref_pool.num_slots; ++slot) {
        if (std::memcmp(now.data() + slot * slot_bytes, before.data() + slot * slot_bytes,
                        slot_bytes) != 0)
          changed.insert(slot);
      }
    }
  }
  return changed;
}

// Bad index contents (see the top of this file): the step is refused as a whole, with
// `argument` named (in argument() and the message), and the KV pool stays byte for byte what it
// was. The CPU backend throws from the call; the CUDA backend runs the step (its calls throw
// nothing), and check_errors() reports it once, attributed to the step; a later call is not
// failed by it.
void expect_bad_index_reported(ScenarioWorld& w, const std::string& argument) {
  if (w.kind == BackendKind::kCpu) {
    expect_rejected(w, argument);
    return;
  }
  std::unique_ptr<MultiStepDraftBackend> draft;
  std::unique_ptr<AttentionBackend> backend;
  auto plan = [&] {
    if (w.multi_step) {
      draft->init_forward_metadata(w.batch);
    } else {
      backend->init_forward_metadata(w.batch);
    }
  };
  auto check_errors = [&] {
    if (w.multi_step) {
      draft->check_errors(/*synchronize=*/true);
    } else {
      backend->check_errors(/*synchronize=*/true);
    }
  };
  uint64_t step = 0;
  try {
    if (w.multi_step) {
      draft = std::make_unique<MultiStepDraftBackend>(w.kind, w.config, w.spec.topk,
                                                      w.spec.num_steps);
    } else {
      backend = make_backend(w.kind, w.config);
    }
    plan();
    step = w.multi_step ? draft->step_id() : backend->step_id();
    for (size_t i = 0; i < w.calls.size(); ++i) {
      const ScenarioCall& c = w.calls[i];
      if (w.multi_step) {
        draft->forward_step(int(i), c.q, c.k, c.v, c.out, w.layer, c.out_cache_loc);
      } else {
        backend->forward(c.q, c.k, c.v, c.out, w.layer, w.batch, w.spec.save_kv_cache);
      }
    }
  } catch (const Error& e) {
    ADD_FAILURE() << "a call threw for bad " << argument
                  << " (device indices are reported by check_errors): " << e.what();
    return;
  }
  try {
    check_errors();
    ADD_FAILURE() << "the bad " << argument << " was not reported by check_errors";
  } catch (const Error& e) {
    if (std::getenv("KVATTN_TEST_VERBOSE")) std::printf("  reported: %s\n", e.what());
    EXPECT_EQ(int(e.kind()), int(ErrorKind::kInvalidArgument)) << e.what();
    EXPECT_NE(e.argument().find(argument), std::string::npos)
        << "argument() is '" << e.argument() << "', expected it to name " << argument;
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos) << e.what();
    EXPECT_EQ(e.step(), int64_t(step)) << e.what();
  }
  EXPECT_TRUE(w.pool_unchanged()) << "the KV pool changed on bad " << argument
                                  << " (slots changed: " << changed_slots(w).size() << ")";
  EXPECT_NO_THROW(check_errors()) << "reported twice";
  EXPECT_NO_THROW(plan()) << "a later call failed by the refused step";
}

/// Test names end in the backend ("Cpu/BadInput.Shapes/cpu").
std::string backend_param_name(const ::testing::TestParamInfo<BackendKind>& info) {
  return backend_kind_name(info.param);
}

class BadInput : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    if (kind() == BackendKind::kCuda && (!cuda_compiled() || cuda_device_count() == 0))
      GTEST_SKIP() << "no CUDA device";
  }
  BackendKind kind() const { return GetParam(); }
  bool cuda() const { return kind() == BackendKind::kCuda; }
  /// A device the backend's tensors are not on.
  Device other_device() const { return cuda() ? Device::cpu() : Device::cuda(0); }
  std::unique_ptr<ScenarioWorld> world(ForwardMode mode,
                                       const std::function<void(ScenarioSpec&)>& change = {}) {
    ScenarioSpec spec = bad_input_spec(mode);
    if (change) change(spec);
    return ScenarioWorld::build(spec, kind());
  }
};

TEST_P(BadInput, WorldsAreValidToBeginWith) {
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend,
                           ForwardMode::kTargetVerify}) {
    std::unique_ptr<ScenarioWorld> w = world(mode);
    EXPECT_NO_THROW(run_step(*w)) << forward_mode_name(mode);
    const ScenarioResult r = judge_world(*w);
    EXPECT_TRUE(r.passed) << forward_mode_name(mode) << ": " << r.detail;
  }
  // The verify world of VerifyPositions (a window model) too.
  auto w = world(ForwardMode::kTargetVerify, [](ScenarioSpec& s) { s.sliding_window = 8; });
  EXPECT_NO_THROW(run_step(*w));
  EXPECT_TRUE(judge_world(*w).passed);
}

TEST_P(BadInput, Shapes) {
  {
    auto w = world(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    c.q = c.q.slice0(0, c.q.size(0) - 1);  // one token short
    expect_rejected(*w, "q");
  }
  {
    auto w = world(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.out = TensorView(c.out.data(), c.out.dtype(), c.out.device(),
                       {c.out.size(0), int64_t(w->spec.num_q_heads), 32});  // wrong v dim
    expect_rejected(*w, "out");
  }
  {
    auto w = world(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    c.k = TensorView(c.k.data(), c.k.dtype(), c.k.device(),
                     {c.k.size(0), 1, int64_t(w->spec.head_dim)});  // one kv head, not two
    expect_rejected(*w, "k");
  }
  {
    auto w = world(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.v = c.v.slice0(0, c.v.size(0) - 2);
    expect_rejected(*w, "v");
  }
  {
    auto w = world(ForwardMode::kDecode);
    w->batch.seq_lens = w->index_tensor({5, 6}, w->index_dtype, w->device);  // 2 of 3
    w->batch.seq_lens_cpu = TensorView();
    expect_rejected(*w, "seq_lens");
  }
  {
    auto w = world(ForwardMode::kDecode);
    w->batch.out_cache_loc = w->batch.out_cache_loc.slice0(0, 2);
    expect_rejected(*w, "out_cache_loc");
  }
}

TEST_P(BadInput, Dtypes) {
  {
    auto w = world(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    const int64_t tokens = c.q.size(0);
    c.q = TensorView(c.q.data(), DType::kFloat16, c.q.device(),
                     {tokens, int64_t(w->spec.num_q_heads), int64_t(w->spec.head_dim)});
    expect_rejected(*w, "q");
  }
  {
    auto w = world(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.out = TensorView(c.out.data(), DType::kFloat32, c.out.device(),
                       {c.out.size(0), int64_t(w->spec.num_q_heads) * w->spec.head_dim / 2});
    expect_rejected(*w, "out");
  }
  {
    auto w = world(ForwardMode::kDecode);
    const TensorView& s = w->batch.req_pool_indices;
    w->batch.req_pool_indices = TensorView(s.data(), DType::kFloat32, s.device(), {s.size(0)});
    expect_rejected(*w, "req_pool_indices");
  }
  {
    auto w = world(ForwardMode::kTargetVerify);
    TensorView& m = w->batch.spec.custom_mask;
    m = TensorView(m.data(), DType::kInt32, m.device(), {m.size(0) / 4});
    expect_rejected(*w, "spec.custom_mask");
  }
}

TEST_P(BadInput, HeadDivisibility) {
  auto w = world(ForwardMode::kDecode);
  BackendConfig config = w->config;
  config.num_q_heads = 5;  // not a multiple of 2 kv heads
  expect_rejected(*w, [&] { make_backend(kind(), config); }, "num_q_heads");
  // A layer that disagrees with the backend's heads.
  AttentionLayer layer = w->layer;
  layer.num_q_heads = 6;
  expect_rejected(*w, [&] { run_world(*w, layer); }, "layer.num_q_heads");
  layer = w->layer;
  layer.num_kv_heads = 1;
  expect_rejected(*w, [&] { run_world(*w, layer); }, "layer.num_kv_heads");
  layer = w->layer;
  layer.head_dim = 128;
  expect_rejected(*w, [&] { run_world(*w, layer); }, "layer.head_dim");
}

TEST_P(BadInput, ReqPoolIndicesRange) {
  for (int64_t bad : {-1, 1000}) {
    auto w = world(ForwardMode::kDecode);
    std::vector<int64_t> rows = values_of(w->batch.req_pool_indices);
    rows[2] = bad;
    w->batch.req_pool_indices = w->index_tensor(rows, w->index_dtype, w->device);
    // The CPU backend names the entry; a device kernel only knows that one was bad.
    expect_bad_index_reported(*w, "req_pool_indices[2]");
  }
}

TEST_P(BadInput, OutCacheLocRange) {
  // The last slot is out of the pool: nothing may be written, not even the valid slots first.
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
    for (int64_t bad : {-3, 1 << 30}) {
      auto w = world(mode);
      std::vector<int64_t> loc = values_of(w->batch.out_cache_loc);
      loc.back() = bad == -3 ? -3 : w->kv_cache->num_slots();
      w->batch.out_cache_loc = w->index_tensor(loc, w->index_dtype, w->device);
      expect_bad_index_reported(*w, "out_cache_loc[" + std::to_string(loc.size() - 1) + "]");
    }
  }
  {
    auto w = world(ForwardMode::kExtend, [](ScenarioSpec& s) { s.cross_attention = true; });
    std::vector<int64_t> loc = values_of(w->batch.encoder_out_cache_loc);
    loc[0] = w->kv_cache->num_slots() + 7;
    w->batch.encoder_out_cache_loc = w->index_tensor(loc, w->index_dtype, w->device);
    expect_bad_index_reported(*w, "encoder_out_cache_loc[0]");
  }
  {
    auto w = world(ForwardMode::kDecode, [](ScenarioSpec& s) {
      s.topk = 2;
      s.num_steps = 2;
    });
    ScenarioCall& c = w->calls[1];
    std::vector<int64_t> loc = values_of(c.out_cache_loc);
    loc[1] = -1;
    c.out_cache_loc = w->index_tensor(loc, w->index_dtype, w->device);
    // Step 0 is valid and saves; step 1 must write nothing of its own (the CPU backend throws
    // from the call, the CUDA backend refuses the draft step on the device and reports it).
    auto draft = std::make_unique<MultiStepDraftBackend>(kind(), w->config, 2, 2);
    draft->init_forward_metadata(w->batch);
    const ScenarioCall& c0 = w->calls[0];
    draft->forward_step(0, c0.q, c0.k, c0.v, c0.out, w->layer, c0.out_cache_loc);
    const auto after_step0_k = w->pool_bytes(ScenarioWorld::kTestedLayer, 0);
    const auto after_step0_v = w->pool_bytes(ScenarioWorld::kTestedLayer, 1);
    bool refused = false;
    try {
      draft->forward_step(1, c.q, c.k, c.v, c.out, w->layer, c.out_cache_loc);
      draft->check_errors(/*synchronize=*/true);
    } catch (const Error& e) {
      refused = true;
      EXPECT_EQ(e.argument(), "out_cache_loc[1]") << e.what();
    }
    EXPECT_TRUE(refused) << "accepted slot -1";
    EXPECT_EQ(w->pool_bytes(ScenarioWorld::kTestedLayer, 0), after_step0_k);
    EXPECT_EQ(w->pool_bytes(ScenarioWorld::kTestedLayer, 1), after_step0_v);
  }
}

TEST_P(BadInput, ReqToTokenContents) {
  // A slot index outside the pool inside a request's req_to_token range.
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
    for (int32_t bad : {-1, 1 << 30}) {
      auto w = world(mode);
      const int row = int(w->ref_batch.req_pool_indices[1]);
      const int32_t value = bad < 0 ? bad : int32_t(w->kv_cache->num_slots());
      w->req_to_token_pool->write(row, 0, std::vector<int32_t>{value});
      expect_bad_index_reported(*w, "req_to_token[" + std::to_string(row) + "][0]");
    }
  }
}

TEST_P(BadInput, NegativeLengths) {
  {
    auto w = world(ForwardMode::kDecode);
    std::vector<int64_t> seq = values_of(w->batch.seq_lens);
    seq[1] = -1;
    set_lengths(*w, w->batch.seq_lens, w->batch.seq_lens_cpu, seq);
    expect_rejected(*w, "seq_lens");
  }
  {
    auto w = world(ForwardMode::kExtend);
    std::vector<int64_t> prefix = values_of(w->batch.extend_prefix_lens);
    prefix[0] = -2;
    set_lengths(*w, w->batch.extend_prefix_lens, w->batch.extend_prefix_lens_cpu, prefix);
    expect_rejected(*w, "extend_prefix_lens");
  }
  for (ForwardMode mode : {ForwardMode::kExtend, ForwardMode::kMixed, ForwardMode::kDraftExtend}) {
    // A negative extend length (the prefix raised to match, so only the sign is wrong).
    auto w = world(mode);
    std::vector<int64_t> seq = values_of(w->batch.seq_lens);
    std::vector<int64_t> prefix = values_of(w->batch.extend_prefix_lens);
    std::vector<int64_t> extend = values_of(w->batch.extend_seq_lens);
    extend[1] = -1;
    prefix[1] = seq[1] + 1;
    set_lengths(*w, w->batch.extend_prefix_lens, w->batch.extend_prefix_lens_cpu, prefix);
    set_lengths(*w, w->batch.extend_seq_lens, w->batch.extend_seq_lens_cpu, extend);
    SCOPED_TRACE(forward_mode_name(mode));
    expect_rejected(*w, "extend_seq_lens");
  }
  {
    auto w = world(ForwardMode::kDecode, [](ScenarioSpec& s) { s.cross_attention = true; });
    std::vector<int64_t> enc = values_of(w->batch.encoder_lens);
    enc[2] = -5;
    set_lengths(*w, w->batch.encoder_lens, w->batch.encoder_lens_cpu, enc);
    expect_rejected(*w, "encoder_lens");
  }
  {
    auto w = world(ForwardMode::kDecode);
    w->batch.batch_size = -1;
    expect_rejected(*w, "batch_size");
  }
}

TEST_P(BadInput, PrefixNotAboveSeq) {
  auto w = world(ForwardMode::kExtend);
  std::vector<int64_t> seq = values_of(w->batch.seq_lens);
  std::vector<int64_t> prefix = values_of(w->batch.extend_prefix_lens);
  prefix[1] = seq[1] + 1;
  set_lengths(*w, w->batch.extend_prefix_lens, w->batch.extend_prefix_lens_cpu, prefix);
  expect_rejected(*w, "extend_prefix_lens[1]");
  // extend_seq_lens must be seq - prefix.
  auto w2 = world(ForwardMode::kExtend);
  std::vector<int64_t> extend = values_of(w2->batch.extend_seq_lens);
  extend[0] += 1;
  set_lengths(*w2, w2->batch.extend_seq_lens, w2->batch.extend_seq_lens_cpu, extend);
  expect_rejected(*w2, "extend_seq_lens[0]");
}

// seq_lens and its host copy seq_lens_cpu disagree. Where both are host tensors (the CPU
// backend) the disagreement is visible for free and rejected. The CUDA backend never reads the
// device copy (every length it plans with, and every index its kernels build, comes from
// seq_lens_cpu), so a device copy that disagrees changes nothing: the step is the one
// seq_lens_cpu describes, and matches the reference for it.
TEST_P(BadInput, SeqLensDisagreeWithHostCopy) {
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend,
                           ForwardMode::kTargetVerify}) {
    SCOPED_TRACE(forward_mode_name(mode));
    auto w = world(mode);
    std::vector<int64_t> seq = values_of(w->batch.seq_lens);
    w->batch.seq_lens_cpu = w->index_tensor(seq, w->index_dtype, Device::cpu());
    std::vector<int64_t> other = seq;
    other[1] += 1;
    other[2] = 1 << 20;  // far beyond the pool's context: reading it would fault or fail
    w->batch.seq_lens = w->index_tensor(other, w->index_dtype, w->device);
    if (!cuda()) {
      expect_rejected(*w, "seq_lens");
    } else {
      EXPECT_NO_THROW(run_step(*w));
      const ScenarioResult r = judge_world(*w);
      EXPECT_TRUE(r.passed) << r.detail;
    }
  }
  if (!cuda()) {
    // The other length pairs follow the same rule on the host.
    auto w = world(ForwardMode::kExtend);
    std::vector<int64_t> prefix = values_of(w->batch.extend_prefix_lens);
    w->batch.extend_prefix_lens_cpu = w->index_tensor(prefix, w->index_dtype, Device::cpu());
    prefix[0] += 1;
    w->batch.extend_prefix_lens = w->index_tensor(prefix, w->index_dtype, w->device);
    expect_rejected(*w, "extend_prefix_lens");
  }
}

TEST_P(BadInput, MaskSizes) {
  {
    auto w = world(ForwardMode::kTargetVerify);
    TensorView& m = w->batch.spec.custom_mask;
    m = m.slice0(0, m.size(0) - 1);
    expect_rejected(*w, "spec.custom_mask");
  }
  {
    auto w = world(ForwardMode::kTargetVerify);
    w->batch.spec.custom_mask = TensorView();
    expect_rejected(*w, "spec.custom_mask");
  }
  {
    auto w = world(ForwardMode::kTargetVerify);
    w->batch.spec.draft_token_num = 0;
    expect_rejected(*w, "spec.draft_token_num");
  }
}

// TARGET_VERIFY on a sliding-window model reads the tree tokens' positions (the window compares
// absolute positions): missing, short, of a float dtype or on the wrong device, they are
// rejected. Their values are checked where they are host tensors (the CPU backend): a tree
// token's position is seq_len + its depth, in [seq_len, seq_len + draft_token_num).
TEST_P(BadInput, VerifyPositions) {
  auto window_world = [&] {
    return world(ForwardMode::kTargetVerify, [](ScenarioSpec& s) { s.sliding_window = 8; });
  };
  {
    auto w = window_world();
    w->batch.positions = TensorView();
    expect_rejected(*w, "positions");
  }
  {
    auto w = window_world();
    w->batch.positions = w->batch.positions.slice0(0, w->batch.positions.size(0) - 1);
    expect_rejected(*w, "positions");
  }
  {
    auto w = window_world();
    const TensorView& p = w->batch.positions;
    w->batch.positions = TensorView(p.data(), DType::kFloat32, p.device(), {p.size(0)});
    expect_rejected(*w, "positions");
  }
  {
    auto w = window_world();
    const TensorView& p = w->batch.positions;
    w->batch.positions = TensorView(p.data(), p.dtype(), other_device(), {p.size(0)});
    expect_rejected(*w, "positions");
  }
  if (!cuda()) {
    const std::vector<int64_t> seq = values_of(window_world()->batch.seq_lens);
    const int draft = bad_input_spec(ForwardMode::kTargetVerify).draft_token_num;
    for (int64_t bad : {int64_t(-1), seq[1] - 1, seq[1] + draft, int64_t(1) << 40}) {
      auto w = window_world();
      std::vector<int64_t> positions = values_of(w->batch.positions);
      positions[size_t(draft) + 1] = bad;  // request 1's second tree token
      w->batch.positions = w->index_tensor(positions, w->index_dtype, w->device);
      SCOPED_TRACE(bad);
      expect_rejected(*w, "positions[" + std::to_string(draft + 1) + "]");
    }
  }
}

TEST_P(BadInput, BufferCapacity) {
  {
    // seq_len beyond max_context_len.
    auto w = world(ForwardMode::kDecode);
    std::vector<int64_t> seq = values_of(w->batch.seq_lens);
    seq[0] = w->req_to_token_pool->max_context_len() + 1;
    set_lengths(*w, w->batch.seq_lens, w->batch.seq_lens_cpu, seq);
    expect_rejected(*w, "seq_lens[0]");
  }
  {
    // TARGET_VERIFY: the tree tokens must fit too.
    auto w = world(ForwardMode::kTargetVerify);
    std::vector<int64_t> seq = values_of(w->batch.seq_lens);
    seq[2] = w->req_to_token_pool->max_context_len() - 1;
    set_lengths(*w, w->batch.seq_lens, w->batch.seq_lens_cpu, seq);
    expect_rejected(*w, "seq_lens[2]");
  }
  {
    // The seq_lens_sum the engine passes must match.
    auto w = world(ForwardMode::kDecode);
    w->batch.seq_lens_sum = 1;
    expect_rejected(*w, "seq_lens_sum");
  }
}

TEST_P(BadInput, DeviceMismatch) {
  // Views that claim to live on the other device (never dereferenced: validation must stop
  // first).
  const Device other = other_device();
  {
    auto w = world(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    c.q = TensorView(c.q.data(), c.q.dtype(), other, {c.q.size(0), c.q.numel() / c.q.size(0)});
    expect_rejected(*w, "q");
  }
  {
    auto w = world(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.out = TensorView(c.out.data(), c.out.dtype(), other,
                       {c.out.size(0), c.out.numel() / std::max<int64_t>(1, c.out.size(0))});
    expect_rejected(*w, "out");
  }
  {
    auto w = world(ForwardMode::kDecode);
    const TensorView& r = w->batch.req_pool_indices;
    w->batch.req_pool_indices = TensorView(r.data(), r.dtype(), other, {r.size(0)});
    expect_rejected(*w, "req_pool_indices");
  }
  {
    auto w = world(ForwardMode::kDecode);
    const TensorView& l = w->batch.out_cache_loc;
    w->batch.out_cache_loc = TensorView(l.data(), l.dtype(), other, {l.size(0)});
    expect_rejected(*w, "out_cache_loc");
  }
  {
    // A backend of the other kind over this world's KV cache. Where that kind cannot run at
    // all (a CPU world in a build without CUDA, or without a GPU), kNotSupported names "kind";
    // otherwise the cache is on the wrong device for it.
    auto w = world(ForwardMode::kDecode);
    const BackendKind wrong = cuda() ? BackendKind::kCpu : BackendKind::kCuda;
    const bool runnable = wrong == BackendKind::kCpu || (cuda_compiled() && cuda_device_count() > 0);
    expect_rejected(*w, [&] { make_backend(wrong, w->config); }, runnable ? "kv_cache" : "kind",
                    runnable ? ErrorKind::kInvalidArgument : ErrorKind::kNotSupported);
  }
}

TEST_P(BadInput, SlidingWindowWithCrossAttention) {
  auto w = world(ForwardMode::kDecode, [](ScenarioSpec& s) { s.cross_attention = true; });
  BackendConfig config = w->config;
  config.sliding_window_size = 16;
  expect_rejected(*w, [&] { make_backend(kind(), config); }, "sliding_window_size");
  AttentionLayer layer = w->layer;
  layer.sliding_window_size = 16;
  expect_rejected(*w, [&] { run_world(*w, layer); }, "sliding_window_size");
}

TEST_P(BadInput, LayerValues) {
  auto w = world(ForwardMode::kDecode);
  AttentionLayer layer = w->layer;
  layer.layer_id = 2;  // the pool has two layers
  expect_rejected(*w, [&] { run_world(*w, layer); }, "layer_id");
  layer = w->layer;
  layer.scaling = 0.f;
  expect_rejected(*w, [&] { run_world(*w, layer); }, "layer.scaling");
  layer = w->layer;
  layer.logit_cap = -1.f;
  expect_rejected(*w, [&] { run_world(*w, layer); }, "layer.logit_cap");
  layer = w->layer;
  layer.is_cross_attention = true;  // the backend was not made for an encoder-decoder model
  expect_rejected(*w, [&] { run_world(*w, layer); }, "layer.is_cross_attention");
}

// Shared-prefix groups the engine declares (ForwardBatch::shared_prefix_group_cpu /
// shared_prefix_lens_cpu): host lengths, so both backends reject them from the call itself,
// naming the tensor and the element at fault. (A broken promise about the slots is a bad index:
// tests/support/bad_index.cpp.)
TEST_P(BadInput, SharedPrefixGroups) {
  auto grouped = [&](ForwardMode mode) {
    return world(mode, [](ScenarioSpec& s) {
      s.batch_size = 5;
      s.min_kv_len = 12;
      s.declared_groups = 1;
    });
  };
  // The worlds are valid: 4 of the 5 requests form group 0, one stays out.
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify}) {
    auto w = grouped(mode);
    ASSERT_EQ(values_of(w->batch.shared_prefix_lens_cpu).size(), 1u);
    EXPECT_NO_THROW(run_step(*w)) << forward_mode_name(mode);
    EXPECT_TRUE(judge_world(*w).passed) << forward_mode_name(mode);
  }
  auto set_host = [](ScenarioWorld& w, TensorView& field, const std::vector<int64_t>& values) {
    field = w.index_tensor(values, w.index_dtype, Device::cpu());
  };
  {  // a group id past the groups
    auto w = grouped(ForwardMode::kDecode);
    std::vector<int64_t> group = values_of(w->batch.shared_prefix_group_cpu);
    group[3] = 1;
    set_host(*w, w->batch.shared_prefix_group_cpu, group);
    expect_rejected(*w, "shared_prefix_group_cpu[3]");
    group[3] = -2;
    set_host(*w, w->batch.shared_prefix_group_cpu, group);
    expect_rejected(*w, "shared_prefix_group_cpu[3]");
  }
  {  // a group of one member: the first member of group 0 alone, the others moved to group 1
    auto w = grouped(ForwardMode::kDecode);
    std::vector<int64_t> group = values_of(w->batch.shared_prefix_group_cpu);
    std::vector<int64_t> lens = values_of(w->batch.shared_prefix_lens_cpu);
    const auto first = std::find(group.begin(), group.end(), 0);
    for (auto it = first + 1; it != group.end(); ++it)
      if (*it == 0) *it = 1;
    lens.push_back(lens[0]);
    set_host(*w, w->batch.shared_prefix_group_cpu, group);
    set_host(*w, w->batch.shared_prefix_lens_cpu, lens);
    expect_rejected(*w, "shared_prefix_lens_cpu[0]");
  }
  {  // shared lengths: 0, and reaching a member's seq_len (DECODE: its new token is its own)
    auto w = grouped(ForwardMode::kDecode);
    set_host(*w, w->batch.shared_prefix_lens_cpu, {0});
    expect_rejected(*w, "shared_prefix_lens_cpu[0]");
    const std::vector<int64_t> group = values_of(w->batch.shared_prefix_group_cpu);
    const std::vector<int64_t> seq = values_of(w->batch.seq_lens);
    int64_t shortest = INT64_MAX;
    for (size_t r = 0; r < group.size(); ++r)
      if (group[r] == 0) shortest = std::min(shortest, seq[r]);
    set_host(*w, w->batch.shared_prefix_lens_cpu, {shortest});
    expect_rejected(*w, "shared_prefix_lens_cpu[0]");
    // TARGET_VERIFY: the whole committed prefix may be shared, no more.
    auto v = grouped(ForwardMode::kTargetVerify);
    const std::vector<int64_t> vgroup = values_of(v->batch.shared_prefix_group_cpu);
    const std::vector<int64_t> vseq = values_of(v->batch.seq_lens);
    shortest = INT64_MAX;
    for (size_t r = 0; r < vgroup.size(); ++r)
      if (vgroup[r] == 0) shortest = std::min(shortest, vseq[r]);
    set_host(*v, v->batch.shared_prefix_lens_cpu, {shortest + 1});
    expect_rejected(*v, "shared_prefix_lens_cpu[0]");
  }
  {  // shapes, dtypes, placement; lengths without groups
    auto w = grouped(ForwardMode::kDecode);
    TensorView& group = w->batch.shared_prefix_group_cpu;
    const TensorView good = group;
    group = group.slice0(0, group.size(0) - 1);
    expect_rejected(*w, "shared_prefix_group_cpu");
    group = w->upload(DType::kFloat32, {5}, std::vector<float>(5, 0.f).data(), Device::cpu());
    expect_rejected(*w, "shared_prefix_group_cpu");
    if (cuda()) {
      group = w->index_tensor(values_of(good), w->index_dtype, w->device);
      expect_rejected(*w, "shared_prefix_group_cpu");
    }
    group = TensorView();
    expect_rejected(*w, "shared_prefix_lens_cpu");
  }
  {  // modes other than DECODE / TARGET_VERIFY
    auto w = world(ForwardMode::kExtend);
    w->batch.shared_prefix_group_cpu = w->index_tensor({0, 0, -1}, w->index_dtype, Device::cpu());
    w->batch.shared_prefix_lens_cpu = w->index_tensor({1}, w->index_dtype, Device::cpu());
    expect_rejected(*w, "shared_prefix_group_cpu", ErrorKind::kNotSupported);
  }
}

TEST_P(BadInput, MultiStepDraftArguments) {
  auto w = world(ForwardMode::kDecode, [](ScenarioSpec& s) {
    s.topk = 2;
    s.num_steps = 2;
  });
  expect_rejected(*w, [&] { MultiStepDraftBackend(kind(), w->config, 0, 2); }, "topk");
  expect_rejected(*w, [&] { MultiStepDraftBackend(kind(), w->config, 2, 0); }, "num_steps");
  MultiStepDraftBackend draft(kind(), w->config, 2, 2);
  draft.init_forward_metadata(w->batch);
  const ScenarioCall& c = w->calls[0];
  expect_rejected(
      *w, [&] { draft.forward_step(2, c.q, c.k, c.v, c.out, w->layer, c.out_cache_loc); },
      "step");
  // q with the rows of one branch per request instead of topk.
  expect_rejected(
      *w,
      [&] { draft.forward_step(0, c.q.slice0(0, 3), c.k, c.v, c.out, w->layer, c.out_cache_loc); },
      "q");
}

}  // namespace
}  // namespace kvattn::testing
