// What the `kvattn` subcommands share: device selection, random data on either device, host
// tensors mirrored to the backend's device, timing and run metadata.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/kvattn.h"

namespace kvattn::tools {

/// The device a subcommand runs on, from --device (default: cuda when a GPU is visible).
struct ToolDevice {
  BackendKind kind = BackendKind::kCpu;
  Device device = Device::cpu();
};
/// Parses "cpu" / "cuda" / "" (= default). Throws UsageError for cuda without a GPU or CUDA build.
ToolDevice select_device(const std::string& name);

/// splitmix64: a small, fast, reproducible generator (the tools need speed, not quality).
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [lo, hi] (inclusive).
  int64_t uniform_int(int64_t lo, int64_t hi) {
    return lo + int64_t(next() % uint64_t(hi - lo + 1));
  }
  /// Uniform in [0, 1).
  double uniform() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  uint64_t state_;
};

/// Fills a contiguous float tensor (fp32/bf16/fp16/fp8) on its device with uniform values in
/// [-scale, scale), reproducibly from `seed`. Host tensors are filled by all cores.
void fill_random(const TensorView& tensor, uint64_t seed, float scale);

/// Waits for the device's queued work (a no-op on the host).
void synchronize(Device device);

/// A 1-D int32 tensor that lives on the backend's device, with its host copy: ForwardBatch
/// wants both (the device one for kernels, the *_cpu one for planning).
class MirroredIndex {
 public:
  MirroredIndex() = default;
  MirroredIndex(const std::vector<int32_t>& values, Device device);
  const TensorView& device_view() const { return device_view_; }
  const TensorView& host_view() const { return host_view_; }
  const std::vector<int32_t>& values() const { return host_; }

 private:
  std::vector<int32_t> host_;
  Buffer device_buffer_;
  TensorView device_view_;
  TensorView host_view_;
};

/// A tensor owned by the tool on `device`.
struct OwnedTensor {
  Buffer buffer;
  TensorView view;
  static OwnedTensor make(Device device, DType dtype, std::initializer_list<int64_t> shape);
};

/// Random bf16 values on a device (with a host mirror) from which a tool's steps slice q/k/v at
/// random offsets: fresh-looking data without generating it per step (kvattn demo and soak).
class RandomSource {
 public:
  RandomSource(Device device, int64_t elements, int head_dim, uint64_t seed);
  /// A [rows, heads, head_dim] view on the device and the same values on the host, at a random
  /// 128-byte aligned offset (an engine's tensors are aligned; the CUDA kernels load 16 bytes).
  std::pair<TensorView, TensorView> slice(Rng& rng, int64_t rows, int heads) const;

 private:
  int64_t elements_;
  int head_dim_;
  OwnedTensor host_;
  OwnedTensor device_;
  bool on_host_;
};

/// Copies a device tensor to a new host tensor (a view of the same buffer when already there).
OwnedTensor to_host(const TensorView& tensor);

/// Threads the CPU backend uses by default (KVATTN_NUM_THREADS, else the CPUs this process may
/// run on): the CPU ceilings are measured with as many, so a fraction compares like with like.
int host_threads();

/// The median of `values` (0 for none).
double median(std::vector<double> values);

/// Monotonic seconds since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The commit the binary runs from: the KVATTN_GIT_COMMIT environment variable, else
/// The KVATTN_GIT_COMMIT environment variable when set (a binary carried away from its tree),
/// else `git rev-parse HEAD` in the source tree (or the working directory) at run time, else the
/// KVATTN_GIT_COMMIT define, else "unknown".
std::string git_commit();
/// Whether tracked files of the source tree differ from that commit (false when
/// KVATTN_GIT_COMMIT names the commit: a carried binary, see git_commit()).
bool git_dirty();
/// Today as "2026-12-01" (local time).
std::string today_iso();
/// "AMD EPYC (2 threads)" or the CUDA device name.
std::string device_description(const ToolDevice& device);

/// "12.3 ms", "456 us" — a duration in microseconds, compactly.
std::string format_us(double us);

/// A JSON number with 6 significant digits; null for NaN and infinities.
std::string json_number(double value);
/// A JSON string literal (quotes and backslashes escaped).
std::string json_string(const std::string& value);

}  // namespace kvattn::tools
