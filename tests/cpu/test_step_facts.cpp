// core::derive_step: one step's facts from the batch, read once, against what the scenario world
// expects of the same batch (its own query rows and ragged choice) and against read_host_lengths.
#include <gtest/gtest.h>

#include <string>

#include "core/batch_layout.h"
#include "core/step.h"
#include "kvattn/error.h"
#include "reference/scenario.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

ScenarioSpec step_spec(ForwardMode mode, uint32_t seed) {
  ScenarioSpec spec;
  spec.variant = "step facts";
  spec.mode = mode;
  spec.batch_size = 4;
  spec.max_kv_len = 80;
  spec.max_q_len = 9;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.seed = seed;
  if (mode == ForwardMode::kTargetVerify) spec.draft_token_num = 3;
  return spec;
}

void expect_facts_of(const ScenarioWorld& w) {
  SCOPED_TRACE(std::string(forward_mode_name(w.spec.mode)) +
               (w.spec.force_ragged ? " ragged" : "") +
               (w.spec.sliding_window >= 0 ? " window" : "") +
               (w.spec.deterministic ? " deterministic" : ""));
  const core::StepFacts facts = core::derive_step(w.batch, w.config, w.device);
  EXPECT_EQ(facts.mode, w.spec.mode);
  EXPECT_EQ(facts.batch_size, w.batch.batch_size);
  ASSERT_FALSE(w.calls.empty());
  EXPECT_EQ(facts.num_tokens, w.calls.front().num_tokens);
  EXPECT_EQ(facts.ragged, w.ragged);
  const core::HostLengths lens = core::read_host_lengths(w.batch, w.config.is_encoder_decoder);
  EXPECT_EQ(facts.lens.seq_lens, lens.seq_lens);
  EXPECT_EQ(facts.lens.prefix_lens, lens.prefix_lens);
  EXPECT_EQ(facts.lens.extend_lens, lens.extend_lens);
  int64_t new_tokens = 0;
  for (int32_t e : lens.extend_lens) new_tokens += e;
  EXPECT_EQ(facts.new_tokens, new_tokens);
  int64_t prefix_tokens = 0;
  for (int32_t e : lens.prefix_lens) prefix_tokens += e;
  EXPECT_EQ(facts.prefix_tokens, prefix_tokens);
  EXPECT_EQ(facts.draft_token_num,
            w.spec.mode == ForwardMode::kTargetVerify ? w.spec.draft_token_num : 0);
}

TEST(StepFacts, EveryModeAgreesWithTheWorld) {
  uint32_t seed = 40;
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend, ForwardMode::kMixed,
                           ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
    expect_facts_of(*ScenarioWorld::build(step_spec(mode, ++seed), BackendKind::kCpu));
  }
  // The ragged choice: forced on (threshold 0), then off with a window or deterministic mode.
  for (ForwardMode mode : {ForwardMode::kExtend, ForwardMode::kMixed}) {
    ScenarioSpec spec = step_spec(mode, ++seed);
    spec.force_ragged = true;
    auto ragged = ScenarioWorld::build(spec, BackendKind::kCpu);
    EXPECT_TRUE(core::derive_step(ragged->batch, ragged->config, ragged->device).ragged);
    expect_facts_of(*ragged);
    spec.sliding_window = 16;
    expect_facts_of(*ScenarioWorld::build(spec, BackendKind::kCpu));
    spec.sliding_window = -1;
    spec.deterministic = true;
    auto deterministic = ScenarioWorld::build(spec, BackendKind::kCpu);
    EXPECT_FALSE(
        core::derive_step(deterministic->batch, deterministic->config, deterministic->device)
            .ragged);
  }
}

