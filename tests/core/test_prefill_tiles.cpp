// The prefill tile planner: every (request, kv head, packed row) is covered exactly once, the
// KV ranges are the visible ones, heavy tiles come first, split chunks tile their range, and the
// buffer routine's sizing and filling agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "core/planner.h"
#include "core/prefill_tiles.h"
#include "kvattn/error.h"

namespace kvattn::core {
namespace {

struct Batch {
  std::vector<int32_t> qo_indptr{0};
  std::vector<int64_t> kv_indptr{0};
  void add(int32_t q_len, int64_t kv_len) {
    qo_indptr.push_back(qo_indptr.back() + q_len);
    kv_indptr.push_back(kv_indptr.back() + kv_len);
  }
};

PrefillTileShape make_shape(MaskMode mask, int window = -1, int concurrent = 0) {
  PrefillTileShape s;
  s.num_q_heads = 32;
  s.num_kv_heads = 8;
  s.tile_rows = 128;
  s.kv_tile = 64;
  s.mask = mask;
  s.window_left = window;
  s.concurrent_ctas = concurrent;
  return s;
}

// The keys a tile must see, from first principles: the union over its rows' visible ranges.
std::pair<int64_t, int64_t> visible_range(const Batch& b, const PrefillTileShape& s, int r,
                                          int64_t row_begin) {
  const int group = s.num_q_heads / s.num_kv_heads;
  const int64_t q_len = b.qo_indptr[r + 1] - b.qo_indptr[r];
  const int64_t kv_len = b.kv_indptr[r + 1] - b.kv_indptr[r];
  int64_t lo = kv_len, hi = 0;
  for (int64_t row = row_begin; row < std::min(q_len * group, row_begin + s.tile_rows); ++row) {
    const int64_t i = row / group;
    for (int64_t j = 0; j < kv_len; ++j) {
      bool visible = true;
      if (s.mask == MaskMode::kCausal && j > kv_len - q_len + i) visible = false;
      if (s.window_left >= 0 && s.mask != MaskMode::kNone && j < kv_len - q_len + i - s.window_left)
        visible = false;
      if (visible) {
        lo = std::min(lo, j);
        hi = std::max(hi, j + 1);
      }
    }
  }
  if (hi <= lo) return {-1, -1};  // nothing visible: any empty range will do
  return {lo, hi};
}

// Checks coverage and ranges; returns the plan for further checks.
PrefillTilePlan plan_and_check(const Batch& b, const PrefillTileShape& s) {
  PrefillTilePlan plan = plan_prefill_tiles(b.qo_indptr, b.kv_indptr, s);
  const int group = s.num_q_heads / s.num_kv_heads;
  EXPECT_EQ(plan.group_size, group);
  EXPECT_EQ(plan.tile_rows, s.tile_rows);

  // Each (request, head, q tile) appears once unsplit, or as num_partials chunks with a merge.
  std::map<std::tuple<int, int, int>, std::vector<PrefillWorkItem>> by_tile;
  for (const PrefillWorkItem& it : plan.items) {
    by_tile[{it.request, it.kv_head, it.q_row_begin}].push_back(it);
    // The request's first K/V index, as the kernel's indptr has it.
    EXPECT_EQ(it.kv_base, b.kv_indptr[it.request]) << "request " << it.request;
    EXPECT_EQ(it.q_begin, b.qo_indptr[it.request]) << "request " << it.request;
    EXPECT_EQ(it.q_end, b.qo_indptr[it.request + 1]) << "request " << it.request;
    EXPECT_EQ(it.kv_len, b.kv_indptr[it.request + 1] - b.kv_indptr[it.request])
        << "request " << it.request;
  }
  std::map<std::tuple<int, int, int>, PrefillMergeItem> merges;
  for (const PrefillMergeItem& m : plan.merges) {
    EXPECT_TRUE(merges.emplace(std::make_tuple(m.request, m.kv_head, m.q_row_begin), m).second);
  }
  std::vector<int> partial_seen(plan.num_partials, 0);
  size_t expected_tiles = 0;
  for (int r = 0; r + 1 < static_cast<int>(b.qo_indptr.size()); ++r) {
    const int64_t rows = int64_t(b.qo_indptr[r + 1] - b.qo_indptr[r]) * group;
    for (int64_t row = 0; row < rows; row += s.tile_rows) {
      const auto [lo, hi] = visible_range(b, s, r, row);
      for (int h = 0; h < s.num_kv_heads; ++h) {
        ++expected_tiles;
        auto found = by_tile.find({r, h, static_cast<int>(row)});
        if (found == by_tile.end()) {
          ADD_FAILURE() << "missing tile r=" << r << " h=" << h << " row=" << row;
          continue;
        }
        std::vector<PrefillWorkItem> chunks = found->second;
        std::sort(chunks.begin(), chunks.end(),
                  [](auto& a, auto& c) { return a.kv_begin < c.kv_begin; });
        const int64_t begin = chunks.front().kv_begin;
        const int64_t end = chunks.back().kv_end;
        if (lo >= 0) {
          EXPECT_EQ(begin, lo) << "r=" << r << " row=" << row;
          EXPECT_EQ(end, hi) << "r=" << r << " row=" << row;
        } else {
          EXPECT_EQ(begin, end) << "empty tile must have an empty range";
        }
        auto merge = merges.find({r, h, static_cast<int>(row)});
        if (chunks.size() == 1) {
          EXPECT_EQ(chunks[0].partial, -1);
          EXPECT_EQ(chunks[0].merge, -1);
          EXPECT_EQ(merge, merges.end());
          continue;
        }
        if (merge == merges.end()) {
          ADD_FAILURE() << "split tile without a merge item";
          continue;
        }
        EXPECT_EQ(merge->second.num_partials, static_cast<int>(chunks.size()));
        for (size_t c = 0; c < chunks.size(); ++c) {
          EXPECT_LT(chunks[c].kv_begin, chunks[c].kv_end) << "empty chunk";
          if (c > 0) EXPECT_EQ(chunks[c].kv_begin, chunks[c - 1].kv_end) << "gap or overlap";
          if (c + 1 < chunks.size()) EXPECT_EQ((chunks[c].kv_end - begin) % s.kv_tile, 0);
          EXPECT_GE(chunks[c].partial, merge->second.first_partial);
          EXPECT_LT(chunks[c].partial, merge->second.first_partial + merge->second.num_partials);
          // The chunk names its merge item (the in-kernel merge counts arrivals there).
          if (chunks[c].merge < 0 || chunks[c].merge >= static_cast<int>(plan.merges.size())) {
            ADD_FAILURE() << "chunk names merge " << chunks[c].merge << " of "
                          << plan.merges.size();
            continue;
          }
          const PrefillMergeItem& named = plan.merges[size_t(chunks[c].merge)];
          EXPECT_EQ(named.first_partial, merge->second.first_partial);
          EXPECT_EQ(named.arrived, 0);
          ++partial_seen.at(chunks[c].partial);
        }
      }
    }
  }
  EXPECT_EQ(by_tile.size(), expected_tiles);
  for (int seen : partial_seen) EXPECT_EQ(seen, 1);
  return plan;
}

int64_t cost_of(const PrefillWorkItem& it, int kv_tile) {
  return (int64_t(it.kv_end - it.kv_begin) + kv_tile - 1) / kv_tile;
}

TEST(PrefillTiles, CausalCoversEveryRowAndOrdersHeaviestFirst) {
  Batch b;
  b.add(16384, 16384);
  const PrefillTileShape s = make_shape(MaskMode::kCausal);
  const PrefillTilePlan plan = plan_and_check(b, s);
  ASSERT_EQ(plan.items.size(), 4096u);  // the worked example in prefill_tiles.h
  EXPECT_TRUE(plan.merges.empty());
  for (size_t i = 1; i < plan.items.size(); ++i) {
    EXPECT_GE(cost_of(plan.items[i - 1], s.kv_tile), cost_of(plan.items[i], s.kv_tile));
  }
  EXPECT_EQ(plan.items.front().kv_end, 16384);
  EXPECT_EQ(plan.items.back().kv_end, 32);  // tokens [0, 32) see keys [0, 32)
}

TEST(PrefillTiles, RandomBatchesAllMasks) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    Batch b;
    const int batch = 1 + int(rng() % 5);
    for (int r = 0; r < batch; ++r) {
      const int q_len = int(rng() % 90);
      const int prefix = (rng() % 3 == 0) ? 0 : int(rng() % 300);
      b.add(q_len, q_len + prefix);
    }
    const MaskMode modes[] = {MaskMode::kNone, MaskMode::kCausal, MaskMode::kCustom};
    const MaskMode mode = modes[trial % 3];
    const int window = (trial % 4 == 0) ? int(rng() % 70) : -1;
    PrefillTileShape s = make_shape(mode, window, (trial % 2) ? 0 : 1 + int(rng() % 300));
    s.num_q_heads = 1 + int(rng() % 3) * 3;  // 1, 4 or 7 q heads
    s.num_kv_heads = 1;
    s.tile_rows = (trial % 2) ? 64 : 128;
    s.kv_tile = (trial % 3) ? 64 : 32;
    s.min_split_keys = 64;
    plan_and_check(b, s);
  }
}

