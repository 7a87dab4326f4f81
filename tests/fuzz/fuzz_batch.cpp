// libFuzzer target over the host code that reads untrusted batches (issue 13): validation
// (core/validate), the batch layout (core/batch_layout), the decode and prefill planners and
// their buffer writers (core/planner, core/prefill_tiles), and the CPU backend end to end
// (init_forward_metadata, forward, the multi-step draft), on random ForwardBatch host data over
// small random pools. Built with clang, -fsanitize=fuzzer,address,undefined (tests/fuzz/README.md).
//
// What counts as a failure (the fuzzer reports a crash):
//   - any sanitizer report (out-of-bounds read or write, use after free, integer UB, ...);
//   - an exception that is not kvattn::Error (bad input must come back as the library's error);
//   - a call that throws kvattn::Error but changed the KV pool (SPEC §5: a refused call leaves
//     the pool as it was), or a planner result that breaks its own contract.
//
// Input format: a byte stream read front to back by Reader; values are mostly drawn inside the
// valid ranges (so random bytes reach deep code) with escape bytes that produce wild values
// (negative, huge, off by one). Missing bytes read as 0.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <span>
#include <vector>

#include "core/batch_layout.h"
#include "core/planner.h"
#include "core/prefill_tiles.h"
#include "core/validate.h"
#include "kvattn/kvattn.h"

namespace {

using namespace kvattn;

// KVATTN_FUZZ_STATS=1: how far inputs get (printed at exit), to judge the harness's reach.
struct Stats {
  uint64_t inputs = 0, backends = 0, planned = 0, forwards = 0, drafts = 0;
  ~Stats() {
    if (std::getenv("KVATTN_FUZZ_STATS") == nullptr) return;
    std::fprintf(stderr, "fuzz_batch: %llu inputs, %llu backends, %llu planned steps, %llu "
                 "forwards run, %llu draft steps run\n", (unsigned long long)inputs,
                 (unsigned long long)backends, (unsigned long long)planned,
                 (unsigned long long)forwards, (unsigned long long)drafts);
  }
} stats;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_batch: %s\n", what);
  std::abort();
}

/// Fuzzed values clamped for the harness's own arithmetic (the tensors keep the raw values).
int64_t sat(int64_t x) { return std::clamp<int64_t>(x, -(int64_t(1) << 30), int64_t(1) << 30); }

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool flag() { return (u8() & 1) != 0; }
  int64_t raw64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | u8();
    return int64_t(v);
  }
  /// Mostly in [0, limit]; escapes give negatives, limit + 1, huge and raw 64-bit values.
  int64_t value(int64_t limit) {
    const uint8_t b = u8();
    if (b < 232) return limit <= 0 ? 0 : int64_t(uint64_t(b) % (uint64_t(limit) + 1));
    switch (b) {
      case 232: return limit == INT64_MAX ? limit : limit + 1;
      case 233: return -1;
      case 234: return -int64_t(u8()) - 2;
      case 235: return int64_t(INT32_MAX);
      case 236: return int64_t(INT32_MIN);
      case 237: return int64_t(1) << 31;
      case 238: return INT64_MAX;
      case 239: return INT64_MIN;
      default: return raw64();
    }
  }
  size_t remaining() const { return pos_ < size_ ? size_ - pos_ : 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

/// Host tensors whose buffers are exactly their size (ASan sees any read past them).
class Arena {
 public:
  TensorView index(const std::vector<int64_t>& values, DType dtype) {
    const size_t elem = dtype == DType::kInt64 ? 8 : 4;
    std::vector<uint8_t>& bytes = buffers_.emplace_back(values.size() * elem);
    for (size_t i = 0; i < values.size(); ++i) {
      if (dtype == DType::kInt64) {
        std::memcpy(bytes.data() + i * 8, &values[i], 8);
      } else {
        const int32_t v = int32_t(values[i]);  // wraps: the value a buggy engine would send
        std::memcpy(bytes.data() + i * 4, &v, 4);
      }
    }
    return TensorView(bytes.empty() ? nullptr : bytes.data(), dtype, Device::cpu(),
                      {int64_t(values.size())});
  }
  TensorView tensor(DType dtype, std::initializer_list<int64_t> shape, uint8_t fill) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    std::vector<uint8_t>& bytes = buffers_.emplace_back(size_t(n) * dtype_size(dtype), fill);
    return TensorView(bytes.empty() ? nullptr : bytes.data(), dtype, Device::cpu(), shape);
  }

 private:
  std::vector<std::vector<uint8_t>> buffers_;
};

