// The CUDA batch prefill kernel against a float64 formula written here: random inputs, poisoned
// outputs (and poisoned padding that must stay untouched), NaN in every KV slot no request
// uses, paged (page 1 shuffled, page 16) and ragged K/V, every mask, window, soft-cap, LSE,
// split-KV, fp8 KV, head_dim 64/128/256, v_head_dim below head_dim (128 with 16..112; V and out
// rows then carry NaN / poison padding after each head), lengths that are not multiples of the
// tile, kv_len 0 and 1.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

/// Owned device bytes for the test.
using ::kvattn::testing::DeviceBytes;

template <typename V>
void* upload(std::vector<std::unique_ptr<DeviceBytes>>& keep, const std::vector<V>& host) {
  keep.push_back(std::make_unique<DeviceBytes>(host.size() * sizeof(V)));
  if (!host.empty()) {
    cudaMemcpy(keep.back()->ptr, host.data(), host.size() * sizeof(V), cudaMemcpyHostToDevice);
  }
  return keep.back()->ptr;
}

struct Case {
  std::string name;
  std::vector<int> q_lens;
  std::vector<int> kv_lens;
  int num_q_heads = 8;
  int num_kv_heads = 2;
  int head_dim = 128;
  int v_head_dim = 0;  // 0: head_dim
  DType io = DType::kBFloat16;
  DType kv = DType::kBFloat16;
  core::MaskMode mask = core::MaskMode::kCausal;
  int window = -1;
  int mask_extra_cols = 0;  // kCustom rows wider than kv_len (keys are the last kv_len columns)
  float cap = 0.f;
  bool paged = true;
  int page_size = 1;
  bool shuffle = true;
  bool lse = true;
  int concurrent_ctas = 0;  // > 0: allow split-KV
  bool out_fp32 = false;    // p.out_fp32: fp32 output (a partial state for a later merge)
  float k_scale = 1.f;
  float v_scale = 1.f;
  float input_range = 2.f;
  // > 1: a key at distance n from the request's last key is scaled by key_growth^(n / 128), so
  // every block the kernel takes (last block first) moves the rows' max, by more the further it
  // goes (the online softmax's rescale on every block).
  float key_growth = 1.f;
  uint32_t seed = 1;
  bool tc_decode = false;  // run the decode-shaped kernel (launch_tc_decode) on its plan shape
  int cluster = 0;      // tc_decode: > 1 a cluster-split plan (capped at the device's max_cluster)
  bool narrow = false;  // tc_decode: the narrow instance's 16-row tiles
  bool transposed = false;  // tc_decode: the transposed instance's 8-row tiles
  // > 1: launch the plan this many times, the output poisoned again before each relaunch (a
  // relaunch of one plan must give the same answer: the dynamic schedule's counters reset).
  int launches = 1;
};

uint16_t to_16bit(float x, DType t) {
  return t == DType::kBFloat16 ? float_to_bf16(x) : float_to_fp16(x);
}
float from_16bit(uint16_t b, DType t) {
  return t == DType::kBFloat16 ? bf16_to_float(b) : fp16_to_float(b);
}

constexpr uint16_t kPoison16 = 0xffff;  // NaN in bf16 and fp16

