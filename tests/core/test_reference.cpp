// The float64 oracle checked on cases small enough to work out by hand, so the tests that
// lean on it do not take it on faith: which keys each mode and variant shows a query, the
// softmax formula, soft-cap, empty rows, and the save's rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "reference/float_format.h"
#include "reference/reference.h"

namespace kvattn::testing {
namespace {

AttentionLayer one_head_layer(int head_dim = 2) {
  AttentionLayer layer;
  layer.num_q_heads = 1;
  layer.num_kv_heads = 1;
  layer.head_dim = head_dim;
  layer.scaling = 1.f;
  return layer;
}

// One request in row 0 whose token i sits in slot 10 + i.
RefBatch one_request(ForwardMode mode, int seq_len, int max_context_len = 64) {
  RefBatch batch;
  batch.mode = mode;
  batch.req_pool_indices = {0};
  batch.seq_lens = {seq_len};
  batch.max_context_len = max_context_len;
  batch.req_to_token.resize(size_t(max_context_len));
  std::iota(batch.req_to_token.begin(), batch.req_to_token.end(), 10);
  return batch;
}

std::vector<int32_t> slots_of(const std::vector<RefKey>& keys) {
  std::vector<int32_t> slots;
  for (const RefKey& k : keys) slots.push_back(k.slot);
  return slots;
}

std::vector<int32_t> range(int32_t begin, int32_t end) {
  std::vector<int32_t> v;
  for (int32_t i = begin; i < end; ++i) v.push_back(i);
  return v;
}

TEST(Reference, OneKeyGivesItsValue) {
  RefKvPool pool = RefKvPool::make(16, 1, 2, 2);
  pool.k_row(10, 0)[0] = 0.5;
  pool.k_row(10, 0)[1] = -1.0;
  pool.v_row(10, 0)[0] = 3.0;
  pool.v_row(10, 0)[1] = -4.0;
  const RefBatch batch = one_request(ForwardMode::kDecode, 1);
  const RefOutput out = reference_attention(one_head_layer(), batch, pool, {2.0, 1.0});
  ASSERT_EQ(out.num_tokens, 1);
  EXPECT_EQ(out.out[0], 3.0);
  EXPECT_EQ(out.out[1], -4.0);
  EXPECT_DOUBLE_EQ(out.lse[0], 2.0 * 0.5 + 1.0 * -1.0);  // the lone logit
}

TEST(Reference, SoftmaxOfTwoKeys) {
  RefKvPool pool = RefKvPool::make(16, 1, 1, 1);
  pool.k_row(10, 0)[0] = 1.0;
  pool.k_row(11, 0)[0] = 2.0;
  pool.v_row(10, 0)[0] = 10.0;
  pool.v_row(11, 0)[0] = 20.0;
  AttentionLayer layer = one_head_layer(1);
  layer.scaling = 0.5f;
  const RefBatch batch = one_request(ForwardMode::kDecode, 2);
  const RefOutput out = reference_attention(layer, batch, pool, {3.0});
  // logits 1.5 and 3.0
  const double w0 = std::exp(1.5), w1 = std::exp(3.0);
  EXPECT_NEAR(out.out[0], (10 * w0 + 20 * w1) / (w0 + w1), 1e-12);
  EXPECT_NEAR(out.lse[0], std::log(w0 + w1), 1e-12);
  layer.logit_cap = 1.f;  // logits become tanh(1.5), tanh(3)
  const RefOutput capped = reference_attention(layer, batch, pool, {3.0});
  const double c0 = std::exp(std::tanh(1.5)), c1 = std::exp(std::tanh(3.0));
  EXPECT_NEAR(capped.out[0], (10 * c0 + 20 * c1) / (c0 + c1), 1e-12);
  EXPECT_NEAR(capped.lse[0], std::log(c0 + c1), 1e-12);
}

TEST(Reference, NoKeysGivesZerosAndMinusInfinity) {
  const RefKvPool pool = RefKvPool::make(16, 1, 2, 2);  // all NaN: nothing may be read
  const RefBatch batch = one_request(ForwardMode::kDecode, 0);
  const RefOutput out = reference_attention(one_head_layer(), batch, pool, {1.0, 1.0});
  EXPECT_EQ(out.out[0], 0.0);
  EXPECT_EQ(out.out[1], 0.0);
  EXPECT_EQ(out.lse[0], -std::numeric_limits<double>::infinity());
}

TEST(Reference, GqaHeadsShareTheirKvHead) {
  AttentionLayer layer;
  layer.num_q_heads = 4;
  layer.num_kv_heads = 2;
  layer.head_dim = 1;
  layer.scaling = 1.f;
  RefKvPool pool = RefKvPool::make(16, 2, 1, 1);
  for (int h = 0; h < 2; ++h) {
    pool.k_row(10, h)[0] = 1.0;
    pool.v_row(10, h)[0] = 100.0 * (h + 1);
  }
  const RefBatch batch = one_request(ForwardMode::kDecode, 1);
  const RefOutput out = reference_attention(layer, batch, pool, {1, 1, 1, 1});
  EXPECT_EQ(out.out, (std::vector<double>{100, 100, 200, 200}));
}

TEST(Reference, DecodeAndWindowKeys) {
  AttentionLayer layer = one_head_layer();
  const RefBatch batch = one_request(ForwardMode::kDecode, 7);
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)), range(10, 17));
  layer.sliding_window_size = 3;  // min(seq, W + 1) = 4 keys: positions 3..6
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)), range(13, 17));
  layer.sliding_window_size = 100;
  EXPECT_EQ(reference_visible_keys(layer, batch, 0, false).size(), 7u);
  layer.sliding_window_size = 0;  // only itself
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)), range(16, 17));
}

