// Unit tests of the CPU kernels (src/cpu): the thread pool, the vector math, row conversions,
// the KV write, and run_attention / merge_attention_states against small float64 formulas
// written here. End-to-end mode x variant coverage lives in the scenario tests.
#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/attention_params.h"
#include "cpu/cpu_attention.h"
#include "cpu/amx.h"
#include "cpu/bf16_avx512.h"
#include "cpu/kv_write.h"
#include "cpu/row_convert.h"
#include "cpu/simd.h"
#include "cpu/thread_pool.h"
#include "kvattn/backend.h"
#include "kvattn/dtype.h"
#include "kvattn/error.h"
#include "kvattn/tensor.h"

namespace kvattn::cpu {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- thread pool ---------------------------------------------------------------------------------

TEST(CpuThreadPool, RunsEveryIndexOnceOnValidThreadIds) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t count : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(count));
      std::atomic<bool> bad_thread{false};
      pool.parallel_for(count, [&](int64_t i, int thread_id) {
        if (thread_id < 0 || thread_id >= threads) bad_thread = true;
        hits[size_t(i)].fetch_add(1);
      });
      EXPECT_FALSE(bad_thread);
      for (int64_t i = 0; i < count; ++i) EXPECT_EQ(hits[size_t(i)].load(), 1) << i;
    }
  }
}

TEST(CpuThreadPool, RethrowsTheFirstErrorAndStaysUsable) {
  ThreadPool pool(3);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.parallel_for(50,
                                 [&](int64_t i, int) {
                                   ran.fetch_add(1);
                                   if (i == 17) throw std::runtime_error("index 17");
                                 }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 50);  // the other indices still ran
  int64_t sum = 0;
  std::mutex m;
  pool.parallel_for(100, [&](int64_t i, int) {
    std::lock_guard<std::mutex> lock(m);
    sum += i;
  });
  EXPECT_EQ(sum, 4950);
}

TEST(CpuThreadPool, ThreadCountResolution) {
  EXPECT_EQ(resolve_num_threads(3), 3);
  const char* old = std::getenv("KVATTN_NUM_THREADS");
  const std::string saved = old ? old : "";
  setenv("KVATTN_NUM_THREADS", "5", 1);
  EXPECT_EQ(resolve_num_threads(0), 5);
  EXPECT_EQ(resolve_num_threads(2), 2);  // the config wins over the environment
  setenv("KVATTN_NUM_THREADS", "zero", 1);
  EXPECT_GE(resolve_num_threads(0), 1);
  // Without the variable: the CPUs the affinity mask allows (as `taskset` or a container's cpuset
  // narrow it), not every CPU of the host. Narrowed to one CPU here, on this thread only.
  unsetenv("KVATTN_NUM_THREADS");
  cpu_set_t before;
  ASSERT_EQ(sched_getaffinity(0, sizeof(before), &before), 0);
  EXPECT_EQ(resolve_num_threads(0), CPU_COUNT(&before));
  int first_cpu = 0;
  while (!CPU_ISSET(first_cpu, &before)) ++first_cpu;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first_cpu, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(resolve_num_threads(0), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(before), &before), 0);
  if (old) setenv("KVATTN_NUM_THREADS", saved.c_str(), 1);
  else unsetenv("KVATTN_NUM_THREADS");
  EXPECT_THROW(ThreadPool(0), Error);
}

// ---- vector math ---------------------------------------------------------------------------------

TEST(CpuSimd, ExpMatchesLibm) {
  std::vector<float> xs;
  for (float x = -87.f; x <= 88.f; x += 0.0137f) xs.push_back(x);
  xs.push_back(0.f);
  xs.push_back(-0.f);
  double worst = 0;
  for (size_t i = 0; i + 8 <= xs.size(); i += 8) {
    float out[8];
    _mm256_storeu_ps(out, simd::exp8(_mm256_loadu_ps(xs.data() + i)));
    for (int l = 0; l < 8; ++l) {
      const double ref = std::exp(double(xs[i + l]));
      worst = std::max(worst, std::abs(out[l] - ref) / ref);
    }
  }
  EXPECT_LT(worst, 3e-7);  // a few float ulps
  // Masked logits (-inf) and deep underflow give exactly 0; NaN stays NaN.
  const float special[8] = {-INFINITY, -1000.f, -88.f, -87.5f, NAN, 0.f, 1.f, -1.f};
  float out[8];
  _mm256_storeu_ps(out, simd::exp8(_mm256_loadu_ps(special)));
  EXPECT_EQ(out[0], 0.f);
  EXPECT_EQ(out[1], 0.f);
  EXPECT_EQ(out[2], 0.f);
  EXPECT_EQ(out[3], 0.f);
  EXPECT_TRUE(std::isnan(out[4]));
  EXPECT_EQ(out[5], 1.f);
  EXPECT_NEAR(out[6], std::exp(1.0), 1e-6);
  EXPECT_NEAR(out[7], std::exp(-1.0), 1e-7);
}

TEST(CpuSimd, SoftCapMatchesTanh) {
  for (float cap : {1.f, 20.f, 50.f}) {
    for (float x = -300.f; x < 300.f; x += 0.731f) {
      float in[8], out[8];
      for (int l = 0; l < 8; ++l) in[l] = x + l * 0.05f;
      _mm256_storeu_ps(out, simd::soft_cap8(_mm256_loadu_ps(in), cap));
      for (int l = 0; l < 8; ++l) {
        const double ref = cap * std::tanh(double(in[l]) / cap);
        EXPECT_NEAR(out[l], ref, 2e-6 * cap) << "x " << in[l] << " cap " << cap;
      }
    }
  }
}

TEST(CpuSimd, HorizontalSums) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  float a[8][8];
  for (auto& row : a)
    for (float& x : row) x = u(rng);
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(a[i]);
  float sums[8];
  _mm256_storeu_ps(sums, simd::hsum8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]));
  for (int i = 0; i < 8; ++i) {
    double ref = 0, mx = -1e30;
    for (float x : a[i]) {
      ref += x;
      mx = std::max<double>(mx, x);
    }
    EXPECT_NEAR(sums[i], ref, 1e-6);
    EXPECT_NEAR(simd::hsum(v[i]), ref, 1e-6);
    EXPECT_EQ(simd::hmax(v[i]), float(mx));
  }
}

// ---- row conversions -------------------------------------------------------------------------------