// The launch order is the longest-first order with ties in build order (request, row tile,
// kv head, chunk), i.e. what a stable sort of the build order by (cost, keys) descending gives
// (the planner sorts runs of equal keys as integers instead: the same order).
TEST(PrefillTiles, OrderIsTheStableLongestFirstOrder) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 30; ++trial) {
    Batch b;
    const int batch = 1 + int(rng() % 300);
    const bool decode = trial % 2 == 0;
    for (int r = 0; r < batch; ++r) {
      const int q_len = decode ? 1 : 1 + int(rng() % 40);
      b.add(q_len, q_len + int(rng() % 5000));
    }
    PrefillTileShape s =
        make_shape(decode ? MaskMode::kNone : MaskMode::kCausal, -1, trial % 3 == 0 ? 0 : 132 * 2);
    s.tile_rows = decode ? 16 : 64;
    s.min_split_keys = 256;
    const PrefillTilePlan plan = plan_and_check(b, s);
    std::vector<PrefillWorkItem> expected = plan.items;
    auto build_key = [](const PrefillWorkItem& it) {
      return std::make_tuple(it.request, it.q_row_begin, it.kv_head, it.kv_begin);
    };
    std::sort(expected.begin(), expected.end(),
              [&](const PrefillWorkItem& x, const PrefillWorkItem& y) {
                return build_key(x) < build_key(y);
              });
    auto cost = [&](const PrefillWorkItem& it) { return (cost_of(it, s.kv_tile) + 1) * s.kv_tile; };
    std::stable_sort(expected.begin(), expected.end(),
                     [&](const PrefillWorkItem& x, const PrefillWorkItem& y) {
                       if (cost(x) != cost(y)) return cost(x) > cost(y);
                       return x.kv_end - x.kv_begin > y.kv_end - y.kv_begin;
                     });
    ASSERT_EQ(expected.size(), plan.items.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_EQ(build_key(expected[i]), build_key(plan.items[i]))
          << "trial " << trial << ", item " << i;
    }
  }
}

