#include "core/size_check.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <limits>

#include "core/device_runtime.h"
#include "kvattn/error.h"

namespace kvattn::core {
namespace {

std::string gib(size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.2f GiB", double(bytes) / double(size_t(1) << 30));
  return text;
}

// MemAvailable of /proc/meminfo (what the kernel can give without swapping), or 0.
size_t host_available_bytes() {
  FILE* file = std::fopen("/proc/meminfo", "r");
  if (file == nullptr) return 0;
  char line[256];
  size_t kib = 0;
  while (std::fgets(line, sizeof(line), file) != nullptr) {
    unsigned long long value = 0;
    if (std::sscanf(line, "MemAvailable: %llu kB", &value) == 1) {
      kib = size_t(value);
      break;
    }
  }
  std::fclose(file);
  return kib * 1024;
}

}  // namespace

size_t checked_bytes(std::initializer_list<int64_t> factors, const std::string& what) {
  size_t product = 1;
  bool overflow = false;
  for (int64_t f : factors) {
    check_arg(f >= 0, what, "a negative size factor (", f, ")");
    if (f != 0 && product > std::numeric_limits<size_t>::max() / size_t(f)) overflow = true;
    if (!overflow) product *= size_t(f);
  }
  if (overflow) {
    std::string text;
    for (int64_t f : factors) text += (text.empty() ? "" : " x ") + std::to_string(f);
    throw_error(ErrorKind::kOutOfResources, what, "needs ", text,
                " bytes, more than any device can hold (the product overflows 64 bits)");
  }
  for (int64_t f : factors) {
    if (f == 0) return 0;
  }
  return product;
}

size_t checked_sum(size_t a, size_t b, const std::string& what) {
  if (a > std::numeric_limits<size_t>::max() - b) {
    throw_error(ErrorKind::kOutOfResources, what, "needs ", a, " + ", b,
                " bytes, more than any device can hold (the sum overflows 64 bits)");
  }
  return a + b;
}

size_t available_bytes(Device device) {
  if (device.is_cpu()) {
    const size_t available = host_available_bytes();
    if (available > 0) return available;
    const long pages = sysconf(_SC_PHYS_PAGES);
    const long page_size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page_size > 0 ? size_t(pages) * size_t(page_size)
                                      : std::numeric_limits<size_t>::max();
  }
  return device_runtime::free_bytes(device.index);
}

void check_fits(Device device, size_t bytes, const std::string& what) {
  const size_t available = available_bytes(device);
  if (bytes <= available) return;
  throw_error(ErrorKind::kOutOfResources, what, "needs ", bytes, " bytes (", gib(bytes), "), ",
              device, " has ", available, " bytes (", gib(available), ") ",
              device.is_cpu() ? "available" : "free", "; nothing was allocated");
}

}  // namespace kvattn::core
