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

/// Sets (value != nullptr) or unsets an environment variable while it lives (the backends read
/// their KVATTN_* knobs at construction), then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value == nullptr)
      unsetenv(name);
    else
      setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_.c_str(), old_.c_str(), 1);
    else
      unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool had_ = false;
  std::string old_;
};

/// Forces the decode kernel choice for backends made while it lives (the backend reads
/// KVATTN_DECODE_TENSOR_CORES at construction); nullptr = the automatic choice.
class TensorCoreChoice : public ScopedEnv {
 public:
  explicit TensorCoreChoice(const char* value) : ScopedEnv("KVATTN_DECODE_TENSOR_CORES", value) {}
};

}  // namespace kvattn::testing
