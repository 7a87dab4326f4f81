// The Hopper prefill kernel's head_dim 64 instances (bf16 and fp16 io.
#include "cuda/kernels/sm90/prefill_kernel.cuh"
#include "cuda/kernels/toolkit/compiled_head_dims.h"

namespace kvattn::cuda::sm90 {

void launch_prefill_sm90_hd64(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                              const LaunchOptions& options, cudaStream_t stream) {
  if constexpr (head_dim_compiled(64)) {
    launch_for_dtype<64, 64>(p, tiles, options, stream);
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim",
                "not compiled: head_dim=64 (KVATTN_CUDA_HEAD_DIMS)");
  }
}

}  // namespace kvattn::cuda::sm90
