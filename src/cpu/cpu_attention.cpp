#include "cpu/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "core/softmax_state.h"
#include "cpu/amx.h"
#include "cpu/bf16_avx512.h"
#include "cpu/row_convert.h"
#include "cpu/simd.h"
#include "kvattn/error.h"

namespace kvattn::cpu {
namespace {

using core::AttentionParams;
using core::MaskMode;
using core::SoftmaxState;

// Keys per inner block; the online-softmax rescale runs once per block. The scratch path widens
// 48 keys a block up to head_dim 128 (values: 24 KiB of floats at 128) and 24 above it, where
// 48 rows of values no longer stay close (in-process A/B on the dev VM, prefill 1 x 1024: 48
// against 24 keys 1.05-1.22x at head_dim 64/128, 0.87-0.97x at 256); its score kernel takes
// kKtKeys = 24 keys at a time (three 8-key vectors, scores_transposed). The direct path takes
// 64: its prefetches then run a whole block (~2 us of decode work) ahead, which measured 18-19
// GB/s against 16-18 with 32 on decode 16 x 4096 bf16.
constexpr int kWidenKvBlock = 48;
constexpr int kWideDimWidenKvBlock = 24;  // head_dim or v_head_dim above 128
constexpr int kKtKeys = 24;
constexpr int kDirectKvBlock = 64;
constexpr int kKvBlock = 64;  // the larger of the two: sizes the per-block arrays
// Packed query rows per tile (tokens x group heads): 64 rows of head_dim 128 are 32 KiB of q,
// enough to amortize widening each K/V row over 64 dot products in prefill.
constexpr int kTileRows = 64;
// Up to this many rows per kv head, a tile reads K/V straight from the pool (widening in
// registers: each element still serves every row) instead of widening a block into scratch
// first. Decode (group rows) and small verify tiles take this path; its work items span every
// kv head of a request, so each key's K and V rows of all heads are one sequential read.
constexpr int kDirectRows = 16;
// A split piece covers at least this many keys, so the merge (rows x v_head_dim per piece) stays
// small next to the attention work (rows x keys x (head_dim + v_head_dim)).
constexpr int kMinSplitKeys = 256;
// Deterministic mode's split chunk (keys from a tile's first key; the merge folds the pieces in
// order).
constexpr int kDeterministicSplitKeys = 2048;
// Work items per thread that the split aims for: with an atomic counter handing them out, a few
// per thread even out unequal tiles.
constexpr int kItemsPerThread = 4;
constexpr int kCacheLine = 64;

// One tile of work: query tokens [q_begin, q_end) of a request for kv heads [head_begin,
// head_end), over relative keys [kv_begin, kv_end) (already clipped to what the tile's rows can
// see).
struct WorkItem {
  int32_t request = 0;
  int32_t head_begin = 0;
  int32_t head_end = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
  int32_t kv_begin = 0;
  int32_t kv_end = 0;
  int64_t partial = -1;  // -1: writes the output itself; else its slot in the partial buffers
  int64_t cost = 0;      // rows x keys, for ordering
  int32_t dense_end = 0;  // custom mask: keys below it are visible to every row of the tile
};

// A split tile: merges num_partials consecutive partial slots into the output.
struct MergeItem {
  int32_t request = 0;
  int32_t head_begin = 0;
  int32_t head_end = 0;
  int32_t q_begin = 0;
  int32_t q_end = 0;
  int64_t first_partial = 0;
  int32_t num_partials = 0;
};

// Cache-line aligned storage for per-thread scratch: with plain heap blocks, the end of one
// thread's buffer and the start of the next thread's can share a line, and every write to it
// then takes the line away from the other core.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = (n * sizeof(T) + kCacheLine - 1) / kCacheLine * kCacheLine;
    return static_cast<T*>(::operator new(bytes, std::align_val_t(kCacheLine)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(kCacheLine)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
};
template <typename T>
using LineVector = std::vector<T, CacheLineAllocator<T>>;

// A thread's tile buffers. Rows of an item: (kv head - head_begin) * tile_rows + token *
// group + head in group.
struct ThreadScratch {
  LineVector<float> q;             // [item_rows, head_dim], pre-scaled
  LineVector<uint16_t> q_bf16;     // [item_rows, head_dim], as given (the AVX-512 BF16 path)
  LineVector<float> o;             // [item_rows, v_head_dim], unnormalized
  LineVector<float> s;             // [item_rows, kKvBlock] scores, then probabilities
  LineVector<float> k;             // [head_dim, kKtKeys or kWidenKvBlock] keys, transposed
  LineVector<float> v;             // [kKvBlock, v_head_dim] widened values
  LineVector<SoftmaxState> state;  // [item_rows]
};

}  // namespace

struct AttentionWorkspace::Impl {
  std::vector<ThreadScratch> threads;
  std::vector<WorkItem> items;
  std::vector<MergeItem> merges;
  std::vector<float> partial_out;  // [num_partials, item_rows, v_head_dim]
  std::vector<float> partial_lse;  // [num_partials, item_rows]
};

AttentionWorkspace::AttentionWorkspace() : impl_(std::make_unique<Impl>()) {}
AttentionWorkspace::~AttentionWorkspace() = default;

namespace {

// Packed query rows per tile on the AMX path (KVATTN_CPU_AMX_ROWS, an A/B knob).
int env_tile_rows() {
  const char* v = std::getenv("KVATTN_CPU_AMX_ROWS");
  const int rows = v != nullptr ? std::atoi(v) : 0;
  return rows >= 16 && rows <= 1024 ? rows : 512;
}

// Everything a tile needs that is fixed for the call.
struct CallContext {
  const AttentionParams* p = nullptr;
  DType out_dtype = DType::kFloat32;
  int group = 1;            // q heads per kv head
  int tile_tokens = 1;      // query tokens per tile
  int tile_rows = 1;        // tile_tokens * group: the rows one kv head serves
  bool direct = false;      // read K/V straight from the pool (see kDirectRows)
  bool bf16_dot = false;    // q.k and P.V on the AVX-512 BF16 kernels (bf16_avx512.h)
  bool amx = false;         // scratch-path tiles on the AMX-BF16 kernels (amx.h)
  int kv_block = kWidenKvBlock;  // keys per inner block
  int item_heads = 1;       // kv heads per work item
  int item_rows = 1;        // item_heads * tile_rows
  int scratch_rows = 1;     // item_rows, rounded up to 16 for the AMX kernels
  float q_scale = 1.f;      // sm_scale * k_scale, folded into q
  const float* fp8_table = nullptr;
  int64_t kv_element = 2;   // bytes per K/V element
};

// ---- row loaders: 8 elements of a K/V row widened to float ---------------------------------------
// The kernels below are templates over these, so each storage dtype gets its own inner loops
// (4 instantiations); the scratch path reuses the fp32 one on widened blocks.

// pair(row, i, a, b) widens 16 elements [i, i + 16) into two vectors for the direct decode path.
// kPermuted: bf16 does it with one 32-byte load, a shift and a mask, so `a` holds the even
// elements (i, i + 2, .., i + 14) and `b` the odd ones. The kernels that use pairs keep q and the
// output accumulators in the same order within each group of 16 dims (permute_16 /
// unpermute_16), which leaves every dot product and sum unchanged. The other dtypes fill a and b
// with elements [i, i + 8) and [i + 8, i + 16).
struct Fp32Rows {
  static constexpr bool kPermuted = false;
  __m256 operator()(const char* row, int i) const {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  }
  void pair(const char* row, int i, __m256& a, __m256& b) const {
    a = (*this)(row, i);
    b = (*this)(row, i + 8);
  }
};
struct Bf16Rows {
  static constexpr bool kPermuted = true;
  __m256 operator()(const char* row, int i) const {
    return simd::load8_bf16(reinterpret_cast<const uint16_t*>(row) + i);
  }
  void pair(const char* row, int i, __m256& even, __m256& odd) const {
    const __m256i raw = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(row) + i));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xffff0000u))));
  }
};
struct Fp16Rows {
  static constexpr bool kPermuted = false;
  __m256 operator()(const char* row, int i) const {
    return simd::load8_fp16(reinterpret_cast<const uint16_t*>(row) + i);
  }
  void pair(const char* row, int i, __m256& a, __m256& b) const {
    a = (*this)(row, i);
    b = (*this)(row, i + 8);
  }
};
struct Fp8Rows {
  static constexpr bool kPermuted = false;
  const float* table;  // [256] the format's values
  __m256 operator()(const char* row, int i) const {
    return simd::load8_fp8(reinterpret_cast<const uint8_t*>(row) + i, table);
  }
  void pair(const char* row, int i, __m256& a, __m256& b) const {
    a = (*this)(row, i);
    b = (*this)(row, i + 8);
  }
};

