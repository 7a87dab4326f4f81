// The online-softmax state and its merge: the one definition of the numerics, shared by the
// CPU kernels, the CUDA split-KV reduction and the ragged + paged-prefix merge.
//
// A partial attention over some keys is (m, d, o): m the largest scaled logit seen, d the sum
// of exp(logit - m), o the output already divided by d. Its log-sum-exp is m + ln(d) (natural
// log, the library's convention). An empty partial has m = -inf, d = 0, o = 0 and LSE -inf.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace kvattn::core {

/// 2^x from adds and multiplies alone: on the GPU it runs on the FMA pipe, so a softmax can
/// take a share of its exponentials off the MUFU (16 a clock an SM, while one warp's 64
/// exponentials of a Hopper prefill block would hold it 512 cycles with the FMA pipe idle:
/// FA4's trick; bench/NOTES.md, twenty-third session).
///
/// x = j + f with j = round(x) and |f| <= 1/2; 2^f by a degree-3 polynomial, minimax in
/// relative error under p(0) = 1 (1.0e-4: below a bf16 or fp16 P's rounding); j enters the
/// exponent by an integer add. For x <= 126. x <= -127, -inf and NaN give exactly +0: x is
/// clamped to -127, where p(0) = 1 and j = -127 cancel the exponent, so a masked score adds
/// nothing, as with the hardware exponential.
KVATTN_HOST_DEVICE float exp2_poly(float x) {
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: x + kRound holds round(x) in its low bits
  x = fmaxf(x, -127.f);
  const float t = x + kRound;
  const float f = x - (t - kRound);
  const float p = fmaf(fmaf(fmaf(0.05500893f, f, 0.24221100f), f, 0.69328290f), f, 1.f);
  // (bits(t) << 23) mod 2^32 is j << 23: kRound's own bits shift out.
#if defined(__CUDA_ARCH__)
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(t) << 23));
#else
  return std::bit_cast<float>(std::bit_cast<uint32_t>(p) + (std::bit_cast<uint32_t>(t) << 23));
#endif
}

/// Two partial states' weights in their merge: w_a + w_b == 1 unless both are empty (then 0).
/// lse_a, lse_b are natural-log LSEs (-inf for an empty partial). Writes the merged LSE.
KVATTN_HOST_DEVICE void merge_weights(float lse_a, float lse_b, float* weight_a, float* weight_b,
                                      float* lse_merged) {
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) {  // both empty: the merged state is empty too
    *weight_a = 0.f;
    *weight_b = 0.f;
    *lse_merged = -INFINITY;
    return;
  }
  const float ea = expf(lse_a - m);
  const float eb = expf(lse_b - m);
  const float inv = 1.f / (ea + eb);
  *weight_a = ea * inv;
  *weight_b = eb * inv;
  *lse_merged = m + logf(ea + eb);
}

/// Running state of one query row while keys stream by (used by the CPU kernels; the CUDA
/// kernels keep the same three quantities in registers).
struct SoftmaxState {
  float max = -INFINITY;  ///< m
  float sum = 0.f;        ///< d, relative to max

  /// Takes a block whose largest logit is block_max; returns the factor by which the already
  /// accumulated output and sum must be scaled (exp(old_max - new_max)).
  KVATTN_HOST_DEVICE float rescale_for(float block_max) {
    const float new_max = fmaxf(max, block_max);
    const float factor = (max == -INFINITY) ? 0.f : expf(max - new_max);
    max = new_max;
    sum *= factor;
    return factor;
  }
  /// Natural-log LSE; -inf when nothing was seen.
  KVATTN_HOST_DEVICE float lse() const { return sum > 0.f ? max + logf(sum) : -INFINITY; }
};

/// Soft-cap of a scaled logit: cap * tanh(x / cap), identity when cap <= 0.
KVATTN_HOST_DEVICE float apply_logit_cap(float x, float cap) {
  return cap > 0.f ? cap * tanhf(x / cap) : x;
}

}  // namespace kvattn::core
