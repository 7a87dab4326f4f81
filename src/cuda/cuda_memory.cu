#include <cuda_runtime.h>

#include <atomic>

#include "core/device_runtime.h"
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

std::atomic<int> malloc_budget{-1};
std::atomic<uint64_t> malloc_count{0};

}  // namespace

namespace debug {
void limit_device_mallocs(int count) { malloc_budget.store(count); }
uint64_t device_malloc_count() { return malloc_count.load(); }
}  // namespace debug

void* device_malloc(size_t bytes, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  int budget = malloc_budget.load();
  while (budget > 0 && !malloc_budget.compare_exchange_weak(budget, budget - 1)) {
  }
  if (budget == 0) {
    throw_error(ErrorKind::kOutOfResources, "cudaMalloc", "out of memory (injected by a test: ",
                bytes, " bytes)");
  }
  void* ptr = nullptr;
  check(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), "cudaMalloc");
  malloc_count.fetch_add(1);
  return ptr;
}

size_t free_device_bytes(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return free_bytes;
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

// The device runtime of the backend-neutral code (core/device_runtime.h) in a build with CUDA.
namespace kvattn::device_runtime {

bool compiled() noexcept { return true; }
void* allocate(size_t bytes, int device) { return cuda::device_malloc(bytes, device); }
void release(void* ptr, int device) noexcept { cuda::device_free(ptr, device); }
void copy_sync(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  cuda::memcpy_sync(dst, dst_device, src, src_device, bytes);
}
void fill_sync(void* dst, int device, int value, size_t bytes) {
  cuda::memset_sync(dst, device, value, bytes);
}
int device_count() noexcept { return cuda::device_count(); }
size_t free_bytes(int device) { return cuda::free_device_bytes(device); }

}  // namespace kvattn::device_runtime
