#include "cpu/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/softmax_state.h"
#include "cpu/row_convert.h"
#include "cpu/simd.h"
#include "kvattn/error.h"

namespace kvattn::cpu {
namespace {

using core::AttentionParams;
using core::MaskMode;
using core::SoftmaxState;

// Keys per inner block. The block's widened K and V ([32, head_dim] floats each, 16 KiB at
// head_dim 128) and the score tile [rows, 32] stay in L1/L2 while all rows of the tile use them.
constexpr int kKvBlock = 32;
// Packed query rows per tile (tokens x group heads): 64 rows of head_dim 128 are 32 KiB of q,
// enough to amortize widening each K/V row over 64 dot products in prefill.
constexpr int kTileRows = 64;
// A split piece covers at least this many keys, so the merge (rows x v_head_dim per piece) stays
// small next to the attention work (rows x keys x (head_dim + v_head_dim)).
constexpr int kMinSplitKeys = 256;
// Work items per thread that the split aims for: with an atomic counter handing them out, a few
// per thread even out unequal tiles.
constexpr int kItemsPerThread = 4;

// One tile of work: query tokens [q_begin, q_end) of a request for one kv head, over relative
// keys [kv_begin, kv_end) (already clipped to what the tile's rows can see).
struct WorkItem {
  int32_t request = 0;
  int32_t kv_head = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
  int32_t kv_begin = 0;
  int32_t kv_end = 0;
  int64_t partial = -1;  // -1: writes the output itself; else its slot in the partial buffers
  int64_t cost = 0;      // rows x keys, for ordering
};

// A split tile: merges num_partials consecutive partial slots into the output.
struct MergeItem {
  int32_t request = 0;
  int32_t kv_head = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
  int64_t first_partial = 0;
  int32_t num_partials = 0;
};

struct ThreadScratch {
  std::vector<float> q;                // [tile_rows, head_dim], pre-scaled
  std::vector<float> o;                // [tile_rows, v_head_dim], unnormalized
  std::vector<float> s;                // [tile_rows, kKvBlock] scores, then probabilities
  std::vector<float> k;                // [kKvBlock, head_dim]
  std::vector<float> v;                // [kKvBlock, v_head_dim]
  std::vector<SoftmaxState> state;     // [tile_rows]
};

}  // namespace

struct AttentionWorkspace::Impl {
  std::vector<ThreadScratch> threads;
  std::vector<WorkItem> items;
  std::vector<MergeItem> merges;
  std::vector<float> partial_out;  // [num_partials, tile_rows, v_head_dim]
  std::vector<float> partial_lse;  // [num_partials, tile_rows]
};

AttentionWorkspace::AttentionWorkspace() : impl_(std::make_unique<Impl>()) {}
AttentionWorkspace::~AttentionWorkspace() = default;

namespace {

// Everything a tile needs that is fixed for the call.
struct CallContext {
  const AttentionParams* p = nullptr;
  DType out_dtype = DType::kFloat32;
  int group = 1;            // q heads per kv head
  int tile_tokens = 1;      // query tokens per tile
  int tile_rows = 1;        // tile_tokens * group
  float q_scale = 1.f;      // sm_scale * k_scale, folded into q
  const float* fp8_table = nullptr;
  int64_t kv_element = 2;   // bytes per K/V element
};

// ---- widening K/V blocks --------------------------------------------------------------------

// Widens rows of one kv head into dst [nk, dim]; row j is at base + row_offset(j) bytes.
template <typename LoadRow>
void load_block_rows(const char* base, const int64_t* row_offsets /*[nk]*/, int nk, int dim,
                     float* dst /*[nk, dim]*/, LoadRow load8) {
  for (int j = 0; j < nk; ++j) {
    const char* row = base + row_offsets[j];
    float* out = dst + int64_t(j) * dim;
    for (int i = 0; i < dim; i += 8) _mm256_storeu_ps(out + i, load8(row, i));
  }
}

void load_block(const char* base, const int64_t* row_offsets, int nk, int dim, DType dtype,
                const float* fp8_table, float* dst) {
  switch (dtype) {
    case DType::kBFloat16:
      load_block_rows(base, row_offsets, nk, dim, dst, [](const char* row, int i) {
        return simd::load8_bf16(reinterpret_cast<const uint16_t*>(row) + i);
      });
      return;
    case DType::kFloat16:
      load_block_rows(base, row_offsets, nk, dim, dst, [](const char* row, int i) {
        return simd::load8_fp16(reinterpret_cast<const uint16_t*>(row) + i);
      });
      return;
    case DType::kFloat32:
      load_block_rows(base, row_offsets, nk, dim, dst, [](const char* row, int i) {
        return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
      });
      return;
    default:  // fp8 e4m3 / e5m2 (the dtype was checked when the call started)
      load_block_rows(base, row_offsets, nk, dim, dst, [fp8_table](const char* row, int i) {
        return simd::load8_fp8(reinterpret_cast<const uint8_t*>(row) + i, fp8_table);
      });
      return;
  }
}

// Asks for the cache lines of rows [0, nk) ahead of their use (slots are scattered when pages
// are shuffled, which defeats the hardware prefetcher).
void prefetch_rows(const char* base, const int64_t* row_offsets, int nk, int64_t row_bytes) {
  for (int j = 0; j < nk; ++j) {
    const char* row = base + row_offsets[j];
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// ---- scores: s[r][j] = q[r] . k[j] ------------------------------------------------------------

// 4 query rows x 2 keys: 8 accumulators, one hsum8 at the end.
inline void dot_4x2(const float* q /*[4, dim]*/, const float* k /*[2, dim]*/, int dim,
                    float* s /*[4, ld]*/, int ld) {
  __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
  __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
  const float* k1 = k + dim;
  for (int i = 0; i < dim; i += 8) {
    const __m256 k0v = _mm256_loadu_ps(k + i);
    const __m256 k1v = _mm256_loadu_ps(k1 + i);
    __m256 qv = _mm256_loadu_ps(q + i);
    a00 = _mm256_fmadd_ps(qv, k0v, a00);
    a01 = _mm256_fmadd_ps(qv, k1v, a01);
    qv = _mm256_loadu_ps(q + dim + i);
    a10 = _mm256_fmadd_ps(qv, k0v, a10);
    a11 = _mm256_fmadd_ps(qv, k1v, a11);
    qv = _mm256_loadu_ps(q + 2 * dim + i);
    a20 = _mm256_fmadd_ps(qv, k0v, a20);
    a21 = _mm256_fmadd_ps(qv, k1v, a21);
    qv = _mm256_loadu_ps(q + 3 * dim + i);
    a30 = _mm256_fmadd_ps(qv, k0v, a30);
    a31 = _mm256_fmadd_ps(qv, k1v, a31);
  }
  const __m256 sums = simd::hsum8(a00, a01, a10, a11, a20, a21, a30, a31);
  const __m128 rows01 = _mm256_castps256_ps128(sums);
  const __m128 rows23 = _mm256_extractf128_ps(sums, 1);
  _mm_storel_pi(reinterpret_cast<__m64*>(s), rows01);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + ld), rows01);
  _mm_storel_pi(reinterpret_cast<__m64*>(s + 2 * ld), rows23);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + 3 * ld), rows23);
}

