#include "cpu_ceilings.h"

#include <immintrin.h>

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wuninitialized reports.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "kvattn/memory.h"
#include "tool_support.h"

namespace kvattn::tools {
namespace {

/// Runs work(thread_index) on all cores, started together; returns the wall seconds from the
/// common start to the last finish.
template <typename Work>
double run_on_all_cores(int threads, Work work) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      work(t);
    });
  }
  while (ready.load() < threads) {
  }
  const auto start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& worker : workers) worker.join();
  return seconds_since(start);
}

/// XOR of every 32-byte vector in [begin, end): four loads in flight per iteration.
__m256i read_range(const __m256i* begin, const __m256i* end) {
  __m256i a = _mm256_setzero_si256();
  __m256i b = a, c = a, d = a;
  const __m256i* p = begin;
  for (; p + 4 <= end; p += 4) {
    a = _mm256_xor_si256(a, _mm256_load_si256(p));
    b = _mm256_xor_si256(b, _mm256_load_si256(p + 1));
    c = _mm256_xor_si256(c, _mm256_load_si256(p + 2));
    d = _mm256_xor_si256(d, _mm256_load_si256(p + 3));
  }
  for (; p < end; ++p) a = _mm256_xor_si256(a, _mm256_load_si256(p));
  return _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
}

/// Read-only bandwidth over a `bytes` buffer on all cores. row_bytes == 0: each core reads its
/// contiguous share front to back. Otherwise the buffer is rows of row_bytes (a multiple of 32)
/// taken in one random order, each read front to back; each core takes its share of the order.
double read_gbps(int64_t bytes, int64_t row_bytes, int passes) {
  const int threads = host_threads();
  const int64_t row_vectors = row_bytes > 0 ? row_bytes / 32 : 0;
  const int64_t num_rows = row_bytes > 0 ? bytes / row_bytes : 0;
  const int64_t num_vectors = row_bytes > 0 ? num_rows * row_vectors : bytes / 32;
  Buffer buffer = Buffer::allocate(Device::cpu(), size_t(num_vectors) * 32);
  // Random content written by all cores: pages are touched before timing, never zero pages.
  fill_random(buffer.view(DType::kFloat32, {num_vectors * 8}), 0x5eed, 1.f);
  const auto* data = static_cast<const __m256i*>(buffer.data());
  std::vector<int32_t> order(static_cast<size_t>(num_rows));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(0x5eed));
  std::vector<uint64_t> sinks(size_t(threads) * 8);
  std::vector<double> gbps;
  for (int pass = 0; pass < passes + 1; ++pass) {
    const double seconds = run_on_all_cores(threads, [&](int t) {
      const int64_t units = row_bytes > 0 ? num_rows : num_vectors;
      const int64_t chunk = (units + threads - 1) / threads;
      const int64_t first = std::min(units, t * chunk);
      const int64_t last = std::min(units, first + chunk);
      __m256i acc = _mm256_setzero_si256();
      if (row_bytes == 0) {
        acc = read_range(data + first, data + last);
      } else {
        for (int64_t i = first; i < last; ++i) {
          const __m256i* row = data + int64_t(order[size_t(i)]) * row_vectors;
          acc = _mm256_xor_si256(acc, read_range(row, row + row_vectors));
        }
      }
      sinks[size_t(t) * 8] = uint64_t(_mm256_extract_epi64(acc, 0));
    });
    if (pass > 0) gbps.push_back(double(num_vectors) * 32 / seconds / 1e9);  // pass 0 warms up
  }
  return median(gbps);
}

}  // namespace

double measure_cpu_read_gbps(int64_t bytes, int passes) {
  return read_gbps(bytes, 0, passes);
}

double measure_cpu_random_rows_gbps(int64_t bytes, int64_t row_bytes, int passes) {
  return read_gbps(bytes, row_bytes, passes);
}

namespace {

// Independent accumulator chains: enough to cover the latency (4-5 cycles) times two ports.
constexpr int kChains = 12;
constexpr int64_t kIterations = 20'000'000;

// kChains AVX2 FMA chains for kIterations steps: kChains * 8 * 2 FLOP a step.
float fma_chains(int t) {
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(float(c + t));
  const __m256 mul = _mm256_set1_ps(0.999999f);
  const __m256 add = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < kIterations; ++i) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], mul, add);
  }
  __m256 total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm256_add_ps(total, acc[c]);
  return _mm256_cvtss_f32(total);
}

// kChains vdpbf16ps chains (16 lanes x 2 products, a multiply and an add each): kChains * 64
// FLOP a step. Compiled for AVX-512 BF16 through the attribute alone; called only where the CPU
// has it.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) float bf16_dot_chains(int t) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(float(c + t));
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 6e-8
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  for (int64_t i = 0; i < kIterations; ++i) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
  return _mm512_reduce_add_ps(total);
}

// The same FMA chains 16 lanes wide (the AVX-512 kernels' P . V): kChains * 16 * 2 FLOP a step.
__attribute__((target("avx512f"))) float fma512_chains(int t) {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(float(c + t));
  const __m512 mul = _mm512_set1_ps(0.999999f);
  const __m512 add = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < kIterations; ++i) {
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], mul, add);
  }
  __m512 total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
  return _mm512_reduce_add_ps(total);
}

// Four independent tdpbf16ps chains (16 x 16 fp32 += 16 x 32 by 32 x 16 bf16: 16384 FLOP
// each), the AMX kernels' instruction. Called only where amx::available() (which also asked the
// kernel for the tile state) said so.
struct alignas(64) AmxConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
};
constexpr int kAmxChains = 4;
__attribute__((target("amx-tile,amx-bf16"))) float amx_chains(int t) {
  static const AmxConfig config;
  alignas(64) static const uint16_t ones[16 * 32] = {};
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  for (int64_t i = 0; i < kIterations / 16; ++i) {
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 5);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  return out[t % 256];
}

// GFLOP/s of `chains` on all cores, median of `passes` after a warm-up pass.
double chains_gflops(int passes, double flops_per_step, float (*chains)(int)) {
  const int threads = host_threads();
  std::vector<float> sinks(size_t(threads) * 16);
  std::vector<double> gflops;
  for (int pass = 0; pass < passes + 1; ++pass) {
    const double seconds =
        run_on_all_cores(threads, [&](int t) { sinks[size_t(t) * 16] = chains(t); });
    const double flops = double(threads) * kIterations * flops_per_step;
    if (pass > 0) gflops.push_back(flops / seconds / 1e9);
  }
  return median(gflops);
}

}  // namespace

double measure_cpu_fma_gflops(int passes) {
  return chains_gflops(passes, kChains * 8 * 2, fma_chains);
}

double measure_cpu_avx512_gflops(int passes) {
  if (!cpu_backend_info().avx512_bf16) return std::numeric_limits<double>::quiet_NaN();
  return std::max(chains_gflops(passes, kChains * 16 * 2, fma512_chains),
                  chains_gflops(passes, kChains * 16 * 2 * 2, bf16_dot_chains));
}

double measure_cpu_amx_gflops(int passes) {
  if (!cpu_backend_info().amx_bf16) return std::numeric_limits<double>::quiet_NaN();
  return chains_gflops(passes, double(kAmxChains) * 16 * 16 * 32 * 2 / 16, amx_chains);
}

int64_t cpu_last_level_cache_bytes() {
  long bytes = -1;
#if defined(_SC_LEVEL3_CACHE_SIZE)
  bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  return bytes > 0 ? int64_t(bytes) : int64_t(32) << 20;
}

}  // namespace kvattn::tools
