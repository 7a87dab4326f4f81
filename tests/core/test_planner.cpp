// The decode planner: chunk choice against the worked examples of planner.h, item coverage,
// LPT order, capacity bounds, and the metadata buffer (dry run and fill agree).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "core/planner.h"
#include "kvattn/error.h"

namespace kvattn::core {
namespace {

// The H200 decode setup of planner.h: 132 SMs x 4 CTAs, 8 kv heads, one head pass.
DecodePlanConfig h200_config() {
  DecodePlanConfig config;
  config.ctas_per_item = 8;
  config.concurrent_ctas = 132 * 4;
  return config;
}

// Every token of every request is covered exactly once; partial rows are consistent.
void expect_plan_covers(const DecodePlan& plan, const std::vector<int32_t>& kv_len) {
  const int bs = int(kv_len.size());
  ASSERT_EQ(plan.merge_indptr.size(), size_t(bs) + 1);
  std::vector<std::vector<std::pair<int, int>>> ranges(static_cast<size_t>(bs));
  std::vector<int> partial_seen(static_cast<size_t>(plan.num_partials), 0);
  for (const DecodeWorkItem& item : plan.items) {
    ASSERT_GE(item.request, 0);
    ASSERT_LT(item.request, bs);
    ASSERT_LE(item.kv_begin, item.kv_end);
    ranges[item.request].push_back({item.kv_begin, item.kv_end});
    const int32_t first = plan.merge_indptr[item.request];
    const int32_t last = plan.merge_indptr[item.request + 1];
    if (item.partial < 0) {
      EXPECT_EQ(first, last) << "a request with partials also writes directly";
    } else {
      ASSERT_GE(item.partial, first);
      ASSERT_LT(item.partial, last);
      partial_seen[item.partial]++;
    }
  }
  for (int p = 0; p < plan.num_partials; ++p) EXPECT_EQ(partial_seen[p], 1) << "partial " << p;
  for (int r = 0; r < bs; ++r) {
    auto& rs = ranges[r];
    ASSERT_FALSE(rs.empty()) << "request " << r << " has no item (kv_len 0 must still write)";
    std::sort(rs.begin(), rs.end());
    int expect = 0;
    for (auto [b, e] : rs) {
      EXPECT_EQ(b, expect) << "request " << r;
      expect = e;
    }
    EXPECT_EQ(expect, kv_len[r]) << "request " << r;
    const int pieces = plan.merge_indptr[r + 1] - plan.merge_indptr[r];
    EXPECT_EQ(pieces == 0 ? 1 : pieces, int(rs.size()));
  }
  // Heaviest first.
  for (size_t i = 1; i < plan.items.size(); ++i) {
    const int a = plan.items[i - 1].kv_end - plan.items[i - 1].kv_begin;
    const int b = plan.items[i].kv_end - plan.items[i].kv_begin;
    EXPECT_GE(a, b) << "item " << i;
  }
}

TEST(DecodePlanner, LargeUniformBatchIsNotSplit) {
  const std::vector<int32_t> kv_len(64, 4096);
  const DecodePlanConfig config = h200_config();
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(64, config));
  EXPECT_EQ(plan.chunk, 4096);
  EXPECT_EQ(plan.items.size(), 64u);
  EXPECT_EQ(plan.num_partials, 0);
  expect_plan_covers(plan, kv_len);
}

TEST(DecodePlanner, SingleLongRequestFillsTheDevice) {
  const std::vector<int32_t> kv_len{32768};
  const DecodePlanConfig config = h200_config();
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(1, config));
  // One wave: at least 3/4 of the CTA slots busy, none queued behind another.
  const int64_t ctas = int64_t(plan.items.size()) * config.ctas_per_item;
  EXPECT_GE(ctas, config.concurrent_ctas * 3 / 4);
  EXPECT_LE(ctas, config.concurrent_ctas);
  EXPECT_EQ(plan.chunk % config.chunk_align, 0);
  EXPECT_GE(plan.chunk, config.min_chunk);
  EXPECT_EQ(plan.num_partials, int(plan.items.size()));
  // 60x better than the unsplit plan's estimate, as the worked example says.
  EXPECT_LT(plan.estimated_cost * 40, estimate_decode_makespan(kv_len, config, 32768));
  expect_plan_covers(plan, kv_len);
}

TEST(DecodePlanner, SmallBatchSplitsToFillTheDevice) {
  const std::vector<int32_t> kv_len(16, 4096);
  const DecodePlanConfig config = h200_config();
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(16, config));
  EXPECT_LT(plan.chunk, 4096);
  EXPECT_LE(int64_t(plan.items.size()) * config.ctas_per_item, config.concurrent_ctas);
  expect_plan_covers(plan, kv_len);
}