// The pair order of a float row of n (a multiple of 16) elements, in place: within each group of
// 16, the even elements first, then the odd ones. unpermute_16 undoes it.
void permute_16(float* x, int n) {
  for (int b = 0; b < n; b += 16) {
    float t[16];
    for (int i = 0; i < 8; ++i) {
      t[i] = x[b + 2 * i];
      t[8 + i] = x[b + 2 * i + 1];
    }
    std::memcpy(x + b, t, sizeof(t));
  }
}
void unpermute_16(float* x, int n) {
  for (int b = 0; b < n; b += 16) {
    float t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = x[b + i];
      t[2 * i + 1] = x[b + 8 + i];
    }
    std::memcpy(x + b, t, sizeof(t));
  }
}

// ---- scores: s[r][j] = q[r] . k[j] ------------------------------------------------------------
// Key j's row starts at keys[j] + head_offset bytes.

// The 8 sums of a 4-row x 2-key block (row-major pairs, as simd::hsum8 leaves them) into
// s[row * ld + key].
inline void store_4x2(__m256 sums, float* s, int ld) {
  const __m128 rows01 = _mm256_castps256_ps128(sums);
  const __m128 rows23 = _mm256_extractf128_ps(sums, 1);
  _mm_storel_pi(reinterpret_cast<__m64*>(s), rows01);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + ld), rows01);
  _mm_storel_pi(reinterpret_cast<__m64*>(s + 2 * ld), rows23);
  _mm_storeh_pi(reinterpret_cast<__m64*>(s + 3 * ld), rows23);
}

// 4 query rows x 2 keys: 8 accumulators, one hsum8 at the end.
template <typename Load>
inline void dot_4x2(const float* q /*[4, dim]*/, const char* k0, const char* k1, int dim,
                    float* s /*[4, ld]*/, int ld, const Load& load) {
  __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
  __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
  __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
  __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 8) {
    const __m256 k0v = load(k0, i);
    const __m256 k1v = load(k1, i);
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
  store_4x2(sums, s, ld);
}

// 1 query row x 8 keys.
template <typename Load>
inline void dot_1x8(const float* q /*[dim]*/, const char* const* keys, int64_t head_offset,
                    int dim, float* s /*[8]*/, const Load& load) {
  __m256 a[8];
  const char* k[8];
  for (int c = 0; c < 8; ++c) {
    a[c] = _mm256_setzero_ps();
    k[c] = keys[c] + head_offset;
  }
  for (int i = 0; i < dim; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(qv, load(k[c], i), a[c]);
  }
  _mm256_storeu_ps(s, simd::hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
}

template <typename Load>
inline float dot_1x1(const float* q, const char* k, int dim, const Load& load) {
  __m256 a = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load(k, i), a);
  return simd::hsum(a);
}

template <typename Load>
void compute_scores(const float* q /*[rows, dim]*/, int rows, const char* const* keys /*[nk]*/,
                    int64_t head_offset, int nk, int dim, float* s /*[rows, ld]*/, int ld,
                    const Load& load) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const float* qr = q + int64_t(r) * dim;
    float* sr = s + int64_t(r) * ld;
    int j = 0;
    for (; j + 2 <= nk; j += 2) {
      dot_4x2(qr, keys[j] + head_offset, keys[j + 1] + head_offset, dim, sr + j, ld, load);
    }
    for (; j < nk; ++j) {
      for (int rr = 0; rr < 4; ++rr) {
        sr[rr * ld + j] = dot_1x1(qr + rr * dim, keys[j] + head_offset, dim, load);
      }
    }
  }
  for (; r < rows; ++r) {
    const float* qr = q + int64_t(r) * dim;
    float* sr = s + int64_t(r) * ld;
    int j = 0;
    for (; j + 8 <= nk; j += 8) dot_1x8(qr, keys + j, head_offset, dim, sr + j, load);
    for (; j < nk; ++j) sr[j] = dot_1x1(qr, keys[j] + head_offset, dim, load);
  }
}

// ---- o[r] += sum_j p[r][j] * v[j] ----------------------------------------------------------------
// Value j's row starts at values[j] + head_offset bytes.

// 16 elements of a value row from column c: two 8-element loads, or (kPaired) the loader's
// (even, odd) pair, which keeps o in the same pair order as q (the direct path).
template <bool kPaired, typename Load>
inline void load16(const Load& load, const char* row, int c, __m256& a, __m256& b) {
  if constexpr (kPaired) {
    load.pair(row, c, a, b);
  } else {
    a = load(row, c);
    b = load(row, c + 8);
  }
}

