#include <cuda_runtime.h>

#include "cuda/cuda_memory.h"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // reported here: not again by a later call's check_launch
    throw_error(status == cudaErrorMemoryAllocation ? ErrorKind::kOutOfResources
                                                    : ErrorKind::kDeviceError,
                what, cudaGetErrorString(status));
  }
}

}  // namespace

void* device_malloc(size_t bytes, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), "cudaMalloc");
  return ptr;
}

void device_free(void* ptr, int device) noexcept {
  if (ptr == nullptr) return;
  cudaSetDevice(device);
  cudaFree(ptr);
}

void memcpy_sync(void* dst, Device dst_device, const void* src, Device src_device,
                 size_t bytes) {
  if (bytes == 0) return;
  cudaMemcpyKind kind = cudaMemcpyDefault;
  if (dst_device.is_cuda()) check(cudaSetDevice(dst_device.index), "cudaSetDevice");
  else if (src_device.is_cuda()) check(cudaSetDevice(src_device.index), "cudaSetDevice");
  check(cudaMemcpy(dst, src, bytes, kind), "cudaMemcpy");
}

void memset_sync(void* dst, int device, int value, size_t bytes) {
  if (bytes == 0) return;
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaMemset(dst, value, bytes), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaMemset");
}

int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

}  // namespace kvattn::cuda
