// The decode kernel's head_dim 64 instances (four KV storage dtypes).
#include "cuda/kernels/decode_kernel.cuh"

namespace kvattn::cuda::detail {
template void run_decode_head_dim<64>(const DecodeLaunch*, DType, int, cudaStream_t,
                                      DecodeKernelInfo*);
}  // namespace kvattn::cuda::detail
