// The host's ceilings, measured in the same run as the CPU benchmark rows (SPEC §6).
#pragma once

#include <cstdint>

namespace kvattn::tools {

/// Read-only streaming bandwidth: every core reads its share of a `bytes` buffer (>= 1 GiB,
/// far past the last-level cache) with 32-byte AVX2 loads. GB/s, median of `passes`.
double measure_cpu_read_gbps(int64_t bytes, int passes);

/// The fp32 FMA rate of all cores (independent AVX2 FMA chains, no memory traffic): the compute
/// ceiling the CPU backend's prefill is held to. GFLOP/s, median of `passes`.
double measure_cpu_fma_gflops(int passes);

/// Last-level cache size in bytes (32 MiB when the system does not say).
int64_t cpu_last_level_cache_bytes();

}  // namespace kvattn::tools