// A cluster-split plan: each tile's `cluster` chunks consecutive and in key order, the tiles
// by cost descending with ties in build order (request, row tile, kv head).
TEST(PrefillTiles, ClusterOrderIsTheStableLongestFirstOrder) {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 20; ++trial) {
    Batch b;
    const int batch = 1 + int(rng() % 6);
    for (int r = 0; r < batch; ++r) {
      const int q_len = 1 + int(rng() % 12);
      b.add(q_len, q_len + int(rng() % 3000));
    }
    PrefillTileShape s = make_shape(trial % 2 ? MaskMode::kCausal : MaskMode::kCustom);
    s.tile_rows = 16;
    s.cluster = 2 << (trial % 4);
    const PrefillTilePlan plan = plan_prefill_tiles(b.qo_indptr, b.kv_indptr, s);
    ASSERT_EQ(plan.items.size() % size_t(s.cluster), 0u);
    struct Tile {
      std::tuple<int, int, int> key;  // request, row tile, kv head
      int64_t cost;
    };
    std::vector<Tile> tiles;
    for (size_t i = 0; i < plan.items.size(); i += size_t(s.cluster)) {
      const PrefillWorkItem& first = plan.items[i];
      int64_t keys = 0;
      for (int c = 0; c < s.cluster; ++c) {
        const PrefillWorkItem& it = plan.items[i + size_t(c)];
        ASSERT_EQ(std::make_tuple(it.request, it.q_row_begin, it.kv_head),
                  std::make_tuple(first.request, first.q_row_begin, first.kv_head));
        if (c > 0) ASSERT_EQ(it.kv_begin, plan.items[i + size_t(c) - 1].kv_end);
        keys += it.kv_end - it.kv_begin;
      }
      tiles.push_back({{first.request, first.q_row_begin, first.kv_head},
                       ((keys + s.kv_tile - 1) / s.kv_tile + 1) * s.kv_tile});
    }
    for (size_t i = 1; i < tiles.size(); ++i) {
      const bool ordered = tiles[i - 1].cost > tiles[i].cost ||
                           (tiles[i - 1].cost == tiles[i].cost && tiles[i - 1].key < tiles[i].key);
      ASSERT_TRUE(ordered) << "trial " << trial << ", tile " << i;
    }
  }
}

