// The Hopper (sm_90a) batch prefill kernel: warp-specialised (one producer warpgroup, two
// consumer warpgroups, three at head_dim 64), wgmma for S = Q K^T (both operands in shared memory)
// and O += P V (P in registers), an mbarrier ring of K/V stages, a persistent grid. It runs every
// item of a core::PrefillTiles plan, like the mma.sync kernel (prefill_kernel.cuh) it replaces on
// sm_90: paged or ragged K/V, masks none / causal / custom, window, soft-cap, LSE, split-KV
// partials, fp32 output, fp8 K/V, v_head_dim up to head_dim (a narrow V uses the head_dim-wide
// instance).
//
// Parts: sm90/prefill_traits.cuh (shapes, shared memory), sm90/tile_scheduler.cuh (which item
// next, item geometry), sm90/prefill_mainloop.cuh (loads and products), sm90/prefill_epilogue.cuh
// (stores). Included by the instance files prefill_sm90_hd*.cu only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/prefill.h"
#include "cuda/kernels/sm90/prefill_epilogue.cuh"
#include "cuda/kernels/sm90/prefill_mainloop.cuh"
#include "cuda/kernels/sm90/prefill_traits.cuh"
#include "cuda/kernels/sm90/tile_scheduler.cuh"
#include "cuda/kernels/step_check.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda::sm90 {

