// Instances of the prefill kernel for head_dim 64 (bf16 and fp16 io; every KV dtype is a
// runtime branch inside them).
#include "cuda/kernels/prefill_kernel.cuh"

namespace kvattn::cuda::prefill_detail {

void launch_prefill_hd64(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                         cudaStream_t stream) {
  launch_if_compiled<64, false>(p, tiles, stream);
}

}  // namespace kvattn::cuda::prefill_detail