// A plan made into a reused PrefillTilePlan (as out_graph does every step) equals a fresh one,
// whatever the reused plan held before: a split plan with merges, a cluster plan, a padded one.
TEST(PrefillTiles, PlanIntoAReusedPlanEqualsAFreshPlan) {
  auto same = [](const PrefillTilePlan& a, const PrefillTilePlan& b) {
    if (a.items.size() != b.items.size() || a.merges.size() != b.merges.size() ||
        a.num_partials != b.num_partials || a.tile_rows != b.tile_rows ||
        a.group_size != b.group_size || a.cluster != b.cluster) {
      return false;
    }
    for (size_t i = 0; i < a.items.size(); ++i) {
      if (std::memcmp(&a.items[i], &b.items[i], sizeof(PrefillWorkItem)) != 0) return false;
    }
    for (size_t i = 0; i < a.merges.size(); ++i) {
      if (std::memcmp(&a.merges[i], &b.merges[i], sizeof(PrefillMergeItem)) != 0) return false;
    }
    return true;
  };
  Batch split;  // decode-like: one long request splits (merges, partials)
  split.add(1, 60000);
  split.add(1, 100);
  Batch plain;
  for (int r = 0; r < 5; ++r) plain.add(1 + 30 * r, 200 + 500 * r);
  PrefillTileShape split_shape = make_shape(MaskMode::kCausal, -1, 264);
  PrefillTileShape cluster_shape = make_shape(MaskMode::kNone, -1, 264);
  cluster_shape.tile_rows = 16;
  cluster_shape.cluster = 8;
  PrefillTilePlan reused;
  plan_prefill_tiles(split.qo_indptr, split.kv_indptr, split_shape, reused);
  ASSERT_FALSE(reused.merges.empty()) << "the first plan must split";
  ASSERT_TRUE(same(reused, plan_prefill_tiles(split.qo_indptr, split.kv_indptr, split_shape)));
  for (const PrefillTileShape& shape :
       {make_shape(MaskMode::kCausal), cluster_shape, split_shape}) {
    plan_prefill_tiles(plain.qo_indptr, plain.kv_indptr, shape, reused);
    EXPECT_TRUE(same(reused, plan_prefill_tiles(plain.qo_indptr, plain.kv_indptr, shape)));
    pad_prefill_plan(reused, prefill_plan_capacity(5, 121, shape));  // the next plan reuses this
  }
  plan_prefill_tiles(split.qo_indptr, split.kv_indptr, split_shape, reused);
  EXPECT_TRUE(same(reused, plan_prefill_tiles(split.qo_indptr, split.kv_indptr, split_shape)));
}

