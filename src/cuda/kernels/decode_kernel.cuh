// The batch decode kernel (see decode.h for the design). Included by one small .cu per compiled
// head_dim (decode_hd64.cu, ...), each instantiating the four KV storage dtypes.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "core/softmax_state.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/decode.h"
#include "cuda/kernels/decode_numerics.cuh"
#include "cuda/kernels/launch.cuh"
#include "cuda/kernels/step_check.cuh"
#include "cuda/kernels/toolkit/compiled_head_dims.h"
#include "kvattn/error.h"

namespace kvattn::cuda::detail {

constexpr int kDecodeThreads = 128;
// Keys per token stream per pipeline step: 4 x (K + V) 16-byte copies in flight per thread per
// stage. With 3 stages and 4 CTAs per SM that is up to 144 KB in flight per SM, several times
// the ~33 KB Little's law asks for at 4.3 TB/s and ~1 us latency over 132 SMs.
constexpr int kDecodeTokensPerStream = 4;
constexpr int kDecodeStages = 3;
// Register budget for 4 resident CTAs of 128 threads: 65536 / 512 = 128 registers per thread.
constexpr int kDecodeMinCtasPerSm = 4;

template <int kHeadDim, DType kKv>
struct DecodeTraits {
  static constexpr int kVec = 8;                            // elements per thread chunk
  static constexpr int kThreadsPerToken = kHeadDim / kVec;  // 8, 16, 32
  static constexpr int kStreams = kDecodeThreads / kThreadsPerToken;
  static constexpr int kTileTokens = kStreams * kDecodeTokensPerStream;
  static constexpr int kChunkBytes = kv_chunk_bytes<kKv>();
  static constexpr int kPlaneBytes = kDecodeThreads * kDecodeTokensPerStream * kChunkBytes;
  static constexpr int kStageBytes = 2 * kPlaneBytes;  // K plane, then V plane
  static constexpr int kPipelineBytes = kDecodeStages * kStageBytes;
  // End of the CTA: per stream m, d and the unnormalized output of every head.
  static constexpr int kMergeBytes =
      (kStreams * kDecodeHeadsPerCta * (kHeadDim + 2) + kDecodeHeadsPerCta) * int(sizeof(float));
  static constexpr int kSmemBytes = kPipelineBytes > kMergeBytes ? kPipelineBytes : kMergeBytes;
  static_assert(kHeadDim % 64 == 0 && kThreadsPerToken <= 32, "head_dim 64, 128 or 256");
};

// One step of a reduce-scatter over lanes: of the 2 * kHalf values each lane holds, it keeps
// the half selected by its lane bit kHalf, adding the partner lane's copy of that half.
template <int kHalf, int kN>
__device__ __forceinline__ void reduce_scatter_step(float (&values)[kN], int lane) {
  const bool upper = (lane & kHalf) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? values[i] : values[i + kHalf];
    const float keep = upper ? values[i + kHalf] : values[i];
    values[i] = keep + __shfl_xor_sync(0xffffffffu, send, kHalf);
  }
}