// 1 query row x 8 keys.
inline void dot_1x8(const float* q /*[dim]*/, const float* k /*[8, dim]*/, int dim,
                    float* s /*[8]*/) {
  __m256 a[8];
  for (int c = 0; c < 8; ++c) a[c] = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + c * dim + i), a[c]);
  }
  _mm256_storeu_ps(s, simd::hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
}

inline float dot_1x1(const float* q, const float* k, int dim) {
  __m256 a = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
  return simd::hsum(a);
}

void compute_scores(const float* q /*[rows, dim]*/, int rows, const float* k /*[nk, dim]*/,
                    int nk, int dim, float* s /*[rows, ld]*/, int ld) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float* qr = q + int64_t(r) * dim;
    float* sr = s + int64_t(r) * ld;
    int j = 0;
    for (; j + 2 <= nk; j += 2) dot_4x2(qr, k + int64_t(j) * dim, dim, sr + j, ld);
    for (; j < nk; ++j) {
      for (int rr = 0; rr < 4; ++rr) sr[rr * ld + j] = dot_1x1(qr + rr * dim, k + int64_t(j) * dim, dim);
    }
  }
  for (; r < rows; ++r) {
    const float* qr = q + int64_t(r) * dim;
    float* sr = s + int64_t(r) * ld;
    int j = 0;
    for (; j + 8 <= nk; j += 8) dot_1x8(qr, k + int64_t(j) * dim, dim, sr + j);
    for (; j < nk; ++j) sr[j] = dot_1x1(qr, k + int64_t(j) * dim, dim);
  }
}

