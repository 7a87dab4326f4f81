// The scenario harness must be able to fail: each test here breaks one thing a backend could get
// wrong (a wrong number, NaN, an unwritten or out-of-bounds element, a stray pool write, an
// ignored variant) and checks that judge_world notices. It also checks that the worlds really
// hold what the brief promises (NaN in unowned slots, shuffled slots).
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <limits>
#include <set>

#include "reference/float_format.h"
#include "reference/scenario.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

ScenarioSpec small_spec(ForwardMode mode, uint64_t seed = 17) {
  ScenarioSpec spec;
  spec.variant = "harness";
  spec.mode = mode;
  spec.batch_size = 3;
  spec.max_kv_len = 120;
  spec.max_q_len = 20;
  spec.seed = seed;
  return spec;
}

std::unique_ptr<ScenarioWorld> ran_world(const ScenarioSpec& spec) {
  std::unique_ptr<ScenarioWorld> w = ScenarioWorld::build(spec, BackendKind::kCpu);
  run_world(*w, w->layer);
  return w;
}

// Element `index` of the first call's output (host memory on the CPU backend).
void poke_output(ScenarioWorld& w, int64_t index, double value) {
  encode_element(w.calls[0].out_with_guard.data(), w.spec.q_dtype, index, value);
}
double peek_output(ScenarioWorld& w, int64_t index) {
  return decode_element(w.calls[0].out_with_guard.data(), w.spec.q_dtype, index);
}

TEST(ScenarioHarness, ACorrectRunPasses) {
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
    std::unique_ptr<ScenarioWorld> w = ran_world(small_spec(mode));
    const ScenarioResult r = judge_world(*w);
    EXPECT_TRUE(r.passed) << r.detail;
    EXPECT_GT(r.max_rel_err, 0.0) << "bf16 output rounding must show";
  }
}

TEST(ScenarioHarness, AWrongNumberFails) {
  std::unique_ptr<ScenarioWorld> w = ran_world(small_spec(ForwardMode::kExtend));
  // Off by 3% of the value in one element of the last token.
  const int64_t index = w->calls[0].out.numel() - 5;
  poke_output(*w, index, peek_output(*w, index) * 1.03 + 0.03);
  const ScenarioResult r = judge_world(*w);
  EXPECT_FALSE(r.passed);
  EXPECT_GT(r.max_rel_err, r.tolerance);
  EXPECT_NE(r.detail.find("seed=17"), std::string::npos) << r.detail;
  EXPECT_NE(r.detail.find("token"), std::string::npos) << r.detail;
}

TEST(ScenarioHarness, NaNAndUnwrittenOutputFail) {
  std::unique_ptr<ScenarioWorld> w = ran_world(small_spec(ForwardMode::kDecode));
  poke_output(*w, 3, std::numeric_limits<double>::quiet_NaN());
  ScenarioResult r = judge_world(*w);
  EXPECT_FALSE(r.passed);
  EXPECT_NE(r.detail.find("NaN"), std::string::npos) << r.detail;

  // Never run: the poisoned output is still there.
  std::unique_ptr<ScenarioWorld> idle = ScenarioWorld::build(small_spec(ForwardMode::kDecode),
                                                             BackendKind::kCpu);
  r = judge_world(*idle);
  EXPECT_FALSE(r.passed);
}

TEST(ScenarioHarness, AWritePastTheOutputFails) {
  std::unique_ptr<ScenarioWorld> w = ran_world(small_spec(ForwardMode::kDecode));
  poke_output(*w, w->calls[0].out.numel(), 0.5);  // first element of the guard rows
  const ScenarioResult r = judge_world(*w);
  EXPECT_FALSE(r.passed);
  EXPECT_NE(r.detail.find("past the end"), std::string::npos) << r.detail;
}

TEST(ScenarioHarness, StrayPoolWritesFail) {
  {
    // A byte of the decoy layer changed.
    std::unique_ptr<ScenarioWorld> w = ran_world(small_spec(ForwardMode::kDecode));
    static_cast<uint8_t*>(w->kv_cache->k_buffer(0).data())[100] ^= 0x10;
    const ScenarioResult r = judge_world(*w);
    EXPECT_FALSE(r.passed);
    EXPECT_FALSE(r.kv_pool_ok);
    EXPECT_NE(r.detail.find("layer 0"), std::string::npos) << r.detail;
  }
  {
    // A saved token holds the wrong value.
    std::unique_ptr<ScenarioWorld> w = ran_world(small_spec(ForwardMode::kExtend));
    const int32_t slot = w->calls[0].new_kv.slots.back();
    const int64_t index = int64_t(slot) * w->spec.num_kv_heads * w->spec.head_dim;
    DType kv = w->spec.kv_dtype;
    void* k = w->kv_cache->k_buffer(ScenarioWorld::kTestedLayer).data();
    encode_element(k, kv, index, decode_element(k, kv, index) * 1.5 + 0.25);
    const ScenarioResult r = judge_world(*w);
    EXPECT_FALSE(r.kv_pool_ok) << r.detail;
    EXPECT_FALSE(r.passed);
  }
}

