// The head_dims the CUDA kernels are compiled for (the CMake option KVATTN_CUDA_HEAD_DIMS, which
// defines the macro for host and device code alike): one list for every kernel family. An
// instance whose head_dim is not listed is never instantiated, and a call that needs it fails
// with a clear "not compiled" error.
#pragma once

#ifndef KVATTN_CUDA_HEAD_DIMS
#define KVATTN_CUDA_HEAD_DIMS 64, 128, 192, 256
#endif

namespace kvattn::cuda {

inline constexpr int kCompiledHeadDims[] = {KVATTN_CUDA_HEAD_DIMS};

constexpr bool head_dim_compiled(int head_dim) {
  for (int d : kCompiledHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

}  // namespace kvattn::cuda
