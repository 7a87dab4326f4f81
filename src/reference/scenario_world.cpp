// ScenarioWorld::build: a random world for one scenario.
//
// Layout of a request's req_to_token row: encoder tokens first (encoder-decoder models), then the
// decoder tokens; TARGET_VERIFY's tree tokens and the multi-step draft tokens follow the
// committed prefix. Slots come from a SlotAllocator whose free list was shuffled, requests
// allocate in interleaved chunks, and some pages stay with nobody: every slot no request owns
// holds NaN, and so does every slot this step saves into, until the backend writes it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>

#include "kvattn/error.h"
#include "reference/float_format.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

bool is_extend_like(ForwardMode mode) {
  return mode == ForwardMode::kExtend || mode == ForwardMode::kMixed ||
         mode == ForwardMode::kDraftExtend;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  /// Uniform in [lo, hi]; lo when the range is empty.
  int uniform(int lo, int hi) {
    if (hi <= lo) return lo;
    return std::uniform_int_distribution<int>(lo, hi)(engine_);
  }
  bool coin() { return (engine_() >> 17) & 1; }
  /// Symmetric around 0 with unit variance (sum of two uniforms), never within 0.05 of zero:
  /// a zero input would hide a missing term. Cheap: worlds draw millions of these.
  double value() {
    const uint64_t bits = engine_();
    const double u1 = double(bits & 0xffffffu) * 0x1p-24;
    const double u2 = double((bits >> 24) & 0xffffffu) * 0x1p-24;
    const double x = (u1 + u2 - 1.0) * 2.449489742783178;  // sqrt(6): unit variance
    return std::fabs(x) < 0.05 ? std::copysign(0.05 + std::fabs(x), x) : x;
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
};

struct Request {
  int row = 0;          // req_to_token row
  int32_t seq = 0;      // ForwardBatch seq_lens
  int32_t prefix = 0;   // EXTEND-like
  int32_t extend = 0;   // EXTEND-like
  int32_t encoder = 0;  // encoder-decoder models
  int64_t footprint = 0;       // req_to_token positions in use (encoder + decoder)
  std::vector<int32_t> slots;  // [footprint]
  std::vector<int> tree_parent;  // TARGET_VERIFY: parent of each tree token (-1: the prefix)
};

// One query token of a call and where its own K/V go (decoder position; -1: a padded entry).
struct TokenPlan {
  int request = 0;
  int64_t decoder_position = -1;
};

void draw_lengths(const ScenarioSpec& s, Rng& rng, std::vector<Request>& reqs) {
  const int bs = int(reqs.size());
  const bool multi_step = s.topk > 0;
  for (int r = 0; r < bs; ++r) {
    Request& q = reqs[size_t(r)];
    q.seq = rng.uniform(s.min_kv_len, s.max_kv_len);
    switch (s.mode) {
      case ForwardMode::kDecode:
        if (s.allow_tiny && r == 0) q.seq = 1;
        // A padded entry (CUDA-graph style): seq_len 0, saves into slot 0, sees nothing.
        if (s.allow_tiny && r == 1 && bs >= 3 && !multi_step) q.seq = 0;
        break;
      case ForwardMode::kTargetVerify:
        if (s.allow_tiny && r == 0) q.seq = 1;
        if (s.allow_tiny && r == 1 && bs >= 3) q.seq = 0;
        break;
      case ForwardMode::kExtend:
      case ForwardMode::kMixed:
      case ForwardMode::kDraftExtend: {
        const bool decode_request =
            s.mode == ForwardMode::kMixed && (r == 0 || (r > 1 && rng.coin()));
        if (decode_request) {
          q.seq = std::max(q.seq, 1);
          q.extend = 1;
        } else if (s.allow_tiny && r == (s.mode == ForwardMode::kMixed ? 1 : 0)) {
          q.seq = std::min(q.seq, s.max_q_len);  // no prefix at all
          q.extend = q.seq;
        } else if (s.allow_tiny && r == 2) {
          q.seq = 1;  // kv_len 1
          q.extend = 1;
        } else if (s.allow_tiny && r == 3) {
          q.seq = std::max(q.seq, 1);  // a one-token extend after a prefix
          q.extend = 1;
        } else {
          q.extend = rng.uniform(std::min(s.min_q_len, q.seq), std::min(s.max_q_len, q.seq));
        }
        q.prefix = q.seq - q.extend;
        break;
      }
      case ForwardMode::kIdle:
        break;
    }
    if (s.cross_attention) {
      q.encoder = rng.uniform(1, std::max(1, s.max_kv_len / 2));
      if (s.allow_tiny && bs >= 2 && r == bs - 1) q.encoder = 0;
      if (s.allow_tiny && bs >= 4 && r == bs - 2) q.encoder = 1;
    }
    int64_t decoder = q.seq;
    if (s.mode == ForwardMode::kTargetVerify) decoder += s.draft_token_num;
    if (multi_step) decoder += int64_t(s.num_steps) * s.topk;
    q.footprint = q.encoder + decoder;
  }
}

// Slots for every request: shuffled free list, interleaved chunks, decoy pages nobody owns.
// Returns the allocator's pool size in slots and a slot that no request owns (the "trap").
void allocate_slots(const ScenarioSpec& s, Rng& rng, std::vector<Request>& reqs,
                    int64_t* num_slots, int32_t* trap_slot) {
  const int page = s.page_size;
  int64_t pages_needed = 0;
  for (const Request& q : reqs) pages_needed += (q.footprint + page - 1) / page;
  const int64_t decoys = s.shuffled_slots ? pages_needed / 2 + 2 : 1;
  const int64_t num_pages = 1 + pages_needed + decoys + 1;
  *num_slots = num_pages * page;
  SlotAllocator allocator(*num_slots, page);
  std::vector<int32_t> kept;
  if (s.shuffled_slots) {
    std::vector<int32_t> all = allocator.allocate_pages(num_pages - 1);
    std::shuffle(all.begin(), all.end(), rng.engine());
    kept.assign(all.begin(), all.begin() + decoys);
    std::vector<int32_t> rest(all.begin() + decoys, all.end());
    allocator.free_pages(rest);
    std::vector<int> pending;
    for (size_t r = 0; r < reqs.size(); ++r)
      if (reqs[r].footprint > 0) pending.push_back(int(r));
    while (!pending.empty()) {
      const int pick = rng.uniform(0, int(pending.size()) - 1);
      Request& q = reqs[size_t(pending[size_t(pick)])];
      const int64_t have = int64_t(q.slots.size());
      const int64_t chunk = std::min<int64_t>(q.footprint - have, rng.uniform(1, 2 * page + 1));
      const int32_t last = have > 0 ? q.slots.back() : 0;
      const std::vector<int32_t> got = allocator.allocate_tokens(have, last, chunk);
      q.slots.insert(q.slots.end(), got.begin(), got.end());
      if (int64_t(q.slots.size()) == q.footprint) pending.erase(pending.begin() + pick);
    }
  } else {
    for (Request& q : reqs) q.slots = allocator.allocate_tokens(0, 0, q.footprint);
    kept = allocator.allocate_pages(1);
  }
  *trap_slot = kept.front() * page + (page - 1);
}

// Fills a host image of `count` elements of `dtype` with the format's NaN.
void fill_nan(std::vector<uint8_t>& image, DType dtype, int64_t count) {
  const int elem = dtype_size(dtype);
  image.assign(size_t(count) * elem, 0);
  std::vector<uint8_t> nan(static_cast<size_t>(elem));
  encode_element(nan.data(), dtype, 0, std::numeric_limits<double>::quiet_NaN());
  for (int64_t i = 0; i < count; ++i) std::memcpy(image.data() + i * elem, nan.data(), elem);
}

// Stores `x` into a KV image: fp8 holds x / scale.
void store_kv(std::vector<uint8_t>& image, DType dtype, int64_t index, double x, double scale) {
  encode_element(image.data(), dtype, index, is_fp8_dtype(dtype) ? x / scale : x);
}

// Random io-dtype values: writes `count` encoded elements into `bytes` (at element offsets
// row * row_stride + i for rows of row_len) and returns the exact values, row-major.
std::vector<double> random_io_rows(Rng& rng, DType dtype, int64_t rows, int64_t row_len,
                                   int64_t row_stride, double gain, std::vector<uint8_t>& bytes) {
  bytes.assign(size_t(rows * row_stride) * dtype_size(dtype), 0);
  std::vector<double> values(static_cast<size_t>(rows * row_len));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < row_stride; ++i) {
      const int64_t index = r * row_stride + i;
      encode_element(bytes.data(), dtype, index, rng.value() * gain);
      if (i < row_len) values[size_t(r * row_len + i)] = decode_element(bytes.data(), dtype, index);
    }
  }
  return values;
}

}  // namespace