// ---- o[r] += sum_j p[r][j] * v[j] ----------------------------------------------------------------

void accumulate_pv(const float* p /*[rows, ld]*/, int ld, int rows, const float* v /*[nk, dv]*/,
                   int nk, int dv, float* o /*[rows, dv]*/) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float* p0 = p + int64_t(r) * ld;
    float* o0 = o + int64_t(r) * dv;
    int c = 0;
    for (; c + 16 <= dv; c += 16) {
      __m256 acc[4][2];
      for (int rr = 0; rr < 4; ++rr) {
        acc[rr][0] = _mm256_loadu_ps(o0 + rr * dv + c);
        acc[rr][1] = _mm256_loadu_ps(o0 + rr * dv + c + 8);
      }
      for (int j = 0; j < nk; ++j) {
        const __m256 v0 = _mm256_loadu_ps(v + int64_t(j) * dv + c);
        const __m256 v1 = _mm256_loadu_ps(v + int64_t(j) * dv + c + 8);
        for (int rr = 0; rr < 4; ++rr) {
          const __m256 w = _mm256_broadcast_ss(p0 + rr * ld + j);
          acc[rr][0] = _mm256_fmadd_ps(w, v0, acc[rr][0]);
          acc[rr][1] = _mm256_fmadd_ps(w, v1, acc[rr][1]);
        }
      }
      for (int rr = 0; rr < 4; ++rr) {
        _mm256_storeu_ps(o0 + rr * dv + c, acc[rr][0]);
        _mm256_storeu_ps(o0 + rr * dv + c + 8, acc[rr][1]);
      }
    }
    for (; c < dv; c += 8) {
      __m256 acc[4];
      for (int rr = 0; rr < 4; ++rr) acc[rr] = _mm256_loadu_ps(o0 + rr * dv + c);
      for (int j = 0; j < nk; ++j) {
        const __m256 v0 = _mm256_loadu_ps(v + int64_t(j) * dv + c);
        for (int rr = 0; rr < 4; ++rr) {
          acc[rr] = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + rr * ld + j), v0, acc[rr]);
        }
      }
      for (int rr = 0; rr < 4; ++rr) _mm256_storeu_ps(o0 + rr * dv + c, acc[rr]);
    }
  }
  for (; r < rows; ++r) {
    const float* pr = p + int64_t(r) * ld;
    float* orow = o + int64_t(r) * dv;
    int c = 0;
    for (; c + 32 <= dv; c += 32) {
      __m256 acc[4];
      for (int u = 0; u < 4; ++u) acc[u] = _mm256_loadu_ps(orow + c + 8 * u);
      for (int j = 0; j < nk; ++j) {
        const __m256 w = _mm256_broadcast_ss(pr + j);
        const float* vj = v + int64_t(j) * dv + c;
        for (int u = 0; u < 4; ++u) acc[u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8 * u), acc[u]);
      }
      for (int u = 0; u < 4; ++u) _mm256_storeu_ps(orow + c + 8 * u, acc[u]);
    }
    for (; c < dv; c += 8) {
      __m256 acc = _mm256_loadu_ps(orow + c);
      for (int j = 0; j < nk; ++j) {
        acc = _mm256_fmadd_ps(_mm256_broadcast_ss(pr + j), _mm256_loadu_ps(v + int64_t(j) * dv + c), acc);
      }
      _mm256_storeu_ps(orow + c, acc);
    }
  }
}

// ---- masks ---------------------------------------------------------------------------------------

// Relative key positions [lo, hi) that query token t of a request may see, before a custom mask.
// Causal queries are bottom-right aligned: token t sits at key position kv_len - q_len + t.
struct VisibleRange {
  int64_t lo;
  int64_t hi;
};

VisibleRange visible_range(const AttentionParams& p, int64_t q_len, int64_t kv_len, int64_t t) {
  const int64_t diag = kv_len - q_len + t;
  VisibleRange range{0, kv_len};
  if (p.mask == MaskMode::kCausal) range.hi = std::min(kv_len, diag + 1);
  if (p.window_left >= 0 && p.mask != MaskMode::kNone) range.lo = std::max<int64_t>(0, diag - p.window_left);
  return range;
}