// kPaired needs dv % 16 == 0; otherwise dv % 8 == 0.
template <bool kPaired = false, typename Load>
void accumulate_pv(const float* p /*[rows, ld]*/, int ld, int rows,
                   const char* const* values /*[nk]*/, int64_t head_offset, int nk, int dv,
                   float* o /*[rows, dv]*/, const Load& load) {
  const char* v[kKvBlock];
  for (int j = 0; j < nk; ++j) v[j] = values[j] + head_offset;
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
        __m256 v0, v1;
        load16<kPaired>(load, v[j], c, v0, v1);
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
    if constexpr (!kPaired) {
      for (; c < dv; c += 8) {
        __m256 acc[4];
        for (int rr = 0; rr < 4; ++rr) acc[rr] = _mm256_loadu_ps(o0 + rr * dv + c);
        for (int j = 0; j < nk; ++j) {
          const __m256 v0 = load(v[j], c);
          for (int rr = 0; rr < 4; ++rr) {
            acc[rr] = _mm256_fmadd_ps(_mm256_broadcast_ss(p0 + rr * ld + j), v0, acc[rr]);
          }
        }
        for (int rr = 0; rr < 4; ++rr) _mm256_storeu_ps(o0 + rr * dv + c, acc[rr]);
      }
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
        __m256 va, vb, vc, vd;
        load16<kPaired>(load, v[j], c, va, vb);
        load16<kPaired>(load, v[j], c + 16, vc, vd);
        acc[0] = _mm256_fmadd_ps(w, va, acc[0]);
        acc[1] = _mm256_fmadd_ps(w, vb, acc[1]);
        acc[2] = _mm256_fmadd_ps(w, vc, acc[2]);
        acc[3] = _mm256_fmadd_ps(w, vd, acc[3]);
      }
      for (int u = 0; u < 4; ++u) _mm256_storeu_ps(orow + c + 8 * u, acc[u]);
    }
    for (; c + 16 <= dv; c += 16) {
      __m256 a0 = _mm256_loadu_ps(orow + c);
      __m256 a1 = _mm256_loadu_ps(orow + c + 8);
      for (int j = 0; j < nk; ++j) {
        const __m256 w = _mm256_broadcast_ss(pr + j);
        __m256 va, vb;
        load16<kPaired>(load, v[j], c, va, vb);
        a0 = _mm256_fmadd_ps(w, va, a0);
        a1 = _mm256_fmadd_ps(w, vb, a1);
      }
      _mm256_storeu_ps(orow + c, a0);
      _mm256_storeu_ps(orow + c + 8, a1);
    }
    if constexpr (!kPaired) {
      for (; c < dv; c += 8) {
        __m256 acc = _mm256_loadu_ps(orow + c);
        for (int j = 0; j < nk; ++j) {
          acc = _mm256_fmadd_ps(_mm256_broadcast_ss(pr + j), load(v[j], c), acc);
        }
        _mm256_storeu_ps(orow + c, acc);
      }
    }
  }
}

// ---- the direct path's kernels on 16-element pairs (head_dim, v_head_dim multiples of 16) --------

// Keeps v in a register: the compiler otherwise folds each q load into both FMAs that use it
// (two loads per value), and the score loop is then bound by the two 256-bit loads per cycle.
inline void in_register(__m256& v) { __asm__("" : "+x"(v)); }

// 4 query rows x 2 keys, 16 dims a step (the even halves, then the odd ones): 8 accumulators,
// each q vector loaded once for both keys, one hsum8 at the end.
template <typename Load>
inline void pair_dot_4x2(const float* q /*[4, dim]*/, const char* k0, const char* k1, int dim,
                         float* s /*[4, ld]*/, int ld, const Load& load) {
  __m256 acc[4][2];
  for (int rr = 0; rr < 4; ++rr) acc[rr][0] = acc[rr][1] = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 16) {
    __m256 k0a, k0b, k1a, k1b;
    load.pair(k0, i, k0a, k0b);
    load.pair(k1, i, k1a, k1b);
    for (int rr = 0; rr < 4; ++rr) {
      __m256 qa = _mm256_loadu_ps(q + rr * dim + i);
      in_register(qa);
      acc[rr][0] = _mm256_fmadd_ps(qa, k0a, acc[rr][0]);
      acc[rr][1] = _mm256_fmadd_ps(qa, k1a, acc[rr][1]);
    }
    for (int rr = 0; rr < 4; ++rr) {
      __m256 qb = _mm256_loadu_ps(q + rr * dim + i + 8);
      in_register(qb);
      acc[rr][0] = _mm256_fmadd_ps(qb, k0b, acc[rr][0]);
      acc[rr][1] = _mm256_fmadd_ps(qb, k1b, acc[rr][1]);
    }
  }
  const __m256 sums = simd::hsum8(acc[0][0], acc[0][1], acc[1][0], acc[1][1], acc[2][0],
                                  acc[2][1], acc[3][0], acc[3][1]);
  store_4x2(sums, s, ld);
}

// 1 query row x 1 key.
template <typename Load>
inline float pair_dot_1x1(const float* q, const char* k, int dim, const Load& load) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 16) {
    __m256 ka, kb;
    load.pair(k, i, ka, kb);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), ka, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), kb, a1);
  }
  return simd::hsum(_mm256_add_ps(a0, a1));
}

// s[r][j] = q[r] . k[j] for rows x nk (nk small: the direct path passes a pair of keys).
template <typename Load>
inline void pair_scores(const float* q /*[rows, dim]*/, int rows, const char* const* keys,
                        int64_t head_offset, int nk, int dim, float* s /*[rows, ld]*/, int ld,
                        const Load& load) {
  int r = 0;
  if (nk == 2) {
    for (; r + 4 <= rows; r += 4) {
      pair_dot_4x2(q + int64_t(r) * dim, keys[0] + head_offset, keys[1] + head_offset, dim,
                   s + int64_t(r) * ld, ld, load);
    }
  }
  for (; r < rows; ++r) {
    for (int j = 0; j < nk; ++j) {
      s[int64_t(r) * ld + j] = pair_dot_1x1(q + int64_t(r) * dim, keys[j] + head_offset, dim, load);
    }
  }
}

// The scratch path's scores with keys in lanes: the block's keys transposed to kt [dim,
// kKtKeys] (key j of dim d at kt[d * kKtKeys + j]), so s[r][8 keys] accumulates
// broadcast(q[r][d]) * kt[d][8 keys] with no horizontal sums at the end. 4 rows x 3 vectors of
// keys are 12 accumulators, the 3 key vectors and the broadcast fill the other 4 registers; on
// the Zen 3 dev VM this ran 73-93 GFLOP/s a core against 47-55 for the 4 x 2 dot-product kernel.

// In-place transpose of 8 rows of 8 floats.
inline void transpose8(__m256 (&r)[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Widens keys [0, nk) (nk <= kt_stride) of one kv head into kt [dim, kt_stride], keys up to
// the next multiple of `pad` (8 or 16: the score kernel's vector) as zeros.
template <typename Load>
void widen_keys_transposed(const char* const* rows /*[nk]*/, int64_t head_offset, int nk,
                           int dim, float* kt, int kt_stride, int pad, const Load& load) {
  const int padded = (nk + pad - 1) / pad * pad;
  for (int j0 = 0; j0 < padded; j0 += 8) {
    const int n = std::max(0, std::min(8, nk - j0));
    for (int d0 = 0; d0 < dim; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        r[i] = i < n ? load(rows[j0 + i] + head_offset, d0) : _mm256_setzero_ps();
      }
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d0 + i) * kt_stride + j0, r[i]);
    }
  }
}

// One query row's step: a_g += b * k_g for the kGroups key vectors.
template <int kGroups>
inline void kt_row(__m256 b, __m256 k0, __m256 k1, __m256 k2, __m256& a0, __m256& a1,
                   __m256& a2) {
  a0 = _mm256_fmadd_ps(b, k0, a0);
  if (kGroups > 1) a1 = _mm256_fmadd_ps(b, k1, a1);
  if (kGroups > 2) a2 = _mm256_fmadd_ps(b, k2, a2);
}

