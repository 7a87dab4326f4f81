#include "support/batch_invariance.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "kvattn/kvattn.h"

namespace kvattn::testing {
namespace {

constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kDim = 128;
constexpr int kCandidates = 12;  // neighbours a batch draws from
constexpr int kDraftTokens = 4;  // TARGET_VERIFY

struct Request {
  int row = 0;
  int prefix = 0;             // keys before this step's tokens
  int tokens = 1;             // this step's query tokens
  std::vector<uint16_t> q;    // [tokens, kQHeads, kDim] bf16
  std::vector<uint8_t> mask;  // TARGET_VERIFY: [tokens, prefix + tokens]
};

/// Device copies of host vectors, owned for the life of one batch.
struct Uploads {
  Device device;
  std::vector<Buffer> buffers;
  template <typename T>
  TensorView put(const std::vector<T>& host, DType dtype) {
    buffers.push_back(Buffer::allocate(device, std::max<size_t>(host.size() * sizeof(T), 16)));
    copy_bytes(buffers.back().data(), device, host.data(), Device::cpu(), host.size() * sizeof(T));
    return TensorView(buffers.back().data(), dtype, device, {int64_t(host.size())});
  }
};

uint16_t random_bf16(std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  return float_to_bf16(normal(rng));
}

}  // namespace

BatchInvarianceResult run_batch_invariance(BackendKind kind, ForwardMode mode, bool deterministic,
                                           int configurations, int threads, uint64_t seed) {
  const Device device = kind == BackendKind::kCuda ? Device::cuda(0) : Device::cpu();
  std::mt19937_64 rng(seed);
  const bool verify = mode == ForwardMode::kTargetVerify;
  const bool extend_like = mode == ForwardMode::kExtend || mode == ForwardMode::kMixed;

  // The probe (row 0) and the candidates: lengths, q, tree masks, drawn once.
  std::vector<Request> requests(1 + kCandidates);
  for (int i = 0; i <= kCandidates; ++i) {
    Request& r = requests[size_t(i)];
    r.row = i;
    r.prefix = i == 0 ? 3000 : int(rng() % 2200);
    r.tokens = verify                         ? kDraftTokens
               : mode == ForwardMode::kExtend ? (i == 0 ? 37 : 1 + int(rng() % 90))
               : mode == ForwardMode::kMixed ? (i == 0 ? 37 : (rng() % 2 ? 1 : 1 + int(rng() % 60)))
                                             : 1;
    if (mode == ForwardMode::kDecode) r.prefix += 1;  // DECODE: prefix counts the new token too
    r.q.resize(size_t(r.tokens) * kQHeads * kDim);
    for (auto& x : r.q) x = random_bf16(rng);
    if (verify) {
      const int cols = r.prefix + r.tokens;
      r.mask.assign(size_t(r.tokens) * cols, 0);
      std::vector<int> parent(size_t(r.tokens), -1);
      for (int t = 1; t < r.tokens; ++t) parent[size_t(t)] = int(rng() % size_t(t + 1)) - 1;
      for (int t = 0; t < r.tokens; ++t) {
        std::fill(r.mask.begin() + int64_t(t) * cols, r.mask.begin() + int64_t(t) * cols + r.prefix,
                  uint8_t(1));
        for (int a = t; a >= 0; a = parent[size_t(a)]) r.mask[size_t(t) * cols + r.prefix + a] = 1;
      }
    }
  }
  // Pool: every request's positions get their own shuffled slots (slot 0 reserved).
  int64_t positions = 0;
  int max_context = 0;
  for (const Request& r : requests) {
    const int len = mode == ForwardMode::kDecode ? r.prefix : r.prefix + r.tokens;
    positions += len;
    max_context = std::max(max_context, len);
  }
  const int64_t num_slots = positions + 1;
  std::vector<int32_t> slot_of(static_cast<size_t>(positions));
  std::iota(slot_of.begin(), slot_of.end(), 1);
  std::shuffle(slot_of.begin(), slot_of.end(), rng);

  KvCacheConfig cache_config;
  cache_config.num_layers = 1;
  cache_config.num_slots = num_slots;
  cache_config.num_kv_heads = kKvHeads;
  cache_config.head_dim = kDim;
  cache_config.page_size = 1;
  cache_config.dtype = DType::kBFloat16;
  cache_config.device = device;
  KvCache cache = KvCache::allocate(cache_config);
  {
    std::vector<uint16_t> values(size_t(num_slots) * kKvHeads * kDim);
    for (int which = 0; which < 2; ++which) {
      for (auto& x : values) x = random_bf16(rng);
      const TensorView& buffer = which == 0 ? cache.k_buffer(0) : cache.v_buffer(0);
      copy_bytes(buffer.data(), device, values.data(), Device::cpu(), values.size() * 2);
    }
  }
  ReqToTokenPool pool = ReqToTokenPool::allocate(1 + kCandidates, max_context, device);
  std::vector<std::vector<int32_t>> table(requests.size());
  {
    int64_t next = 0;
    for (const Request& r : requests) {
      const int len = mode == ForwardMode::kDecode ? r.prefix : r.prefix + r.tokens;
      table[size_t(r.row)].assign(slot_of.begin() + next, slot_of.begin() + next + len);
      pool.write(r.row, 0, table[size_t(r.row)]);
      next += len;
    }
  }

  BackendConfig config;
  config.kv_cache = &cache;
  config.req_to_token_pool = &pool;
  config.num_q_heads = kQHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.q_dtype = DType::kBFloat16;
  config.num_threads = threads;
  config.deterministic = deterministic;
  AttentionLayer layer;
  layer.num_q_heads = kQHeads;
  layer.num_kv_heads = kKvHeads;
  layer.head_dim = kDim;
  layer.scaling = float(1.0 / std::sqrt(double(kDim)));

  BatchInvarianceResult result;
  std::vector<uint16_t> alone;
  for (int c = 0; c < configurations; ++c) {
    // The batch: the probe alone first, then random neighbours around it.
    std::vector<int> members = {0};
    if (c > 0) {
      std::vector<int> others(kCandidates);
      std::iota(others.begin(), others.end(), 1);
      std::shuffle(others.begin(), others.end(), rng);
      const int count = c == 1 ? kCandidates : 1 + int(rng() % kCandidates);
      members.assign(others.begin(), others.begin() + count);
      members.insert(members.begin() + int(rng() % size_t(count + 1)), 0);
    }
    const int bs = int(members.size());
    std::vector<int32_t> rows, seq, prefix, extend, loc;
    std::vector<uint16_t> q;
    std::vector<uint8_t> mask;
    int64_t probe_row = 0;
    for (int m : members) {
      const Request& r = requests[size_t(m)];
      if (m == 0) probe_row = int64_t(q.size()) / (kQHeads * kDim);
      rows.push_back(r.row);
      seq.push_back(mode == ForwardMode::kDecode ? r.prefix
                    : verify                     ? r.prefix
                                                 : r.prefix + r.tokens);
      prefix.push_back(r.prefix);
      extend.push_back(r.tokens);
      const std::vector<int32_t>& t = table[size_t(r.row)];
      if (mode == ForwardMode::kDecode) {
        loc.push_back(t[size_t(r.prefix - 1)]);
      } else {
        loc.insert(loc.end(), t.begin() + r.prefix, t.begin() + r.prefix + r.tokens);
      }
      q.insert(q.end(), r.q.begin(), r.q.end());
      mask.insert(mask.end(), r.mask.begin(), r.mask.end());
    }
    const int64_t tokens = int64_t(q.size()) / (kQHeads * kDim);
    Uploads up{device, {}};
    ForwardBatch batch;
    batch.mode = mode;
    batch.batch_size = bs;
    batch.req_pool_indices = up.put(rows, DType::kInt32);
    batch.seq_lens = up.put(seq, DType::kInt32);
    batch.seq_lens_cpu = TensorView(seq.data(), DType::kInt32, Device::cpu(), {int64_t(bs)});
    if (extend_like) {
      batch.extend_prefix_lens = up.put(prefix, DType::kInt32);
      batch.extend_prefix_lens_cpu =
          TensorView(prefix.data(), DType::kInt32, Device::cpu(), {int64_t(bs)});
      batch.extend_seq_lens = up.put(extend, DType::kInt32);
      batch.extend_seq_lens_cpu =
          TensorView(extend.data(), DType::kInt32, Device::cpu(), {int64_t(bs)});
    }
    batch.out_cache_loc = up.put(loc, DType::kInt32);
    if (verify) {
      batch.spec.draft_token_num = kDraftTokens;
      batch.spec.custom_mask = up.put(mask, DType::kUInt8);
    }
    batch.req_to_token_pool = &pool;
    batch.kv_cache = &cache;
    const TensorView q_view = up.put(q, DType::kBFloat16).reshape({tokens, kQHeads, kDim});
    std::vector<uint16_t> out_host(size_t(tokens) * kQHeads * kDim, 0xffff);
    const TensorView out_view = up.put(out_host, DType::kBFloat16).reshape({tokens, kQHeads, kDim});

    std::unique_ptr<AttentionBackend> backend = make_backend(kind, config);
    backend->init_forward_metadata(batch);
    backend->forward(q_view, TensorView(), TensorView(), out_view, layer, batch,
                     /*save_kv_cache=*/false);
    // (copy_bytes waits for the default stream the backend ran on)
    copy_bytes(out_host.data(), Device::cpu(), out_view.data(), device, out_host.size() * 2);
    const int64_t row_elems = int64_t(kQHeads) * kDim;
    std::vector<uint16_t> probe(out_host.begin() + probe_row * row_elems,
                                out_host.begin() + (probe_row + requests[0].tokens) * row_elems);
    for (uint16_t bits : probe) result.finite = result.finite && std::isfinite(bf16_to_float(bits));
    ++result.batches;
    if (c == 0) {
      alone = probe;
      ++result.identical;
      continue;
    }
    if (probe == alone) {
      ++result.identical;
    } else if (result.first_diff.empty()) {
      size_t i = 0;
      while (probe[i] == alone[i]) ++i;
      result.first_diff = "batch " + std::to_string(c) + " (" + std::to_string(bs) +
                          " requests, probe at row " + std::to_string(probe_row) + "): element " +
                          std::to_string(i) + " " + std::to_string(bf16_to_float(probe[i])) +
                          " vs alone " + std::to_string(bf16_to_float(alone[i]));
    }
  }
  return result;
}

}  // namespace kvattn::testing
