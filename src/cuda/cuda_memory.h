// The CUDA runtime calls the device-agnostic code (kvattn::Buffer, copy_bytes) needs. Defined in
// cuda_memory.cu; only linked in builds with KVATTN_WITH_CUDA.
#pragma once

#include <cstddef>

#include "kvattn/tensor.h"

namespace kvattn::cuda {

/// cudaMalloc on `device`; throws kvattn::Error(kOutOfResources / kDeviceError).
void* device_malloc(size_t bytes, int device);
/// cudaFree; never throws (called from destructors).
void device_free(void* ptr, int device) noexcept;
/// Synchronous copy between any two devices (one of them CUDA).
void memcpy_sync(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
/// Synchronous cudaMemset.
void memset_sync(void* dst, int device, int value, size_t bytes);
/// Visible CUDA devices; 0 when there is no driver or no GPU.
int device_count() noexcept;
/// Free bytes on `device` now (cudaMemGetInfo).
size_t free_device_bytes(int device);

namespace debug {
/// Fault injection for tests: the next `count` device_malloc calls succeed and every later one
/// fails as an out-of-memory cudaMalloc would, until limit_device_mallocs(-1) lifts the limit.
/// Lets a test fail an allocation in the middle of KvCache::allocate, init_cuda_graph_state or a
/// workspace growth and check that nothing stays allocated.
void limit_device_mallocs(int count);
/// device_malloc calls that have succeeded in this process.
uint64_t device_malloc_count();
}  // namespace debug

}  // namespace kvattn::cuda
