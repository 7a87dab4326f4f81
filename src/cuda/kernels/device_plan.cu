// DECODE plans on the device (device_plan.h). One CTA of kThreads: every step is a block-wide
// loop, reduction or scan over the requests, then a bitonic sort of the items' keys in shared
// memory. The arithmetic is the host planners' (core::plan_decode_rule, core::plan_prefill_tiles:
// the same int64 sums, the same comparisons, the same unique keys), so the plans are equal item
// for item.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/tile_keys.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/device_plan.h"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr double kRequiredGain = 0.97;  // core::plan_decode_rule's bar (planner.cpp)

__device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Sum / max of one value a thread over the block (every thread gets the result).
__device__ int64_t block_sum(int64_t v, int64_t* scratch) {
  for (int o = 16; o >= 1; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  return total;
}

__device__ int64_t block_max(int64_t v, int64_t* scratch) {
  for (int o = 16; o >= 1; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  int64_t top = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) top = max(top, scratch[w]);
  return top;
}

// Exclusive prefix sums of values[0, n) into out[0, n] (out[n] = the total), n <= kThreads *
// per-thread segments: each thread scans its contiguous segment, the segment totals are scanned
// by a Hillis-Steele pass in shared memory.
template <typename T>
__device__ void block_exclusive_scan(const T* values, T* out, int n, T* partials) {
  __syncthreads();  // values were written with another thread-to-element map
  const int per = (n + kThreads - 1) / kThreads;
  const int begin = min(n, int(threadIdx.x) * per);
  const int end = min(n, begin + per);
  T local = 0;
  for (int i = begin; i < end; ++i) local += values[i];
  __syncthreads();
  partials[threadIdx.x] = local;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset *= 2) {
    const T add = threadIdx.x >= unsigned(offset) ? partials[threadIdx.x - offset] : T(0);
    __syncthreads();
    partials[threadIdx.x] += add;
    __syncthreads();
  }
  T running = partials[threadIdx.x] - local;  // exclusive: the segments before this one
  for (int i = begin; i < end; ++i) {
    const T v = values[i];
    out[i] = running;
    running += v;
  }
  if (threadIdx.x == kThreads - 1) out[n] = partials[kThreads - 1];
  __syncthreads();
}

// The host's heaviest_first_key (planner.cpp): ascending order = heaviest first, then index.
__device__ __forceinline__ uint64_t heaviest_first_key(int64_t weight, uint32_t index) {
  return (uint64_t(INT32_MAX - weight) << 32) | uint64_t(index);
}

