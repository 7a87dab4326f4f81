// Instances of the decode-shaped tensor-core kernel for head_dim 128 (bf16 and fp16 io; every KV
// dtype, mask and soft-cap is a runtime branch inside them).
#include "cuda/kernels/tc_decode_kernel.cuh"

namespace kvattn::cuda::tc_decode {

void launch_tc_decode_hd128(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                            cudaStream_t stream) {
  launch_if_compiled<128>(p, tiles, stream);
}

PrefillKernelShape tc_decode_shape_hd128() { return shape_if_compiled<128>(); }

}  // namespace kvattn::cuda::tc_decode
