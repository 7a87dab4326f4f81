#include "core/planner.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>

#include "kvattn/error.h"

namespace kvattn::core {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
int64_t round_up(int64_t a, int64_t b) {
  return ceil_div(a, b) * b;
}

// Split factors of the longest request tried by the planner: dense where one more chunk changes
// the wave count a lot, sparse beyond (each candidate costs one LPT simulation).
constexpr int kSplitCandidates[] = {1,   2,   3,   4,   5,   6,   7,   8,   10,  12, 14,
                                    16,  20,  24,  28,  32,  40,  48,  56,  64,  80, 96,
                                    112, 128, 160, 192, 224, 256, 320, 384, 448, 512};

// A candidate split must beat the best so far by this much: one more split costs merge work
// and partial-state traffic that the cost model only approximates.
constexpr double kRequiredGain = 0.97;

// Bounds far above any device (an H200 runs 132 SMs x at most 32 CTAs = 4224 CTAs at once; a
// decode item has num_kv_heads x head passes CTAs): the makespan simulation keeps one slot per
// concurrent CTA, so a wild config must be refused rather than simulated (found by fuzzing).
constexpr int kMaxConcurrentCtas = 1 << 20;
constexpr int kMaxCtasPerItem = 1 << 16;

void check_config(const DecodePlanConfig& config) {
  check_arg(config.ctas_per_item >= 1 && config.ctas_per_item <= kMaxCtasPerItem, "ctas_per_item",
            "got ", config.ctas_per_item, ", expected 1..", kMaxCtasPerItem);
  check_arg(config.concurrent_ctas >= 0 && config.concurrent_ctas <= kMaxConcurrentCtas,
            "concurrent_ctas", "got ", config.concurrent_ctas, ", expected 0..",
            kMaxConcurrentCtas);
  check_arg(config.chunk_align >= 1, "chunk_align", "got ", config.chunk_align, ", expected >= 1");
  check_arg(config.min_chunk >= 1, "min_chunk", "got ", config.min_chunk, ", expected >= 1");
}

int32_t check_lengths(std::span<const int32_t> kv_len) {
  int32_t max_len = 0;
  for (size_t r = 0; r < kv_len.size(); ++r) {
    // The argument's name is built only on failure: this runs at every step.
    if (kv_len[r] < 0) {
      throw_error(ErrorKind::kInvalidArgument, "kv_len[" + std::to_string(r) + "]", "got ",
                  kv_len[r], ", expected >= 0");
    }
    max_len = std::max(max_len, kv_len[r]);
  }
  return max_len;
}

// The inputs of a plan (plan_decode, plan_decode_rule): config, lengths and an item capacity of
// at least one item a request. Returns the longest length.
int32_t check_plan_inputs(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                          int item_capacity) {
  check_config(config);
  const int32_t max_len = check_lengths(kv_len);
  const int batch_size = int(kv_len.size());
  check_arg(item_capacity >= batch_size, "item_capacity", "got ", item_capacity,
            ", expected >= batch_size ", batch_size);
  return max_len;
}

int64_t items_for_chunk(std::span<const int32_t> kv_len, int64_t chunk) {
  int64_t n = 0;
  for (int32_t len : kv_len) n += std::max<int64_t>(1, ceil_div(len, chunk));
  return n;
}

}  // namespace

int decode_item_capacity(int batch_size, const DecodePlanConfig& config) {
  check_config(config);
  check_arg(batch_size >= 0, "batch_size", "got ", batch_size, ", expected >= 0");
  // Splitting never pays beyond about two waves of CTAs (see the worked example in planner.h).
  const int64_t extra = config.concurrent_ctas > 0
                            ? ceil_div(2 * int64_t(config.concurrent_ctas), config.ctas_per_item)
                            : 0;
  check_arg(batch_size + extra <= INT32_MAX, "batch_size", "got ", batch_size,
            ": the decode plan would exceed 2^31 items");
  return int(std::max<int64_t>(1, batch_size + extra));
}

