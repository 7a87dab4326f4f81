// Helpers shared by the CUDA backend's device tests.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <string>

#include "kvattn/memory.h"

#define CUDA_OK(call)                                                                \
  do {                                                                               \
    const cudaError_t status_ = (call);                                              \
    ASSERT_EQ(status_, cudaSuccess) << #call << ": " << cudaGetErrorString(status_); \
  } while (0)

#define REQUIRE_GPU()                                                       \
  do {                                                                      \
    if (::kvattn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace kvattn::testing {

/// Device memory a test owns (at least 16 bytes; ptr stays null when cudaMalloc fails, so the
/// first copy into it fails the test).
struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(size_t bytes) {
    if (cudaMalloc(&ptr, std::max<size_t>(bytes, 16)) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBytes() { cudaFree(ptr); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

/// Forces the decode kernel choice for backends made while it lives (the backend reads
/// KVATTN_DECODE_TENSOR_CORES at construction); nullptr = the automatic choice.
class TensorCoreChoice {
 public:
  explicit TensorCoreChoice(const char* value) {
    const char* old = std::getenv("KVATTN_DECODE_TENSOR_CORES");
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value == nullptr)
      unsetenv("KVATTN_DECODE_TENSOR_CORES");
    else
      setenv("KVATTN_DECODE_TENSOR_CORES", value, 1);
  }
  ~TensorCoreChoice() {
    if (had_)
      setenv("KVATTN_DECODE_TENSOR_CORES", old_.c_str(), 1);
    else
      unsetenv("KVATTN_DECODE_TENSOR_CORES");
  }
  TensorCoreChoice(const TensorCoreChoice&) = delete;
  TensorCoreChoice& operator=(const TensorCoreChoice&) = delete;

 private:
  bool had_ = false;
  std::string old_;
};

}  // namespace kvattn::testing