TEST(CpuRowConvert, LoadMatchesTheScalarConversions) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-3, 3);
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
                      DType::kFloat8E5M2}) {
    const int n = 40;
    std::vector<uint8_t> raw(size_t(n) * 4);
    for (int i = 0; i < n; ++i) store_from_float(raw.data(), dtype, i, u(rng));
    std::vector<float> out(n);
    load_row(raw.data(), dtype, n, 0.5f, out.data());
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(out[size_t(i)], load_as_float(raw.data(), dtype, i) * 0.5f) << dtype_name(dtype);
    }
  }
  // Every fp8 code through the table.
  for (DType dtype : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    std::vector<uint8_t> codes(256);
    std::iota(codes.begin(), codes.end(), 0);
    std::vector<float> out(256);
    load_row(codes.data(), dtype, 256, 1.f, out.data());
    for (int c = 0; c < 256; ++c) {
      const float ref = load_as_float(codes.data(), dtype, c);
      if (std::isnan(ref)) {
        EXPECT_TRUE(std::isnan(out[size_t(c)]));
      } else {
        EXPECT_EQ(out[size_t(c)], ref) << dtype_name(dtype) << " code " << c;
      }
    }
  }
}

TEST(CpuRowConvert, StoreMatchesTheScalarConversions) {
  // Ties, subnormals, overflow and NaN alongside random values.
  std::vector<float> values = {1.00390625f, 1.01171875f, -1.00390625f, 3.0e38f, -3.0e38f,
                               1e-40f,      70000.f,     -70000.f,     500.f,   -500.f,
                               NAN,         INFINITY,    -INFINITY,    0.f,     -0.f,
                               65519.f};
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 10.f);
  while (values.size() < 64) values.push_back(normal(rng));
  const int n = int(values.size());
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
                      DType::kFloat8E5M2}) {
    std::vector<uint8_t> got(size_t(n) * 4), want(size_t(n) * 4);
    store_row(values.data(), n, dtype, got.data());
    for (int i = 0; i < n; ++i) store_from_float(want.data(), dtype, i, values[size_t(i)]);
    for (int i = 0; i < n; ++i) {
      const float g = load_as_float(got.data(), dtype, i);
      const float w = load_as_float(want.data(), dtype, i);
      if (std::isnan(w)) {
        EXPECT_TRUE(std::isnan(g)) << dtype_name(dtype) << " value " << values[size_t(i)];
      } else {
        EXPECT_EQ(g, w) << dtype_name(dtype) << " value " << values[size_t(i)];
      }
    }
  }
}

// ---- KV write --------------------------------------------------------------------------------------

TEST(CpuKvWrite, NarrowsScalesAndSaturates) {
  const int num_slots = 6, heads = 2, dim = 16, vdim = 8;
  ThreadPool pool(2);
  for (DType storage : {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3,
                        DType::kFloat8E5M2}) {
    for (DType io : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const int es = dtype_size(storage);
      std::vector<uint8_t> k_pool(size_t(num_slots) * heads * dim * es, 0xAB);
      std::vector<uint8_t> v_pool(size_t(num_slots) * heads * vdim * es, 0xCD);
      const std::vector<uint8_t> k_before = k_pool, v_before = v_pool;
      TensorView k_buffer(k_pool.data(), storage, Device::cpu(), {num_slots, heads, dim});
      TensorView v_buffer(v_pool.data(), storage, Device::cpu(), {num_slots, heads, vdim});
      const int n = 3;
      std::vector<uint8_t> k(size_t(n) * heads * dim * 4), v(size_t(n) * heads * vdim * 4);
      std::mt19937 rng(9);
      std::normal_distribution<float> normal(0.f, 300.f);  // fp8 e4m3 must saturate some
      for (int i = 0; i < n * heads * dim; ++i) store_from_float(k.data(), io, i, normal(rng));
      for (int i = 0; i < n * heads * vdim; ++i) store_from_float(v.data(), io, i, normal(rng));
      TensorView kv(k.data(), io, Device::cpu(), {n, heads, dim});
      TensorView vv(v.data(), io, Device::cpu(), {n, heads * vdim});  // flat form
      std::vector<int64_t> loc = {4, 1, 5};
      TensorView loc_view(loc.data(), DType::kInt64, Device::cpu(), {n});
      const float k_scale = 2.f, v_scale = 0.25f;
      write_kv(kv, vv, loc_view, "out_cache_loc", k_buffer, v_buffer, k_scale, v_scale, pool);
      const bool fp8 = is_fp8_dtype(storage);
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < heads * dim; ++i) {
          const float x = load_as_float(k.data(), io, t * heads * dim + i);
          const float want = fp8 ? x / k_scale : x;
          std::vector<uint8_t> expect(4);
          store_from_float(expect.data(), storage, 0, want);
          EXPECT_EQ(std::memcmp(k_pool.data() + (loc[size_t(t)] * heads * dim + i) * es,
                                expect.data(), size_t(es)),
                    0)
              << dtype_name(storage) << " from " << dtype_name(io);
        }
        for (int i = 0; i < heads * vdim; ++i) {
          const float x = load_as_float(v.data(), io, t * heads * vdim + i);
          std::vector<uint8_t> expect(4);
          store_from_float(expect.data(), storage, 0, fp8 ? x / v_scale : x);
          EXPECT_EQ(std::memcmp(v_pool.data() + (loc[size_t(t)] * heads * vdim + i) * es,
                                expect.data(), size_t(es)),
                    0);
        }
      }
      // Slots not named stay as they were.
      for (int slot : {0, 2, 3}) {
        const size_t kb = size_t(heads) * dim * es, vb = size_t(heads) * vdim * es;
        EXPECT_EQ(std::memcmp(k_pool.data() + slot * kb, k_before.data() + slot * kb, kb), 0);
        EXPECT_EQ(std::memcmp(v_pool.data() + slot * vb, v_before.data() + slot * vb, vb), 0);
      }
      if (storage == DType::kFloat8E4M3) {
        float largest = 0;
        for (int i = 0; i < num_slots * heads * dim; ++i) {
          largest = std::max(largest, std::abs(load_as_float(k_pool.data(), storage, i)));
        }
        EXPECT_EQ(largest, 448.f);  // saturated, not NaN
      }
    }
  }
}