// The custom mask row of query token t: [kv_len] bytes (the request's mask may be wider; the
// keys are its last kv_len columns).
const uint8_t* custom_mask_row(const AttentionParams& p, int request, int64_t q_len,
                               int64_t kv_len, int64_t t) {
  const int64_t begin = p.mask_indptr[request];
  const int64_t row_len = q_len > 0 ? (p.mask_indptr[request + 1] - begin) / q_len : 0;
  return p.custom_mask + begin + t * row_len + (row_len - kv_len);
}

// ---- one tile ------------------------------------------------------------------------------------

void attend_tile(const CallContext& ctx, const WorkItem& item, ThreadScratch& ws,
                 float* partial_out /*[tile_rows, dv] or null*/,
                 float* partial_lse /*[tile_rows] or null*/) {
  const AttentionParams& p = *ctx.p;
  const int group = ctx.group;
  const int dim = p.head_dim;
  const int dv = p.v_head_dim;
  const int r = item.request;
  const int64_t q_start = p.qo_indptr[r];
  const int64_t q_len = p.qo_indptr[r + 1] - q_start;
  const int64_t kv_start = p.kv_indptr[r];
  const int64_t kv_len = p.kv_indptr[r + 1] - kv_start;
  const int tokens = item.q_end - item.q_begin;
  const int rows = tokens * group;
  const int64_t io_element = dtype_size(p.io_dtype);

  // Queries, pre-scaled so that q . k is the logit.
  for (int t = 0; t < tokens; ++t) {
    const int64_t token = q_start + item.q_begin + t;
    for (int g = 0; g < group; ++g) {
      const int head = item.kv_head * group + g;
      const char* src = static_cast<const char*>(p.q) +
                        (token * p.q_stride_token + int64_t(head) * p.q_stride_head) * io_element;
      load_row(src, p.io_dtype, dim, ctx.q_scale, ws.q.data() + int64_t(t * group + g) * dim);
    }
  }
  std::fill(ws.o.begin(), ws.o.begin() + int64_t(rows) * dv, 0.f);
  std::fill(ws.state.begin(), ws.state.begin() + rows, SoftmaxState{});

  // Byte offsets of this kv head's K and V rows for one block of keys.
  const char* k_base = static_cast<const char*>(p.k) + item.kv_head * p.k_stride_head * ctx.kv_element;
  const char* v_base = static_cast<const char*>(p.v) + item.kv_head * p.v_stride_head * ctx.kv_element;
  int64_t k_offsets[2][kKvBlock];
  int64_t v_offsets[2][kKvBlock];
  auto fill_offsets = [&](int64_t block_begin, int nk, int64_t* k_off, int64_t* v_off) {
    for (int j = 0; j < nk; ++j) {
      const int64_t row = p.kv_indices ? int64_t(p.kv_indices[kv_start + block_begin + j])
                                       : kv_start + block_begin + j;
      k_off[j] = row * p.k_stride_token * ctx.kv_element;
      v_off[j] = row * p.v_stride_token * ctx.kv_element;
    }
  };
  const int64_t k_row_bytes = dim * ctx.kv_element;
  const int64_t v_row_bytes = dv * ctx.kv_element;

  // Whole-tile visibility, to skip per-row masking on blocks every row sees entirely.
  const VisibleRange first_range = visible_range(p, q_len, kv_len, item.q_begin);
  const VisibleRange last_range = visible_range(p, q_len, kv_len, item.q_end - 1);
  const bool custom = p.mask == MaskMode::kCustom;

  int buffer = 0;
  if (item.kv_begin < item.kv_end) {
    fill_offsets(item.kv_begin, std::min<int>(kKvBlock, item.kv_end - item.kv_begin),
                 k_offsets[0], v_offsets[0]);
  }
  for (int64_t block = item.kv_begin; block < item.kv_end; block += kKvBlock) {
    const int nk = int(std::min<int64_t>(kKvBlock, item.kv_end - block));
    const int64_t next = block + kKvBlock;
    if (next < item.kv_end) {
      const int next_nk = int(std::min<int64_t>(kKvBlock, item.kv_end - next));
      fill_offsets(next, next_nk, k_offsets[buffer ^ 1], v_offsets[buffer ^ 1]);
      prefetch_rows(k_base, k_offsets[buffer ^ 1], next_nk, k_row_bytes);
      prefetch_rows(v_base, v_offsets[buffer ^ 1], next_nk, v_row_bytes);
    }

    load_block(k_base, k_offsets[buffer], nk, dim, p.kv_dtype, ctx.fp8_table, ws.k.data());
    float* s = ws.s.data();
    compute_scores(ws.q.data(), rows, ws.k.data(), nk, dim, s, kKvBlock);

    // Soft-cap, then masks, over the padded block width (padding lanes become -inf).
    const int padded = (nk + 7) & ~7;
    const bool whole_block_visible = !custom && block >= first_range.lo &&
                                     block >= last_range.lo && block + nk <= first_range.hi;
    for (int t = 0; t < tokens; ++t) {
      const int64_t token_t = item.q_begin + t;
      VisibleRange range{block, block + nk};
      if (!whole_block_visible) range = visible_range(p, q_len, kv_len, token_t);
      const uint8_t* mask_row = custom ? custom_mask_row(p, r, q_len, kv_len, token_t) : nullptr;
      for (int g = 0; g < group; ++g) {
        float* srow = s + int64_t(t * group + g) * kKvBlock;
        if (p.logit_cap > 0.f) {
          for (int j = 0; j < padded; j += 8) {
            _mm256_storeu_ps(srow + j, simd::soft_cap8(_mm256_loadu_ps(srow + j), p.logit_cap));
          }
        }
        for (int j = nk; j < padded; ++j) srow[j] = -INFINITY;
        if (!whole_block_visible) {
          for (int j = 0; j < nk; ++j) {
            const int64_t key = block + j;
            if (key < range.lo || key >= range.hi || (mask_row && !mask_row[key])) srow[j] = -INFINITY;
          }
        }
      }
    }

    // Online softmax: rescale what each row holds to the new running max, then p = e^(s - max).
    for (int row = 0; row < rows; ++row) {
      float* srow = s + int64_t(row) * kKvBlock;
      __m256 vmax = _mm256_set1_ps(-INFINITY);
      for (int j = 0; j < padded; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(srow + j));
      const float block_max = simd::hmax(vmax);
      if (block_max == -INFINITY) {  // the row sees none of these keys
        std::fill(srow, srow + padded, 0.f);
        continue;
      }
      SoftmaxState& state = ws.state[row];
      const float factor = state.rescale_for(block_max);
      if (factor != 1.f) {
        float* orow = ws.o.data() + int64_t(row) * dv;
        const __m256 f = _mm256_set1_ps(factor);
        for (int c = 0; c < dv; c += 8) _mm256_storeu_ps(orow + c, _mm256_mul_ps(_mm256_loadu_ps(orow + c), f));
      }
      const __m256 m = _mm256_set1_ps(state.max);
      __m256 vsum = _mm256_setzero_ps();
      for (int j = 0; j < padded; j += 8) {
        const __m256 e = simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + j), m));
        _mm256_storeu_ps(srow + j, e);
        vsum = _mm256_add_ps(vsum, e);
      }
      state.sum += simd::hsum(vsum);
    }

    load_block(v_base, v_offsets[buffer], nk, dv, p.kv_dtype, ctx.fp8_table, ws.v.data());
    accumulate_pv(s, kKvBlock, rows, ws.v.data(), nk, dv, ws.o.data());
    buffer ^= 1;
  }

  // Normalize; v_scale (fp8 storage) multiplies every value row, so it folds in here.
  const int64_t out_element = dtype_size(ctx.out_dtype);
  for (int t = 0; t < tokens; ++t) {
    const int64_t token = q_start + item.q_begin + t;
    for (int g = 0; g < group; ++g) {
      const int row = t * group + g;
      const int head = item.kv_head * group + g;
      float* orow = ws.o.data() + int64_t(row) * dv;
      const SoftmaxState& state = ws.state[row];
      const float lse = state.lse();
      const __m256 inv = _mm256_set1_ps(state.sum > 0.f ? p.v_scale / state.sum : 0.f);
      for (int c = 0; c < dv; c += 8) _mm256_storeu_ps(orow + c, _mm256_mul_ps(_mm256_loadu_ps(orow + c), inv));
      if (partial_out) {
        std::memcpy(partial_out + int64_t(row) * dv, orow, size_t(dv) * sizeof(float));
        partial_lse[row] = lse;
        continue;
      }
      char* dst = static_cast<char*>(p.out) +
                  (token * p.out_stride_token + int64_t(head) * p.out_stride_head) * out_element;
      store_row(orow, dv, ctx.out_dtype, dst);
      if (p.lse) p.lse[token * p.num_q_heads + head] = lse;
    }
  }
}

