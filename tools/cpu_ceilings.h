// The host's ceilings, measured in the same run as the CPU benchmark rows (SPEC §6).
#pragma once

#include <cstdint>

namespace kvattn::tools {

/// Read-only streaming bandwidth: every core reads its share of a `bytes` buffer (>= 1 GiB,
/// far past the last-level cache) with 32-byte AVX2 loads. GB/s, median of `passes`.
double measure_cpu_read_gbps(int64_t bytes, int passes);

/// The same read, but of whole `row_bytes` rows (multiple of 32) taken in a random order, each
/// read front to back with plain loads: the access pattern of a decode over shuffled page-1 slots
/// (a row = one slot of K or V) or pages of 16. Not a ceiling (a kernel that keeps more misses
/// in flight can beat it): a reference for what this memory system gives the pattern, which on a
/// VM whose host maps guest memory with small pages is bound by TLB misses. GB/s, median.
double measure_cpu_random_rows_gbps(int64_t bytes, int64_t row_bytes, int passes);

/// The fp32 FMA rate of all cores (independent AVX2 FMA chains, no memory traffic): the compute
/// ceiling the CPU backend's prefill is held to. GFLOP/s, median of `passes`.
double measure_cpu_fma_gflops(int passes);

/// The compute ceiling of the CPU backend's AVX-512 BF16 kernels (q . k on vdpbf16ps, 64 FLOP
/// an instruction; P . V on 16-lane fp32 FMAs): the faster of the two rates on all cores. NaN
/// where those kernels do not run (no AVX-512 BF16, or KVATTN_CPU_ISA=avx2). GFLOP/s, each the
/// median of `passes`.
double measure_cpu_avx512_gflops(int passes);

/// The AMX-BF16 tile rate of all cores (independent tdpbf16ps chains): the ceiling of the CPU
/// prefill where its tiles run on AMX. NaN where they do not (no AMX, or KVATTN_CPU_ISA=avx512
/// or avx2). GFLOP/s, median of `passes`.
double measure_cpu_amx_gflops(int passes);

/// Last-level cache size in bytes (32 MiB when the system does not say).
int64_t cpu_last_level_cache_bytes();

}  // namespace kvattn::tools
