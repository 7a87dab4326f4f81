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

}  // namespace kvattn::cuda