// s[r][8g, 8g + 8) for kRows rows and kGroups key vectors. Named accumulators: with arrays GCC
// kept them on the stack.
template <int kRows, int kGroups>
void scores_kt(const float* q /*[kRows, dim]*/, int dim, const float* kt, float* s, int ld) {
  static_assert(kRows >= 1 && kRows <= 4 && kGroups >= 1 && kGroups <= 3);
  const __m256 zero = _mm256_setzero_ps();
  __m256 a00 = zero, a01 = zero, a02 = zero, a10 = zero, a11 = zero, a12 = zero;
  __m256 a20 = zero, a21 = zero, a22 = zero, a30 = zero, a31 = zero, a32 = zero;
  const float* q0 = q;
  const float* q1 = q + (kRows > 1 ? dim : 0);
  const float* q2 = q + (kRows > 2 ? 2 * dim : 0);
  const float* q3 = q + (kRows > 3 ? 3 * dim : 0);
  for (int d = 0; d < dim; ++d) {
    const float* kd = kt + d * kKtKeys;
    const __m256 k0 = _mm256_loadu_ps(kd);
    const __m256 k1 = kGroups > 1 ? _mm256_loadu_ps(kd + 8) : zero;
    const __m256 k2 = kGroups > 2 ? _mm256_loadu_ps(kd + 16) : zero;
    kt_row<kGroups>(_mm256_broadcast_ss(q0 + d), k0, k1, k2, a00, a01, a02);
    if (kRows > 1) kt_row<kGroups>(_mm256_broadcast_ss(q1 + d), k0, k1, k2, a10, a11, a12);
    if (kRows > 2) kt_row<kGroups>(_mm256_broadcast_ss(q2 + d), k0, k1, k2, a20, a21, a22);
    if (kRows > 3) kt_row<kGroups>(_mm256_broadcast_ss(q3 + d), k0, k1, k2, a30, a31, a32);
  }
  const __m256 rows[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) _mm256_storeu_ps(s + int64_t(r) * ld + 8 * g, rows[r][g]);
  }
}

template <int kRows>
void scores_kt_rows(int groups, const float* q, int dim, const float* kt, float* s, int ld) {
  switch (groups) {
    case 1: scores_kt<kRows, 1>(q, dim, kt, s, ld); return;
    case 2: scores_kt<kRows, 2>(q, dim, kt, s, ld); return;
    default: scores_kt<kRows, 3>(q, dim, kt, s, ld); return;
  }
}

// s[r][j] = q[r] . k[j] for rows x nk keys from kt; columns up to the next multiple of 8 are
// written too (zero keys: the softmax masks them).
void scores_transposed(const float* q /*[rows, dim]*/, int rows, const float* kt, int nk,
                       int dim, float* s /*[rows, ld]*/, int ld) {
  const int groups = (nk + 7) / 8;
  for (int r = 0; r < rows; r += 4) {
    const float* qr = q + int64_t(r) * dim;
    float* sr = s + int64_t(r) * ld;
    switch (std::min(4, rows - r)) {
      case 1: scores_kt_rows<1>(groups, qr, dim, kt, sr, ld); break;
      case 2: scores_kt_rows<2>(groups, qr, dim, kt, sr, ld); break;
      case 3: scores_kt_rows<3>(groups, qr, dim, kt, sr, ld); break;
      default: scores_kt_rows<4>(groups, qr, dim, kt, sr, ld); break;
    }
  }
}

// Widens one kv head's rows of a block into dst [nk, dim] (the scratch path's values).
template <typename Load>
void widen_block(const char* const* rows /*[nk]*/, int64_t head_offset, int nk, int dim,
                 float* dst, const Load& load) {
  for (int j = 0; j < nk; ++j) {
    const char* row = rows[j] + head_offset;
    float* out = dst + int64_t(j) * dim;
    for (int i = 0; i < dim; i += 8) _mm256_storeu_ps(out + i, load(row, i));
  }
}

