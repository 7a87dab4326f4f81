// The DECODE plans built on the device (kernels/device_plan.h) equal the host's, item for item:
//  - the CUDA-core decode plan equals core::plan_decode_rule's, with kv_indptr and each item's
//    kv_offset as write_call_metadata fills them: random batches of 1..kDevicePlanMaxBatch
//    requests, empty and long requests, unsplit and split plans, a capacity that forces the
//    chunk to grow, no device size (no split); and from seq_lens (the layout too);
//  - the decode-shaped kernel's plan equals core::plan_prefill_tiles + pad_prefill_plan of the
//    host layout (core::make_paged_layout of the same seq_lens, full and window index sets):
//    cluster, unsplit and split plans, int32 and int64 seq_lens, lengths past max_context_len
//    (clamped, as the step check then refuses the step).
// Output buffers are poisoned first.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/batch_layout.h"
#include "core/planner.h"
#include "core/prefill_tiles.h"
#include "cuda/kernels/device_plan.h"
#include "cuda_test_support.h"
#include "kvattn/error.h"

namespace kvattn::testing {
namespace {

void expect_device_plan_equals_rule(const std::vector<int32_t>& kv_len,
                                    const core::DecodePlanConfig& config, int capacity) {
  const int bs = int(kv_len.size());
  const core::DecodePlan host = core::plan_decode_rule(kv_len, config, capacity);

  DeviceBytes lens(kv_len.size() * sizeof(int32_t));
  DeviceBytes indptr((kv_len.size() + 1) * sizeof(int64_t));
  DeviceBytes items(size_t(capacity) * sizeof(core::DecodeWorkItem));
  DeviceBytes merge((kv_len.size() + 1) * sizeof(int32_t));
  DeviceBytes counts(2 * sizeof(int32_t));
  CUDA_OK(
      cudaMemcpy(lens.ptr, kv_len.data(), kv_len.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(indptr.ptr, 0xA5, (kv_len.size() + 1) * sizeof(int64_t)));
  CUDA_OK(cudaMemset(items.ptr, 0xA5, size_t(capacity) * sizeof(core::DecodeWorkItem)));
  CUDA_OK(cudaMemset(merge.ptr, 0xA5, (kv_len.size() + 1) * sizeof(int32_t)));
  CUDA_OK(cudaMemset(counts.ptr, 0xA5, 2 * sizeof(int32_t)));

  cuda::DevicePlanDecode p;
  p.kv_len = static_cast<const int32_t*>(lens.ptr);
  p.batch_size = bs;
  p.config = config;
  p.item_capacity = capacity;
  p.kv_indptr = static_cast<int64_t*>(indptr.ptr);
  p.items = static_cast<core::DecodeWorkItem*>(items.ptr);
  p.merge_indptr = static_cast<int32_t*>(merge.ptr);
  p.num_items = static_cast<int32_t*>(counts.ptr);
  p.chunk = static_cast<int32_t*>(counts.ptr) + 1;
  cuda::launch_device_plan_decode(p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());

  int32_t got_counts[2] = {0, 0};
  CUDA_OK(cudaMemcpy(got_counts, counts.ptr, sizeof(got_counts), cudaMemcpyDeviceToHost));
  ASSERT_EQ(got_counts[0], int(host.items.size()));
  EXPECT_EQ(got_counts[1], host.chunk);
  std::vector<int64_t> got_indptr(kv_len.size() + 1);
  CUDA_OK(cudaMemcpy(got_indptr.data(), indptr.ptr, got_indptr.size() * sizeof(int64_t),
                     cudaMemcpyDeviceToHost));
  int64_t sum = 0;
  for (int r = 0; r <= bs; ++r) {
    EXPECT_EQ(got_indptr[size_t(r)], sum) << "kv_indptr[" << r << "]";
    if (r < bs) sum += kv_len[size_t(r)];
  }
  std::vector<int32_t> got_merge(kv_len.size() + 1);
  CUDA_OK(cudaMemcpy(got_merge.data(), merge.ptr, got_merge.size() * sizeof(int32_t),
                     cudaMemcpyDeviceToHost));
  EXPECT_EQ(got_merge, host.merge_indptr);
  std::vector<core::DecodeWorkItem> got(host.items.size());
  CUDA_OK(cudaMemcpy(got.data(), items.ptr, got.size() * sizeof(core::DecodeWorkItem),
                     cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < got.size(); ++i) {
    const core::DecodeWorkItem& want = host.items[i];
    SCOPED_TRACE("item " + std::to_string(i));
    EXPECT_EQ(got[i].request, want.request);
    EXPECT_EQ(got[i].kv_begin, want.kv_begin);
    EXPECT_EQ(got[i].kv_end, want.kv_end);
    EXPECT_EQ(got[i].partial, want.partial);
    EXPECT_EQ(got[i].kv_offset, got_indptr[size_t(want.request)] + want.kv_begin);
    if (::testing::Test::HasFailure()) return;  // one item's diff says enough
  }
}

core::DecodePlanConfig h200_config() {
  core::DecodePlanConfig config;
  config.ctas_per_item = 8;
  config.concurrent_ctas = 132 * 4;
  config.chunk_align = 32;
  config.min_chunk = 64;
  return config;
}

TEST(DevicePlan, EqualsTheHostRuleOnRandomBatches) {
  REQUIRE_GPU();
  const core::DecodePlanConfig config = h200_config();
  std::mt19937 rng(5);
  for (int trial = 0; trial < 60; ++trial) {
    const int bs = trial < 20 ? 1 + int(rng() % 8) : 1 + int(rng() % 400);
    std::vector<int32_t> kv_len(static_cast<size_t>(bs));
    for (int32_t& len : kv_len) {
      const int kind = int(rng() % 10);
      len = kind == 0   ? 0
            : kind == 1 ? 1
            : kind < 8  ? int32_t(rng() % 4096)
                        : int32_t(4096 + rng() % 60000);
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ", batch " + std::to_string(bs));
    expect_device_plan_equals_rule(kv_len, config, core::decode_item_capacity(bs, config));
    if (HasFailure()) return;
  }
}

TEST(DevicePlan, EdgeShapes) {
  REQUIRE_GPU();
  core::DecodePlanConfig config = h200_config();
  // One long request: split to fill the device (the worked example of planner.h).
  expect_device_plan_equals_rule({32768}, config, core::decode_item_capacity(1, config));
  // A full batch that is not split, and the largest batch one CTA plans.
  expect_device_plan_equals_rule(std::vector<int32_t>(64, 4096), config,
                                 core::decode_item_capacity(64, config));
  std::vector<int32_t> big(cuda::kDevicePlanMaxBatch);
  for (size_t r = 0; r < big.size(); ++r) big[r] = int32_t((r * 7919) % 3000);
  expect_device_plan_equals_rule(
      big, config,
      std::min(cuda::kDevicePlanMaxItems, core::decode_item_capacity(int(big.size()), config)));
  // A tight capacity makes the chunk grow (the doubling loop).
  expect_device_plan_equals_rule({60000, 50000, 3}, config, 4);
  // No device size: no split.
  config.concurrent_ctas = 0;
  expect_device_plan_equals_rule({60000, 0, 7}, config, 3);
}

TEST(DevicePlan, RefusesWhatOneCtaCannotPlan) {  // host-side checks: no GPU needed
  cuda::DevicePlanDecode p;
  p.batch_size = cuda::kDevicePlanMaxBatch + 1;
  p.item_capacity = p.batch_size;
  EXPECT_THROW(cuda::launch_device_plan_decode(p, nullptr), Error);
  p.batch_size = 4;
  p.item_capacity = 3;  // below the batch
  EXPECT_THROW(cuda::launch_device_plan_decode(p, nullptr), Error);
}

// ---- the decode-shaped kernel's plan --------------------------------------------------------

template <typename T>
std::vector<T> from_device(const DeviceBytes& b, size_t n) {
  std::vector<T> out(n);
  const cudaError_t status = cudaMemcpy(out.data(), b.ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
  EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
  return out;
}

core::PrefillTileShape h200_tile_shape(int batch_size, int window, int max_cluster) {
  core::PrefillTileShape shape;
  shape.num_q_heads = 32;
  shape.num_kv_heads = 8;
  shape.tile_rows = 16;
  shape.kv_tile = 16;
  shape.mask = core::MaskMode::kCausal;
  shape.window_left = window;
  shape.concurrent_ctas = 132 * 2;
  shape.min_split_keys = 256;
  shape.cluster = core::cluster_split_size(batch_size, 1, shape, max_cluster);
  return shape;
}

// seq_lens (as given, int32 or int64, may exceed max_context) through the device planner against
// the host: the layout of make_paged_layout over the clamped lengths, then the padded host plan.
// draft > 0: a TARGET_VERIFY call of draft-token trees (custom mask, mask_indptr compared too);
// mask_short: the tree mask one element short (every length zeroed, nothing planned to read).
// prefix_lens given: an EXTEND call (query tokens seq - prefix a request, the prefix clamped to
// [0, seq]; qo_indptr clamped to num_tokens, compared too), the token-bucket capacity.
void expect_tile_plan_equals_host(const std::vector<int64_t>& seq_lens, int window,
                                  const core::PrefillTileShape& shape, bool int64, int max_context,
                                  int draft = 0, bool mask_short = false,
                                  const std::vector<int64_t>* prefix_lens = nullptr,
                                  int64_t num_tokens = 0) {
  const int bs = int(seq_lens.size());
  const int q_len = draft > 0 ? draft : 1;
  const bool extend = prefix_lens != nullptr;
  core::HostLengths lens;
  for (int64_t v : seq_lens) {
    lens.seq_lens.push_back(int32_t(std::clamp<int64_t>(v, 0, max_context - draft)));
  }
  if (extend) {
    for (int r = 0; r < bs; ++r) {
      const int32_t seq = lens.seq_lens[size_t(r)];
      const int32_t prefix = int32_t(std::clamp<int64_t>((*prefix_lens)[size_t(r)], 0, seq));
      lens.prefix_lens.push_back(prefix);
      lens.extend_lens.push_back(seq - prefix);
    }
  }
  core::PagedLayout layout = core::make_paged_layout(
      extend      ? ForwardMode::kExtend
      : draft > 0 ? ForwardMode::kTargetVerify
                  : ForwardMode::kDecode,
      window >= 0 ? core::IndexSet::kWindow : core::IndexSet::kFull, window, lens, draft);
  if (extend) {
    for (int32_t& q : layout.qo_indptr) q = int32_t(std::min<int64_t>(q, num_tokens));
  }
  const int64_t mask_elems = layout.mask_indptr.empty() ? 0 : layout.mask_indptr.back();
  if (mask_short) {
    for (int32_t& len : layout.kv_len) len = 0;
    std::fill(layout.kv_indptr.begin(), layout.kv_indptr.end(), 0);
  }
  core::PrefillTilePlan host = core::plan_prefill_tiles(layout.qo_indptr, layout.kv_indptr, shape);
  const core::PrefillPlanCapacity capacity =
      extend ? core::prefill_plan_capacity_for_tokens(bs, num_tokens, shape)
             : core::prefill_plan_capacity(bs, q_len, shape);
  core::pad_prefill_plan(host, capacity);
  auto upload = [&](const DeviceBytes& dst, const std::vector<int64_t>& v) {
    if (int64) {
      CUDA_OK(cudaMemcpy(dst.ptr, v.data(), v.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
    } else {
      std::vector<int32_t> narrow(v.begin(), v.end());
      CUDA_OK(
          cudaMemcpy(dst.ptr, narrow.data(), v.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    }
  };
  DeviceBytes prefix(size_t(bs) * sizeof(int64_t));
  DeviceBytes qo((size_t(bs) + 1) * sizeof(int32_t));
  CUDA_OK(cudaMemset(qo.ptr, 0xA5, (size_t(bs) + 1) * sizeof(int32_t)));
  if (extend) upload(prefix, *prefix_lens);

  DeviceBytes seq(size_t(bs) * sizeof(int64_t));
  upload(seq, seq_lens);
  DeviceBytes start(size_t(bs) * sizeof(int32_t)), len(size_t(bs) * sizeof(int32_t));
  DeviceBytes indptr((size_t(bs) + 1) * sizeof(int64_t));
  DeviceBytes items(size_t(capacity.items) * sizeof(core::PrefillWorkItem));
  DeviceBytes merges(size_t(capacity.merges) * sizeof(core::PrefillMergeItem));
  DeviceBytes sched(4 * sizeof(int));
  for (const DeviceBytes* b : {&start, &len}) CUDA_OK(cudaMemset(b->ptr, 0xA5, size_t(bs) * 4));
  CUDA_OK(cudaMemset(indptr.ptr, 0xA5, (size_t(bs) + 1) * sizeof(int64_t)));
  CUDA_OK(cudaMemset(items.ptr, 0xA5, size_t(capacity.items) * sizeof(core::PrefillWorkItem)));
  CUDA_OK(cudaMemset(merges.ptr, 0xA5, size_t(capacity.merges) * sizeof(core::PrefillMergeItem)));
  CUDA_OK(cudaMemset(sched.ptr, 0xA5, 4 * sizeof(int)));
  DeviceBytes mask((size_t(bs) + 1) * sizeof(int64_t));
  CUDA_OK(cudaMemset(mask.ptr, 0xA5, (size_t(bs) + 1) * sizeof(int64_t)));
  const int64_t given_elems = mask_short ? mask_elems - 1 : mask_elems;
  DeviceBytes elems(sizeof(int64_t));
  CUDA_OK(cudaMemcpy(elems.ptr, &given_elems, sizeof(given_elems), cudaMemcpyHostToDevice));

  cuda::DevicePlanTiles p;
  p.lengths.seq_lens = seq.ptr;
  p.lengths.seq_lens_int64 = int64;
  p.lengths.window = window;
  p.lengths.max_context_len = max_context;
  p.lengths.kv_start = static_cast<int32_t*>(start.ptr);
  p.lengths.kv_len = static_cast<int32_t*>(len.ptr);
  p.lengths.q_len = q_len;
  p.lengths.tree_tokens = draft;
  if (extend) {
    p.lengths.prefix_lens = prefix.ptr;
    p.lengths.prefix_lens_int64 = int64;
    p.lengths.num_tokens = num_tokens;
    p.lengths.qo_indptr = static_cast<int32_t*>(qo.ptr);
  }
  if (draft > 0) {
    p.lengths.mask_indptr = static_cast<int64_t*>(mask.ptr);
    p.lengths.mask_elems = static_cast<const int64_t*>(elems.ptr);
  }
  p.batch_size = bs;
  p.shape = shape;
  p.capacity = capacity;
  p.kv_indptr = static_cast<int64_t*>(indptr.ptr);
  p.items = static_cast<core::PrefillWorkItem*>(items.ptr);
  p.merges = static_cast<core::PrefillMergeItem*>(merges.ptr);
  p.scheduler = static_cast<int*>(sched.ptr);
  cuda::launch_device_plan_tiles(p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());

  EXPECT_EQ(from_device<int32_t>(start, size_t(bs)), layout.kv_start);
  EXPECT_EQ(from_device<int32_t>(len, size_t(bs)), layout.kv_len);
  EXPECT_EQ(from_device<int64_t>(indptr, size_t(bs) + 1), layout.kv_indptr);
  if (extend) EXPECT_EQ(from_device<int32_t>(qo, size_t(bs) + 1), layout.qo_indptr);
  if (draft > 0) {
    const auto got_mask = from_device<int64_t>(mask, size_t(bs) + 1);
    EXPECT_EQ(got_mask.back(), mask_elems);  // what the step check compares
    if (!mask_short) EXPECT_EQ(got_mask, layout.mask_indptr);
  }
  EXPECT_EQ(from_device<int>(sched, 4), std::vector<int>(4, 0));
  const auto got_items = from_device<core::PrefillWorkItem>(items, size_t(capacity.items));
  for (size_t i = 0; i < got_items.size(); ++i) {
    const core::PrefillWorkItem& g = got_items[i];
    const core::PrefillWorkItem& w = host.items[i];
    SCOPED_TRACE("item " + std::to_string(i) + " of " + std::to_string(capacity.items));
    EXPECT_EQ(g.request, w.request);
    EXPECT_EQ(g.kv_head, w.kv_head);
    EXPECT_EQ(g.q_row_begin, w.q_row_begin);
    EXPECT_EQ(g.kv_begin, w.kv_begin);
    EXPECT_EQ(g.kv_end, w.kv_end);
    EXPECT_EQ(g.partial, w.partial);
    EXPECT_EQ(g.merge, w.merge);
    EXPECT_EQ(g.kv_base, w.kv_base);
    EXPECT_EQ(g.q_begin, w.q_begin);
    EXPECT_EQ(g.q_end, w.q_end);
    EXPECT_EQ(g.kv_len, w.kv_len);
    EXPECT_EQ(g.reserved, 0);
    if (::testing::Test::HasFailure()) return;
  }
  const auto got_merges = from_device<core::PrefillMergeItem>(merges, size_t(capacity.merges));
  for (size_t m = 0; m < got_merges.size(); ++m) {
    const core::PrefillMergeItem& g = got_merges[m];
    const core::PrefillMergeItem& w = host.merges[m];
    SCOPED_TRACE("merge " + std::to_string(m));
    EXPECT_EQ(g.request, w.request);
    EXPECT_EQ(g.kv_head, w.kv_head);
    EXPECT_EQ(g.q_row_begin, w.q_row_begin);
    EXPECT_EQ(g.first_partial, w.first_partial);
    EXPECT_EQ(g.num_partials, w.num_partials);
    EXPECT_EQ(g.arrived, 0);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(DevicePlanTiles, EqualsTheHostPlanOnRandomBatches) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  int split_plans = 0, cluster_plans = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const int bs = trial < 30 ? 1 + int(rng() % 16) : 1 + int(rng() % 300);
    const int window = trial % 4 == 3 ? int(rng() % 5000) : -1;
    const int max_cluster = trial % 5 == 4 ? 0 : 16;
    const int max_context = 70000;
    std::vector<int64_t> seq(static_cast<size_t>(bs));
    for (int64_t& v : seq) {
      const int kind = int(rng() % 12);
      v = kind == 0   ? 0
          : kind == 1 ? 1
          : kind < 8  ? int64_t(rng() % 4096)
          : kind < 11 ? int64_t(4096 + rng() % 60000)
                      : int64_t(max_context + 1 + rng() % 100);  // clamped
    }
    const core::PrefillTileShape shape = h200_tile_shape(bs, window, max_cluster);
    cluster_plans += shape.cluster > 1;
    {
      core::HostLengths lens;
      for (int64_t v : seq) lens.seq_lens.push_back(int32_t(std::min<int64_t>(v, max_context)));
      const core::PagedLayout l = core::make_paged_layout(
          ForwardMode::kDecode, window >= 0 ? core::IndexSet::kWindow : core::IndexSet::kFull,
          window, lens, 0);
      split_plans += !core::plan_prefill_tiles(l.qo_indptr, l.kv_indptr, shape).merges.empty();
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ", batch " + std::to_string(bs) + ", window " +
                 std::to_string(window) + ", cluster " + std::to_string(shape.cluster));
    expect_tile_plan_equals_host(seq, window, shape, /*int64=*/trial % 2 == 1, max_context);
    if (HasFailure()) return;
  }
  // The trials reach every form of the plan.
  EXPECT_GT(cluster_plans, 5);
  EXPECT_GT(split_plans, 5);
}

// EXTEND-like calls (the Hopper prefill kernel's shape: causal row tiles of 64 / 128 rows, a
// window or none, split-KV or not, GQA groups 1 / 4 / 8): requests of 0, 1 or many new tokens,
// tile-boundary lengths, prefixes of 0 to long, out-of-range lengths clamped (seq over
// max_context, prefix negative or over seq), and lengths whose tokens exceed num_tokens (qo_indptr
// clamped): the host plan of the same clamped call, item for item.
TEST(DevicePlanTiles, ExtendEqualsTheHostPlan) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  int split_plans = 0, clamped = 0, l2_plans = 0;
  for (int trial = 0; trial < 90; ++trial) {
    const int bs = trial < 40 ? 1 + int(rng() % 8) : 1 + int(rng() % 200);
    const int window = trial % 4 == 3 ? int(rng() % 3000) : -1;
    const int max_context = 40000;
    const int group = trial % 3 == 0 ? 1 : trial % 3 == 1 ? 4 : 8;
    core::PrefillTileShape shape;
    shape.num_kv_heads = trial % 5 == 0 ? 2 : 8;
    shape.num_q_heads = shape.num_kv_heads * group;
    shape.tile_rows = trial % 2 == 0 ? 128 : 64;
    shape.kv_tile = trial % 2 == 0 ? 128 : 176;
    shape.mask = core::MaskMode::kCausal;
    shape.window_left = window;
    shape.concurrent_ctas = trial % 7 == 6 ? 0 : 132 * (1 + trial % 2);
    // The L2 order of head groups (H200: ~120K keys x heads at head_dim 128), small enough in
    // some trials that requests split their heads.
    shape.l2_keys = trial % 3 == 2 ? 0 : trial % 3 == 0 ? 120000 : 6000 + int64_t(rng() % 30000);
    std::vector<int64_t> seq(static_cast<size_t>(bs)), prefix(static_cast<size_t>(bs));
    int64_t tokens = 0;
    for (int r = 0; r < bs; ++r) {
      const int kind = int(rng() % 10);
      const int64_t q = kind == 0   ? 0
                        : kind == 1 ? 1
                        : kind == 2 ? int64_t(shape.tile_rows / group) * (1 + rng() % 3) + 1
                        : kind < 8  ? int64_t(rng() % 600)
                                    : int64_t(rng() % 5000);
      const int64_t pre = rng() % 3 == 0 ? 0 : int64_t(rng() % 20000);
      seq[size_t(r)] = std::min<int64_t>(pre + q, max_context);
      prefix[size_t(r)] = pre;
      tokens += seq[size_t(r)] - std::min(pre, seq[size_t(r)]);
    }
    if (trial % 11 == 10) {  // out of range: clamped by the planner (the step check refuses)
      seq[0] = max_context + 5;
      prefix[size_t(bs - 1)] = -3;
      ++clamped;
    }
    int64_t num_tokens = tokens;
    if (trial % 13 == 12) {  // more tokens than the step has: qo_indptr clamped
      num_tokens = tokens / 2;
      ++clamped;
    }
    // Within one planning CTA (the backend refuses larger steps before planning): the tokens
    // halved, request by request, until the bucket's plan fits.
    while (!cuda::device_plan_tiles_fit(
        bs, core::prefill_plan_capacity_for_tokens(bs, num_tokens, shape), shape)) {
      tokens = 0;
      for (int r = 0; r < bs; ++r) {
        const int64_t q =
            (seq[size_t(r)] - std::clamp<int64_t>(prefix[size_t(r)], 0, seq[size_t(r)])) / 2;
        seq[size_t(r)] = std::max<int64_t>(prefix[size_t(r)], 0) + q;
        tokens += q;
      }
      num_tokens = std::min(num_tokens, tokens);
    }
    {
      std::vector<int32_t> qo{0};
      std::vector<int64_t> kv{0};
      for (int r = 0; r < bs; ++r) {
        qo.push_back(qo.back() +
                     int32_t(seq[size_t(r)] - std::min(prefix[size_t(r)], seq[size_t(r)])));
        kv.push_back(kv.back() + seq[size_t(r)]);
      }
      if (trial % 11 != 10) {
        split_plans += !core::plan_prefill_tiles(qo, kv, shape).merges.empty();
        core::PrefillTileShape plain = shape;
        plain.l2_keys = 0;
        // (The L2 order changed the plan: the items of the two orders differ.)
        const auto a = core::plan_prefill_tiles(qo, kv, shape).items;
        const auto b = core::plan_prefill_tiles(qo, kv, plain).items;
        l2_plans +=
            a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) != 0;
      }
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + ", batch " + std::to_string(bs) + ", window " +
                 std::to_string(window) + ", tokens " + std::to_string(num_tokens));
    expect_tile_plan_equals_host(seq, window, shape, /*int64=*/trial % 2 == 1, max_context, 0,
                                 false, &prefix, num_tokens);
    if (HasFailure()) return;
  }
  EXPECT_GT(split_plans, 10);
  EXPECT_GT(clamped, 10);
  EXPECT_GT(l2_plans, 10);
}

// TARGET_VERIFY: trees of 1..12 tokens on the decode-shaped kernel's 16- and 32-row tiles,
// cluster and split plans, and a tree mask one element short.
TEST(DevicePlanTiles, VerifyEqualsTheHostPlan) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const int bs = trial < 20 ? 1 + int(rng() % 8) : 1 + int(rng() % 120);
    const int draft = 1 + int(rng() % 12);
    const int max_context = 40000;
    std::vector<int64_t> seq(static_cast<size_t>(bs));
    for (int64_t& v : seq) {
      const int kind = int(rng() % 8);
      v = kind == 0 ? 0 : kind < 6 ? int64_t(rng() % 4096) : int64_t(4096 + rng() % 30000);
    }
    core::PrefillTileShape shape = h200_tile_shape(bs, -1, 16);
    shape.mask = core::MaskMode::kCustom;
    shape.tile_rows = draft * 4 <= 16 ? 16 : 32;
    shape.cluster = core::cluster_split_size(bs, draft, shape, 16);
    SCOPED_TRACE("trial " + std::to_string(trial) + ", batch " + std::to_string(bs) + ", draft " +
                 std::to_string(draft) + ", cluster " + std::to_string(shape.cluster));
    expect_tile_plan_equals_host(seq, -1, shape, trial % 2 == 0, max_context, draft,
                                 /*mask_short=*/trial % 10 == 9);
    if (HasFailure()) return;
  }
}

TEST(DevicePlanTiles, EdgeShapes) {
  REQUIRE_GPU();
  // One long request (cluster split), no split at a full batch, the largest batch one CTA takes,
  // more rows than a tile (group 32: two 16-row tiles a request), no device size.
  expect_tile_plan_equals_host({32768}, -1, h200_tile_shape(1, -1, 16), false, 65536);
  expect_tile_plan_equals_host(std::vector<int64_t>(64, 4096), -1, h200_tile_shape(64, -1, 16),
                               false, 8192);
  std::vector<int64_t> big(cuda::kDevicePlanTilesMaxBatch);
  for (size_t r = 0; r < big.size(); ++r) big[r] = int64_t((r * 7919) % 3000);
  big[5] = 60000;  // one long request: the split form at the largest batch
  core::PrefillTileShape wide = h200_tile_shape(int(big.size()), -1, 16);
  wide.num_kv_heads = 4;  // 2048 x 4 tiles + 264 items <= the sort's 16384 keys
  wide.num_q_heads = 16;
  expect_tile_plan_equals_host(big, -1, wide, true, 65536);
  core::PrefillTileShape group32 = h200_tile_shape(6, -1, 16);
  group32.num_q_heads = 256;
  group32.cluster = core::cluster_split_size(6, 1, group32, 16);
  expect_tile_plan_equals_host({100, 5000, 0, 1, 17, 40000}, -1, group32, false, 65536);
  group32.cluster = 0;
  expect_tile_plan_equals_host({100, 5000, 0, 1, 17, 40000}, 64, group32, false, 65536);
  core::PrefillTileShape none = h200_tile_shape(3, -1, 0);
  none.concurrent_ctas = 0;
  expect_tile_plan_equals_host({60000, 0, 7}, -1, none, false, 65536);
}

TEST(DevicePlanTiles, RefusesWhatOneCtaCannotPlan) {  // host-side checks: no GPU needed
  cuda::DevicePlanTiles p;
  p.shape = h200_tile_shape(cuda::kDevicePlanTilesMaxBatch + 1, -1, 16);
  p.batch_size = cuda::kDevicePlanTilesMaxBatch + 1;
  p.capacity = core::prefill_plan_capacity(p.batch_size, 1, p.shape);
  EXPECT_THROW(cuda::launch_device_plan_tiles(p, nullptr), Error);
  p.batch_size = 4;
  p.shape = h200_tile_shape(4, -1, 16);
  p.capacity = core::prefill_plan_capacity(4, 1, p.shape);
  p.shape.l2_keys = 1 << 20;  // the prefill order: not the device planner's
  EXPECT_THROW(cuda::launch_device_plan_tiles(p, nullptr), Error);
  p.shape.l2_keys = 0;
  p.capacity.items += 1;  // not the capacity of the shape
  EXPECT_THROW(cuda::launch_device_plan_tiles(p, nullptr), Error);
}

}  // namespace
}  // namespace kvattn::testing
