// The Hopper prefill kernel's head_dim 192 instances (bf16 and fp16 io; v_head_dim 128: DeepSeek's
// MHA prefill).
#include "cuda/kernels/sm90/prefill_kernel.cuh"
#include "cuda/kernels/toolkit/compiled_head_dims.h"

namespace kvattn::cuda::sm90 {

void launch_prefill_sm90_hd192(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                               const LaunchOptions& options, cudaStream_t stream) {
  if constexpr (head_dim_compiled(192)) {
    launch_for_dtype<192, 128>(p, tiles, options, stream);
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim",
                "not compiled: head_dim=192 (KVATTN_CUDA_HEAD_DIMS)");
  }
}

}  // namespace kvattn::cuda::sm90
