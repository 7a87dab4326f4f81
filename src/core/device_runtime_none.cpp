// The device runtime of a build without CUDA (core/device_runtime.h): the host works, every
// device allocation, copy or fill is refused with kNotSupported.
#include "core/device_runtime.h"

#if !defined(KVATTN_WITH_CUDA)

#include "kvattn/error.h"

namespace kvattn::device_runtime {
namespace {

[[noreturn]] void no_device(const char* what) {
  throw_error(ErrorKind::kNotSupported, what,
              "this build of kvattn has no CUDA backend (built without nvcc)");
}

}  // namespace

bool compiled() noexcept {
  return false;
}
void* allocate(size_t, int) {
  no_device("device");
}
void release(void*, int) noexcept {}
void copy_sync(void*, Device, const void*, Device, size_t) {
  no_device("device");
}
void fill_sync(void*, int, int, size_t) {
  no_device("device");
}
int device_count() noexcept {
  return 0;
}
size_t free_bytes(int) {
  no_device("device");
}

}  // namespace kvattn::device_runtime

#endif  // !KVATTN_WITH_CUDA
