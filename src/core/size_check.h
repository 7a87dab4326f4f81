// Size arithmetic before an allocation (issue: a refused call leaves no trace): byte counts are
// multiplied without overflow and compared with what the device can hold, so an impossible
// request is refused in microseconds, with the numbers, before anything is allocated or planned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kvattn/tensor.h"

namespace kvattn::core {

/// The product of `factors` (each >= 0), or throws kOutOfResources naming `what` when it does
/// not fit in size_t (or a factor is negative: kInvalidArgument).
size_t checked_bytes(std::initializer_list<int64_t> factors, const std::string& what);

/// a + b, or throws kOutOfResources naming `what` on overflow.
size_t checked_sum(size_t a, size_t b, const std::string& what);

/// Memory `device` can hand out now: for a CUDA device the free bytes (cudaMemGetInfo), for the
/// host the physical memory available (MemAvailable, else all physical pages).
size_t available_bytes(Device device);

/// Throws kOutOfResources ("<what>: needs N bytes (X GiB), <device> has M bytes free") unless
/// `bytes` fit in available_bytes(device).
void check_fits(Device device, size_t bytes, const std::string& what);

}  // namespace kvattn::core
