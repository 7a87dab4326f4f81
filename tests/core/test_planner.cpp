// The decode planner: chunk choice against the worked examples of planner.h, item coverage,
// LPT order, capacity bounds, the metadata buffer (dry run and fill agree), the grouped LPT
// estimate against a per-CTA simulation, the cost of replay planning, and the fixed-size
// (CUDA-graph) prefill plans: capacity bounds over random batches and no-op padding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <queue>
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

// fixed_chunk (a tuning knob) replaces the search when its items fit, and is ignored when not.
TEST(DecodePlanner, FixedChunkSplitsEveryLongRequest) {
  DecodePlanConfig config = h200_config();
  config.fixed_chunk = 100;  // rounded up to chunk_align 32: 128
  const std::vector<int32_t> kv_len{1000, 50, 129};
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(3, config));
  EXPECT_EQ(plan.chunk, 128);
  EXPECT_EQ(plan.items.size(), size_t(8 + 1 + 2));
  expect_plan_covers(plan, kv_len);
  config.fixed_chunk = 32;  // 1000 / 32 = 32 items: over a capacity of 4, so the search decides
  const DecodePlan fallback = plan_decode(kv_len, config, 4);
  EXPECT_NE(fallback.chunk, 32);
  EXPECT_LE(fallback.items.size(), 4u);
  expect_plan_covers(fallback, kv_len);
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
  // Every item as written: the plan's fields plus where its indices start (kv_indptr + begin).
  for (size_t i = 0; i < plan.items.size(); ++i) {
    DecodeWorkItem item;
    std::memcpy(&item, host.data() + filled.decode_items + i * sizeof(item), sizeof(item));
    EXPECT_EQ(item.request, plan.items[i].request);
    EXPECT_EQ(item.kv_begin, plan.items[i].kv_begin);
    EXPECT_EQ(item.partial, plan.items[i].partial);
    EXPECT_EQ(item.kv_offset, layout.kv_indptr[size_t(item.request)] + item.kv_begin) << i;
  }
  EXPECT_GT(plan.num_partials, 0) << "the 4000-token request should split";
  for (size_t offset : {filled.kv_indptr, filled.decode_items, filled.merge_indptr}) {
    EXPECT_EQ(offset % 16, 0u);
  }
  // Too small a host buffer, or a batch over capacity, is refused before anything is written.
  EXPECT_THROW(write_call_metadata(capacity, &layout, &plan, host.data(), host.size() - 1), Error);
  CallCapacity small = capacity;
  small.batch_size = 2;
  EXPECT_THROW(write_call_metadata(small, &layout, &plan, host.data(), host.size()), Error);
}

// ---- the LPT estimate ---------------------------------------------------------------------------

// The estimate from first principles: every CTA of every item (heaviest first) on the least
// loaded of the slots, one at a time.
double per_cta_makespan(const std::vector<int32_t>& kv_len, const DecodePlanConfig& config,
                        int chunk) {
  std::vector<double> costs;
  for (int32_t len : kv_len) {
    const int64_t pieces = std::max<int64_t>(1, (int64_t(len) + chunk - 1) / chunk);
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t end = std::min<int64_t>(len, (p + 1) * chunk);
      costs.push_back(double(end - p * chunk) + config.cta_overhead_tokens +
                      (pieces > 1 ? config.merge_overhead_tokens : 0));
    }
  }
  if (costs.empty()) return 0;
  std::sort(costs.begin(), costs.end(), std::greater<>());
  if (config.concurrent_ctas == 0) return costs.front();
  const int64_t slots =
      std::min<int64_t>(config.concurrent_ctas, int64_t(costs.size()) * config.ctas_per_item);
  std::priority_queue<double, std::vector<double>, std::greater<>> loads;
  for (int64_t s = 0; s < slots; ++s) loads.push(0.0);
  double makespan = 0;
  for (double cost : costs) {
    for (int c = 0; c < config.ctas_per_item; ++c) {
      const double load = loads.top() + cost;
      loads.pop();
      loads.push(load);
      makespan = std::max(makespan, load);
    }
  }
  return makespan;
}