template <int kHeadDim, DType kKv>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeMinCtasPerSm)
    decode_paged_kernel(const DecodeLaunch launch) {
  using T = DecodeTraits<kHeadDim, kKv>;
  constexpr int kU = kDecodeTokensPerStream;
  constexpr int kH = kDecodeHeadsPerCta;
  constexpr int kElemBytes = T::kChunkBytes / T::kVec;
  // One score per lane after a reduce-scatter when the stream has exactly kU * kH lanes
  // (head_dim 128); other head_dims reduce every score on every lane.
  constexpr bool kScatter = T::kThreadsPerToken == kU * kH;
  const core::AttentionParams& p = launch.params;
  extern __shared__ __align__(16) unsigned char smem[];

  // ---- which work ----------------------------------------------------------------------------
  const int group = p.num_q_heads / p.num_kv_heads;
  const int head_passes = (group + kH - 1) / kH;
  const int ctas_per_item = p.num_kv_heads * head_passes;
  const int item_index = int(blockIdx.x) / ctas_per_item;
  const int rem = int(blockIdx.x) % ctas_per_item;
  const int kv_head = rem / head_passes;
  const int pass = rem % head_passes;
  // Launched as a programmatic dependent (launch_decode): the CTA may start while the previous
  // kernel of the stream drains, so nothing global is read before that kernel has completed.
  ptx::grid_dependency_wait();
  // The error word, the item count and the item load together (item_index < grid_items <= the
  // buffer's capacity, so the read is in bounds even for a graph's padding CTAs). A refused step
  // writes nothing (step_check.h): it is checked before the first write, not here, so that its
  // load is not a round trip of its own before the others (until then the kernel reads only
  // clamped slots and host-made plan values); every CTA sees the same word.
  const bool refused = step_refused(p.step_error);
  const int num_items = *launch.num_items;
  const core::DecodeWorkItem item = launch.items[item_index];
  if (item_index >= num_items) return;  // graph grids cover the capacity
  const int head0 = kv_head * group + pass * kH;
  const int num_heads = min(kH, group - pass * kH);

  const int tid = int(threadIdx.x);
  const int stream = tid / T::kThreadsPerToken;
  const int lane = tid % T::kThreadsPerToken;
  const int dim0 = lane * T::kVec;
  const bool k_lane = dim0 < p.head_dim;
  const bool v_lane = dim0 < p.v_head_dim;
  const int request = item.request;

  // ---- q in registers, scaled so that q.k is the logit in log2 units (or tanh's argument) ----
  const bool capped = p.logit_cap > 0.f;
  const float k_scale = (kKv == DType::kFloat8E4M3 || kKv == DType::kFloat8E5M2) ? p.k_scale : 1.f;
  const float q_scale = (capped ? p.sm_scale / p.logit_cap : p.sm_scale * kLog2e) * k_scale;
  const float cap_log2 = p.logit_cap * kLog2e;
  float q[kH][T::kVec];
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    const bool live = h < num_heads && k_lane;
    const int64_t base =
        int64_t(request) * p.q_stride_token + int64_t(head0 + h) * p.q_stride_head + dim0;
#pragma unroll
    for (int i = 0; i < T::kVec; ++i) {
      q[h][i] = live && dim0 + i < p.head_dim ? load_io(p.q, p.io_dtype, base + i) * q_scale : 0.f;
    }
  }

  // ---- the pipeline: each thread copies and later reads back its own chunks ----------------
  const int64_t kv_base = item.kv_offset;
  const int n_tokens = item.kv_end - item.kv_begin;
  const int num_tiles = (n_tokens + T::kTileTokens - 1) / T::kTileTokens;
  const char* k_head =
      static_cast<const char*>(p.k) + (int64_t(kv_head) * p.k_stride_head + dim0) * kElemBytes;
  const char* v_head =
      static_cast<const char*>(p.v) + (int64_t(kv_head) * p.v_stride_head + dim0) * kElemBytes;
  const uint64_t num_slots = uint64_t(p.num_slots);

  int32_t slots[kU];
  auto load_slots = [&](int tile, int32_t(&into)[kU]) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int local = tile * T::kTileTokens + u * T::kStreams + stream;
      int32_t slot = -1;
      if (local < n_tokens) {
        slot = p.kv_indices[kv_base + local];
        if (uint64_t(uint32_t(slot)) >= num_slots) slot = 0;  // never read outside the pool
      }
      into[u] = slot;
    }
  };
  auto issue = [&](int stage, const int32_t(&slots)[kU]) {
    unsigned char* k_plane = smem + stage * T::kStageBytes;
    unsigned char* v_plane = k_plane + T::kPlaneBytes;
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const bool valid = slots[u] >= 0;
      const int64_t slot = valid ? slots[u] : 0;
      const int offset = (u * kDecodeThreads + tid) * T::kChunkBytes;
      ptx::cp_async_zfill<T::kChunkBytes>(ptx::smem_address(k_plane + offset),
                                          k_head + slot * p.k_stride_token * kElemBytes,
                                          valid && k_lane);
      ptx::cp_async_zfill<T::kChunkBytes>(ptx::smem_address(v_plane + offset),
                                          v_head + slot * p.v_stride_token * kElemBytes,
                                          valid && v_lane);
    }
  };

  float m[kH], d[kH], acc[kH][T::kVec];
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    m[h] = -INFINITY;
    d[h] = 0.f;
