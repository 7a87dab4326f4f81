// The device runtime the backend-neutral code needs (kvattn::Buffer, copy_bytes, fill_bytes,
// the size checks): allocation, synchronous copies and fills, device count, free memory.
//
// Core declares it and never includes a backend: the device backend defines it. In a build
// with CUDA, src/cuda/cuda_memory.cu defines these over the CUDA runtime; otherwise
// src/core/device_runtime_none.cpp defines them to refuse device memory with kNotSupported.
// Exactly one of the two is compiled into the library, so the choice is made at link time:
// no registration, no static initialiser that a static link could drop.
#pragma once

#include <cstddef>

#include "kvattn/tensor.h"

namespace kvattn::device_runtime {

/// True when this build has a device runtime (the CUDA backend).
bool compiled() noexcept;
/// Device memory on `device`; throws kvattn::Error (kOutOfResources, kDeviceError, or
/// kNotSupported in a build without one).
void* allocate(size_t bytes, int device);
/// Frees what allocate() returned; never throws (called from destructors).
void release(void* ptr, int device) noexcept;
/// Synchronous copy between any two devices, at least one of them a device (not the host).
void copy_sync(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
/// Synchronous fill of device memory.
void fill_sync(void* dst, int device, int value, size_t bytes);
/// Visible devices; 0 in a build without a device runtime, without a driver or without a GPU.
int device_count() noexcept;
/// Free bytes on `device` now.
size_t free_bytes(int device);

}  // namespace kvattn::device_runtime
