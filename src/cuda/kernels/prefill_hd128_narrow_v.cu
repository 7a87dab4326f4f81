// Instances of the prefill kernel for head_dim 128 with v_head_dim a multiple of 16 below 128
// (bf16 and fp16 io; v_head_dim and every KV dtype are runtime branches inside them). A file of
// its own so that it compiles beside the v_head_dim == head_dim instances.
#include "cuda/kernels/prefill_kernel.cuh"

namespace kvattn::cuda::prefill_detail {

void launch_prefill_hd128_narrow_v(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                                   cudaStream_t stream) {
  launch_if_compiled<128, true>(p, tiles, stream);
}

}  // namespace kvattn::cuda::prefill_detail