namespace {

// An unstable sort of these unique keys gives heaviest first and, among equal weights, the
// lower index first (what a stable sort by weight gives) at a fraction of the cost.
uint64_t heaviest_first_key(int64_t weight, size_t index) {
  return (uint64_t(INT32_MAX - weight) << 32) | uint64_t(index);
}
size_t key_index(uint64_t key) {
  return size_t(key & 0xffffffffu);
}

// Greedy LPT makespan of items whose costs are given heaviest first: each CTA goes to the slot
// that frees up first (what the block dispatcher does). An item's k = ctas_per_item CTAs take
// the k least-loaded slots. When the slot count is a multiple of k, the multiset of loads only
// ever holds each value a multiple of k times (true at the start; taking k copies of the least
// value and adding the same cost keeps it), so the slots are simulated as groups of k, one heap
// step per item: k times fewer heap operations, the same makespan. Integer costs keep the sums
// exact.
double lpt_makespan(const std::vector<int64_t>& costs, const DecodePlanConfig& config) {
  if (costs.empty()) return 0;
  if (config.concurrent_ctas == 0) return double(costs.front());
  const int64_t total_ctas = int64_t(costs.size()) * config.ctas_per_item;
  const int64_t slots = std::min<int64_t>(config.concurrent_ctas, total_ctas);
  const bool grouped = slots % config.ctas_per_item == 0;
  const size_t lanes = size_t(grouped ? slots / config.ctas_per_item : slots);
  const int copies = grouped ? 1 : config.ctas_per_item;
  // One wave: every CTA has its own slot, the heaviest item ends last.
  if (costs.size() * size_t(copies) <= lanes) return double(costs.front());
  std::vector<int64_t> loads(lanes, 0);  // a min-heap (all equal: valid)
  int64_t makespan = 0;
  for (int64_t cost : costs) {
    for (int c = 0; c < copies; ++c) {
      // The least load grows by `cost` and sinks to its place (one sift instead of pop + push).
      const int64_t value = loads[0] + cost;
      size_t i = 0;
      for (size_t child = 1; child < lanes; child = 2 * i + 1) {
        if (child + 1 < lanes && loads[child + 1] < loads[child]) ++child;
        if (loads[child] >= value) break;
        loads[i] = loads[child];
        i = child;
      }
      loads[i] = value;
      makespan = std::max(makespan, value);
    }
  }
  return double(makespan);
}

// Every request cut into `chunk`-token items (one item when it fits), partial rows numbered in
// request order into plan.merge_indptr (sized batch_size + 1, zeroed), the items heaviest first,
// ties in emission order (one sort of unique 64-bit keys): plan_decode's and the device rule's
// emission.
void emit_chunks_heaviest_first(std::span<const int32_t> kv_len, int64_t chunk, DecodePlan& plan) {
  std::vector<DecodeWorkItem> emitted;
  emitted.reserve(size_t(items_for_chunk(kv_len, chunk)));
  for (size_t r = 0; r < kv_len.size(); ++r) {
    const int64_t len = kv_len[r];
    const int64_t pieces = std::max<int64_t>(1, ceil_div(len, chunk));
    plan.merge_indptr[r + 1] = plan.merge_indptr[r] + (pieces > 1 ? int32_t(pieces) : 0);
    for (int64_t p = 0; p < pieces; ++p) {
      DecodeWorkItem item;
      item.request = int32_t(r);
      item.kv_begin = int32_t(p * chunk);
      item.kv_end = int32_t(std::min<int64_t>(len, (p + 1) * chunk));
      item.partial = pieces > 1 ? plan.merge_indptr[r] + int32_t(p) : -1;
      emitted.push_back(item);
    }
  }
  plan.num_partials = plan.merge_indptr.back();
  std::vector<uint64_t> keys(emitted.size());
  for (size_t i = 0; i < emitted.size(); ++i)
    keys[i] = heaviest_first_key(int64_t(emitted[i].kv_end) - emitted[i].kv_begin, i);
  std::sort(keys.begin(), keys.end());
  plan.items.resize(emitted.size());
  for (size_t i = 0; i < keys.size(); ++i) plan.items[i] = emitted[key_index(keys[i])];
}

}  // namespace

