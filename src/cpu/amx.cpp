#include "cpu/amx.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() (see bf16_avx512.cpp).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

// Only functions with this attribute use AMX or AVX-512; the file is compiled with the library's
// AVX2 flags like the rest (bf16_avx512.cpp says why).
#define KVATTN_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace kvattn::cpu::amx {
namespace {

constexpr int kTileElems = 16 * 32;          // one 16 x 32 bf16 B tile (1 KiB)
constexpr float kRescaleAbove = 5.5451774f;  // 8 ln 2

// Accumulators 0..3 += A tile 4 times the four B tiles at b (kTileElems apart): a 16-row by
// 64-column pass, B through tiles 5..7 (the fourth reuses 5 once its first product is issued).
KVATTN_AMX inline __attribute__((always_inline)) void dp_four_b_tiles(const uint16_t* b) {
  _tile_loadd(5, b, 64);
  _tile_loadd(6, b + kTileElems, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(7, b + 2 * kTileElems, 64);
  _tile_loadd(5, b + 3 * kTileElems, 64);
  _tile_dpbf16ps(2, 4, 7);
  _tile_dpbf16ps(3, 4, 5);
}

// Linux keeps the AMX tile data off until a process asks for it (arch_prctl).
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

bool detect() {
  const char* isa = std::getenv("KVATTN_CPU_ISA");
  if (isa != nullptr && (std::strcmp(isa, "avx2") == 0 || std::strcmp(isa, "avx512") == 0)) {
    return false;
  }
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bf16"))) {
    return false;
  }
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d >> 22) & 1;
  const bool amx_tile = (d >> 24) & 1;
  if (!amx_bf16 || !amx_tile) return false;
  // The OS must save the tile state (XCR0 bits 17 and 18)...
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if (((xcr0_lo >> 17) & 3) != 3) return false;
  // ... and let this process use it.
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Palette 1, tiles 0..7 all 16 rows x 64 bytes (16 fp32 or 32 bf16 a row).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0};
};

KVATTN_AMX inline void load_config() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

// The first `count` of 16 lanes (none for count <= 0, all for count >= 16).
inline __mmask16 first_lanes(int count) {
  return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// r[0..15] (16 rows of 16 dwords) transposed in place: r[c][n] = old r[n][c].
KVATTN_AMX inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // Within each 128-bit lane L, u[4 i + j] holds column 4 L + j of rows 4 i .. 4 i + 3.
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Column 4 L + j gathers lane L of u[j], u[4 + j], u[8 + j], u[12 + j].
  for (int j = 0; j < 4; ++j) {
    const __m512i lo01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i hi01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
    const __m512i lo23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i hi23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
    r[0 + j] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(lo01, lo23, 0xdd);
    r[8 + j] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(hi01, hi23, 0xdd);
  }
}

// e^x in 16 lanes for x <= 0 (and -inf): 2^(x log2 e) = 2^n 2^f with n the nearest integer and
// |f| <= 1/2, 2^f by its degree-5 Taylor polynomial (relative error < 2e-6, far below the bf16
// rounding P gets next), 2^n by scalef; lanes below -87.3 (and -inf) give 0.
KVATTN_AMX inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365478515625f), _CMP_GE_OQ);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);                  // ln2^5 / 120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

}  // namespace

bool available() {
  static const bool ok = detect();
  return ok;
}

KVATTN_AMX void pack_keys(const char* const* keys, int64_t head_offset, int nk, int dim,
                          uint16_t* kp) {
  const int chunks = dim / 32;
  for (int g = 0; g < kBlockKeys / 16; ++g) {
    for (int c = 0; c < chunks; ++c) {
      __m512i r[16];
      for (int n = 0; n < 16; ++n) {
        const int key = 16 * g + n;
        r[n] = key < nk ? _mm512_loadu_si512(keys[key] + head_offset + int64_t(c) * 64)
                        : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t* tile = kp + int64_t(c * 4 + g) * kTileElems;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + i * 32, r[i]);
    }
  }
}

