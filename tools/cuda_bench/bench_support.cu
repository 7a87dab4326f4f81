#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "cuda_bench/bench_support.h"
#include "kvattn/error.h"

namespace kvattn::cuda::bench {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw_error(
        status == cudaErrorMemoryAllocation ? ErrorKind::kOutOfResources : ErrorKind::kDeviceError,
        what, cudaGetErrorString(status));
  }
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw_error(ErrorKind::kDeviceError, what, "cuBLAS status ", int(status));
  }
}

/// cudaMalloc'd bytes, freed on scope exit (the ceilings allocate and free GiBs).
class DeviceAllocation {
 public:
  explicit DeviceAllocation(size_t bytes) { check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc"); }
  ~DeviceAllocation() { cudaFree(ptr_); }
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

/// Events around one region on a stream; elapsed in microseconds.
class EventPair {
 public:
  EventPair() {
    check_cuda(cudaEventCreate(&start_), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  ~EventPair() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
  void start(cudaStream_t stream) {
    check_cuda(cudaEventRecord(start_, stream), "cudaEventRecord");
  }
  double stop_us(cudaStream_t stream) {
    check_cuda(cudaEventRecord(stop_, stream), "cudaEventRecord");
    check_cuda(cudaEventSynchronize(stop_), "cudaEventSynchronize");
    float ms = 0.f;
    check_cuda(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return double(ms) * 1e3;
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Element i gets a value drawn from hash(seed, i): reproducible and independent of the launch.
__global__ void fill_random_kernel(void* data,  // [count] of dtype
                                   DType dtype, int64_t count, uint64_t seed, float scale) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint64_t bits = mix64(seed * 0x9E3779B97F4A7C15ull + uint64_t(i));
    const float unit = float(bits >> 40) * (1.f / 16777216.f);  // [0, 1)
    const float value = (2.f * unit - 1.f) * scale;
    switch (dtype) {
      case DType::kFloat32:
        static_cast<float*>(data)[i] = value;
        break;
      case DType::kBFloat16:
        static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(value);
        break;
      case DType::kFloat16:
        static_cast<__half*>(data)[i] = __float2half_rn(value);
        break;
      case DType::kFloat8E4M3:
        static_cast<__nv_fp8_storage_t*>(data)[i] =
            __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3);
        break;
      case DType::kFloat8E5M2:
        static_cast<__nv_fp8_storage_t*>(data)[i] =
            __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E5M2);
        break;
      default:
        break;
    }
  }
}

/// Reads `num_vectors` 16-byte vectors once; four independent loads in flight per thread.
/// The XOR of everything read is written only when it equals an unlikely constant, so the
/// compiler keeps every load while the kernel writes (almost surely) nothing.
__global__ void read_stream_kernel(const uint4* __restrict__ data,  // [num_vectors]
                                   int64_t num_vectors,
                                   uint32_t* sink) {  // [1]
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t acc = 0;
  for (; i + 3 * stride < num_vectors; i += 4 * stride) {
    const uint4 a = __ldcs(data + i);
    const uint4 b = __ldcs(data + i + stride);
    const uint4 c = __ldcs(data + i + 2 * stride);
    const uint4 d = __ldcs(data + i + 3 * stride);
    acc ^= (a.x ^ a.y ^ a.z ^ a.w) ^ (b.x ^ b.y ^ b.z ^ b.w) ^ (c.x ^ c.y ^ c.z ^ c.w) ^
           (d.x ^ d.y ^ d.z ^ d.w);
  }
  for (; i < num_vectors; i += stride) {
    const uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) *sink = acc;
}

int blocks_filling_device(const void* kernel, int threads, int device) {
  int sm_count = 0;
  check_cuda(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute");
  int per_sm = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0),
             "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(1, sm_count * std::max(1, per_sm));
}

}  // namespace

DeviceProperties device_properties(int device) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  DeviceProperties out;
  out.name = prop.name;
  out.sm_count = prop.multiProcessorCount;
  out.l2_bytes = prop.l2CacheSize;
  out.global_bytes = int64_t(prop.totalGlobalMem);
  out.compute_major = prop.major;
  out.compute_minor = prop.minor;
  return out;
}

Stream::Stream(int device) : device_(device) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = stream;
}