double estimate_decode_makespan(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                                int chunk) {
  check_config(config);
  check_arg(chunk >= 1, "chunk", "got ", chunk, ", expected >= 1");
  // Item costs (each item stands for ctas_per_item identical CTAs), heaviest first.
  std::vector<int64_t> costs;
  costs.reserve(size_t(items_for_chunk(kv_len, chunk)));
  for (int32_t len : kv_len) {
    const int64_t pieces = std::max<int64_t>(1, ceil_div(len, chunk));
    const int64_t extra =
        config.cta_overhead_tokens + (pieces > 1 ? config.merge_overhead_tokens : 0);
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t begin = p * chunk;
      const int64_t end = std::min<int64_t>(len, begin + chunk);
      costs.push_back(end - begin + extra);
    }
  }
  std::sort(costs.begin(), costs.end(), std::greater<>());
  return lpt_makespan(costs, config);
}

DecodePlan plan_decode(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                       int item_capacity) {
  const int32_t max_len = check_plan_inputs(kv_len, config, item_capacity);
  const int batch_size = int(kv_len.size());

  // Requests heaviest first, sorted once: the unsplit plan's launch order and the input of its
  // cost estimate (this runs at every step, so the common unsplit case sorts nothing else).
  std::vector<uint64_t> order(static_cast<size_t>(batch_size));
  for (int r = 0; r < batch_size; ++r) order[size_t(r)] = heaviest_first_key(kv_len[r], size_t(r));
  std::sort(order.begin(), order.end());

  // ---- choose the chunk ---------------------------------------------------------------------
  // Candidates are estimated only when one is feasible: a large batch, which fills the device
  // unsplit and has no room for more items, skips the estimate altogether.
  int64_t best_chunk = std::max<int32_t>(max_len, 1);
  double best_cost = 0;
  bool estimated = false;
  const int64_t fixed =
      config.fixed_chunk > 0 ? round_up(config.fixed_chunk, config.chunk_align) : 0;
  if (fixed > 0 && fixed < max_len && items_for_chunk(kv_len, fixed) <= item_capacity) {
    best_chunk = fixed;
  } else if (config.concurrent_ctas > 0 && max_len > config.min_chunk) {
    double total = 0;
    for (int32_t len : kv_len) total += double(len) + config.cta_overhead_tokens;
    const double lower_bound = total * config.ctas_per_item / config.concurrent_ctas;
    int64_t last_chunk = best_chunk;
    for (int k : kSplitCandidates) {
      if (k == 1) continue;
      const int64_t chunk = round_up(ceil_div(max_len, k), config.chunk_align);
      if (chunk < config.min_chunk) break;
      if (chunk >= last_chunk) continue;  // rounding made it a repeat
      last_chunk = chunk;
      if (items_for_chunk(kv_len, chunk) > item_capacity) break;  // grows with k
      if (!estimated) {
        std::vector<int64_t> costs(static_cast<size_t>(batch_size));
        for (int i = 0; i < batch_size; ++i) {
          costs[size_t(i)] =
              int64_t(kv_len[key_index(order[size_t(i)])]) + config.cta_overhead_tokens;
        }
        best_cost = lpt_makespan(costs, config);
        estimated = true;
      }
      if (best_cost <= lower_bound * 1.03) break;  // already within 3% of a perfect spread
      const double cost = estimate_decode_makespan(kv_len, config, int(chunk));
      if (cost < best_cost * kRequiredGain) {
        best_cost = cost;
        best_chunk = chunk;
      }
    }
  }

  // ---- emit the items --------------------------------------------------------------------------
  // Heaviest first; among equals in request order (neighbouring requests' CTAs start together,
  // which keeps the dispatch order reproducible).
  DecodePlan plan;
  plan.chunk = int(best_chunk);
  plan.estimated_cost = best_cost;
  plan.merge_indptr.assign(size_t(batch_size) + 1, 0);
  if (best_chunk >= max_len) {
    plan.items.resize(size_t(batch_size));
    for (int i = 0; i < batch_size; ++i) {
      DecodeWorkItem& item = plan.items[size_t(i)];
      item.request = int32_t(key_index(order[size_t(i)]));
      item.kv_begin = 0;
      item.kv_end = kv_len[item.request];
      item.partial = -1;
    }
    return plan;
  }
  emit_chunks_heaviest_first(kv_len, best_chunk, plan);
  return plan;
}