KVATTN_AMX void scores(const uint16_t* q, int rows, int dim, const uint16_t* kp, float scale,
                       float* s, int ld) {
  load_config();
  const int chunks = dim / 32;
  const __m512 f = _mm512_set1_ps(scale);
  int r0 = 0;
  // Two row groups x two key groups a pass: 4 tile loads feed 4 products (the 1 x 4 form below,
  // for a last group of 16 rows, needs 5).
  for (; r0 + 32 <= rows; r0 += 32) {
    for (int g0 = 0; g0 < 4; g0 += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < chunks; ++c) {
        _tile_loadd(4, q + int64_t(r0) * dim + c * 32, dim * 2);
        const uint16_t* b = kp + (int64_t(c) * 4 + g0) * kTileElems;
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + kTileElems, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, q + int64_t(r0 + 16) * dim + c * 32, dim * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      float* dst = s + int64_t(r0) * ld + g0 * 16;
      _tile_stored(0, dst, ld * 4);
      _tile_stored(1, dst + 16, ld * 4);
      _tile_stored(2, dst + 16 * ld, ld * 4);
      _tile_stored(3, dst + 16 * ld + 16, ld * 4);
    }
    if (scale == 1.f) continue;  // (softmax_rows scales on its way)
    for (int r = 0; r < 32; ++r) {
      float* row = s + int64_t(r0 + r) * ld;
      for (int j = 0; j < kBlockKeys; j += 16) {
        _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), f));
      }
    }
  }
  for (; r0 < rows; r0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < chunks; ++c) {
      _tile_loadd(4, q + int64_t(r0) * dim + c * 32, dim * 2);
      dp_four_b_tiles(kp + int64_t(c) * 4 * kTileElems);
    }
    float* dst = s + int64_t(r0) * ld;
    _tile_stored(0, dst, ld * 4);
    _tile_stored(1, dst + 16, ld * 4);
    _tile_stored(2, dst + 32, ld * 4);
    _tile_stored(3, dst + 48, ld * 4);
    if (scale == 1.f) continue;  // (softmax_rows scales on its way)
    for (int r = 0; r < 16; ++r) {
      float* row = dst + int64_t(r) * ld;
      for (int j = 0; j < kBlockKeys; j += 16) {
        _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), f));
      }
    }
  }
}

KVATTN_AMX void softmax_rows(float* s, int ld, int rows, int nk, int first_limit, int group,
                             float scale, core::SoftmaxState* state, float* o, int dv) {
  const int vectors = (nk + 15) / 16;
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  const __m512 f = _mm512_set1_ps(scale);
  for (int r = 0; r < rows; ++r) {
    float* row = s + int64_t(r) * ld;
    // Keys [0, visible) of the block are this row's (a causal row sees up to its diagonal).
    const int visible = first_limit + r / group < 0 ? 0 : std::min(nk, first_limit + r / group);
    if (visible == 0) {  // p = 0, the state unchanged
      for (int i = 0; i < vectors; ++i) _mm512_storeu_ps(row + 16 * i, _mm512_setzero_ps());
      continue;
    }
    __m512 v[kBlockKeys / 16];
    __m512 vmax = minus_inf;
    for (int i = 0; i < vectors; ++i) {
      const int left = visible - 16 * i;
      v[i] = _mm512_mask_mul_ps(minus_inf, first_lanes(left), _mm512_loadu_ps(row + 16 * i), f);
      vmax = _mm512_max_ps(vmax, v[i]);
    }
    // The row's reference max moves only when the block's max exceeds it by more than
    // kRescaleAbove (p stays <= 2^8: exact enough in the fp32 sums and in a bf16 P), so the
    // rescale of o is rare once a row has seen its first keys (the GPU kernels' rule, FA4's);
    // the common case needs no horizontal max, only a compare.
    const bool stays =
        state[r].max != -INFINITY &&
        _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(state[r].max + kRescaleAbove), _CMP_GT_OQ) == 0;
    if (!stays) {
      const float factor = state[r].rescale_for(_mm512_reduce_max_ps(vmax));
      if (factor != 1.f) {
        float* orow = o + int64_t(r) * dv;
        const __m512 by = _mm512_set1_ps(factor);
        for (int c = 0; c < dv; c += 16) {
          _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(orow + c), by));
        }
      }
    }
    const __m512 m = _mm512_set1_ps(state[r].max);
    __m512 vsum = _mm512_setzero_ps();
    for (int i = 0; i < vectors; ++i) {
      const __m512 e = exp16(_mm512_sub_ps(v[i], m));
      _mm512_storeu_ps(row + 16 * i, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    state[r].sum += _mm512_reduce_add_ps(vsum);
  }
}