TEST(DecodePlanner, GroupedEstimateEqualsPerCtaSimulation) {
  std::mt19937 rng(777);
  int grouped = 0;
  for (int trial = 0; trial < 300; ++trial) {
    DecodePlanConfig config = h200_config();
    config.ctas_per_item = 1 + int(rng() % 12);
    // Slot counts both divisible by ctas_per_item (the grouped path) and not.
    config.concurrent_ctas = trial % 7 == 0 ? 0 : 1 + int(rng() % 600);
    if (trial % 2 == 0 && config.concurrent_ctas > 0) {
      config.concurrent_ctas = config.ctas_per_item * (1 + int(rng() % 70));
      ++grouped;
    }
    const int bs = 1 + int(rng() % 200);
    std::vector<int32_t> kv_len(static_cast<size_t>(bs));
    for (auto& len : kv_len) len = int32_t(rng() % 9000);
    const int chunk = 1 + int(rng() % 5000);
    EXPECT_EQ(estimate_decode_makespan(kv_len, config, chunk),
              per_cta_makespan(kv_len, config, chunk))
        << "trial " << trial << " ctas_per_item " << config.ctas_per_item << " slots "
        << config.concurrent_ctas;
  }
  EXPECT_GT(grouped, 100);
}

// Equal lengths launch in request order (the reproducible dispatch order the planner promises).
TEST(DecodePlanner, EqualItemsKeepRequestOrder) {
  const std::vector<int32_t> kv_len{7, 300, 7, 300, 7};
  const DecodePlanConfig config = h200_config();
  const DecodePlan plan = plan_decode(kv_len, config, decode_item_capacity(5, config));
  ASSERT_EQ(plan.items.size(), 5u);
  const int expected[] = {1, 3, 0, 2, 4};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(plan.items[size_t(i)].request, expected[i]) << i;
  // A large uniform batch has no room to split: nothing was estimated.
  const std::vector<int32_t> big(256, 4096);
  EXPECT_EQ(plan_decode(big, config, decode_item_capacity(256, config)).estimated_cost, 0.0);
}

// A CUDA-graph replay re-plans every decode step into buffers sized once for the batch size: for
// lengths that grow step by step, every plan must fit the capacity decode_item_capacity gave, and
// planning the same lengths twice must give the same plan (a replay may re-plan a step). How long
// planning takes is measured by `kvattn bench --planner` (plan_decode alone and the whole host
// planning of a step), never asserted in a test.
TEST(DecodePlanner, ReplayPlansFitTheirCapacity) {
  const DecodePlanConfig config = h200_config();
  for (int bs : {1, 64, 256}) {
    std::vector<int32_t> base(static_cast<size_t>(bs));
    std::mt19937 rng{uint32_t(bs)};
    for (auto& len : base) len = 1024 + int32_t(rng() % 3072);
    std::vector<int32_t> kv_len = base;
    const int capacity = decode_item_capacity(bs, config);
    for (int step = 0; step < 400; ++step) {
      for (size_t r = 0; r < kv_len.size(); ++r) kv_len[r] = base[r] + step;
      const DecodePlan plan = plan_decode(kv_len, config, capacity);
      ASSERT_LE(int(plan.items.size()), capacity) << "batch " << bs << " step " << step;
      if (step % 97 == 0) {
        const DecodePlan again = plan_decode(kv_len, config, capacity);
        ASSERT_EQ(again.items.size(), plan.items.size());
        for (size_t i = 0; i < plan.items.size(); ++i) {
          EXPECT_EQ(again.items[i].request, plan.items[i].request);
          EXPECT_EQ(again.items[i].kv_begin, plan.items[i].kv_begin);
          EXPECT_EQ(again.items[i].kv_end, plan.items[i].kv_end);
        }
      }
    }
  }
}

// ---- fixed-size prefill plans ------------------------------------------------------------------

PrefillTileShape graph_shape(int q_heads, int kv_heads, int tile_rows, int concurrent,
                             MaskMode mask, int window) {
  PrefillTileShape s;
  s.num_q_heads = q_heads;
  s.num_kv_heads = kv_heads;
  s.tile_rows = tile_rows;
  s.kv_tile = 64;
  s.mask = mask;
  s.window_left = window;
  s.concurrent_ctas = concurrent;
  return s;
}