TEST(PrefillTiles, DecodeLikeBatchSplitsKv) {
  Batch b;
  b.add(1, 32768);
  b.add(1, 1000);
  PrefillTileShape s = make_shape(MaskMode::kCausal, -1, 132 * 2);
  const PrefillTilePlan plan = plan_and_check(b, s);
  EXPECT_FALSE(plan.merges.empty());
  EXPECT_GT(plan.num_partials, 8);
  // The long request's chunks come before the short request's tiles.
  EXPECT_EQ(plan.items.front().request, 0);
  EXPECT_EQ(plan.items.back().request, 1);

  s.concurrent_ctas = 0;  // split disabled
  const PrefillTilePlan whole = plan_and_check(b, s);
  EXPECT_TRUE(whole.merges.empty());
  EXPECT_EQ(whole.num_partials, 0);
  EXPECT_EQ(whole.items.size(), 16u);
}

TEST(PrefillTiles, EmptyRequestsAndEmptyKv) {
  Batch b;
  b.add(0, 5);  // no queries: no tiles
  b.add(3, 0);  // no keys: one tile per head with an empty range (writes zeros, LSE -inf)
  b.add(2, 1);  // causal, q_len > kv_len: the first query sees nothing
  const PrefillTilePlan plan = plan_and_check(b, make_shape(MaskMode::kCausal, -1, 264));
  EXPECT_EQ(plan.items.size(), 16u);
  for (const PrefillWorkItem& it : plan.items) {
    EXPECT_NE(it.request, 0);
    if (it.request == 1) EXPECT_EQ(it.kv_begin, it.kv_end);
    if (it.request == 2) {
      EXPECT_EQ(it.kv_begin, 0);
      EXPECT_EQ(it.kv_end, 1);
    }
  }
}

TEST(PrefillTiles, RejectsBadShapes) {
  Batch b;
  b.add(4, 4);
  PrefillTileShape s = make_shape(MaskMode::kCausal);
  s.num_q_heads = 30;  // not a multiple of 8
  EXPECT_THROW(plan_prefill_tiles(b.qo_indptr, b.kv_indptr, s), Error);
  s = make_shape(MaskMode::kCausal);
  s.tile_rows = 0;
  EXPECT_THROW(plan_prefill_tiles(b.qo_indptr, b.kv_indptr, s), Error);
  std::vector<int32_t> qo = {0, 5, 3};  // negative q_len
  std::vector<int64_t> kv = {0, 5, 10};
  try {
    plan_prefill_tiles(qo, kv, make_shape(MaskMode::kCausal));
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(e.argument(), "qo_indptr[2]");
  }
  std::vector<int64_t> short_kv = {0, 5};
  EXPECT_THROW(plan_prefill_tiles(qo, short_kv, make_shape(MaskMode::kCausal)), Error);
}

