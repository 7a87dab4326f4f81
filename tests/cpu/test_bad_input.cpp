// Bad input (SPEC §5), one test per rule: every public entry point answers with a kvattn::Error
// of the right kind whose message names the argument at fault, and the KV pool is byte for byte
// what it was (bad input never corrupts the pool, not even partly).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "kvattn/kvattn.h"
#include "reference/scenario.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

ScenarioSpec base_spec(ForwardMode mode) {
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

std::unique_ptr<ScenarioWorld> world_for(ForwardMode mode,
                                         const std::function<void(ScenarioSpec&)>& change = {}) {
  ScenarioSpec spec = base_spec(mode);
  if (change) change(spec);
  return ScenarioWorld::build(spec, BackendKind::kCpu);
}

// One whole step as an engine runs it: make the backend, plan, run every call.
void run_step(ScenarioWorld& w) { run_world(w, w.layer); }

// Runs `step`, which must throw kvattn::Error of `kind` naming `argument` (in argument() and in
// the message), and checks that the KV pool did not change.
void expect_rejected(ScenarioWorld& w, const std::function<void()>& step,
                     const std::string& argument,
                     ErrorKind kind = ErrorKind::kInvalidArgument) {
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

// Replaces a length tensor and its host copy (when the world gave one).
void set_lengths(ScenarioWorld& w, TensorView& device_view, TensorView& host_view,
                 const std::vector<int64_t>& values) {
  device_view = w.index_tensor(values, w.index_dtype, w.device);
  if (host_view.defined()) host_view = w.index_tensor(values, w.index_dtype, Device::cpu());
}

std::vector<int64_t> host_values(const TensorView& t) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < t.size(0); ++i) out.push_back(read_index(t, i));
  return out;
}

TEST(BadInput, WorldsAreValidToBeginWith) {
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend,
                           ForwardMode::kTargetVerify}) {
    std::unique_ptr<ScenarioWorld> w = world_for(mode);
    EXPECT_NO_THROW(run_step(*w)) << forward_mode_name(mode);
    EXPECT_TRUE(judge_world(*w).passed);
  }
}