TEST(CpuKvWrite, ABadSlotWritesNothing) {
  const int num_slots = 4, heads = 1, dim = 8;
  ThreadPool pool(2);
  std::vector<uint16_t> k_pool(num_slots * dim, 0x1234), v_pool(num_slots * dim, 0x5678);
  TensorView k_buffer(k_pool.data(), DType::kBFloat16, Device::cpu(), {num_slots, heads, dim});
  TensorView v_buffer(v_pool.data(), DType::kBFloat16, Device::cpu(), {num_slots, heads, dim});
  std::vector<uint16_t> k(2 * dim, 0x3f80), v(2 * dim, 0x3f80);
  TensorView kv(k.data(), DType::kBFloat16, Device::cpu(), {2, heads, dim});
  TensorView vv(v.data(), DType::kBFloat16, Device::cpu(), {2, heads, dim});
  for (int32_t bad : {-1, 4, 1000}) {
    std::vector<int32_t> loc = {2, bad};
    TensorView loc_view(loc.data(), DType::kInt32, Device::cpu(), {2});
    try {
      write_kv(kv, vv, loc_view, "out_cache_loc", k_buffer, v_buffer, 1.f, 1.f, pool);
      ADD_FAILURE() << "slot " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "out_cache_loc[1]");
    }
    for (uint16_t x : k_pool) EXPECT_EQ(x, 0x1234);
    for (uint16_t x : v_pool) EXPECT_EQ(x, 0x5678);
  }
}

// ---- attention against a float64 formula -----------------------------------------------------------

struct KernelCase {
  std::string name;
  std::vector<int> q_lens;
  std::vector<int> kv_lens;
  int q_heads = 8;
  int kv_heads = 2;
  int dim = 64;
  int v_dim = 64;
  DType io = DType::kFloat32;
  DType kv = DType::kBFloat16;
  core::MaskMode mask = core::MaskMode::kCausal;
  int window = -1;
  float cap = 0.f;
  bool ragged = false;      // K/V from k/v tensors (kv must be an io dtype)
  bool with_lse = true;
  float k_scale = 1.f;      // fp8 storage
  float v_scale = 1.f;
  int threads = 2;
  DType out_dtype = DType::kFloat32;
  int custom_mask_extra_cols = 0;  // custom masks wider than kv_len (the keys are the last cols)
  double tol = 0;  // relative error bar; 0: 1e-5 for fp32 q and output, else 1e-2
  uint64_t seed = 1;
};

struct KernelRun {
  std::vector<double> ref_out;  // [tokens, heads, v_dim]
  std::vector<double> ref_lse;  // [tokens, heads]
  std::vector<uint8_t> out;     // out_dtype
  std::vector<float> lse;
};

uint64_t nan_bits(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 0x7fc00000u;
    case DType::kBFloat16: return 0x7fc0u;
    case DType::kFloat16: return 0x7e00u;
    default: return 0x7fu;
  }
}

void fill_nan(std::vector<uint8_t>& buffer, DType dtype) {
  const int es = dtype_size(dtype);
  const uint64_t bits = nan_bits(dtype);
  for (size_t i = 0; i + es <= buffer.size(); i += size_t(es)) std::memcpy(&buffer[i], &bits, size_t(es));
}

