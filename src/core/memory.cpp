#include "kvattn/memory.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kvattn/error.h"
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core/device_runtime.h"

namespace kvattn {

Buffer Buffer::allocate(Device device, size_t bytes) {
  Buffer b;
  b.bytes_ = bytes;
  b.device_ = device;
  if (device.is_cpu()) {
    // One cache line (what AVX loads like); buffers of 2 MiB and more (KV pools) start on a
    // 2 MiB boundary and ask for transparent huge pages: a page-size-1 decode gathers rows
    // from all over the pool, and 4 KiB pages cost it TLB misses (+7% measured with THP).
    constexpr size_t kAlignment = 64;
    constexpr size_t kHugePage = size_t(2) << 20;
    const size_t align = bytes >= kHugePage ? kHugePage : kAlignment;
    if (bytes > SIZE_MAX / 2) {  // the rounding below would wrap
      throw_error(ErrorKind::kOutOfResources, "bytes", "host allocation of ", bytes,
                  " bytes is larger than any host");
    }
    const size_t rounded = (bytes + align - 1) / align * align;
    b.data_ = std::aligned_alloc(align, rounded == 0 ? align : rounded);
    if (b.data_ == nullptr) {
      throw_error(ErrorKind::kOutOfResources, "bytes", "host allocation of ", bytes,
                  " bytes failed");
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == kHugePage) madvise(b.data_, rounded, MADV_HUGEPAGE);  // a hint: failure is fine
#endif
    return b;
  }
  b.data_ = device_runtime::allocate(bytes, device.index);
  return b;
}

Buffer::~Buffer() {
  if (data_ == nullptr) return;
  if (device_.is_cpu()) {
    std::free(data_);
  } else {
    device_runtime::release(data_, device_.index);
  }
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(other.device_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    Buffer old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

TensorView Buffer::view(DType dtype, std::initializer_list<int64_t> shape) const {
  TensorView v(data_, dtype, device_, shape);
  check_arg(size_t(v.nbytes()) <= bytes_, "shape", "a view of ", v.nbytes(),
            " bytes over a buffer of ", bytes_);
  return v;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memmove(dst, src, bytes);
    return;
  }
  device_runtime::copy_sync(dst, dst_device, src, src_device, bytes);
}

void fill_bytes(void* dst, Device device, int value, size_t bytes) {
  if (device.is_cpu()) {
    std::memset(dst, value, bytes);
    return;
  }
  device_runtime::fill_sync(dst, device.index, value, bytes);
}

void copy_tensor(const TensorView& dst, const TensorView& src) {
  check_arg(dst.dtype() == src.dtype(), "dst", "dtype ", dtype_name(dst.dtype()),
            " differs from src ", dtype_name(src.dtype()));
  check_arg(dst.numel() == src.numel(), "dst", dst, " and src ", src, " differ in size");
  check_arg(dst.is_contiguous() && src.is_contiguous(), "dst", "copy_tensor needs contiguous ",
            "views, got ", dst, " and ", src);
  copy_bytes(dst.data(), dst.device(), src.data(), src.device(), size_t(src.nbytes()));
}

bool cuda_compiled() {
  return device_runtime::compiled();
}

int cuda_device_count() {
  return device_runtime::device_count();
}

}  // namespace kvattn
