// KVATTN_HOST_DEVICE: a function the host planner and the CUDA kernels share (one definition of
// the arithmetic both sides must agree on): __host__ __device__ inline under nvcc, inline else.
#pragma once

#if defined(__CUDACC__)
#define KVATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVATTN_HOST_DEVICE inline
#endif