// Runs one case end to end and checks it; prints the errors.
void run_case(const Case& c) {
  SCOPED_TRACE(c.name);
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<float> uni(-c.input_range, c.input_range);
  const int batch = static_cast<int>(c.q_lens.size());
  const int hq = c.num_q_heads, hkv = c.num_kv_heads, d = c.head_dim, group = hq / hkv;
  const int dv = c.v_head_dim > 0 ? c.v_head_dim : d;
  // v_head_dim != head_dim: V and out rows get padding after each head (NaN in V, poison in
  // out), so a kernel that reads or writes past v_head_dim fails.
  const bool narrow = dv != d;
  const int64_t v_stride_head = narrow ? dv + 16 : d;
  const int64_t out_stride_head = narrow ? dv + 8 : d;
  const bool fp8 = is_fp8_dtype(c.kv);
  const int kv_elem = dtype_size(c.kv);

  std::vector<int32_t> qo_indptr{0};
  std::vector<int64_t> kv_indptr{0};
  for (int r = 0; r < batch; ++r) {
    qo_indptr.push_back(qo_indptr.back() + c.q_lens[r]);
    kv_indptr.push_back(kv_indptr.back() + c.kv_lens[r]);
  }
  const int64_t total_q = qo_indptr.back();
  const int64_t total_kv = kv_indptr.back();

  // q and out with padding after each token's heads (strides are not hq * d).
  const int64_t q_stride_token = int64_t(hq) * d + 8;
  std::vector<uint16_t> q_host(std::max<int64_t>(total_q * q_stride_token, 1), kPoison16);
  std::vector<double> q_ref(total_q * hq * d);
  for (int64_t t = 0; t < total_q; ++t) {
    for (int h = 0; h < hq; ++h) {
      for (int i = 0; i < d; ++i) {
        const uint16_t bits = to_16bit(uni(rng), c.io);
        q_host[t * q_stride_token + h * d + i] = bits;
        q_ref[(t * hq + h) * d + i] = from_16bit(bits, c.io);
      }
    }
  }

  // K/V storage rows and, paged, the slot of every token (pages shuffled, spare pages NaN).
  int64_t num_rows = total_kv;
  std::vector<int32_t> kv_indices;
  if (c.paged) {
    std::vector<int64_t> pages_of(batch);
    int64_t total_pages = 0;
    for (int r = 0; r < batch; ++r) {
      pages_of[r] = (c.kv_lens[r] + c.page_size - 1) / c.page_size;
      total_pages += pages_of[r];
    }
    total_pages += 3;  // spare pages, never referenced
    std::vector<int32_t> page_ids(total_pages);
    std::iota(page_ids.begin(), page_ids.end(), 0);
    if (c.shuffle) std::shuffle(page_ids.begin(), page_ids.end(), rng);
    int64_t next = 0;
    for (int r = 0; r < batch; ++r) {
      for (int64_t p = 0; p < pages_of[r]; ++p) {
        const int32_t page = page_ids[next++];
        for (int s = 0; s < c.page_size && p * c.page_size + s < c.kv_lens[r]; ++s) {
          kv_indices.push_back(page * c.page_size + s);
        }
      }
    }
    num_rows = total_pages * c.page_size;
  }
  const int64_t kv_stride_token = int64_t(hkv) * d;
  const int64_t v_stride_token = hkv * v_stride_head;
  // Every row starts as NaN; rows that tokens use get values.
  std::vector<uint8_t> k_host(std::max<int64_t>(num_rows * kv_stride_token * kv_elem, 16));
  std::vector<uint8_t> v_host(std::max<int64_t>(num_rows * v_stride_token * kv_elem, 16));
  auto poison = [&](std::vector<uint8_t>& buf) {
    if (fp8) {
      std::fill(buf.begin(), buf.end(), uint8_t(0x7f));  // NaN in e4m3 and e5m2
    } else {
      std::fill(buf.begin(), buf.end(), uint8_t(0xff));
    }
  };
  poison(k_host);
  poison(v_host);
  std::vector<double> k_ref(total_kv * hkv * d), v_ref(total_kv * hkv * dv);
  auto store = [&](std::vector<uint8_t>& buf, int64_t element, float value, float scale) -> double {
    if (c.kv == DType::kFloat8E4M3) {
      buf[element] = float_to_fp8_e4m3(value / scale);
      return double(fp8_e4m3_to_float(buf[element])) * scale;
    }
    if (c.kv == DType::kFloat8E5M2) {
      buf[element] = float_to_fp8_e5m2(value / scale);
      return double(fp8_e5m2_to_float(buf[element])) * scale;
    }
    const uint16_t bits = to_16bit(value, c.kv);
    std::memcpy(&buf[element * 2], &bits, 2);
    return double(from_16bit(bits, c.kv)) * scale;
  };
  int key_request = 0;
  for (int64_t t = 0; t < total_kv; ++t) {
    const int64_t row = c.paged ? kv_indices[t] : t;
    while (t >= kv_indptr[key_request + 1]) ++key_request;
    const float k_gain =
        c.key_growth == 1.f
            ? 1.f
            : std::pow(c.key_growth, float(kv_indptr[key_request + 1] - 1 - t) / 128.f);
    for (int h = 0; h < hkv; ++h) {
      for (int i = 0; i < std::max(d, dv); ++i) {
        if (i < d) {
          k_ref[(t * hkv + h) * d + i] =
              store(k_host, row * kv_stride_token + h * d + i, uni(rng) * k_gain, c.k_scale);
        }
        if (i < dv) {
          v_ref[(t * hkv + h) * dv + i] =
              store(v_host, row * v_stride_token + h * v_stride_head + i, uni(rng), c.v_scale);
        }
      }
    }
  }

  // Custom mask: ~70% visible, one row of the first request fully hidden.
  std::vector<uint8_t> mask_host;
  std::vector<int64_t> mask_indptr{0};
  if (c.mask == core::MaskMode::kCustom) {
    for (int r = 0; r < batch; ++r) {
      for (int i = 0; i < c.q_lens[r]; ++i) {
        for (int j = 0; j < c.kv_lens[r] + c.mask_extra_cols; ++j) {
          const bool key_column = j >= c.mask_extra_cols;
          mask_host.push_back((r == 0 && i == 0 && key_column) ? 0 : (rng() % 10 < 7));
        }
      }
      mask_indptr.push_back(int64_t(mask_host.size()));
    }
  }

  const double sm_scale = 1.0 / std::sqrt(double(d));

  // ---- float64 reference ------------------------------------------------------------------
  std::vector<double> out_ref(total_q * hq * dv, 0.0);
  std::vector<double> lse_ref(total_q * hq, -INFINITY);
  for (int r = 0; r < batch; ++r) {
    const int q_len = c.q_lens[r], kv_len = c.kv_lens[r];
    for (int i = 0; i < q_len; ++i) {
      const int64_t t = qo_indptr[r] + i;
      for (int h = 0; h < hq; ++h) {
        const int kh = h / group;
        std::vector<double> logits;
        std::vector<int> keys;
        for (int j = 0; j < kv_len; ++j) {
          bool visible = true;
          if (c.mask == core::MaskMode::kCausal && j > kv_len - q_len + i) visible = false;
          // The window bounds causal and custom masks (ignored with kNone, as on the CPU).
          if (c.window >= 0 && c.mask != core::MaskMode::kNone &&
              j < kv_len - q_len + i - c.window) {
            visible = false;
          }
          if (c.mask == core::MaskMode::kCustom &&
              !mask_host[mask_indptr[r] + int64_t(i) * (kv_len + c.mask_extra_cols) +
                         c.mask_extra_cols + j]) {
            visible = false;
          }
          if (!visible) continue;
          double x = 0;
          const double* qv = &q_ref[(t * hq + h) * d];
          const double* kv = &k_ref[((kv_indptr[r] + j) * hkv + kh) * d];
          for (int e = 0; e < d; ++e) x += qv[e] * kv[e];
          x *= sm_scale;
          if (c.cap > 0) x = c.cap * std::tanh(x / c.cap);
          logits.push_back(x);
          keys.push_back(j);
        }
        if (logits.empty()) continue;
        const double m = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (double& x : logits) sum += (x = std::exp(x - m));
        double* o = &out_ref[(t * hq + h) * dv];
        for (size_t n = 0; n < keys.size(); ++n) {
          const double* vv = &v_ref[((kv_indptr[r] + keys[n]) * hkv + kh) * dv];
          for (int e = 0; e < dv; ++e) o[e] += logits[n] / sum * vv[e];
        }
        lse_ref[t * hq + h] = m + std::log(sum);
      }
    }
  }

  // ---- device run ---------------------------------------------------------------------------
  std::vector<std::unique_ptr<DeviceBytes>> keep;
  const int64_t out_stride_token = hq * out_stride_head + 8;
  // fp32 output: two 16-bit words per element (0xffff 0xffff is a NaN float too).
  const int64_t out_words = c.out_fp32 ? 2 : 1;
  std::vector<uint16_t> out_host(std::max<int64_t>(total_q * out_stride_token * out_words, 1),
                                 kPoison16);
  auto out_value = [&](int64_t element) -> double {
    if (!c.out_fp32) return from_16bit(out_host[size_t(element)], c.io);
    float value;
    std::memcpy(&value, &out_host[size_t(element) * 2], sizeof value);
    return value;
  };
  auto out_poisoned = [&](int64_t element) {
    for (int64_t w = 0; w < out_words; ++w) {
      if (out_host[size_t(element * out_words + w)] != kPoison16) return false;
    }
    return true;
  };
  int64_t unrounded = 0, written = 0;  // fp32 outputs that a 16-bit type could not hold
  std::vector<float> lse_host(std::max<int64_t>(total_q * hq, 1), std::nanf(""));

  core::AttentionParams p;
  p.q = upload(keep, q_host);
  p.q_stride_token = q_stride_token;
  p.q_stride_head = d;
  p.out = upload(keep, out_host);
  p.out_stride_token = out_stride_token;
  p.out_stride_head = out_stride_head;
  p.lse = c.lse ? static_cast<float*>(upload(keep, lse_host)) : nullptr;
  p.io_dtype = c.io;
  p.out_fp32 = c.out_fp32;
  p.k = upload(keep, k_host);
  p.v = upload(keep, v_host);
  p.k_stride_token = kv_stride_token;
  p.k_stride_head = d;
  p.v_stride_token = v_stride_token;
  p.v_stride_head = v_stride_head;
  p.kv_dtype = c.kv;
  p.k_scale = c.k_scale;
  p.v_scale = c.v_scale;
  p.batch_size = batch;
  p.qo_indptr = static_cast<const int32_t*>(upload(keep, qo_indptr));
  p.kv_indptr = static_cast<const int64_t*>(upload(keep, kv_indptr));
  p.kv_indices = c.paged ? static_cast<const int32_t*>(upload(keep, kv_indices)) : nullptr;
  p.num_slots = num_rows;
  p.mask = c.mask;
  if (c.mask == core::MaskMode::kCustom) {
    p.custom_mask = static_cast<const uint8_t*>(upload(keep, mask_host));
    p.mask_indptr = static_cast<const int64_t*>(upload(keep, mask_indptr));
  }
  p.window_left = c.window;
  p.sm_scale = static_cast<float>(sm_scale);
  p.logit_cap = c.cap;
  p.num_q_heads = hq;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.v_head_dim = dv;

  const PrefillKernelShape shape =
      c.tc_decode ? tc_decode_kernel_shape(d, dv) : prefill_kernel_shape(d, dv);
  core::PrefillTileShape tile_shape;
  tile_shape.num_q_heads = hq;
  tile_shape.num_kv_heads = hkv;
  tile_shape.tile_rows = shape.tile_rows;
  tile_shape.kv_tile = shape.kv_tile;
  tile_shape.mask = c.mask;
  tile_shape.window_left = c.window;
  tile_shape.concurrent_ctas = c.concurrent_ctas;
  tile_shape.min_split_keys = 64;
  if (c.tc_decode && c.cluster > 1) tile_shape.cluster = std::min(c.cluster, shape.max_cluster);
  if (c.tc_decode && c.narrow) {
    ASSERT_EQ(shape.narrow_tile_rows, 16);
    tile_shape.tile_rows = shape.narrow_tile_rows;
  }
  if (c.tc_decode && c.transposed) {
    ASSERT_EQ(shape.transposed_tile_rows, 8);
    tile_shape.tile_rows = shape.transposed_tile_rows;
  }
  const core::PrefillTilePlan plan = core::plan_prefill_tiles(qo_indptr, kv_indptr, tile_shape);
  if (tile_shape.cluster > 1) {
    EXPECT_EQ(plan.num_partials, 0);
    EXPECT_EQ(plan.cluster, tile_shape.cluster);
  } else if (c.concurrent_ctas > 0) {
    EXPECT_GT(plan.num_partials, 0) << "the case meant to split";
  }
  const core::PrefillBufferLayout layout =
      core::write_prefill_buffer(plan, dv, nullptr, 0, nullptr, nullptr);
  std::vector<unsigned char> metadata(layout.metadata_bytes);
  keep.push_back(std::make_unique<DeviceBytes>(layout.total_bytes));
  core::PrefillTiles tiles;
  core::write_prefill_buffer(plan, dv, metadata.data(), metadata.size(), keep.back()->ptr, &tiles);
  // Poison the partial scratch too: the merge must read only what the kernel wrote.
  CUDA_OK(cudaMemset(keep.back()->ptr, 0xff, layout.total_bytes));
  CUDA_OK(cudaMemcpy(keep.back()->ptr, metadata.data(), metadata.size(), cudaMemcpyHostToDevice));

  for (int launch = 0; launch < c.launches; ++launch) {
    if (launch > 0) {  // poison the output again: the relaunch must write all of it
      CUDA_OK(cudaMemcpy(p.out, out_host.data(), out_host.size() * 2, cudaMemcpyHostToDevice));
      if (p.lse != nullptr) {
        CUDA_OK(cudaMemcpy(p.lse, lse_host.data(), lse_host.size() * 4, cudaMemcpyHostToDevice));
      }
    }
    if (c.tc_decode) {
      launch_tc_decode(p, tiles, nullptr);
    } else {
      launch_batch_prefill(p, tiles, nullptr);
    }
    CUDA_OK(cudaDeviceSynchronize());
  }
  int counters[2] = {-1, -1};
  CUDA_OK(cudaMemcpy(counters, tiles.scheduler, sizeof counters, cudaMemcpyDeviceToHost));
  EXPECT_EQ(counters[0], 0) << c.name << ": the tile schedule's ticket counter is reset";
  EXPECT_EQ(counters[1], 0) << c.name << ": the tile schedule's finished-CTA count is reset";
  CUDA_OK(cudaMemcpy(out_host.data(), p.out, out_host.size() * 2, cudaMemcpyDeviceToHost));
  if (c.lse) {
    CUDA_OK(cudaMemcpy(lse_host.data(), p.lse, lse_host.size() * 4, cudaMemcpyDeviceToHost));
  }

  // ---- compare ------------------------------------------------------------------------------
  double diff2 = 0, ref2 = 0, worst = 0, worst_lse = 0;
  int64_t bad = 0;
  for (int64_t t = 0; t < total_q; ++t) {
    for (int h = 0; h < hq; ++h) {
      const double* r = &out_ref[(t * hq + h) * dv];
      double scale = 1e-3;
      for (int e = 0; e < dv; ++e) scale = std::max(scale, std::abs(r[e]));
      for (int e = 0; e < dv; ++e) {
        const double o = out_value(t * out_stride_token + h * out_stride_head + e);
        if (c.out_fp32 && std::isfinite(o) && o != 0.0) {
          ++written;
          if (float(from_16bit(to_16bit(float(o), c.io), c.io)) != float(o)) ++unrounded;
        }
        const double err = std::abs(o - r[e]);
        diff2 += err * err;
        ref2 += r[e] * r[e];
        if (!(err <= 1.5e-2 * scale)) {
          if (bad++ < 5) {
            ADD_FAILURE() << "out[token " << t << "][head " << h << "][" << e << "] = " << o
                          << ", expected " << r[e];
          }
        }
        worst = std::max(worst, std::isnan(o) ? INFINITY : err / scale);
      }
      if (c.lse) {
        const double l = lse_host[t * hq + h];
        const double lr = lse_ref[t * hq + h];
        if (std::isinf(lr)) {
          EXPECT_TRUE(std::isinf(l) && l < 0)
              << "lse[" << t << "][" << h << "] = " << l << ", expected -inf";
        } else {
          const double err = std::abs(l - lr);
          worst_lse = std::max(worst_lse, std::isnan(l) ? INFINITY : err);
          EXPECT_LE(err, 1e-2 + 1e-3 * std::abs(lr))
              << "lse[" << t << "][" << h << "] = " << l << ", expected " << lr;
        }
      }
    }
    // Padding (after each head's v_head_dim values, after the last head) must still be poison.
    for (int64_t e = 0; e < out_stride_token; ++e) {
      if (e < hq * out_stride_head && e % out_stride_head < dv) continue;
      EXPECT_TRUE(out_poisoned(t * out_stride_token + e))
          << "wrote padding of token " << t << " at " << e;
    }
  }
  EXPECT_EQ(bad, 0) << bad << " elements off";
  // An fp32 output that went through a 16-bit rounding would fit the 16-bit type exactly.
  if (c.out_fp32) EXPECT_GT(unrounded, written * 9 / 10) << "of " << written << " fp32 outputs";
  const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  EXPECT_LE(rel, 1e-2) << "relative L2 error";
  std::printf("  %-40s items %5zu partials %4d  rel_l2 %.2e  worst %.2e  lse %.2e\n",
              c.name.c_str(), plan.items.size(), plan.num_partials, rel, worst, worst_lse);
}

class PrefillKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kvattn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(PrefillKernel, CausalPagedPage1Shuffled) {
  Case c;
  c.name = "causal paged p1 hd128 bf16";
  c.q_lens = {37, 130, 1};
  c.kv_lens = {37, 300, 77};
  run_case(c);
}

TEST_F(PrefillKernel, CausalPagedPage16Fp16Hd64) {
  Case c;
  c.name = "causal paged p16 hd64 fp16";
  c.q_lens = {200, 65};
  c.kv_lens = {200, 1000};
  c.head_dim = 64;
  c.io = c.kv = DType::kFloat16;
  c.page_size = 16;
  c.seed = 2;
  run_case(c);
}

TEST_F(PrefillKernel, RaggedWithLse) {
  Case c;
  c.name = "causal ragged hd128 bf16 + lse";
  c.q_lens = {129, 64, 5};
  c.kv_lens = {129, 64, 5};
  c.paged = false;
  c.seed = 3;
  run_case(c);
  c.name = "none ragged hd128 bf16 + lse";
  c.mask = core::MaskMode::kNone;
  c.kv_lens = {129, 80, 200};
  c.seed = 4;
  run_case(c);
}

TEST_F(PrefillKernel, HeadDim256NoMaskPage16) {
  Case c;
  c.name = "none paged p16 hd256 bf16";
  c.q_lens = {50, 3};
  c.kv_lens = {70, 33};
  c.head_dim = 256;
  c.mask = core::MaskMode::kNone;
  c.page_size = 16;
  c.seed = 5;
  run_case(c);
  c.name = "causal paged p1 hd256 fp16";
  c.mask = core::MaskMode::kCausal;
  c.io = c.kv = DType::kFloat16;
  c.page_size = 1;
  c.q_lens = {97};
  c.kv_lens = {161};
  c.seed = 6;
  run_case(c);
}

