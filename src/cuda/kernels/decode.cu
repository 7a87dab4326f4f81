// Dispatch of the decode kernel over the compiled (head_dim, KV dtype) instances.
#include <cstdint>

#include "cuda/kernels/decode.h"
#include "cuda/kernels/toolkit/compiled_head_dims.h"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace detail {

template <int kHeadDim>
void run_decode_head_dim(const DecodeLaunch* launch, DType kv_dtype, int device,
                         cudaStream_t stream, DecodeKernelInfo* info);
extern template void run_decode_head_dim<64>(const DecodeLaunch*, DType, int, cudaStream_t,
                                             DecodeKernelInfo*);
extern template void run_decode_head_dim<128>(const DecodeLaunch*, DType, int, cudaStream_t,
                                              DecodeKernelInfo*);
extern template void run_decode_head_dim<256>(const DecodeLaunch*, DType, int, cudaStream_t,
                                              DecodeKernelInfo*);

}  // namespace detail

namespace {

// The instance that serves head_dim and v_head_dim: the smallest compiled one >= both.
int pick_instance(int head_dim, int v_head_dim, DType kv_dtype) {
  check_arg(head_dim > 0 && head_dim % 8 == 0, "head_dim", "got ", head_dim,
            ", the decode kernel needs a positive multiple of 8");
  check_arg(v_head_dim > 0 && v_head_dim % 8 == 0, "v_head_dim", "got ", v_head_dim,
            ", the decode kernel needs a positive multiple of 8");
  const int need = head_dim > v_head_dim ? head_dim : v_head_dim;
  int best = 0;
  for (int d : kCompiledHeadDims) {
    if ((d == 64 || d == 128 || d == 256) && d >= need && (best == 0 || d < best)) best = d;
  }
  if (best == 0) {
    throw_error(ErrorKind::kNotSupported, "head_dim",
                "decode kernel not compiled: head_dim=", head_dim, " v_head_dim=", v_head_dim,
                " dtype=", dtype_name(kv_dtype), " (compiled head_dims: KVATTN_CUDA_HEAD_DIMS)");
  }
  return best;
}

void run_instance(int instance, const DecodeLaunch* launch, DType kv_dtype, int device,
                  cudaStream_t stream, DecodeKernelInfo* info) {
  switch (instance) {
    case 64:
      return detail::run_decode_head_dim<64>(launch, kv_dtype, device, stream, info);
    case 128:
      return detail::run_decode_head_dim<128>(launch, kv_dtype, device, stream, info);
    default:
      return detail::run_decode_head_dim<256>(launch, kv_dtype, device, stream, info);
  }
}

bool aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % uintptr_t(bytes) == 0;
}

}  // namespace

DecodeKernelInfo decode_kernel_info(int head_dim, int v_head_dim, DType kv_dtype, int group_size,
                                    int device) {
  check_arg(group_size >= 1, "group_size", "got ", group_size, ", expected >= 1");
  DecodeKernelInfo info;
  run_instance(pick_instance(head_dim, v_head_dim, kv_dtype), nullptr, kv_dtype, device, nullptr,
               &info);
  info.head_passes = (group_size + kDecodeHeadsPerCta - 1) / kDecodeHeadsPerCta;
  if (info.ctas_per_sm < 1) {
    throw_error(ErrorKind::kDeviceError, "decode_paged_kernel", "no CTA fits on one SM of device ",
                device);
  }
  return info;
}

void launch_decode(const DecodeLaunch& launch, int device, cudaStream_t stream) {
  const core::AttentionParams& p = launch.params;
  check_arg(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0, "num_q_heads", "got ",
            p.num_q_heads, " q heads for ", p.num_kv_heads, " kv heads");
  check_arg(p.io_dtype == DType::kFloat32 || p.io_dtype == DType::kBFloat16 ||
                p.io_dtype == DType::kFloat16,
            "q", "dtype ", dtype_name(p.io_dtype), ", expected fp32, bf16 or fp16");
  const int instance = pick_instance(p.head_dim, p.v_head_dim, p.kv_dtype);
  // cp.async moves 8-element chunks: rows must start on a chunk boundary.
  const int64_t chunk_bytes = 8 * dtype_size(p.kv_dtype);
  check_arg(aligned(p.k, chunk_bytes) && aligned(p.v, chunk_bytes), "k_buffer",
            "K/V buffers must be ", chunk_bytes, "-byte aligned");
  check_arg(p.k_stride_token % 8 == 0 && p.k_stride_head % 8 == 0 && p.v_stride_token % 8 == 0 &&
                p.v_stride_head % 8 == 0,
            "k_buffer", "K/V strides must be multiples of 8 elements");
  check_arg(launch.items != nullptr && launch.num_items != nullptr && p.kv_indptr != nullptr &&
                p.kv_indices != nullptr,
            "plan", "decode needs work items, kv_indptr and kv_indices on the device");
  if (launch.grid_items == 0 || p.batch_size == 0) return;
  run_instance(instance, &launch, p.kv_dtype, device, stream, nullptr);
  if (launch.has_partials) detail::launch_decode_merge(launch, stream);

}

}  // namespace kvattn::cuda