#pragma unroll
    for (int i = 0; i < T::kVec; ++i) acc[h][i] = 0.f;
  }

  // Prologue: the slots of the first two tiles load together (one index latency, not two).
  static_assert(kDecodeStages == 3, "the prologue fills two stages");
  {
    int32_t second[kU];
    load_slots(0, slots);
    load_slots(1, second);
    if (num_tiles > 0) issue(0, slots);
    ptx::cp_async_commit();
    if (num_tiles > 1) issue(1, second);
    ptx::cp_async_commit();
    load_slots(2, slots);
  }

  for (int tile = 0; tile < num_tiles; ++tile) {
    // Refill the stage consumed in the previous iteration (this thread's own chunks only).
    const int ahead = tile + kDecodeStages - 1;
    if (ahead < num_tiles) issue(ahead % kDecodeStages, slots);
    ptx::cp_async_commit();
    load_slots(ahead + 1, slots);
    ptx::cp_async_wait<kDecodeStages - 1>();

    const unsigned char* k_plane = smem + (tile % kDecodeStages) * T::kStageBytes;
    const unsigned char* v_plane = k_plane + T::kPlaneBytes;

    // Scores: partial dot products over this lane's 8 dims, then a butterfly over the stream.
    float s[kU * kH];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float kf[T::kVec];
      chunk_to_float<kKv>(k_plane + (u * kDecodeThreads + tid) * T::kChunkBytes, kf);
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) dot = fmaf(q[h][i], kf[i], dot);
        s[u * kH + h] = dot;
      }
    }
    if constexpr (kScatter) {
      // Reduce-scatter the kU x kH partial dots over the stream's 16 lanes (15 shuffles instead
      // of 64): afterwards lane L holds the full score of token u = L / kH, head h = L % kH.
      static_assert(T::kThreadsPerToken == 16, "the reduce-scatter below is written for 16 lanes");
      reduce_scatter_step<8>(s, lane);
      reduce_scatter_step<4>(s, lane);
      reduce_scatter_step<2>(s, lane);
      reduce_scatter_step<1>(s, lane);
      const int my_u = lane / kH;
      float score = s[0];
      if (capped) score = cap_log2 * tanhf(score);
      if (tile * T::kTileTokens + my_u * T::kStreams + stream >= n_tokens) score = -INFINITY;
      // This lane's head (lane % kH) across the tile's tokens: lanes L ^ kH, L ^ 2kH.
      float tile_max = fmaxf(score, __shfl_xor_sync(0xffffffffu, score, kH));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2 * kH));
      const float new_max = fmaxf(m[0], tile_max);
      float rescale = 1.f;
      float weight = 0.f;
      if (new_max != -INFINITY) {
        rescale = exp2f(m[0] - new_max);
        weight = exp2f(score - new_max);
      }
      float weight_sum = weight + __shfl_xor_sync(0xffffffffu, weight, kH);
      weight_sum += __shfl_xor_sync(0xffffffffu, weight_sum, 2 * kH);
      d[0] = d[0] * rescale + weight_sum;
      m[0] = new_max;
      // Every lane needs every head's rescale and every (token, head) weight.
      float head_rescale[kH];
      bool any_rescale = false;
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        head_rescale[h] = __shfl_sync(0xffffffffu, rescale, h, T::kThreadsPerToken);
        any_rescale |= head_rescale[h] != 1.f;
      }
      if (any_rescale) {  // rare once the running max settles
#pragma unroll
        for (int h = 0; h < kH; ++h) {
#pragma unroll
          for (int i = 0; i < T::kVec; ++i) acc[h][i] *= head_rescale[h];
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
#pragma unroll
        for (int h = 0; h < kH; ++h) {
          s[u * kH + h] = __shfl_sync(0xffffffffu, weight, u * kH + h, T::kThreadsPerToken);
        }
      }
    } else {
#pragma unroll
      for (int offset = T::kThreadsPerToken / 2; offset >= 1; offset /= 2) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
          for (int h = 0; h < kH; ++h)
            s[u * kH + h] += __shfl_xor_sync(0xffffffffu, s[u * kH + h], offset);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const bool valid = tile * T::kTileTokens + u * T::kStreams + stream < n_tokens;
#pragma unroll
        for (int h = 0; h < kH; ++h) {
          float logit = s[u * kH + h];
          if (capped) logit = cap_log2 * tanhf(logit);
          s[u * kH + h] = valid ? logit : -INFINITY;
        }
      }

      // Online softmax (log2 domain): rescale what was accumulated, turn scores into weights.
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        float tile_max = s[h];
#pragma unroll
        for (int u = 1; u < kU; ++u) tile_max = fmaxf(tile_max, s[u * kH + h]);
        const float new_max = fmaxf(m[h], tile_max);
        if (new_max == -INFINITY) {  // nothing valid seen yet
#pragma unroll
          for (int u = 0; u < kU; ++u) s[u * kH + h] = 0.f;
          continue;
        }
        const float rescale = exp2f(m[h] - new_max);
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          s[u * kH + h] = exp2f(s[u * kH + h] - new_max);
          sum += s[u * kH + h];
        }
        d[h] = d[h] * rescale + sum;
        m[h] = new_max;
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) acc[h][i] *= rescale;
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float vf[T::kVec];
      chunk_to_float<kKv>(v_plane + (u * kDecodeThreads + tid) * T::kChunkBytes, vf);
