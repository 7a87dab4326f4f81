#include "core/prefill_tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>

#include "core/size_check.h"
#include "core/tile_keys.h"
#include "kvattn/error.h"

namespace kvattn::core {
namespace {

// Offsets inside the plan buffer are aligned like a cudaMalloc'd base, so every array starts on
// a 16-byte vector boundary and the scratch on a fresh cache line.
constexpr size_t kBufferAlignment = 256;

size_t align_up(size_t bytes) {
  return checked_sum(bytes, kBufferAlignment - 1, "prefill plan buffer") / kBufferAlignment *
         kBufferAlignment;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// A tile before splitting: its keys and its kernel steps, ceil(keys / kv_tile). Its cost in key
// rows is (steps + 1) x kv_tile (each step of the kernel costs the same whatever the mask; a
// fixed overhead of one step covers the Q load and the epilogue).
struct RawTile {
  PrefillWorkItem item;
  int64_t steps = 0;
};

/// The items of an unsplit plan in PrefillTileShape::l2_keys order (heads in groups of at most
/// l2_keys / 3 keys x heads). `raw` is in build order (request, row tile).
void emit_l2_groups(const std::vector<RawTile>& raw, std::span<const int64_t> kv_indptr,
                    const PrefillTileShape& shape, std::vector<PrefillWorkItem>& items) {
  struct Group {
    int64_t heaviest;     // keys of the group's heaviest tile
    uint32_t begin, end;  // the request's tiles in `order`
    int head_begin, head_end;
  };
  std::vector<uint32_t> order(raw.size());
  std::vector<Group> groups;
  auto keys = [&](uint32_t i) { return raw[i].item.kv_end - raw[i].item.kv_begin; };
  const int batch_size = static_cast<int>(kv_indptr.size()) - 1;
  uint32_t at = 0;
  for (int r = 0; r < batch_size; ++r) {
    const uint32_t begin = at;
    while (at < raw.size() && raw[at].item.request == r) {
      order[at] = at;
      ++at;
    }
    if (at == begin) continue;
    std::stable_sort(order.begin() + begin, order.begin() + at,
                     [&](uint32_t a, uint32_t b) { return keys(a) > keys(b); });
    const int heads = l2_group_heads(shape, kv_indptr[r + 1] - kv_indptr[r]);
    for (int h = 0; h < shape.num_kv_heads; h += heads) {
      groups.push_back({keys(order[begin]), begin, at, h, std::min(h + heads, shape.num_kv_heads)});
    }
  }
  std::stable_sort(groups.begin(), groups.end(),
                   [](const Group& a, const Group& b) { return a.heaviest > b.heaviest; });
  items.reserve(raw.size() * size_t(shape.num_kv_heads));
  for (const Group& g : groups) {
    for (uint32_t i = g.begin; i < g.end; ++i) {
      PrefillWorkItem item = raw[order[i]].item;
      for (int h = g.head_begin; h < g.head_end; ++h) {
        item.kv_head = h;
        items.push_back(item);
      }
    }
  }
}

}  // namespace

PrefillTilePlan plan_prefill_tiles(std::span<const int32_t> qo_indptr,
                                   std::span<const int64_t> kv_indptr,
                                   const PrefillTileShape& shape) {
  PrefillTilePlan plan;
  plan_prefill_tiles(qo_indptr, kv_indptr, shape, plan);
  return plan;
}

void plan_prefill_tiles(std::span<const int32_t> qo_indptr, std::span<const int64_t> kv_indptr,
                        const PrefillTileShape& shape, PrefillTilePlan& plan) {
  check_arg(!qo_indptr.empty(), "qo_indptr", "empty, expected batch_size + 1 entries");
  check_arg(kv_indptr.size() == qo_indptr.size(), "kv_indptr", "has ", kv_indptr.size(),
            " entries, expected ", qo_indptr.size(), " (as qo_indptr)");
  check_arg(shape.num_kv_heads > 0, "num_kv_heads", "got ", shape.num_kv_heads, ", expected > 0");
  check_arg(shape.num_q_heads > 0 && shape.num_q_heads % shape.num_kv_heads == 0, "num_q_heads",
            "got ", shape.num_q_heads, ", expected a positive multiple of num_kv_heads ",
            shape.num_kv_heads);
  check_arg(shape.tile_rows > 0, "tile_rows", "got ", shape.tile_rows, ", expected > 0");
  check_arg(shape.kv_tile > 0, "kv_tile", "got ", shape.kv_tile, ", expected > 0");
  check_arg(shape.window_left >= -1, "window_left", "got ", shape.window_left,
            ", expected -1 (none) or >= 0");
  // Far above any device (see planner.cpp's bounds); a wild value must not drive the split.
  check_arg(shape.concurrent_ctas >= 0 && shape.concurrent_ctas <= (1 << 20), "concurrent_ctas",
            "got ", shape.concurrent_ctas, ", expected 0..", 1 << 20);
  check_arg(shape.min_split_keys >= 1, "min_split_keys", "got ", shape.min_split_keys,
            ", expected >= 1");

  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int batch_size = static_cast<int>(qo_indptr.size()) - 1;
  plan.items.clear();  // (the vectors keep their storage: no allocation once it suffices)
  plan.merges.clear();
  plan.num_partials = 0;
  plan.cluster = 0;
  plan.tile_rows = shape.tile_rows;
  plan.group_size = group;

  // A row tile of a request, for every kv head (item.kv_head 0: the heads are expanded where
  // items are emitted, in head order).
  std::vector<RawTile> raw;
  int64_t total_cost = 0;
  int64_t batch_keys = 0;  // keys of the batch (times num_kv_heads: its K/V in keys x heads)
  for (int r = 0; r < batch_size; ++r) {
    const int64_t q_len = int64_t(qo_indptr[r + 1]) - qo_indptr[r];
    const int64_t kv_len = kv_indptr[r + 1] - kv_indptr[r];
    // (Messages built only on failure: this loop runs for every request of every step.)
    if (q_len < 0) {
      throw_error(ErrorKind::kInvalidArgument, "qo_indptr[" + std::to_string(r + 1) + "]", "q_len ",
                  q_len, " is negative");
    }
    if (kv_len < 0 || kv_len > INT32_MAX) {
      throw_error(ErrorKind::kInvalidArgument, "kv_indptr[" + std::to_string(r + 1) + "]",
                  "kv_len ", kv_len, " out of [0, 2^31)");
    }
    batch_keys += kv_len;
    const int64_t rows = q_len * group;
    check_arg(rows <= INT32_MAX, "qo_indptr", "request ", r, " has ", rows,
              " packed rows, over 2^31");
    for (int64_t row = 0; row < rows; row += shape.tile_rows) {
      const TileKeys keys = row_tile_keys(shape, group, kv_len, q_len, row);
      const int64_t steps = tile_steps(keys, shape.kv_tile);
      RawTile t;
      t.item.request = r;
      t.item.kv_base =
          kv_indptr[r] >= 0 && kv_indptr[r] <= INT32_MAX ? static_cast<int32_t>(kv_indptr[r]) : -1;
      t.item.q_begin = qo_indptr[r];  // >= 0: the layout's indptr starts at 0 and q_len >= 0
      t.item.q_end = qo_indptr[r + 1];
      t.item.kv_len = static_cast<int32_t>(kv_len);  // < 2^31: checked above
      t.item.q_row_begin = static_cast<int32_t>(row);
      t.item.kv_begin = static_cast<int32_t>(keys.begin);
      t.item.kv_end = static_cast<int32_t>(keys.end);
      t.steps = steps;
      raw.push_back(t);
      total_cost += tile_cost(steps, shape);
    }
  }

  if (shape.cluster > 1) {
    // Cluster split: every tile in exactly `cluster` chunks, its chunks consecutive (one cluster),
    // the tiles heaviest first.
    check_arg(shape.cluster <= 64, "cluster", "got ", shape.cluster, ", expected <= 64");
    plan.cluster = shape.cluster;
    std::stable_sort(raw.begin(), raw.end(),
                     [](const RawTile& a, const RawTile& b) { return a.steps > b.steps; });
    plan.items.reserve(raw.size() * size_t(shape.num_kv_heads) * size_t(shape.cluster));
    for (const RawTile& t : raw) {
      const int64_t steps = t.steps;
      for (int h = 0; h < shape.num_kv_heads; ++h) {
        for (int c = 0; c < shape.cluster; ++c) {
          PrefillWorkItem chunk = t.item;
          chunk.kv_head = h;
          const TileKeys k =
              chunk_keys({t.item.kv_begin, t.item.kv_end}, steps, c, shape.cluster, shape.kv_tile);
          chunk.kv_begin = static_cast<int32_t>(k.begin);
          chunk.kv_end = static_cast<int32_t>(k.end);
          plan.items.push_back(chunk);
        }
      }
    }
    return;
  }

  // Split-KV: a tile much heavier than an even share of the device would finish long after the
  // rest (decode-like batches: few tiles, long KV). Chunks are whole kernel steps, at least
  // min_split_keys long.
  const int64_t split_keys = split_chunk_keys(shape, total_cost, int64_t(raw.size()));

  // The work in build order (request, row tile, kv head, chunk), then launched longest first:
  // the hardware hands out CTAs in grid order, so this is a greedy LPT schedule (causal: the
  // tiles at the end of the sequence start first). An item's cost, (ceil(keys / kv_tile) + 1) x
  // kv_tile, grows with its keys, so "cost, then keys, descending; ties in build order" is keys
  // descending, then the build index, sorted as 64-bit integers (a decode step at batch 256
  // orders 2048 tiles on the host every step).
  // Runs of consecutive equal keys keep their build order, so the runs are what is sorted.
  struct Run {
    uint32_t begin;
    uint32_t size;
  };
  auto sorted_runs = [](const auto& entries, auto keys_of) {
    check_arg(entries.size() <= size_t{UINT32_MAX}, "prefill plan", entries.size(),
              " tiles, over 2^32");
    std::vector<Run> runs;
    std::vector<uint64_t> order;
    for (size_t i = 0; i < entries.size();) {
      const int32_t keys = keys_of(entries[i]);  // 0 .. 2^31 - 1
      size_t j = i + 1;
      while (j < entries.size() && keys_of(entries[j]) == keys) ++j;
      order.push_back((uint64_t{uint32_t(INT32_MAX - keys)} << 32) | uint64_t(runs.size()));
      runs.push_back({uint32_t(i), uint32_t(j - i)});
      i = j;
    }
    std::sort(order.begin(), order.end());
    std::vector<Run> sorted;
    sorted.reserve(order.size());
    for (const uint64_t key : order) sorted.push_back(runs[key & 0xFFFFFFFFu]);
    return sorted;
  };
  auto tile_keys = [](const RawTile& t) { return t.item.kv_end - t.item.kv_begin; };
  const bool splits = std::any_of(raw.begin(), raw.end(), [&](const RawTile& t) {
    return split_chunks(tile_keys(t), split_keys) > 1;
  });
  if (!splits && shape.l2_keys > 0 && batch_keys * shape.num_kv_heads > shape.l2_keys) {
    emit_l2_groups(raw, kv_indptr, shape, plan.items);
    return;
  }
  if (!splits) {
    // No tile splits (decode at a large batch): the row tiles are sorted, the kv heads expanded
    // as they are emitted (a tile's heads are consecutive in build order and share its keys).
    plan.items.reserve(raw.size() * size_t(shape.num_kv_heads));
    for (const Run run : sorted_runs(raw, tile_keys)) {
      for (uint32_t i = run.begin; i < run.begin + run.size; ++i) {
        PrefillWorkItem item = raw[i].item;
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          item.kv_head = h;
          plan.items.push_back(item);
        }
      }
    }
    return;
  }
  std::vector<PrefillWorkItem> built;
  built.reserve(raw.size() * size_t(shape.num_kv_heads));
  for (const RawTile& t : raw) {
    const int64_t keys = tile_keys(t);
    const int64_t chunks = split_chunks(keys, split_keys);
    const int64_t steps = t.steps;
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      PrefillWorkItem item = t.item;
      item.kv_head = h;
      if (chunks <= 1) {
        built.push_back(item);
        continue;
      }
      PrefillMergeItem merge;
      merge.request = item.request;
      merge.kv_head = h;
      merge.q_row_begin = item.q_row_begin;
      merge.first_partial = plan.num_partials;
      merge.num_partials = static_cast<int32_t>(chunks);
      plan.merges.push_back(merge);
      // Even chunks in whole steps, so no chunk is a sliver.
      for (int64_t c = 0; c < chunks; ++c) {
        PrefillWorkItem chunk = item;
        const TileKeys k =
            chunk_keys({item.kv_begin, item.kv_end}, steps, c, chunks, shape.kv_tile);
        chunk.kv_begin = static_cast<int32_t>(k.begin);
        chunk.kv_end = static_cast<int32_t>(k.end);
        chunk.partial = plan.num_partials++;
        chunk.merge = static_cast<int32_t>(plan.merges.size() - 1);
        built.push_back(chunk);
      }
    }
  }
  plan.items.reserve(built.size());
  for (const Run run :
       sorted_runs(built, [](const PrefillWorkItem& it) { return it.kv_end - it.kv_begin; })) {
    plan.items.insert(plan.items.end(), built.begin() + run.begin,
                      built.begin() + run.begin + run.size);
  }
}