// The L2 order (PrefillTileShape::l2_keys): the same items as the plain order, a request's
// kv heads in power-of-two groups within the key budget, each group's items contiguous (its tiles
// heaviest first, a tile's heads consecutive), the groups heaviest first.
TEST(PrefillTiles, L2GroupOrder) {
  Batch b;
  b.add(300, 300);     // 75 keys x 8 heads fit: one group of 8
  b.add(1000, 5000);   // 5000 x 2 <= 10000: groups of 2 heads
  b.add(40, 40);       // one tile
  b.add(0, 700);       // no rows: no items
  b.add(2000, 12000);  // over the budget alone: groups of 1
  PrefillTileShape s = make_shape(MaskMode::kCausal);
  const PrefillTilePlan plain = plan_and_check(b, s);
  s.l2_keys = 30000;  // groups within 10000 keys x heads
  // The batch's K/V fitting the L2: the plain order.
  PrefillTileShape roomy = s;
  roomy.l2_keys = (300 + 5000 + 40 + 700 + 12000) * 8;
  const PrefillTilePlan fits = plan_prefill_tiles(b.qo_indptr, b.kv_indptr, roomy);
  ASSERT_EQ(fits.items.size(), plain.items.size());
  for (size_t i = 0; i < fits.items.size(); ++i) {
    EXPECT_TRUE(std::memcmp(&fits.items[i], &plain.items[i], sizeof(PrefillWorkItem)) == 0)
        << "item " << i;
  }
  const PrefillTilePlan grouped = plan_and_check(b, s);  // coverage and ranges, as any plan
  ASSERT_EQ(grouped.items.size(), plain.items.size());
  ASSERT_EQ(grouped.num_partials, 0);

  const int expected_heads[] = {8, 2, 8, 8, 1};
  struct Span {
    size_t first, last;
  };
  std::map<std::pair<int, int>, Span> spans;  // (request, group index) -> item positions
  for (size_t i = 0; i < grouped.items.size(); ++i) {
    const PrefillWorkItem& it = grouped.items[i];
    const int heads = expected_heads[it.request];
    auto [pos, fresh] = spans.try_emplace({it.request, it.kv_head / heads}, Span{i, i});
    if (!fresh) pos->second.last = i;
  }
  size_t covered = 0;
  int64_t previous_heaviest = INT64_MAX;
  std::vector<std::pair<size_t, std::pair<int, int>>> starts;
  for (const auto& [key, span] : spans) starts.push_back({span.first, key});
  std::sort(starts.begin(), starts.end());
  for (const auto& [first, key] : starts) {
    const Span span = spans[key];
    const int heads = expected_heads[key.first];
    const int head0 = key.second * heads;
    // Contiguous: the group's items are exactly its tiles x its heads.
    const int64_t tiles = int64_t(span.last - span.first + 1) / heads;
    EXPECT_EQ(int64_t(span.last - span.first + 1), tiles * heads) << "request " << key.first;
    int64_t previous_keys = INT64_MAX;
    for (size_t i = span.first; i <= span.last; ++i) {
      const PrefillWorkItem& it = grouped.items[i];
      EXPECT_EQ(it.request, key.first) << "item " << i << " inside another group's span";
      EXPECT_EQ(it.kv_head, head0 + int((i - span.first) % heads)) << "item " << i;
      const int64_t keys = it.kv_end - it.kv_begin;
      EXPECT_LE(keys, previous_keys) << "item " << i << ": tiles heaviest first in a group";
      if ((i - span.first) % heads == 0)
        previous_keys = keys;
      else
        EXPECT_EQ(keys, previous_keys) << "item " << i << ": a tile's heads together";
    }
    const PrefillWorkItem& head_item = grouped.items[span.first];
    const int64_t heaviest = head_item.kv_end - head_item.kv_begin;
    EXPECT_LE(heaviest, previous_heaviest) << "groups heaviest first";
    previous_heaviest = heaviest;
    covered += span.last - span.first + 1;
  }
  EXPECT_EQ(covered, grouped.items.size());
  EXPECT_EQ(spans.size(), size_t(1 + 8 / 2 + 1 + 8)) << "groups: 8 heads, 2s, 8 heads, 1s";
}