#pragma unroll
      for (int h = 0; h < kH; ++h) {
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) acc[h][i] = fmaf(s[u * kH + h], vf[i], acc[h][i]);
      }
    }
  }
  ptx::cp_async_wait<0>();
  // The split-KV merge kernel (launched as a programmatic dependent) may start its CTAs now;
  // it waits for this grid's completion before reading any partial state.
  ptx::grid_launch_dependents();
  __syncthreads();  // every thread is done with the pipeline: its memory becomes the merge area

  // ---- merge the CTA's streams and write -------------------------------------------------------
  float* merge_m = reinterpret_cast<float*>(smem);  // [kStreams][kH]
  float* merge_d = merge_m + T::kStreams * kH;      // [kStreams][kH]
  float* merge_acc = merge_d + T::kStreams * kH;    // [kStreams][kH][kHeadDim]
  if constexpr (kScatter) {
    if (lane < kH) {  // lane h owns head h's running max and sum
      merge_m[stream * kH + lane] = m[0];
      merge_d[stream * kH + lane] = d[0];
    }
  }
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    if (!kScatter && lane == 0) {
      merge_m[stream * kH + h] = m[h];
      merge_d[stream * kH + h] = d[h];
    }
    float* row = merge_acc + (stream * kH + h) * kHeadDim + dim0;
#pragma unroll
    for (int i = 0; i < T::kVec; i += 4) {
      *reinterpret_cast<float4*>(row + i) =
          make_float4(acc[h][i], acc[h][i + 1], acc[h][i + 2], acc[h][i + 3]);
    }
  }
  __syncthreads();

  const float v_scale = (kKv == DType::kFloat8E4M3 || kKv == DType::kFloat8E5M2) ? p.v_scale : 1.f;
  // Per head: the CTA's max and sum, then each stream's weight (written over its sum).
  // (In the dynamic area: 16 bytes of static shared memory would push 4 CTAs past the 196 KB
  // carveout and cost a quarter of the occupancy.)
  float* head_lse = merge_acc + T::kStreams * kH * kHeadDim;  // [kH]
  if (tid < kH) {
    const int h = tid;
    float total_max = -INFINITY;
#pragma unroll
    for (int st = 0; st < T::kStreams; ++st) total_max = fmaxf(total_max, merge_m[st * kH + h]);
    float total_sum = 0.f;
    if (total_max != -INFINITY) {
#pragma unroll
      for (int st = 0; st < T::kStreams; ++st) {
        const float stream_max = merge_m[st * kH + h];
        total_sum +=
            stream_max == -INFINITY ? 0.f : merge_d[st * kH + h] * exp2f(stream_max - total_max);
      }
    }
    const bool empty = !(total_sum > 0.f);
#pragma unroll
    for (int st = 0; st < T::kStreams; ++st) {
      const float stream_max = merge_m[st * kH + h];
      merge_d[st * kH + h] = empty || stream_max == -INFINITY
                                 ? 0.f
                                 : exp2f(stream_max - total_max) / total_sum * v_scale;
    }
    head_lse[h] = empty ? -INFINITY : (total_max + log2f(total_sum)) * kLn2;
  }
  __syncthreads();
  if (refused) return;  // before the first write (every CTA of the grid returns here)
  for (int index = tid; index < kH * kHeadDim; index += kDecodeThreads) {
    const int h = index / kHeadDim;
    const int dim = index % kHeadDim;
    if (h >= num_heads || dim >= p.v_head_dim) continue;
    float out = 0.f;
#pragma unroll
    for (int st = 0; st < T::kStreams; ++st) {
      out = fmaf(merge_acc[(st * kH + h) * kHeadDim + dim], merge_d[st * kH + h], out);
    }
    const float lse = head_lse[h];
    const int head = head0 + h;
    if (item.partial < 0) {
      store_io(p.out, p.out_fp32 ? DType::kFloat32 : p.io_dtype,
               int64_t(request) * p.out_stride_token + int64_t(head) * p.out_stride_head + dim,
               out);
      if (dim == 0 && p.lse != nullptr) p.lse[int64_t(request) * p.num_q_heads + head] = lse;
    } else {
      const int64_t row = int64_t(item.partial) * p.num_q_heads + head;
      launch.partial_out[row * p.v_head_dim + dim] = out;
      if (dim == 0) launch.partial_lse[row] = lse;
    }
  }
}