Stream::~Stream() {
  cudaSetDevice(device_);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void Stream::synchronize() const {
  check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
}

void fill_random(const TensorView& tensor, uint64_t seed, float scale, void* stream) {
  check_arg(tensor.device().is_cuda(), "tensor", "expected a CUDA tensor, got ", tensor.describe());
  check_arg(is_float_dtype(tensor.dtype()) && tensor.is_contiguous(), "tensor",
            "expected a contiguous float tensor, got ", tensor.describe());
  const int64_t count = tensor.numel();
  if (count == 0) return;
  check_cuda(cudaSetDevice(tensor.device().index), "cudaSetDevice");
  const int threads = 256;
  const int blocks = int(std::min<int64_t>((count + threads - 1) / threads, 65536));
  auto s = static_cast<cudaStream_t>(stream);
  fill_random_kernel<<<blocks, threads, 0, s>>>(tensor.data(), tensor.dtype(), count, seed, scale);
  check_cuda(cudaGetLastError(), "fill_random_kernel");
  check_cuda(cudaStreamSynchronize(s), "fill_random_kernel");
}

void device_synchronize() {
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

double measure_read_gbps(int device, int64_t bytes, int reps) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const int64_t num_vectors = bytes / int64_t(sizeof(uint4));
  DeviceAllocation data(size_t(num_vectors) * sizeof(uint4));
  DeviceAllocation sink(sizeof(uint32_t));
  // Random content: reading zeros could take a faster path somewhere in the memory system.
  fill_random(TensorView(data.get(), DType::kFloat32, Device::cuda(device), {num_vectors * 4}),
              0x5eed, 1.f, nullptr);
  const int threads = 512;
  const int blocks =
      blocks_filling_device(reinterpret_cast<const void*>(read_stream_kernel), threads, device);
  auto run = [&] {
    read_stream_kernel<<<blocks, threads>>>(static_cast<const uint4*>(data.get()), num_vectors,
                                            static_cast<uint32_t*>(sink.get()));
  };
  run();
  check_cuda(cudaGetLastError(), "read_stream_kernel");
  check_cuda(cudaDeviceSynchronize(), "read_stream_kernel");
  EventPair events;
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    events.start(nullptr);
    run();
    const double us = events.stop_us(nullptr);
    gbps.push_back(double(num_vectors) * sizeof(uint4) / (us * 1e3));
  }
  check_cuda(cudaGetLastError(), "read_stream_kernel");
  return median(gbps);
}

double measure_copy_gbps(int device, int64_t bytes, int reps) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const size_t half = size_t(bytes / 2) & ~size_t(255);
  DeviceAllocation data(2 * half);
  char* base = static_cast<char*>(data.get());
  fill_random(TensorView(base, DType::kFloat32, Device::cuda(device), {int64_t(half / 4)}), 7, 1.f,
              nullptr);
  check_cuda(cudaMemcpy(base + half, base, half, cudaMemcpyDeviceToDevice), "cudaMemcpy");
  EventPair events;
  std::vector<double> gbps;
  for (int r = 0; r < reps; ++r) {
    events.start(nullptr);
    check_cuda(cudaMemcpyAsync(base + half, base, half, cudaMemcpyDeviceToDevice, nullptr),
               "cudaMemcpyAsync");
    const double us = events.stop_us(nullptr);
    gbps.push_back(2.0 * double(half) / (us * 1e3));
  }
  return median(gbps);
}