// Folds `count` partial states of one row into `acc` (dv floats) with core::merge_weights and
// returns the merged LSE.
float merge_partials(const float* const* outs, const float* lses, int count, int dv, float* acc) {
  float lse = lses[0];
  std::memcpy(acc, outs[0], size_t(dv) * sizeof(float));
  for (int i = 1; i < count; ++i) {
    float weight_acc = 0.f;
    float weight_new = 0.f;
    float merged = 0.f;
    core::merge_weights(lse, lses[i], &weight_acc, &weight_new, &merged);
    const __m256 wa = _mm256_set1_ps(weight_acc);
    const __m256 wb = _mm256_set1_ps(weight_new);
    for (int c = 0; c < dv; c += 8) {
      const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + c), wa);
      _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(_mm256_loadu_ps(outs[i] + c), wb, a));
    }
    lse = merged;
  }
  return lse;
}

// ---- planning ------------------------------------------------------------------------------------

// Clips a custom-mask tile to the columns some row of it can see: [lo, hi) in relative keys.
VisibleRange custom_mask_span(const AttentionParams& p, int request, int64_t q_len,
                              int64_t kv_len, int64_t q_begin, int64_t q_end, VisibleRange span) {
  int64_t lo = span.hi;
  int64_t hi = span.lo;
  for (int64_t t = q_begin; t < q_end; ++t) {
    const uint8_t* row = custom_mask_row(p, request, q_len, kv_len, t);
    int64_t first = span.lo;
    while (first < span.hi && !row[first]) ++first;
    if (first == span.hi) continue;
    int64_t last = span.hi - 1;
    while (!row[last]) --last;
    lo = std::min(lo, first);
    hi = std::max(hi, last + 1);
  }
  if (lo >= hi) return {span.lo, span.lo};
  return {lo, hi};
}