TEST(PrefillTiles, BufferSizingAndFillingAgree) {
  Batch b;
  b.add(1, 20000);
  b.add(300, 700);
  const PrefillTilePlan plan = plan_and_check(b, make_shape(MaskMode::kCausal, -1, 64));
  ASSERT_GT(plan.num_partials, 0);
  const PrefillBufferLayout sized = write_prefill_buffer(plan, 128, nullptr, 0, nullptr, nullptr);
  EXPECT_GE(sized.total_bytes,
            sized.metadata_bytes + size_t(plan.num_partials) * plan.tile_rows * (128 + 1) * 4);

  std::vector<unsigned char> host(sized.metadata_bytes, 0xab);
  std::vector<unsigned char> fake_device(sized.total_bytes);
  PrefillTiles view;
  const PrefillBufferLayout filled =
      write_prefill_buffer(plan, 128, host.data(), host.size(), fake_device.data(), &view);
  EXPECT_EQ(filled.metadata_bytes, sized.metadata_bytes);
  EXPECT_EQ(filled.total_bytes, sized.total_bytes);
  // "Copy" to the device and read the plan back through the view.
  std::copy(host.begin(), host.end(), fake_device.begin());
  ASSERT_EQ(view.num_items, static_cast<int>(plan.items.size()));
  ASSERT_EQ(view.num_merges, static_cast<int>(plan.merges.size()));
  // The kernels' packed row -> (token, head) divisor is the plan's group.
  ASSERT_GT(plan.group_size, 1);
  EXPECT_EQ(view.group_size, plan.group_size);
  EXPECT_EQ(view.group_div.divisor, plan.group_size);
  for (int row = 0; row < 300 * plan.group_size; ++row) {
    int in_group = -1;
    ASSERT_EQ(view.group_div.divmod(row, in_group), row / plan.group_size);
    ASSERT_EQ(in_group, row % plan.group_size);
  }
  for (int i = 0; i < view.num_items; ++i) {
    EXPECT_EQ(view.items[i].kv_begin, plan.items[i].kv_begin);
    EXPECT_EQ(view.items[i].partial, plan.items[i].partial);
  }
  for (int i = 0; i < view.num_merges; ++i) {
    EXPECT_EQ(view.merges[i].first_partial, plan.merges[i].first_partial);
  }
  auto offset = [&](const void* p) {
    return size_t(static_cast<const unsigned char*>(p) - fake_device.data());
  };
  EXPECT_EQ(offset(view.merges) % 16, 0u);
  // The scheduler counters are metadata (copied as zeros) and overlap no array.
  ASSERT_NE(view.scheduler, nullptr);
  EXPECT_EQ(view.scheduler[0], 0);
  EXPECT_EQ(view.scheduler[1], 0);
  EXPECT_LE(offset(view.scheduler) + 2 * sizeof(int), offset(view.items));
  EXPECT_EQ(offset(view.items) % 16, 0u);
  EXPECT_EQ(offset(view.partial_out) % 256, 0u);
  EXPECT_GE(offset(view.partial_out), filled.metadata_bytes);
  EXPECT_GE(offset(view.partial_lse),
            offset(view.partial_out) + size_t(plan.num_partials) * plan.tile_rows * 128 * 4);
  EXPECT_LE(offset(view.partial_lse) + size_t(plan.num_partials) * plan.tile_rows * 4,
            filled.total_bytes);

  EXPECT_THROW(write_prefill_buffer(plan, 128, host.data(), 16, nullptr, nullptr), Error);
}