// Requests `bytes` from each of rows [0, nk) (each at rows[j] + offset) into L2. The T1 hint
// matters: measured on the 2-core EPYC (Zen 3, family 25 model 1) dev VM, decode 16 x 4096
// bf16 streamed at 17-18 GB/s with T1 against 13-14 GB/s with T0 (and 12 with NTA): T0
// requests hold the small L1 miss queue and stall the core once a block's worth of rows is in
// flight.
void prefetch_rows(const char* const* rows, int nk, int64_t offset, int64_t bytes) {
  for (int j = 0; j < nk; ++j) {
    const char* row = rows[j] + offset;
    for (int64_t b = 0; b < bytes; b += kCacheLine) _mm_prefetch(row + b, _MM_HINT_T1);
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

// The query side of a tile: which request and tokens its rows are.
struct TileRows {
  int request = 0;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  int64_t q_begin = 0;  // first token of the tile, relative to the request
  int tokens = 0;
  int group = 1;
  VisibleRange first_range{0, 0};  // of the first and the last token
  VisibleRange last_range{0, 0};
  /// Custom mask: keys below it are visible to every row (WorkItem::dense_end): blocks below it
  /// read no mask byte.
  int64_t dense_end = 0;
};

// Soft-cap and masks on one kv head's scores for keys [block, block + nk), then the
// online-softmax update of its rows: rescale what each row holds to the new running max and
// leave p = e^(s - max) in s (0 for keys a row does not see, and for the padding up to a
// multiple of 8).
void mask_and_softmax(const AttentionParams& p, const TileRows& tile, int64_t block, int nk,
                      float* s /*[rows, kKvBlock]*/, SoftmaxState* state /*[rows]*/,
                      float* o /*[rows, dv]*/, int dv) {
  const bool custom = p.mask == MaskMode::kCustom;
  const int padded = (nk + 7) & ~7;
  const bool whole_block_visible = (!custom || block + nk <= tile.dense_end) &&
                                   block >= tile.last_range.lo && block + nk <= tile.first_range.hi;
  for (int t = 0; t < tile.tokens; ++t) {
    const int64_t token_t = tile.q_begin + t;
    VisibleRange range{block, block + nk};
    if (!whole_block_visible) range = visible_range(p, tile.q_len, tile.kv_len, token_t);
    const uint8_t* mask_row =
        custom ? custom_mask_row(p, tile.request, tile.q_len, tile.kv_len, token_t) : nullptr;
    for (int g = 0; g < tile.group; ++g) {
      float* srow = s + int64_t(t * tile.group + g) * kKvBlock;
      if (p.logit_cap > 0.f) {
        for (int j = 0; j < padded; j += 8) {
          _mm256_storeu_ps(srow + j, simd::soft_cap8(_mm256_loadu_ps(srow + j), p.logit_cap));
        }
      }
      for (int j = nk; j < padded; ++j) srow[j] = -INFINITY;
      if (!whole_block_visible) {
        for (int j = 0; j < nk; ++j) {
          const int64_t key = block + j;
          if (key < range.lo || key >= range.hi || (mask_row && !mask_row[key])) {
            srow[j] = -INFINITY;
          }
        }
      }
    }
  }
  const int rows = tile.tokens * tile.group;
  for (int row = 0; row < rows; ++row) {
    float* srow = s + int64_t(row) * kKvBlock;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < padded; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(srow + j));
    const float block_max = simd::hmax(vmax);
    if (block_max == -INFINITY) {  // the row sees none of these keys
      std::fill(srow, srow + padded, 0.f);
      continue;
    }
    const float factor = state[row].rescale_for(block_max);
    if (factor != 1.f) {
      float* orow = o + int64_t(row) * dv;
      const __m256 f = _mm256_set1_ps(factor);
      for (int c = 0; c < dv; c += 8) {
        _mm256_storeu_ps(orow + c, _mm256_mul_ps(_mm256_loadu_ps(orow + c), f));
      }
    }
    const __m256 m = _mm256_set1_ps(state[row].max);
    __m256 vsum = _mm256_setzero_ps();
    for (int j = 0; j < padded; j += 8) {
      const __m256 e = simd::exp8(_mm256_sub_ps(_mm256_loadu_ps(srow + j), m));
      _mm256_storeu_ps(srow + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    state[row].sum += simd::hsum(vsum);
  }
}

template <typename Load>
void attend_tile(const CallContext& ctx, const WorkItem& item, ThreadScratch& ws,
                 float* partial_out /*[item_rows, dv] or null*/,
                 float* partial_lse /*[item_rows] or null*/, const Load& load) {
  const AttentionParams& p = *ctx.p;
  const int group = ctx.group;
  const int dim = p.head_dim;
  const int dv = p.v_head_dim;
  TileRows tile;
  tile.request = item.request;
  const int64_t q_start = p.qo_indptr[item.request];
  tile.q_len = p.qo_indptr[item.request + 1] - q_start;
  const int64_t kv_start = p.kv_indptr[item.request];
  tile.kv_len = p.kv_indptr[item.request + 1] - kv_start;
  tile.q_begin = item.q_begin;
  tile.tokens = item.q_end - item.q_begin;
  tile.group = group;
  tile.first_range = visible_range(p, tile.q_len, tile.kv_len, item.q_begin);
  tile.last_range = visible_range(p, tile.q_len, tile.kv_len, item.q_end - 1);
  tile.dense_end = item.dense_end;
  const int rows = tile.tokens * group;  // per kv head
  const int num_heads = item.head_end - item.head_begin;
  const int64_t io_element = dtype_size(p.io_dtype);
  auto row_of = [&](int h, int t, int g) { return h * ctx.tile_rows + t * group + g; };
  // The direct path works on 16-element pairs when both dims allow; with a permuting loader
  // (bf16), q and o are then in pair order until the output is normalized.
  const bool pairs = ctx.direct && dim % 16 == 0 && dv % 16 == 0;
  // q in pair order feeds the AVX2 pair kernels only; o is in pair order for them and for the
  // BF16 kernels' P.V on both paths (undone at normalization).
  const bool q_pair_order = pairs && Load::kPermuted;
  const bool o_pair_order = q_pair_order || ctx.bf16_dot;
  // The BF16 kernels take rows 4 at a time: a tile's last rows up to the next multiple of 4
  // (still inside the kv head's tile_rows) get zero queries on the direct path and zero weights
  // in P on the scratch path; their outputs are never read.
  // (The AMX kernels take rows 16 at a time, likewise.)
  const int kernel_rows = ctx.bf16_dot ? (rows + 3) / 4 * 4 : ctx.amx ? (rows + 15) / 16 * 16 : rows;
  // bf16 q as given: the direct path's vdpbf16ps scores and the AMX tiles.
  const bool q_as_bf16 = (ctx.bf16_dot && ctx.direct) || ctx.amx;

  // Queries, pre-scaled so that q . k is the logit (the BF16 kernels scale the scores instead).
  for (int h = 0; h < num_heads; ++h) {
    for (int t = 0; t < tile.tokens; ++t) {
      const int64_t token = q_start + item.q_begin + t;
      for (int g = 0; g < group; ++g) {
        const int head = (item.head_begin + h) * group + g;
        const char* src = static_cast<const char*>(p.q) +
                          (token * p.q_stride_token + int64_t(head) * p.q_stride_head) * io_element;
        if (q_as_bf16) {  // bf16 q as given; the kernel scales the scores
          std::memcpy(ws.q_bf16.data() + int64_t(row_of(h, t, g)) * dim, src,
                      size_t(dim) * sizeof(uint16_t));
          continue;
        }
        float* qrow = ws.q.data() + int64_t(row_of(h, t, g)) * dim;
        load_row(src, p.io_dtype, dim, ctx.q_scale, qrow);
        if (q_pair_order) permute_16(qrow, dim);
      }
    }
  }
  for (int h = 0; h < num_heads; ++h) {
    const int64_t first = int64_t(h) * ctx.tile_rows;
    if (q_as_bf16 && kernel_rows > rows) {
      std::fill(ws.q_bf16.begin() + (first + rows) * dim,
                ws.q_bf16.begin() + (first + kernel_rows) * dim, uint16_t(0));
    }
    std::fill(ws.o.begin() + first * dv,
              ws.o.begin() + (first + (ctx.amx ? kernel_rows : rows)) * dv, 0.f);
    std::fill(ws.state.begin() + first, ws.state.begin() + first + rows, SoftmaxState{});
  }

  // Each key's slot (or ragged row) start, for the current and the next block; head h of the
  // item is head_offset(h) bytes further.
  const char* k_base = static_cast<const char*>(p.k);
  const char* v_base = static_cast<const char*>(p.v);
  const int64_t k_head_bytes = p.k_stride_head * ctx.kv_element;
  const int64_t v_head_bytes = p.v_stride_head * ctx.kv_element;
  auto k_head_offset = [&](int h) { return (item.head_begin + h) * k_head_bytes; };
  auto v_head_offset = [&](int h) { return (item.head_begin + h) * v_head_bytes; };
  const int64_t k_row_bytes = dim * ctx.kv_element;  // one head's row
  const int64_t v_row_bytes = dv * ctx.kv_element;
  const char* k_rows[2][kKvBlock];
  const char* v_rows[2][kKvBlock];
  auto fill_rows = [&](int64_t block_begin, int nk, const char** k_out, const char** v_out) {
    for (int j = 0; j < nk; ++j) {
      const int64_t row = p.kv_indices ? int64_t(p.kv_indices[kv_start + block_begin + j])
                                       : kv_start + block_begin + j;
      k_out[j] = k_base + row * p.k_stride_token * ctx.kv_element;
      v_out[j] = v_base + row * p.v_stride_token * ctx.kv_element;
    }
  };
  // The scratch path's widened value rows.
  const char* v_scratch_rows[kKvBlock];
  if (!ctx.direct) {
    for (int j = 0; j < kKvBlock; ++j) {
      v_scratch_rows[j] = reinterpret_cast<const char*>(ws.v.data() + int64_t(j) * dv);
    }
  }

  int buffer = 0;
  if (item.kv_begin < item.kv_end) {
    fill_rows(item.kv_begin, std::min<int>(ctx.kv_block, item.kv_end - item.kv_begin), k_rows[0],
              v_rows[0]);
  }
  for (int64_t block = item.kv_begin; block < item.kv_end; block += ctx.kv_block) {
    const int nk = int(std::min<int64_t>(ctx.kv_block, item.kv_end - block));
    const int64_t next = block + ctx.kv_block;
    const int next_nk =
        next < item.kv_end ? int(std::min<int64_t>(ctx.kv_block, item.kv_end - next)) : 0;
    if (next_nk > 0) fill_rows(next, next_nk, k_rows[buffer ^ 1], v_rows[buffer ^ 1]);
    const char* const* keys = k_rows[buffer];
    const char* const* values = v_rows[buffer];

    if (ctx.direct) {
      // Keys two (four on the BF16 kernels) at a time across all heads: each key's row is read
      // front to back. Alongside each head's keys, ask for its values of this block (used after
      // the softmax) and its keys of the next block: a few lines per step keeps the misses in
      // flight without stalling on a burst of prefetches.
      const char* const* next_keys = k_rows[buffer ^ 1];
      const int step = ctx.bf16_dot ? 4 : 2;
      for (int j = 0; j < nk; j += step) {
        const int count = std::min(step, nk - j);
        const int next_count = std::max(0, std::min(step, next_nk - j));
        for (int h = 0; h < num_heads; ++h) {
          prefetch_rows(values + j, count, v_head_offset(h), v_row_bytes);
          prefetch_rows(next_keys + j, next_count, k_head_offset(h), k_row_bytes);
          const int64_t first_row = int64_t(h) * ctx.tile_rows;
          float* s = ws.s.data() + first_row * kKvBlock + j;
          if (ctx.bf16_dot) {
            avx512::scores_bf16(ws.q_bf16.data() + first_row * dim, kernel_rows, keys + j,
                                k_head_offset(h), count, dim, ctx.q_scale, s, kKvBlock);
          } else if (pairs) {
            pair_scores(ws.q.data() + first_row * dim, rows, keys + j, k_head_offset(h), count,
                        dim, s, kKvBlock, load);
          } else {
            compute_scores(ws.q.data() + first_row * dim, rows, keys + j, k_head_offset(h),
                           count, dim, s, kKvBlock, load);
          }
        }
      }
      for (int h = 0; h < num_heads; ++h) {
        const int64_t first_row = int64_t(h) * ctx.tile_rows;
        mask_and_softmax(p, tile, block, nk, ws.s.data() + first_row * kKvBlock,
                         ws.state.data() + first_row, ws.o.data() + first_row * dv, dv);
        if (ctx.bf16_dot) {
          avx512::accumulate_pv_bf16(ws.s.data() + first_row * kKvBlock, kKvBlock, kernel_rows,
                                     values, v_head_offset(h), nk, dv,
                                     ws.o.data() + first_row * dv);
        } else if (pairs) {
          accumulate_pv<true>(ws.s.data() + first_row * kKvBlock, kKvBlock, rows, values,
                             v_head_offset(h), nk, dv, ws.o.data() + first_row * dv, load);
        } else {
          accumulate_pv(ws.s.data() + first_row * kKvBlock, kKvBlock, rows, values,
                        v_head_offset(h), nk, dv, ws.o.data() + first_row * dv, load);
        }
      }
    } else {
      // Widen each head's block once; all of the tile's rows then use it from L1.
      if (next_nk > 0) {
        for (int h = 0; h < num_heads; ++h) {
          prefetch_rows(k_rows[buffer ^ 1], next_nk, k_head_offset(h), k_row_bytes);
          prefetch_rows(v_rows[buffer ^ 1], next_nk, v_head_offset(h), v_row_bytes);
        }
      }
      for (int h = 0; h < num_heads; ++h) {
        const int64_t first_row = int64_t(h) * ctx.tile_rows;
        float* s = ws.s.data() + first_row * kKvBlock;
        if (ctx.amx) {  // S = Q K^T and O += P V on the tile unit, K and V packed per block
          uint16_t* kp = reinterpret_cast<uint16_t*>(ws.k.data());
          uint16_t* vp = reinterpret_cast<uint16_t*>(ws.v.data());
          // Blocks whose rows see keys from the block's start (no custom mask or soft-cap, the
          // window's lower bound not inside) take the AVX-512 softmax, which also scales the
          // scores; a causal row's upper bound is a per-row key count there.
          const bool plain =
              (p.mask != MaskMode::kCustom || block + nk <= tile.dense_end) &&
              p.logit_cap <= 0.f && block >= tile.last_range.lo;
          amx::pack_keys(keys, k_head_offset(h), nk, dim, kp);
          amx::scores(ws.q_bf16.data() + first_row * dim, kernel_rows, dim, kp,
                      plain ? 1.f : ctx.q_scale, s, kKvBlock);
          if (plain) {
            const int64_t first_hi =
                visible_range(p, tile.q_len, tile.kv_len, tile.q_begin).hi - block;
            const int first_limit = int(std::min<int64_t>(first_hi, amx::kBlockKeys));
            const int per_token = p.mask == MaskMode::kCausal ? group : (1 << 30);
            amx::softmax_rows(s, kKvBlock, rows, nk, first_limit, per_token, ctx.q_scale,
                              ws.state.data() + first_row, ws.o.data() + first_row * dv, dv);
          } else {
            mask_and_softmax(p, tile, block, nk, s, ws.state.data() + first_row,
                             ws.o.data() + first_row * dv, dv);
          }
          amx::pack_values(values, v_head_offset(h), nk, dv, vp);
          amx::accumulate_pv(s, kKvBlock, kernel_rows, nk, vp, dv, ws.o.data() + first_row * dv);
          continue;
        }
        if (ctx.bf16_dot) {  // keys in 16 lanes; values straight from the pool
          widen_keys_transposed(keys, k_head_offset(h), nk, dim, ws.k.data(), kWidenKvBlock, 16,
                                load);
          avx512::scores_keys_in_lanes(ws.q.data() + first_row * dim, rows, ws.k.data(),
                                       kWidenKvBlock, nk, dim, s, kKvBlock);
          mask_and_softmax(p, tile, block, nk, s, ws.state.data() + first_row,
                           ws.o.data() + first_row * dv, dv);
          // P.V takes rows 4 at a time: the padding rows weigh nothing.
          std::fill(s + int64_t(rows) * kKvBlock, s + int64_t(kernel_rows) * kKvBlock, 0.f);
          avx512::accumulate_pv_bf16(s, kKvBlock, kernel_rows, values, v_head_offset(h), nk, dv,
                                     ws.o.data() + first_row * dv);
          continue;
        }
        for (int j = 0; j < nk; j += kKtKeys) {
          const int count = std::min(kKtKeys, nk - j);
          widen_keys_transposed(keys + j, k_head_offset(h), count, dim, ws.k.data(), kKtKeys, 8,
                                load);
          scores_transposed(ws.q.data() + first_row * dim, rows, ws.k.data(), count, dim, s + j,
                            kKvBlock);
        }
        mask_and_softmax(p, tile, block, nk, s, ws.state.data() + first_row,
                         ws.o.data() + first_row * dv, dv);
        widen_block(values, v_head_offset(h), nk, dv, ws.v.data(), load);
        accumulate_pv(s, kKvBlock, rows, v_scratch_rows, 0, nk, dv,
                      ws.o.data() + first_row * dv, Fp32Rows{});
      }
    }
    buffer ^= 1;
  }

  // Normalize; v_scale (fp8 storage) multiplies every value row, so it folds in here.
  const int64_t out_element = dtype_size(ctx.out_dtype);
  for (int h = 0; h < num_heads; ++h) {
    for (int t = 0; t < tile.tokens; ++t) {
      const int64_t token = q_start + item.q_begin + t;
      for (int g = 0; g < group; ++g) {
        const int row = row_of(h, t, g);
        const int head = (item.head_begin + h) * group + g;
        float* orow = ws.o.data() + int64_t(row) * dv;
        const SoftmaxState& state = ws.state[size_t(row)];
        const float lse = state.lse();
        if (o_pair_order) unpermute_16(orow, dv);
        const __m256 inv = _mm256_set1_ps(state.sum > 0.f ? p.v_scale / state.sum : 0.f);
        for (int c = 0; c < dv; c += 8) {
          _mm256_storeu_ps(orow + c, _mm256_mul_ps(_mm256_loadu_ps(orow + c), inv));
        }
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
}

// Runs one item with the loader of the call's K/V dtype.
void attend_item(const CallContext& ctx, const WorkItem& item, ThreadScratch& ws,
                 float* partial_out, float* partial_lse) {
  switch (ctx.p->kv_dtype) {
    case DType::kBFloat16: attend_tile(ctx, item, ws, partial_out, partial_lse, Bf16Rows{}); return;
    case DType::kFloat16: attend_tile(ctx, item, ws, partial_out, partial_lse, Fp16Rows{}); return;
    case DType::kFloat32: attend_tile(ctx, item, ws, partial_out, partial_lse, Fp32Rows{}); return;
    default:  // fp8 (check_params accepted only float dtypes)
      attend_tile(ctx, item, ws, partial_out, partial_lse, Fp8Rows{ctx.fp8_table});
      return;
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

// The keys [0, end) that every row of a custom-mask tile sees: end is the first 0 byte of any
// of its rows (an engine's verify mask keeps the prefix: then the tile's blocks there read no
// mask byte and take the unmasked softmax).
int64_t custom_mask_dense_end(const AttentionParams& p, int request, int64_t q_len,
                              int64_t kv_len, int64_t q_begin, int64_t q_end) {
  int64_t end = kv_len;
  for (int64_t t = q_begin; t < q_end && end > 0; ++t) {
    const uint8_t* row = custom_mask_row(p, request, q_len, kv_len, t);
    const void* zero = std::memchr(row, 0, size_t(end));
    if (zero != nullptr) end = static_cast<const uint8_t*>(zero) - row;
  }
  return end;
}

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
      if (slot >= 0 && slot < p.num_slots) continue;  // the argument name is built on failure only
      check_arg(false, "kv_indices[" + std::to_string(i) + "]", "slot ", slot,
                " outside the pool [0, ", p.num_slots, ")");
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
  int64_t max_q_len = 1;
  for (int r = 0; r < p.batch_size; ++r) {
    max_q_len = std::max<int64_t>(max_q_len, p.qo_indptr[r + 1] - p.qo_indptr[r]);
  }
  // Deterministic mode (BackendConfig::deterministic): tiles of a fixed token count, whatever
  // the batch's longest request, so a token's tile (its key blocks, its kernel) depends on its
  // request alone; decode then takes the scratch path too.
  const int64_t tile_cap = p.deterministic ? INT64_MAX : max_q_len;
  ctx.tile_tokens = int(std::min<int64_t>(std::max(1, kTileRows / ctx.group), tile_cap));
  ctx.tile_rows = ctx.tile_tokens * ctx.group;
  ctx.direct = ctx.tile_rows <= kDirectRows;
  // The AVX-512 BF16 kernels take bf16 q and K/V (q used as given: its scores need no rounding
  // the AVX2 path does not do), 4 rows at a time and 32 dims a step, on both paths.
  ctx.bf16_dot = p.io_dtype == DType::kBFloat16 &&
                 p.kv_dtype == DType::kBFloat16 && ctx.tile_rows % 4 == 0 &&
                 p.head_dim % 32 == 0 && p.v_head_dim % 32 == 0 && avx512::bf16_available();
  // Tiles of many rows (prefill, extend, large verify trees) run on the AMX tile unit where the
  // CPU has it: bf16 q and K/V, 16 rows and 32 dims a tile step, 64 keys a block.
  ctx.amx = !ctx.direct && p.io_dtype == DType::kBFloat16 && p.kv_dtype == DType::kBFloat16 &&
            p.head_dim % 32 == 0 && p.v_head_dim % 64 == 0 && amx::available();
  if (ctx.amx) {
    ctx.bf16_dot = false;
    // Larger tiles: each block of K/V (gathered and packed once per tile) then serves 8x the
    // rows, which the gather of page-1 slots needs (bench/NOTES.md, "CPU prefill on AMX":
    // 1 x 4096 prefill 302 ms at 64 rows, 219 at 128, 195 at 256, 180 at 512, 186 at 1024).
    static const int amx_rows = env_tile_rows();
    ctx.tile_tokens = int(std::min<int64_t>(std::max(1, amx_rows / ctx.group), tile_cap));
    ctx.tile_rows = ctx.tile_tokens * ctx.group;
  }
  ctx.item_heads = ctx.direct ? p.num_kv_heads : 1;
  ctx.kv_block = ctx.direct                                 ? kDirectKvBlock
                 : ctx.amx                                  ? amx::kBlockKeys
                 : std::max(p.head_dim, p.v_head_dim) > 128 ? kWideDimWidenKvBlock
                                                            : kWidenKvBlock;
  ctx.item_rows = ctx.item_heads * ctx.tile_rows;
  ctx.scratch_rows = ctx.amx ? (ctx.item_rows + 15) / 16 * 16 : ctx.item_rows;
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
      int64_t dense_end = 0;
      if (p.mask == MaskMode::kCustom) {
        span = custom_mask_span(p, r, q_len, kv_len, q0, q1, span);
        dense_end = custom_mask_dense_end(p, r, q_len, kv_len, q0, q1);
      }
      for (int h = 0; h < p.num_kv_heads; h += ctx.item_heads) {
        WorkItem item;
        item.request = r;
        item.head_begin = h;
        item.head_end = std::min(p.num_kv_heads, h + ctx.item_heads);
        item.q_begin = int32_t(q0);
        item.q_end = int32_t(q1);
        item.kv_begin = int32_t(span.lo);
        item.kv_end = int32_t(span.hi);
        item.dense_end = int32_t(dense_end);
        // Rows x keys, plus a constant per tile for loading q and writing the output.
        item.cost = (q1 - q0) * ctx.group * (item.head_end - item.head_begin) *
                    (span.hi - span.lo + 16);
        total_cost += item.cost;
        w.items.push_back(item);
      }
    }
  }

  // Split the tiles that hold much more than a fair share of the work along the KV axis
  // (deterministic mode: every tile longer than kDeterministicSplitKeys, in chunks of that many
  // keys from the tile's first key, whatever the batch and the thread count).
  int64_t num_partials = 0;
  if (threads > 1 || p.deterministic) {
    const int64_t target = std::max<int64_t>(1, total_cost / (int64_t(threads) * kItemsPerThread));
    const size_t num_tiles = w.items.size();
    for (size_t i = 0; i < num_tiles; ++i) {
      WorkItem& tile = w.items[i];
      const int64_t span = tile.kv_end - tile.kv_begin;
      int64_t chunk = 0;
      if (p.deterministic) {
        if (span <= kDeterministicSplitKeys) continue;
        chunk = kDeterministicSplitKeys;
      } else {
        if (tile.cost <= target || span < 2 * kMinSplitKeys) continue;
        const int64_t pieces =
            std::min<int64_t>((tile.cost + target - 1) / target, span / kMinSplitKeys);
        if (pieces < 2) continue;
        chunk = (span + pieces - 1) / pieces;
        chunk = (chunk + ctx.kv_block - 1) / ctx.kv_block * ctx.kv_block;
      }
      MergeItem merge;
      merge.request = tile.request;
      merge.head_begin = tile.head_begin;
      merge.head_end = tile.head_end;
      merge.q_begin = tile.q_begin;
      merge.q_end = tile.q_end;
      merge.first_partial = num_partials;
      const WorkItem whole = tile;
      for (int64_t begin = whole.kv_begin; begin < whole.kv_end; begin += chunk) {
        WorkItem piece = whole;
        piece.kv_begin = int32_t(begin);
        piece.kv_end = int32_t(std::min<int64_t>(whole.kv_end, begin + chunk));
        piece.partial = num_partials++;
        piece.cost = (whole.q_end - whole.q_begin) * ctx.group *
                     (whole.head_end - whole.head_begin) * (piece.kv_end - piece.kv_begin);
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
    scratch.q.resize(size_t(ctx.scratch_rows) * dim);
    if ((ctx.bf16_dot && ctx.direct) || ctx.amx) {
      scratch.q_bf16.resize(size_t(ctx.scratch_rows) * dim);
    }
    scratch.o.resize(size_t(ctx.scratch_rows) * dv);
    scratch.s.resize(size_t(ctx.scratch_rows) * kKvBlock);
    // (the AMX path packs the block's keys and values, in bf16, into k and v)
    scratch.k.resize(size_t(dim) * kWidenKvBlock);
    scratch.v.resize(size_t(kKvBlock) * dv);
    scratch.state.resize(size_t(ctx.scratch_rows));
  }
  w.partial_out.resize(size_t(num_partials) * ctx.item_rows * dv);
  w.partial_lse.resize(size_t(num_partials) * ctx.item_rows);

  pool.parallel_for(int64_t(w.items.size()), [&](int64_t index, int thread_id) {
    const WorkItem& item = w.items[size_t(index)];
    float* partial_out = nullptr;
    float* partial_lse = nullptr;
    if (item.partial >= 0) {
      partial_out = w.partial_out.data() + item.partial * ctx.item_rows * dv;
      partial_lse = w.partial_lse.data() + item.partial * ctx.item_rows;
    }
    attend_item(ctx, item, w.threads[size_t(thread_id)], partial_out, partial_lse);
  });

  if (w.merges.empty()) return;
  const int64_t out_element = dtype_size(out_dtype);
  pool.parallel_for(int64_t(w.merges.size()), [&](int64_t index, int thread_id) {
    const MergeItem& merge = w.merges[size_t(index)];
    ThreadScratch& scratch = w.threads[size_t(thread_id)];
    std::vector<const float*> outs(static_cast<size_t>(merge.num_partials));
    std::vector<float> lses(static_cast<size_t>(merge.num_partials));
    const int64_t q_start = p.qo_indptr[merge.request];
    for (int h = 0; h < merge.head_end - merge.head_begin; ++h) {
      for (int t = 0; t < merge.q_end - merge.q_begin; ++t) {
        const int64_t token = q_start + merge.q_begin + t;
        for (int g = 0; g < ctx.group; ++g) {
          const int row = h * ctx.tile_rows + t * ctx.group + g;
          const int head = (merge.head_begin + h) * ctx.group + g;
          for (int i = 0; i < merge.num_partials; ++i) {
            const int64_t slot = merge.first_partial + i;
            outs[size_t(i)] = w.partial_out.data() + (slot * ctx.item_rows + row) * dv;
            lses[size_t(i)] = w.partial_lse[size_t(slot * ctx.item_rows + row)];
          }
          const float lse = merge_partials(outs.data(), lses.data(), merge.num_partials, dv,
                                           scratch.o.data());
          char* dst = static_cast<char*>(p.out) +
                      (token * p.out_stride_token + int64_t(head) * p.out_stride_head) *
                          out_element;
          store_row(scratch.o.data(), dv, out_dtype, dst);
          if (p.lse) p.lse[token * p.num_q_heads + head] = lse;
        }
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

void apply_sinks(const TensorView& sinks, const float* lse, int64_t num_tokens, int num_q_heads,
                 int v_head_dim, void* out, int64_t out_stride_token, int64_t out_stride_head,
                 DType out_dtype, ThreadPool& pool) {
  std::vector<float> sink(static_cast<size_t>(num_q_heads));
  for (int h = 0; h < num_q_heads; ++h) {
    const char* at = static_cast<const char*>(sinks.data()) + h * dtype_size(sinks.dtype());
    uint16_t bits = 0;
    if (sinks.dtype() == DType::kFloat32) {
      std::memcpy(&sink[size_t(h)], at, sizeof(float));
      continue;
    }
    std::memcpy(&bits, at, sizeof(bits));
    sink[size_t(h)] = sinks.dtype() == DType::kBFloat16 ? bf16_to_float(bits) : fp16_to_float(bits);
  }
  constexpr int64_t kTokensPerChunk = 64;
  const int64_t num_chunks = (num_tokens + kTokensPerChunk - 1) / kTokensPerChunk;
  const int64_t out_element = dtype_size(out_dtype);
  pool.parallel_for(num_chunks, [&](int64_t chunk, int) {
    // load_row may write a few floats past n (it works in vector widths): room for them.
    std::vector<float> row_values(static_cast<size_t>(v_head_dim) + 16);
    const int64_t end = std::min(num_tokens, (chunk + 1) * kTokensPerChunk);
    for (int64_t token = chunk * kTokensPerChunk; token < end; ++token) {
      for (int head = 0; head < num_q_heads; ++head) {
        const float row_lse = lse[token * num_q_heads + head];
        // No key: the row is zero and stays zero (the sink has no value).
        const float factor =
            row_lse == -INFINITY ? 0.f : 1.f / (1.f + std::exp(sink[size_t(head)] - row_lse));
        char* dst = static_cast<char*>(out) +
                    (token * out_stride_token + int64_t(head) * out_stride_head) * out_element;
        load_row(dst, out_dtype, v_head_dim, factor, row_values.data());
        store_row(row_values.data(), v_head_dim, out_dtype, dst);
      }
    }
  });
}

}  // namespace kvattn::cpu