// ---- ScenarioWorld helpers -----------------------------------------------------------------

TensorView ScenarioWorld::upload(DType dtype, std::initializer_list<int64_t> shape,
                                 const void* bytes, Device where) {
  int64_t count = 1;
  for (int64_t s : shape) count *= s;
  const size_t nbytes = size_t(count) * dtype_size(dtype);
  Buffer buffer = Buffer::allocate(where, nbytes);
  copy_bytes(buffer.data(), where, bytes, Device::cpu(), nbytes);
  TensorView view = buffer.view(dtype, shape);
  buffers_.push_back(std::move(buffer));
  return view;
}

TensorView ScenarioWorld::index_tensor(const std::vector<int64_t>& values, DType dtype,
                                       Device where) {
  std::vector<uint8_t> bytes(values.size() * dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == DType::kInt64) {
      std::memcpy(bytes.data() + i * 8, &values[i], 8);
    } else {
      const int32_t v = int32_t(values[i]);
      std::memcpy(bytes.data() + i * 4, &v, 4);
    }
  }
  return upload(dtype, {int64_t(values.size())}, bytes.data(), where);
}

std::vector<uint8_t> ScenarioWorld::download(const TensorView& t) {
  std::vector<uint8_t> bytes(static_cast<size_t>(t.nbytes()));
  copy_bytes(bytes.data(), Device::cpu(), t.data(), t.device(), bytes.size());
  return bytes;
}