TEST_F(PrefillKernel, CustomMask) {
  Case c;
  c.name = "custom paged p1 hd128 bf16";
  c.q_lens = {7, 16, 1};
  c.kv_lens = {100, 40, 9};
  c.mask = core::MaskMode::kCustom;
  c.seed = 7;
  run_case(c);
  c.name = "custom, rows wider than kv_len, + window";
  c.mask_extra_cols = 5;
  c.window = 20;
  c.seed = 21;
  run_case(c);
}

TEST_F(PrefillKernel, SlidingWindow) {
  Case c;
  c.name = "causal window 37 hd128";
  c.q_lens = {150, 1};
  c.kv_lens = {400, 90};
  c.window = 37;
  c.seed = 8;
  run_case(c);
  c.name = "none + window 100 (ignored) hd64";
  c.mask = core::MaskMode::kNone;
  c.head_dim = 64;
  c.window = 100;
  c.seed = 9;
  run_case(c);
}

TEST_F(PrefillKernel, SoftCap) {
  Case c;
  c.name = "causal softcap 2 hd64";
  c.q_lens = {90};
  c.kv_lens = {130};
  c.head_dim = 64;
  c.cap = 2.f;
  c.input_range = 3.f;
  c.seed = 10;
  run_case(c);
}

// Logits with a spread of tens: row maxima keep jumping, so the kernel's O rescale runs on
// later steps too, not only on the first.
TEST_F(PrefillKernel, LargeLogitsRescale) {
  Case c;
  c.name = "large logits hd64 causal";
  c.q_lens = {40, 200};
  c.kv_lens = {300, 700};
  c.head_dim = 64;
  c.input_range = 6.f;
  c.seed = 19;
  run_case(c);
  c.name = "large logits hd128 split";
  c.head_dim = 128;
  c.q_lens = {1, 3};
  c.kv_lens = {2000, 900};
  c.concurrent_ctas = 264;
  c.seed = 20;
  run_case(c);
}

// Every block after the first moves the rows' max: by a few log2 units (growth 1.3), past the
// rescale threshold (RowPairSoftmax::kRescaleLog2) and by tens to hundreds of log2 units (growth
// 2), so the output is rescaled on most blocks.
TEST_F(PrefillKernel, MaxJumpsEveryBlock) {
  Case c;
  c.name = "max jumps causal ragged";
  c.q_lens = {300, 1};
  c.kv_lens = {1500, 900};
  c.paged = false;
  c.key_growth = 2.f;
  c.seed = 31;
  run_case(c);
  c.name = "max jumps causal paged growth 1.3";
  c.paged = true;
  c.key_growth = 1.3f;
  c.seed = 32;
  run_case(c);
  c.name = "max jumps no mask hd64";
  c.mask = core::MaskMode::kNone;
  c.head_dim = 64;
  c.q_lens = {200, 70};
  c.kv_lens = {1000, 333};
  c.key_growth = 2.f;
  c.seed = 33;
  run_case(c);
  c.name = "max jumps causal hd256";
  c.mask = core::MaskMode::kCausal;
  c.head_dim = 256;
  c.q_lens = {130};
  c.kv_lens = {1100};
  c.seed = 34;
  run_case(c);
}

TEST_F(PrefillKernel, KvLenZeroAndOne) {
  Case c;
  c.name = "kv_len 0 and 1";
  c.q_lens = {4, 1, 2};
  c.kv_lens = {0, 1, 1};  // causal, q_len 2 over kv_len 1: the first query sees nothing
  c.seed = 11;
  run_case(c);
  c.name = "kv_len 0 none";
  c.mask = core::MaskMode::kNone;
  c.q_lens = {3};
  c.kv_lens = {0};
  run_case(c);
}

TEST_F(PrefillKernel, GqaGroups) {
  Case c;
  c.name = "group 8 hd128";
  c.num_q_heads = 16;
  c.num_kv_heads = 2;
  c.q_lens = {33, 70};
  c.kv_lens = {33, 120};
  c.seed = 12;
  run_case(c);
  c.name = "group 1 (MHA) hd128";
  c.num_q_heads = c.num_kv_heads = 3;
  c.seed = 13;
  run_case(c);
  // Groups that do not divide a tile's rows (128 / 192): tiles start and end inside a token, and
  // the packed row -> (token, head) map (core::FastDivmod) takes its non-power-of-two path.
  c.name = "group 6 hd128";
  c.num_q_heads = 12;
  c.num_kv_heads = 2;
  c.q_lens = {45, 100};
  c.kv_lens = {45, 230};
  c.seed = 31;
  run_case(c);
  c.name = "group 7 hd64 fp16 page 16";
  c.head_dim = 64;
  c.io = c.kv = DType::kFloat16;
  c.num_q_heads = 7;
  c.num_kv_heads = 1;
  c.page_size = 16;
  c.q_lens = {60, 1};
  c.kv_lens = {300, 77};
  c.seed = 32;
  run_case(c);
  c.name = "group 24 hd128 (a tile's rows step within a token)";
  c.head_dim = 128;
  c.io = c.kv = DType::kBFloat16;
  c.num_q_heads = 24;
  c.num_kv_heads = 1;
  c.page_size = 1;
  c.q_lens = {20, 3};
  c.kv_lens = {90, 40};
  c.seed = 33;
  run_case(c);
}

TEST_F(PrefillKernel, SplitKvDecodeLikeAndPrefill) {
  Case c;
  c.name = "split decode-like hd128 (q_len 1)";
  c.q_lens = {1, 1, 1};
  c.kv_lens = {3000, 17, 1500};
  c.concurrent_ctas = 264;
  c.seed = 14;
  run_case(c);
  c.name = "split prefill hd64 fp16 + window";
  c.head_dim = 64;
  c.io = c.kv = DType::kFloat16;
  c.q_lens = {70};
  c.kv_lens = {2500};
  c.window = 1500;
  c.seed = 15;
  run_case(c);
}