void check_params(const AttentionParams& p, DType out_dtype) {
  check_arg(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0, "num_q_heads", "got ",
            p.num_q_heads, " q heads for ", p.num_kv_heads, " kv heads, expected a multiple");
  if (p.head_dim % 8 != 0 || p.v_head_dim % 8 != 0 || p.head_dim <= 0 || p.v_head_dim <= 0) {
    throw_error(ErrorKind::kNotSupported, "head_dim", "the CPU backend needs head_dim and ",
                "v_head_dim to be positive multiples of 8; got ", p.head_dim, " and ",
                p.v_head_dim);
  }
  auto io_ok = [](DType d) {
    return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
  };
  check_arg(io_ok(p.io_dtype), "q", "dtype ", dtype_name(p.io_dtype), ", expected fp32/bf16/fp16");
  check_arg(io_ok(out_dtype), "out", "dtype ", dtype_name(out_dtype), ", expected fp32/bf16/fp16");
  check_arg(is_float_dtype(p.kv_dtype), "kv_dtype", "got ", dtype_name(p.kv_dtype),
            ", expected a float type");
  check_arg(p.mask != MaskMode::kCustom || (p.custom_mask && p.mask_indptr), "custom_mask",
            "missing for a custom-mask call");
  if (p.kv_indices) {
    const int64_t total = p.kv_indptr[p.batch_size];
    for (int64_t i = 0; i < total; ++i) {
      const int64_t slot = p.kv_indices[i];
      check_arg(slot >= 0 && slot < p.num_slots, "kv_indices[" + std::to_string(i) + "]", "slot ",
                slot, " outside the pool [0, ", p.num_slots, ")");
    }
  }
}

}  // namespace