// judge_world reads the saved tokens as stored by writing them into the world's ref_pool for
// the comparison; it must put the old values back (a world can be judged again).
TEST(ScenarioHarness, JudgingLeavesTheReferencePoolAsItWas) {
  for (const ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kExtend}) {
    std::unique_ptr<ScenarioWorld> w = ran_world(small_spec(mode));
    ASSERT_TRUE(w->spec.save_kv_cache);
    const std::vector<double> k = w->ref_pool.k;
    const std::vector<double> v = w->ref_pool.v;
    const ScenarioResult first = judge_world(*w);
    EXPECT_TRUE(first.passed) << first.detail;
    // The saved slots held NaN before the run (scenario_world.cpp), so a value left behind
    // would show as a difference here.
    EXPECT_TRUE(std::equal(k.begin(), k.end(), w->ref_pool.k.begin(), w->ref_pool.k.end(),
                           [](double a, double b) { return a == b || (a != a && b != b); }));
    EXPECT_TRUE(std::equal(v.begin(), v.end(), w->ref_pool.v.begin(), w->ref_pool.v.end(),
                           [](double a, double b) { return a == b || (a != a && b != b); }));
    const ScenarioResult second = judge_world(*w);
    EXPECT_EQ(second.passed, first.passed);
    EXPECT_EQ(second.max_rel_err, first.max_rel_err);
  }
}

TEST(ScenarioHarness, IgnoringAVariantFails) {
  struct Case {
    const char* what;
    ScenarioSpec spec;
    void (*break_layer)(AttentionLayer&);
  };
  ScenarioSpec window = small_spec(ForwardMode::kDecode);
  window.sliding_window = 8;
  window.min_kv_len = 40;
  ScenarioSpec softcap = small_spec(ForwardMode::kExtend);
  softcap.logit_cap = 3.f;
  ScenarioSpec layer_id = small_spec(ForwardMode::kDecode);
  layer_id.save_kv_cache = false;
  const Case cases[] = {
      {"window ignored", window, [](AttentionLayer& l) { l.sliding_window_size = -1; }},
      {"soft-cap ignored", softcap, [](AttentionLayer& l) { l.logit_cap = 0.f; }},
      {"scale wrong", small_spec(ForwardMode::kExtend),
       [](AttentionLayer& l) { l.scaling *= 1.1f; }},
      {"wrong layer read", layer_id, [](AttentionLayer& l) { l.layer_id = 0; }},
  };
  for (const Case& c : cases) {
    std::unique_ptr<ScenarioWorld> w = ScenarioWorld::build(c.spec, BackendKind::kCpu);
    AttentionLayer broken = w->layer;
    c.break_layer(broken);
    run_world(*w, broken);
    const ScenarioResult r = judge_world(*w);
    EXPECT_FALSE(r.passed) << c.what << ": err " << r.max_rel_err;
  }
}

TEST(ScenarioHarness, TheRaggedModelMatters) {
  // fp32 queries with bf16 KV: the ragged path reads the new K/V unrounded, the paged path
  // reads them rounded to bf16. Judging one by the other's model must fail at the fp32 bar.
  ScenarioSpec spec = small_spec(ForwardMode::kExtend);
  spec.q_dtype = DType::kFloat32;
  spec.force_ragged = true;
  std::unique_ptr<ScenarioWorld> w = ran_world(spec);
  ASSERT_TRUE(w->ragged);
  EXPECT_TRUE(judge_world(*w).passed);
  w->ragged = false;
  EXPECT_FALSE(judge_world(*w).passed);
}

TEST(ScenarioHarness, WorldsHoldNaNInUnownedSlotsAndShuffledSlots) {
  ScenarioSpec spec = small_spec(ForwardMode::kDecode);
  spec.page_size = 16;
  spec.batch_size = 5;
  spec.min_kv_len = 40;  // several pages per request
  std::unique_ptr<ScenarioWorld> w = ScenarioWorld::build(spec, BackendKind::kCpu);
  const RefKvPool& pool = w->ref_pool;
  const RefBatch& b = w->ref_batch;
  std::set<int32_t> owned;
  bool shuffled = false;
  for (int r = 0; r < b.batch_size(); ++r) {
    const int32_t* row = b.req_to_token.data() + int64_t(b.req_pool_indices[r]) * b.max_context_len;
    for (int i = 0; i < b.seq_lens[r]; ++i) {
      owned.insert(row[i]);
      if (i > 0 && row[i] != row[i - 1] + 1) shuffled = true;
      ASSERT_EQ(row[i] % 16, i % 16) << "token i sits at offset i % page_size";
    }
  }
  EXPECT_TRUE(shuffled) << "page order should not follow token order";
  int64_t nan_slots = 0;
  for (int64_t slot = 0; slot < pool.num_slots; ++slot) {
    const bool is_nan = std::isnan(pool.k_row(slot, 0)[0]) && std::isnan(pool.v_row(slot, 0)[0]);
    if (!owned.count(int32_t(slot))) {
      ASSERT_TRUE(is_nan) << "unowned slot " << slot << " is not NaN";
      ++nan_slots;
    }
  }
  EXPECT_GT(nan_slots, 16) << "partial pages and decoy pages leave NaN slots";
}

}  // namespace
}  // namespace kvattn::testing