KernelRun run_case(const KernelCase& c) {
  const int batch = int(c.q_lens.size());
  const int group = c.q_heads / c.kv_heads;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<int32_t> qo_indptr(size_t(batch) + 1, 0);
  std::vector<int64_t> kv_indptr(size_t(batch) + 1, 0);
  for (int r = 0; r < batch; ++r) {
    qo_indptr[size_t(r) + 1] = qo_indptr[size_t(r)] + c.q_lens[size_t(r)];
    kv_indptr[size_t(r) + 1] = kv_indptr[size_t(r)] + c.kv_lens[size_t(r)];
  }
  const int64_t tokens = qo_indptr.back();
  const int64_t total_kv = kv_indptr.back();

  // K/V: a pool with shuffled slots and NaN everywhere no key owns, or ragged rows.
  const int64_t num_rows = c.ragged ? total_kv : total_kv + 9;
  const int es = dtype_size(c.kv);
  std::vector<uint8_t> k_store(size_t(num_rows) * c.kv_heads * c.dim * es);
  std::vector<uint8_t> v_store(size_t(num_rows) * c.kv_heads * c.v_dim * es);
  fill_nan(k_store, c.kv);
  fill_nan(v_store, c.kv);
  std::vector<int32_t> slots(static_cast<size_t>(total_kv));
  if (c.ragged) {
    std::iota(slots.begin(), slots.end(), 0);
  } else {
    std::vector<int32_t> perm(static_cast<size_t>(num_rows));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy(perm.begin(), perm.begin() + total_kv, slots.begin());
  }
  for (int64_t key = 0; key < total_kv; ++key) {
    const int64_t row = slots[size_t(key)];
    for (int i = 0; i < c.kv_heads * c.dim; ++i) {
      store_from_float(k_store.data(), c.kv, row * c.kv_heads * c.dim + i, normal(rng) / c.k_scale);
    }
    for (int i = 0; i < c.kv_heads * c.v_dim; ++i) {
      store_from_float(v_store.data(), c.kv, row * c.kv_heads * c.v_dim + i, normal(rng) / c.v_scale);
    }
  }
  std::vector<uint8_t> q(size_t(tokens) * c.q_heads * c.dim * dtype_size(c.io));
  for (int64_t i = 0; i < tokens * c.q_heads * c.dim; ++i) store_from_float(q.data(), c.io, i, normal(rng));

  // Custom masks: random, some rows empty.
  std::vector<int64_t> mask_indptr(size_t(batch) + 1, 0);
  std::vector<uint8_t> mask;
  if (c.mask == core::MaskMode::kCustom) {
    std::bernoulli_distribution on(0.6);
    for (int r = 0; r < batch; ++r) {
      const int cols = c.kv_lens[size_t(r)] + c.custom_mask_extra_cols;
      for (int i = 0; i < c.q_lens[size_t(r)]; ++i) {
        const bool empty_row = (i % 5 == 3);
        for (int j = 0; j < cols; ++j) mask.push_back(!empty_row && on(rng) ? 1 : 0);
      }
      mask_indptr[size_t(r) + 1] = int64_t(mask.size());
    }
  }

  // The float64 formula.
  const float sm_scale = 1.f / std::sqrt(float(c.dim));
  KernelRun run;
  run.ref_out.assign(size_t(tokens) * c.q_heads * c.v_dim, 0.0);
  run.ref_lse.assign(size_t(tokens) * c.q_heads, -kInf);
  for (int r = 0; r < batch; ++r) {
    const int q_len = c.q_lens[size_t(r)], kv_len = c.kv_lens[size_t(r)];
    const int cols = kv_len + c.custom_mask_extra_cols;
    for (int t = 0; t < q_len; ++t) {
      const int64_t token = qo_indptr[size_t(r)] + t;
      const int64_t diag = int64_t(kv_len) - q_len + t;
      for (int head = 0; head < c.q_heads; ++head) {
        const int kv_head = head / group;
        std::vector<double> logits(size_t(kv_len), -kInf);
        double m = -kInf;
        for (int j = 0; j < kv_len; ++j) {
          bool visible = true;
          if (c.mask == core::MaskMode::kCausal) visible = j <= diag;
          if (c.mask == core::MaskMode::kCustom) {
            visible = mask[size_t(mask_indptr[size_t(r)] + int64_t(t) * cols +
                                  c.custom_mask_extra_cols + j)] != 0;
          }
          if (c.window >= 0 && c.mask != core::MaskMode::kNone && j < diag - c.window) visible = false;
          if (!visible) continue;
          const int64_t row = slots[size_t(kv_indptr[size_t(r)] + j)];
          double dot = 0;
          for (int d = 0; d < c.dim; ++d) {
            const double qd = load_as_float(q.data(), c.io, (token * c.q_heads + head) * c.dim + d);
            const double kd = double(load_as_float(k_store.data(), c.kv,
                                                   (row * c.kv_heads + kv_head) * c.dim + d)) *
                              (c.ragged ? 1.0 : c.k_scale);
            dot += qd * kd;
          }
          double x = dot * sm_scale;
          if (c.cap > 0) x = c.cap * std::tanh(x / c.cap);
          logits[size_t(j)] = x;
          m = std::max(m, x);
        }
        if (m == -kInf) continue;
        double sum = 0;
        for (double& x : logits) {
          x = x == -kInf ? 0.0 : std::exp(x - m);
          sum += x;
        }
        double* out = &run.ref_out[size_t((token * c.q_heads + head) * c.v_dim)];
        for (int j = 0; j < kv_len; ++j) {
          if (logits[size_t(j)] == 0) continue;
          const int64_t row = slots[size_t(kv_indptr[size_t(r)] + j)];
          for (int d = 0; d < c.v_dim; ++d) {
            out[d] += logits[size_t(j)] / sum *
                      double(load_as_float(v_store.data(), c.kv,
                                           (row * c.kv_heads + kv_head) * c.v_dim + d)) *
                      (c.ragged ? 1.0 : c.v_scale);
          }
        }
        run.ref_lse[size_t(token * c.q_heads + head)] = m + std::log(sum);
      }
    }
  }

  // The kernel, with poisoned outputs.
  run.out.assign(size_t(tokens) * c.q_heads * c.v_dim * dtype_size(c.out_dtype), 0);
  fill_nan(run.out, c.out_dtype);
  run.lse.assign(size_t(tokens) * c.q_heads, NAN);
  core::AttentionParams p;
  p.q = q.data();
  p.q_stride_token = int64_t(c.q_heads) * c.dim;
  p.q_stride_head = c.dim;
  p.out = run.out.data();
  p.out_stride_token = int64_t(c.q_heads) * c.v_dim;
  p.out_stride_head = c.v_dim;
  p.lse = c.with_lse ? run.lse.data() : nullptr;
  p.io_dtype = c.io;
  p.k = k_store.data();
  p.v = v_store.data();
  p.k_stride_token = int64_t(c.kv_heads) * c.dim;
  p.k_stride_head = c.dim;
  p.v_stride_token = int64_t(c.kv_heads) * c.v_dim;
  p.v_stride_head = c.v_dim;
  p.kv_dtype = c.kv;
  p.k_scale = c.k_scale;
  p.v_scale = c.v_scale;
  p.batch_size = batch;
  p.qo_indptr = qo_indptr.data();
  p.kv_indptr = kv_indptr.data();
  p.kv_indices = c.ragged ? nullptr : slots.data();
  p.num_slots = num_rows;
  p.mask = c.mask;
  p.custom_mask = mask.empty() ? nullptr : mask.data();
  p.mask_indptr = c.mask == core::MaskMode::kCustom ? mask_indptr.data() : nullptr;
  p.window_left = c.window;
  p.sm_scale = sm_scale;
  p.logit_cap = c.cap;
  p.num_q_heads = c.q_heads;
  p.num_kv_heads = c.kv_heads;
  p.head_dim = c.dim;
  p.v_head_dim = c.v_dim;
  ThreadPool pool(c.threads);
  AttentionWorkspace workspace;
  run_attention(p, c.out_dtype, pool, workspace);
  return run;
}

void expect_matches(const KernelCase& c, const KernelRun& run) {
  const double tol = c.tol > 0                                                 ? c.tol
                     : c.out_dtype == DType::kFloat32 && c.io == DType::kFloat32 ? 1e-5
                                                                                 : 1e-2;
  const int64_t rows = int64_t(run.ref_lse.size());
  int failures = 0;
  for (int64_t row = 0; row < rows && failures < 5; ++row) {
    double ref_max = 0, err = 0;
    bool nan = false;
    for (int d = 0; d < c.v_dim; ++d) {
      const double ref = run.ref_out[size_t(row * c.v_dim + d)];
      const double got = load_as_float(run.out.data(), c.out_dtype, row * c.v_dim + d);
      nan = nan || std::isnan(got);
      ref_max = std::max(ref_max, std::abs(ref));
      err = std::max(err, std::abs(got - ref));
    }
    const bool empty = run.ref_lse[size_t(row)] == -kInf;
    bool ok = !nan && (empty ? err == 0 : err <= tol * ref_max);
    if (c.with_lse) {
      const double lse = run.lse[size_t(row)];
      ok = ok && (empty ? lse == -kInf : std::abs(lse - run.ref_lse[size_t(row)]) <= 1e-4 * (1 + std::abs(lse)));
    }
    if (!ok) {
      ++failures;
      ADD_FAILURE() << c.name << ": row " << row << " (token " << row / c.q_heads << ", head "
                    << row % c.q_heads << ") err " << err << " vs max|ref| " << ref_max
                    << (nan ? " NaN" : "") << " lse " << run.lse[size_t(row)] << " ref "
                    << run.ref_lse[size_t(row)];
    }
  }
}