double measure_gemm_bf16_tflops(int device, int n, int reps) {
  check_cuda(cudaSetDevice(device), "cudaSetDevice");
  const size_t elements = size_t(n) * size_t(n);
  DeviceAllocation a(elements * 2);
  DeviceAllocation b(elements * 2);
  DeviceAllocation c(elements * 2);
  const Device dev = Device::cuda(device);
  // Random operands: a GEMM on zeros runs measurably faster than on real data.
  fill_random(TensorView(a.get(), DType::kBFloat16, dev, {int64_t(elements)}), 11, 1.f, nullptr);
  fill_random(TensorView(b.get(), DType::kBFloat16, dev, {int64_t(elements)}), 12, 1.f, nullptr);
  cublasHandle_t handle = nullptr;
  check_cublas(cublasCreate(&handle), "cublasCreate");
  const float alpha = 1.f;
  const float beta = 0.f;
  auto gemm = [&] {
    check_cublas(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(),
                              CUDA_R_16BF, n, b.get(), CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF,
                              n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx");
  };
  std::vector<double> tflops;
  try {
    for (int w = 0; w < 5; ++w) gemm();
    check_cuda(cudaDeviceSynchronize(), "cublasGemmEx");
    EventPair events;
    const double flops = 2.0 * double(n) * double(n) * double(n);
    for (int r = 0; r < reps; ++r) {
      events.start(nullptr);
      gemm();
      const double us = events.stop_us(nullptr);
      tflops.push_back(flops / (us * 1e6));
    }
  } catch (...) {
    cublasDestroy(handle);
    throw;
  }
  cublasDestroy(handle);
  return median(tflops);
}

Timing time_on_stream(const std::function<void(int call)>& fn, void* stream_handle,
                      const TimingOptions& options) {
  auto stream = static_cast<cudaStream_t>(stream_handle);
  const int calls = std::max(1, options.calls_per_rep);
  auto run_calls = [&] {
    for (int call = 0; call < calls; ++call) fn(call);
  };
  // One plain pass first: lazy allocations and plans must happen outside any capture.
  run_calls();
  check_cuda(cudaGetLastError(), "timed function");
  check_cuda(cudaStreamSynchronize(stream), "timed function");

  cudaGraphExec_t graph_exec = nullptr;
  if (options.use_graph) {
    cudaGraph_t graph = nullptr;
    bool ok = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok) {
      try {
        run_calls();
      } catch (...) {
        ok = false;  // e.g. a synchronizing call inside the backend: time it directly instead
      }
      ok = (cudaStreamEndCapture(stream, &graph) == cudaSuccess) && ok && graph != nullptr;
      if (ok) ok = cudaGraphInstantiate(&graph_exec, graph, 0) == cudaSuccess;
      if (graph != nullptr) cudaGraphDestroy(graph);
    }
    if (!ok) {
      graph_exec = nullptr;
      cudaGetLastError();  // a failed capture leaves a non-sticky error behind
    }
  }
  auto run_rep = [&] {
    if (graph_exec != nullptr) {
      check_cuda(cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch");
    } else {
      run_calls();
    }
  };

  Timing timing;
  timing.graph = graph_exec != nullptr;
  try {
    for (int w = 0; w < options.warmup; ++w) run_rep();
    check_cuda(cudaStreamSynchronize(stream), "timed function");
    EventPair events;
    std::vector<double> per_call;
    const auto begin = std::chrono::steady_clock::now();
    while (int(per_call.size()) < options.max_reps) {
      events.start(stream);
      run_rep();
      per_call.push_back(events.stop_us(stream) / calls);
      const double spent =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      if (int(per_call.size()) >= options.min_reps && spent > options.max_seconds) break;
    }
    check_cuda(cudaGetLastError(), "timed function");
    timing.reps = int(per_call.size());
    timing.median_us = median(per_call);
    timing.min_us = *std::min_element(per_call.begin(), per_call.end());
  } catch (...) {
    if (graph_exec != nullptr) cudaGraphExecDestroy(graph_exec);
    throw;
  }
  if (graph_exec != nullptr) cudaGraphExecDestroy(graph_exec);
  return timing;
}

}  // namespace kvattn::cuda::bench
