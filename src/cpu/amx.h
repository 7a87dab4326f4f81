// AMX-BF16 kernels of the CPU prefill / extend / verify tiles (Intel Sapphire Rapids onward):
// S = Q K^T and O += P V on the tile unit (tdpbf16ps: 16 x 16 fp32 += 16 x 32 bf16 x 32 x 16
// bf16), picked at run time like the AVX-512 BF16 kernels (bf16_avx512.h), which stay the path of
// decode-shaped tiles and of CPUs without AMX.
//
// Layouts (all row-major, strides in elements):
//   q     [rows, dim] bf16 as given (rows a multiple of 16; padding rows zero)
//   kp    the block's keys packed by pack_keys: per 32-dim chunk c and 16-key group g, a B tile
//         of 16 rows (dim pairs) x 16 keys x 2: kp[((c * 4 + g) * 16 + i) * 32 + 2 n + e] =
//         K[16 g + n][32 c + 2 i + e]; keys past nk are zero (the block holds 64)
//   vp    the block's values packed by pack_values: per 32-key chunk kc and 16-dim column tile
//         t, a B tile of 16 rows (key pairs) x 16 dims x 2: vp[((kc * dv / 16 + t) * 16 + i) *
//         32 + 2 n + e] = V[32 kc + 2 i + e][16 t + n]; keys past nk are zero
//   s, p  [rows, ld] fp32 scores / probabilities
//   o     [rows, dv] fp32, natural order
// Nothing here allocates or uses std containers: every function carries the AMX / AVX-512
// target attribute, the file is compiled with the library's baseline flags (see bf16_avx512.cpp).
#pragma once

#include <cstdint>

#include "core/softmax_state.h"

namespace kvattn::cpu::amx {

/// Keys per block the kernels take (the tile's kv block).
constexpr int kBlockKeys = 64;

/// True when the CPU has AMX-TILE and AMX-BF16 (and AVX-512 BF16), the kernel lets this process
/// use the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM), and KVATTN_CPU_ISA is neither
/// "avx2" nor "avx512" (which keep the older kernels, e.g. to compare).
bool available();

/// Packs keys [0, nk) of a block (key j's bf16 row at keys[j] + head_offset bytes, dim % 32 == 0,
/// nk <= kBlockKeys) into kp ([dim * kBlockKeys] bf16), zero for keys past nk.
void pack_keys(const char* const* keys, int64_t head_offset, int nk, int dim, uint16_t* kp);

/// s[r * ld + j] = scale * (q[r] . k_j) for r < rows (a multiple of 16) and all kBlockKeys
/// columns j (keys past nk give 0). ld >= kBlockKeys. scale 1 skips the multiply (for
/// softmax_rows, which scales itself).
void scores(const uint16_t* q, int rows, int dim, const uint16_t* kp, float scale, float* s,
            int ld);

/// The online-softmax update of rows [0, rows) over a block of nk (<= kBlockKeys) keys without
/// a custom mask, window or soft-cap: s[r * ld + j] becomes e^(s - max_r) for j < nk, 0 up
/// to the next multiple of 16, with state[r].max the row's reference max. That max moves (and
/// o's row r, dv floats, is rescaled) only when the block's max exceeds it by more than 8 ln 2,
/// so e^(s - max) <= 256 (the GPU kernels' rule); the state stays exact (lse = max + ln sum).
/// The AVX-512 form of the CPU kernels' mask_and_softmax without masks.
/// Row r sees keys [0, min(nk, first_limit + r / group)) of the block (a causal tile's rows,
/// group q heads a token; pass first_limit >= nk when every row sees the whole block); keys past
/// it get p = 0.
/// The scores are multiplied by `scale` first (pass 1 when scores() scaled them already).
void softmax_rows(float* s, int ld, int rows, int nk, int first_limit, int group, float scale,
                  core::SoftmaxState* state, float* o, int dv);

/// Packs values [0, nk) of a block (value j's bf16 row at values[j] + head_offset bytes,
/// dv % 32 == 0, nk <= kBlockKeys) into vp ([kBlockKeys * dv] bf16), zero for keys past nk
/// (up to the next multiple of 32).
void pack_values(const char* const* values, int64_t head_offset, int nk, int dv, uint16_t* vp);

/// o[r] += sum_j p[r * ld + j] * v_j for r < rows (a multiple of 16) and j < nk; p is rounded
/// to bf16 (as the GPU kernels round P), columns past nk count as zero.
void accumulate_pv(const float* p, int ld, int rows, int nk, const uint16_t* vp, int dv, float* o);

}  // namespace kvattn::cpu::amx