DecodePlan plan_decode_rule(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                            int item_capacity) {
  const int32_t max_len = check_plan_inputs(kv_len, config, item_capacity);
  const int batch_size = int(kv_len.size());
  int64_t chunk = std::max<int32_t>(max_len, 1);
  if (config.concurrent_ctas > 0 && max_len > config.min_chunk) {
    int64_t total = 0;
    for (int32_t len : kv_len) total += int64_t(len) + config.cta_overhead_tokens;
    const int64_t share = ceil_div(total * config.ctas_per_item, config.concurrent_ctas);
    const int64_t even = round_up(std::max<int64_t>(share, config.min_chunk), config.chunk_align);
    // (plan_decode's bar: a split must promise at least 3% on the longest request.)
    if (double(even) < kRequiredGain * double(max_len)) {
      chunk = even;
      while (chunk < max_len && items_for_chunk(kv_len, chunk) > item_capacity) chunk *= 2;
      chunk = std::min<int64_t>(chunk, std::max<int32_t>(max_len, 1));
    }
  }
  DecodePlan plan;
  plan.chunk = int(chunk);
  plan.merge_indptr.assign(size_t(batch_size) + 1, 0);
  // Heaviest first (on the device a bitonic sort in one CTA's shared memory). Request order
  // instead measured 1.14x the searched plan's makespan (geomean, 600 batches; worst 1.65): the
  // order matters more than the chunk.
  emit_chunks_heaviest_first(kv_len, chunk, plan);
  return plan;
}

// ---- the metadata buffer -------------------------------------------------------------------

namespace {

// Lays arrays out one after another; with a null base it only measures. Every array starts on
// a 16-byte boundary (the kernels load work items and indptrs with vector loads).
class BufferCursor {
 public:
  size_t take(size_t bytes) {
    const size_t offset = (used_ + 15) / 16 * 16;
    used_ = offset + bytes;
    return offset;
  }
  size_t used() const { return (used_ + 15) / 16 * 16; }

 private:
  size_t used_ = 0;
};

template <typename T>
void write_array(void* host, size_t offset, const std::vector<T>& values) {
  if (!values.empty())
    std::memcpy(static_cast<char*>(host) + offset, values.data(), values.size() * sizeof(T));
}

}  // namespace