TEST_F(PrefillKernel, Fp8Kv) {
  Case c;
  c.name = "fp8 e4m3 hd128 bf16 scales";
  c.q_lens = {45, 1};
  c.kv_lens = {300, 64};
  c.kv = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.seed = 16;
  run_case(c);
  c.name = "fp8 e5m2 hd64 fp16 page 16";
  c.head_dim = 64;
  c.io = DType::kFloat16;
  c.kv = DType::kFloat8E5M2;
  c.page_size = 16;
  c.k_scale = 1.5f;
  c.v_scale = 0.25f;
  c.seed = 17;
  run_case(c);
  c.name = "fp8 e4m3 hd256 bf16 split";
  c.head_dim = 256;
  c.io = DType::kBFloat16;
  c.kv = DType::kFloat8E4M3;
  c.page_size = 1;
  c.q_lens = {1, 2};
  c.kv_lens = {900, 40};
  c.concurrent_ctas = 264;
  c.seed = 18;
  run_case(c);
}

// v_head_dim below head_dim (the kNarrowV instance at head_dim 128): every layout, mask, fp8,
// split-KV (partial rows v_head_dim wide) and the edge widths 16 and 112.
TEST_F(PrefillKernel, NarrowVHeadDimCausalPagedAndRagged) {
  Case c;
  c.name = "causal paged p1 hd128 v64 bf16 + lse";
  c.v_head_dim = 64;
  c.q_lens = {37, 130, 1};
  c.kv_lens = {37, 300, 77};
  c.seed = 30;
  run_case(c);
  c.name = "none ragged hd128 v64 fp16 + lse";
  c.io = c.kv = DType::kFloat16;
  c.paged = false;
  c.mask = core::MaskMode::kNone;
  c.q_lens = {129, 64, 5};
  c.kv_lens = {129, 80, 200};
  c.seed = 31;
  run_case(c);
  c.name = "causal ragged hd128 v16 bf16 group 8";
  c.io = c.kv = DType::kBFloat16;
  c.mask = core::MaskMode::kCausal;
  c.v_head_dim = 16;
  c.num_q_heads = 16;
  c.num_kv_heads = 2;
  c.q_lens = {33, 70};
  c.kv_lens = {33, 120};
  c.seed = 32;
  run_case(c);
  c.name = "causal paged p16 hd128 v112 fp16 window 37";
  c.io = c.kv = DType::kFloat16;
  c.paged = true;
  c.page_size = 16;
  c.v_head_dim = 112;
  c.num_q_heads = 8;
  c.window = 37;
  c.q_lens = {150, 1};
  c.kv_lens = {400, 90};
  c.seed = 33;
  run_case(c);
}

TEST_F(PrefillKernel, NarrowVHeadDimCustomSoftCapLargeLogits) {
  Case c;
  c.name = "custom paged p1 hd128 v64, wider rows + window";
  c.v_head_dim = 64;
  c.mask = core::MaskMode::kCustom;
  c.mask_extra_cols = 5;
  c.window = 20;
  c.q_lens = {7, 16, 1};
  c.kv_lens = {100, 40, 9};
  c.seed = 34;
  run_case(c);
  c.name = "causal softcap 2 hd128 v48";
  c.v_head_dim = 48;
  c.mask = core::MaskMode::kCausal;
  c.mask_extra_cols = 0;
  c.window = -1;
  c.cap = 2.f;
  c.input_range = 3.f;
  c.q_lens = {90};
  c.kv_lens = {130};
  c.seed = 35;
  run_case(c);
  c.name = "large logits hd128 v64 causal";
  c.v_head_dim = 64;
  c.cap = 0.f;
  c.input_range = 6.f;
  c.q_lens = {40, 200};
  c.kv_lens = {300, 700};
  c.seed = 36;
  run_case(c);
}

// fp32 output (the ragged + prefix EXTEND's partial states): the direct epilogue and the split
// merge both write floats that no 16-bit rounding produced.
TEST_F(PrefillKernel, Fp32Output) {
  Case c;
  c.out_fp32 = true;
  c.name = "fp32 out causal paged p1 hd128 bf16";
  c.q_lens = {37, 130, 1};
  c.kv_lens = {37, 300, 77};
  c.seed = 40;
  run_case(c);
  c.name = "fp32 out ragged none hd64 fp16";
  c.head_dim = 64;
  c.io = c.kv = DType::kFloat16;
  c.paged = false;
  c.mask = core::MaskMode::kNone;
  c.q_lens = {129, 64, 5};
  c.kv_lens = {129, 64, 5};
  c.seed = 41;
  run_case(c);
  c.name = "fp32 out split prefill hd128 v96 bf16";
  c.head_dim = 128;
  c.v_head_dim = 96;
  c.io = c.kv = DType::kBFloat16;
  c.paged = true;
  c.mask = core::MaskMode::kCausal;
  c.q_lens = {70, 1};
  c.kv_lens = {2500, 1800};
  c.concurrent_ctas = 264;
  c.seed = 42;
  run_case(c);
}

TEST_F(PrefillKernel, NarrowVHeadDimSplitKvAndShortKv) {
  Case c;
  c.name = "split decode-like hd128 v64 (q_len 1)";
  c.v_head_dim = 64;
  c.q_lens = {1, 1, 1};
  c.kv_lens = {3000, 17, 1500};
  c.concurrent_ctas = 264;
  c.seed = 37;
  run_case(c);
  c.name = "split prefill hd128 v96 fp16 + window";
  c.v_head_dim = 96;
  c.io = c.kv = DType::kFloat16;
  c.q_lens = {70};
  c.kv_lens = {2500};
  c.window = 1500;
  c.seed = 38;
  run_case(c);
  c.name = "kv_len 0 and 1 hd128 v32";
  c.v_head_dim = 32;
  c.io = c.kv = DType::kBFloat16;
  c.concurrent_ctas = 0;
  c.window = -1;
  c.q_lens = {4, 1, 2};
  c.kv_lens = {0, 1, 1};
  c.seed = 39;
  run_case(c);
}

TEST_F(PrefillKernel, NarrowVHeadDimFp8Kv) {
  Case c;
  c.name = "fp8 e4m3 hd128 v64 bf16 scales";
  c.v_head_dim = 64;
  c.q_lens = {45, 1};
  c.kv_lens = {300, 64};
  c.kv = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.seed = 40;
  run_case(c);
  c.name = "fp8 e5m2 hd128 v80 fp16 page 16";
  c.v_head_dim = 80;
  c.io = DType::kFloat16;
  c.kv = DType::kFloat8E5M2;
  c.page_size = 16;
  c.k_scale = 1.5f;
  c.v_scale = 0.25f;
  c.seed = 41;
  run_case(c);
  c.name = "fp8 e4m3 hd128 v64 bf16 split";
  c.v_head_dim = 64;
  c.io = DType::kBFloat16;
  c.kv = DType::kFloat8E4M3;
  c.page_size = 1;
  c.q_lens = {1, 2};
  c.kv_lens = {900, 40};
  c.concurrent_ctas = 264;
  c.seed = 42;
  run_case(c);
}