int cluster_split_size(int batch_size, int q_len, const PrefillTileShape& shape, int max_cluster) {
  check_arg(batch_size >= 0 && q_len >= 0, "batch_size", "got batch_size ", batch_size,
            " and q_len ", q_len, ", expected >= 0");
  check_arg(shape.num_kv_heads > 0 && shape.num_q_heads > 0 &&
                shape.num_q_heads % shape.num_kv_heads == 0 && shape.tile_rows > 0,
            "num_q_heads", "got ", shape.num_q_heads, " q heads over ", shape.num_kv_heads,
            " kv heads, tile_rows ", shape.tile_rows);
  const int64_t rows = int64_t(q_len) * (shape.num_q_heads / shape.num_kv_heads);
  const int64_t tiles = int64_t(batch_size) * shape.num_kv_heads * ceil_div(rows, shape.tile_rows);
  if (tiles == 0 || shape.concurrent_ctas <= 0 || max_cluster < 2) return 0;
  int cluster = 1;
  while (cluster * 2 <= max_cluster && tiles * cluster * 2 <= shape.concurrent_ctas) cluster *= 2;
  return cluster >= 2 ? cluster : 0;
}

namespace {

// Every offset of a plan buffer, from the counts alone, overflow-checked.
struct PrefillBufferOffsets {
  size_t scheduler = 0;  // PrefillTiles::scheduler: 16 bytes of counters
  size_t items = 16;
  size_t merges = 0;
  size_t metadata_bytes = 0;
  size_t partial_out = 0;
  size_t partial_lse = 0;
  size_t total_bytes = 0;
};

PrefillBufferOffsets prefill_buffer_offsets(int64_t items, int64_t merges, int64_t partials,
                                            int tile_rows, int v_head_dim) {
  check_arg(v_head_dim > 0, "v_head_dim", "got ", v_head_dim, ", expected > 0");
  check_arg(items >= 0 && merges >= 0 && partials >= 0 && tile_rows >= 0, "prefill plan",
            "negative counts: ", items, " items, ", merges, " merges, ", partials,
            " partials, tile_rows ", tile_rows);
  const std::string what = "prefill plan buffer";
  PrefillBufferOffsets o;
  const size_t items_bytes = checked_bytes({items, int64_t(sizeof(PrefillWorkItem))}, what);
  o.merges = align_up(checked_sum(o.items, items_bytes, what));
  const size_t merges_bytes = checked_bytes({merges, int64_t(sizeof(PrefillMergeItem))}, what);
  o.metadata_bytes = align_up(checked_sum(o.merges, merges_bytes, what));
  const size_t rows = checked_bytes({partials, tile_rows}, what);
  o.partial_out = o.metadata_bytes;
  const size_t out_bytes = checked_bytes({int64_t(rows), v_head_dim, int64_t(sizeof(float))}, what);
  o.partial_lse = align_up(checked_sum(o.partial_out, out_bytes, what));
  const size_t lse_bytes = checked_bytes({int64_t(rows), int64_t(sizeof(float))}, what);
  o.total_bytes = align_up(checked_sum(o.partial_lse, lse_bytes, what));
  return o;
}

}  // namespace

