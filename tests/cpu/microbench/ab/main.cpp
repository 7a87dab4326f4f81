// The A/B driver (see build.sh): the same inputs to both sides, calls alternated, min / median
// of each and the largest output difference.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
extern "C" double run_new(const void*, const void*, const void*, void*, const int32_t*, const int64_t*, const int32_t*, int, int64_t, int, int, int, int, int);
extern "C" double run_old(const void*, const void*, const void*, void*, const int32_t*, const int64_t*, const int32_t*, int, int64_t, int, int, int, int, int);
int main(int argc, char** argv) {
  // MODE: prefill (causal, q_len = kv_len = LEN, slots in order), decode1 / decode16 (q_len 1,
  // kv_len LEN, page-1 slots or pages of 16 shuffled, as the bench), hot (q_len 1, every key on
  // one of 8 slots: compute alone).
  if (argc < 5) { fprintf(stderr, "usage: ab BATCH LEN THREADS REPS [HEAD_DIM] [MODE]\n"); return 2; }
  const int batch = atoi(argv[1]), len = atoi(argv[2]), threads = atoi(argv[3]), reps = atoi(argv[4]), D = argc > 5 ? atoi(argv[5]) : 128;
  const std::string mode = argc > 6 ? argv[6] : "prefill";
  const bool decode = mode != "prefill";
  const int q_len = decode ? 1 : len;
  const int H = 32, KH = 8;
  const int64_t slots = int64_t(batch) * len + 16;
  std::mt19937 rng(1); std::uniform_real_distribution<float> u(-1, 1);
  auto bf = [&](size_t n) { std::vector<uint16_t> x(n); for (auto& e : x) { float f = u(rng); uint32_t b; memcpy(&b, &f, 4); e = uint16_t(b >> 16); } return x; };
  auto k = bf(size_t(slots) * KH * D), v = bf(size_t(slots) * KH * D), q = bf(size_t(batch) * q_len * H * D);
  std::vector<uint16_t> o1(q.size()), o2(q.size());
  std::vector<int32_t> qo(batch + 1), idx(size_t(batch) * len); std::vector<int64_t> kvp(batch + 1);
  for (int r = 0; r <= batch; ++r) { qo[r] = r * q_len; kvp[r] = int64_t(r) * len; }
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int32_t(i + 1);
  if (mode == "decode1") std::shuffle(idx.begin(), idx.end(), rng);
  if (mode == "decode16") {  // pages of 16 in a shuffled order (slot 0's page unused)
    std::vector<int32_t> pages(idx.size() / 16);
    for (size_t i = 0; i < pages.size(); ++i) pages[i] = int32_t(i);
    std::shuffle(pages.begin(), pages.end(), rng);
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = 16 + pages[i / 16 % pages.size()] * 16 + int32_t(i % 16);
  }
  if (mode == "hot") for (size_t i = 0; i < idx.size(); ++i) idx[i] = 1 + int32_t(i % 8);
  std::vector<double> a, b;
  for (int i = 0; i < reps + 1; ++i) {
    double ta = run_old(q.data(), k.data(), v.data(), o1.data(), qo.data(), kvp.data(), idx.data(), batch, slots, H, KH, D, 1, threads);
    double tb = run_new(q.data(), k.data(), v.data(), o2.data(), qo.data(), kvp.data(), idx.data(), batch, slots, H, KH, D, 1, threads);
    if (i) { a.push_back(ta); b.push_back(tb); }
  }
  float md = 0; for (size_t i = 0; i < o1.size(); ++i) { uint32_t x = uint32_t(o1[i]) << 16, y = uint32_t(o2[i]) << 16; float fx, fy; memcpy(&fx, &x, 4); memcpy(&fy, &y, 4); md = std::max(md, std::fabs(fx - fy)); }
  std::sort(a.begin(), a.end()); std::sort(b.begin(), b.end());
  const double flops = decode ? 4.0 * batch * H * D * double(len) : 4.0 * batch * H * D * double(len) * len / 2;
  const double bytes = 2.0 * batch * double(len) * KH * D * 2;
  printf("%s b%d len %d thr %d: old min %.2f med %.2f ms | new min %.2f med %.2f ms | speedup med %.3f min %.3f | new %.1f GFLOP/s %.1f GB/s | maxdiff %g\n",
         mode.c_str(), batch, len, threads, a[0] * 1e3, a[a.size() / 2] * 1e3, b[0] * 1e3, b[b.size() / 2] * 1e3,
         a[a.size() / 2] / b[b.size() / 2], a[0] / b[0], flops / b[0] / 1e9, bytes / b[0] / 1e9, md);
}