void check(const KernelCase& c) { expect_matches(c, run_case(c)); }

TEST(CpuAttention, DecodeShapesAndDtypes) {
  KernelCase base;
  base.q_lens = {1, 1, 1, 1, 1};
  base.kv_lens = {0, 1, 33, 130, 7};
  for (DType kv : {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    for (int group : {1, 3, 4, 8}) {
      KernelCase c = base;
      c.kv = kv;
      c.kv_heads = 2;
      c.q_heads = 2 * group;
      c.name = std::string("decode ") + dtype_name(kv) + " group " + std::to_string(group);
      if (is_fp8_dtype(kv)) {
        c.k_scale = 0.5f;
        c.v_scale = 2.f;
      }
      c.seed = uint64_t(group) * 10 + uint64_t(kv);
      check(c);
    }
  }
}

TEST(CpuAttention, DecodeHeadDimsOnTheDirectPath) {
  // Decode tiles read K/V straight from the pool; at head_dim and v_head_dim multiples of 16 they
  // work on 16-element pairs (bf16 in even/odd order). Every dtype, groups that leave remainder
  // rows, v_head_dim != head_dim, soft-cap and a window, keys not a multiple of the block.
  int seed = 0;
  for (DType kv : {DType::kBFloat16, DType::kFloat16, DType::kFloat8E4M3}) {
    for (int dim : {64, 128, 256}) {
      for (int v_dim : {dim, 16, 48}) {
        for (int group : {1, 3, 4, 5, 8}) {
          KernelCase c;
          c.name = std::string("direct decode ") + dtype_name(kv) + " dims " +
                   std::to_string(dim) + "/" + std::to_string(v_dim) + " group " +
                   std::to_string(group);
          c.kv = kv;
          c.dim = dim;
          c.v_dim = v_dim;
          c.kv_heads = 2;
          c.q_heads = 2 * group;
          c.q_lens = {1, 1, 1};
          c.kv_lens = {1, 67, 130};
          if (is_fp8_dtype(kv)) {
            c.k_scale = 0.5f;
            c.v_scale = 2.f;
          }
          if (group == 4) c.cap = 3.f;
          if (group == 3) c.window = 40;
          c.seed = uint64_t(++seed);
          check(c);
        }
      }
    }
  }
}

// The bar of a bf16 q and K/V case with an fp32 output: fp32's, except on the AMX kernels (tiles
// of more than 16 rows a kv head, v_head_dim a multiple of 64, on a CPU with AMX), which round
// P to bf16 before P V as the GPU's tensor-core kernels do: measured ~2e-3 of a row's max.
double bf16_case_bar(bool scratch_tiles, int v_dim) {
  const bool amx = cpu_backend_info().amx_bf16 && scratch_tiles && v_dim % 64 == 0;
  return amx ? 5e-3 : 2e-5;
}

TEST(CpuAttention, Bf16QueriesAndKv) {
  // bf16 q and K/V with an fp32 output: the reference sees the same bf16 inputs, so the bar is
  // fp32's (bf16_case_bar: the AMX kernels'). On CPUs with AVX-512 BF16 both paths run
  // bf16_avx512's kernels where a kv head's tile rows are a multiple of 4 and both dims
  // multiples of 32; other shapes, and CPUs without them, run the AVX2 kernels. Decode and
  // verify-sized tiles, keys not a multiple of the 4-key step or the block, soft-cap, a window,
  // split pieces, then prefill tiles.
  uint64_t seed = 100;
  for (int dim : {64, 128, 256}) {
    for (int v_dim : {dim, 32, 48}) {
      for (int group : {1, 4, 8}) {
        KernelCase c;
        c.name = "bf16 direct dims " + std::to_string(dim) + "/" + std::to_string(v_dim) +
                 " group " + std::to_string(group);
        c.io = DType::kBFloat16;
        c.kv = DType::kBFloat16;
        c.dim = dim;
        c.v_dim = v_dim;
        c.kv_heads = 2;
        c.q_heads = 2 * group;
        c.tol = 2e-5;
        if (group == 4) c.cap = 3.f;
        if (group == 8) c.window = 50;
        c.q_lens = {1, 1, 1, 1};
        c.kv_lens = {0, 1, 3, 130};
        c.seed = ++seed;
        check(c);
        c.name += " verify";
        // Tiles of 4 tokens: direct at groups 1 and 4 (the 3-token tile pads rows at group 1),
        // 32 rows at group 8 take the scratch path.
        c.q_lens = {4, 3};
        c.kv_lens = {70, 5};
        c.tol = bf16_case_bar(group == 8, v_dim);
        c.seed = ++seed;
        check(c);
      }
    }
  }
  // Prefill tiles (the scratch path: 64 rows, 32-key blocks), a last tile whose rows are not a
  // multiple of 4, the ragged layout, a window.
  for (int dim : {64, 128}) {
    for (int group : {1, 4}) {
      for (bool ragged : {false, true}) {
        KernelCase c;
        c.name = std::string("bf16 prefill dim ") + std::to_string(dim) + " group " +
                 std::to_string(group) + (ragged ? " ragged" : " paged");
        c.io = DType::kBFloat16;
        c.kv = DType::kBFloat16;
        c.dim = c.v_dim = dim;
        c.kv_heads = 2;
        c.q_heads = 2 * group;
        c.ragged = ragged;
        c.q_lens = {70, 5, 1, 4, 3};
        c.kv_lens = ragged ? std::vector<int>{70, 5, 1, 4, 3} : std::vector<int>{100, 5, 40, 4, 9};
        if (group == 1 && !ragged) c.window = 33;
        c.tol = bf16_case_bar(true, dim);
        c.seed = ++seed;
        check(c);
      }
    }
  }
  KernelCase split;
  split.name = "bf16 direct split";
  split.io = DType::kBFloat16;
  split.dim = split.v_dim = 128;
  split.q_heads = 8;
  split.kv_heads = 2;
  split.q_lens = {1};
  split.kv_lens = {1501};
  split.threads = 4;
  split.tol = 2e-5;
  check(split);
}

// The AMX kernels one by one against their formulas: packed keys -> scores, packed values ->
// O += P V (P rounded to bf16), and the unmasked online-softmax rows, at every dim the tiles
// take and block fills of 64, 37 and 1 keys.
TEST(CpuAttention, AmxKernelsMatchTheFormulas) {
  if (!amx::available()) GTEST_SKIP() << "this CPU (or KVATTN_CPU_ISA) runs no AMX kernels";
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto bf16 = [&](float x) { return float_to_bf16(x); };
  constexpr int kRows = 48;  // a pass of 2 x 16 rows, then a last group of 16
  constexpr int kLd = 72;    // a row stride wider than the block
  for (int dim : {64, 128, 256}) {
    for (int nk : {64, 37, 1}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + ", " + std::to_string(nk) + " keys");
      std::vector<uint16_t> q(size_t(kRows) * dim);
      for (auto& x : q) x = bf16(normal(rng));
      // Keys and values in a pool of two heads, in reverse slot order (the second head used).
      std::vector<uint16_t> pool(size_t(64) * 2 * dim);
      for (auto& x : pool) x = bf16(normal(rng));
      const int64_t head_offset = 2 * dim;  // bytes: the second head
      std::vector<const char*> rows(64);
      for (int j = 0; j < 64; ++j) {
        rows[size_t(j)] = reinterpret_cast<const char*>(pool.data() + size_t(63 - j) * 2 * dim);
      }
      auto element = [&](int j, int d) {
        const uint16_t* row = reinterpret_cast<const uint16_t*>(rows[size_t(j)] + head_offset);
        return double(bf16_to_float(row[d]));
      };
      std::vector<uint16_t> packed(size_t(64) * dim, 0xffff);  // NaN: every lane gets written
      amx::pack_keys(rows.data(), head_offset, nk, dim, packed.data());
      std::vector<float> s(size_t(kRows) * kLd, std::nanf(""));
      const float scale = 0.37f;
      amx::scores(q.data(), kRows, dim, packed.data(), scale, s.data(), kLd);
      for (int r = 0; r < kRows; ++r) {
        for (int j = 0; j < 64; ++j) {
          double want = 0;
          if (j < nk) {
            for (int d = 0; d < dim; ++d) want += double(bf16_to_float(q[size_t(r) * dim + d])) * element(j, d);
          }
          want *= scale;
          ASSERT_NEAR(s[size_t(r) * kLd + j], want, 1e-4 * (1 + std::abs(want))) << r << "," << j;
        }
      }
      // O += P V with P in [0, 1] (the softmax's range), O starting from random values.
      std::vector<float> p(size_t(kRows) * kLd), o(size_t(kRows) * dim), o0;
      std::uniform_real_distribution<float> unit(0.f, 1.f);
      for (auto& x : p) x = unit(rng);
      for (auto& x : o) x = normal(rng);
      o0 = o;
      std::vector<uint16_t> vpacked(size_t(64) * dim, 0xffff);
      amx::pack_values(rows.data(), head_offset, nk, dim, vpacked.data());
      amx::accumulate_pv(p.data(), kLd, kRows, nk, vpacked.data(), dim, o.data());
      for (int r = 0; r < kRows; ++r) {
        for (int d = 0; d < dim; ++d) {
          double want = o0[size_t(r) * dim + d];
          for (int j = 0; j < nk; ++j) {
            want += double(bf16_to_float(float_to_bf16(p[size_t(r) * kLd + j]))) * element(j, d);
          }
          ASSERT_NEAR(o[size_t(r) * dim + d], want, 1e-4 * (1 + std::abs(want))) << r << "," << d;
        }
      }
    }
  }
  // softmax_rows: blocks into a fresh state (the third's max far above: the reference max must
  // move; the fourth causal: row r sees min(nk, r / 2 - 3) keys), against the scalar update.
  std::vector<float> s(size_t(kRows) * kLd), o(size_t(kRows) * 64, 1.f);
  std::vector<core::SoftmaxState> state(kRows), want_state(kRows);
  for (int pass = 0; pass < 4; ++pass) {
    const int nk = pass == 0 ? 64 : pass == 1 ? 29 : pass == 2 ? 50 : 40;
    const int first_limit = pass == 3 ? -3 : 64;
    const int group = pass == 3 ? 2 : (1 << 30);
    for (auto& x : s) x = 4.f * normal(rng) + (pass == 2 ? 40.f : 0.f);
    const float scale = pass == 1 ? 0.7f : 1.f;  // softmax_rows scales the scores first
    std::vector<float> want(s);
    for (auto& x : want) x *= scale;
    std::vector<float> factor(kRows, 1.f);
    std::vector<int> visible(kRows);
    for (int r = 0; r < kRows; ++r) {
      visible[size_t(r)] = std::clamp(first_limit + r / group, 0, nk);
      float m = -INFINITY;
      for (int j = 0; j < visible[size_t(r)]; ++j) m = std::max(m, want[size_t(r) * kLd + j]);
      for (int j = visible[size_t(r)]; j < nk; ++j) want[size_t(r) * kLd + j] = 0.f;
      if (m == -INFINITY) continue;  // nothing seen: p = 0, the state unchanged
      // The reference max moves only past 8 ln 2 above it (amx.h).
      core::SoftmaxState& st = want_state[size_t(r)];
      if (st.max == -INFINITY || m > st.max + 8.f * std::log(2.f)) {
        factor[size_t(r)] = st.rescale_for(m);
      }
      for (int j = 0; j < visible[size_t(r)]; ++j) {
        float& x = want[size_t(r) * kLd + j];
        x = std::exp(x - st.max);
        st.sum += x;
      }
    }
    std::vector<float> o_before(o);
    amx::softmax_rows(s.data(), kLd, kRows, nk, first_limit, group, scale, state.data(), o.data(),
                      64);
    for (int r = 0; r < kRows; ++r) {
      ASSERT_EQ(state[size_t(r)].max, want_state[size_t(r)].max) << "pass " << pass << " row " << r;
      ASSERT_NEAR(state[size_t(r)].sum, want_state[size_t(r)].sum, 1e-5 * want_state[size_t(r)].sum);
      ASSERT_NEAR(o[size_t(r) * 64], o_before[size_t(r) * 64] * factor[size_t(r)], 1e-6);
      for (int j = 0; j < (nk + 15) / 16 * 16; ++j) {
        const float w = j < nk ? want[size_t(r) * kLd + j] : 0.f;
        ASSERT_NEAR(s[size_t(r) * kLd + j], w, 2e-6 * (1 + w)) << r << "," << j;
      }
    }
  }
}

