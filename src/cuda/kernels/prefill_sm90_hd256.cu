// The Hopper prefill kernel's head_dim 256 instances (bf16 and fp16 io.
#include "cuda/kernels/sm90/prefill_kernel.cuh"
#include "cuda/kernels/toolkit/compiled_head_dims.h"

namespace kvattn::cuda::sm90 {

void launch_prefill_sm90_hd256(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                               const LaunchOptions& options, cudaStream_t stream) {
  if constexpr (head_dim_compiled(256)) {
    launch_for_dtype<256, 256>(p, tiles, options, stream);
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim",
                "not compiled: head_dim=256 (KVATTN_CUDA_HEAD_DIMS)");
  }
}

}  // namespace kvattn::cuda::sm90