// The rule itself, case by case (SPEC §3 and the rules of ours in core/batch_layout.h).
TEST(StepFacts, RaggedExtendRule) {
  using core::RaggedExtendRule;
  const auto ragged = [](ForwardMode mode, int64_t fresh, int64_t prefix, RaggedExtendRule rule) {
    return core::use_ragged_extend(mode, fresh, prefix, rule);
  };
  const ForwardMode e = ForwardMode::kExtend;
  const RaggedExtendRule standard;  // threshold 4096, the cache in the q dtype
  // No cached prefix: ragged at any size, whatever the threshold (nothing to merge)...
  EXPECT_TRUE(ragged(e, 1, 0, standard));
  EXPECT_TRUE(ragged(e, 1024, 0, {.threshold = int64_t(1) << 40}));
  EXPECT_TRUE(ragged(ForwardMode::kMixed, 7, 0, standard));
  EXPECT_FALSE(ragged(e, 0, 0, standard));  // an empty step
  // ... unless the cache rounds k/v (fp8, or a 16-bit cache under fp32 q): then the threshold.
  EXPECT_FALSE(ragged(e, 1024, 0, {.cache_is_io_dtype = false}));
  EXPECT_TRUE(ragged(e, 4096, 0, {.cache_is_io_dtype = false}));
  // With a prefix: the threshold, and more new tokens than prefix tokens.
  EXPECT_FALSE(ragged(e, 1024, 1, standard));
  EXPECT_TRUE(ragged(e, 4096, 4095, standard));
  EXPECT_FALSE(ragged(e, 4096, 4096, standard));
  EXPECT_FALSE(ragged(e, 8 * 512, 8 * 4096, standard));
  EXPECT_TRUE(ragged(e, 8 * 512, 8 * 4096, {.threshold = 0}));  // forced
  // Never: a window, cross-attention, deterministic mode, or a mode that is not EXTEND / MIXED.
  EXPECT_FALSE(ragged(e, 1024, 0, {.threshold = 0, .has_window = true}));
  EXPECT_FALSE(ragged(e, 1024, 0, {.threshold = 0, .is_encoder_decoder = true}));
  EXPECT_FALSE(ragged(e, 1024, 0, {.threshold = 0, .deterministic = true}));
  EXPECT_FALSE(ragged(ForwardMode::kDecode, 4, 0, {.threshold = 0}));
  EXPECT_FALSE(ragged(ForwardMode::kTargetVerify, 8, 0, {.threshold = 0}));
  EXPECT_FALSE(ragged(ForwardMode::kDraftExtend, 8, 0, {.threshold = 0}));
}

TEST(StepFacts, IdleAndBadBatches) {
  auto w = ScenarioWorld::build(step_spec(ForwardMode::kDecode, 7), BackendKind::kCpu);
  ForwardBatch idle = w->batch;
  idle.mode = ForwardMode::kIdle;
  const core::StepFacts facts = core::derive_step(idle, w->config, w->device);
  EXPECT_EQ(facts.num_tokens, 0);
  EXPECT_TRUE(facts.lens.seq_lens.empty());
  ForwardBatch bad = w->batch;
  bad.batch_size = -1;
  try {
    (void)core::derive_step(bad, w->config, w->device);
    ADD_FAILURE() << "a negative batch_size was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "batch_size");
  }
}