TEST(CpuAttention, Avx512Bf16KernelsMatchTheFormulas) {
  if (!avx512::bf16_available()) GTEST_SKIP() << "this CPU has no AVX-512 BF16";
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto bf16 = [&](float x) { return float_to_bf16(x); };
  for (int dim : {32, 128, 256}) {
    const int rows = 8;
    const int num_keys = 7;
    const int64_t head_offset = 2 * dim;  // bytes: the keys' second "head"
    std::vector<uint16_t> q(size_t(rows) * dim);
    for (auto& x : q) x = bf16(normal(rng));
    std::vector<uint16_t> pool(size_t(num_keys) * 2 * dim);
    for (auto& x : pool) x = bf16(normal(rng));
    std::vector<const char*> keys(num_keys);
    for (int j = 0; j < num_keys; ++j) {
      keys[size_t(j)] = reinterpret_cast<const char*>(pool.data() + size_t(num_keys - 1 - j) * 2 * dim);
    }
    const int ld = 16;
    std::vector<float> s(size_t(rows) * ld, std::nanf(""));
    const float scale = 0.3f;
    avx512::scores_bf16(q.data(), rows, keys.data(), head_offset, 4, dim, scale, s.data(), ld);
    avx512::scores_bf16(q.data(), rows, keys.data() + 4, head_offset, 3, dim, scale, s.data() + 4,
                        ld);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < num_keys; ++j) {
        const uint16_t* k = reinterpret_cast<const uint16_t*>(keys[size_t(j)] + head_offset);
        double ref = 0, mag = 0;
        for (int d = 0; d < dim; ++d) {
          const double term = double(bf16_to_float(q[size_t(r) * dim + d])) * bf16_to_float(k[d]);
          ref += term;
          mag += std::abs(term);
        }
        const double got = s[size_t(r) * ld + j];
        EXPECT_NEAR(got, scale * ref, 1e-5 * scale * mag) << "dim " << dim << " row " << r << " key " << j;
      }
    }
    // Keys in 16 lanes: kt [dim, 48] fp32, zero past nk up to a multiple of 16; 6 rows (a
    // remainder of 2 after a block of 4), 37 keys (3 vectors, the last partly zero).
    {
      const int kt_rows = 6, kt_keys = 37, stride = 48;
      std::vector<float> qf(size_t(kt_rows) * dim), kt(size_t(dim) * stride, 0.f);
      for (auto& x : qf) x = normal(rng);
      for (int j = 0; j < kt_keys; ++j) {
        for (int d = 0; d < dim; ++d) kt[size_t(d) * stride + j] = normal(rng);
      }
      std::vector<float> st(size_t(kt_rows) * 64, std::nanf(""));
      avx512::scores_keys_in_lanes(qf.data(), kt_rows, kt.data(), stride, kt_keys, dim, st.data(),
                                   64);
      for (int r = 0; r < kt_rows; ++r) {
        for (int j = 0; j < 48; ++j) {
          double ref = 0, mag = 0;
          for (int d = 0; d < dim; ++d) {
            const double term = double(qf[size_t(r) * dim + d]) * kt[size_t(d) * stride + j];
            ref += term;
            mag += std::abs(term);
          }
          EXPECT_NEAR(st[size_t(r) * 64 + j], ref, 1e-5 * mag + 1e-30)
              << "keys in lanes, dim " << dim << " row " << r << " key " << j;
        }
      }
    }
    // o += p v, o in the direct path's pair order (per 16 dims: the even elements, then the odd).
    const int dv = dim;
    const int nk = 37;
    std::vector<uint16_t> v_pool(size_t(nk) * dv);
    for (auto& x : v_pool) x = bf16(normal(rng));
    std::vector<const char*> values(nk);
    for (int j = 0; j < nk; ++j) values[size_t(j)] = reinterpret_cast<const char*>(v_pool.data() + size_t(j) * dv);
    const int p_ld = 64;
    std::vector<float> p(size_t(rows) * p_ld);
    for (auto& x : p) x = std::abs(normal(rng));
    std::vector<float> o0(size_t(rows) * dv);
    for (auto& x : o0) x = normal(rng);
    auto pair_index = [](int d) { return d / 16 * 16 + (d % 2) * 8 + d % 16 / 2; };
    std::vector<float> o(o0.size());
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < dv; ++d) o[size_t(r) * dv + pair_index(d)] = o0[size_t(r) * dv + d];
    }
    avx512::accumulate_pv_bf16(p.data(), p_ld, rows, values.data(), 0, nk, dv, o.data());
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < dv; ++d) {
        double ref = o0[size_t(r) * dv + d], mag = std::abs(ref);
        for (int j = 0; j < nk; ++j) {
          const double term = double(p[size_t(r) * p_ld + j]) * bf16_to_float(v_pool[size_t(j) * dv + d]);
          ref += term;
          mag += std::abs(term);
        }
        EXPECT_NEAR(o[size_t(r) * dv + pair_index(d)], ref, 1e-5 * mag) << "dim " << dv << " row " << r << " d " << d;
      }
    }
  }
}

