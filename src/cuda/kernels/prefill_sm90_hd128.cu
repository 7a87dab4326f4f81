// The Hopper prefill kernel's head_dim 128 instances (bf16 and fp16 io; v_head_dim 128, and
// narrower V heads of head_dim 128 through it.
#include "cuda/kernels/sm90/prefill_kernel.cuh"
#include "cuda/kernels/toolkit/compiled_head_dims.h"

namespace kvattn::cuda::sm90 {

void launch_prefill_sm90_hd128(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                               const LaunchOptions& options, cudaStream_t stream) {
  if constexpr (head_dim_compiled(128)) {
    launch_for_dtype<128, 128>(p, tiles, options, stream);
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim",
                "not compiled: head_dim=128 (KVATTN_CUDA_HEAD_DIMS)");
  }
}

}  // namespace kvattn::cuda::sm90
