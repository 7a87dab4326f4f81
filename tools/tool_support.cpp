#include "tool_support.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <thread>

#include "cli_args.h"

#if defined(KVATTN_WITH_CUDA)
#include "cuda_bench/bench_support.h"
#endif

namespace kvattn::tools {
namespace {

/// Runs body(begin, end) over [0, count) split across all cores.
template <typename Body>
void parallel_ranges(int64_t count, Body body) {
  const int threads = int(std::min<int64_t>(host_threads(), std::max<int64_t>(1, count >> 16)));
  if (threads <= 1) {
    body(int64_t(0), count);
    return;
  }
  std::vector<std::thread> workers;
  const int64_t chunk = (count + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = std::min(count, t * chunk);
    const int64_t end = std::min(count, begin + chunk);
    workers.emplace_back([=] { body(begin, end); });
  }
  for (std::thread& worker : workers) worker.join();
}

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string run_and_read_line(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  char line[256] = {0};
  std::string out;
  if (std::fgets(line, sizeof(line), pipe) != nullptr) out = line;
  pclose(pipe);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

}  // namespace

int host_threads() {
  return cpu_backend_info().num_threads;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

ToolDevice select_device(const std::string& name) {
  ToolDevice out;
  std::string wanted = name;
  if (wanted.empty()) wanted = cuda_device_count() > 0 ? "cuda" : "cpu";
  if (wanted == "cpu") return out;
  if (wanted != "cuda") {
    throw UsageError("option '--device': got '" + name + "', expected cpu|cuda");
  }
  if (!cuda_compiled()) {
    throw UsageError(
        "--device cuda: this build of kvattn has no CUDA backend "
        "(configure with nvcc present and -DKVATTN_WITH_CUDA=ON)");
  }
  if (cuda_device_count() == 0) throw UsageError("--device cuda: no CUDA device is visible");
  out.kind = BackendKind::kCuda;
  out.device = Device::cuda(0);
  return out;
}

void fill_random(const TensorView& tensor, uint64_t seed, float scale) {
  check_arg(is_float_dtype(tensor.dtype()) && tensor.is_contiguous(), "tensor",
            "expected a contiguous float tensor, got ", tensor);
  if (tensor.device().is_cuda()) {
#if defined(KVATTN_WITH_CUDA)
    cuda::bench::fill_random(tensor, seed, scale, nullptr);
    return;
#else
    throw_error(ErrorKind::kNotSupported, "tensor", "a CUDA tensor in a build without CUDA");
#endif
  }
  void* data = tensor.data();
  const DType dtype = tensor.dtype();
  // Same hash as the CUDA fill, so a seed means the same data on either device.
  parallel_ranges(tensor.numel(), [=](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t bits = mix64(seed * 0x9E3779B97F4A7C15ull + uint64_t(i));
      const float value = (2.f * (float(bits >> 40) * (1.f / 16777216.f)) - 1.f) * scale;
      // bf16 is what the benchmark fills by the GiB: skip the generic per-element dispatch.
      if (dtype == DType::kBFloat16)
        static_cast<uint16_t*>(data)[i] = float_to_bf16(value);
      else
        store_from_float(data, dtype, i, value);
    }
  });
}

void synchronize(Device device) {
#if defined(KVATTN_WITH_CUDA)
  if (device.is_cuda()) cuda::bench::device_synchronize();
#else
  (void)device;
#endif
}

MirroredIndex::MirroredIndex(const std::vector<int32_t>& values, Device device) : host_(values) {
  const int64_t n = int64_t(host_.size());
  host_view_ = TensorView(host_.data(), DType::kInt32, Device::cpu(), {n});
  if (device.is_cpu()) {
    device_view_ = host_view_;
    return;
  }
  device_buffer_ = Buffer::allocate(device, size_t(std::max<int64_t>(n, 1)) * 4);
  device_view_ = device_buffer_.view(DType::kInt32, {n});
  copy_bytes(device_view_.data(), device, host_.data(), Device::cpu(), size_t(n) * 4);
}

OwnedTensor OwnedTensor::make(Device device, DType dtype, std::initializer_list<int64_t> shape) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  OwnedTensor out;
  out.buffer = Buffer::allocate(device, size_t(std::max<int64_t>(count, 1)) * dtype_size(dtype));
  out.view = out.buffer.view(dtype, shape);
  return out;
}

OwnedTensor to_host(const TensorView& tensor) {
  check_arg(tensor.is_contiguous(), "tensor", "expected a contiguous tensor, got ", tensor);
  OwnedTensor out;
  out.buffer = Buffer::allocate(Device::cpu(), size_t(std::max<int64_t>(tensor.nbytes(), 1)));
  const int ndim = tensor.ndim();
  int64_t shape[TensorView::kMaxDims];
  int64_t strides[TensorView::kMaxDims];
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    shape[d] = tensor.size(d);
    strides[d] = stride;
    stride *= shape[d];
  }
  out.view = TensorView(out.buffer.data(), tensor.dtype(), Device::cpu(), ndim, shape, strides);
  copy_bytes(out.buffer.data(), Device::cpu(), tensor.data(), tensor.device(),
             size_t(tensor.nbytes()));
  return out;
}

