// set_kv_buffer on the device (see kv_write.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/kernels/decode_numerics.cuh"
#include "cuda/kernels/kv_write.h"
#include "cuda/kernels/step_check.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

using detail::load_io;
using detail::store_kv;

constexpr int kWriteThreads = 256;
// Enough CTAs to fill an H200 several times over; larger writes loop (grid-stride).
constexpr int64_t kMaxWriteCtas = 132 * 16;

// One thread per element of a (token, kv head) row of K followed by V.
// check_loc: true when every slot of loc is inside the pool, else (block 0) the step is refused
// and the first bad slot published. Every CTA reads all of loc, so all agree.
__device__ bool loc_all_valid(const KvWriteLaunch& w) {
  const DeviceIndexArray loc{w.loc, w.loc_int64, w.num_tokens};
  bool bad = false;
  for (int64_t t = threadIdx.x; t < w.num_tokens && !bad; t += kWriteThreads) {
    const int64_t slot = detail::index_at(loc, t);
    bad = slot < 0 || slot >= w.num_slots;
  }
  if (!__syncthreads_or(bad)) return true;
  if (blockIdx.x == 0) {
    __shared__ unsigned long long scratch;
    const int64_t first = detail::first_out_of_range(loc, w.num_slots, &scratch);
    if (threadIdx.x == 0 && w.step_state != nullptr) {
      const uint32_t bit = 1u << w.loc_argument;
      const uint32_t error = atomicOr(&w.step_state->error, bit) | bit;
      StepReport report;
      report.step = w.step_state->step;
      report.error = error;
      for (int a = 0; a < kNumStepArguments; ++a) {
        report.position[a] = report.value[a] = report.entry[a] = report.row[a] = -1;
      }
      report.position[w.loc_argument] = report.entry[w.loc_argument] = first;
      report.value[w.loc_argument] = detail::index_at(loc, first);
      detail::publish_step_report(w.reports, report);
    }
  }
  return false;
}

template <DType kKv>
__global__ void __launch_bounds__(kWriteThreads) kv_write_kernel(const KvWriteLaunch w) {
  // Block-uniform: with check_loc, block 0 of this very launch may set the word meanwhile.
  const uint32_t* word = w.step_state != nullptr ? &w.step_state->error : nullptr;
  if (__syncthreads_or(threadIdx.x == 0 && detail::step_refused(word))) return;
  if (w.check_loc && !loc_all_valid(w)) return;
  const int64_t row_elems = int64_t(w.head_dim) + w.v_head_dim;
  const int64_t total = w.num_tokens * w.num_kv_heads * row_elems;
  const bool fp8 = kKv == DType::kFloat8E4M3 || kKv == DType::kFloat8E5M2;
  for (int64_t index = int64_t(blockIdx.x) * kWriteThreads + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * kWriteThreads) {
    const int64_t row = index / row_elems;
    const int64_t e = index % row_elems;
    const int64_t token = row / w.num_kv_heads;
    const int64_t head = row % w.num_kv_heads;
    const int64_t slot = w.loc_int64 ? static_cast<const int64_t*>(w.loc)[token]
                                     : static_cast<const int32_t*>(w.loc)[token];
    if (slot < 0 || slot >= w.num_slots) continue;  // checked before: never reached
    if (e < w.head_dim) {
      const float x =
          load_io(w.k, w.io_dtype, token * w.k_stride_token + head * w.k_stride_head + e);
      // Division, not a reciprocal multiply, so the stored value matches the host's k / k_scale.
      store_kv<kKv>(w.k_cache, slot * w.k_cache_stride_token + head * w.k_cache_stride_head + e,
                    fp8 ? x / w.k_scale : x);
    } else {
      const int64_t ev = e - w.head_dim;
      const float x =
          load_io(w.v, w.io_dtype, token * w.v_stride_token + head * w.v_stride_head + ev);
      store_kv<kKv>(w.v_cache, slot * w.v_cache_stride_token + head * w.v_cache_stride_head + ev,
                    fp8 ? x / w.v_scale : x);
    }
  }
}

}  // namespace

void launch_kv_write(const KvWriteLaunch& w, cudaStream_t stream) {
  const int64_t total = w.num_tokens * w.num_kv_heads * (int64_t(w.head_dim) + w.v_head_dim);
  if (total == 0) return;
  const dim3 grid(
      uint32_t(std::min<int64_t>((total + kWriteThreads - 1) / kWriteThreads, kMaxWriteCtas)));
  switch (w.kv_dtype) {
    case DType::kBFloat16:
      kv_write_kernel<DType::kBFloat16><<<grid, kWriteThreads, 0, stream>>>(w);
      break;
    case DType::kFloat16:
      kv_write_kernel<DType::kFloat16><<<grid, kWriteThreads, 0, stream>>>(w);
      break;
    case DType::kFloat8E4M3:
      kv_write_kernel<DType::kFloat8E4M3><<<grid, kWriteThreads, 0, stream>>>(w);
      break;
    case DType::kFloat8E5M2:
      kv_write_kernel<DType::kFloat8E5M2><<<grid, kWriteThreads, 0, stream>>>(w);
      break;
    default:
      throw_error(ErrorKind::kNotSupported, "kv_dtype", dtype_name(w.kv_dtype),
                  " is not a KV storage dtype");
  }
  check_launch("kv_write_kernel");
}

}  // namespace kvattn::cuda

namespace kvattn::cuda {
namespace {

__global__ void __launch_bounds__(kWriteThreads) convert_rows_kernel(const ConvertRowsLaunch c) {
  if (detail::step_refused(c.step_error)) return;
  const int64_t total = c.rows * c.heads * c.dim;
  for (int64_t index = int64_t(blockIdx.x) * kWriteThreads + threadIdx.x; index < total;
       index += int64_t(gridDim.x) * kWriteThreads) {
    const int64_t row = index / (int64_t(c.heads) * c.dim);
    const int64_t rest = index % (int64_t(c.heads) * c.dim);
    const int64_t head = rest / c.dim;
    const int64_t e = rest % c.dim;
    const int64_t src_row = c.src_rows != nullptr ? c.src_rows[row] : row;
    const float x =
        load_io(c.src, c.src_dtype, src_row * c.src_stride_token + head * c.src_stride_head + e);
    detail::store_io(c.dst, c.dst_dtype, row * c.dst_stride_token + head * c.dst_stride_head + e,
                     x);
  }
}

}  // namespace

void launch_convert_rows(const ConvertRowsLaunch& c, cudaStream_t stream) {
  const int64_t total = c.rows * c.heads * c.dim;
  if (total == 0) return;
  const dim3 grid(
      uint32_t(std::min<int64_t>((total + kWriteThreads - 1) / kWriteThreads, kMaxWriteCtas)));
  convert_rows_kernel<<<grid, kWriteThreads, 0, stream>>>(c);
  check_launch("convert_rows_kernel");
}

}  // namespace kvattn::cuda