TEST(Reference, ExtendIsCausalBottomRight) {
  AttentionLayer layer = one_head_layer();
  RefBatch batch = one_request(ForwardMode::kExtend, 6);
  batch.prefix_lens = {4};
  batch.extend_lens = {2};
  ASSERT_EQ(reference_num_tokens(batch), 2);
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)), range(10, 15));
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 1, false)), range(10, 16));
  layer.sliding_window_size = 2;  // position 5 sees [3, 5]
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 1, false)), range(13, 16));
  // Ragged: the new tokens come from the new K/V rows, the prefix from the pool.
  layer.sliding_window_size = -1;
  const std::vector<RefKey> keys = reference_visible_keys(layer, batch, 1, true);
  ASSERT_EQ(keys.size(), 6u);
  EXPECT_EQ(keys[3].slot, 13);
  EXPECT_EQ(keys[4].slot, -1);
  EXPECT_EQ(keys[4].new_kv_row, 0);
  EXPECT_EQ(keys[5].new_kv_row, 1);
}

TEST(Reference, CrossAttentionKeys) {
  RefBatch batch = one_request(ForwardMode::kExtend, 3);
  batch.prefix_lens = {1};
  batch.extend_lens = {2};
  batch.encoder_lens = {5};
  AttentionLayer layer = one_head_layer();
  // Self layer: decoder tokens after the 5 encoder tokens, causal.
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)), range(15, 17));
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 1, false)), range(15, 18));
  // Cross layer: all encoder tokens, whatever the query.
  layer.is_cross_attention = true;
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)), range(10, 15));
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 1, false)), range(10, 15));
}

TEST(Reference, TreeMaskAndWindow) {
  RefBatch batch = one_request(ForwardMode::kTargetVerify, 3);
  batch.draft_token_num = 3;
  // Tree: token 0 root, token 1 child of 0, token 2 child of 0 (sibling of 1).
  const int kv_len = 6;
  batch.custom_mask = {1, 1, 1, 1, 0, 0,   //
                       1, 1, 1, 1, 1, 0,   //
                       1, 1, 1, 1, 0, 1};  //
  ASSERT_EQ(int(batch.custom_mask.size()), 3 * kv_len);
  AttentionLayer layer = one_head_layer();
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)), range(10, 14));
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 1, false)), range(10, 15));
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 2, false)),
            (std::vector<int32_t>{10, 11, 12, 13, 15}));
  // A window of 1 by tree positions (3, 4, 4): token 2 at position 4 sees positions >= 3.
  batch.positions = {3, 4, 4};
  layer.sliding_window_size = 1;
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 2, false)),
            (std::vector<int32_t>{13, 15}));
}

TEST(Reference, MultiStepDraftKeys) {
  RefBatch batch = one_request(ForwardMode::kDecode, 4);
  batch.topk = 2;
  batch.draft_step = 1;
  ASSERT_EQ(reference_num_tokens(batch), 2);
  const AttentionLayer layer = one_head_layer();
  // Branch 1 at step 1: prefix 0..3, then positions 4 + 0*2 + 1 = 5 and 4 + 1*2 + 1 = 7.
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 1, false)),
            (std::vector<int32_t>{10, 11, 12, 13, 15, 17}));
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)),
            (std::vector<int32_t>{10, 11, 12, 13, 14, 16}));
}

TEST(Reference, MultiStepDraftWindow) {
  RefBatch batch = one_request(ForwardMode::kDecode, 4);
  batch.topk = 2;
  batch.draft_step = 1;
  AttentionLayer layer = one_head_layer();
  // The query of step 1 sits at position 4 + 1 = 5; a window of 2 shows positions 3, 4, 5:
  // prefix token 3, then the branch's draft tokens of steps 0 and 1.
  layer.sliding_window_size = 2;
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 1, false)),
            (std::vector<int32_t>{13, 15, 17}));
  // A window of 0: the query's own draft token only.
  layer.sliding_window_size = 0;
  EXPECT_EQ(slots_of(reference_visible_keys(layer, batch, 0, false)),
            (std::vector<int32_t>{16}));
}

TEST(Reference, SaveRoundsThroughTheStorageDtype) {
  EXPECT_EQ(round_through_storage(1000.0, DType::kFloat8E4M3, 1.0), 448.0) << "saturates";
  EXPECT_EQ(round_through_storage(0.3, DType::kFloat8E4M3, 0.5), 0.625 * 0.5);
  EXPECT_EQ(round_through_storage(1.0 + 1.0 / 256, DType::kBFloat16, 7.0), 1.0) << "tie to even";
  EXPECT_EQ(round_through_storage(1.0 + 3.0 / 256, DType::kBFloat16, 7.0), 1.0 + 1.0 / 64);
  RefKvPool pool = RefKvPool::make(4, 1, 1, 1);
  RefNewKv kv;
  kv.slots = {2};
  kv.k = {0.3};
  kv.v = {-1000.0};
  reference_save_kv(pool, kv, DType::kFloat8E5M2, 1.0, 2.0);
  EXPECT_EQ(pool.k_row(2, 0)[0], 0.3125);            // e5m2 rounds 0.3 to 0.3125
  EXPECT_EQ(pool.v_row(2, 0)[0], -1024.0);  // -1000 / 2 = -500 rounds to -512, times 2
  EXPECT_TRUE(std::isnan(pool.k_row(1, 0)[0])) << "other slots untouched";
}

}  // namespace
}  // namespace kvattn::testing