// FNV-1a of every layer's K and V.
uint64_t pool_hash(const KvCache& cache) {
  uint64_t h = 1469598103934665603ull;
  for (int l = 0; l < cache.num_layers(); ++l) {
    for (const TensorView* t : {&cache.k_buffer(l), &cache.v_buffer(l)}) {
      const auto* p = static_cast<const uint8_t*>(t->data());
      for (int64_t i = 0; i < t->nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
    }
  }
  return h;
}

// Runs `body`; kvattn::Error is an answer (returns false), anything else a failure.
template <typename Body>
bool attempt(Body&& body) {
  try {
    body();
    return true;
  } catch (const Error& e) {
    if (e.what()[0] == '\0') fail("kvattn::Error with an empty message");
    return false;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_batch: non-kvattn exception: %s\n", e.what());
    std::abort();
  }
}

DType pick(Reader& r, std::initializer_list<DType> options) {
  const size_t i = r.u8() % options.size();
  return *(options.begin() + i);
}

// ---- the planners directly, on lengths the backend would never hand them -------------------

void fuzz_planners(Reader& r) {
  const int batch = int(r.u8() % 9);
  std::vector<int32_t> kv_len(static_cast<size_t>(batch));
  std::vector<int32_t> qo_indptr(static_cast<size_t>(batch) + 1, 0);
  std::vector<int64_t> kv_indptr(static_cast<size_t>(batch) + 1, 0);
  for (int i = 0; i < batch; ++i) {
    kv_len[size_t(i)] = int32_t(r.value(4096));
    // Wrapped in 32 bits as a buggy engine's int32 arithmetic would (not C++ overflow here).
    const uint32_t q = uint32_t(r.value(64));
    qo_indptr[size_t(i) + 1] = int32_t(uint32_t(qo_indptr[size_t(i)]) + q);
    kv_indptr[size_t(i) + 1] = kv_indptr[size_t(i)] + kv_len[size_t(i)];
  }
  core::DecodePlanConfig dc;
  dc.ctas_per_item = int(r.value(16));
  dc.concurrent_ctas = int(r.value(600));
  dc.chunk_align = int(r.value(64));
  dc.min_chunk = int(r.value(512));
  dc.fixed_chunk = r.flag() ? int(r.value(256)) : 0;
  attempt([&] {
    const int capacity = core::decode_item_capacity(batch, dc);
    const core::DecodePlan plan = core::plan_decode(kv_len, dc, capacity);
    if (int64_t(plan.items.size()) > capacity) fail("plan_decode exceeded its item capacity");
    core::PagedLayout layout;
    layout.batch_size = batch;
    layout.qo_indptr = qo_indptr;
    layout.kv_start.assign(size_t(batch), 0);
    layout.kv_len = kv_len;
    layout.kv_indptr = kv_indptr;
    core::CallCapacity cap;
    cap.batch_size = batch;
    cap.decode_items = capacity;
    cap.num_q_heads = 4;
    cap.v_head_dim = 8;
    const core::CallMetadataLayout sized = core::write_call_metadata(cap, nullptr, nullptr, nullptr, 0);
    std::vector<uint8_t> host(sized.metadata_bytes);
    core::write_call_metadata(cap, &layout, &plan, host.data(), host.size());
    // The device planner's rule on the same lengths: within capacity, every key once.
    const core::DecodePlan rule = core::plan_decode_rule(kv_len, dc, capacity);
    if (int64_t(rule.items.size()) > capacity) fail("plan_decode_rule exceeded its item capacity");
    std::vector<int64_t> covered(size_t(batch), 0);
    for (const core::DecodeWorkItem& item : rule.items) {
      if (item.request < 0 || item.request >= batch || item.kv_begin > item.kv_end) {
        fail("plan_decode_rule made a bad item");
      }
      covered[size_t(item.request)] += int64_t(item.kv_end) - item.kv_begin;
    }
    for (int i = 0; i < batch; ++i) {
      if (covered[size_t(i)] != kv_len[size_t(i)]) fail("plan_decode_rule lost or repeated keys");
    }
    core::write_call_metadata(cap, &layout, &rule, host.data(), host.size());
  });
  core::PrefillTileShape shape;
  shape.num_kv_heads = int(r.value(4));
  shape.num_q_heads = int(uint32_t(shape.num_kv_heads) * uint32_t(r.value(4)));
  shape.tile_rows = int(r.value(128));
  shape.kv_tile = int(r.value(64));
  shape.mask = core::MaskMode(r.u8() % 3);
  shape.window_left = int(std::max<int64_t>(std::clamp<int64_t>(r.value(64), INT32_MIN, INT32_MAX) - 1, INT32_MIN));
  shape.concurrent_ctas = int(r.value(300));
  shape.cluster = r.flag() ? int(r.value(20)) : 0;  // the decode-shaped kernel's cluster split
  // The work is proportional to the tiles; the backend's are bounded by the tokens it holds in
  // memory (and its tile_rows is the kernel's 64 or 128): keep this call's to what a step has.
  double tiles = 0;  // an estimate, in double: the fuzzed values may be anything
  for (int i = 0; i < batch; ++i) {
    const double rows = (double(qo_indptr[size_t(i) + 1]) - qo_indptr[size_t(i)]) *
                        std::max(1, shape.num_kv_heads > 0 ? shape.num_q_heads / shape.num_kv_heads : 1);
    tiles += std::ceil(std::max(rows, 0.0) / std::max(shape.tile_rows, 1)) *
             std::max(shape.num_kv_heads, 1);
  }
  if (tiles > (1 << 16)) return;
  attempt([&] {
    core::PrefillTilePlan plan = core::plan_prefill_tiles(qo_indptr, kv_indptr, shape);
    const core::PrefillBufferLayout sized = core::write_prefill_buffer(plan, 8, nullptr, 0, nullptr, nullptr);
    std::vector<uint8_t> host(sized.metadata_bytes);
    core::write_prefill_buffer(plan, 8, host.data(), host.size(), nullptr, nullptr);
    int64_t max_q = 0;
    for (int i = 0; i < batch; ++i) {
      max_q = std::max(max_q, int64_t(qo_indptr[size_t(i) + 1]) - qo_indptr[size_t(i)]);
    }
    max_q = std::min<int64_t>(max_q, INT32_MAX);
    const core::PrefillPlanCapacity capacity = core::prefill_plan_capacity(batch, int(max_q), shape);
    const core::PrefillBufferLayout by_counts = core::prefill_buffer_layout(
        capacity.items, capacity.merges, capacity.partials, shape.tile_rows, 8);
    // The backend pads only to capacities whose buffers init_cuda_graph_state sized (by
    // prefill_buffer_layout) and allocated, so a padded plan always fits memory there.
    if (capacity.items > (1 << 20)) return;
    core::pad_prefill_plan(plan, capacity);
    const core::PrefillBufferLayout padded =
        core::write_prefill_buffer(plan, 8, nullptr, 0, nullptr, nullptr);
    if (padded.total_bytes != by_counts.total_bytes) {
      fail("prefill_buffer_layout disagrees with write_prefill_buffer on a padded plan");
    }
  });
}

// ---- a batch against the CPU backend ------------------------------------------------------------

void fuzz_backend(Reader& r) {
  // The model and the pools.
  const int page_size = 1 << (r.u8() % 4);
  const int num_kv_heads = 1 + r.u8() % 2;
  const int num_q_heads = num_kv_heads * (1 + r.u8() % 3);
  const int head_dim = r.flag() ? 16 : 8;
  const bool window_model = r.flag();
  const bool encoder_decoder = r.flag();
  const DType q_dtype = pick(r, {DType::kBFloat16, DType::kFloat32, DType::kFloat16});
  const DType kv_dtype =
      pick(r, {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2});
  const DType index_dtype = r.flag() ? DType::kInt64 : DType::kInt32;
  KvCacheConfig kc;
  kc.num_layers = 2;
  kc.num_slots = int64_t(page_size) * (2 + r.u8() % 16);
  kc.num_kv_heads = num_kv_heads;
  kc.head_dim = head_dim;
  kc.page_size = page_size;
  kc.dtype = kv_dtype;
  std::optional<KvCache> cache;
  if (!attempt([&] { cache.emplace(KvCache::allocate(kc)); })) return;
  for (int l = 0; l < kc.num_layers; ++l) {  // small nonzero values in every slot
    for (const TensorView* t : {&cache->k_buffer(l), &cache->v_buffer(l)}) {
      std::memset(t->data(), kv_dtype == DType::kFloat8E4M3 || kv_dtype == DType::kFloat8E5M2 ? 0x30 : 0x3c,
                  size_t(t->nbytes()));
    }
  }
  const int max_reqs = 1 + r.u8() % 6;
  const int max_context = 1 + r.u8() % 48;
  const int64_t num_slots = kc.num_slots;
  ReqToTokenPool pool = ReqToTokenPool::allocate(max_reqs, max_context, Device::cpu());
  {
    std::vector<int32_t> row(static_cast<size_t>(max_context));
    for (int req = 0; req < max_reqs; ++req) {
      for (int i = 0; i < max_context; ++i) row[size_t(i)] = int32_t(r.value(num_slots - 1));
      pool.write(req, 0, row);
    }
  }

  BackendConfig config;
  config.kv_cache = &*cache;
  config.req_to_token_pool = &pool;
  config.num_q_heads = num_q_heads;
  config.num_kv_heads = num_kv_heads;
  config.head_dim = head_dim;
  config.q_dtype = q_dtype;
  config.sliding_window_size = window_model ? int(r.value(8)) : -1;
  config.is_encoder_decoder = encoder_decoder;
  config.ragged_extend_threshold = r.value(64);
  config.num_threads = 1;

  // The batch.
  Arena arena;
  ForwardBatch b;
  b.mode = ForwardMode(r.u8() % 6);
  const uint8_t bs_byte = r.u8();
  b.batch_size = bs_byte < 250 ? bs_byte % 6 : int(int32_t(r.raw64()));
  const int n = std::clamp(b.batch_size, 0, 6);
  auto length = [&](int64_t wanted) { return r.u8() < 245 ? wanted : r.value(8); };
  auto index_tensor = [&](int64_t len, int64_t limit) {
    std::vector<int64_t> values(size_t(std::clamp<int64_t>(len, 0, 64)));
    for (int64_t& v : values) v = r.value(limit);
    return arena.index(values, index_dtype);
  };
  const size_t count = static_cast<size_t>(n);
  std::vector<int64_t> seq(count), prefix(count), encoder(count);
  for (int i = 0; i < n; ++i) {
    encoder[size_t(i)] = encoder_decoder ? r.value(max_context / 3) : 0;
    seq[size_t(i)] = r.value(max_context - sat(encoder[size_t(i)]));
    prefix[size_t(i)] = r.value(seq[size_t(i)]);
  }
  std::vector<int64_t> extend(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    extend[size_t(i)] = r.u8() < 245 ? sat(seq[size_t(i)]) - sat(prefix[size_t(i)]) : r.value(8);
  }
  b.req_pool_indices = index_tensor(length(n), max_reqs - 1);
  auto lengths_tensor = [&](const std::vector<int64_t>& values) {
    std::vector<int64_t> v = values;
    v.resize(size_t(std::clamp<int64_t>(length(n), 0, 64)), 3);
    return arena.index(v, index_dtype);
  };
  b.seq_lens = lengths_tensor(seq);
  if (r.flag()) b.seq_lens_cpu = lengths_tensor(seq);
  b.extend_prefix_lens = lengths_tensor(prefix);
  if (r.flag()) b.extend_prefix_lens_cpu = lengths_tensor(prefix);
  if (r.flag()) b.extend_seq_lens = lengths_tensor(extend);
  if (encoder_decoder) b.encoder_lens = lengths_tensor(encoder);
  b.seq_lens_sum = r.flag() ? -1 : r.value(512);
  b.spec.draft_token_num = int(r.value(4));
  int64_t tokens = 0;
  attempt([&] { tokens = b.num_tokens(); });
  tokens = std::clamp<int64_t>(tokens, 0, 512);
  b.out_cache_loc = index_tensor(length(tokens), num_slots - 1);
  int64_t encoder_tokens = 0;
  for (int64_t e : encoder) encoder_tokens += std::max<int64_t>(sat(e), 0);
  if (encoder_decoder && r.flag()) {
    b.encoder_out_cache_loc = index_tensor(length(encoder_tokens), num_slots - 1);
  }
  if (b.mode == ForwardMode::kTargetVerify) {
    int64_t mask = 0;
    for (int i = 0; i < n; ++i) {
      mask = sat(mask + sat(int64_t(b.spec.draft_token_num)) *
                            sat(sat(seq[size_t(i)]) + b.spec.draft_token_num));
    }
    mask = std::clamp<int64_t>(length(mask), 0, 1 << 14);
    b.spec.custom_mask = arena.tensor(DType::kUInt8, {mask}, r.u8() & 1);
    if (r.flag()) b.positions = index_tensor(length(tokens), max_context);
  }
  b.req_to_token_pool = &pool;
  b.kv_cache = &*cache;

  // The layer and the inputs.
  AttentionLayer layer;
  layer.layer_id = int(r.value(1));
  layer.num_q_heads = num_q_heads;
  layer.num_kv_heads = num_kv_heads;
  layer.head_dim = head_dim;
  layer.scaling = r.flag() ? 0.25f : float(r.value(2));
  layer.logit_cap = r.flag() ? 0.f : 5.f;
  layer.sliding_window_size = window_model && r.flag() ? config.sliding_window_size : -1;
  layer.is_cross_attention = encoder_decoder && r.flag();
  const int64_t rows = std::clamp<int64_t>(length(tokens), 0, 512);
  const int64_t kv_rows = layer.is_cross_attention ? std::min<int64_t>(encoder_tokens, 512) : rows;
  const TensorView q = arena.tensor(q_dtype, {rows, num_q_heads, head_dim}, 0x3c);
  const TensorView k = arena.tensor(q_dtype, {kv_rows, num_kv_heads, head_dim}, 0x3d);
  const TensorView v = arena.tensor(q_dtype, {kv_rows, num_kv_heads, head_dim}, 0x3b);
  const TensorView out = arena.tensor(q_dtype, {rows, int64_t(num_q_heads) * head_dim}, 0);
  const bool save = r.u8() < 230;  // mostly saving, as engines do

  // The host code of the step on its own...
  attempt([&] {
    core::validate_batch(b, config, Device::cpu());
    const core::HostLengths lens = core::read_host_lengths(b, encoder_decoder);
    for (core::IndexSet set : {core::IndexSet::kFull, core::IndexSet::kWindow,
                               core::IndexSet::kDecoderSelf, core::IndexSet::kEncoder}) {
      attempt([&] {
        core::make_paged_layout(b.mode, set, config.sliding_window_size, lens,
                                b.spec.draft_token_num, r.flag());
      });
    }
    attempt([&] { core::make_ragged_layout(lens); });
  });

  // ... and through the backend: a refused call must leave the pool as it was.
  std::unique_ptr<AttentionBackend> backend;
  if (!attempt([&] { backend = make_backend(BackendKind::kCpu, config); })) return;
  ++stats.backends;
  const uint64_t before = pool_hash(*cache);
  const bool planned = attempt([&] { backend->init_forward_metadata(b); });
  if (!planned) {
    if (pool_hash(*cache) != before) fail("a refused init_forward_metadata changed the KV pool");
    return;
  }
  ++stats.planned;
  for (int call = 0; call < 2; ++call) {
    const uint64_t start = pool_hash(*cache);
    const bool ran = attempt([&] { backend->forward(q, k, v, out, layer, b, save); });
    if (!ran && pool_hash(*cache) != start) fail("a refused forward changed the KV pool");
    stats.forwards += ran;
  }
  attempt([&] { backend->check_errors(); });

  // The multi-step draft over the same pools (DECODE batches).
  if (b.mode == ForwardMode::kDecode && r.flag()) {
    const int topk = 1 + r.u8() % 2;
    const int steps = 1 + r.u8() % 2;
    std::optional<MultiStepDraftBackend> draft;
    if (!attempt([&] { draft.emplace(BackendKind::kCpu, config, topk, steps); })) return;
    const uint64_t start = pool_hash(*cache);
    if (!attempt([&] { draft->init_forward_metadata(b); })) {
      if (pool_hash(*cache) != start) fail("a refused draft init_forward_metadata changed the pool");
      return;
    }
    const int64_t entries = std::clamp<int64_t>(int64_t(n) * topk, 0, 64);
    const TensorView dq = arena.tensor(q_dtype, {entries, num_q_heads, head_dim}, 0x3c);
    const TensorView dk = arena.tensor(q_dtype, {entries, num_kv_heads, head_dim}, 0x3d);
    const TensorView dout = arena.tensor(q_dtype, {entries, int64_t(num_q_heads) * head_dim}, 0);
    for (int s = 0; s < steps; ++s) {
      const TensorView loc = index_tensor(length(entries), num_slots - 1);
      const uint64_t at = pool_hash(*cache);
      AttentionLayer draft_layer = layer;
      draft_layer.is_cross_attention = false;
      const bool ran = attempt([&] { draft->forward_step(s, dq, dk, dk, dout, draft_layer, loc); });
      if (!ran && pool_hash(*cache) != at) fail("a refused draft forward_step changed the KV pool");
      stats.drafts += ran;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r(data, size);
  ++stats.inputs;
  if (r.u8() & 1) fuzz_planners(r);
  fuzz_backend(r);
  return 0;
}
