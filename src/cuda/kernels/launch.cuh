// Kernel launches as programmatic dependents (PDL, sm_90): the grid may be scheduled while the
// previous kernel of the stream drains. A kernel launched this way must execute
// `griddepcontrol.wait` before it reads anything an earlier kernel wrote (or writes anything an
// earlier kernel reads); the launch itself is an ordinary one on devices or streams without PDL.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/cuda_util.h"

namespace kvattn::cuda::detail {

/// `cluster` > 1: the grid runs in thread-block clusters of that many CTAs along x (grid.x a
/// multiple of it; above 8 the kernel must allow non-portable cluster sizes). Such a kernel
/// should let its dependents launch (griddepcontrol.launch_dependents) only at its very end:
/// clusters of the next grid scheduled while this one still runs take the SM slots it leaves
/// free (a whole cluster within one GPC), so a grid of one CTA an SM ends up with two CTAs on
/// some SMs and none on others for its whole run. Measured (H200, bench/peers, the
/// decode-shaped kernel's cluster split back to back, batch 1, 16 CTAs a kv head; bench/NOTES.md,
/// thirteenth session): triggered after the key steps, decode x 32768 keys 52.8 us, x 16384
/// 29.4, verify b1 16.0; launched as an ordinary dependent 42.1, 24.4, 15.5; triggered at the end
/// 41.3, 23.9, 14.5.
template <typename... Params, typename... Args>
void launch_programmatic_dependent(void (*kernel)(Params...), dim3 grid, dim3 block,
                                   size_t smem_bytes, cudaStream_t stream, const char* name,
                                   int cluster, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = programmatic_launch_enabled() ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  if (cluster > 1) {
    attribute[1].id = cudaLaunchAttributeClusterDimension;
    attribute[1].val.clusterDim.x = unsigned(cluster);
    attribute[1].val.clusterDim.y = 1;
    attribute[1].val.clusterDim.z = 1;
    config.numAttrs = 2;
  }
  check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name);
  check_launch(name);
}

}  // namespace kvattn::cuda::detail