// Host-only: which (head_dim, v_head_dim) pairs the kernel serves (runs without a device).
TEST(PrefillKernelSupport, VHeadDimPairs) {
  for (int dv = 16; dv < 128; dv += 16) {
    EXPECT_TRUE(prefill_v_head_dim_supported(128, dv)) << dv;
    EXPECT_EQ(prefill_kernel_shape(128, dv).tile_rows, prefill_kernel_shape(128).tile_rows);
  }
  for (int d : {64, 128, 256}) {
    EXPECT_TRUE(prefill_v_head_dim_supported(d, d)) << d;
    EXPECT_EQ(prefill_kernel_shape(d, d).kv_tile, prefill_kernel_shape(d).kv_tile);
  }
  // head_dim 192 with v_head_dim 128 (DeepSeek's MHA prefill): the Hopper kernel only.
  EXPECT_TRUE(prefill_v_head_dim_supported(192, 128));
  if (prefill_kernel_family(192, 128) == PrefillKernelFamily::kSm90) {
    EXPECT_EQ(prefill_kernel_shape(192, 128).tile_rows, 128);
  } else {
    EXPECT_THROW(prefill_kernel_shape(192, 128), Error);
  }
  const int unsupported[][2] = {{128, 72},  {128, 8},  {128, 0}, {128, 144}, {128, 256}, {64, 32},
                                {256, 128}, {256, 64}, {96, 64}, {192, 192}, {192, 64}};
  for (const auto& pair : unsupported) {
    EXPECT_FALSE(prefill_v_head_dim_supported(pair[0], pair[1])) << pair[0] << "/" << pair[1];
    try {
      prefill_kernel_shape(pair[0], pair[1]);
      ADD_FAILURE() << "no throw for " << pair[0] << "/" << pair[1];
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kNotSupported);
      const std::string what = e.what();
      EXPECT_NE(what.find("v_head_dim " + std::to_string(pair[1])), std::string::npos) << what;
    }
  }
}

// The Hopper kernel's own edges: more tiles than SMs (the persistent loop runs several tiles a
// CTA, its stage ring and barriers carry across tiles), long key ranges (many blocks through
// the two-stage ring, causal masks only on the diagonal blocks), head_dim 192 / 128.
TEST_F(PrefillKernel, ManyTilesLongKeys) {
  Case c;
  c.name = "causal ragged hd128 bf16, 156 tiles";
  c.num_q_heads = 16;
  c.num_kv_heads = 4;
  c.q_lens = {900, 300};
  c.kv_lens = {900, 300};
  c.paged = false;
  c.seed = 40;
  c.launches = 3;  // more tiles than SMs: the dynamic schedule hands out tickets, and resets
  run_case(c);
  c.name = "causal paged p1 hd128 fp16, prefix 1000";
  c.io = c.kv = DType::kFloat16;
  c.paged = true;
  c.q_lens = {200, 1, 77};
  c.kv_lens = {1200, 1001, 1077};
  c.seed = 41;
  run_case(c);
  c.name = "window 300 + soft-cap paged p16 hd64";
  c.head_dim = 64;
  c.io = c.kv = DType::kBFloat16;
  c.page_size = 16;
  c.window = 300;
  c.cap = 30.f;
  c.input_range = 4.f;
  c.q_lens = {500, 40};
  c.kv_lens = {900, 1040};
  c.seed = 42;
  run_case(c);
}

// Ragged K/V over several requests at every head_dim (the tensor-map path; a block can run into
// the next request's rows), bf16 and fp32 output.
TEST_F(PrefillKernel, RaggedManyRequestsEveryHeadDim) {
  for (int d : {64, 128, 256}) {
    for (bool fp32_out : {false, true}) {
      Case c;
      c.name = "ragged causal hd" + std::to_string(d) + (fp32_out ? " fp32 out" : " bf16");
      c.head_dim = d;
      c.num_q_heads = 8;
      c.num_kv_heads = 2;
      c.q_lens = {160, 97, 130, 64};
      c.kv_lens = {160, 97, 130, 64};
      c.paged = false;
      c.out_fp32 = fp32_out;
      c.seed = 60 + d + (fp32_out ? 1 : 0);
      run_case(c);
    }
  }
}

TEST_F(PrefillKernel, HeadDim192V128) {
  if (prefill_kernel_family(192, 128) != PrefillKernelFamily::kSm90) {
    GTEST_SKIP() << "head_dim 192 runs on the Hopper kernel only";
  }
  Case c;
  c.name = "causal paged p1 hd192 v128 bf16 + lse";
  c.head_dim = 192;
  c.v_head_dim = 128;
  c.q_lens = {130, 37, 1};
  c.kv_lens = {400, 37, 77};
  c.seed = 50;
  run_case(c);
  c.name = "causal ragged hd192 v128 fp16";
  c.io = c.kv = DType::kFloat16;
  c.paged = false;
  c.q_lens = {300, 5};
  c.kv_lens = {300, 5};
  c.seed = 51;
  run_case(c);
  c.name = "custom hd192 v128 bf16 split";
  c.io = c.kv = DType::kBFloat16;
  c.paged = true;
  c.mask = core::MaskMode::kCustom;
  c.q_lens = {8, 3};
  c.kv_lens = {1500, 700};
  c.concurrent_ctas = 264;
  c.seed = 52;
  run_case(c);
  c.name = "fp8 e4m3 hd192 v128 bf16";
  c.mask = core::MaskMode::kCausal;
  c.kv = DType::kFloat8E4M3;
  c.concurrent_ctas = 0;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.q_lens = {60};
  c.kv_lens = {260};
  c.seed = 53;
  run_case(c);
}