/// Launches the kernel for one (head_dim, KV dtype) instance, or reports its facts.
template <int kHeadDim, DType kKv>
void run_decode_typed(const DecodeLaunch* launch, int device, cudaStream_t stream,
                      DecodeKernelInfo* info) {
  using T = DecodeTraits<kHeadDim, kKv>;
  auto kernel = decode_paged_kernel<kHeadDim, kKv>;
  // The shared-memory attribute is set once per device (bit `device` of the mask).
  static std::atomic<uint64_t> configured{0};
  const uint64_t bit = uint64_t(1) << (device & 63);
  if ((configured.load() & bit) == 0) {
    check_cuda(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes),
        "cudaFuncSetAttribute(decode_paged_kernel)");
    // All of the unified L1/shared storage as shared memory: 4 CTAs x 48 KB need 196 KB.
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)),
               "cudaFuncSetAttribute(decode_paged_kernel carveout)");
    configured.fetch_or(bit);
  }
  if (info != nullptr) {
    int ctas = 0;
    check_cuda(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kDecodeThreads, T::kSmemBytes),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor(decode_paged_kernel)");
    info->compiled_head_dim = kHeadDim;
    info->ctas_per_sm = ctas;
    info->tile_tokens = T::kTileTokens;
    return;
  }
  const core::AttentionParams& p = launch->params;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t ctas_per_item =
      int64_t(p.num_kv_heads) * ((group + kDecodeHeadsPerCta - 1) / kDecodeHeadsPerCta);
  const int64_t grid = int64_t(launch->grid_items) * ctas_per_item;
  if (grid == 0) return;
  check_arg(grid < (int64_t(1) << 31), "grid", grid, " CTAs exceed the launch limit");
  launch_programmatic_dependent(kernel, dim3(uint32_t(grid)), dim3(kDecodeThreads), T::kSmemBytes,
                                stream, "decode_paged_kernel", /*cluster=*/0, *launch);
}

/// All four KV dtypes of one head_dim; defined (explicitly instantiated) in decode_hd<N>.cu.
template <int kHeadDim>
void run_decode_head_dim(const DecodeLaunch* launch, DType kv_dtype, int device,
                         cudaStream_t stream, DecodeKernelInfo* info) {
  if constexpr (head_dim_compiled(kHeadDim)) {
    switch (kv_dtype) {
      case DType::kBFloat16:
        return run_decode_typed<kHeadDim, DType::kBFloat16>(launch, device, stream, info);
      case DType::kFloat16:
        return run_decode_typed<kHeadDim, DType::kFloat16>(launch, device, stream, info);
      case DType::kFloat8E4M3:
        return run_decode_typed<kHeadDim, DType::kFloat8E4M3>(launch, device, stream, info);
      case DType::kFloat8E5M2:
        return run_decode_typed<kHeadDim, DType::kFloat8E5M2>(launch, device, stream, info);
      default:
        break;
    }
    throw_error(ErrorKind::kNotSupported, "kv_dtype", dtype_name(kv_dtype),
                " is not a KV storage dtype of the decode kernel");
  } else {
    throw_error(ErrorKind::kNotSupported, "head_dim",
                "decode kernel not compiled: head_dim=", kHeadDim, " (KVATTN_CUDA_HEAD_DIMS)");
  }
}

}  // namespace kvattn::cuda::detail