TEST(PrefillCapacity, WorkedExampleOfPlannerH) {
  const PrefillTileShape s = graph_shape(32, 8, 128, 264, MaskMode::kCustom, -1);
  const PrefillPlanCapacity c = prefill_plan_capacity(64, 8, s);
  EXPECT_EQ(c.items, 776);
  EXPECT_EQ(c.merges, 264);
  EXPECT_EQ(c.partials, 528);
  const PrefillPlanCapacity none =
      prefill_plan_capacity(3, 1, graph_shape(32, 8, 128, 0, MaskMode::kCausal, -1));
  EXPECT_EQ(none.items, 24);
  EXPECT_EQ(none.merges, 0);
  EXPECT_EQ(none.partials, 0);
}

// Random batches of a bucket (every request q_len or fewer query tokens, any KV lengths from 0
// to very long, every mask, with and without a window, many device sizes): the plan always fits
// the capacity, which depends on the batch size and q_len alone.
TEST(PrefillCapacity, RandomPlansFitTheirBucket) {
  std::mt19937 rng(2024);
  int split_plans = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int kv_heads = 1 + int(rng() % 8);
    const int group = 1 + int(rng() % 8);
    const int tile_rows = trial % 3 == 0 ? 64 : 128;
    const int concurrent = trial % 5 == 0 ? 0 : 1 + int(rng() % 600);
    const MaskMode mask = trial % 3 == 0   ? MaskMode::kCausal
                          : trial % 3 == 1 ? MaskMode::kCustom
                                           : MaskMode::kNone;
    const int window = rng() % 2 ? -1 : int(rng() % 3000);
    const PrefillTileShape s =
        graph_shape(kv_heads * group, kv_heads, tile_rows, concurrent, mask, window);
    const int bs = 1 + int(rng() % 64);
    const int q_len = trial % 4 == 0 ? 1 : 1 + int(rng() % 16);  // decode, or verify trees
    std::vector<int32_t> qo{0};
    std::vector<int64_t> kv{0};
    for (int r = 0; r < bs; ++r) {
      const int q = rng() % 5 == 0 ? int(rng() % (q_len + 1)) : q_len;
      const int kind = int(rng() % 4);
      int64_t len = kind == 0 ? 0 : kind == 1 ? int64_t(rng() % 200) : int64_t(rng() % 70000);
      if (mask == MaskMode::kCausal) len = std::max<int64_t>(len, q);
      qo.push_back(qo.back() + q);
      kv.push_back(kv.back() + len);
    }
    PrefillTilePlan plan = plan_prefill_tiles(qo, kv, s);
    const PrefillPlanCapacity cap = prefill_plan_capacity(bs, q_len, s);
    if (!plan.merges.empty()) ++split_plans;
    ASSERT_LE(int(plan.items.size()), cap.items) << "trial " << trial;
    ASSERT_LE(int(plan.merges.size()), cap.merges) << "trial " << trial;
    ASSERT_LE(plan.num_partials, cap.partials) << "trial " << trial;
  }
  EXPECT_GT(split_plans, 50);  // the split-KV bounds were exercised
}

