// Decode microbenchmark of cpu::run_attention (not part of the test build): the bench's decode
// shape (32 q / 8 kv heads, head_dim 128, bf16 KV and q) and the process CPU time per call next
// to the wall time. On the shared 2-core VM the CPU time is steadier than the wall time: GB/s per
// CPU-second is the per-core rate even when other work takes the cores part of the time.
//
//   g++ -O2 -std=c++20 -mavx2 -mfma -mf16c -Isrc -Iinclude
//       tests/cpu/microbench/decode_microbench.cpp build-cpu/libkvattn.a -lpthread -o /tmp/decode_mb
//   /tmp/decode_mb BATCH KV_LEN THREADS REPS SLOTS    (best of REPS calls)
//
// SLOTS: 0 slots in order, 1 shuffled (the bench's page 1), 3 pages of 16 shuffled (page 16),
// 2 every key on one of 8 slots (K/V hot in L1/L2: the compute rate alone). MB_HUGE=1 asks for transparent huge pages on the pools.
#include <sys/resource.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <algorithm>
#include "cpu/cpu_attention.h"
#include "cpu/thread_pool.h"
using namespace kvattn;
static double cpu_now() {
  rusage u; getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}
static double wall_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
int main(int argc, char** argv) {
  int batch = argc > 1 ? atoi(argv[1]) : 16;
  int kv_len = argc > 2 ? atoi(argv[2]) : 4096;
  int threads = argc > 3 ? atoi(argv[3]) : 1;
  int reps = argc > 4 ? atoi(argv[4]) : 10;
  int shuffle = argc > 5 ? atoi(argv[5]) : 1;
  const int H = 32, KH = 8, D = 128;
  int64_t slots = int64_t(batch) * kv_len + 16;
  const size_t kvn = size_t(slots) * KH * D;
  auto alloc = [&](size_t n) {
    size_t bytes = (n * 2 + (2u << 20)) & ~size_t((2u << 20) - 1);
    void* ptr = nullptr; if (posix_memalign(&ptr, 2u << 20, bytes) != 0) std::abort();
    if (getenv("MB_HUGE")) madvise(ptr, bytes, MADV_HUGEPAGE);
    return static_cast<uint16_t*>(ptr);
  };
  struct Buf { uint16_t* p; size_t n; uint16_t* begin() { return p; } uint16_t* end() { return p + n; } uint16_t* data() { return p; } };
  Buf k{alloc(kvn), kvn}, v{alloc(kvn), kvn};
  std::vector<uint16_t> q(size_t(batch) * H * D), out(size_t(batch) * H * D);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto bf = [](float f) { uint32_t b; memcpy(&b, &f, 4); return uint16_t(b >> 16); };
  for (auto& x : k) x = bf(u(rng));
  for (auto& x : v) x = bf(u(rng));
  for (auto& x : q) x = bf(u(rng));
  std::vector<int32_t> idx(slots - 1);
  for (int64_t i = 0; i < slots - 1; ++i) idx[i] = int32_t(i + 1);
  if (shuffle == 1) std::shuffle(idx.begin(), idx.end(), rng);
  if (shuffle == 2) for (auto& x : idx) x = 1 + int32_t(&x - idx.data()) % 8;
  if (shuffle == 3) {  // page 16, pages shuffled (the bench's page 16 rows); slot 0..15 unused
    const int64_t pages = (slots - 1) / 16;
    std::vector<int32_t> order(pages);
    for (int64_t i = 0; i < pages; ++i) order[i] = int32_t(i);
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t i = 0; i < slots - 1; ++i) idx[i] = 16 + order[i / 16 % pages] * 16 + int32_t(i % 16);
  }
  std::vector<int32_t> qo(batch + 1); std::vector<int64_t> kvp(batch + 1);
  for (int r = 0; r <= batch; ++r) { qo[r] = r; kvp[r] = int64_t(r) * kv_len; }
  core::AttentionParams p;
  p.q = q.data(); p.q_stride_token = H * D; p.q_stride_head = D; p.out = out.data();
  p.out_stride_token = H * D; p.out_stride_head = D; p.io_dtype = DType::kBFloat16;
  p.k = k.data(); p.v = v.data(); p.k_stride_token = KH * D; p.k_stride_head = D;
  p.v_stride_token = KH * D; p.v_stride_head = D; p.kv_dtype = DType::kBFloat16;
  p.batch_size = batch; p.qo_indptr = qo.data(); p.kv_indptr = kvp.data(); p.kv_indices = idx.data();
  p.num_slots = slots; p.mask = core::MaskMode::kCausal; p.sm_scale = 1.f / sqrtf(D);
  p.num_q_heads = H; p.num_kv_heads = KH; p.head_dim = D; p.v_head_dim = D;
  cpu::ThreadPool pool(threads); cpu::AttentionWorkspace ws;
  double bytes = double(batch) * kv_len * KH * D * 2 * 2;
  double best_w = 1e9, best_c = 1e9;
  cpu::run_attention(p, DType::kBFloat16, pool, ws);
  for (int i = 0; i < reps; ++i) {
    double w0 = wall_now(), c0 = cpu_now();
    cpu::run_attention(p, DType::kBFloat16, pool, ws);
    double w = wall_now() - w0, c = cpu_now() - c0;
    best_w = std::min(best_w, w); best_c = std::min(best_c, c);
  }
  unsigned sum = 0; for (auto x : out) sum = sum * 31 + x;
  printf("b%d x %d thr %d: wall %.2f ms %.1f GB/s | cpu %.2f ms %.2f GB/s per cpu-s | out hash %08x\n",
         batch, kv_len, threads, best_w * 1e3, bytes / best_w / 1e9, best_c * 1e3, bytes / best_c / 1e9, sum);
}