KVATTN_AMX void pack_values(const char* const* values, int64_t head_offset, int nk, int dv,
                            uint16_t* vp) {
  // Element 2 n of a packed row is key a's dim n, element 2 n + 1 key b's.
  alignas(64) static const uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                       21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i index = _mm512_load_si512(kInterleave);
  const int col_tiles = dv / 16;
  const int key_chunks = (nk + 31) / 32;
  for (int kc = 0; kc < key_chunks; ++kc) {
    for (int i = 0; i < 16; ++i) {
      const int a = 32 * kc + 2 * i;
      const int b = a + 1;
      const char* row_a = a < nk ? values[a] + head_offset : nullptr;
      const char* row_b = b < nk ? values[b] + head_offset : nullptr;
      for (int t = 0; t < col_tiles; ++t) {
        const __m256i va = row_a ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_a) + t)
                                 : _mm256_setzero_si256();
        const __m256i vb = row_b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_b) + t)
                                 : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1);
        uint16_t* dst = vp + (int64_t(kc) * col_tiles + t) * kTileElems + i * 32;
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(index, both));
      }
    }
  }
}

KVATTN_AMX void accumulate_pv(const float* p, int ld, int rows, int nk, const uint16_t* vp, int dv,
                              float* o) {
  load_config();
  const int key_chunks = (nk + 31) / 32;
  const int width = key_chunks * 32;
  const int col_tiles = dv / 16;
  alignas(64) uint16_t pb[32 * kBlockKeys];  // up to 32 rows of P in bf16, kBlockKeys a row
  for (int r0 = 0; r0 < rows;) {
    const int group_rows = rows - r0 >= 32 ? 32 : 16;
    for (int r = 0; r < group_rows; ++r) {
      const float* src = p + int64_t(r0 + r) * ld;
      for (int j = 0; j < width; j += 16) {
        const int left = nk - j;
        const __m512 v = _mm512_maskz_loadu_ps(first_lanes(left), src + j);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + r * kBlockKeys + j),
                            (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
    if (group_rows == 32) {
      // Two row groups x two column tiles a pass: 4 tile loads feed 4 products.
      for (int t0 = 0; t0 < col_tiles; t0 += 2) {
        float* od = o + int64_t(r0) * dv + t0 * 16;
        _tile_loadd(0, od, dv * 4);
        _tile_loadd(1, od + 16, dv * 4);
        _tile_loadd(2, od + 16 * dv, dv * 4);
        _tile_loadd(3, od + 16 * dv + 16, dv * 4);
        for (int kc = 0; kc < key_chunks; ++kc) {
          const uint16_t* b = vp + (int64_t(kc) * col_tiles + t0) * kTileElems;
          _tile_loadd(4, pb + kc * 32, kBlockKeys * 2);
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + kTileElems, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, pb + 16 * kBlockKeys + kc * 32, kBlockKeys * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, od, dv * 4);
        _tile_stored(1, od + 16, dv * 4);
        _tile_stored(2, od + 16 * dv, dv * 4);
        _tile_stored(3, od + 16 * dv + 16, dv * 4);
      }
    } else {
      for (int t0 = 0; t0 < col_tiles; t0 += 4) {
        float* od = o + int64_t(r0) * dv + t0 * 16;
        _tile_loadd(0, od, dv * 4);
        _tile_loadd(1, od + 16, dv * 4);
        _tile_loadd(2, od + 32, dv * 4);
        _tile_loadd(3, od + 48, dv * 4);
        for (int kc = 0; kc < key_chunks; ++kc) {
          _tile_loadd(4, pb + kc * 32, kBlockKeys * 2);
          dp_four_b_tiles(vp + (int64_t(kc) * col_tiles + t0) * kTileElems);
        }
        _tile_stored(0, od, dv * 4);
        _tile_stored(1, od + 16, dv * 4);
        _tile_stored(2, od + 32, dv * 4);
        _tile_stored(3, od + 48, dv * 4);
      }
    }
    r0 += group_rows;
  }
}

}  // namespace kvattn::cpu::amx
