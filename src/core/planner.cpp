#include "core/planner.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <queue>
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

void check_config(const DecodePlanConfig& config) {
  check_arg(config.ctas_per_item >= 1, "ctas_per_item", "got ", config.ctas_per_item,
            ", expected >= 1");
  check_arg(config.concurrent_ctas >= 0, "concurrent_ctas", "got ", config.concurrent_ctas,
            ", expected >= 0");
  check_arg(config.chunk_align >= 1, "chunk_align", "got ", config.chunk_align, ", expected >= 1");
  check_arg(config.min_chunk >= 1, "min_chunk", "got ", config.min_chunk, ", expected >= 1");
}

int32_t check_lengths(std::span<const int32_t> kv_len) {
  int32_t max_len = 0;
  for (size_t r = 0; r < kv_len.size(); ++r) {
    check_arg(kv_len[r] >= 0, "kv_len[" + std::to_string(r) + "]", "got ", kv_len[r],
              ", expected >= 0");
    max_len = std::max(max_len, kv_len[r]);
  }
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
  return int(std::max<int64_t>(1, batch_size + extra));
}

double estimate_decode_makespan(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                                int chunk) {
  check_config(config);
  check_arg(chunk >= 1, "chunk", "got ", chunk, ", expected >= 1");
  // Item costs (each item stands for ctas_per_item identical CTAs), heaviest first.
  std::vector<double> costs;
  costs.reserve(kv_len.size());
  for (int32_t len : kv_len) {
    const int64_t pieces = std::max<int64_t>(1, ceil_div(len, chunk));
    const double extra =
        config.cta_overhead_tokens + (pieces > 1 ? config.merge_overhead_tokens : 0);
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t begin = p * chunk;
      const int64_t end = std::min<int64_t>(len, begin + chunk);
      costs.push_back(double(end - begin) + extra);
    }
  }
  if (costs.empty()) return 0;
  std::sort(costs.begin(), costs.end(), std::greater<>());
  if (config.concurrent_ctas == 0) return costs.front();
  // Greedy LPT: each CTA goes to the slot that frees up first (what the block dispatcher does).
  const int64_t total_ctas = int64_t(costs.size()) * config.ctas_per_item;
  const int64_t slots = std::min<int64_t>(config.concurrent_ctas, total_ctas);
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

DecodePlan plan_decode(std::span<const int32_t> kv_len, const DecodePlanConfig& config,
                       int item_capacity) {
  check_config(config);
  const int32_t max_len = check_lengths(kv_len);
  const int batch_size = int(kv_len.size());
  check_arg(item_capacity >= batch_size, "item_capacity", "got ", item_capacity,
            ", expected >= batch_size ", batch_size);

  // ---- choose the chunk ---------------------------------------------------------------------
  int64_t best_chunk = std::max<int32_t>(max_len, 1);
  double best_cost = estimate_decode_makespan(kv_len, config, int(best_chunk));
  if (config.concurrent_ctas > 0 && max_len > config.min_chunk) {
    double total = 0;
    for (int32_t len : kv_len) total += double(len) + config.cta_overhead_tokens;
    const double lower_bound = total * config.ctas_per_item / config.concurrent_ctas;
    int64_t last_chunk = best_chunk;
    for (int k : kSplitCandidates) {
      if (k == 1) continue;
      if (best_cost <= lower_bound * 1.03) break;  // already within 3% of a perfect spread
      const int64_t chunk = round_up(ceil_div(max_len, k), config.chunk_align);
      if (chunk < config.min_chunk) break;
      if (chunk >= last_chunk) continue;  // rounding made it a repeat
      last_chunk = chunk;
      if (items_for_chunk(kv_len, chunk) > item_capacity) break;  // grows with k
      const double cost = estimate_decode_makespan(kv_len, config, int(chunk));
      if (cost < best_cost * kRequiredGain) {
        best_cost = cost;
        best_chunk = chunk;
      }
    }
  }

  // ---- emit the items --------------------------------------------------------------------------
  DecodePlan plan;
  plan.chunk = int(best_chunk);
  plan.estimated_cost = best_cost;
  plan.merge_indptr.assign(size_t(batch_size) + 1, 0);
  struct Keyed {
    DecodeWorkItem item;
    int64_t cost;
  };
  std::vector<Keyed> keyed;
  keyed.reserve(size_t(items_for_chunk(kv_len, best_chunk)));
  for (int r = 0; r < batch_size; ++r) {
    const int64_t len = kv_len[r];
    const int64_t pieces = std::max<int64_t>(1, ceil_div(len, best_chunk));
    plan.merge_indptr[r + 1] = plan.merge_indptr[r] + (pieces > 1 ? int32_t(pieces) : 0);
    for (int64_t p = 0; p < pieces; ++p) {
      DecodeWorkItem item;
      item.request = r;
      item.kv_begin = int32_t(p * best_chunk);
      item.kv_end = int32_t(std::min<int64_t>(len, (p + 1) * best_chunk));
      item.partial = pieces > 1 ? plan.merge_indptr[r] + int32_t(p) : -1;
      keyed.push_back({item, int64_t(item.kv_end) - item.kv_begin});
    }
  }
  plan.num_partials = plan.merge_indptr.back();
  // Heaviest first; stable, so equal items keep request order (neighbouring requests' CTAs
  // start together, which keeps the dispatch order reproducible).
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const Keyed& a, const Keyed& b) { return a.cost > b.cost; });
  plan.items.reserve(keyed.size());
  for (const Keyed& k : keyed) plan.items.push_back(k.item);
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
  out.qo_indptr = meta.take((bs + 1) * sizeof(int32_t));
  out.kv_indptr = meta.take((bs + 1) * sizeof(int64_t));
  out.kv_start = meta.take(bs * sizeof(int32_t));
  out.kv_len = meta.take(bs * sizeof(int32_t));
  out.mask_indptr = capacity.custom_mask ? meta.take((bs + 1) * sizeof(int64_t)) : 0;
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
  if (capacity.custom_mask) write_array(host, out.mask_indptr, layout->mask_indptr);
  if (plan != nullptr) {
    check_arg(capacity.decode_items > 0, "plan", "given, but the buffer has no decode plan");
    check_arg(int64_t(plan->items.size()) <= capacity.decode_items, "plan", "has ",
              plan->items.size(), " items, the buffer holds ", capacity.decode_items);
    check_arg(plan->merge_indptr.size() == size_t(layout->batch_size) + 1, "plan",
              "merge_indptr has ", plan->merge_indptr.size(), " entries, expected ",
              layout->batch_size + 1);
    write_array(host, out.decode_items, plan->items);
    write_array(host, out.merge_indptr, plan->merge_indptr);
    const int32_t n = int32_t(plan->items.size());
    std::memcpy(static_cast<char*>(host) + out.num_items, &n, sizeof(n));
  }
  return out;
}

}  // namespace kvattn::core
