// Timing of the prefill kernel on the grid of SPEC §6, next to the cuBLAS bf16 GEMM ceiling
// measured in the same run. Runs only with KVATTN_PREFILL_BENCH=1 (it takes seconds of device
// time); prints a table and, with KVATTN_PREFILL_BENCH_JSON=<path>, writes the rows there.
//
// Timing: the plan is built once, outside; a CUDA graph of 10 launches is replayed (2 warm-up
// replays, median of 9 timed with CUDA events) and the time divided by 10. Inputs are random (never
// zeros), and larger than L2 where the shape allows. KVATTN_PREFILL_BENCH_EAGER=1 also times the
// same launches issued eagerly, before the graph (a row's second timing runs on a GPU that has
// been busy longer: bench/NOTES.md, twelfth session). KVATTN_PREFILL_BENCH_ONLY=<row> times one
// row (for a profiler).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"
#include "cuda/kernels/prefill.h"
#include "cuda_test_support.h"
#include "kvattn/dtype.h"
#include "kvattn/error.h"
#include "kvattn/memory.h"

namespace kvattn::cuda {
namespace {

using ::kvattn::testing::DeviceBytes;

// Random bf16 in [-1, 1) from a cheap generator (hundreds of MB are filled).
void fill_random_bf16(void* device, size_t count, uint64_t seed) {
  std::vector<uint16_t> host(count);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < count; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float f = float(int32_t(x >> 40) - (1 << 23)) / float(1 << 23);
    host[i] = float_to_bf16(f);
  }
  cudaMemcpy(device, host.data(), count * 2, cudaMemcpyHostToDevice);
}

template <typename F>
double median_ms(F&& run, int warmup, int reps, cudaStream_t stream = nullptr) {
  for (int i = 0; i < warmup; ++i) run();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(start, stream);
    run();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double gemm_bf16_tflops() {
  const int n = 8192;
  DeviceBytes a(size_t(n) * n * 2), b(size_t(n) * n * 2), c(size_t(n) * n * 2);
  fill_random_bf16(a.ptr, size_t(n) * n, 1);
  fill_random_bf16(b.ptr, size_t(n) * n, 2);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 0;
  const float alpha = 1.f, beta = 0.f;
  auto run = [&]() {
    cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.ptr, CUDA_R_16BF, n, b.ptr,
                 CUDA_R_16BF, n, &beta, c.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                 CUBLAS_GEMM_DEFAULT);
  };
  const double ms = median_ms(run, 3, 10);
  cublasDestroy(handle);
  return 2.0 * n * n * double(n) / (ms * 1e-3) / 1e12;
}

struct Workload {
  std::string name;
  int batch;
  int prefix;  // cached tokens before the new ones (extend)
  int q_len;   // new tokens per request
  int head_dim;
  bool paged;           // page 1, shuffled slots
  bool custom = false;  // a tree mask (TARGET_VERIFY): prefix visible, random tree over q_len
  bool tc = false;      // the decode-shaped kernel (launch_tc_decode) instead of the prefill one
};

struct Row {
  Workload w;
  double ms;
  double tflops;
  int items;
};

Row time_workload(const Workload& w) {
  const int hq = 32, hkv = 8, d = w.head_dim;
  const int kv_len = w.prefix + w.q_len;
  std::vector<int32_t> qo_indptr{0};
  std::vector<int64_t> kv_indptr{0};
  for (int r = 0; r < w.batch; ++r) {
    qo_indptr.push_back(qo_indptr.back() + w.q_len);
    kv_indptr.push_back(kv_indptr.back() + kv_len);
  }
  const int64_t total_q = qo_indptr.back(), total_kv = kv_indptr.back();
  DeviceBytes q(size_t(total_q) * hq * d * 2), out(size_t(total_q) * hq * d * 2);
  DeviceBytes k(size_t(total_kv) * hkv * d * 2), v(size_t(total_kv) * hkv * d * 2);
  fill_random_bf16(q.ptr, size_t(total_q) * hq * d, 3);
  fill_random_bf16(k.ptr, size_t(total_kv) * hkv * d, 4);
  fill_random_bf16(v.ptr, size_t(total_kv) * hkv * d, 5);
  std::vector<int32_t> slots(total_kv);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937(6));
  DeviceBytes qo_d(qo_indptr.size() * 4), kv_d(kv_indptr.size() * 8), idx_d(slots.size() * 4);
  cudaMemcpy(qo_d.ptr, qo_indptr.data(), qo_indptr.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(kv_d.ptr, kv_indptr.data(), kv_indptr.size() * 8, cudaMemcpyHostToDevice);
  cudaMemcpy(idx_d.ptr, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice);

  core::AttentionParams p;
  p.q = q.ptr;
  p.q_stride_token = int64_t(hq) * d;
  p.q_stride_head = d;
  p.out = out.ptr;
  p.out_stride_token = int64_t(hq) * d;
  p.out_stride_head = d;
  p.io_dtype = p.kv_dtype = DType::kBFloat16;
  p.k = k.ptr;
  p.v = v.ptr;
  p.k_stride_token = p.v_stride_token = int64_t(hkv) * d;
  p.k_stride_head = p.v_stride_head = d;
  p.batch_size = w.batch;
  p.qo_indptr = static_cast<const int32_t*>(qo_d.ptr);
  p.kv_indptr = static_cast<const int64_t*>(kv_d.ptr);
  p.kv_indices = w.paged ? static_cast<const int32_t*>(idx_d.ptr) : nullptr;
  p.num_slots = total_kv;
  p.mask = w.custom ? core::MaskMode::kCustom : core::MaskMode::kCausal;
  // Tree masks: token i's parent is a random earlier token (or the root); a row sees the prefix,
  // its ancestors and itself.
  std::vector<uint8_t> mask;
  std::vector<int64_t> mask_indptr{0};
  if (w.custom) {
    std::mt19937 rng(7);
    for (int r = 0; r < w.batch; ++r) {
      std::vector<int> parent(w.q_len, -1);
      for (int i = 1; i < w.q_len; ++i) parent[i] = int(rng() % (i + 1)) - 1;
      for (int i = 0; i < w.q_len; ++i) {
        std::vector<uint8_t> row(kv_len, 0);
        std::fill(row.begin(), row.begin() + w.prefix, 1);
        for (int a = i; a >= 0; a = parent[a]) row[w.prefix + a] = 1;
        mask.insert(mask.end(), row.begin(), row.end());
      }
      mask_indptr.push_back(int64_t(mask.size()));
    }
  }
  DeviceBytes mask_d(mask.size()), mask_indptr_d(mask_indptr.size() * 8);
  if (w.custom) {
    cudaMemcpy(mask_d.ptr, mask.data(), mask.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(mask_indptr_d.ptr, mask_indptr.data(), mask_indptr.size() * 8,
               cudaMemcpyHostToDevice);
    p.custom_mask = static_cast<const uint8_t*>(mask_d.ptr);
    p.mask_indptr = static_cast<const int64_t*>(mask_indptr_d.ptr);
  }
  p.sm_scale = 1.f / std::sqrt(float(d));
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = p.v_head_dim = d;

  const PrefillKernelShape shape = w.tc ? tc_decode_kernel_shape(d, d) : prefill_kernel_shape(d);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  core::PrefillTileShape ts;
  ts.num_q_heads = hq;
  ts.num_kv_heads = hkv;
  ts.tile_rows = shape.tile_rows;
  ts.kv_tile = shape.kv_tile;
  ts.mask = p.mask;
  ts.concurrent_ctas = sms * shape.ctas_per_sm;
  if (!w.tc) ts.l2_keys = shape.l2_keys;  // the backend's order (cuda_backend.cpp)
  if (w.tc) {
    const char* split = std::getenv("KVATTN_TC_DECODE_MIN_SPLIT");
    ts.min_split_keys = split != nullptr ? std::atoi(split) : 256;
  }
  const core::PrefillTilePlan plan = core::plan_prefill_tiles(qo_indptr, kv_indptr, ts);
  const core::PrefillBufferLayout layout =
      core::write_prefill_buffer(plan, d, nullptr, 0, nullptr, nullptr);
  std::vector<unsigned char> meta(layout.metadata_bytes);
  DeviceBytes buffer(layout.total_bytes);
  core::PrefillTiles tiles;
  core::write_prefill_buffer(plan, d, meta.data(), meta.size(), buffer.ptr, &tiles);
  cudaMemcpy(buffer.ptr, meta.data(), meta.size(), cudaMemcpyHostToDevice);

  // Time replays of a CUDA graph of kGraphCalls launches, so host launch work stays out of the
  // numbers of small shapes (SPEC §6 times the calls of a step the same way).
  constexpr int kGraphCalls = 10;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  auto launch = [&]() {
    if (w.tc) {
      launch_tc_decode(p, tiles, stream);
    } else {
      launch_batch_prefill(p, tiles, stream);
    }
  };
  launch();  // warm-up outside the capture
  if (std::getenv("KVATTN_PREFILL_BENCH_EAGER") != nullptr) {
    // The same launches issued eagerly, back to back (how an engine's eager prefill runs them):
    // compares with the graph's time.
    auto launches = [&]() {
      for (int i = 0; i < kGraphCalls; ++i) launch();
    };
    const double eager = median_ms(launches, 2, 9, stream) / kGraphCalls;
    std::printf("eager %s b%d q%d: %.1f us\n", w.name.c_str(), w.batch, w.q_len, eager * 1e3);
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < kGraphCalls; ++i) launch();
  cudaStreamEndCapture(stream, &graph);
  cudaGraphInstantiate(&exec, graph, 0);
  const double ms = median_ms([&]() { cudaGraphLaunch(exec, stream); }, 2, 9, stream) / kGraphCalls;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  // Visible (query, key) pairs under the bottom-right causal mask; for a plain prefill this is
  // s(s+1)/2, the s^2/2 of SPEC §6 up to 1/s.
  double pairs = 0;
  for (int i = 0; i < w.q_len; ++i) pairs += double(w.prefix + i + 1);
  pairs *= w.batch;
  const double flops = 4.0 * hq * d * pairs;
  return Row{w, ms, flops / (ms * 1e-3) / 1e12, static_cast<int>(plan.items.size())};
}

TEST(PrefillBench, Grid) {
  if (std::getenv("KVATTN_PREFILL_BENCH") == nullptr) GTEST_SKIP() << "set KVATTN_PREFILL_BENCH=1";
  if (kvattn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const double gemm = gemm_bf16_tflops();
  std::vector<Workload> grid = {
      {"prefill", 1, 0, 16384, 128, false}, {"prefill", 1, 0, 16384, 128, true},
      {"prefill", 1, 0, 4096, 128, false},  {"prefill", 1, 0, 1024, 128, false},
      {"prefill", 8, 0, 2048, 128, false},  {"extend", 8, 4096, 512, 128, true},
      {"prefill", 1, 0, 4096, 64, false},   {"prefill", 1, 0, 4096, 256, false},
  };
  const size_t grid_rows = grid.size();
  // Past the grid (KVATTN_PREFILL_BENCH_ONLY only): the long rows at head_dim 64 and 256, where
  // a tile's fixed cost no longer counts (the steady state of a block).
  grid.push_back({"prefill", 1, 0, 16384, 64, false});
  grid.push_back({"prefill", 1, 0, 16384, 256, false});
  // KVATTN_PREFILL_BENCH_ONLY=<index> times one row (for a profiler run).
  const char* only = std::getenv("KVATTN_PREFILL_BENCH_ONLY");
  std::vector<Row> rows;
  for (size_t i = 0; i < grid.size(); ++i) {
    if (only != nullptr ? std::atoi(only) != static_cast<int>(i) : i >= grid_rows) continue;
    const Workload& w = grid[i];
    try {
      rows.push_back(time_workload(w));
    } catch (const ::kvattn::Error& e) {
      // A build of fewer head dims (KVATTN_CUDA_HEAD_DIMS, quick A/B builds) skips the others.
      if (e.kind() != ::kvattn::ErrorKind::kNotSupported) throw;
      std::printf("skipped %s hd%d: %s\n", w.name.c_str(), w.head_dim, e.what());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  const char* json = std::getenv("KVATTN_PREFILL_BENCH_JSON");
  if (json != nullptr) {
    if (FILE* f = std::fopen(json, "w")) {
      std::fprintf(f, "{\"gemm_bf16_tflops\": %.1f, \"rows\": [\n", gemm);
      for (size_t i = 0; i < rows.size(); ++i) {
        const Row& r = rows[i];
        std::fprintf(f,
                     "  {\"workload\": \"%s\", \"batch\": %d, \"prefix_len\": %d, \"qo_len\": %d, "
                     "\"head_dim\": %d, \"page_size\": %s, \"time_us\": %.1f, \"tflops\": %.1f, "
                     "\"fraction\": %.3f}%s\n",
                     r.w.name.c_str(), r.w.batch, r.w.prefix, r.w.q_len, r.w.head_dim,
                     r.w.paged ? "1" : "null", r.ms * 1e3, r.tflops, r.tflops / gemm,
                     i + 1 < rows.size() ? "," : "");
      }
      std::fprintf(f, "]}\n");
      std::fclose(f);
    }
  }
  std::printf("\ncuBLAS bf16 GEMM 8192^3: %.1f TFLOP/s\n", gemm);
  std::printf("%-8s %5s %6s %6s %4s %6s %6s %10s %8s %6s\n", "workload", "batch", "prefix", "q_len",
              "hd", "kv", "tiles", "time_us", "TFLOP/s", "frac");
  for (const Row& r : rows) {
    std::printf("%-8s %5d %6d %6d %4d %6s %6d %10.1f %8.1f %6.3f\n", r.w.name.c_str(), r.w.batch,
                r.w.prefix, r.w.q_len, r.w.head_dim, r.w.paged ? "page1" : "ragged", r.items,
                r.ms * 1e3, r.tflops, r.tflops / gemm);
  }
}

// The decode-shaped rows (speculative verify with tree masks, draft extend, decode of a group of
// 8) on the decode-shaped kernel and on the prefill family, in one run. KV bytes over time is the
// yardstick (these rows are memory-bound): KVATTN_PREFILL_BENCH=1 runs it too.
TEST(PrefillBench, DecodeShaped) {
  if (std::getenv("KVATTN_PREFILL_BENCH") == nullptr) GTEST_SKIP() << "set KVATTN_PREFILL_BENCH=1";
  if (kvattn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  struct Spec {
    const char* name;
    int batch, prefix, q_len;
    bool custom;
  };
  const std::vector<Spec> specs = {
      {"verify", 1, 4096, 8, true},     {"verify", 16, 4096, 8, true},
      {"verify", 64, 4096, 8, true},    {"verify", 64, 1024, 16, true},
      {"draftext", 16, 4096, 4, false}, {"draftext", 64, 4096, 4, false},
  };
  // KVATTN_PREFILL_BENCH_ONLY=<index>: that row on the decode-shaped kernel only (a profiler run).
  const char* only = std::getenv("KVATTN_PREFILL_BENCH_ONLY");
  std::printf("\n%-8s %5s %6s %5s %-8s %6s %10s %8s\n", "workload", "batch", "prefix", "q_len",
              "kernel", "items", "time_us", "KV GB/s");
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& sp = specs[i];
    if (only != nullptr && std::atoi(only) != static_cast<int>(i)) continue;
    for (const bool tc : {true, false}) {
      if (only != nullptr && !tc) continue;
      Workload w{sp.name, sp.batch, sp.prefix, sp.q_len, 128, true, sp.custom, tc};
      const Row r = time_workload(w);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const double kv_bytes = double(sp.batch) * (sp.prefix + sp.q_len) * 8 * 2 * 128 * 2;
      std::printf("%-8s %5d %6d %5d %-8s %6d %10.1f %8.0f\n", sp.name, sp.batch, sp.prefix,
                  sp.q_len, tc ? "tc" : "prefill", r.items, r.ms * 1e3,
                  kv_bytes / (r.ms * 1e-3) / 1e9);
    }
  }
}

}  // namespace
}  // namespace kvattn::cuda