template <int kHeadDim, int kHeadDimV, int kStages, typename T>
__global__ void __launch_bounds__(PrefillTraits<kHeadDim, kHeadDimV, kStages>::kThreads, 1)
    batch_prefill_sm90_kernel(const core::AttentionParams p, const core::PrefillTiles tiles,
                              const __grid_constant__ PrefillTensorMaps maps,
                              const LaunchOptions options) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // A refused step writes nothing (core/attention_params.h, step_error): every CTA returns here,
  // before any barrier or copy exists.
  if (::kvattn::cuda::detail::step_refused(p.step_error)) return;
  using Tr = PrefillTraits<kHeadDim, kHeadDimV, kStages>;
  static_assert(sizeof(PrefillTile) <= Tr::kTileInfoBytes, "a tile description fits its slot");
  extern __shared__ unsigned char smem_raw[];
  SharedBuffers<Tr> sm;
  {
    const uint32_t raw = ptx::smem_address(smem_raw);
    const uint32_t aligned = (raw + 1023u) & ~1023u;
    sm.base = aligned;
    sm.ptr = smem_raw + (aligned - raw);
  }
  if (threadIdx.x == 0) sm.init_barriers(maps.enabled != 0);
  __syncthreads();

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warpgroup = warp / 4;
  const core::FastDivmod& group = tiles.group_div;  // packed row -> token, head
  const int v_dim = p.v_head_dim;
  const StaticTileScheduler scheduler{tiles.num_items};
  const bool soft_cap = p.logit_cap > 0.f;
  // k_scale folds into the logit scale, v_scale into the output (exact: dequantisation is a
  // per-tensor product).
  const float qk_scale = p.sm_scale * p.k_scale;
  const float scale_log2 = soft_cap ? ptx::kLog2e : qk_scale * ptx::kLog2e;

  if (warpgroup == 0) {
    ptx::warpgroup_registers_release<Tr::kProducerRegisters>();
    PrefillProducer<Tr, T> producer{p,
                                    sm,
                                    maps,
                                    static_cast<int>(threadIdx.x),
                                    p.kv_indices != nullptr,
                                    is_fp8_dtype(p.kv_dtype),
                                    p.kv_dtype == DType::kFloat8E5M2,
                                    v_dim,
                                    options.diagnostic};
    uint32_t it = 0, published = 0;
    auto run_item = [&](int index) {
      const PrefillTile t = PrefillTile::load<Tr::kKvTile>(p, tiles, index);
      if (!t.has_rows()) return;  // a padding item: nothing to compute or write
      producer.publish_tile(t, group, published++);
      if (t.num_blocks > 0) producer.run_tile(t, it);
    };
    if (options.dynamic_schedule && tiles.scheduler != nullptr) {
      const DynamicTileScheduler dynamic{tiles.scheduler};
      const bool leader = threadIdx.x == 0;
      int index = dynamic.first();
      for (uint32_t taken = 0; index < tiles.num_items; ++taken) {
        // The item after this one: round 1 of the static schedule after the first, then the
        // next ticket, taken as this item starts (its round trip hides under this item's
        // loads). The CTA commits to one item ahead and no more, so the greedy choice of each
        // item is made as late as the loads allow.
        const int next =
            taken == 0 ? DynamicTileScheduler::second() : (leader ? dynamic.take() : 0);
        run_item(index);
        if (leader) *sm.next_item(taken) = next;
        ptx::named_barrier_sync(kProducerTable, 128);
        index = *sm.next_item(taken);
      }
      if (leader) dynamic.finish();
    } else {
      for (int round = 0; scheduler.more(round); ++round) {
        const int index = scheduler.item(round);
        if (index < tiles.num_items) run_item(index);
      }
    }
    PrefillTile end;
    end.request = -1;
    producer.publish_tile(end, group, published);
  } else {
    ptx::warpgroup_registers_take<Tr::kConsumerRegisters>();
    using Consumer = PrefillConsumer<Tr, T>;
    const int window = p.mask == core::MaskMode::kNone ? -1 : p.window_left;
    Consumer consumer{p,
                      sm,
                      warpgroup - 1,
                      warp % 4,
                      lane,
                      p.mask == core::MaskMode::kCausal,
                      p.mask == core::MaskMode::kCustom,
                      window,
                      soft_cap,
                      scale_log2,
                      soft_cap ? qk_scale / p.logit_cap : 0.f,
                      options.ping_pong,
                      options.diagnostic};
    // The first warpgroup starts the ping-pong.
    if (consumer.ping_pong && consumer.wg == 0) ptx::named_barrier_arrive(kScheduleFirst, 256);
    const int rows[2] = {consumer.tile_row(0), consumer.tile_row(1)};
    // A 16-bit output whose rows are 16-byte vectors is written 16 bytes a store: staged
    // through the tile's Q buffer (whole rows a store) where there are two buffers, else from
    // registers after a quad transpose (store_tile_rows).
    const bool vec16_output = !p.out_fp32 && v_dim % 8 == 0 &&
                              (reinterpret_cast<uintptr_t>(p.out) & 15u) == 0 &&
                              p.out_stride_token % 8 == 0 && p.out_stride_head % 8 == 0;
    const bool staged_output = Tr::kQBuffers == 2 && vec16_output;
    using QRing = RingPosition<Tr::kQBuffers>;
    uint32_t it = 0;
    float o[Consumer::kOutRegs];
#if defined(KVATTN_SM90_TRACE)
    // Thread 0 of each consumer warpgroup stamps its tiles' phases (TraceSlot).
    unsigned long long* const trace =
        options.trace != nullptr && threadIdx.x % 128 == 0
            ? options.trace +
                  (size_t(blockIdx.x) * kTraceWarpgroups + consumer.wg) * kTraceTiles * kTraceSlots
            : nullptr;
#else
    constexpr unsigned long long* trace = nullptr;  // every stamp below folds away
#endif
    for (uint32_t taken = 0;; ++taken) {
      const QRing at = QRing::of(taken);
      unsigned long long* const tile_trace =
          trace != nullptr && taken < kTraceTiles ? trace + taken * kTraceSlots : nullptr;
      stamp(tile_trace, kTraceTileStart);
      ptx::mbarrier_wait(sm.q_full(at.stage), at.phase);
      const PrefillTile t = *sm.tile_info(at.stage);
      if (t.request < 0) break;  // the producer's end of work
      stamp(tile_trace, kTraceQArrived);
      if (tile_trace != nullptr) tile_trace[kTraceBlocks] = t.num_blocks;
      const bool staged = staged_output && t.partial < 0;
      RowPairSoftmax softmax;
      if (t.num_blocks > 0) {
        consumer.run_tile(t, group.divisor, o, softmax, it, at.stage, !staged, tile_trace);
      } else {
#pragma unroll
        for (int i = 0; i < Consumer::kOutRegs; ++i) o[i] = 0.f;
      }
      if constexpr (Tr::kQBuffers == 2) {
        if (staged) {
          store_tile_rows_staged<Tr, T>(p, t, group, v_dim, rows, consumer.wg * 64 + consumer.warp * 16,
                                        lane, o, softmax, scale_log2,
                                        sm.ptr + Tr::kQOffset + at.stage * Tr::kQBytes);
          consumer.release_q(at.stage);
          stamp(tile_trace, kTraceStored);
          continue;
        }
      }
      if (t.num_blocks == 0) consumer.release_q(at.stage);  // no S read the buffer
      store_tile_rows<T>(p, tiles, t, group, v_dim, rows, lane, o, softmax, scale_log2,
                         vec16_output);
      stamp(tile_trace, kTraceStored);
    }
  }