CallMetadataLayout write_call_metadata(const CallCapacity& capacity, const PagedLayout* layout,
                                       const DecodePlan* plan, void* host, size_t host_capacity) {
  check_arg(capacity.batch_size >= 0, "batch_size", "got ", capacity.batch_size, ", expected >= 0");
  check_arg(capacity.decode_items >= 0, "decode_items", "got ", capacity.decode_items,
            ", expected >= 0");
  const size_t bs = size_t(capacity.batch_size);
  CallMetadataLayout out;
  BufferCursor meta;
  out.step_state = meta.take(kStepStateBytes);
  out.qo_indptr = meta.take((bs + 1) * sizeof(int32_t));
  out.kv_indptr = meta.take((bs + 1) * sizeof(int64_t));
  out.kv_start = meta.take(bs * sizeof(int32_t));
  out.kv_len = meta.take(bs * sizeof(int32_t));
  out.mask_indptr = capacity.custom_mask ? meta.take((bs + 1) * sizeof(int64_t)) : 0;
  out.mask_dense = capacity.custom_mask ? meta.take(bs * sizeof(int32_t)) : 0;
  out.mask_elems = capacity.custom_mask ? meta.take(sizeof(int64_t)) : 0;
  if (capacity.decode_items > 0) {
    out.decode_items = meta.take(size_t(capacity.decode_items) * sizeof(DecodeWorkItem));
    out.merge_indptr = meta.take((bs + 1) * sizeof(int32_t));
    out.num_items = meta.take(sizeof(int32_t));
  }
  out.metadata_bytes = meta.used();
  BufferCursor scratch;
  if (capacity.decode_items > 0) {
    const size_t rows = size_t(capacity.decode_items) * size_t(capacity.num_q_heads);
    out.partial_out = scratch.take(rows * size_t(capacity.v_head_dim) * sizeof(float));
    out.partial_lse = scratch.take(rows * sizeof(float));
  }
  out.scratch_bytes = scratch.used();
  if (host == nullptr) return out;

  check_arg(host_capacity >= out.metadata_bytes, "host_capacity", "got ", host_capacity,
            " bytes, expected >= ", out.metadata_bytes);
  check_arg(layout != nullptr, "layout", "missing: required when filling the buffer");
  check_arg(layout->batch_size <= capacity.batch_size, "batch_size", "got ", layout->batch_size,
            ", the buffer holds ", capacity.batch_size);
  std::memset(host, 0, out.metadata_bytes);
  write_array(host, out.qo_indptr, layout->qo_indptr);
  write_array(host, out.kv_indptr, layout->kv_indptr);
  write_array(host, out.kv_start, layout->kv_start);
  write_array(host, out.kv_len, layout->kv_len);
  if (capacity.custom_mask) {
    write_array(host, out.mask_indptr, layout->mask_indptr);
    const int64_t elems = layout->mask_indptr.empty() ? 0 : layout->mask_indptr.back();
    std::memcpy(static_cast<char*>(host) + out.mask_elems, &elems, sizeof(elems));
  }
  if (plan != nullptr) {
    check_arg(capacity.decode_items > 0, "plan", "given, but the buffer has no decode plan");
    check_arg(int64_t(plan->items.size()) <= capacity.decode_items, "plan", "has ",
              plan->items.size(), " items, the buffer holds ", capacity.decode_items);
    check_arg(plan->merge_indptr.size() == size_t(layout->batch_size) + 1, "plan",
              "merge_indptr has ", plan->merge_indptr.size(), " entries, expected ",
              layout->batch_size + 1);
    auto* items = reinterpret_cast<DecodeWorkItem*>(static_cast<char*>(host) + out.decode_items);
    for (size_t i = 0; i < plan->items.size(); ++i) {
      DecodeWorkItem item = plan->items[i];
      check_arg(item.request >= 0 && item.request < layout->batch_size, "plan", "item ", i,
                " names request ", item.request, " of a batch of ", layout->batch_size);
      item.kv_offset = layout->kv_indptr[size_t(item.request)] + item.kv_begin;
      std::memcpy(items + i, &item, sizeof(item));
    }
    write_array(host, out.merge_indptr, plan->merge_indptr);
    const int32_t n = int32_t(plan->items.size());
    std::memcpy(static_cast<char*>(host) + out.num_items, &n, sizeof(n));
  }
  return out;
}

// ---- fixed-size prefill plans ----------------------------------------------------------------