void run_attention(const AttentionParams& p, DType out_dtype, ThreadPool& pool,
                   AttentionWorkspace& workspace) {
  check_params(p, out_dtype);
  AttentionWorkspace::Impl& w = workspace.impl();
  CallContext ctx;
  ctx.p = &p;
  ctx.out_dtype = out_dtype;
  ctx.group = p.num_q_heads / p.num_kv_heads;
  ctx.tile_tokens = std::max(1, kTileRows / ctx.group);
  ctx.tile_rows = ctx.tile_tokens * ctx.group;
  ctx.q_scale = p.sm_scale * (is_fp8_dtype(p.kv_dtype) ? p.k_scale : 1.f);
  ctx.fp8_table = fp8_value_table(p.kv_dtype);
  ctx.kv_element = dtype_size(p.kv_dtype);
  const int threads = pool.size();

  // Tiles and their visible key spans.
  w.items.clear();
  w.merges.clear();
  int64_t total_cost = 0;
  for (int r = 0; r < p.batch_size; ++r) {
    const int64_t q_len = p.qo_indptr[r + 1] - p.qo_indptr[r];
    const int64_t kv_len = p.kv_indptr[r + 1] - p.kv_indptr[r];
    for (int64_t q0 = 0; q0 < q_len; q0 += ctx.tile_tokens) {
      const int64_t q1 = std::min(q_len, q0 + ctx.tile_tokens);
      const VisibleRange first = visible_range(p, q_len, kv_len, q0);
      const VisibleRange last = visible_range(p, q_len, kv_len, q1 - 1);
      VisibleRange span{std::max<int64_t>(0, first.lo), std::min(kv_len, last.hi)};
      if (span.hi < span.lo) span.hi = span.lo;
      if (p.mask == MaskMode::kCustom) span = custom_mask_span(p, r, q_len, kv_len, q0, q1, span);
      for (int h = 0; h < p.num_kv_heads; ++h) {
        WorkItem item;
        item.request = r;
        item.kv_head = h;
        item.q_begin = int32_t(q0);
        item.q_end = int32_t(q1);
        item.kv_begin = int32_t(span.lo);
        item.kv_end = int32_t(span.hi);
        // Rows x keys, plus a constant per tile for loading q and writing the output.
        item.cost = (q1 - q0) * ctx.group * (span.hi - span.lo + 16);
        total_cost += item.cost;
        w.items.push_back(item);
      }
    }
  }

  // Split the tiles that hold much more than a fair share of the work along the KV axis.
  int64_t num_partials = 0;
  if (threads > 1) {
    const int64_t target = std::max<int64_t>(1, total_cost / (int64_t(threads) * kItemsPerThread));
    const size_t num_tiles = w.items.size();
    for (size_t i = 0; i < num_tiles; ++i) {
      WorkItem& tile = w.items[i];
      const int64_t span = tile.kv_end - tile.kv_begin;
      if (tile.cost <= target || span < 2 * kMinSplitKeys) continue;
      const int64_t pieces =
          std::min<int64_t>((tile.cost + target - 1) / target, span / kMinSplitKeys);
      if (pieces < 2) continue;
      int64_t chunk = (span + pieces - 1) / pieces;
      chunk = (chunk + kKvBlock - 1) / kKvBlock * kKvBlock;
      MergeItem merge;
      merge.request = tile.request;
      merge.kv_head = tile.kv_head;
      merge.q_begin = tile.q_begin;
      merge.q_end = tile.q_end;
      merge.first_partial = num_partials;
      const WorkItem whole = tile;
      for (int64_t begin = whole.kv_begin; begin < whole.kv_end; begin += chunk) {
        WorkItem piece = whole;
        piece.kv_begin = int32_t(begin);
        piece.kv_end = int32_t(std::min<int64_t>(whole.kv_end, begin + chunk));
        piece.partial = num_partials++;
        piece.cost = (whole.q_end - whole.q_begin) * ctx.group * (piece.kv_end - piece.kv_begin);
        ++merge.num_partials;
        if (begin == whole.kv_begin) {
          w.items[i] = piece;
        } else {
          w.items.push_back(piece);
        }
      }
      w.merges.push_back(merge);
    }
  }
  // Heaviest first, so the last items to start are the short ones.
  std::stable_sort(w.items.begin(), w.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  // Scratch.
  const int dim = p.head_dim;
  const int dv = p.v_head_dim;
  if (int(w.threads.size()) < threads) w.threads.resize(size_t(threads));
  for (ThreadScratch& scratch : w.threads) {
    scratch.q.resize(size_t(ctx.tile_rows) * dim);
    scratch.o.resize(size_t(ctx.tile_rows) * dv);
    scratch.s.resize(size_t(ctx.tile_rows) * kKvBlock);
    scratch.k.resize(size_t(kKvBlock) * dim);
    scratch.v.resize(size_t(kKvBlock) * dv);
    scratch.state.resize(size_t(ctx.tile_rows));
  }
  w.partial_out.resize(size_t(num_partials) * ctx.tile_rows * dv);
  w.partial_lse.resize(size_t(num_partials) * ctx.tile_rows);

  pool.parallel_for(int64_t(w.items.size()), [&](int64_t index, int thread_id) {
    const WorkItem& item = w.items[size_t(index)];
    float* partial_out = nullptr;
    float* partial_lse = nullptr;
    if (item.partial >= 0) {
      partial_out = w.partial_out.data() + item.partial * ctx.tile_rows * dv;
      partial_lse = w.partial_lse.data() + item.partial * ctx.tile_rows;
    }
    attend_tile(ctx, item, w.threads[size_t(thread_id)], partial_out, partial_lse);
  });

  if (w.merges.empty()) return;
  const int64_t out_element = dtype_size(out_dtype);
  pool.parallel_for(int64_t(w.merges.size()), [&](int64_t index, int thread_id) {
    const MergeItem& merge = w.merges[size_t(index)];
    ThreadScratch& scratch = w.threads[size_t(thread_id)];
    std::vector<const float*> outs(static_cast<size_t>(merge.num_partials));
    std::vector<float> lses(static_cast<size_t>(merge.num_partials));
    const int64_t q_start = p.qo_indptr[merge.request];
    for (int t = 0; t < merge.q_end - merge.q_begin; ++t) {
      const int64_t token = q_start + merge.q_begin + t;
      for (int g = 0; g < ctx.group; ++g) {
        const int row = t * ctx.group + g;
        const int head = merge.kv_head * ctx.group + g;
        for (int i = 0; i < merge.num_partials; ++i) {
          const int64_t slot = merge.first_partial + i;
          outs[size_t(i)] = w.partial_out.data() + (slot * ctx.tile_rows + row) * dv;
          lses[size_t(i)] = w.partial_lse[size_t(slot * ctx.tile_rows + row)];
        }
        const float lse = merge_partials(outs.data(), lses.data(), merge.num_partials, dv,
                                         scratch.o.data());
        char* dst = static_cast<char*>(p.out) +
                    (token * p.out_stride_token + int64_t(head) * p.out_stride_head) * out_element;
        store_row(scratch.o.data(), dv, out_dtype, dst);
        if (p.lse) p.lse[token * p.num_q_heads + head] = lse;
      }
    }
  });
}

void merge_attention_states(const float* out_a, const float* lse_a, const float* out_b,
                            const float* lse_b, int64_t num_tokens, int num_q_heads,
                            int v_head_dim, void* out, int64_t out_stride_token,
                            int64_t out_stride_head, DType out_dtype, float* lse_out,
                            ThreadPool& pool) {
  // Tokens per index: enough rows that one index is worth waking a thread for.
  constexpr int64_t kTokensPerChunk = 64;
  const int64_t num_chunks = (num_tokens + kTokensPerChunk - 1) / kTokensPerChunk;
  const int64_t out_element = dtype_size(out_dtype);
  pool.parallel_for(num_chunks, [&](int64_t chunk, int) {
    std::vector<float> acc(static_cast<size_t>(v_head_dim));
    const int64_t end = std::min(num_tokens, (chunk + 1) * kTokensPerChunk);
    for (int64_t token = chunk * kTokensPerChunk; token < end; ++token) {
      for (int head = 0; head < num_q_heads; ++head) {
        const int64_t row = token * num_q_heads + head;
        const float* outs[2] = {out_a + row * v_head_dim, out_b + row * v_head_dim};
        const float lses[2] = {lse_a[row], lse_b[row]};
        const float lse = merge_partials(outs, lses, 2, v_head_dim, acc.data());
        char* dst = static_cast<char*>(out) +
                    (token * out_stride_token + int64_t(head) * out_stride_head) * out_element;
        store_row(acc.data(), v_head_dim, out_dtype, dst);
        if (lse_out) lse_out[row] = lse;
      }
    }
  });
}

}  // namespace kvattn::cpu