// The request of emission index i: the last r in [0, batch_size) with starts[r] <= i (starts
// non-decreasing from starts[0] = 0 <= i: a request with no items shares its start with the
// next, and the last of them is the one that has items).
__device__ __forceinline__ int request_of_item(const int32_t* starts, int batch_size, int i) {
  int lo = 0, hi = batch_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Ascending bitonic sort of keys[0, padded), padded a power of two (unique keys: the order is
// the stable one of the host's sorts).
__device__ void bitonic_sort(uint64_t* keys, int padded) {
  __syncthreads();
  for (int size = 2; size <= padded; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < padded; i += kThreads) {
        const int partner = i ^ stride;
        if (partner > i) {
          const bool ascending = (i & size) == 0;
          const uint64_t a = keys[i];
          const uint64_t b = keys[partner];
          if ((a > b) == ascending) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
}

__device__ __forceinline__ int64_t read_length(const void* p, bool int64, int r) {
  return int64 ? static_cast<const int64_t*>(p)[r] : int64_t(static_cast<const int32_t*>(p)[r]);
}

// Request r's KV range (make_paged_layout's layout) written to the call's metadata, its length
// returned; *q_len: its query tokens (EXTEND-like: seq_len - prefix_len, before the clamp to
// num_tokens).
__device__ int32_t step_kv_len(const DeviceLengths& l, int r, int32_t* q_len) {
  const int64_t room = int64_t(l.max_context_len) - l.tree_tokens;
  int64_t encoder = 0;
  if (l.encoder_lens != nullptr) {
    encoder = min(max(read_length(l.encoder_lens, l.encoder_lens_int64, r), int64_t(0)), room);
  }
  int64_t seq =
      read_length(l.seq_lens, l.seq_lens_int64, l.per_request > 1 ? r / l.per_request : r);
  seq = min(max(seq, int64_t(0)), room - encoder);
  int64_t q = l.q_len;
  if (l.prefix_lens != nullptr) {
    const int64_t prefix = read_length(l.prefix_lens, l.prefix_lens_int64, r);
    q = seq - min(max(prefix, int64_t(0)), seq);
  }
  *q_len = int32_t(q);
  if (l.encoder_keys) {  // the request's encoder tokens, every query row sees them all
    l.kv_start[r] = 0;
    l.kv_len[r] = int32_t(encoder);
    return int32_t(encoder);
  }
  int64_t len = seq + l.tree_tokens;
  if (l.window >= 0) len = min(seq, int64_t(l.window) + q);
  l.kv_start[r] = int32_t(encoder + seq + l.tree_tokens - len);
  l.kv_len[r] = int32_t(len);
  return int32_t(len);
}

// The tree mask's rows (custom-mask calls): mask_indptr from the lengths; a mask too short for
// them zeroes every length, so that no later kernel of the step reads past it (the step check
// refuses the step). lens / lens64 are the block's copies; returns whether they were zeroed.
__device__ bool mask_rows(const DeviceLengths& l, int bs, int32_t* lens, int64_t* lens64,
                          int64_t* partials64) {
  if (l.mask_indptr == nullptr) return false;
  // q_len x kv_len a request, scanned through lens64 (restored after).
  for (int r = threadIdx.x; r < bs; r += kThreads) lens64[r] = int64_t(l.q_len) * lens[r];
  block_exclusive_scan<int64_t>(lens64, l.mask_indptr, bs, partials64);
  const bool too_short = l.mask_indptr[bs] > *l.mask_elems;
  for (int r = threadIdx.x; r < bs; r += kThreads) {
    if (too_short) {
      lens[r] = 0;
      l.kv_len[r] = 0;
    }
    lens64[r] = lens[r];
  }
  __syncthreads();
  return too_short;
}

__device__ __forceinline__ int padded_pow2(int n) {
  int padded = 1;
  while (padded < n) padded *= 2;
  return padded;
}

__global__ void __launch_bounds__(kThreads) device_plan_decode_kernel(const DevicePlanDecode p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int bs = p.batch_size;
  int64_t* scratch = reinterpret_cast<int64_t*>(smem);                      // [kThreads / 32]
  int64_t* partials64 = scratch + kThreads / 32;                            // [kThreads]
  int32_t* partials32 = reinterpret_cast<int32_t*>(partials64 + kThreads);  // [kThreads]
  int32_t* lens = partials32 + kThreads;                                    // [bs]
  int32_t* pieces = lens + bs;                                              // [bs]
  int32_t* starts = pieces + bs;                                            // [bs + 1]
  int32_t* split = starts + bs + 1;  // [bs] pieces if > 1, else 0
  int32_t* merge = split + bs;       // [bs + 1]
  int64_t* lens64 = reinterpret_cast<int64_t*>((reinterpret_cast<uintptr_t>(merge + bs + 1) + 15) /
                                               16 * 16);      // [bs]
  uint64_t* keys = reinterpret_cast<uint64_t*>(lens64 + bs);  // [pow2 >= items]

  // ---- lengths, kv_indptr, the longest request and the total cost ---------------------------
  int64_t top = 0;
  int64_t total = 0;
  for (int r = threadIdx.x; r < bs; r += kThreads) {
    int32_t q_len = 1;
    const int32_t len =
        p.lengths.seq_lens != nullptr ? step_kv_len(p.lengths, r, &q_len) : max(p.kv_len[r], 0);
    lens[r] = len;
    lens64[r] = len;
    top = max(top, int64_t(len));
    total += int64_t(len) + p.config.cta_overhead_tokens;
  }
  const int64_t max_len = block_max(top, scratch);
  total = block_sum(total, scratch);
  block_exclusive_scan<int64_t>(lens64, p.kv_indptr, bs, partials64);

  // ---- the chunk (core::plan_decode_rule) ----------------------------------------------------
  int64_t chunk = max(max_len, int64_t(1));
  const core::DecodePlanConfig& c = p.config;
  if (c.concurrent_ctas > 0 && max_len > c.min_chunk) {
    const int64_t share = ceil_div(total * c.ctas_per_item, c.concurrent_ctas);
    const int64_t even = ceil_div(max(share, int64_t(c.min_chunk)), c.chunk_align) * c.chunk_align;
    if (double(even) < kRequiredGain * double(max_len)) {
      chunk = even;
      while (chunk < max_len) {
        int64_t items = 0;
        for (int r = threadIdx.x; r < bs; r += kThreads) {
          items += max(int64_t(1), ceil_div(lens[r], chunk));
        }
        if (block_sum(items, scratch) <= p.item_capacity) break;
        chunk *= 2;
      }
      chunk = min(chunk, max(max_len, int64_t(1)));
    }
  }

  // ---- items a request, their offsets, the partial rows --------------------------------------
  for (int r = threadIdx.x; r < bs; r += kThreads) {
    const int32_t n = int32_t(max(int64_t(1), ceil_div(lens[r], chunk)));
    pieces[r] = n;
    split[r] = n > 1 ? n : 0;
  }
  block_exclusive_scan<int32_t>(pieces, starts, bs, partials32);
  block_exclusive_scan<int32_t>(split, merge, bs, partials32);
  const int num_items = starts[bs];

  // ---- heaviest first: keys of the items in emission order, a bitonic sort -------------------
  const int padded = padded_pow2(num_items);
  for (int i = threadIdx.x; i < padded; i += kThreads) {
    uint64_t key = ~uint64_t(0);  // padding sorts last
    if (i < num_items) {
      const int r = request_of_item(starts, bs, i);
      const int64_t piece = i - starts[r];
      const int64_t begin = piece * chunk;
      const int64_t end = min(int64_t(lens[r]), begin + chunk);
      key = heaviest_first_key(end - begin, uint32_t(i));
    }
    keys[i] = key;
  }
  bitonic_sort(keys, padded);

  // ---- the plan ----------------------------------------------------------------------------
  for (int j = threadIdx.x; j < num_items; j += kThreads) {
    const int i = int(keys[j] & 0xffffffffu);
    const int lo = request_of_item(starts, bs, i);
    const int64_t piece = i - starts[lo];
    core::DecodeWorkItem item;
    item.request = lo;
    item.kv_begin = int32_t(piece * chunk);
    item.kv_end = int32_t(min(int64_t(lens[lo]), (piece + 1) * chunk));
    item.partial = pieces[lo] > 1 ? merge[lo] + int32_t(piece) : -1;
    item.kv_offset = p.kv_indptr[lo] + item.kv_begin;
    item.reserved = 0;
    p.items[j] = item;
  }
  for (int r = threadIdx.x; r <= bs; r += kThreads) p.merge_indptr[r] = merge[r];
  if (threadIdx.x == 0) {
    *p.num_items = num_items;
    if (p.chunk != nullptr) *p.chunk = int32_t(chunk);
  }
}

// ---- the tensor-core kernels' plan (core::plan_prefill_tiles) -----------------------------

// The host's tile arithmetic (core/tile_keys.h): row tile `row_tile` of a request's keys, its
// kernel steps, a chunk of it.
using core::TileKeys;
__device__ __forceinline__ TileKeys keys_of_row_tile(const core::PrefillTileShape& s, int group,
                                                     int32_t kv_len, int32_t q_len, int row_tile) {
  return core::row_tile_keys(s, group, kv_len, q_len, int64_t(row_tile) * s.tile_rows);
}

__device__ __forceinline__ int32_t steps_of(TileKeys k, int kv_tile) {
  return int32_t(core::tile_steps(k, kv_tile));
}

// Shared-memory layout of the tile planner: fixed scratch, per-request arrays, per-row-tile
// arrays (the split path's scans), then the sort keys.
struct TilesSmem {
  size_t lens64, lens, q_lens, qo, tile_start, built, merge, partial, groups, keys, bytes;
};
// l2_groups: the L2 order's head groups (PrefillTileShape::l2_keys > 0): at most one a kv head
// of each request with rows.
__host__ __device__ inline TilesSmem tiles_smem(int batch_size, int row_tiles, int keys,
                                                int l2_groups) {
  TilesSmem m;
  size_t at = (kThreads / 32 + kThreads) * sizeof(int64_t) + kThreads * sizeof(int32_t);
  auto take = [&](size_t bytes) {
    at = (at + 15) / 16 * 16;
    const size_t here = at;
    at += bytes;
    return here;
  };
  const size_t bs = size_t(batch_size);
  m.lens64 = take(bs * sizeof(int64_t));
  m.lens = take(bs * sizeof(int32_t));
  m.q_lens = take(bs * sizeof(int32_t));
  m.qo = take((bs + 1) * sizeof(int32_t));
  m.tile_start = take((bs + 1) * sizeof(int32_t));
  const size_t tiles = size_t(row_tiles) + 1;
  m.built = take(tiles * sizeof(int32_t));
  m.merge = take(tiles * sizeof(int32_t));
  m.partial = take(tiles * sizeof(int32_t));
  m.groups = take((size_t(l2_groups) + 1) * sizeof(int32_t));
  m.keys = take(size_t(keys) * sizeof(uint64_t));
  m.bytes = (at + 15) / 16 * 16;
  return m;
}

// The head groups the L2 order may form (0 without it): one a kv head of each request that has
// rows, at most min(batch_size, row tiles) requests.
__host__ __device__ inline int l2_group_bound(const DevicePlanTiles& p) {
  if (p.shape.l2_keys <= 0) return 0;
  return min(p.batch_size, p.capacity.row_tiles) * p.shape.num_kv_heads;
}

__global__ void __launch_bounds__(kThreads) device_plan_tiles_kernel(const DevicePlanTiles p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int bs = p.batch_size;
  const core::PrefillTileShape& s = p.shape;
  const int heads = s.num_kv_heads;
  const int group = s.num_q_heads / s.num_kv_heads;
  const bool extend = p.lengths.prefix_lens != nullptr;
  int keys_needed = 1;
  while (keys_needed < p.capacity.items) keys_needed *= 2;
  const TilesSmem m = tiles_smem(bs, p.capacity.row_tiles, keys_needed, l2_group_bound(p));
  int64_t* scratch = reinterpret_cast<int64_t*>(smem);                      // [kThreads / 32]
  int64_t* partials64 = scratch + kThreads / 32;                            // [kThreads]
  int32_t* partials32 = reinterpret_cast<int32_t*>(partials64 + kThreads);  // [kThreads]
  int64_t* lens64 = reinterpret_cast<int64_t*>(smem + m.lens64);            // [bs]
  int32_t* lens = reinterpret_cast<int32_t*>(smem + m.lens);                // [bs]
  int32_t* q_lens = reinterpret_cast<int32_t*>(smem + m.q_lens);            // [bs]
  int32_t* qo = reinterpret_cast<int32_t*>(smem + m.qo);                    // [bs + 1]
  int32_t* tile_start = reinterpret_cast<int32_t*>(smem + m.tile_start);    // [bs + 1]
  int32_t* built = reinterpret_cast<int32_t*>(smem + m.built);              // [row tiles + 1]
  int32_t* merge = reinterpret_cast<int32_t*>(smem + m.merge);              // [row tiles + 1]
  int32_t* partial = reinterpret_cast<int32_t*>(smem + m.partial);          // [row tiles + 1]
  int32_t* groups = reinterpret_cast<int32_t*>(smem + m.groups);            // [l2 groups + 1]
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem + m.keys);              // [keys_needed]

  if (p.scheduler != nullptr && threadIdx.x < 4) p.scheduler[threadIdx.x] = 0;

  // ---- lengths, query rows, mask rows, kv_indptr ---------------------------------------------
  for (int r = threadIdx.x; r < bs; r += kThreads) {
    int32_t q_len = 0;
    const int32_t len = step_kv_len(p.lengths, r, &q_len);
    lens[r] = len;
    lens64[r] = len;
    q_lens[r] = q_len;
  }
  mask_rows(p.lengths, bs, lens, lens64, partials64);
  if (extend) {
    // qo_indptr, clamped to the step's rows (the step check refuses lengths that do not add up).
    block_exclusive_scan<int32_t>(q_lens, qo, bs, partials32);
    const int32_t rows = int32_t(p.lengths.num_tokens);
    for (int r = threadIdx.x; r <= bs; r += kThreads) {
      qo[r] = min(qo[r], rows);
      p.lengths.qo_indptr[r] = qo[r];
    }
    __syncthreads();
    for (int r = threadIdx.x; r < bs; r += kThreads) q_lens[r] = qo[r + 1] - qo[r];
  } else {
    for (int r = threadIdx.x; r <= bs; r += kThreads) qo[r] = r * p.lengths.q_len;
  }
  block_exclusive_scan<int64_t>(lens64, p.kv_indptr, bs, partials64);
  // The (request, row tile) pairs in build order, at most capacity.row_tiles.
  for (int r = threadIdx.x; r < bs; r += kThreads) {
    tile_start[r] = int32_t((int64_t(q_lens[r]) * group + s.tile_rows - 1) / s.tile_rows);
  }
  block_exclusive_scan<int32_t>(tile_start, tile_start, bs, partials32);
  const int num_tiles = min(tile_start[bs], p.capacity.row_tiles);
  // Row tile t's request, its row tile and its keys.
  auto request_of_tile = [&](int t) { return request_of_item(tile_start, bs, t); };
  auto keys_of_tile = [&](int t, int r) {
    return keys_of_row_tile(s, group, lens[r], q_lens[r], t - tile_start[r]);
  };
  int64_t cost = 0;
  for (int t = threadIdx.x; t < num_tiles; t += kThreads) {
    cost += core::tile_cost(steps_of(keys_of_tile(t, request_of_tile(t)), s.kv_tile), s);
  }
  const int64_t total_cost = block_sum(cost, scratch);

  auto fill_item = [&](core::PrefillWorkItem& item, int r, int row_tile, int h, TileKeys k) {
    item.request = r;
    item.kv_head = h;
    item.q_row_begin = row_tile * s.tile_rows;
    item.kv_begin = int32_t(k.begin);
    item.kv_end = int32_t(k.end);
    item.partial = -1;
    item.merge = -1;
    const int64_t base = p.kv_indptr[r];
    item.kv_base = base <= INT32_MAX ? int32_t(base) : -1;
    item.q_begin = qo[r];
    item.q_end = qo[r + 1];
    item.kv_len = int32_t(p.kv_indptr[r + 1] - base);
    item.reserved = 0;
  };
  int num_items = 0;
  int num_merges = 0;

  if (s.cluster > 1) {
    // Every tile in exactly `cluster` chunks, the tiles by their steps, heaviest first.
    const int padded = padded_pow2(num_tiles);
    for (int i = threadIdx.x; i < padded; i += kThreads) {
      uint64_t key = ~uint64_t(0);
      if (i < num_tiles) {
        key = heaviest_first_key(steps_of(keys_of_tile(i, request_of_tile(i)), s.kv_tile),
                                 uint32_t(i));
      }
      keys[i] = key;
    }
    bitonic_sort(keys, padded);
    const int per_tile = heads * s.cluster;
    num_items = min(num_tiles * per_tile, p.capacity.items);
    for (int j = threadIdx.x; j < num_items; j += kThreads) {
      const int tile = int(keys[j / per_tile] & 0xffffffffu);
      const int h = (j % per_tile) / s.cluster;
      const int c = j % s.cluster;
      const int r = request_of_tile(tile);
      const TileKeys k = keys_of_tile(tile, r);
      core::PrefillWorkItem item;
      fill_item(item, r, tile - tile_start[r], h,
                core::chunk_keys(k, steps_of(k, s.kv_tile), c, s.cluster, s.kv_tile));
      p.items[j] = item;
    }
  } else {
    // Split-KV where a tile is much heavier than an even share of the device.
    const int64_t chunk = core::split_chunk_keys(s, total_cost, num_tiles);
    int64_t longest = 0;
    for (int t = threadIdx.x; t < num_tiles; t += kThreads) {
      const TileKeys k = keys_of_tile(t, request_of_tile(t));
      longest = max(longest, k.end - k.begin);
    }
    const bool splits = core::split_chunks(block_max(longest, scratch), chunk) > 1;
    const bool l2_order = !splits && s.l2_keys > 0 && p.kv_indptr[bs] * int64_t(heads) > s.l2_keys;
    if (l2_order) {
      // The L2 order (emit_l2_groups): each request's tiles heaviest first (ties in build
      // order), its kv heads in groups of l2_group_heads, a group's tiles together with its
      // heads consecutive, the groups by their heaviest tile (ties in build order).
      // 1. Sort the tiles by (request, keys descending, row tile): built[] holds them sorted, a
      //    request's at [tile_start[r], tile_start[r + 1]).
      const int padded_tiles = padded_pow2(num_tiles);
      for (int i = threadIdx.x; i < padded_tiles; i += kThreads) {
        uint64_t key = ~uint64_t(0);
        if (i < num_tiles) {
          const int r = request_of_tile(i);
          const TileKeys k = keys_of_tile(i, r);
          key = (uint64_t(r) << 47) | (uint64_t(INT32_MAX - (k.end - k.begin)) << 16) |
                uint64_t(i - tile_start[r]);
        }
        keys[i] = key;
      }
      bitonic_sort(keys, padded_tiles);
      for (int i = threadIdx.x; i < num_tiles; i += kThreads) {
        const int r = int(keys[i] >> 47);
        built[i] = tile_start[r] + int(keys[i] & 0xffffu);
      }
      // 2. The groups in build order (request, head group): group_start[r] (in lens64's bytes,
      //    free since kv_indptr is written), then sorted by (heaviest descending, build index).
      int32_t* group_start = reinterpret_cast<int32_t*>(lens64);  // [bs + 1]
      for (int r = threadIdx.x; r < bs; r += kThreads) {
        const bool rows = tile_start[r + 1] > tile_start[r] && tile_start[r] < num_tiles;
        const int hg = core::l2_group_heads(s, lens[r]);
        group_start[r] = rows ? (heads + hg - 1) / hg : 0;
      }
      block_exclusive_scan<int32_t>(group_start, group_start, bs, partials32);
      const int num_groups = min(group_start[bs], l2_group_bound(p));
      auto group_request = [&](int g) { return request_of_item(group_start, bs, g); };
      const int padded_groups = padded_pow2(num_groups);
      for (int g = threadIdx.x; g < padded_groups; g += kThreads) {
        uint64_t key = ~uint64_t(0);
        if (g < num_groups) {
          const int r = group_request(g);
          const TileKeys k = keys_of_tile(built[tile_start[r]], r);  // its heaviest tile
          key = heaviest_first_key(k.end - k.begin, uint32_t(g));
        }
        keys[g] = key;
      }
      bitonic_sort(keys, padded_groups);
      // 3. Items a sorted group (its tiles x its heads), scanned; item j finds its group.
      auto group_heads = [&](int g, int r, int* head_begin) {
        const int hg = core::l2_group_heads(s, lens[r]);
        *head_begin = (g - group_start[r]) * hg;
        return min(hg, heads - *head_begin);
      };
      for (int q = threadIdx.x; q < num_groups; q += kThreads) {
        const int g = int(keys[q] & 0xffffffffu);
        const int r = group_request(g);
        int head_begin = 0;
        groups[q] =
            (min(tile_start[r + 1], num_tiles) - tile_start[r]) * group_heads(g, r, &head_begin);
      }
      block_exclusive_scan<int32_t>(groups, groups, num_groups, partials32);
      num_items = min(groups[num_groups], p.capacity.items);
      for (int j = threadIdx.x; j < num_items; j += kThreads) {
        const int q = request_of_item(groups, num_groups, j);
        const int g = int(keys[q] & 0xffffffffu);
        const int r = group_request(g);
        int head_begin = 0;
        const int size = group_heads(g, r, &head_begin);
        const int local = j - groups[q];
        const int tile = built[tile_start[r] + local / size];
        core::PrefillWorkItem item;
        fill_item(item, r, tile - tile_start[r], head_begin + local % size, keys_of_tile(tile, r));
        p.items[j] = item;
      }
    } else if (!splits) {
      // The row tiles by their keys, heaviest first; a tile's kv heads consecutive.
      const int padded = padded_pow2(num_tiles);
      for (int i = threadIdx.x; i < padded; i += kThreads) {
        uint64_t key = ~uint64_t(0);
        if (i < num_tiles) {
          const TileKeys k = keys_of_tile(i, request_of_tile(i));
          key = heaviest_first_key(k.end - k.begin, uint32_t(i));
        }
        keys[i] = key;
      }
      bitonic_sort(keys, padded);
      num_items = min(num_tiles * heads, p.capacity.items);
      for (int j = threadIdx.x; j < num_items; j += kThreads) {
        const int tile = int(keys[j / heads] & 0xffffffffu);
        const int r = request_of_tile(tile);
        core::PrefillWorkItem item;
        fill_item(item, r, tile - tile_start[r], j % heads, keys_of_tile(tile, r));
        p.items[j] = item;
      }
    } else {
      // Build order (request, row tile, kv head, chunk): a tile's items, merges and partial
      // slots are consecutive, so three scans over the row tiles number them all.
      auto chunks_of = [&](TileKeys k) {
        return int32_t(core::split_chunks(k.end - k.begin, chunk));
      };
      for (int t = threadIdx.x; t < num_tiles; t += kThreads) {
        const int32_t chunks = chunks_of(keys_of_tile(t, request_of_tile(t)));
        built[t] = heads * chunks;
        merge[t] = chunks > 1 ? heads : 0;
        partial[t] = chunks > 1 ? heads * chunks : 0;
      }
      block_exclusive_scan<int32_t>(built, built, num_tiles, partials32);
      block_exclusive_scan<int32_t>(merge, merge, num_tiles, partials32);
      block_exclusive_scan<int32_t>(partial, partial, num_tiles, partials32);
      // (At most capacity.items by prefill_plan_capacity's bound; clamped so that the keys stay
      // inside their shared memory whatever happens.)
      const int total_built = min(built[num_tiles], p.capacity.items);
      // Where each built item sits: its tile, request, head and chunk.
      struct Built {
        int t, r, h, c, chunks;
        TileKeys chunk;
      };
      auto locate = [&](int i) {
        Built b;
        b.t = request_of_item(built, num_tiles, i);
        b.r = request_of_tile(b.t);
        const TileKeys k = keys_of_tile(b.t, b.r);
        b.chunks = chunks_of(k);
        const int local = i - built[b.t];
        b.h = local / b.chunks;
        b.c = local % b.chunks;
        b.chunk = core::chunk_keys(k, steps_of(k, s.kv_tile), b.c, b.chunks, s.kv_tile);
        return b;
      };
      const int padded = padded_pow2(total_built);
      for (int i = threadIdx.x; i < padded; i += kThreads) {
        uint64_t key = ~uint64_t(0);
        if (i < total_built) {
          const Built b = locate(i);
          key = heaviest_first_key(b.chunk.end - b.chunk.begin, uint32_t(i));
        }
        keys[i] = key;
      }
      bitonic_sort(keys, padded);
      num_items = total_built;
      for (int j = threadIdx.x; j < num_items; j += kThreads) {
        const Built b = locate(int(keys[j] & 0xffffffffu));
        core::PrefillWorkItem item;
        fill_item(item, b.r, b.t - tile_start[b.r], b.h, b.chunk);
        if (b.chunks > 1) {
          item.partial = partial[b.t] + b.h * b.chunks + b.c;
          item.merge = merge[b.t] + b.h;
        }
        p.items[j] = item;
      }
      num_merges = min(merge[num_tiles], p.capacity.merges);
      for (int i = threadIdx.x; i < num_merges; i += kThreads) {
        const int t = request_of_item(merge, num_tiles, i);
        const int r = request_of_tile(t);
        const int h = i - merge[t];
        const int chunks = chunks_of(keys_of_tile(t, r));
        core::PrefillMergeItem item;
        item.request = r;
        item.kv_head = h;
        item.q_row_begin = (t - tile_start[r]) * s.tile_rows;
        item.first_partial = partial[t] + h * chunks;
        item.num_partials = chunks;
        item.arrived = 0;
        item.reserved1 = item.reserved2 = 0;
        p.merges[i] = item;
      }
    }
  }

  // ---- the fixed-size tail: no-op items and empty merges (core::pad_prefill_plan) ------------
  for (int j = num_items + threadIdx.x; j < p.capacity.items; j += kThreads) {
    core::PrefillWorkItem item;
    item.q_row_begin = core::kNoOpRow;
    p.items[j] = item;
  }
  for (int i = num_merges + threadIdx.x; i < p.capacity.merges; i += kThreads) {
    core::PrefillMergeItem item;
    item.q_row_begin = core::kNoOpRow;
    p.merges[i] = item;
  }
}

// The bitonic sort's keys for n items: the power of two at or above n.
int sort_keys(int n) {
  int keys = 1;
  while (keys < n) keys *= 2;
  return keys;
}

size_t smem_bytes(int batch_size, int item_capacity) {
  const int padded = sort_keys(item_capacity);
  size_t bytes = (kThreads / 32 + kThreads) * sizeof(int64_t) + kThreads * sizeof(int32_t);
  bytes += (5 * size_t(batch_size) + 2) * sizeof(int32_t);
  bytes = (bytes + 15) / 16 * 16 + size_t(batch_size) * sizeof(int64_t);
  return bytes + size_t(padded) * sizeof(uint64_t);
}

}  // namespace

bool device_plan_decode_fits(int batch_size, int item_capacity) {
  return batch_size <= kDevicePlanMaxBatch && item_capacity <= kDevicePlanMaxItems;
}

bool device_plan_tiles_fit(int batch_size, const core::PrefillPlanCapacity& capacity,
                           const core::PrefillTileShape& shape) {
  const int keys = sort_keys(capacity.items);
  DevicePlanTiles probe;
  probe.batch_size = batch_size;
  probe.capacity = capacity;
  probe.shape = shape;
  return batch_size >= 0 && batch_size <= kDevicePlanTilesMaxBatch && capacity.row_tiles >= 0 &&
         keys <= kDevicePlanTilesMaxKeys &&
         tiles_smem(batch_size, capacity.row_tiles, keys, l2_group_bound(probe)).bytes <=
             kDevicePlanTilesMaxSmem;
}

void launch_device_plan_decode(const DevicePlanDecode& p, cudaStream_t stream) {
  check_arg(p.batch_size >= 0 && p.batch_size <= kDevicePlanMaxBatch, "batch_size", "got ",
            p.batch_size, ", the device planner takes 0..", kDevicePlanMaxBatch);
  check_arg(
      p.item_capacity >= p.batch_size && device_plan_decode_fits(p.batch_size, p.item_capacity),
      "item_capacity", "got ", p.item_capacity, ", expected batch_size (", p.batch_size, ")..",
      kDevicePlanMaxItems);
  check_arg(p.config.ctas_per_item >= 1 && p.config.concurrent_ctas >= 0 &&
                p.config.chunk_align >= 1 && p.config.min_chunk >= 1,
            "config",
            "ctas_per_item >= 1, concurrent_ctas >= 0, chunk_align >= 1, min_chunk >= 1 "
            "expected");
  const bool lengths = p.lengths.seq_lens != nullptr && p.lengths.kv_start != nullptr &&
                       p.lengths.kv_len != nullptr && p.lengths.max_context_len >= 0 &&
                       p.lengths.per_request >= 1 && p.lengths.tree_tokens >= 0 &&
                       p.lengths.max_context_len >= p.lengths.tree_tokens;
  check_arg(p.batch_size == 0 ||
                ((p.kv_len != nullptr || lengths) && p.kv_indptr != nullptr && p.items != nullptr &&
                 p.merge_indptr != nullptr && p.num_items != nullptr),
            "kv_len",
            "the device plan needs kv_len (or seq_lens with kv_start / kv_len out), kv_indptr, "
            "items, merge_indptr, num_items");
  if (p.batch_size == 0) return;
  const size_t smem = smem_bytes(p.batch_size, p.item_capacity);
  check_cuda(cudaFuncSetAttribute(device_plan_decode_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cudaFuncSetAttribute(device_plan_decode_kernel)");
  device_plan_decode_kernel<<<1, kThreads, smem, stream>>>(p);
  check_launch("device_plan_decode_kernel");
}

void launch_device_plan_tiles(const DevicePlanTiles& p, cudaStream_t stream) {
  const core::PrefillTileShape& s = p.shape;
  check_arg(p.batch_size >= 0 && p.batch_size <= kDevicePlanTilesMaxBatch, "batch_size", "got ",
            p.batch_size, ", the device tile planner takes 0..", kDevicePlanTilesMaxBatch);
  check_arg(s.num_kv_heads > 0 && s.num_q_heads > 0 && s.num_q_heads % s.num_kv_heads == 0 &&
                s.tile_rows > 0 && s.kv_tile > 0 && s.window_left >= -1 && s.concurrent_ctas >= 0 &&
                s.min_split_keys >= 1 && s.cluster <= 64,
            "shape", "a tile shape core::plan_prefill_tiles accepts expected");
  check_arg(s.l2_keys >= 0 && (s.l2_keys == 0 || s.cluster <= 1), "shape.l2_keys", "got ",
            s.l2_keys, ", expected >= 0 (and 0 with a cluster split)");
  const bool extend = p.lengths.prefix_lens != nullptr;
  check_arg(extend || (p.lengths.q_len >= 1 && p.lengths.tree_tokens >= 0), "q_len", "got ",
            p.lengths.q_len, " query and ", p.lengths.tree_tokens,
            " tree tokens a request, expected >= 1 and >= 0");
  check_arg(!extend || (p.lengths.tree_tokens == 0 && p.lengths.qo_indptr != nullptr &&
                        p.lengths.num_tokens >= 0 && p.lengths.num_tokens <= INT32_MAX &&
                        s.mask != core::MaskMode::kCustom),
            "prefix_lens",
            "an EXTEND-like plan needs qo_indptr, num_tokens in [0, 2^31), no tree tokens and no "
            "custom mask");
  check_arg(p.lengths.mask_indptr == nullptr ||
                (s.mask == core::MaskMode::kCustom && p.lengths.mask_elems != nullptr),
            "mask_indptr", "only a custom-mask call writes mask_indptr, and it needs mask_elems");
  check_arg(p.lengths.per_request >= 1, "per_request", "got ", p.lengths.per_request,
            ", expected >= 1");
  const core::PrefillPlanCapacity want =
      extend ? core::prefill_plan_capacity_for_tokens(p.batch_size, p.lengths.num_tokens, s)
             : core::prefill_plan_capacity(p.batch_size, p.lengths.q_len, s);
  check_arg(p.capacity.items == want.items && p.capacity.merges == want.merges &&
                p.capacity.partials == want.partials && p.capacity.row_tiles == want.row_tiles,
            "capacity", "got ", p.capacity.items, " items, ", p.capacity.merges, " merges, ",
            p.capacity.partials, " partials, ", p.capacity.row_tiles,
            " row tiles; expected the call's prefill_plan_capacity: ", want.items, ", ",
            want.merges, ", ", want.partials, ", ", want.row_tiles);
  check_arg(device_plan_tiles_fit(p.batch_size, p.capacity, s), "batch_size", "got ", p.batch_size,
            ": ", p.capacity.items, " items of ", p.capacity.row_tiles,
            " row tiles, over what one tile-planning CTA sorts (", kDevicePlanTilesMaxKeys,
            " keys) or holds (", kDevicePlanTilesMaxSmem, " bytes of shared memory)");
  const DeviceLengths& l = p.lengths;
  check_arg(
      p.batch_size == 0 || (l.seq_lens != nullptr && l.kv_start != nullptr && l.kv_len != nullptr &&
                            l.max_context_len >= l.tree_tokens && p.kv_indptr != nullptr &&
                            p.items != nullptr && (p.merges != nullptr || p.capacity.merges == 0)),
      "seq_lens",
      "the device tile plan needs seq_lens, kv_start, kv_len, kv_indptr, items "
      "and merges");
  if (p.batch_size == 0) return;
  const size_t smem =
      tiles_smem(p.batch_size, p.capacity.row_tiles, sort_keys(p.capacity.items), l2_group_bound(p))
          .bytes;
  check_cuda(cudaFuncSetAttribute(device_plan_tiles_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cudaFuncSetAttribute(device_plan_tiles_kernel)");
  device_plan_tiles_kernel<<<1, kThreads, smem, stream>>>(p);
  check_launch("device_plan_tiles_kernel");
}

}  // namespace kvattn::cuda