TEST(CpuAttention, HeadDimsAndOutputDtypes) {
  for (int dim : {8, 24, 64, 128, 256}) {
    for (int v_dim : {dim, 16}) {
      KernelCase c;
      c.name = "dims " + std::to_string(dim) + "/" + std::to_string(v_dim);
      c.q_lens = {1, 3, 20};
      c.kv_lens = {40, 3, 77};
      c.dim = dim;
      c.v_dim = v_dim;
      c.seed = uint64_t(dim + v_dim);
      check(c);
    }
  }
  for (DType io : {DType::kBFloat16, DType::kFloat16}) {
    KernelCase c;
    c.name = std::string("io ") + dtype_name(io);
    c.q_lens = {1, 9, 70};
    c.kv_lens = {50, 9, 120};
    c.io = io;
    c.out_dtype = io;
    c.kv = io;
    check(c);
  }
}

TEST(CpuAttention, CausalPrefillTilesAndWindow) {
  // Long enough for several q tiles (64 rows) and KV blocks (32 keys) with ragged edges.
  for (int group : {1, 4, 16}) {
    for (int window : {-1, 0, 5, 40}) {
      KernelCase c;
      c.name = "prefill group " + std::to_string(group) + " window " + std::to_string(window);
      c.q_heads = 2 * group;
      c.kv_heads = 2;
      c.q_lens = {70, 1, 33};
      c.kv_lens = {70, 100, 90};  // no prefix, a long prefix, a short prefix
      c.window = window;
      c.seed = uint64_t(group * 100 + window + 1);
      check(c);
    }
  }
}

