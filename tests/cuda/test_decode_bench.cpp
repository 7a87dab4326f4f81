// Timing of decode through the CUDA backend on the SPEC §6 grid (32 q / 8 kv heads, head_dim
// 128, bf16), next to the read-only streaming ceiling measured in the same run. Runs only with
// KVATTN_DECODE_BENCH=1; prints one row per case and a summary table last.
//
// Method: random K/V (never zeros) in a pool whose slots are shuffled (page 1) or whose pages
// are shuffled (page 16); the plan and indices are built once (init_forward_metadata), then
// forward_decode (save_kv_cache = false: attention only) is timed with CUDA events, median of
// reps, as graph replays and as direct calls. Small cases rotate layers so the inputs exceed
// the 60 MiB L2. Each case checks request 0's output against a float64 computation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_bench/bench_support.h"
#include "cuda/kernels/decode.h"
#include "kvattn/kvattn.h"

namespace kvattn {
namespace {

struct BenchCase {
  int batch;
  int kv_len;
  int page_size;
  const char* tensor_cores;  // "0" CUDA-core kernel, "1" tensor-core kernel
};

struct BenchRow {
  BenchCase c;
  double graph_us = 0;
  double direct_us = 0;
  double gbps = 0;
  double fraction = 0;
  double max_rel_err = 0;
};

constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr int kHeadDim = 128;

std::vector<uint16_t> download_bf16(const void* src, int64_t count) {
  std::vector<uint16_t> out(static_cast<size_t>(count));
  copy_bytes(out.data(), Device::cpu(), src, Device::cuda(0), out.size() * 2);
  return out;
}

BenchRow run_case(const BenchCase& c, double read_gbps, cuda::bench::Stream& stream) {
  setenv("KVATTN_DECODE_TENSOR_CORES", c.tensor_cores, 1);
  const Device dev = Device::cuda(0);
  const int64_t pages_per_req = (c.kv_len + c.page_size - 1) / c.page_size;
  const int64_t num_pages = 1 + int64_t(c.batch) * pages_per_req;
  const int64_t layer_bytes = num_pages * c.page_size * kKvHeads * kHeadDim * 2 * 2;
  // At least 4x the L2 per rotation.
  const int num_layers = int(std::clamp<int64_t>((int64_t(256) << 20) / layer_bytes + 1, 1, 8));

  KvCacheConfig kc;
  kc.num_layers = num_layers;
  kc.num_slots = num_pages * c.page_size;
  kc.num_kv_heads = kKvHeads;
  kc.head_dim = kHeadDim;
  kc.page_size = c.page_size;
  kc.dtype = DType::kBFloat16;
  kc.device = dev;
  KvCache cache = KvCache::allocate(kc);
  for (int l = 0; l < num_layers; ++l) {
    cuda::bench::fill_random(cache.k_buffer(l), 1000 + l, 1.f, stream.handle());
    cuda::bench::fill_random(cache.v_buffer(l), 2000 + l, 1.f, stream.handle());
  }
  // Shuffled pages (page 1: shuffled slots); page 0 stays the padding page.
  std::vector<int32_t> pages(static_cast<size_t>(num_pages - 1));
  std::iota(pages.begin(), pages.end(), 1);
  std::mt19937 rng(uint32_t(c.batch * 131 + c.kv_len));
  std::shuffle(pages.begin(), pages.end(), rng);
  ReqToTokenPool pool = ReqToTokenPool::allocate(c.batch, c.kv_len, dev);
  std::vector<std::vector<int32_t>> slots(static_cast<size_t>(c.batch));
  for (int r = 0; r < c.batch; ++r) {
    auto& row = slots[size_t(r)];
    row.resize(size_t(c.kv_len));
    for (int i = 0; i < c.kv_len; ++i) {
      row[size_t(i)] =
          pages[size_t(r * pages_per_req + i / c.page_size)] * c.page_size + i % c.page_size;
    }
    pool.write(r, 0, row);
  }
  Buffer q_buf = Buffer::allocate(dev, size_t(c.batch) * kQHeads * kHeadDim * 2);
  Buffer out_buf = Buffer::allocate(dev, size_t(c.batch) * kQHeads * kHeadDim * 2);
  const TensorView q = q_buf.view(DType::kBFloat16, {c.batch, kQHeads, kHeadDim});
  const TensorView out = out_buf.view(DType::kBFloat16, {c.batch, kQHeads, kHeadDim});
  cuda::bench::fill_random(q, 3000, 1.f, stream.handle());
  std::vector<int32_t> rows(static_cast<size_t>(c.batch)),
      lens(static_cast<size_t>(c.batch), c.kv_len);
  std::iota(rows.begin(), rows.end(), 0);
  Buffer rows_buf = Buffer::allocate(dev, rows.size() * 4);
  Buffer lens_buf = Buffer::allocate(dev, lens.size() * 4);
  copy_bytes(rows_buf.data(), dev, rows.data(), Device::cpu(), rows.size() * 4);
  copy_bytes(lens_buf.data(), dev, lens.data(), Device::cpu(), lens.size() * 4);

  BackendConfig config;
  config.kv_cache = &cache;
  config.req_to_token_pool = &pool;
  config.num_q_heads = kQHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kHeadDim;
  config.q_dtype = DType::kBFloat16;
  config.cuda_stream = stream.handle();
  auto backend = make_backend(BackendKind::kCuda, config);
  ForwardBatch batch;
  batch.mode = ForwardMode::kDecode;
  batch.batch_size = c.batch;
  batch.req_pool_indices = rows_buf.view(DType::kInt32, {c.batch});
  batch.seq_lens = lens_buf.view(DType::kInt32, {c.batch});
  batch.seq_lens_cpu = TensorView(lens.data(), DType::kInt32, Device::cpu(), {c.batch});
  backend->init_forward_metadata(batch);

  auto layer_for = [&](int l) {
    AttentionLayer layer;
    layer.layer_id = l;
    layer.num_q_heads = kQHeads;
    layer.num_kv_heads = kKvHeads;
    layer.head_dim = kHeadDim;
    layer.scaling = 1.f / std::sqrt(float(kHeadDim));
    return layer;
  };
  auto fn = [&](int call) {
    backend->forward_decode(q, TensorView(), TensorView(), out, layer_for(call % num_layers), batch,
                            false);
  };
  cuda::bench::TimingOptions options;
  options.calls_per_rep = num_layers;
  options.max_seconds = 1.0;
  BenchRow row;
  row.c = c;
  options.use_graph = true;
  row.graph_us = cuda::bench::time_on_stream(fn, stream.handle(), options).median_us;
  options.use_graph = false;
  row.direct_us = cuda::bench::time_on_stream(fn, stream.handle(), options).median_us;
  const double bytes = double(c.batch) * c.kv_len * kKvHeads * kHeadDim * 2 * 2;
  const double best_us = std::min(row.graph_us, row.direct_us);
  row.gbps = bytes / (best_us * 1e-6) / 1e9;
  row.fraction = row.gbps / read_gbps;

  // Request 0 against float64, layer 0.
  fn(0);
  stream.synchronize();
  const std::vector<uint16_t> qh = download_bf16(q.data(), kQHeads * kHeadDim);
  const std::vector<uint16_t> oh = download_bf16(out.data(), kQHeads * kHeadDim);
  std::vector<double> kd(size_t(c.kv_len) * kKvHeads * kHeadDim), vd(kd.size());
  for (int i = 0; i < c.kv_len; ++i) {
    const int64_t slot = slots[0][size_t(i)];
    const int64_t row_elems = kKvHeads * kHeadDim;
    const auto kr =
        download_bf16(cache.k_buffer(0).data_as<uint16_t>() + slot * row_elems, row_elems);
    const auto vr =
        download_bf16(cache.v_buffer(0).data_as<uint16_t>() + slot * row_elems, row_elems);
    for (int64_t e = 0; e < row_elems; ++e) {
      kd[size_t(i * row_elems + e)] = bf16_to_float(kr[size_t(e)]);
      vd[size_t(i * row_elems + e)] = bf16_to_float(vr[size_t(e)]);
    }
  }
  double worst = 0;
  for (int h = 0; h < kQHeads; ++h) {
    const int kvh = h / (kQHeads / kKvHeads);
    std::vector<double> logits(static_cast<size_t>(c.kv_len));
    double m = -INFINITY;
    for (int i = 0; i < c.kv_len; ++i) {
      double dot = 0;
      for (int d = 0; d < kHeadDim; ++d) {
        dot += double(bf16_to_float(qh[size_t(h * kHeadDim + d)])) *
               kd[size_t((i * kKvHeads + kvh) * kHeadDim + d)];
      }
      logits[size_t(i)] = dot / std::sqrt(double(kHeadDim));
      m = std::max(m, logits[size_t(i)]);
    }
    double sum = 0;
    std::vector<double> o(kHeadDim, 0.0);
    for (int i = 0; i < c.kv_len; ++i) {
      const double p = std::exp(logits[size_t(i)] - m);
      sum += p;
      for (int d = 0; d < kHeadDim; ++d)
        o[size_t(d)] += p * vd[size_t((i * kKvHeads + kvh) * kHeadDim + d)];
    }
    double max_ref = 0, max_diff = 0;
    for (int d = 0; d < kHeadDim; ++d) {
      const double ref = o[size_t(d)] / sum;
      const double got = bf16_to_float(oh[size_t(h * kHeadDim + d)]);
      max_ref = std::max(max_ref, std::fabs(ref));
      max_diff = std::max(max_diff, std::isnan(got) ? INFINITY : std::fabs(got - ref));
    }
    worst = std::max(worst, max_diff / std::max(max_ref, 1e-30));
  }
  row.max_rel_err = worst;
  std::printf(
      "decode b%-4d kv%-6d page%-3d tc=%s layers %d: graph %9.1f us  direct %9.1f us  "
      "%7.1f GB/s  %5.1f%% of read  err %.1e\n",
      c.batch, c.kv_len, c.page_size, c.tensor_cores, num_layers, row.graph_us, row.direct_us,
      row.gbps, 100 * row.fraction, row.max_rel_err);
  std::fflush(stdout);
  unsetenv("KVATTN_DECODE_TENSOR_CORES");
  return row;
}

TEST(DecodeBench, Grid) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const char* on = std::getenv("KVATTN_DECODE_BENCH");
  if (on == nullptr || std::string(on) != "1") GTEST_SKIP() << "set KVATTN_DECODE_BENCH=1";
  const auto props = cuda::bench::device_properties(0);
  const double read_gbps = cuda::bench::measure_read_gbps(0, int64_t(4) << 30, 5);
  std::printf("%s, %d SMs: read-only streaming %.0f GB/s (4 GiB, median of 5)\n",
              props.name.c_str(), props.sm_count, read_gbps);
  const cuda::DecodeKernelInfo info =
      cuda::decode_kernel_info(kHeadDim, kHeadDim, DType::kBFloat16, kQHeads / kKvHeads, 0);
  std::printf("decode kernel (head_dim %d, bf16): %d CTAs per SM, %d keys per step\n",
              info.compiled_head_dim, info.ctas_per_sm, info.tile_tokens);
  cuda::bench::Stream stream(0);
  const std::vector<BenchCase> cases = {
      {64, 4096, 1, "0"},  {1, 32768, 1, "0"},  {64, 4096, 16, "0"}, {1, 32768, 16, "0"},
      {16, 4096, 1, "0"},  {256, 1024, 1, "0"}, {16, 16384, 1, "0"}, {16, 32768, 1, "0"},
      {256, 4096, 1, "0"}, {1, 1024, 1, "0"},   {64, 4096, 1, "1"},  {1, 32768, 1, "1"},
  };
  // KVATTN_DECODE_BENCH_CASES="b,kv,page,tc;..." (e.g. "1,32768,1,0;1,1024,1,0") picks rows.
  std::vector<BenchCase> picked;
  if (const char* only = std::getenv("KVATTN_DECODE_BENCH_CASES"); only != nullptr) {
    std::string spec(only);
    for (size_t begin = 0; begin < spec.size();) {
      const size_t end = std::min(spec.find(';', begin), spec.size());
      BenchCase c{};
      int tc = 0;
      if (std::sscanf(spec.substr(begin, end - begin).c_str(), "%d,%d,%d,%d", &c.batch, &c.kv_len,
                      &c.page_size, &tc) != 4) {
        FAIL() << "KVATTN_DECODE_BENCH_CASES: bad entry in '" << spec << "'";
      }
      c.tensor_cores = tc != 0 ? "1" : "0";
      picked.push_back(c);
      begin = end + 1;
    }
  }
  std::vector<BenchRow> rows;
  for (const BenchCase& c : picked.empty() ? cases : picked)
    rows.push_back(run_case(c, read_gbps, stream));
  std::printf(
      "\n| batch | kv_len | page | kernel | graph us | direct us | GB/s | of read | err |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const BenchRow& r : rows) {
    std::printf("| %d | %d | %d | %s | %.1f | %.1f | %.0f | %.1f%% | %.1e |\n", r.c.batch,
                r.c.kv_len, r.c.page_size, r.c.tensor_cores[0] == '1' ? "tensor" : "cuda-core",
                r.graph_us, r.direct_us, r.gbps, 100 * r.fraction, r.max_rel_err);
    EXPECT_LT(r.max_rel_err, 1e-2) << "b" << r.c.batch << " kv" << r.c.kv_len;
  }
  std::printf("read ceiling %.0f GB/s\n", read_gbps);
}

}  // namespace
}  // namespace kvattn