TEST(BadInput, Shapes) {
  {
    auto w = world_for(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    c.q = c.q.slice0(0, c.q.size(0) - 1);  // one token short
    expect_rejected(*w, "q");
  }
  {
    auto w = world_for(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.out = TensorView(c.out.data(), c.out.dtype(), c.out.device(),
                       {c.out.size(0), int64_t(w->spec.num_q_heads), 32});  // wrong v dim
    expect_rejected(*w, "out");
  }
  {
    auto w = world_for(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    c.k = TensorView(c.k.data(), c.k.dtype(), c.k.device(),
                     {c.k.size(0), 1, int64_t(w->spec.head_dim)});  // one kv head, not two
    expect_rejected(*w, "k");
  }
  {
    auto w = world_for(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.v = c.v.slice0(0, c.v.size(0) - 2);
    expect_rejected(*w, "v");
  }
  {
    auto w = world_for(ForwardMode::kDecode);
    w->batch.seq_lens = w->index_tensor({5, 6}, w->index_dtype, w->device);  // 2 of 3
    w->batch.seq_lens_cpu = TensorView();
    expect_rejected(*w, "seq_lens");
  }
  {
    auto w = world_for(ForwardMode::kDecode);
    w->batch.out_cache_loc = w->batch.out_cache_loc.slice0(0, 2);
    expect_rejected(*w, "out_cache_loc");
  }
}

TEST(BadInput, Dtypes) {
  {
    auto w = world_for(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    const int64_t tokens = c.q.size(0);
    c.q = TensorView(c.q.data(), DType::kFloat16, c.q.device(),
                     {tokens, int64_t(w->spec.num_q_heads), int64_t(w->spec.head_dim)});
    expect_rejected(*w, "q");
  }
  {
    auto w = world_for(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.out = TensorView(c.out.data(), DType::kFloat32, c.out.device(),
                       {c.out.size(0), int64_t(w->spec.num_q_heads) * w->spec.head_dim / 2});
    expect_rejected(*w, "out");
  }
  {
    auto w = world_for(ForwardMode::kDecode);
    const TensorView& s = w->batch.req_pool_indices;
    w->batch.req_pool_indices = TensorView(s.data(), DType::kFloat32, s.device(), {s.size(0)});
    expect_rejected(*w, "req_pool_indices");
  }
  {
    auto w = world_for(ForwardMode::kTargetVerify);
    TensorView& m = w->batch.spec.custom_mask;
    m = TensorView(m.data(), DType::kInt32, m.device(), {m.size(0) / 4});
    expect_rejected(*w, "spec.custom_mask");
  }
  {
    // A KV cache of a non-storage dtype.
    KvCacheConfig config;
    config.num_slots = 64;
    config.num_kv_heads = 2;
    config.head_dim = 64;
    config.dtype = DType::kFloat32;
    try {
      KvCache::allocate(config);
      ADD_FAILURE() << "fp32 KV cache accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "dtype");
    }
  }
}

TEST(BadInput, HeadDivisibility) {
  auto w = world_for(ForwardMode::kDecode);
  BackendConfig config = w->config;
  config.num_q_heads = 5;  // not a multiple of 2 kv heads
  expect_rejected(*w, [&] { make_backend(BackendKind::kCpu, config); }, "num_q_heads");
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

TEST(BadInput, ReqPoolIndicesRange) {
  for (int64_t bad : {-1, 1000}) {
    auto w = world_for(ForwardMode::kDecode);
    std::vector<int64_t> rows = host_values(w->batch.req_pool_indices);
    rows[2] = bad;
    w->batch.req_pool_indices = w->index_tensor(rows, w->index_dtype, w->device);
    expect_rejected(*w, "req_pool_indices[2]");
  }
}

TEST(BadInput, OutCacheLocRange) {
  // The last slot is out of the pool: nothing may be written, not even the valid slots first.
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
    for (int64_t bad : {-3, 1 << 30}) {
      auto w = world_for(mode);
      std::vector<int64_t> loc = host_values(w->batch.out_cache_loc);
      loc.back() = bad == -3 ? -3 : w->kv_cache->num_slots();
      w->batch.out_cache_loc = w->index_tensor(loc, w->index_dtype, w->device);
      expect_rejected(*w, "out_cache_loc[" + std::to_string(loc.size() - 1) + "]");
    }
  }
  {
    auto w = world_for(ForwardMode::kExtend, [](ScenarioSpec& s) { s.cross_attention = true; });
    std::vector<int64_t> loc = host_values(w->batch.encoder_out_cache_loc);
    loc[0] = w->kv_cache->num_slots() + 7;
    w->batch.encoder_out_cache_loc = w->index_tensor(loc, w->index_dtype, w->device);
    expect_rejected(*w, "encoder_out_cache_loc[0]");
  }
  {
    auto w = world_for(ForwardMode::kDecode, [](ScenarioSpec& s) {
      s.topk = 2;
      s.num_steps = 2;
    });
    ScenarioCall& c = w->calls[1];
    std::vector<int64_t> loc = host_values(c.out_cache_loc);
    loc[1] = -1;
    c.out_cache_loc = w->index_tensor(loc, w->index_dtype, w->device);
    // Step 0 is valid and saves; step 1 must fail without writing anything of its own.
    auto draft = std::make_unique<MultiStepDraftBackend>(BackendKind::kCpu, w->config, 2, 2);
    draft->init_forward_metadata(w->batch);
    const ScenarioCall& c0 = w->calls[0];
    draft->forward_step(0, c0.q, c0.k, c0.v, c0.out, w->layer, c0.out_cache_loc);
    const auto after_step0 = w->pool_bytes(ScenarioWorld::kTestedLayer, 0);
    try {
      draft->forward_step(1, c.q, c.k, c.v, c.out, w->layer, c.out_cache_loc);
      ADD_FAILURE() << "accepted slot -1";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("out_cache_loc"), std::string::npos) << e.what();
    }
    EXPECT_EQ(w->pool_bytes(ScenarioWorld::kTestedLayer, 0), after_step0);
  }
}

TEST(BadInput, ReqToTokenContents) {
  // A slot index outside the pool inside a request's req_to_token range.
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
    for (int32_t bad : {-1, 1 << 30}) {
      auto w = world_for(mode);
      const int row = int(w->ref_batch.req_pool_indices[1]);
      const int32_t value = bad < 0 ? bad : int32_t(w->kv_cache->num_slots());
      w->req_to_token_pool->write(row, 0, std::vector<int32_t>{value});
      expect_rejected(*w, "req_to_token");
    }
  }
}

TEST(BadInput, PageSizes) {
  for (int page_size : {0, 3, 24, 256}) {
    KvCacheConfig config;
    config.num_slots = 1024;
    config.num_kv_heads = 2;
    config.head_dim = 64;
    config.page_size = page_size;
    try {
      KvCache::allocate(config);
      ADD_FAILURE() << "page_size " << page_size << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "page_size");
      EXPECT_NE(std::string(e.what()).find("page_size"), std::string::npos);
    }
    EXPECT_THROW(SlotAllocator(1024, page_size), Error);
  }
  KvCacheConfig config;
  config.num_slots = 100;  // not a multiple of the page size
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.page_size = 16;
  try {
    KvCache::allocate(config);
    ADD_FAILURE() << "num_slots 100 with page_size 16 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "num_slots");
  }
}

TEST(BadInput, NegativeLengths) {
  {
    auto w = world_for(ForwardMode::kDecode);
    std::vector<int64_t> seq = host_values(w->batch.seq_lens);
    seq[1] = -1;
    set_lengths(*w, w->batch.seq_lens, w->batch.seq_lens_cpu, seq);
    expect_rejected(*w, "seq_lens");
  }
  {
    auto w = world_for(ForwardMode::kExtend);
    std::vector<int64_t> prefix = host_values(w->batch.extend_prefix_lens);
    prefix[0] = -2;
    set_lengths(*w, w->batch.extend_prefix_lens, w->batch.extend_prefix_lens_cpu, prefix);
    expect_rejected(*w, "extend_prefix_lens");
  }
  {
    auto w = world_for(ForwardMode::kDecode, [](ScenarioSpec& s) { s.cross_attention = true; });
    std::vector<int64_t> enc = host_values(w->batch.encoder_lens);
    enc[2] = -5;
    set_lengths(*w, w->batch.encoder_lens, w->batch.encoder_lens_cpu, enc);
    expect_rejected(*w, "encoder_lens");
  }
  {
    auto w = world_for(ForwardMode::kDecode);
    w->batch.batch_size = -1;
    expect_rejected(*w, "batch_size");
  }
}

TEST(BadInput, PrefixNotAboveSeq) {
  auto w = world_for(ForwardMode::kExtend);
  std::vector<int64_t> seq = host_values(w->batch.seq_lens);
  std::vector<int64_t> prefix = host_values(w->batch.extend_prefix_lens);
  prefix[1] = seq[1] + 1;
  set_lengths(*w, w->batch.extend_prefix_lens, w->batch.extend_prefix_lens_cpu, prefix);
  expect_rejected(*w, "extend_prefix_lens[1]");
  // extend_seq_lens must be seq - prefix.
  auto w2 = world_for(ForwardMode::kExtend);
  std::vector<int64_t> extend = host_values(w2->batch.extend_seq_lens);
  extend[0] += 1;
  set_lengths(*w2, w2->batch.extend_seq_lens, w2->batch.extend_seq_lens_cpu, extend);
  expect_rejected(*w2, "extend_seq_lens[0]");
}

TEST(BadInput, MaskSizes) {
  {
    auto w = world_for(ForwardMode::kTargetVerify);
    TensorView& m = w->batch.spec.custom_mask;
    m = m.slice0(0, m.size(0) - 1);
    expect_rejected(*w, "spec.custom_mask");
  }
  {
    auto w = world_for(ForwardMode::kTargetVerify);
    w->batch.spec.custom_mask = TensorView();
    expect_rejected(*w, "spec.custom_mask");
  }
  {
    auto w = world_for(ForwardMode::kTargetVerify);
    w->batch.spec.draft_token_num = 0;
    expect_rejected(*w, "spec.draft_token_num");
  }
}

TEST(BadInput, BufferCapacity) {
  {
    // seq_len beyond max_context_len.
    auto w = world_for(ForwardMode::kDecode);
    std::vector<int64_t> seq = host_values(w->batch.seq_lens);
    seq[0] = w->req_to_token_pool->max_context_len() + 1;
    set_lengths(*w, w->batch.seq_lens, w->batch.seq_lens_cpu, seq);
    expect_rejected(*w, "seq_lens[0]");
  }
  {
    // TARGET_VERIFY: the tree tokens must fit too.
    auto w = world_for(ForwardMode::kTargetVerify);
    std::vector<int64_t> seq = host_values(w->batch.seq_lens);
    seq[2] = w->req_to_token_pool->max_context_len() - 1;
    set_lengths(*w, w->batch.seq_lens, w->batch.seq_lens_cpu, seq);
    expect_rejected(*w, "seq_lens[2]");
  }
  {
    // The seq_lens_sum the engine passes must match.
    auto w = world_for(ForwardMode::kDecode);
    w->batch.seq_lens_sum = 1;
    expect_rejected(*w, "seq_lens_sum");
  }
}

TEST(BadInput, DeviceMismatch) {
  // Views that claim to live on a GPU (never dereferenced: validation must stop first).
  {
    auto w = world_for(ForwardMode::kDecode);
    ScenarioCall& c = w->calls[0];
    c.q = TensorView(c.q.data(), c.q.dtype(), Device::cuda(0),
                     {c.q.size(0), c.q.numel() / c.q.size(0)});
    expect_rejected(*w, "q");
  }
  {
    auto w = world_for(ForwardMode::kExtend);
    ScenarioCall& c = w->calls[0];
    c.out = TensorView(c.out.data(), c.out.dtype(), Device::cuda(0),
                       {c.out.size(0), c.out.numel() / std::max<int64_t>(1, c.out.size(0))});
    expect_rejected(*w, "out");
  }
  {
    auto w = world_for(ForwardMode::kDecode);
    const TensorView& r = w->batch.req_pool_indices;
    w->batch.req_pool_indices = TensorView(r.data(), r.dtype(), Device::cuda(0), {r.size(0)});
    expect_rejected(*w, "req_pool_indices");
  }
  {
    auto w = world_for(ForwardMode::kDecode);
    // A CUDA backend over a host KV cache (or, in a build without CUDA, no CUDA at all).
    expect_rejected(*w, [&] { make_backend(BackendKind::kCuda, w->config); }, "",
                    cuda_compiled() && cuda_device_count() > 0 ? ErrorKind::kInvalidArgument
                                                               : ErrorKind::kNotSupported);
  }
}

TEST(BadInput, SlidingWindowWithCrossAttention) {
  auto w = world_for(ForwardMode::kDecode, [](ScenarioSpec& s) { s.cross_attention = true; });
  BackendConfig config = w->config;
  config.sliding_window_size = 16;
  expect_rejected(*w, [&] { make_backend(BackendKind::kCpu, config); }, "sliding_window_size");
  AttentionLayer layer = w->layer;
  layer.sliding_window_size = 16;
  expect_rejected(*w, [&] { run_world(*w, layer); }, "sliding_window_size");
}

TEST(BadInput, LayerValues) {
  auto w = world_for(ForwardMode::kDecode);
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

TEST(BadInput, MultiStepDraftArguments) {
  auto w = world_for(ForwardMode::kDecode, [](ScenarioSpec& s) {
    s.topk = 2;
    s.num_steps = 2;
  });
  expect_rejected(*w, [&] { MultiStepDraftBackend(BackendKind::kCpu, w->config, 0, 2); },
                  "topk");
  expect_rejected(*w, [&] { MultiStepDraftBackend(BackendKind::kCpu, w->config, 2, 0); },
                  "num_steps");
  MultiStepDraftBackend draft(BackendKind::kCpu, w->config, 2, 2);
  draft.init_forward_metadata(w->batch);
  const ScenarioCall& c = w->calls[0];
  expect_rejected(*w, [&] { draft.forward_step(2, c.q, c.k, c.v, c.out, w->layer,
                                               c.out_cache_loc); },
                  "step");
  // q with the rows of one branch per request instead of topk.
  expect_rejected(*w, [&] { draft.forward_step(0, c.q.slice0(0, 3), c.k, c.v, c.out, w->layer,
                                               c.out_cache_loc); },
                  "q");
}

}  // namespace
}  // namespace kvattn::testing