PrefillBufferLayout prefill_buffer_layout(int64_t items, int64_t merges, int64_t partials,
                                          int tile_rows, int v_head_dim) {
  const PrefillBufferOffsets o =
      prefill_buffer_offsets(items, merges, partials, tile_rows, v_head_dim);
  PrefillBufferLayout layout;
  layout.metadata_bytes = o.metadata_bytes;
  layout.total_bytes = o.total_bytes;
  return layout;
}

PrefillBufferLayout write_prefill_buffer(const PrefillTilePlan& plan, int v_head_dim,
                                         void* host_metadata, size_t host_capacity,
                                         void* device_base, PrefillTiles* view) {
  const PrefillBufferOffsets o =
      prefill_buffer_offsets(int64_t(plan.items.size()), int64_t(plan.merges.size()),
                             plan.num_partials, plan.tile_rows, v_head_dim);
  const size_t items_offset = o.items;
  const size_t items_bytes = plan.items.size() * sizeof(PrefillWorkItem);
  const size_t merges_offset = o.merges;
  const size_t merges_bytes = plan.merges.size() * sizeof(PrefillMergeItem);
  const size_t metadata_bytes = o.metadata_bytes;
  const size_t partial_out_offset = o.partial_out;
  const size_t partial_lse_offset = o.partial_lse;
  const size_t total_bytes = o.total_bytes;

  PrefillBufferLayout layout;
  layout.metadata_bytes = metadata_bytes;
  layout.total_bytes = total_bytes;

  if (host_metadata != nullptr) {
    check_arg(host_capacity >= metadata_bytes, "host_capacity", "got ", host_capacity,
              " bytes, the plan's metadata needs ", metadata_bytes);
    // The arrays, and zeros around them (the scheduler counters, the alignment gaps): each byte
    // written once (a whole-region memset first was ~110 KB more a step at batch 256).
    auto* bytes = static_cast<unsigned char*>(host_metadata);
    std::memset(bytes, 0, items_offset);
    if (items_bytes > 0) std::memcpy(bytes + items_offset, plan.items.data(), items_bytes);
    std::memset(bytes + items_offset + items_bytes, 0, merges_offset - items_offset - items_bytes);
    if (merges_bytes > 0) std::memcpy(bytes + merges_offset, plan.merges.data(), merges_bytes);
    std::memset(bytes + merges_offset + merges_bytes, 0,
                metadata_bytes - merges_offset - merges_bytes);
  }
  if (device_base != nullptr && view != nullptr) {
    auto* base = static_cast<unsigned char*>(device_base);
    PrefillTiles t;
    t.items = reinterpret_cast<const PrefillWorkItem*>(base + items_offset);
    t.num_items = static_cast<int>(plan.items.size());
    t.merges = reinterpret_cast<const PrefillMergeItem*>(base + merges_offset);
    t.num_merges = static_cast<int>(plan.merges.size());
    t.partial_out =
        plan.num_partials > 0 ? reinterpret_cast<float*>(base + partial_out_offset) : nullptr;
    t.partial_lse =
        plan.num_partials > 0 ? reinterpret_cast<float*>(base + partial_lse_offset) : nullptr;
    t.num_partials = plan.num_partials;
    t.tile_rows = plan.tile_rows;
    t.group_size = plan.group_size;
    t.group_div = FastDivmod(plan.group_size > 0 ? plan.group_size : 1);
    t.cluster = plan.cluster;
    t.scheduler = reinterpret_cast<int*>(base + o.scheduler);
    *view = t;
  }
  return layout;
}

}  // namespace kvattn::core
