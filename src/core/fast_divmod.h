// Division of a non-negative int by a divisor fixed for a whole launch, as a multiply-high and a
// shift (Granlund and Montgomery's method; CUTLASS's FastDivmod is the same idea): the kernels
// map a packed row (token x GQA group + head) to its token and head this way, where a division
// by a runtime int is ~25 dependent instructions and its temporaries.
//
// For a divisor d >= 2 with l = ceil(log2 d): m = ceil(2^(31 + l) / d) fits 32 bits, and
// floor(n m / 2^(31 + l)) = floor(n / d) for every 0 <= n < 2^31 (m d - 2^(31 + l) < d <= 2^l,
// so the error term stays below 1/d). The host builds it once (the plan's PrefillTiles carries
// it); a quotient is then one multiply-high and one shift (d == 1: a select).
#pragma once

#include <cstdint>

#include "core/host_device.h"

namespace kvattn::core {

struct FastDivmod {
  int32_t divisor = 1;
  uint32_t multiplier = 0;  ///< 0: divisor 1 (the quotient is n)
  uint32_t shift = 0;

  FastDivmod() = default;
  /// d >= 1 (the caller checks; a plan's group size is).
  explicit FastDivmod(int32_t d) : divisor(d) {
    if (d <= 1) return;
    uint32_t l = 0;
    while ((uint64_t{1} << l) < static_cast<uint64_t>(d)) ++l;
    const uint64_t p2 = uint64_t{1} << (31 + l);
    multiplier =
        static_cast<uint32_t>((p2 + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
    shift = l - 1;
  }

  /// floor(n / divisor) for 0 <= n < 2^31.
  KVATTN_HOST_DEVICE int div(int n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(static_cast<uint32_t>(n), multiplier);
#else
    const uint32_t high =
        static_cast<uint32_t>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * multiplier) >> 32);
#endif
    return multiplier == 0 ? n : static_cast<int>(high >> shift);
  }
  /// n = quotient x divisor + remainder, for 0 <= n < 2^31.
  KVATTN_HOST_DEVICE int divmod(int n, int& remainder) const {
    const int q = div(n);
    remainder = n - q * divisor;
    return q;
  }
};

}  // namespace kvattn::core