// A DECODE (or TARGET_VERIFY) batch whose lengths live on the device alone (no seq_lens_cpu): a
// backend that plans on the device takes it without reading a length (the tensors are never read
// here: their data is host memory labelled cuda); any other backend, mode or batch reads host
// lengths as before.
TEST(StepFacts, DeviceLengthsOnlyForDevicePlannedDecodeAndVerify) {
  auto w = ScenarioWorld::build(step_spec(ForwardMode::kDecode, 9), BackendKind::kCpu);
  const Device gpu = Device::cuda(0);
  ForwardBatch b = w->batch;
  auto on_gpu = [&](const TensorView& t) {
    return TensorView(const_cast<void*>(t.data()), t.dtype(), gpu, {t.size(0)});
  };
  b.req_pool_indices = on_gpu(w->batch.req_pool_indices);
  b.seq_lens = on_gpu(w->batch.seq_lens);
  b.seq_lens_cpu = TensorView();
  b.out_cache_loc = TensorView();
  EXPECT_TRUE(core::uses_device_lengths(b, w->config, /*device_plan=*/true));
  const core::StepFacts facts = core::derive_step(b, w->config, gpu, /*device_plan=*/true);
  EXPECT_TRUE(facts.device_lengths);
  EXPECT_TRUE(facts.lens.seq_lens.empty());
  EXPECT_EQ(facts.num_tokens, b.batch_size);
  EXPECT_FALSE(facts.ragged);
  // A backend that plans on the host: the device copy is refused, naming it.
  try {
    (void)core::derive_step(b, w->config, gpu, /*device_plan=*/false);
    ADD_FAILURE() << "device-only lengths were accepted by a host planner";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "seq_lens") << e.what();
  }
  // With the host copy, or shared-prefix groups, or another mode: the host lengths.
  ForwardBatch with_host = b;
  with_host.seq_lens_cpu = w->batch.seq_lens;
  EXPECT_FALSE(core::uses_device_lengths(with_host, w->config, true));
  const core::StepFacts host_facts = core::derive_step(with_host, w->config, gpu, true);
  EXPECT_FALSE(host_facts.device_lengths);
  EXPECT_EQ(host_facts.lens.seq_lens.size(), size_t(b.batch_size));
  ForwardBatch grouped = b;
  grouped.shared_prefix_group_cpu = w->batch.seq_lens;
  EXPECT_FALSE(core::uses_device_lengths(grouped, w->config, true));
  ForwardBatch verify = b;  // TARGET_VERIFY too; EXTEND-like modes need their prefix lengths
  verify.mode = ForwardMode::kTargetVerify;
  EXPECT_TRUE(core::uses_device_lengths(verify, w->config, true));
  ForwardBatch extend = b;
  extend.mode = ForwardMode::kExtend;
  EXPECT_FALSE(core::uses_device_lengths(extend, w->config, true));
  // The shapes are still checked.
  ForwardBatch short_seq = b;
  short_seq.seq_lens =
      TensorView(const_cast<void*>(b.seq_lens.data()), b.seq_lens.dtype(), gpu, {b.batch_size - 1});
  try {
    (void)core::derive_step(short_seq, w->config, gpu, true);
    ADD_FAILURE() << "a seq_lens of the wrong length was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "seq_lens") << e.what();
  }
}

// EXTEND-like steps without any host length: planned on the device, their token count
// out_cache_loc's, never the ragged path; any *_cpu copy (or a host prefix tensor) keeps the host
// plan; the shapes are still checked.
TEST(StepFacts, DeviceLengthsForExtendLikeStepsWithoutHostCopies) {
  auto w = ScenarioWorld::build(step_spec(ForwardMode::kExtend, 5), BackendKind::kCpu);
  const Device gpu = Device::cuda(0);
  auto on_gpu = [&](const TensorView& t) {
    return TensorView(const_cast<void*>(t.data()), t.dtype(), gpu, {t.size(0)});
  };
  ForwardBatch b = w->batch;
  ASSERT_TRUE(b.extend_prefix_lens.defined());
  b.req_pool_indices = on_gpu(w->batch.req_pool_indices);
  b.seq_lens = on_gpu(w->batch.seq_lens);
  b.extend_prefix_lens = on_gpu(w->batch.extend_prefix_lens);
  b.extend_seq_lens =
      w->batch.extend_seq_lens.defined() ? on_gpu(w->batch.extend_seq_lens) : TensorView();
  b.out_cache_loc = on_gpu(w->batch.out_cache_loc);
  b.seq_lens_cpu = b.extend_prefix_lens_cpu = b.extend_seq_lens_cpu = TensorView();
  const core::StepFacts host = core::derive_step(w->batch, w->config, Device::cpu());
  ASSERT_GT(host.num_tokens, 0);
  for (ForwardMode mode : {ForwardMode::kExtend, ForwardMode::kMixed, ForwardMode::kDraftExtend}) {
    ForwardBatch m = b;
    m.mode = mode;
    EXPECT_TRUE(core::uses_device_lengths(m, w->config, true)) << forward_mode_name(mode);
    const core::StepFacts facts = core::derive_step(m, w->config, gpu, true);
    EXPECT_TRUE(facts.device_lengths);
    EXPECT_TRUE(facts.lens.seq_lens.empty());
    EXPECT_EQ(facts.num_tokens, host.num_tokens);
    EXPECT_EQ(facts.new_tokens, host.num_tokens);
    EXPECT_FALSE(facts.ragged);
  }
  EXPECT_FALSE(core::uses_device_lengths(b, w->config, /*device_plan=*/false));
  for (int which = 0; which < 4; ++which) {
    ForwardBatch h = b;
    if (which == 0) h.seq_lens_cpu = w->batch.seq_lens;
    if (which == 1) h.extend_prefix_lens_cpu = w->batch.extend_prefix_lens;
    if (which == 2) h.extend_seq_lens_cpu = w->batch.seq_lens;
    if (which == 3) h.extend_prefix_lens = w->batch.extend_prefix_lens;  // on the host
    EXPECT_FALSE(core::uses_device_lengths(h, w->config, true)) << which;
  }
  ForwardBatch no_loc = b;
  no_loc.out_cache_loc = TensorView();
  EXPECT_FALSE(core::uses_device_lengths(no_loc, w->config, true));
  ForwardBatch short_prefix = b;
  short_prefix.extend_prefix_lens =
      TensorView(const_cast<void*>(b.extend_prefix_lens.data()), b.extend_prefix_lens.dtype(), gpu,
                 {b.batch_size - 1});
  try {
    (void)core::derive_step(short_prefix, w->config, gpu, true);
    ADD_FAILURE() << "an extend_prefix_lens of the wrong length was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "extend_prefix_lens") << e.what();
  }
}