TEST(DecodePlanner, UnevenLengthsSplitTheLongOne) {
  // One long request among short ones: without a split it alone sets the step time.
  std::vector<int32_t> kv_len(32, 200);
  kv_len[7] = 30000;
  const DecodePlanConfig config = h200_config();
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(32, config));
  EXPECT_LT(plan.chunk, 30000);
  EXPECT_GT(plan.merge_indptr[8] - plan.merge_indptr[7], 1);
  EXPECT_EQ(plan.merge_indptr[1], 0);  // short requests are not split
  EXPECT_LT(plan.estimated_cost * 4, estimate_decode_makespan(kv_len, config, 30000));
  expect_plan_covers(plan, kv_len);
}

TEST(DecodePlanner, EmptyAndTinyRequestsGetOneItemEach) {
  const std::vector<int32_t> kv_len{0, 1, 0, 17, 5000};
  const DecodePlanConfig config = h200_config();
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(5, config));
  expect_plan_covers(plan, kv_len);
}

TEST(DecodePlanner, NoSplitWithoutDeviceSize) {
  DecodePlanConfig config = h200_config();
  config.concurrent_ctas = 0;
  const std::vector<int32_t> kv_len{32768, 3};
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(2, config));
  EXPECT_EQ(plan.items.size(), 2u);
  EXPECT_EQ(plan.num_partials, 0);
  expect_plan_covers(plan, kv_len);
}

TEST(DecodePlanner, RandomBatchesStayWithinCapacity) {
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    const int bs = 1 + int(rng() % 300);
    std::vector<int32_t> kv_len(static_cast<size_t>(bs));
    const int max_len = 1 + int(rng() % 40000);
    for (auto& len : kv_len) len = int32_t(rng() % uint32_t(max_len + 1));
    DecodePlanConfig config = h200_config();
    config.ctas_per_item = 1 + int(rng() % 16);
    const int capacity = decode_item_capacity(bs, config);
    const DecodePlan plan = plan_decode(kv_len, config, capacity);
    ASSERT_LE(int(plan.items.size()), capacity) << "trial " << trial;
    expect_plan_covers(plan, kv_len);
    // Never worse than not splitting.
    EXPECT_LE(plan.estimated_cost,
              estimate_decode_makespan(kv_len, config, std::max(1, max_len)) + 1e-9);
  }
}

TEST(DecodePlanner, RejectsBadInput) {
  const DecodePlanConfig config = h200_config();
  const std::vector<int32_t> negative{4, -1};
  EXPECT_THROW(plan_decode(negative, config, 10), Error);
  const std::vector<int32_t> ok{4, 4, 4};
  EXPECT_THROW(plan_decode(ok, config, 2), Error);  // capacity below the batch size
  DecodePlanConfig bad = config;
  bad.ctas_per_item = 0;
  EXPECT_THROW(plan_decode(ok, bad, 10), Error);
}

TEST(CallMetadata, DryRunAndFillAgree) {
  const std::vector<int32_t> kv_len{5, 0, 4000};
  const DecodePlanConfig config = h200_config();
  CallCapacity capacity;
  capacity.batch_size = 8;  // a graph bucket larger than the batch
  capacity.decode_items = decode_item_capacity(8, config);
  capacity.num_q_heads = 32;
  capacity.v_head_dim = 128;
  const CallMetadataLayout dry = write_call_metadata(capacity, nullptr, nullptr, nullptr, 0);
  EXPECT_GT(dry.metadata_bytes, 0u);
  EXPECT_EQ(dry.scratch_bytes, size_t(capacity.decode_items) * 32 * (128 + 1) * sizeof(float));

  PagedLayout layout;
  layout.batch_size = 3;
  layout.qo_indptr = {0, 1, 2, 3};
  layout.kv_start = {0, 0, 0};
  layout.kv_len = kv_len;
  layout.kv_indptr = {0, 5, 5, 4005};
  const DecodePlan plan = plan_decode(kv_len, config, capacity.decode_items);
  std::vector<unsigned char> host(dry.metadata_bytes, 0xAB);
  const CallMetadataLayout filled =
      write_call_metadata(capacity, &layout, &plan, host.data(), host.size());
  EXPECT_EQ(std::memcmp(&dry, &filled, sizeof(dry)), 0);
  // Read the arrays back.
  int64_t kv_indptr[4];
  std::memcpy(kv_indptr, host.data() + filled.kv_indptr, sizeof(kv_indptr));
  EXPECT_EQ(kv_indptr[3], 4005);
  int32_t n = 0;
  std::memcpy(&n, host.data() + filled.num_items, sizeof(n));
  EXPECT_EQ(n, int(plan.items.size()));
  DecodeWorkItem first;
  std::memcpy(&first, host.data() + filled.decode_items, sizeof(first));
  EXPECT_EQ(first.request, plan.items[0].request);
  for (size_t offset : {filled.kv_indptr, filled.decode_items, filled.merge_indptr}) {
    EXPECT_EQ(offset % 16, 0u);
  }
  // Too small a host buffer, or a batch over capacity, is refused before anything is written.
  EXPECT_THROW(write_call_metadata(capacity, &layout, &plan, host.data(), host.size() - 1), Error);
  CallCapacity small = capacity;
  small.batch_size = 2;
  EXPECT_THROW(write_call_metadata(small, &layout, &plan, host.data(), host.size()), Error);
}

}  // namespace
}  // namespace kvattn::core
