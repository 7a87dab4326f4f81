// The online-softmax state and its merge: the one definition of the numerics, shared by the
// CPU kernels, the CUDA split-KV reduction and the ragged + paged-prefix merge.
//
// A partial attention over some keys is (m, d, o): m the largest scaled logit seen, d the sum
// of exp(logit - m), o the output already divided by d. Its log-sum-exp is m + ln(d) (natural
// log, the library's convention). An empty partial has m = -inf, d = 0, o = 0 and LSE -inf.
#pragma once

#include <cmath>

#include "core/host_device.h"

namespace kvattn::core {

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
