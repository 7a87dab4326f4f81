// Error checking and small RAII helpers for the CUDA backend. Plain C++ (only the runtime API
// header), so both nvcc- and g++-compiled files use it. Every CUDA failure becomes
// kvattn::Error(kDeviceError) naming the call; nothing here exits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvattn::cuda {

/// Throws kvattn::Error (kOutOfResources for an allocation failure, else kDeviceError) naming
/// `what` when `status` is not cudaSuccess. Clears the runtime's last error first, so a failure
/// that leaves the context usable (an allocation too large) is not met again by the next
/// check_launch of a later, good step.
void check_cuda(cudaError_t status, const char* what);

/// Call right after a kernel launch: turns a launch failure (bad configuration, missing image,
/// a sticky error from an earlier kernel) into kvattn::Error naming `kernel`.
void check_launch(const char* kernel);

/// Whether kernels that support it launch as programmatic dependents (kernels/launch.cuh): on
/// unless KVATTN_PDL=0 (read once).
bool programmatic_launch_enabled();

/// An integer tuning knob from the environment: `fallback` when unset, else a value in
/// [min_value, 2^24] (anything else throws kInvalidArgument naming the variable).
int env_int(const char* name, int fallback, int min_value = 1);

/// True while `stream` is being captured into a CUDA graph (launch sizes must then be fixed).
bool stream_is_capturing(cudaStream_t stream);

/// Facts about a device the planners need, read once per device.
struct DeviceInfo {
  int sm_count = 0;
  int max_smem_per_block_optin = 0;
  int compute_major = 0;
  int l2_bytes = 0;
};
const DeviceInfo& device_info(int device);

/// Page-locked host memory (the staging buffer of async host-to-device copies).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  /// Grows to at least `bytes` (contents are lost on growth).
  void reserve(size_t bytes);
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

/// An event that marks when a staging buffer's last async copy has been consumed, so the host
/// can reuse the buffer (waits only when the previous step's copy is still queued).
class CopyFence {
 public:
  CopyFence();
  ~CopyFence();
  CopyFence(const CopyFence&) = delete;
  CopyFence& operator=(const CopyFence&) = delete;
  void record(cudaStream_t stream);
  /// Host waits for the last recorded point; a point already passed (the steady state: a
  /// step's copy runs first in its GPU work, so it has when the next step is planned) makes no
  /// host synchronisation call at all (python/tests/test_gpu_sync_counts.py counts them).
  void wait();

 private:
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
};

}  // namespace kvattn::cuda
