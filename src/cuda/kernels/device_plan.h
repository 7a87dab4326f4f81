// The decode plan built on the device from device lengths (issue 15): core::plan_decode_rule's
// plan, item for item, by one CTA (block reductions for the chunk, scans for the item and
// partial offsets, one bitonic sort for the heaviest-first order), so that a step can be planned
// inside a CUDA graph without the host seeing its lengths. Not wired into the backend yet: the
// GPU test (tests/cuda/test_device_plan.cpp) compares it with the host rule.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/planner.h"

namespace kvattn::cuda {

/// One decode call's plan, from kv_len on the device into the call's metadata arrays.
struct DevicePlanDecode {
  const int32_t* kv_len = nullptr;  ///< [batch_size] device
  int batch_size = 0;
  core::DecodePlanConfig config;
  int item_capacity = 0;                  ///< items the buffers hold (core::decode_item_capacity)
  int64_t* kv_indptr = nullptr;           ///< [batch_size + 1] out
  core::DecodeWorkItem* items = nullptr;  ///< [item_capacity] out (the first num_items)
  int32_t* merge_indptr = nullptr;        ///< [batch_size + 1] out
  int32_t* num_items = nullptr;           ///< [1] out
  int32_t* chunk = nullptr;               ///< [1] out (the plan's chunk; may be null)
};

/// Largest batch and item capacity one planning CTA takes (its shared memory).
constexpr int kDevicePlanMaxBatch = 4096;
constexpr int kDevicePlanMaxItems = 4096;

/// Throws kvattn::Error (kInvalidArgument naming the field) for a plan beyond those bounds or a
/// bad config; launches one CTA on `stream` (records into a CUDA graph).
void launch_device_plan_decode(const DevicePlanDecode& plan, cudaStream_t stream);

}  // namespace kvattn::cuda
