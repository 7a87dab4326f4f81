// kvattn — owned memory on the host or a CUDA device, and copies between them.
//
// The engine normally owns the big buffers (the KV pool, req_to_token) and hands
// kvattn views of them. kvattn owns memory only where a caller asks it to (a KV
// cache made by KvCache::allocate) and for a backend's own workspace.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvattn/tensor.h"

namespace kvattn {

/// A move-only owned allocation on one device. Host memory is 64-byte aligned.
/// A CUDA allocation needs a build with CUDA; otherwise allocate() throws kNotSupported.
class Buffer {
 public:
  Buffer() = default;
  static Buffer allocate(Device device, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  /// A contiguous view of this buffer's first bytes as `shape` of `dtype`.
  TensorView view(DType dtype, std::initializer_list<int64_t> shape) const;

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_{};
};

/// Copies `bytes` between any two devices and waits for the copy to finish.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

/// Sets `bytes` bytes at `dst` to `value` and waits.
void fill_bytes(void* dst, Device device, int value, size_t bytes);

/// Copies a whole contiguous view into another of the same dtype and element count.
void copy_tensor(const TensorView& dst, const TensorView& src);

/// True when this build of kvattn has its CUDA backend compiled in.
bool cuda_compiled();
/// Number of CUDA devices visible now (0 in a build without CUDA or on a machine without a GPU).
int cuda_device_count();

}  // namespace kvattn