// Encoder-decoder models plan on the device too when the encoder lengths are device tensors as
// well (they place both index sets); a host copy of them, or a host tensor, keeps the host plan;
// the shape of the device encoder_lens is still checked.
TEST(StepFacts, DeviceLengthsForEncoderDecoderModelsNeedDeviceEncoderLengths) {
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
    ScenarioSpec spec = step_spec(mode, 31);
    spec.cross_attention = true;
    auto w = ScenarioWorld::build(spec, BackendKind::kCpu);
    ASSERT_TRUE(w->config.is_encoder_decoder);
    const Device gpu = Device::cuda(0);
    auto on_gpu = [&](const TensorView& t, int64_t n) {
      return TensorView(const_cast<void*>(t.data()), t.dtype(), gpu, {n});
    };
    auto lift = [&](const TensorView& t) {
      return t.defined() ? on_gpu(t, t.size(0)) : TensorView();
    };
    ForwardBatch b = w->batch;
    b.req_pool_indices = lift(b.req_pool_indices);
    b.seq_lens = lift(b.seq_lens);
    b.extend_prefix_lens = lift(b.extend_prefix_lens);
    b.extend_seq_lens = lift(b.extend_seq_lens);
    b.out_cache_loc = lift(b.out_cache_loc);
    b.encoder_lens = lift(b.encoder_lens);
    b.seq_lens_cpu = b.extend_prefix_lens_cpu = b.extend_seq_lens_cpu = TensorView();
    b.encoder_lens_cpu = TensorView();
    const std::string name = forward_mode_name(mode);
    EXPECT_TRUE(core::uses_device_lengths(b, w->config, true)) << name;
    const core::StepFacts facts = core::derive_step(b, w->config, gpu, true);
    EXPECT_TRUE(facts.device_lengths) << name;
    EXPECT_TRUE(facts.lens.encoder_lens.empty()) << name;
    EXPECT_FALSE(facts.ragged) << name;
    ForwardBatch host_copy = b;
    host_copy.encoder_lens_cpu = w->batch.encoder_lens;
    EXPECT_FALSE(core::uses_device_lengths(host_copy, w->config, true)) << name;
    ForwardBatch host_tensor = b;
    host_tensor.encoder_lens = w->batch.encoder_lens;  // on the host
    EXPECT_FALSE(core::uses_device_lengths(host_tensor, w->config, true)) << name;
    ForwardBatch short_encoder = b;
    short_encoder.encoder_lens = on_gpu(b.encoder_lens, b.batch_size - 1);
    try {
      (void)core::derive_step(short_encoder, w->config, gpu, true);
      ADD_FAILURE() << name << ": an encoder_lens of the wrong length was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "encoder_lens") << e.what();
    }
  }
}

}  // namespace
}  // namespace kvattn::testing
