#include "cuda/cuda_util.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "kvattn/error.h"

namespace kvattn::cuda {

void check_cuda(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // reported here: not again by a later call's check_launch
  const ErrorKind kind =
      status == cudaErrorMemoryAllocation ? ErrorKind::kOutOfResources : ErrorKind::kDeviceError;
  throw_error(kind, what, cudaGetErrorName(status), ": ", cudaGetErrorString(status));
}

void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  throw_error(ErrorKind::kDeviceError, kernel, "launch failed: ", cudaGetErrorName(status), ": ",
              cudaGetErrorString(status));
}

int env_int(const char* name, int fallback, int min_value) {
  const char* env = std::getenv(name);
  if (env == nullptr || env[0] == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(env, &end, 10);
  if (*end != '\0' || value < min_value || value > (1 << 24)) {
    throw_error(ErrorKind::kInvalidArgument, name, "got '", env, "', expected an integer in [",
                min_value, ", 2^24]");
  }
  return int(value);
}

bool programmatic_launch_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KVATTN_PDL");
    return env == nullptr || std::string(env) != "0";
  }();
  return enabled;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "cudaStreamIsCapturing");
  return status == cudaStreamCaptureStatusActive;
}

const DeviceInfo& device_info(int device) {
  static std::mutex mutex;
  static std::vector<DeviceInfo> infos;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= int(infos.size())) infos.resize(size_t(device) + 1);
  DeviceInfo& info = infos[size_t(device)];
  if (info.sm_count == 0) {
    check_cuda(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device),
               "cudaDeviceGetAttribute(multiProcessorCount)");
    check_cuda(cudaDeviceGetAttribute(&info.max_smem_per_block_optin,
                                      cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "cudaDeviceGetAttribute(maxSharedMemoryPerBlockOptin)");
    check_cuda(
        cudaDeviceGetAttribute(&info.compute_major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute(computeCapabilityMajor)");
    check_cuda(cudaDeviceGetAttribute(&info.l2_bytes, cudaDevAttrL2CacheSize, device),
               "cudaDeviceGetAttribute(l2CacheSize)");
  }
  return info;
}

// ---- PinnedBuffer --------------------------------------------------------------------------

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void PinnedBuffer::reserve(size_t bytes) {
  if (bytes <= bytes_) return;
  const size_t grown = std::max(bytes, bytes_ * 2);
  void* fresh = nullptr;
  check_cuda(cudaHostAlloc(&fresh, grown, cudaHostAllocDefault), "cudaHostAlloc(staging)");
  if (data_ != nullptr) cudaFreeHost(data_);
  data_ = fresh;
  bytes_ = grown;
}

// ---- CopyFence -----------------------------------------------------------------------------

CopyFence::CopyFence() {
  check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
}

CopyFence::~CopyFence() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

void CopyFence::record(cudaStream_t stream) {
  check_cuda(cudaEventRecord(event_, stream), "cudaEventRecord");
  recorded_ = true;
}

void CopyFence::wait() {
  if (!recorded_) return;
  const cudaError_t state = cudaEventQuery(event_);
  if (state == cudaSuccess) return;
  if (state != cudaErrorNotReady) check_cuda(state, "cudaEventQuery");
  (void)cudaGetLastError();  // "not ready" is an answer, not an error for the next check
  check_cuda(cudaEventSynchronize(event_), "cudaEventSynchronize");
}

}  // namespace kvattn::cuda