namespace {

/// The source tree: __FILE__ is tools/tool_support.cpp under it (CMake passes absolute paths).
std::string source_dir() {
  std::string dir = __FILE__;
  for (int up = 0; up < 2; ++up) {
    const size_t slash = dir.find_last_of('/');
    dir = slash == std::string::npos ? "." : dir.substr(0, slash);
  }
  return dir;
}

// The commit a binary run away from its source tree (e.g. carried to the GPU machine) is told
// through KVATTN_GIT_COMMIT; null when it is not set.
const char* told_commit() {
  const char* env = std::getenv("KVATTN_GIT_COMMIT");
  return env != nullptr && *env != '\0' ? env : nullptr;
}

}  // namespace

std::string git_commit() {
  if (const char* told = told_commit()) return told;
  for (const std::string& dir : {source_dir(), std::string(".")}) {
    const std::string sha = run_and_read_line("git -C '" + dir + "' rev-parse HEAD 2>/dev/null");
    if (sha.size() == 40) return sha;
  }
#if defined(KVATTN_GIT_COMMIT)
  return KVATTN_GIT_COMMIT;
#else
  return "unknown";
#endif
}

bool git_dirty() {
  // A binary told its commit was built from that commit; the tree it runs beside (a copy on the
  // GPU machine, with a stale .git) says nothing about it.
  if (told_commit() != nullptr) return false;
  return !run_and_read_line("git -C '" + source_dir() +
                            "' status --porcelain --untracked-files=no 2>/dev/null")
              .empty();
}

std::string today_iso() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[16];
  std::strftime(text, sizeof(text), "%Y-%m-%d", &local);
  return text;
}

std::string device_description(const ToolDevice& device) {
  if (device.device.is_cuda()) {
#if defined(KVATTN_WITH_CUDA)
    return cuda::bench::device_properties(device.device.index).name;
#endif
  }
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  std::string model = "CPU";
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(colon + 2);
      break;
    }
  }
  std::ostringstream os;
  os << model << " (" << host_threads() << " threads)";
  return os.str();
}

std::string format_us(double us) {
  char text[32];
  if (us >= 1e6)
    std::snprintf(text, sizeof(text), "%.2f s", us / 1e6);
  else if (us >= 1e4)
    std::snprintf(text, sizeof(text), "%.1f ms", us / 1e3);
  else if (us >= 1e3)
    std::snprintf(text, sizeof(text), "%.2f ms", us / 1e3);
  else
    std::snprintf(text, sizeof(text), "%.1f us", us);
  return text;
}

std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof(text), "%.6g", value);
  return text;
}

std::string json_string(const std::string& value) {
  std::string out = "\"";
  for (char c : value) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

RandomSource::RandomSource(Device device, int64_t elements, int head_dim, uint64_t seed)
    : elements_(elements),
      head_dim_(head_dim),
      host_(OwnedTensor::make(Device::cpu(), DType::kBFloat16, {elements})),
      device_(device.is_cpu() ? OwnedTensor{}
                              : OwnedTensor::make(device, DType::kBFloat16, {elements})),
      on_host_(device.is_cpu()) {
  fill_random(host_.view, seed, 1.f);
  if (!on_host_) {
    copy_bytes(device_.view.data(), device, host_.view.data(), Device::cpu(),
               size_t(host_.view.nbytes()));
  }
}

std::pair<TensorView, TensorView> RandomSource::slice(Rng& rng, int64_t rows, int heads) const {
  const int64_t count = rows * heads * head_dim_;
  check_arg(count <= elements_, "random source", "needs ", count, " values, has ", elements_);
  constexpr int64_t kAlignElements = 128 / 2;  // bf16
  const int64_t offset =
      int64_t(rng.next() % uint64_t(elements_ - count + 1)) / kAlignElements * kAlignElements;
  auto view_at = [&](const OwnedTensor& t) {
    return TensorView(static_cast<uint16_t*>(t.view.data()) + offset, DType::kBFloat16,
                      t.view.device(), {rows, heads, int64_t(head_dim_)});
  };
  const TensorView host = view_at(host_);
  return {on_host_ ? host : view_at(device_), host};
}

}  // namespace kvattn::tools