// EXTEND-like buckets (num_tokens query tokens split among batch_size requests any way, the
// device planner's capacity): random splits, including requests without tokens, one request
// holding them all and lengths just past a tile, always fit; the worked example of planner.h;
// and the bound is reached (it is not loose by more than one tile a request).
TEST(PrefillCapacity, TokenBucketsFitEverySplit) {
  {
    const PrefillTileShape s = graph_shape(32, 8, 128, 264, MaskMode::kCausal, -1);
    const PrefillPlanCapacity c = prefill_plan_capacity_for_tokens(16, 4096, s);
    EXPECT_EQ(c.row_tiles, 143);
    EXPECT_EQ(c.items, 1408);
    EXPECT_EQ(c.merges, 264);
    EXPECT_EQ(c.partials, 528);
  }
  std::mt19937 rng(77);
  int split_plans = 0;
  int tight = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int kv_heads = 1 + int(rng() % 8);
    const int group = 1 + int(rng() % 8);
    const int tile_rows = trial % 3 == 0 ? 64 : 128;
    const int concurrent = trial % 5 == 0 ? 0 : 1 + int(rng() % 600);
    const int window = rng() % 2 ? -1 : int(rng() % 3000);
    const PrefillTileShape s =
        graph_shape(kv_heads * group, kv_heads, tile_rows, concurrent, MaskMode::kCausal, window);
    const int bs = 1 + int(rng() % 64);
    const int64_t tokens = trial % 7 == 0 ? int64_t(rng() % 8) : int64_t(rng() % 9000);
    // A random split of `tokens` among bs requests (some empty; trial % 4 == 1: one takes all;
    // trial % 4 == 2: each just over a tile where the tokens allow).
    std::vector<int64_t> q(size_t(bs), 0);
    int64_t left = tokens;
    if (trial % 4 == 1) {
      q[size_t(rng() % bs)] = tokens;
      left = 0;
    } else if (trial % 4 == 2) {
      const int64_t just_over = tile_rows / group + 1;
      for (int r = 0; r < bs && left >= just_over; ++r) q[size_t(r)] = just_over, left -= just_over;
    }
    while (left > 0) {
      const int64_t take = std::min<int64_t>(left, 1 + int64_t(rng() % 600));
      q[size_t(rng() % bs)] += take;
      left -= take;
    }
    std::vector<int32_t> qo{0};
    std::vector<int64_t> kv{0};
    for (int r = 0; r < bs; ++r) {
      const int64_t prefix = rng() % 3 == 0 ? 0 : int64_t(rng() % 20000);
      qo.push_back(qo.back() + int32_t(q[size_t(r)]));
      kv.push_back(kv.back() + prefix + q[size_t(r)]);
    }
    const PrefillTilePlan plan = plan_prefill_tiles(qo, kv, s);
    const PrefillPlanCapacity cap = prefill_plan_capacity_for_tokens(bs, tokens, s);
    if (!plan.merges.empty()) ++split_plans;
    int64_t row_tiles = 0;
    for (int r = 0; r < bs; ++r) row_tiles += (q[size_t(r)] * group + tile_rows - 1) / tile_rows;
    if (row_tiles + bs >= cap.row_tiles) ++tight;
    ASSERT_LE(row_tiles, cap.row_tiles) << "trial " << trial;
    ASSERT_LE(int(plan.items.size()), cap.items) << "trial " << trial;
    ASSERT_LE(int(plan.merges.size()), cap.merges) << "trial " << trial;
    ASSERT_LE(plan.num_partials, cap.partials) << "trial " << trial;
  }
  EXPECT_GT(split_plans, 50);
  EXPECT_GT(tight, 100);
  const PrefillTileShape cluster = [] {
    PrefillTileShape s = graph_shape(32, 8, 32, 264, MaskMode::kCausal, -1);
    s.cluster = 4;
    return s;
  }();
  EXPECT_THROW(prefill_plan_capacity_for_tokens(4, 64, cluster), Error);
  EXPECT_THROW(
      prefill_plan_capacity_for_tokens(4, -1, graph_shape(32, 8, 128, 264, MaskMode::kCausal, -1)),
      Error);
}

