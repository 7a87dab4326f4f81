// core::plan_decode_rule on the device (device_plan.h). One CTA of kThreads: every step is a
// block-wide loop, reduction or scan over at most kDevicePlanMaxBatch requests, then a bitonic
// sort of at most kDevicePlanMaxItems keys in shared memory. The arithmetic is the host rule's
// (the same int64 sums, the same double comparison with its 0.97 bar, the same unique keys), so
// the two plans are equal item for item.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/kernels/device_plan.h"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr double kRequiredGain = 0.97;  // core::plan_decode_rule's bar (planner.cpp)

__device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Sum / max of one value a thread over the block (every thread gets the result).
__device__ int64_t block_sum(int64_t v, int64_t* scratch) {
  for (int o = 16; o >= 1; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  return total;
}

__device__ int64_t block_max(int64_t v, int64_t* scratch) {
  for (int o = 16; o >= 1; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  int64_t top = scratch[0];
  for (int w = 1; w < kThreads / 32; ++w) top = max(top, scratch[w]);
  return top;
}

// Exclusive prefix sums of values[0, n) into out[0, n] (out[n] = the total), n <= kThreads *
// per-thread segments: each thread scans its contiguous segment, the segment totals are scanned
// by a Hillis-Steele pass in shared memory.
template <typename T>
__device__ void block_exclusive_scan(const T* values, T* out, int n, T* partials) {
  __syncthreads();  // values were written with another thread-to-element map
  const int per = (n + kThreads - 1) / kThreads;
  const int begin = min(n, int(threadIdx.x) * per);
  const int end = min(n, begin + per);
  T local = 0;
  for (int i = begin; i < end; ++i) local += values[i];
  __syncthreads();
  partials[threadIdx.x] = local;
  __syncthreads();
  for (int offset = 1; offset < kThreads; offset *= 2) {
    const T add = threadIdx.x >= unsigned(offset) ? partials[threadIdx.x - offset] : T(0);
    __syncthreads();
    partials[threadIdx.x] += add;
    __syncthreads();
  }
  T running = partials[threadIdx.x] - local;  // exclusive: the segments before this one
  for (int i = begin; i < end; ++i) {
    const T v = values[i];
    out[i] = running;
    running += v;
  }
  if (threadIdx.x == kThreads - 1) out[n] = partials[kThreads - 1];
  __syncthreads();
}

// The host's heaviest_first_key (planner.cpp): ascending order = heaviest first, then index.
__device__ __forceinline__ uint64_t heaviest_first_key(int64_t weight, uint32_t index) {
  return (uint64_t(INT32_MAX - weight) << 32) | uint64_t(index);
}

// The request of emission index i: the last r with starts[r] <= i (starts strictly increasing:
// every request has at least one item).
__device__ __forceinline__ int request_of_item(const int32_t* starts, int batch_size, int i) {
  int lo = 0, hi = batch_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) device_plan_decode_kernel(const DevicePlanDecode p) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int bs = p.batch_size;
  int64_t* scratch = reinterpret_cast<int64_t*>(smem);                      // [kThreads / 32]
  int64_t* partials64 = scratch + kThreads / 32;                            // [kThreads]
  int32_t* partials32 = reinterpret_cast<int32_t*>(partials64 + kThreads);  // [kThreads]
  int32_t* lens = partials32 + kThreads;                                    // [bs]
  int32_t* pieces = lens + bs;                                              // [bs]
  int32_t* starts = pieces + bs;                                            // [bs + 1]
  int32_t* split = starts + bs + 1;  // [bs] pieces if > 1, else 0
  int32_t* merge = split + bs;       // [bs + 1]
  int64_t* lens64 = reinterpret_cast<int64_t*>((reinterpret_cast<uintptr_t>(merge + bs + 1) + 15) /
                                               16 * 16);      // [bs]
  uint64_t* keys = reinterpret_cast<uint64_t*>(lens64 + bs);  // [pow2 >= items]

  // ---- lengths, kv_indptr, the longest request and the total cost ---------------------------
  int64_t top = 0;
  int64_t total = 0;
  for (int r = threadIdx.x; r < bs; r += kThreads) {
    const int32_t len = max(p.kv_len[r], 0);
    lens[r] = len;
    lens64[r] = len;
    top = max(top, int64_t(len));
    total += int64_t(len) + p.config.cta_overhead_tokens;
  }
  const int64_t max_len = block_max(top, scratch);
  total = block_sum(total, scratch);
  block_exclusive_scan<int64_t>(lens64, p.kv_indptr, bs, partials64);

  // ---- the chunk (core::plan_decode_rule) ----------------------------------------------------
  int64_t chunk = max(max_len, int64_t(1));
  const core::DecodePlanConfig& c = p.config;
  if (c.concurrent_ctas > 0 && max_len > c.min_chunk) {
    const int64_t share = ceil_div(total * c.ctas_per_item, c.concurrent_ctas);
    const int64_t even = ceil_div(max(share, int64_t(c.min_chunk)), c.chunk_align) * c.chunk_align;
    if (double(even) < kRequiredGain * double(max_len)) {
      chunk = even;
      while (chunk < max_len) {
        int64_t items = 0;
        for (int r = threadIdx.x; r < bs; r += kThreads) {
          items += max(int64_t(1), ceil_div(lens[r], chunk));
        }
        if (block_sum(items, scratch) <= p.item_capacity) break;
        chunk *= 2;
      }
      chunk = min(chunk, max(max_len, int64_t(1)));
    }
  }

  // ---- items a request, their offsets, the partial rows --------------------------------------
  for (int r = threadIdx.x; r < bs; r += kThreads) {
    const int32_t n = int32_t(max(int64_t(1), ceil_div(lens[r], chunk)));
    pieces[r] = n;
    split[r] = n > 1 ? n : 0;
  }
  block_exclusive_scan<int32_t>(pieces, starts, bs, partials32);
  block_exclusive_scan<int32_t>(split, merge, bs, partials32);
  const int num_items = starts[bs];

  // ---- heaviest first: keys of the items in emission order, a bitonic sort -------------------
  int padded = 1;
  while (padded < num_items) padded *= 2;
  for (int i = threadIdx.x; i < padded; i += kThreads) {
    uint64_t key = ~uint64_t(0);  // padding sorts last
    if (i < num_items) {
      const int r = request_of_item(starts, bs, i);
      const int64_t piece = i - starts[r];
      const int64_t begin = piece * chunk;
      const int64_t end = min(int64_t(lens[r]), begin + chunk);
      key = heaviest_first_key(end - begin, uint32_t(i));
    }
    keys[i] = key;
  }
  __syncthreads();
  for (int size = 2; size <= padded; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < padded; i += kThreads) {
        const int partner = i ^ stride;
        if (partner > i) {
          const bool ascending = (i & size) == 0;
          const uint64_t a = keys[i];
          const uint64_t b = keys[partner];
          if ((a > b) == ascending) {
            keys[i] = b;
            keys[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }

  // ---- the plan ----------------------------------------------------------------------------
  for (int j = threadIdx.x; j < num_items; j += kThreads) {
    const int i = int(keys[j] & 0xffffffffu);
    const int lo = request_of_item(starts, bs, i);
    const int64_t piece = i - starts[lo];
    core::DecodeWorkItem item;
    item.request = lo;
    item.kv_begin = int32_t(piece * chunk);
    item.kv_end = int32_t(min(int64_t(lens[lo]), (piece + 1) * chunk));
    item.partial = pieces[lo] > 1 ? merge[lo] + int32_t(piece) : -1;
    item.kv_offset = p.kv_indptr[lo] + item.kv_begin;
    item.reserved = 0;
    p.items[j] = item;
  }
  for (int r = threadIdx.x; r <= bs; r += kThreads) p.merge_indptr[r] = merge[r];
  if (threadIdx.x == 0) {
    *p.num_items = num_items;
    if (p.chunk != nullptr) *p.chunk = int32_t(chunk);
  }
}

size_t smem_bytes(int batch_size, int item_capacity) {
  int padded = 1;
  while (padded < item_capacity) padded *= 2;
  size_t bytes = (kThreads / 32 + kThreads) * sizeof(int64_t) + kThreads * sizeof(int32_t);
  bytes += (5 * size_t(batch_size) + 2) * sizeof(int32_t);
  bytes = (bytes + 15) / 16 * 16 + size_t(batch_size) * sizeof(int64_t);
  return bytes + size_t(padded) * sizeof(uint64_t);
}

}  // namespace

void launch_device_plan_decode(const DevicePlanDecode& p, cudaStream_t stream) {
  check_arg(p.batch_size >= 0 && p.batch_size <= kDevicePlanMaxBatch, "batch_size", "got ",
            p.batch_size, ", the device planner takes 0..", kDevicePlanMaxBatch);
  check_arg(p.item_capacity >= p.batch_size && p.item_capacity <= kDevicePlanMaxItems,
            "item_capacity", "got ", p.item_capacity, ", expected batch_size (", p.batch_size,
            ")..", kDevicePlanMaxItems);
  check_arg(p.config.ctas_per_item >= 1 && p.config.concurrent_ctas >= 0 &&
                p.config.chunk_align >= 1 && p.config.min_chunk >= 1,
            "config",
            "ctas_per_item >= 1, concurrent_ctas >= 0, chunk_align >= 1, min_chunk >= 1 "
            "expected");
  check_arg(
      p.batch_size == 0 || (p.kv_len != nullptr && p.kv_indptr != nullptr && p.items != nullptr &&
                            p.merge_indptr != nullptr && p.num_items != nullptr),
      "kv_len", "the device plan needs kv_len, kv_indptr, items, merge_indptr, num_items");
  if (p.batch_size == 0) return;
  const size_t smem = smem_bytes(p.batch_size, p.item_capacity);
  check_cuda(cudaFuncSetAttribute(device_plan_decode_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cudaFuncSetAttribute(device_plan_decode_kernel)");
  device_plan_decode_kernel<<<1, kThreads, smem, stream>>>(p);
  check_launch("device_plan_decode_kernel");
}

}  // namespace kvattn::cuda
