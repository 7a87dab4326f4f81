// Instances of the decode-shaped tensor-core kernel for head_dim 64 (bf16 and fp16 io; every KV
// dtype, mask and soft-cap is a runtime branch inside them).
#include "cuda/kernels/tc_decode_kernel.cuh"

namespace kvattn::cuda::tc_decode {

void launch_tc_decode_hd64(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                           cudaStream_t stream) {
  launch_if_compiled<64>(p, tiles, stream);
}

PrefillKernelShape tc_decode_shape_hd64() { return shape_if_compiled<64>(); }

}  // namespace kvattn::cuda::tc_decode