std::vector<uint8_t> ScenarioWorld::pool_bytes(int layer_id, int which) const {
  return download(which == 0 ? kv_cache->k_buffer(layer_id) : kv_cache->v_buffer(layer_id));
}

bool ScenarioWorld::pool_unchanged() const {
  for (int l = 0; l < kv_cache->num_layers(); ++l)
    for (int which = 0; which < 2; ++which)
      if (pool_bytes(l, which) != pool_bytes_before[size_t(l)][size_t(which)]) return false;
  return true;
}

// ---- build ------------------------------------------------------------------------------------

std::unique_ptr<ScenarioWorld> ScenarioWorld::build(const ScenarioSpec& s, BackendKind kind) {
  std::unique_ptr<ScenarioWorld> world(new ScenarioWorld());
  ScenarioWorld& w = *world;
  w.spec = s;
  w.kind = kind;
  w.device = kind == BackendKind::kCuda ? Device::cuda(0) : Device::cpu();
  Rng rng(s.seed);

  const int hq = s.num_q_heads;
  const int hkv = s.num_kv_heads;
  const int dim = s.head_dim;
  const int v_dim = s.v_head_dim > 0 ? s.v_head_dim : s.head_dim;
  const DType io = s.q_dtype;
  const DType kv_dtype = s.kv_dtype;
  const bool multi_step = s.topk > 0;
  const bool cross_model = s.cross_attention;
  const bool cross_layer = cross_model && s.cross_layer;
  const bool verify = s.mode == ForwardMode::kTargetVerify;
  const bool idle = s.mode == ForwardMode::kIdle;
  w.multi_step = multi_step;
  if (multi_step && s.mode != ForwardMode::kDecode)
    throw std::invalid_argument("scenario: multi-step draft runs DECODE batches");
  if (cross_model && (multi_step || verify))
    throw std::invalid_argument("scenario: cross-attention with speculative modes");

  // ---- requests, slots, req_to_token -------------------------------------------------------
  const int bs = idle ? 0 : s.batch_size;
  std::vector<Request> reqs(static_cast<size_t>(bs));
  draw_lengths(s, rng, reqs);
  int64_t num_slots = 0;
  int32_t trap_slot = 0;
  allocate_slots(s, rng, reqs, &num_slots, &trap_slot);
  if (s.shared_prefix > 0) {
    // A shared prefix: the longest request's first slots serve every request long enough (the
    // slots those requests had become slots nobody owns: NaN in the pool).
    size_t lead = 0;
    for (size_t r = 1; r < reqs.size(); ++r) {
      if (reqs[r].footprint > reqs[lead].footprint) lead = r;
    }
    const int64_t n = s.shared_prefix;
    for (size_t r = 0; r < reqs.size() && reqs[lead].footprint > n; ++r) {
      if (r == lead || reqs[r].footprint <= n || reqs[r].encoder > 0) continue;
      std::copy(reqs[lead].slots.begin(), reqs[lead].slots.begin() + n, reqs[r].slots.begin());
    }
  }

  // Declared shared-prefix groups: members drawn at random, each group sharing its first
  // member's leading slots (the members' own slots there become slots nobody owns: NaN).
  std::vector<int64_t> group_of(static_cast<size_t>(bs), -1);
  std::vector<int64_t> group_lens;
  if (s.declared_groups > 0) {
    std::vector<int> eligible;  // a member keeps >= 1 own key past the shared ones
    for (int r = 0; r < bs; ++r) {
      if (reqs[size_t(r)].encoder == 0 && reqs[size_t(r)].seq >= (verify ? 1 : 2))
        eligible.push_back(r);
    }
    std::shuffle(eligible.begin(), eligible.end(), rng.engine());
    // About a quarter stay out of every group; each group gets >= 2 members.
    const int grouped = int(eligible.size()) - int(eligible.size()) / 4;
    const int groups = std::min(s.declared_groups, grouped / 2);
    std::vector<std::vector<int>> members(static_cast<size_t>(std::max(groups, 0)));
    for (int i = 0; i < groups * (grouped / std::max(groups, 1)); ++i)
      members[size_t(i % groups)].push_back(eligible[size_t(i)]);
    for (int g = 0; g < groups; ++g) {
      std::vector<int>& m = members[size_t(g)];
      std::sort(m.begin(), m.end());
      int32_t limit = INT32_MAX;  // the longest shared length every member admits
      for (int r : m) limit = std::min(limit, reqs[size_t(r)].seq - (verify ? 0 : 1));
      int32_t n = rng.uniform(std::max(1, limit / 2), limit);
      if (s.page_size > 1 && n % s.page_size == 0 && n > 1) --n;
      const Request& lead = reqs[size_t(m.front())];
      for (int r : m) {
        group_of[size_t(r)] = g;
        std::copy(lead.slots.begin(), lead.slots.begin() + n, reqs[size_t(r)].slots.begin());
      }
      group_lens.push_back(n);
    }
  }

  const int max_reqs = bs + 3;
  std::vector<int> rows(static_cast<size_t>(max_reqs));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng.engine());
  int64_t max_footprint = 1;
  for (int r = 0; r < bs; ++r) {
    reqs[size_t(r)].row = rows[size_t(r)];
    max_footprint = std::max(max_footprint, reqs[size_t(r)].footprint);
  }
  const int max_context_len = int(max_footprint) + rng.uniform(0, 5);
  // Positions no request uses point at a slot nobody owns (NaN): reading them shows.
  std::vector<int32_t> table(size_t(max_reqs) * max_context_len, trap_slot);
  for (const Request& q : reqs)
    std::copy(q.slots.begin(), q.slots.end(), table.begin() + int64_t(q.row) * max_context_len);
  w.req_to_token_pool.emplace(ReqToTokenPool::allocate(max_reqs, max_context_len, w.device));
  for (int row = 0; row < max_reqs; ++row) {
    w.req_to_token_pool->write(
        row, 0, std::span<const int32_t>(table.data() + int64_t(row) * max_context_len,
                                         size_t(max_context_len)));
  }

  // ---- tree masks (TARGET_VERIFY) ------------------------------------------------------------
  std::vector<uint8_t> custom_mask;
  std::vector<int64_t> tree_positions;  // [bs * draft_token_num]
  if (verify) {
    const int n = s.draft_token_num;
    for (Request& q : reqs) {
      q.tree_parent.assign(size_t(n), -1);
      std::vector<int> depth(size_t(n), 0);
      for (int i = 1; i < n; ++i) {
        q.tree_parent[size_t(i)] = rng.uniform(0, i - 1);
        depth[size_t(i)] = depth[size_t(q.tree_parent[size_t(i)])] + 1;
      }
      const int64_t kv_len = q.seq + n;
      const size_t request_begin = custom_mask.size();
      for (int i = 0; i < n; ++i) {
        std::vector<uint8_t> row(size_t(kv_len), 0);
        std::fill(row.begin(), row.begin() + q.seq, 1);  // the prefix is fully visible
        for (int a = i; a >= 0; a = q.tree_parent[size_t(a)]) row[size_t(q.seq + a)] = 1;
        custom_mask.insert(custom_mask.end(), row.begin(), row.end());
        tree_positions.push_back(q.seq + depth[size_t(i)]);
      }
      // Holes wide enough to move the output well past the error bar: the first the last
      // min(seq, 48) prefix columns of a row, the others a third of the prefix from anywhere.
      for (int h = 0; h < s.prefix_holes && q.seq > 0; ++h) {
        const int row = rng.uniform(0, n - 1);
        const int width = h == 0 ? std::min(q.seq, 48) : std::max(1, q.seq / 3);
        const int start = h == 0 ? q.seq - width : rng.uniform(0, q.seq - width);
        uint8_t* mask_row = custom_mask.data() + request_begin + size_t(row) * size_t(kv_len);
        std::fill(mask_row + start, mask_row + start + width, uint8_t(0));
      }
    }
  }

  // ---- the calls: which tokens query, which K/V are new --------------------------------------
  const int num_calls = multi_step ? s.num_steps : 1;
  std::vector<std::vector<TokenPlan>> plans(static_cast<size_t>(num_calls));
  for (int c = 0; c < num_calls; ++c) {
    std::vector<TokenPlan>& plan = plans[size_t(c)];
    for (int r = 0; r < bs; ++r) {
      const Request& q = reqs[size_t(r)];
      if (multi_step) {
        for (int b = 0; b < s.topk; ++b)
          plan.push_back({r, int64_t(q.seq) + int64_t(c) * s.topk + b});
      } else if (s.mode == ForwardMode::kDecode) {
        plan.push_back({r, q.seq > 0 ? q.seq - 1 : -1});
      } else if (verify) {
        for (int i = 0; i < s.draft_token_num; ++i) plan.push_back({r, int64_t(q.seq) + i});
      } else {
        for (int i = 0; i < q.extend; ++i) plan.push_back({r, int64_t(q.prefix) + i});
      }
    }
  }
  auto decoder_slot = [&](const TokenPlan& t) -> int32_t {
    if (t.decoder_position < 0) return 0;  // padded entries write to the padding slot
    const Request& q = reqs[size_t(t.request)];
    return q.slots[size_t(q.encoder + t.decoder_position)];
  };

  // ---- KV cache and its contents -------------------------------------------------------------
  KvCacheConfig kv_config;
  kv_config.num_layers = 2;
  kv_config.num_slots = num_slots;
  kv_config.num_kv_heads = hkv;
  kv_config.head_dim = dim;
  kv_config.v_head_dim = s.v_head_dim;
  kv_config.page_size = s.page_size;
  kv_config.dtype = kv_dtype;
  kv_config.device = w.device;
  w.kv_cache.emplace(KvCache::allocate(kv_config));
  const bool fp8 = is_fp8_dtype(kv_dtype);
  w.k_scale = fp8 ? s.k_scale : 1.f;
  w.v_scale = fp8 ? s.v_scale : 1.f;
  const float decoy_k_scale = 0.75f;
  const float decoy_v_scale = 1.25f;
  if (fp8) {
    w.kv_cache->set_scales(0, decoy_k_scale, decoy_v_scale);
    w.kv_cache->set_scales(kTestedLayer, s.k_scale, s.v_scale);
  }

  // New K/V of each call (values as the caller hands them), and where they are saved.
  std::vector<std::vector<uint8_t>> k_bytes(static_cast<size_t>(num_calls));
  std::vector<std::vector<uint8_t>> v_bytes(static_cast<size_t>(num_calls));
  for (int c = 0; c < num_calls; ++c) {
    ScenarioCall call;
    RefNewKv& nk = call.new_kv;
    int64_t rows_new = 0;
    if (cross_layer) {
      for (const Request& q : reqs)
        for (int j = 0; j < q.encoder; ++j) nk.slots.push_back(q.slots[size_t(j)]);
    } else {
      for (const TokenPlan& t : plans[size_t(c)]) nk.slots.push_back(decoder_slot(t));
    }
    rows_new = int64_t(nk.slots.size());
    nk.k = random_io_rows(rng, io, rows_new * hkv, dim, dim, 1.0, k_bytes[size_t(c)]);
    nk.v = random_io_rows(rng, io, rows_new * hkv, v_dim, v_dim, 1.0, v_bytes[size_t(c)]);
    w.calls.push_back(std::move(call));
  }

  const int64_t k_elems = num_slots * hkv * dim;
  const int64_t v_elems = num_slots * hkv * v_dim;
  w.pool_bytes_before.resize(2);
  for (int layer = 0; layer < 2; ++layer) {
    fill_nan(w.pool_bytes_before[size_t(layer)][0], kv_dtype, k_elems);
    fill_nan(w.pool_bytes_before[size_t(layer)][1], kv_dtype, v_elems);
  }
  {
    // Layer 0 is a decoy: finite values everywhere, so a backend reading the wrong layer
    // produces wrong numbers rather than NaN. Drawn from a small table of encoded values (a
    // prime count, so rows do not repeat in step with the head dims).
    constexpr int kTable = 4099;
    const int elem = dtype_size(kv_dtype);
    for (int which = 0; which < 2; ++which) {
      std::vector<uint8_t> table(size_t(kTable) * elem);
      for (int i = 0; i < kTable; ++i)
        store_kv(table, kv_dtype, i, rng.value(), which == 0 ? decoy_k_scale : decoy_v_scale);
      std::vector<uint8_t>& image = w.pool_bytes_before[0][size_t(which)];
      const int64_t count = which == 0 ? k_elems : v_elems;
      const int64_t offset = rng.uniform(0, kTable - 1);
      for (int64_t i = 0; i < count; ++i)
        std::memcpy(image.data() + i * elem, table.data() + ((i + offset) % kTable) * elem,
                    size_t(elem));
    }
  }
  {
    // The tested layer: every owned slot gets K/V, except the slots this step saves into
    // (NaN until written) and, for a cross layer, the decoder tokens of this step (never read).
    auto& image = w.pool_bytes_before[size_t(kTestedLayer)];
    std::vector<uint8_t> skip(size_t(num_slots), 0);
    for (const ScenarioCall& call : w.calls)
      for (int32_t slot : call.new_kv.slots) skip[size_t(slot)] = 1;
    if (cross_layer)
      for (const auto& plan : plans)
        for (const TokenPlan& t : plan) skip[size_t(decoder_slot(t))] = 1;
    skip[0] = 1;  // the padding slot belongs to nobody
    for (const Request& q : reqs) {
      for (int32_t slot : q.slots) {
        if (skip[size_t(slot)]) continue;
        for (int64_t i = 0; i < int64_t(hkv) * dim; ++i)
          store_kv(image[0], kv_dtype, slot * hkv * dim + i, rng.value(), w.k_scale);
        for (int64_t i = 0; i < int64_t(hkv) * v_dim; ++i)
          store_kv(image[1], kv_dtype, slot * hkv * v_dim + i, rng.value(), w.v_scale);
      }
    }
    if (!s.save_kv_cache) {
      // The caller already wrote this step's K/V.
      for (const ScenarioCall& call : w.calls) {
        const RefNewKv& nk = call.new_kv;
        for (size_t n = 0; n < nk.slots.size(); ++n) {
          for (int64_t i = 0; i < int64_t(hkv) * dim; ++i)
            store_kv(image[0], kv_dtype, nk.slots[n] * hkv * dim + i,
                     nk.k[n * hkv * dim + size_t(i)], w.k_scale);
          for (int64_t i = 0; i < int64_t(hkv) * v_dim; ++i)
            store_kv(image[1], kv_dtype, nk.slots[n] * hkv * v_dim + i,
                     nk.v[n * hkv * v_dim + size_t(i)], w.v_scale);
        }
      }
    }
  }
  for (int layer = 0; layer < 2; ++layer) {
    const auto& image = w.pool_bytes_before[size_t(layer)];
    copy_bytes(w.kv_cache->k_buffer(layer).data(), w.device, image[0].data(), Device::cpu(),
               image[0].size());
    copy_bytes(w.kv_cache->v_buffer(layer).data(), w.device, image[1].data(), Device::cpu(),
               image[1].size());
  }
  w.ref_pool = RefKvPool::make(num_slots, hkv, dim, v_dim);
  {
    const auto& image = w.pool_bytes_before[size_t(kTestedLayer)];
    for (int64_t i = 0; i < k_elems; ++i)
      w.ref_pool.k[size_t(i)] = decode_element(image[0].data(), kv_dtype, i) * w.k_scale;
    for (int64_t i = 0; i < v_elems; ++i)
      w.ref_pool.v[size_t(i)] = decode_element(image[1].data(), kv_dtype, i) * w.v_scale;
  }

  // ---- layer and backend config -------------------------------------------------------------
  w.layer.layer_id = kTestedLayer;
  w.layer.num_q_heads = hq;
  w.layer.num_kv_heads = hkv;
  w.layer.head_dim = dim;
  w.layer.v_head_dim = s.v_head_dim;
  w.layer.scaling = float(1.0 / std::sqrt(double(dim)));
  w.layer.logit_cap = s.logit_cap;
  w.layer.sliding_window_size = (s.sliding_window >= 0 && s.window_layer) ? s.sliding_window : -1;
  w.layer.is_cross_attention = cross_layer;
  if (fp8 && rng.coin()) {  // explicit per-layer scales, equal to the cache's
    w.layer.k_scale = s.k_scale;
    w.layer.v_scale = s.v_scale;
  }

  w.config.kv_cache = &*w.kv_cache;
  w.config.req_to_token_pool = &*w.req_to_token_pool;
  w.config.num_q_heads = hq;
  w.config.num_kv_heads = hkv;
  w.config.head_dim = dim;
  w.config.v_head_dim = s.v_head_dim;
  w.config.q_dtype = io;
  w.config.sliding_window_size = s.sliding_window;
  w.config.is_encoder_decoder = cross_model;
  w.config.ragged_extend_threshold = s.force_ragged ? 0 : 4096;
  w.config.num_threads = rng.uniform(1, 3);
  w.config.deterministic = s.deterministic;
  // SPEC §3, stated here apart from core::use_ragged_extend (the step-facts test compares the
  // two): EXTEND / MIXED steps with no cached prefix (the cache in the q dtype), or with at
  // least ragged_extend_threshold new tokens (and more new than cached prefix tokens, unless
  // the threshold is 0), take the ragged + paged-prefix path, unless the model has a window or
  // cross-attention.
  int64_t new_tokens = 0, prefix_tokens = 0;
  for (const Request& q : reqs) {
    new_tokens += q.extend;
    prefix_tokens += q.prefix;
  }
  const bool large = new_tokens >= w.config.ragged_extend_threshold &&
                     (w.config.ragged_extend_threshold == 0 || prefix_tokens < new_tokens);
  w.ragged = (s.mode == ForwardMode::kExtend || s.mode == ForwardMode::kMixed) &&
             ((prefix_tokens == 0 && new_tokens > 0 && kv_dtype == io) || large) &&
             s.sliding_window < 0 && !cross_model && !s.deterministic;

  // ---- inputs and outputs of each call --------------------------------------------------------
  const bool three_d = rng.coin();
  const double q_gain = s.logit_cap > 0 ? 3.0 : 1.5;  // soft-cap: logits large enough to bend
  const bool pass_kv = s.save_kv_cache || w.ragged;
  for (int c = 0; c < num_calls; ++c) {
    ScenarioCall& call = w.calls[size_t(c)];
    const int64_t tokens = int64_t(plans[size_t(c)].size());
    call.num_tokens = tokens;
    const int64_t q_row = int64_t(hq) * dim;
    const int64_t q_stride = s.strided_q ? q_row + dim : q_row;
    std::vector<uint8_t> q_bytes;
    call.q_values = random_io_rows(rng, io, tokens, q_row, q_stride, q_gain, q_bytes);
    const TensorView q_full = w.upload(io, {tokens, q_stride}, q_bytes.data(), w.device);
    if (three_d) {
      const int64_t shape[3] = {tokens, hq, dim};
      const int64_t strides[3] = {q_stride, dim, 1};
      call.q = TensorView(q_full.data(), io, w.device, 3, shape, strides);
    } else {
      const int64_t shape[2] = {tokens, q_row};
      const int64_t strides[2] = {q_stride, 1};
      call.q = TensorView(q_full.data(), io, w.device, 2, shape, strides);
    }
    const int64_t rows_new = int64_t(call.new_kv.slots.size());
    if (pass_kv) {
      call.k = w.upload(io, {rows_new, hkv, dim}, k_bytes[size_t(c)].data(), w.device);
      call.v = w.upload(io, {rows_new, hkv, v_dim}, v_bytes[size_t(c)].data(), w.device);
      if (!three_d) {
        call.k = call.k.reshape({rows_new, int64_t(hkv) * dim});
        call.v = call.v.reshape({rows_new, int64_t(hkv) * v_dim});
      }
    }
    std::vector<uint8_t> out_bytes;
    fill_nan(out_bytes, io, (tokens + kOutGuardRows) * hq * v_dim);
    call.out_with_guard =
        w.upload(io, {(tokens + kOutGuardRows) * hq * v_dim}, out_bytes.data(), w.device);
    call.out = three_d ? TensorView(call.out_with_guard.data(), io, w.device, {tokens, hq, v_dim})
                       : TensorView(call.out_with_guard.data(), io, w.device,
                                    {tokens, int64_t(hq) * v_dim});
  }

  // ---- the batch ------------------------------------------------------------------------------
  w.index_dtype = rng.coin() ? DType::kInt64 : DType::kInt32;
  const bool host_copies = kind == BackendKind::kCuda || rng.coin();
  const DType idx = w.index_dtype;
  ForwardBatch& b = w.batch;
  b.mode = s.mode;
  b.batch_size = bs;
  b.req_to_token_pool = &*w.req_to_token_pool;
  b.kv_cache = &*w.kv_cache;
  std::vector<int64_t> pool_rows, seq_lens, prefix_lens, extend_lens, encoder_lens;
  for (const Request& q : reqs) {
    pool_rows.push_back(q.row);
    seq_lens.push_back(q.seq);
    prefix_lens.push_back(q.prefix);
    extend_lens.push_back(q.extend);
    encoder_lens.push_back(q.encoder);
  }
  auto lengths = [&](const std::vector<int64_t>& values, TensorView& device_view,
                     TensorView& host_view) {
    device_view = w.index_tensor(values, idx, w.device);
    if (host_copies) host_view = w.index_tensor(values, idx, Device::cpu());
  };
  if (!idle) {
    b.req_pool_indices = w.index_tensor(pool_rows, idx, w.device);
    lengths(seq_lens, b.seq_lens, b.seq_lens_cpu);
    if (s.device_lengths) b.seq_lens_cpu = TensorView();
    const int64_t sum = std::accumulate(seq_lens.begin(), seq_lens.end(), int64_t(0));
    b.seq_lens_sum = rng.coin() ? sum : -1;
    if (is_extend_like(s.mode)) {
      lengths(prefix_lens, b.extend_prefix_lens, b.extend_prefix_lens_cpu);
      lengths(extend_lens, b.extend_seq_lens, b.extend_seq_lens_cpu);
      if (s.device_lengths) b.extend_prefix_lens_cpu = b.extend_seq_lens_cpu = TensorView();
    }
    if (cross_model) {
      lengths(encoder_lens, b.encoder_lens, b.encoder_lens_cpu);
      if (s.device_lengths) b.encoder_lens_cpu = TensorView();
      std::vector<int64_t> encoder_slots;
      for (const Request& q : reqs)
        for (int j = 0; j < q.encoder; ++j) encoder_slots.push_back(q.slots[size_t(j)]);
      b.encoder_out_cache_loc = w.index_tensor(encoder_slots, idx, w.device);
    }
    std::vector<int64_t> positions;
    if (verify) {
      positions = tree_positions;
    } else {
      for (const TokenPlan& t : plans[0]) positions.push_back(std::max<int64_t>(0, t.decoder_position));
    }
    b.positions = w.index_tensor(positions, idx, w.device);
    if (multi_step) {
      b.spec.topk = s.topk;
      b.spec.num_steps = s.num_steps;
      for (int c = 0; c < num_calls; ++c) {
        std::vector<int64_t> loc;
        for (const TokenPlan& t : plans[size_t(c)]) loc.push_back(decoder_slot(t));
        if (s.save_kv_cache) w.calls[size_t(c)].out_cache_loc = w.index_tensor(loc, idx, w.device);
      }
    } else {
      std::vector<int64_t> loc;
      for (const TokenPlan& t : plans[0]) loc.push_back(decoder_slot(t));
      b.out_cache_loc = w.index_tensor(loc, idx, w.device);
    }
    if (verify) {
      b.spec.draft_token_num = s.draft_token_num;
      b.spec.custom_mask =
          w.upload(DType::kUInt8, {int64_t(custom_mask.size())}, custom_mask.data(), w.device);
    }
    if (s.declared_groups > 0) {
      b.shared_prefix_group_cpu = w.index_tensor(group_of, idx, Device::cpu());
      b.shared_prefix_lens_cpu = w.index_tensor(group_lens, idx, Device::cpu());
    }
  }

  // ---- the reference's view of the batch ------------------------------------------------------
  RefBatch& rb = w.ref_batch;
  rb.mode = s.mode;
  for (const Request& q : reqs) {
    rb.req_pool_indices.push_back(q.row);
    rb.seq_lens.push_back(q.seq);
    if (is_extend_like(s.mode)) {
      rb.prefix_lens.push_back(q.prefix);
      rb.extend_lens.push_back(q.extend);
    }
    if (cross_model) rb.encoder_lens.push_back(q.encoder);
  }
  rb.max_context_len = max_context_len;
  rb.req_to_token = table;
  rb.draft_token_num = verify ? s.draft_token_num : 0;
  rb.custom_mask = custom_mask;
  rb.positions = tree_positions;
  rb.topk = multi_step ? s.topk : 0;

  // ---- attention sinks (drawn last, so that rows without them keep their data) ---------------
  if (s.sinks) {
    // Around a row's typical LSE (ln of its key count plus a little), so that the sink takes
    // anything from a small to a large share of a row's softmax.
    std::vector<uint8_t> bytes(size_t(hq) * size_t(dtype_size(s.sinks_dtype)));
    for (int h = 0; h < hq; ++h) {
      encode_element(bytes.data(), s.sinks_dtype, h, 2.0 + 1.5 * rng.value());
      w.sink_values.push_back(decode_element(bytes.data(), s.sinks_dtype, h));
    }
    w.layer.sinks = w.upload(s.sinks_dtype, {int64_t(hq)}, bytes.data(), w.device);
  }
  return world;
}

}  // namespace kvattn::testing