TEST(PrefillCapacity, PaddingAppendsNoOpsAndKeepsTheRealItems) {
  const PrefillTileShape s = graph_shape(32, 8, 128, 264, MaskMode::kCustom, -1);
  std::vector<int32_t> qo{0, 4, 8, 12};
  std::vector<int64_t> kv{0, 40000, 40004, 40010};
  const PrefillTilePlan original = plan_prefill_tiles(qo, kv, s);
  ASSERT_FALSE(original.merges.empty());
  const PrefillPlanCapacity cap = prefill_plan_capacity(3, 4, s);
  PrefillTilePlan padded = original;
  pad_prefill_plan(padded, cap);
  ASSERT_EQ(int(padded.items.size()), cap.items);
  ASSERT_EQ(int(padded.merges.size()), cap.merges);
  EXPECT_EQ(padded.num_partials, cap.partials);
  EXPECT_EQ(padded.tile_rows, original.tile_rows);
  EXPECT_EQ(padded.group_size, original.group_size);
  for (size_t i = 0; i < original.items.size(); ++i) {
    EXPECT_EQ(std::memcmp(&padded.items[i], &original.items[i], sizeof(PrefillWorkItem)), 0) << i;
  }
  for (size_t i = 0; i < original.merges.size(); ++i) {
    EXPECT_EQ(std::memcmp(&padded.merges[i], &original.merges[i], sizeof(PrefillMergeItem)), 0);
  }
  // The no-op contract of prefill_tiles.h: past every request's rows, no keys, no partial.
  const int group = 4;
  for (size_t i = original.items.size(); i < padded.items.size(); ++i) {
    const PrefillWorkItem& it = padded.items[i];
    ASSERT_GE(it.request, 0);
    ASSERT_LT(it.request, 3);
    EXPECT_GE(it.q_row_begin, (qo[it.request + 1] - qo[it.request]) * group);
    EXPECT_LT(int64_t(it.q_row_begin) + 2 * s.tile_rows, int64_t(INT32_MAX));  // no overflow
    EXPECT_EQ(it.kv_begin, it.kv_end);
    EXPECT_EQ(it.partial, -1);
  }
  for (size_t i = original.merges.size(); i < padded.merges.size(); ++i) {
    EXPECT_EQ(padded.merges[i].num_partials, 0);
    EXPECT_GE(padded.merges[i].q_row_begin, kNoOpRow);
  }
  // A plan larger than the capacity is refused, not truncated.
  PrefillTilePlan too_big = original;
  PrefillPlanCapacity small = cap;
  small.items = int(original.items.size()) - 1;
  try {
    pad_prefill_plan(too_big, small);
    ADD_FAILURE() << "an oversized plan was padded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfResources);
  }
  // The buffer layout of a padded plan depends on the capacity alone.
  PrefillTilePlan other =
      plan_prefill_tiles(std::vector<int32_t>{0, 4, 8, 12}, std::vector<int64_t>{0, 5, 10, 15}, s);
  pad_prefill_plan(other, cap);
  const PrefillBufferLayout a = write_prefill_buffer(padded, 128, nullptr, 0, nullptr, nullptr);
  const PrefillBufferLayout b = write_prefill_buffer(other, 128, nullptr, 0, nullptr, nullptr);
  EXPECT_EQ(a.metadata_bytes, b.metadata_bytes);
  EXPECT_EQ(a.total_bytes, b.total_bytes);
}

TEST(PrefillCapacity, RejectsBadInput) {
  const PrefillTileShape s = graph_shape(32, 8, 128, 264, MaskMode::kCausal, -1);
  EXPECT_THROW(prefill_plan_capacity(-1, 1, s), Error);
  EXPECT_THROW(prefill_plan_capacity(1, -1, s), Error);
  EXPECT_THROW(prefill_plan_capacity(1, kNoOpRow, s), Error);  // rows would reach the no-op row
  PrefillTileShape bad = s;
  bad.num_q_heads = 30;
  EXPECT_THROW(prefill_plan_capacity(1, 1, bad), Error);
}

// ---- the device planner's rule (issue 15) ---------------------------------------------------

// The makespan of a plan as the hardware runs it: items in launch order, each item's
// ctas_per_item CTAs taking the earliest-free of concurrent_ctas slots (the block dispatcher
// starts CTAs in index order as slots free up), costs in token-equivalents as plan_decode's
// estimate counts them.
double in_order_makespan(const DecodePlan& plan, const DecodePlanConfig& config) {
  std::priority_queue<int64_t, std::vector<int64_t>, std::greater<>> slots;
  for (int i = 0; i < config.concurrent_ctas; ++i) slots.push(0);
  int64_t makespan = 0;
  for (const DecodeWorkItem& item : plan.items) {
    const int64_t cost = int64_t(item.kv_end) - item.kv_begin + config.cta_overhead_tokens +
                         (item.partial >= 0 ? config.merge_overhead_tokens : 0);
    for (int c = 0; c < config.ctas_per_item; ++c) {
      const int64_t end = slots.top() + cost;
      slots.pop();
      slots.push(end);
      makespan = std::max(makespan, end);
    }
  }
  return double(makespan);
}

