// Measuring a CUDA device for `kvattn bench` (SPEC §6): the ceilings every benchmark run
// measures for itself (read-only streaming, device-to-device copy, cuBLAS bf16 GEMM), random
// fills, and an event timer. A plain C++ header (no CUDA includes), so the g++-compiled tools
// can call it; defined in bench_support.cu, present only in builds with KVATTN_WITH_CUDA.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "kvattn/tensor.h"

namespace kvattn::cuda::bench {

struct DeviceProperties {
  std::string name;  ///< "NVIDIA H200"
  int sm_count = 0;
  int64_t l2_bytes = 0;  ///< 60 MiB on the H200: small benchmark inputs sit in it
  int64_t global_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
};
DeviceProperties device_properties(int device);

/// A non-blocking CUDA stream on `device` (a CUDA graph cannot be captured on the legacy
/// default stream, so the benchmark gives the backend this one).
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  void* handle() const { return stream_; }  ///< the cudaStream_t
  void synchronize() const;

 private:
  void* stream_ = nullptr;
  int device_ = 0;
};

/// Read-only streaming bandwidth: a kernel that only loads `bytes` (4 GiB by default, far past
/// the L2) with 16-byte loads on every SM. GB/s = bytes / time, median of `reps` passes.
double measure_read_gbps(int device, int64_t bytes, int reps);
/// Device-to-device cudaMemcpy of bytes / 2 into another bytes / 2: GB/s counting the bytes
/// read plus the bytes written, median of `reps`.
double measure_copy_gbps(int device, int64_t bytes, int reps);
/// cuBLAS bf16 x bf16 -> bf16 GEMM of n x n x n (fp32 accumulate) on random data:
/// 2 n^3 / time in TFLOP/s, median of `reps` after warm-up.
double measure_gemm_bf16_tflops(int device, int n, int reps);

/// Fills a contiguous device tensor of a float dtype with uniform values in [-scale, scale),
/// reproducibly from `seed`, on `stream` (null = default), and waits.
void fill_random(const TensorView& tensor, uint64_t seed, float scale, void* stream);

/// Waits for all work on the current device.
void device_synchronize();

struct TimingOptions {
  int warmup = 3;  ///< untimed calls of the whole rep first
  int min_reps = 5;
  int max_reps = 50;
  double max_seconds = 2.0;  ///< stop adding reps once this much time was spent timing
  int calls_per_rep = 1;     ///< fn(call) runs this many times between two events
  /// Capture the calls of one rep in a CUDA graph and time its replays (removes launch gaps
  /// from small cases); falls back to direct calls when capture fails.
  bool use_graph = true;
};
struct Timing {
  double median_us = 0;  ///< per call
  double min_us = 0;
  int reps = 0;
  bool graph = false;  ///< whether the graph path was used
};
/// Times fn with CUDA events on `stream`. fn(call) must queue its work on `stream`; `call` runs
/// 0..calls_per_rep-1 within a rep so that fn can rotate input sets.
Timing time_on_stream(const std::function<void(int call)>& fn, void* stream,
                      const TimingOptions& options);

}  // namespace kvattn::cuda::bench
