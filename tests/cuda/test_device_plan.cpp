// The decode plan built on the device (kernels/device_plan.h) equals core::plan_decode_rule's,
// item for item, with kv_indptr and each item's kv_offset as write_call_metadata fills them:
// random batches of 1..kDevicePlanMaxBatch requests, empty and long requests, unsplit and split
// plans, a capacity that forces the chunk to grow, no device size (no split). Output buffers are
// poisoned first.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/planner.h"
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

}  // namespace
}  // namespace kvattn::testing