// The cluster split (the decode-shaped kernel's): the size from the batch shape alone, every tile
// in exactly `cluster` consecutive chunks that tile its visible keys in kv_tile steps, no merges,
// heaviest tiles first, and the fixed-size (graph) capacity and padding in whole clusters.
TEST(PrefillTiles, ClusterSplitSizeAndPlan) {
  PrefillTileShape s = make_shape(MaskMode::kCustom, -1, /*concurrent=*/264);
  s.tile_rows = 32;
  // Verify at 32 q / 8 kv heads, 8 tree tokens: one tile a kv head and request.
  EXPECT_EQ(cluster_split_size(1, 8, s, 16), 16);
  EXPECT_EQ(cluster_split_size(1, 8, s, 8), 8);
  EXPECT_EQ(cluster_split_size(4, 8, s, 16), 8);
  EXPECT_EQ(cluster_split_size(16, 8, s, 16), 2);
  EXPECT_EQ(cluster_split_size(16, 16, s, 16), 0);  // 256 tiles: no room for two chunks each
  EXPECT_EQ(cluster_split_size(64, 8, s, 16), 0);
  EXPECT_EQ(cluster_split_size(0, 8, s, 16), 0);
  EXPECT_EQ(cluster_split_size(1, 8, s, 1), 0);  // no clusters on the device
  PrefillTileShape no_split = s;
  no_split.concurrent_ctas = 0;  // deterministic mode: never split
  EXPECT_EQ(cluster_split_size(1, 8, no_split, 16), 0);

  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    Batch b;
    const int batch = 1 + int(rng() % 5);
    for (int r = 0; r < batch; ++r) {
      const int q_len = 1 + int(rng() % 8);
      b.add(q_len, q_len + int64_t(rng() % 3000) * (trial % 4 == 0 ? 0 : 1));
    }
    PrefillTileShape c = s;
    c.mask = trial % 2 == 0 ? MaskMode::kCausal : MaskMode::kCustom;
    c.window_left = trial % 3 == 0 ? 700 : -1;
    c.cluster = cluster_split_size(batch, 8, c, 16);
    ASSERT_GE(c.cluster, 2);
    const PrefillTilePlan plan = plan_prefill_tiles(b.qo_indptr, b.kv_indptr, c);
    EXPECT_EQ(plan.cluster, c.cluster);
    EXPECT_TRUE(plan.merges.empty());
    EXPECT_EQ(plan.num_partials, 0);
    ASSERT_EQ(plan.items.size() % size_t(c.cluster), 0u);
    int64_t tiles = 0;
    for (int r = 0; r < batch; ++r) {
      tiles += (int64_t(b.qo_indptr[r + 1] - b.qo_indptr[r]) * 4 + 31) / 32 * c.num_kv_heads;
    }
    ASSERT_EQ(int64_t(plan.items.size()), tiles * c.cluster);
    int64_t previous_steps = INT64_MAX;
    for (size_t first = 0; first < plan.items.size(); first += size_t(c.cluster)) {
      const PrefillWorkItem& lead = plan.items[first];
      const auto [lo, hi] = visible_range(b, c, lead.request, lead.q_row_begin);
      const int64_t keys = plan.items[first + size_t(c.cluster) - 1].kv_end - lead.kv_begin;
      const int64_t steps = (keys + c.kv_tile - 1) / c.kv_tile;
      EXPECT_LE(steps, previous_steps) << "heaviest tiles first";
      previous_steps = steps;
      for (int k = 0; k < c.cluster; ++k) {
        const PrefillWorkItem& it = plan.items[first + size_t(k)];
        EXPECT_EQ(it.request, lead.request);
        EXPECT_EQ(it.kv_head, lead.kv_head);
        EXPECT_EQ(it.q_row_begin, lead.q_row_begin);
        EXPECT_EQ(it.partial, -1);
        EXPECT_EQ(it.merge, -1);
        EXPECT_LE(it.kv_begin, it.kv_end);
        if (k > 0) EXPECT_EQ(it.kv_begin, plan.items[first + size_t(k) - 1].kv_end);
        if (it.kv_end < plan.items[first + size_t(c.cluster) - 1].kv_end) {
          EXPECT_EQ((it.kv_end - lead.kv_begin) % c.kv_tile, 0) << "whole steps";
        }
      }
      if (lo >= 0) {
        EXPECT_EQ(lead.kv_begin, lo);
        EXPECT_EQ(plan.items[first + size_t(c.cluster) - 1].kv_end, hi);
      } else {
        EXPECT_EQ(keys, 0);
      }
    }
    // A graph's plan for this batch shape: padded in whole no-op clusters.
    const PrefillPlanCapacity capacity = prefill_plan_capacity(batch, 8, c);
    EXPECT_EQ(capacity.merges, 0);
    EXPECT_EQ(capacity.partials, 0);
    EXPECT_EQ(capacity.items % c.cluster, 0);
    PrefillTilePlan padded = plan;
    pad_prefill_plan(padded, capacity);
    ASSERT_EQ(int64_t(padded.items.size()), capacity.items);
    for (size_t i = plan.items.size(); i < padded.items.size(); ++i) {
      EXPECT_EQ(padded.items[i].q_row_begin, kNoOpRow);
    }
    // The plain split's capacity (what the backend sizes its buffers with) holds it too.
    PrefillTileShape plain = c;
    plain.cluster = 0;
    EXPECT_LE(capacity.items, prefill_plan_capacity(batch, 8, plain).items);
  }
}

}  // namespace
}  // namespace kvattn::core