namespace {

void check_capacity_shape(const PrefillTileShape& shape) {
  check_arg(shape.num_kv_heads > 0 && shape.num_q_heads > 0 &&
                shape.num_q_heads % shape.num_kv_heads == 0,
            "num_q_heads", "got ", shape.num_q_heads, " q heads over ", shape.num_kv_heads,
            " kv heads");
  check_arg(shape.tile_rows > 0, "tile_rows", "got ", shape.tile_rows, ", expected > 0");
  check_arg(shape.concurrent_ctas >= 0, "concurrent_ctas", "got ", shape.concurrent_ctas,
            ", expected >= 0");
}

// The bounds of prefill_plan_capacity from the (request, row tile) pairs: T = row_tiles x
// num_kv_heads.
PrefillPlanCapacity capacity_of_tiles(int64_t row_tiles, const PrefillTileShape& shape) {
  const int64_t tiles = row_tiles * shape.num_kv_heads;
  const int64_t ctas = shape.concurrent_ctas;
  const bool cluster = shape.cluster > 1;  // every tile exactly `cluster` chunks, no merges
  const int64_t items = cluster ? tiles * shape.cluster : tiles + ctas;
  const int64_t merges = cluster ? 0 : std::min(tiles, ctas);
  const int64_t partials = cluster ? 0 : std::min(items, 2 * ctas);
  check_arg(items <= INT32_MAX, "batch_size", items, " prefill items, over 2^31");
  PrefillPlanCapacity capacity;
  capacity.items = int(items);
  capacity.merges = int(merges);
  capacity.partials = int(partials);
  capacity.row_tiles = int(row_tiles);
  return capacity;
}

}  // namespace

PrefillPlanCapacity prefill_plan_capacity(int batch_size, int q_len,
                                          const PrefillTileShape& shape) {
  check_arg(batch_size >= 0, "batch_size", "got ", batch_size, ", expected >= 0");
  check_arg(q_len >= 0, "q_len", "got ", q_len, ", expected >= 0");
  check_capacity_shape(shape);
  const int64_t rows = int64_t(q_len) * (shape.num_q_heads / shape.num_kv_heads);
  // No-op items start at kNoOpRow: a request must have fewer packed rows.
  check_arg(rows <= kNoOpRow, "q_len", "got ", q_len, ": ", rows,
            " packed rows a request, a fixed-size plan holds at most ", kNoOpRow);
  return capacity_of_tiles(int64_t(batch_size) * ceil_div(rows, shape.tile_rows), shape);
}

PrefillPlanCapacity prefill_plan_capacity_for_tokens(int batch_size, int64_t num_tokens,
                                                     const PrefillTileShape& shape) {
  check_arg(batch_size >= 0, "batch_size", "got ", batch_size, ", expected >= 0");
  check_arg(num_tokens >= 0, "num_tokens", "got ", num_tokens, ", expected >= 0");
  check_capacity_shape(shape);
  check_arg(shape.cluster <= 1, "cluster", "got ", shape.cluster,
            ": a cluster-split plan needs the same query tokens every request");
  const int64_t group = shape.num_q_heads / shape.num_kv_heads;
  const int64_t rows = num_tokens * group;  // the most rows one request can have
  check_arg(rows <= kNoOpRow, "num_tokens", "got ", num_tokens, ": ", rows,
            " packed rows, a fixed-size plan holds at most ", kNoOpRow);
  // Each request with rows adds at most tile_rows - 1 rows of slack to its last tile.
  const int64_t with_rows = std::min<int64_t>(batch_size, num_tokens);
  const int64_t row_tiles = (rows + with_rows * (shape.tile_rows - 1)) / shape.tile_rows;
  return capacity_of_tiles(row_tiles, shape);
}

void pad_prefill_plan(PrefillTilePlan& plan, const PrefillPlanCapacity& capacity) {
  if (int64_t(plan.items.size()) > capacity.items ||
      int64_t(plan.merges.size()) > capacity.merges || plan.num_partials > capacity.partials) {
    throw_error(ErrorKind::kOutOfResources, "prefill plan", "has ", plan.items.size(), " items, ",
                plan.merges.size(), " merges and ", plan.num_partials,
                " partials; the fixed-size (CUDA-graph) plan holds ", capacity.items, ", ",
                capacity.merges, " and ", capacity.partials);
  }
  PrefillWorkItem no_op;
  no_op.q_row_begin = kNoOpRow;
  plan.items.resize(size_t(capacity.items), no_op);
  PrefillMergeItem no_merge;
  no_merge.q_row_begin = kNoOpRow;
  plan.merges.resize(size_t(capacity.merges), no_merge);
  plan.num_partials = capacity.partials;
}

}  // namespace kvattn::core