TEST(CpuAttention, SoftCapNoMaskAndRagged) {
  KernelCase c;
  c.name = "softcap";
  c.q_lens = {1, 17};
  c.kv_lens = {200, 80};
  c.cap = 2.f;  // small enough to bend most logits
  check(c);
  c.name = "no mask (encoder keys)";
  c.mask = core::MaskMode::kNone;
  c.cap = 0;
  c.q_lens = {5, 2, 0};
  c.kv_lens = {9, 0, 4};
  check(c);
  for (DType io : {DType::kFloat32, DType::kBFloat16}) {
    c.name = std::string("ragged ") + dtype_name(io);
    c.mask = core::MaskMode::kCausal;
    c.ragged = true;
    c.io = io;
    c.kv = io;
    c.out_dtype = DType::kFloat32;
    c.q_lens = {40, 1, 66};
    c.kv_lens = {40, 1, 66};
    check(c);
  }
}

TEST(CpuAttention, CustomMaskWithEmptyRows) {
  for (int extra : {0, 5}) {
    for (int group : {1, 4}) {
      KernelCase c;
      c.name = "custom mask extra " + std::to_string(extra) + " group " + std::to_string(group);
      c.mask = core::MaskMode::kCustom;
      c.q_heads = 2 * group;
      c.q_lens = {4, 8, 1};
      c.kv_lens = {60, 8, 40};
      c.custom_mask_extra_cols = extra;
      c.seed = uint64_t(extra * 10 + group);
      check(c);
    }
  }
}

TEST(CpuAttention, SplitKvMergesToTheSameResult) {
  // One request and one kv head on 4 threads: the tile is split along the KV axis and merged.
  for (int kv_len : {600, 3001}) {
    for (bool decode : {true, false}) {
      KernelCase c;
      c.name = "split kv " + std::to_string(kv_len) + (decode ? " decode" : " verify-like");
      c.q_heads = 4;
      c.kv_heads = 1;
      c.q_lens = {decode ? 1 : 6};
      c.kv_lens = {kv_len};
      c.threads = 4;
      c.window = decode ? -1 : 1000;
      c.seed = uint64_t(kv_len);
      check(c);
      c.threads = 1;  // and unsplit
      check(c);
    }
  }
}

TEST(CpuAttention, RejectsSlotsOutsideThePoolAndOddDims) {
  KernelCase c;
  c.q_lens = {1};
  c.kv_lens = {4};
  std::vector<int32_t> slots = {1, 2, 99, 3};
  std::vector<int32_t> qo = {0, 1};
  std::vector<int64_t> kv = {0, 4};
  std::vector<float> q(8 * 64), out(8 * 64, 7.f);
  std::vector<uint16_t> pool(10 * 2 * 64);
  core::AttentionParams p;
  p.q = q.data();
  p.q_stride_token = 8 * 64;
  p.q_stride_head = 64;
  p.out = out.data();
  p.out_stride_token = 8 * 64;
  p.out_stride_head = 64;
  p.io_dtype = DType::kFloat32;
  p.k = pool.data();
  p.v = pool.data();
  p.k_stride_token = 128;
  p.k_stride_head = 64;
  p.v_stride_token = 128;
  p.v_stride_head = 64;
  p.kv_dtype = DType::kBFloat16;
  p.batch_size = 1;
  p.qo_indptr = qo.data();
  p.kv_indptr = kv.data();
  p.kv_indices = slots.data();
  p.num_slots = 10;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 64;
  p.v_head_dim = 64;
  ThreadPool threads(2);
  AttentionWorkspace workspace;
  try {
    run_attention(p, DType::kFloat32, threads, workspace);
    ADD_FAILURE() << "slot 99 of 10 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "kv_indices[2]");
  }
  for (float x : out) EXPECT_EQ(x, 7.f);
  slots[2] = 4;
  p.head_dim = 60;
  try {
    run_attention(p, DType::kFloat32, threads, workspace);
    ADD_FAILURE() << "head_dim 60 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotSupported);
  }
}

TEST(CpuAttention, MergeOfTwoStatesMatchesTheFormula) {
  const int tokens = 70, heads = 3, dv = 16;
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> a(size_t(tokens) * heads * dv), b(a.size()), la(size_t(tokens) * heads),
      lb(la.size());
  for (float& x : a) x = normal(rng);
  for (float& x : b) x = normal(rng);
  for (size_t i = 0; i < la.size(); ++i) {
    la[i] = i % 7 == 0 ? -INFINITY : 3.f * normal(rng);
    lb[i] = i % 11 == 0 ? -INFINITY : 3.f * normal(rng);
  }
  std::vector<uint16_t> out(a.size(), 0x7fc0);
  std::vector<float> lse(la.size(), NAN);
  ThreadPool pool(2);
  // Output rows with a stride wider than the row (a slice of a larger buffer).
  std::vector<uint16_t> wide(size_t(tokens) * heads * dv * 2, 0x7fc0);
  merge_attention_states(a.data(), la.data(), b.data(), lb.data(), tokens, heads, dv, wide.data(),
                         int64_t(heads) * dv * 2, dv, DType::kBFloat16, lse.data(), pool);
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      const size_t row = size_t(t) * heads + h;
      const double m = std::max<double>(la[row], lb[row]);
      double ref_lse = -kInf;
      double wa = 0, wb = 0;
      if (m != -kInf) {
        const double ea = std::exp(double(la[row]) - m), eb = std::exp(double(lb[row]) - m);
        wa = ea / (ea + eb);
        wb = eb / (ea + eb);
        ref_lse = m + std::log(ea + eb);
      }
      if (ref_lse == -kInf) {
        EXPECT_EQ(lse[row], -INFINITY);
      } else {
        EXPECT_NEAR(lse[row], ref_lse, 1e-5);
      }
      for (int d = 0; d < dv; ++d) {
        const double ref = wa * a[row * dv + size_t(d)] + wb * b[row * dv + size_t(d)];
        const float got = bf16_to_float(wide[size_t(t) * heads * dv * 2 + size_t(h) * dv + d]);
        EXPECT_NEAR(got, ref, 1e-2 * (1 + std::abs(ref))) << t << " " << h << " " << d;
      }
    }
    // The gap between strided rows is untouched.
    EXPECT_EQ(wide[size_t(t) * heads * dv * 2 + size_t(heads) * dv], 0x7fc0);
  }
}

}  // namespace
}  // namespace kvattn::cpu