TEST_F(PrefillKernel, RejectsUnsupported) {
  core::AttentionParams p;
  p.num_q_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = 96;
  p.v_head_dim = 96;
  core::PrefillTiles tiles;
  auto kind_of = [&]() {
    try {
      launch_batch_prefill(p, tiles, nullptr);
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::kInvalidArgument;  // no throw: reported below as the wrong kind
  };
  EXPECT_EQ(kind_of(), ErrorKind::kNotSupported);  // head_dim 96
  p.head_dim = 128;
  p.v_head_dim = 72;
  EXPECT_EQ(kind_of(), ErrorKind::kNotSupported);  // not a multiple of 16
  p.v_head_dim = 160;
  EXPECT_EQ(kind_of(), ErrorKind::kNotSupported);  // above head_dim
  p.head_dim = 64;
  p.v_head_dim = 32;
  EXPECT_EQ(kind_of(), ErrorKind::kNotSupported);  // below head_dim is compiled at 128 only
  p.head_dim = 128;
  p.v_head_dim = 128;
  p.io_dtype = DType::kFloat32;
  EXPECT_EQ(kind_of(), ErrorKind::kNotSupported);
  p.io_dtype = DType::kBFloat16;
  p.kv_dtype = DType::kFloat16;
  EXPECT_EQ(kind_of(), ErrorKind::kNotSupported);
  EXPECT_THROW(prefill_kernel_shape(80), Error);

  // A K/V row pitch of 4 GiB or more: the kernels address a row as a 32-bit row (slot or key)
  // times a 32-bit pitch, so the call is refused by name before any launch.
  p.kv_dtype = DType::kBFloat16;
  tiles.group_size = 4;
  tiles.group_div = core::FastDivmod(4);
  tiles.tile_rows = prefill_kernel_shape(128).tile_rows;
  const int32_t qo[2] = {0, 1};
  const int64_t kv[2] = {0, 1};
  p.qo_indptr = qo;
  p.kv_indptr = kv;
  for (const int64_t stride : {int64_t{1} << 31, int64_t{3} << 30}) {
    p.k_stride_token = p.v_stride_token = stride;  // x 2 bytes: 4 GiB, 6 GiB
    try {
      launch_batch_prefill(p, tiles, nullptr);
      ADD_FAILURE() << "a " << stride << "-element row pitch was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("k_stride_token"), std::string::npos) << e.what();
    }
  }
}

// ---- the decode-shaped tensor-core kernel (tc_decode_kernel.cuh) on its own plan shape -------

class TcDecodeKernel : public PrefillKernel {};

// Verify-shaped: few query tokens (tree tokens) over a long prefix, a random custom mask over
// every column, split across CTAs (and not), paged page 1 shuffled and page 16, ragged.
TEST_F(TcDecodeKernel, VerifyCustomMaskSplitAndWhole) {
  Case c;
  c.tc_decode = true;
  c.name = "tc verify custom p1 hd128 split";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.q_lens = {8, 8, 3};
  c.kv_lens = {2056, 777, 3};
  c.mask = core::MaskMode::kCustom;
  c.concurrent_ctas = 264;
  c.seed = 101;
  run_case(c);
  c.name = "tc verify custom p16 hd128 whole + extra cols";
  c.page_size = 16;
  c.concurrent_ctas = 0;
  c.mask_extra_cols = 3;
  c.seed = 102;
  run_case(c);
  c.name = "tc verify custom ragged fp16 split";
  c.paged = false;
  c.io = c.kv = DType::kFloat16;
  c.mask_extra_cols = 0;
  c.concurrent_ctas = 264;
  c.seed = 103;
  run_case(c);
}

// Two row tiles a request (16 tokens x 4 heads = 64 rows), rows not a multiple of the tile
// (5 tokens x 4 = 20), causal (draft extend) with a window, soft-cap, large logits.
TEST_F(TcDecodeKernel, CausalWindowSoftCapRowTiles) {
  Case c;
  c.tc_decode = true;
  c.name = "tc causal 64 rows a request hd128";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.q_lens = {16, 5, 1};
  c.kv_lens = {1040, 333, 70};
  c.concurrent_ctas = 264;
  c.seed = 104;
  run_case(c);
  c.name = "tc causal window 100 softcap hd64";
  c.head_dim = 64;
  c.window = 100;
  c.cap = 2.f;
  c.input_range = 3.f;
  c.seed = 105;
  run_case(c);
  c.name = "tc large logits hd128 split";
  c.head_dim = 128;
  c.window = -1;
  c.cap = 0.f;
  c.input_range = 6.f;
  c.seed = 106;
  run_case(c);
}

// Decode of a large GQA group (q_len 1, group 8 and 16), kv_len 0 and 1, none mask.
TEST_F(TcDecodeKernel, DecodeGroupsAndShortKv) {
  Case c;
  c.tc_decode = true;
  c.name = "tc decode group 8 hd128 split";
  c.num_q_heads = 16;
  c.num_kv_heads = 2;
  c.q_lens = {1, 1, 1, 1};
  c.kv_lens = {3000, 1, 0, 65};
  c.concurrent_ctas = 264;
  c.seed = 107;
  run_case(c);
  c.name = "tc decode group 16 hd64 fp16 none";
  c.num_q_heads = 16;
  c.num_kv_heads = 1;
  c.head_dim = 64;
  c.io = c.kv = DType::kFloat16;
  c.mask = core::MaskMode::kNone;
  c.q_lens = {1, 2};
  c.kv_lens = {500, 0};
  c.seed = 108;
  run_case(c);
}

TEST_F(TcDecodeKernel, Fp8KvAndFp32Output) {
  Case c;
  c.tc_decode = true;
  c.name = "tc fp8 e4m3 hd128 custom split";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.q_lens = {8, 4};
  c.kv_lens = {1500, 90};
  c.mask = core::MaskMode::kCustom;
  c.kv = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.concurrent_ctas = 264;
  c.seed = 109;
  run_case(c);
  c.name = "tc fp8 e5m2 hd64 fp16 page 16 causal";
  c.head_dim = 64;
  c.io = DType::kFloat16;
  c.kv = DType::kFloat8E5M2;
  c.mask = core::MaskMode::kCausal;
  c.page_size = 16;
  c.k_scale = 1.5f;
  c.v_scale = 0.25f;
  c.seed = 110;
  run_case(c);
  c.name = "tc fp32 output hd128 causal";
  c.head_dim = 128;
  c.io = c.kv = DType::kBFloat16;
  c.page_size = 1;
  c.k_scale = c.v_scale = 1.f;
  c.out_fp32 = true;
  c.concurrent_ctas = 0;
  c.seed = 111;
  run_case(c);
}

// The cluster split: a tile's chunks are one thread-block cluster that merges them in
// distributed shared memory (no partials, no merge grid): verify masks, empty chunks (kv_len 0
// and 1, tiles with fewer steps than chunks), causal window soft-cap, two row tiles a request,
// fp8 KV, fp32 output, every cluster size.
TEST_F(TcDecodeKernel, ClusterSplit) {
  if (tc_decode_kernel_shape(128, 128).max_cluster < 2) {
    GTEST_SKIP() << "no cluster split on this device (or KVATTN_TC_DECODE_MERGE=grid|kernel)";
  }
  Case c;
  c.tc_decode = true;
  c.name = "tc cluster 16 verify custom p1 hd128";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.q_lens = {8, 8, 3};
  c.kv_lens = {2056, 777, 3};
  c.mask = core::MaskMode::kCustom;
  c.concurrent_ctas = 264;
  c.cluster = 16;
  c.seed = 121;
  run_case(c);
  c.name = "tc cluster 8 decode group 8 kv 0 and 1";
  c.num_q_heads = 16;
  c.num_kv_heads = 2;
  c.q_lens = {1, 1, 1, 1};
  c.kv_lens = {3000, 1, 0, 65};
  c.mask = core::MaskMode::kCausal;
  c.cluster = 8;
  c.seed = 122;
  run_case(c);
  c.name = "tc cluster 4 causal window softcap 64 rows hd64 page 16";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 64;
  c.q_lens = {16, 5, 1};
  c.kv_lens = {1040, 333, 70};
  c.window = 100;
  c.cap = 2.f;
  c.input_range = 3.f;
  c.page_size = 16;
  c.cluster = 4;
  c.seed = 123;
  run_case(c);
  c.name = "tc cluster 2 fp8 e4m3 custom hd128";
  c.head_dim = 128;
  c.window = -1;
  c.cap = 0.f;
  c.input_range = 2.f;
  c.page_size = 1;
  c.q_lens = {8, 4};
  c.kv_lens = {1500, 90};
  c.mask = core::MaskMode::kCustom;
  c.kv = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.cluster = 2;
  c.seed = 124;
  run_case(c);
  c.name = "tc cluster 16 fp32 output ragged fp16";
  c.kv = c.io = DType::kFloat16;
  c.k_scale = c.v_scale = 1.f;
  c.paged = false;
  c.out_fp32 = true;
  c.cluster = 16;
  c.seed = 125;
  run_case(c);
}

// The narrow instance (16-row tiles, Q in registers): draft extend (4 tokens x 4 heads), the
// multi-step draft's branch rows under a custom mask, decode of a group of 8, requests of more
// rows than a tile (two and three tiles), kv_len 0 and 1, window + soft-cap, fp8, fp32 output,
// ragged, head_dim 64, split and whole, with and without the cluster split.
TEST_F(TcDecodeKernel, NarrowTiles) {
  Case c;
  c.tc_decode = true;
  c.narrow = true;
  c.name = "tc narrow draft extend causal hd128 split";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.q_lens = {4, 4, 4, 1};
  c.kv_lens = {2052, 700, 4, 1};
  c.concurrent_ctas = 264;
  c.seed = 131;
  run_case(c);
  c.name = "tc narrow custom mask 4 and 9 tokens (3 tiles) fp8 e4m3 cluster";
  c.q_lens = {4, 9};
  c.kv_lens = {1500, 90};
  c.mask = core::MaskMode::kCustom;
  c.kv = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.cluster = 4;
  c.seed = 132;
  run_case(c);
  c.name = "tc narrow decode group 8 kv 0 1 window softcap hd64 fp16 page 16";
  c.num_q_heads = 16;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.io = c.kv = DType::kFloat16;
  c.k_scale = c.v_scale = 1.f;
  c.mask = core::MaskMode::kCausal;
  c.window = 300;
  c.cap = 2.f;
  c.input_range = 3.f;
  c.page_size = 16;
  c.q_lens = {1, 1, 1, 2};
  c.kv_lens = {3000, 1, 0, 65};
  c.cluster = 0;
  c.seed = 133;
  run_case(c);
  c.name = "tc narrow fp32 output ragged bf16 whole";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.io = c.kv = DType::kBFloat16;
  c.window = -1;
  c.cap = 0.f;
  c.input_range = 2.f;
  c.paged = false;
  c.out_fp32 = true;
  c.q_lens = {4, 3};
  c.kv_lens = {1000, 30};
  c.concurrent_ctas = 0;
  c.seed = 134;
  run_case(c);
  c.name = "tc narrow cluster 16 ragged fp16 large logits";
  c.io = c.kv = DType::kFloat16;
  c.out_fp32 = false;
  c.input_range = 6.f;
  c.q_lens = {4};
  c.kv_lens = {4100};
  c.concurrent_ctas = 264;
  c.cluster = 16;
  c.seed = 135;
  run_case(c);
  // Batch-1 decode as the backend plans it (GQA 4, page 1, one long request and a short one).
  c.name = "tc narrow decode cluster 16 page 1 bf16 long";
  c.io = c.kv = DType::kBFloat16;
  c.input_range = 2.f;
  c.paged = true;
  c.q_lens = {1, 1};
  c.kv_lens = {9001, 17};
  c.cluster = 16;
  c.seed = 136;
  run_case(c);
}

// The transposed instance (8-row tiles, S^T = K Q^T): decode of groups 4 and 8, requests of
// more rows than a tile (draft extend: 2 and 3 tiles), kv_len 0 and 1, causal, window +
// soft-cap, custom masks (rows as wide as the keys and wider), fp8 with scales, fp32 output,
// ragged, head_dim 64, split and whole, with and without the cluster split, keys that move the
// max on every block.
TEST_F(TcDecodeKernel, TransposedTiles) {
  Case c;
  c.tc_decode = true;
  c.transposed = true;
  c.name = "tc transposed decode group 4 split page 1 bf16";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.q_lens = {1, 1, 1, 1, 1};
  c.kv_lens = {4100, 700, 16, 1, 0};
  c.concurrent_ctas = 264;
  c.seed = 141;
  run_case(c);
  c.name = "tc transposed draft extend causal 2 and 5 tokens page 16 growing keys";
  c.q_lens = {2, 5, 1};
  c.kv_lens = {2052, 300, 3};
  c.page_size = 16;
  c.key_growth = 1.5f;
  c.seed = 142;
  run_case(c);
  c.name = "tc transposed decode fp8 e4m3 scales cluster 16";
  c.key_growth = 1.f;
  c.q_lens = {1, 1};
  c.kv_lens = {9001, 17};
  c.kv = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.cluster = 16;
  c.seed = 143;
  run_case(c);
  c.name = "tc transposed decode group 8 kv 0 1 window softcap hd64 fp16 page 16";
  c.num_q_heads = 16;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.io = c.kv = DType::kFloat16;
  c.k_scale = c.v_scale = 1.f;
  c.mask = core::MaskMode::kCausal;
  c.window = 300;
  c.cap = 2.f;
  c.input_range = 3.f;
  c.q_lens = {1, 1, 1, 2};
  c.kv_lens = {3000, 1, 0, 65};
  c.cluster = 0;
  c.seed = 144;
  run_case(c);
  c.name = "tc transposed fp32 output ragged bf16 whole";
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.io = c.kv = DType::kBFloat16;
  c.window = -1;
  c.cap = 0.f;
  c.input_range = 2.f;
  c.paged = false;
  c.out_fp32 = true;
  c.q_lens = {1, 3};
  c.kv_lens = {1000, 30};
  c.concurrent_ctas = 0;
  c.seed = 145;
  run_case(c);
  c.name = "tc transposed custom mask 2 tokens and 1 fp8 e4m3 cluster 4";
  c.out_fp32 = false;
  c.paged = true;
  c.mask = core::MaskMode::kCustom;
  c.kv = DType::kFloat8E4M3;
  c.k_scale = 0.5f;
  c.v_scale = 2.f;
  c.q_lens = {2, 1, 2};
  c.kv_lens = {1500, 90, 2};
  c.concurrent_ctas = 264;
  c.cluster = 4;
  c.seed = 147;
  run_case(c);
  c.name = "tc transposed custom mask wider rows 2 and 5 tokens split";
  c.kv = DType::kBFloat16;
  c.k_scale = c.v_scale = 1.f;
  c.mask_extra_cols = 5;
  c.q_lens = {2, 5};
  c.kv_lens = {3000, 40};
  c.cluster = 0;
  c.seed = 148;
  run_case(c);
  c.mask_extra_cols = 0;
  c.name = "tc transposed e5m2 large logits split relaunched";
  c.out_fp32 = false;
  c.paged = true;
  c.mask = core::MaskMode::kNone;
  c.kv = DType::kFloat8E5M2;
  c.input_range = 6.f;
  c.q_lens = {1, 1, 1};
  c.kv_lens = {5000, 64, 65};
  c.concurrent_ctas = 264;
  c.launches = 2;
  c.seed = 146;
  run_case(c);
}

TEST(TcDecodeKernelSupport, ShapesAndRefusals) {
  if (kvattn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(tc_decode_serves(128, 128));
  EXPECT_TRUE(tc_decode_serves(64, 64));
  EXPECT_FALSE(tc_decode_serves(256, 256));
  EXPECT_FALSE(tc_decode_serves(128, 64));
  const PrefillKernelShape shape = tc_decode_kernel_shape(128, 128);
  EXPECT_EQ(shape.family, PrefillKernelFamily::kTcDecode);
  EXPECT_EQ(shape.tile_rows, 32);
  EXPECT_EQ(shape.narrow_tile_rows, 16);
  EXPECT_EQ(shape.transposed_tile_rows, 8);
  EXPECT_EQ(shape.kv_tile, 64);
  EXPECT_GE(shape.ctas_per_sm, 1);
  EXPECT_THROW(tc_decode_kernel_shape(256, 256), Error);
}

}  // namespace
}  // namespace kvattn::cuda