#else
  __trap();  // built without sm_90a: the host never selects this kernel then
#endif
}

/// Host side: the tensor maps of ragged K and V (io dtype, 16-byte aligned rows), or disabled
/// maps when the call is paged, fp8, or not expressible (the kernel then copies row by row).
PrefillTensorMaps make_ragged_tensor_maps(const core::AttentionParams& p, int kv_tile);

/// Host side of one instance: shared-memory opt-in (once per device) and the persistent launch.
template <int kHeadDim, int kHeadDimV, int kStages, typename T>
void launch_instance(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                     const PrefillTensorMaps& maps, const LaunchOptions& options,
                     cudaStream_t stream) {
  using Tr = PrefillTraits<kHeadDim, kHeadDimV, kStages>;
  auto kernel = batch_prefill_sm90_kernel<kHeadDim, kHeadDimV, kStages, T>;
  static std::atomic<uint64_t> devices_ready{0};
  int device = 0;
  const cudaError_t got = cudaGetDevice(&device);
  const uint64_t bit = (got == cudaSuccess && device < 64) ? (uint64_t{1} << device) : 0;
  if (bit == 0 || (devices_ready.load(std::memory_order_acquire) & bit) == 0) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    Tr::kSmemAllocBytes),
               "batch_prefill_sm90: cudaFuncSetAttribute");
    devices_ready.fetch_or(bit, std::memory_order_release);
  }
  const int grid = std::min(tiles.num_items, std::max(options.max_ctas, 1));
  kernel<<<grid, Tr::kThreads, Tr::kSmemAllocBytes, stream>>>(p, tiles, maps, options);
  check_launch("batch_prefill_sm90");
}

/// The instance of a call: the io dtype, and the ring depth: two stages (at head_dim <= 128 with
/// two Q buffers: the next tile's Q lands during this one, the output is staged through Q), the
/// deeper ring only when LaunchOptions::stages asks for it (A/B runs).
template <int kHeadDim, int kHeadDimV>
void launch_for_dtype(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                      const LaunchOptions& options, cudaStream_t stream) {
  constexpr int kDeep = max_prefill_stages(kHeadDim);
  constexpr int kKvTile = PrefillTraits<kHeadDim, kHeadDimV>::kKvTile;
  // Two stages also for the tensor-map path: at head_dim 128 they take 1 x 16384 in 2.6% fewer
  // cycles than three stages with one Q buffer (bench/NOTES.md, seventeenth session; the row
  // copies measured faster with two since v5).
  const PrefillTensorMaps maps = make_ragged_tensor_maps(p, kKvTile);
  const int stages = options.stages > 0 ? options.stages : 2;
  const bool deep = stages >= 3 && kDeep >= 3;
  auto launch = [&]<int kStages>() {
    if (p.io_dtype == DType::kBFloat16) {
      launch_instance<kHeadDim, kHeadDimV, kStages, __nv_bfloat16>(p, tiles, maps, options, stream);
    } else {
      launch_instance<kHeadDim, kHeadDimV, kStages, __half>(p, tiles, maps, options, stream);
    }
  };
  if constexpr (kDeep >= 3) {
    if (deep) {
      launch.template operator()<kDeep>();
      return;
    }
  }
  launch.template operator()<2>();
}

// One per instance file (prefill_sm90_hd<D>.cu).
void launch_prefill_sm90_hd64(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                              const LaunchOptions& options, cudaStream_t stream);
void launch_prefill_sm90_hd128(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                               const LaunchOptions& options, cudaStream_t stream);
void launch_prefill_sm90_hd192(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                               const LaunchOptions& options, cudaStream_t stream);
void launch_prefill_sm90_hd256(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                               const LaunchOptions& options, cudaStream_t stream);

}  // namespace kvattn::cuda::sm90