TEST(DecodePlanRule, CoversEveryRequestWithinCapacity) {
  const DecodePlanConfig config = h200_config();
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int bs = 1 + int(rng() % 300);
    std::vector<int32_t> kv_len(static_cast<size_t>(bs));
    for (int32_t& len : kv_len) len = int32_t(rng() % (trial % 3 == 0 ? 40000 : 3000));
    const int capacity = decode_item_capacity(bs, config);
    const DecodePlan plan = plan_decode_rule(kv_len, config, capacity);
    expect_plan_covers(plan, kv_len);
    EXPECT_LE(int(plan.items.size()), capacity);
    for (const DecodeWorkItem& item : plan.items) EXPECT_EQ(item.kv_begin % plan.chunk, 0);
  }
  // The worked examples of planner.h: 64 x 4096 stays whole; 1 x 32768 splits into chunks of
  // 32768 x 8 / 528 (+ overhead) -> 512 tokens.
  EXPECT_EQ(
      plan_decode_rule(std::vector<int32_t>(64, 4096), config, decode_item_capacity(64, config))
          .items.size(),
      64u);
  const DecodePlan one =
      plan_decode_rule(std::vector<int32_t>{32768}, config, decode_item_capacity(1, config));
  EXPECT_EQ(one.chunk, 512);
  EXPECT_EQ(one.items.size(), 64u);
  // No device size: no split.
  DecodePlanConfig none = config;
  none.concurrent_ctas = 0;
  EXPECT_EQ(plan_decode_rule(std::vector<int32_t>{32768}, none, 4).items.size(), 1u);
}

// Load balance of the rule (closed-form chunk) against plan_decode (searched chunk), both
// heaviest first and run in order on the H200 setup, over batch shapes a server sees:
// uniform, ragged, one long request among short ones. Measured on this suite (seed 12, 600
// batches): geomean 0.972, worst 1.110; the same rule in request order measured 1.142 / 1.650
// (so the bars below fail without the heaviest-first order). bench/NOTES.md, "device-plan rule".
TEST(DecodePlanRule, LoadBalanceAgainstTheSearch) {
  const DecodePlanConfig config = h200_config();
  std::mt19937 rng(12);
  double log_sum = 0;
  double worst = 0;
  double best = 1e9;
  int count = 0;
  int worse_by_10 = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int bs = std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128, 256}[size_t(trial % 9)];
    std::vector<int32_t> kv_len(static_cast<size_t>(bs));
    const int shape = (trial / 9) % 3;
    for (int32_t& len : kv_len) {
      if (shape == 0) len = int32_t(1024 + rng() % 31744);  // ragged 1K..32K
      if (shape == 1) len = int32_t(4096 + rng() % 64);     // near-uniform 4K
      if (shape == 2) len = int32_t(256 + rng() % 1792);    // short 256..2K
    }
    if (shape == 2) kv_len[0] = int32_t(32768 + rng() % 32768);  // ... and one long request
    const int capacity = decode_item_capacity(bs, config);
    const double searched = in_order_makespan(plan_decode(kv_len, config, capacity), config);
    const double rule = in_order_makespan(plan_decode_rule(kv_len, config, capacity), config);
    const double ratio = rule / searched;
    log_sum += std::log(ratio);
    worst = std::max(worst, ratio);
    best = std::min(best, ratio);
    worse_by_10 += ratio > 1.10;
    ++count;
  }
  const double geomean = std::exp(log_sum / count);
  std::printf(
      "rule / searched makespan over %d batches: geomean %.3f, best %.3f, worst %.3f, "
      "%d worse by > 10%%\n",
      count, geomean, best, worst, worse_by_10);
  EXPECT_LE(geomean, 1.0);
  EXPECT_LE(worst, 1.15);
}

}  // namespace
}  // namespace kvattn::core
