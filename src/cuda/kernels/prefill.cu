// Dispatch of the batch prefill (validation, head_dim -> instance file) and the merge of split
// tiles.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/softmax_state.h"
#include "cuda/cuda_util.h"
#include "cuda/kernels/prefill.h"
#include "cuda/kernels/prefill_kernel.cuh"
#include "cuda/kernels/sm90/prefill_kernel.cuh"
#include "cuda/kernels/split_merge.cuh"
#include "cuda/kernels/tc_decode_kernel.cuh"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

constexpr int kMergeThreads = 128;

/// Rows of a split tile one merge CTA folds: a warp a row.
constexpr int kMergeRowsPerCta = kMergeThreads / 32;

/// Grid (merges, tile_rows / kMergeRowsPerCta): warp w folds row blockIdx.y * 4 + w of a split
/// tile (detail::merge_split_row).
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    prefill_merge_kernel(const core::AttentionParams p, const core::PrefillTiles tiles) {
  // A no-op unless launched as a programmatic dependent (launch_merge): then it waits for the
  // attention grid that wrote the partials.
  ptx::grid_dependency_wait();
  if (detail::step_refused(p.step_error)) return;
  const int r = int(blockIdx.y) * kMergeRowsPerCta + (threadIdx.x >> 5);
  detail::merge_split_row<T>(p, tiles, tiles.merges[blockIdx.x], r, threadIdx.x & 31);
}

/// The split-KV merge of a plan's split tiles (nothing when it has none). programmatic: launched
/// as a programmatic dependent of the attention grid before it (which must let it launch).
void launch_merge(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                  cudaStream_t stream, bool programmatic = false) {
  if (tiles.num_merges == 0) return;
  const dim3 grid(uint32_t(tiles.num_merges),
                  uint32_t((tiles.tile_rows + kMergeRowsPerCta - 1) / kMergeRowsPerCta));
  if (p.io_dtype == DType::kBFloat16) {
    if (programmatic) {
      detail::launch_programmatic_dependent(prefill_merge_kernel<__nv_bfloat16>, grid,
                                            dim3(kMergeThreads), 0, stream, "prefill_merge",
                                            /*cluster=*/0, p, tiles);
      return;
    }
    prefill_merge_kernel<__nv_bfloat16><<<grid, kMergeThreads, 0, stream>>>(p, tiles);
  } else {
    if (programmatic) {
      detail::launch_programmatic_dependent(prefill_merge_kernel<__half>, grid, dim3(kMergeThreads),
                                            0, stream, "prefill_merge", /*cluster=*/0, p, tiles);
      return;
    }
    prefill_merge_kernel<__half><<<grid, kMergeThreads, 0, stream>>>(p, tiles);
  }
  check_launch("prefill_merge");
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// Checks the call against the kernel shape its plan must come from: `family` kTcDecode is the
// decode-shaped kernel, anything else the prefill family of the device.
PrefillKernelShape validate(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                            int device, bool tc_decode) {
  if (p.io_dtype != DType::kBFloat16 && p.io_dtype != DType::kFloat16) {
    throw_error(ErrorKind::kNotSupported, "io_dtype", "prefill supports bf16 and fp16, got ",
                dtype_name(p.io_dtype));
  }
  if (p.kv_dtype != p.io_dtype && !is_fp8_dtype(p.kv_dtype)) {
    throw_error(ErrorKind::kNotSupported, "kv_dtype", "prefill supports KV in the io dtype (",
                dtype_name(p.io_dtype), ") or fp8, got ", dtype_name(p.kv_dtype));
  }
  // Throws kNotSupported for a head_dim / v_head_dim pair without a compiled instance.
  const PrefillKernelShape shape = tc_decode
                                       ? tc_decode_kernel_shape(p.head_dim, p.v_head_dim, device)
                                       : prefill_kernel_shape(p.head_dim, p.v_head_dim, device);
  check_arg(p.num_kv_heads > 0 && p.num_q_heads % p.num_kv_heads == 0, "num_q_heads", "got ",
            p.num_q_heads, " q heads over ", p.num_kv_heads, " kv heads");
  const int group = p.num_q_heads / p.num_kv_heads;
  check_arg(tiles.group_size == group, "tiles.group_size", "got ", tiles.group_size,
            ", the call's GQA group is ", group);
  // The kernels divide packed rows by group_div (write_prefill_buffer builds it from the same
  // group): a view built otherwise must carry both.
  check_arg(tiles.group_div.divisor == group, "tiles.group_div", "got a divisor of ",
            tiles.group_div.divisor, ", the call's GQA group is ", group);
  check_arg(tiles.tile_rows == shape.tile_rows ||
                (shape.narrow_tile_rows > 0 && tiles.tile_rows == shape.narrow_tile_rows) ||
                (shape.transposed_tile_rows > 0 && tiles.tile_rows == shape.transposed_tile_rows),
            "tiles.tile_rows", "got ", tiles.tile_rows, ", the head_dim ", p.head_dim,
            " kernel needs ", shape.tile_rows,
            shape.narrow_tile_rows > 0 ? " (or its narrow instance's " : "",
            shape.narrow_tile_rows > 0 ? std::to_string(shape.narrow_tile_rows) + ")" : "",
            shape.transposed_tile_rows > 0 ? " (or its transposed instance's " : "",
            shape.transposed_tile_rows > 0 ? std::to_string(shape.transposed_tile_rows) + ")" : "");
  check_arg(
      tiles.num_partials == 0 || (tiles.partial_out != nullptr && tiles.partial_lse != nullptr),
      "tiles.partial_out", "split tiles need partial buffers");
  if (p.mask == core::MaskMode::kCustom) {
    check_arg(p.custom_mask != nullptr && p.mask_indptr != nullptr, "custom_mask",
              "mask kCustom needs custom_mask and mask_indptr");
  }
  // The kernel's online softmax assumes logits grow with q.k (a positive scale).
  check_arg(p.sm_scale > 0.f && p.k_scale > 0.f, "sm_scale", "sm_scale ", p.sm_scale,
            " and k_scale ", p.k_scale, " must be positive");
  check_arg(p.qo_indptr != nullptr && p.kv_indptr != nullptr, "qo_indptr",
            "qo_indptr and kv_indptr are required");
  // The kernels address a K/V row as a 32-bit row (a slot or a key) times a 32-bit pitch in
  // bytes (one wide multiply-add a copy).
  const int64_t kv_bytes = dtype_size(p.kv_dtype);
  check_arg(p.k_stride_token >= 0 && p.v_stride_token >= 0 &&
                p.k_stride_token * kv_bytes <= int64_t{UINT32_MAX} &&
                p.v_stride_token * kv_bytes <= int64_t{UINT32_MAX},
            "k_stride_token", "got k/v token strides ", p.k_stride_token, "/", p.v_stride_token,
            " elements of ", kv_bytes, " bytes, expected a row pitch below 4 GiB");
  // 16-byte copies: rows must start on 16-byte boundaries.
  const int kv_vec = static_cast<int>(16 / kv_bytes);
  const bool rows_aligned = aligned16(p.q) && aligned16(p.out) && aligned16(p.k) &&
                            aligned16(p.v) && p.q_stride_token % 8 == 0 &&
                            p.q_stride_head % 8 == 0 && p.out_stride_token % 8 == 0 &&
                            p.out_stride_head % 8 == 0 && p.k_stride_token % kv_vec == 0 &&
                            p.k_stride_head % kv_vec == 0 && p.v_stride_token % kv_vec == 0 &&
                            p.v_stride_head % kv_vec == 0;
  if (!rows_aligned) {
    throw_error(ErrorKind::kNotSupported, "q/k/v/out",
                "prefill needs 16-byte aligned pointers and row strides (q strides ",
                p.q_stride_token, "/", p.q_stride_head, ", k strides ", p.k_stride_token, "/",
                p.k_stride_head, ", v strides ", p.v_stride_token, "/", p.v_stride_head,
                ", out strides ", p.out_stride_token, "/", p.out_stride_head, ")");
  }
  return shape;
}

/// sm_90a kernels in this build (CMake defines KVATTN_SM90A_KERNELS when the gencode list holds
/// sm_90a; a plain sm_90 build has none: wgmma and setmaxnreg need the "a" target).
constexpr bool kHaveSm90Kernels =
#if defined(KVATTN_SM90A_KERNELS)
    true;
#else
    false;
#endif

/// KVATTN_PREFILL_KERNEL, read once: 0 auto, 1 mma, 2 sm90.
int forced_family() {
  static const int forced = [] {
    const char* env = std::getenv("KVATTN_PREFILL_KERNEL");
    if (env == nullptr || *env == 0 || std::strcmp(env, "auto") == 0) return 0;
    if (std::strcmp(env, "mma") == 0) return 1;
    if (std::strcmp(env, "sm90") == 0) return 2;
    throw_error(ErrorKind::kInvalidArgument, "KVATTN_PREFILL_KERNEL", "got '", env,
                "', expected auto, mma or sm90");
  }();
  return forced;
}

bool mma_serves(int head_dim, int v_head_dim) {
  return (v_head_dim == head_dim && (head_dim == 64 || head_dim == 128 || head_dim == 256)) ||
         (head_dim == 128 && v_head_dim > 0 && v_head_dim < head_dim && v_head_dim % 16 == 0);
}

bool sm90_serves(int head_dim, int v_head_dim) {
  return mma_serves(head_dim, v_head_dim) || (head_dim == 192 && v_head_dim == 128);
}

/// The Hopper instance of a pair: narrow V (head_dim 128) runs the 128 / 128 instance.
template <int kHeadDim, int kHeadDimV>
PrefillKernelShape sm90_shape() {
  using Tr = sm90::PrefillTraits<kHeadDim, kHeadDimV>;  // tile shape: the same at every depth
  PrefillKernelShape shape;
  shape.tile_rows = Tr::kTileRows;
  shape.kv_tile = Tr::kKvTile;
  shape.ctas_per_sm = 1;
  shape.family = PrefillKernelFamily::kSm90;
  return shape;
}

#if defined(KVATTN_SM90_TRACE)
namespace {

// Time attribution of the Hopper prefill kernel (a build with KVATTN_SM90_TRACE defined, and
// KVATTN_SM90_TRACE=1 at run time): each consumer warpgroup stamps its tiles' phases
// (sm90::TraceSlot, %globaltimer ns) into one device buffer that every launch overwrites; at exit
// the last launch's stamps are summarised on stderr: per phase, its time summed over a warpgroup's
// tiles (mean over warpgroups), the same per tile, the loop's time per block, and when the
// warpgroups ended (the schedule's tail).
struct Sm90Trace {
  static constexpr int kMaxCtas = 1024;
  static constexpr size_t kWords =
      size_t(kMaxCtas) * sm90::kTraceWarpgroups * sm90::kTraceTiles * sm90::kTraceSlots;
  unsigned long long* buffer = nullptr;
};

void print_sm90_trace(const Sm90Trace& t) {
  std::vector<unsigned long long> h(Sm90Trace::kWords);
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(h.data(), t.buffer, h.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) {
    std::fprintf(stderr, "sm90 trace: could not read the stamps back\n");
    return;
  }
  // The stamps of tile i in trace record g (record g: CTA g / kTraceWarpgroups, warpgroup
  // g % kTraceWarpgroups).
  auto tile_stamps = [&h](int g, int i) {
    return h.data() + (size_t(g) * sm90::kTraceTiles + size_t(i)) * sm90::kTraceSlots;
  };
  // Sums over tiles of each phase (ns), per warpgroup then averaged; the launch's first start
  // and the spread of the warpgroups' ends (the tail of the static schedule).
  double sums[4] = {0, 0, 0, 0}, gap = 0, tiles = 0, blocks = 0, q_max = 0;
  double first_k = 0, first_s = 0;  // the first block's K wait and S (the rest is its softmax)
  double k_wait = 0, v_wait = 0;    // the loop's waits for K and V to arrive
  double span_sum = 0, span_min = 1e30, span_max = 0;
  unsigned long long launch = ~0ull, end_min = ~0ull, end_max = 0;
  int groups = 0;
  for (int g = 0; g < Sm90Trace::kMaxCtas * sm90::kTraceWarpgroups; ++g) {
    const unsigned long long* w = tile_stamps(g, 0);
    if (w[sm90::kTraceStored] == 0) continue;
    ++groups;
    const unsigned long long first = w[sm90::kTraceTileStart];
    unsigned long long last = first;
    for (int i = 0; i < sm90::kTraceTiles; ++i) {
      const unsigned long long* s = w + i * sm90::kTraceSlots;
      if (s[sm90::kTraceStored] < s[sm90::kTraceTileStart] || s[sm90::kTraceStored] == 0) break;
      const bool computed = s[sm90::kTraceBlocks] > 0;
      // Phase k runs from stamp k to stamp k + 1 (TraceSlot's order).
      const double q = double(s[sm90::kTraceQArrived] - s[sm90::kTraceTileStart]);
      sums[0] += q;
      q_max = std::max(q_max, q);
      if (computed) {
        for (int k = 1; k < 4; ++k) sums[k] += double(s[k + 1] - s[k]);
        first_k += double(s[sm90::kTraceFirstK] - s[sm90::kTraceQArrived]);
        first_s += double(s[sm90::kTraceFirstS] - s[sm90::kTraceFirstK]);
        k_wait += double(s[sm90::kTraceKWait]);
        v_wait += double(s[sm90::kTraceVWait]);
      }
      if (i > 0) gap += double(s[0] - w[(i - 1) * sm90::kTraceSlots + sm90::kTraceStored]);
      tiles += 1;
      blocks += double(s[sm90::kTraceBlocks]);
      last = s[sm90::kTraceStored];
    }
    const double span = double(last - first);
    span_sum += span;
    span_min = std::min(span_min, span);
    span_max = std::max(span_max, span);
    launch = std::min(launch, first);
    end_min = std::min(end_min, last);
    end_max = std::max(end_max, last);
  }
  if (groups == 0 || tiles == 0) {
    std::fprintf(stderr, "sm90 trace: no stamps\n");
    return;
  }
  // One steady-state block a long tile (%clock64 cycles): its phases, and how far apart the
  // CTA's two first consumer warpgroups issue the same block (0: in lockstep; half a block:
  // alternating).
  double bphase[5] = {0, 0, 0, 0, 0}, bcycle = 0, bcount = 0, skew = 0, skew_n = 0;
  double skew_hist[4] = {0, 0, 0, 0};
  for (int c = 0; c < Sm90Trace::kMaxCtas; ++c) {
    for (int i = 0; i < sm90::kTraceTiles; ++i) {
      const unsigned long long* st[2];
      bool ok[2];
      for (int w = 0; w < 2; ++w) {
        st[w] = tile_stamps(c * sm90::kTraceWarpgroups + w, i);
        const unsigned long long* s = st[w];
        ok[w] = s[sm90::kTraceBlockTop] != 0 && s[sm90::kTraceBlockNext] > s[sm90::kTraceBlockTop];
        for (int k = sm90::kTraceBlockTop; ok[w] && k < sm90::kTraceBlockNext; ++k) {
          ok[w] = s[k + 1] >= s[k];
        }
        if (!ok[w]) continue;
        for (int k = 0; k < 5; ++k) {
          bphase[k] += double(s[sm90::kTraceBlockTop + k + 1] - s[sm90::kTraceBlockTop + k]);
        }
        bcycle += double(s[sm90::kTraceBlockNext] - s[sm90::kTraceBlockTop]);
        bcount += 1;
      }
      if (ok[0] && ok[1]) {
        const double cyc = 0.5 * double(st[0][sm90::kTraceBlockNext] - st[0][sm90::kTraceBlockTop] +
                                        st[1][sm90::kTraceBlockNext] - st[1][sm90::kTraceBlockTop]);
        const double d = std::fabs(double(st[1][sm90::kTraceBlockIssued]) -
                                   double(st[0][sm90::kTraceBlockIssued]));
        skew += d;
        skew_n += 1;
        skew_hist[std::min(3, static_cast<int>(4.0 * std::fmod(d, cyc) / cyc))] += 1;
      }
    }
  }
  if (bcount > 0) {
    const double n = 1.0 / bcount;
    std::fprintf(stderr,
                 "sm90 trace, one steady-state block (step %d) of %.0f tiles, cycles: K wait + "
                 "issue %.0f, S done %.0f, softmax %.0f, P V done %.0f, to the next top %.0f; "
                 "a block %.0f. Warpgroups 0 / 1 issue %.0f cycles apart (%.0f pairs; apart by "
                 "[0, 1/4) / [1/4, 1/2) / [1/2, 3/4) / [3/4, 1) of a block: %.0f / %.0f / %.0f / "
                 "%.0f)\n",
                 sm90::kTraceBlockStep, bcount, bphase[0] * n, bphase[1] * n, bphase[2] * n,
                 bphase[3] * n, bphase[4] * n, bcycle * n, skew / std::max(1.0, skew_n), skew_n,
                 skew_hist[0], skew_hist[1], skew_hist[2], skew_hist[3]);
  }
  const double per = 1.0 / groups, us = 1e-3;
  std::fprintf(stderr,
               "sm90 trace: %d warpgroups, %.1f tiles and %.1f blocks each; us a warpgroup (per "
               "tile): span %.1f (min %.1f, max %.1f), Q wait %.1f (%.3f, max %.2f), first block "
               "%.1f (%.3f: K wait %.3f, S %.3f, softmax %.3f), loop %.1f (%.3f; %.3f a later "
               "block, of which waiting for K %.3f and V %.3f), output %.1f (%.3f), between "
               "tiles %.1f; ends %.1f..%.1f after the first start\n",
               groups, tiles * per, blocks * per, span_sum * per * us, span_min * us, span_max * us,
               sums[0] * per * us, sums[0] / tiles * us, q_max * us, sums[1] * per * us,
               sums[1] / tiles * us, first_k / tiles * us, first_s / tiles * us,
               (sums[1] - first_k - first_s) / tiles * us, sums[2] * per * us, sums[2] / tiles * us,
               sums[2] / std::max(1.0, blocks - tiles) * us,
               k_wait / std::max(1.0, blocks - tiles) * us, v_wait / std::max(1.0, blocks) * us,
               sums[3] * per * us, sums[3] / tiles * us, gap * per * us,
               double(end_min - launch) * us, double(end_max - launch) * us);
}

Sm90Trace* sm90_trace() {
  static Sm90Trace* trace = []() -> Sm90Trace* {
    const char* v = std::getenv("KVATTN_SM90_TRACE");
    if (v == nullptr || std::atoi(v) == 0) return nullptr;
    auto* t = new Sm90Trace;
    check_cuda(cudaMalloc(&t->buffer, Sm90Trace::kWords * 8), "cudaMalloc(sm90 trace)");
    check_cuda(cudaMemset(t->buffer, 0, Sm90Trace::kWords * 8), "cudaMemset(sm90 trace)");
    std::atexit([] { print_sm90_trace(*sm90_trace()); });
    return t;
  }();
  return trace;
}

}  // namespace
#endif

/// The Hopper kernel's launch options for a call at `head_dim`: a persistent grid of one CTA per
/// SM, the dynamic tile schedule, ping-pong of the consumer warpgroups at head_dim 64 only,
/// unless KVATTN_SM90_CTAS / KVATTN_SM90_SCHEDULE / KVATTN_SM90_PINGPONG (A/B runs) say
/// otherwise (read once).
sm90::LaunchOptions sm90_options(int sm_count, int head_dim) {
  static const int ctas = env_int("KVATTN_SM90_CTAS", 0);
  static const int ping_pong = env_int("KVATTN_SM90_PINGPONG", -1, 0);  // -1: the default
  static const int diagnostic = env_int("KVATTN_SM90_DIAG", 0, 0);
  static const int stages = env_int("KVATTN_SM90_STAGES", 0, 0);
  static const bool dynamic_schedule = [] {
    const char* v = std::getenv("KVATTN_SM90_SCHEDULE");
    if (v == nullptr || *v == 0) return true;  // measured faster (bench/NOTES.md, eleventh session)
    const std::string s(v);
    check_arg(s == "static" || s == "dynamic", "KVATTN_SM90_SCHEDULE", "got '", s,
              "', expected static or dynamic");
    return s == "dynamic";
  }();
  check_arg(diagnostic == 0 || sm90::kDiagnosticsBuilt, "KVATTN_SM90_DIAG", "got ", diagnostic,
            ", expected 0: honoured by trace builds only (-DKVATTN_SM90_TRACE=ON)");
  sm90::LaunchOptions options;
  options.dynamic_schedule = dynamic_schedule;
  options.diagnostic = diagnostic;
  options.stages = stages;
  options.max_ctas = ctas > 0 ? ctas : sm_count;
  // Ping-pong by default where it measured faster: head_dim 64, three consumer warpgroups
  // (-2.6% cycles at 1 x 4096; bench/NOTES.md, eighteenth session); off above (no gain at
  // head_dim 128, +2.3% on its paged rows).
  options.ping_pong = ping_pong < 0 ? head_dim <= 64 : ping_pong != 0;
#if defined(KVATTN_SM90_TRACE)
  const Sm90Trace* trace = sm90_trace();
  options.trace = trace != nullptr ? trace->buffer : nullptr;
  if (options.trace != nullptr) options.max_ctas = std::min(options.max_ctas, Sm90Trace::kMaxCtas);
#endif
  return options;
}

/// The current device, or -1 when the machine has none (host-only callers, CI).
int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error of a machine without a GPU
    return -1;
  }
  return device;
}

}  // namespace

namespace sm90 {
namespace {

/// cuTensorMapEncodeTiled from the driver (through the runtime, so nothing links libcuda);
/// null when the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

/// A [rows, heads, cols] 16-bit tensor with a [kv_tile, 1, 64] box in the 128-byte swizzle.
bool encode_rows(CUtensorMap* map, const void* base, DType dtype, int64_t rows, int heads, int cols,
                 int64_t stride_token, int64_t stride_head, int kv_tile) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(stride_head) * 2, cuuint64_t(stride_token) * 2};
  const cuuint32_t box[3] = {64, 1, cuuint32_t(kv_tile)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status =
      encode(map,
             dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
             3, const_cast<void*>(base), dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return status == CUDA_SUCCESS;
}

}  // namespace

PrefillTensorMaps make_ragged_tensor_maps(const core::AttentionParams& p, int kv_tile) {
  static const bool allowed = env_int("KVATTN_SM90_TMA", 1, 0) != 0;  // A/B: 0 copies rows
  PrefillTensorMaps maps{};
  const bool ragged_16bit = p.kv_indices == nullptr && !is_fp8_dtype(p.kv_dtype) &&
                            p.num_slots > 0 && p.num_slots < (int64_t(1) << 31);
  // Strides a tensor map takes: multiples of 16 bytes below 2^40 (rows are 16-byte aligned
  // already, see validate()).
  const auto stride_ok = [](int64_t elements) {
    return elements > 0 && (elements * 2) % 16 == 0 && elements * 2 < (int64_t(1) << 40);
  };
  if (!allowed || !ragged_16bit || !stride_ok(p.k_stride_token) || !stride_ok(p.k_stride_head) ||
      !stride_ok(p.v_stride_token) || !stride_ok(p.v_stride_head)) {
    return maps;
  }
  const bool encoded = encode_rows(&maps.k, p.k, p.kv_dtype, p.num_slots, p.num_kv_heads,
                                   p.head_dim, p.k_stride_token, p.k_stride_head, kv_tile) &&
                       encode_rows(&maps.v, p.v, p.kv_dtype, p.num_slots, p.num_kv_heads,
                                   p.v_head_dim, p.v_stride_token, p.v_stride_head, kv_tile);
  maps.enabled = encoded ? 1 : 0;
  return maps;
}

}  // namespace sm90

PrefillKernelFamily prefill_kernel_family(int head_dim, int v_head_dim, int device) {
  const int forced = forced_family();
  if (forced == 1) return PrefillKernelFamily::kMmaSync;
  if (device < 0) device = current_device();
  const bool hopper = kHaveSm90Kernels && device >= 0 && device_info(device).compute_major == 9;
  if (forced == 2) {
    if (!hopper) {
      throw_error(ErrorKind::kNotSupported, "KVATTN_PREFILL_KERNEL",
                  "sm90 needs a compute capability 9.0 device and a build with sm_90a code");
    }
    return PrefillKernelFamily::kSm90;
  }
  return hopper && sm90_serves(head_dim, v_head_dim) ? PrefillKernelFamily::kSm90
                                                     : PrefillKernelFamily::kMmaSync;
}

bool prefill_v_head_dim_supported(int head_dim, int v_head_dim) {
  return sm90_serves(head_dim, v_head_dim);
}

namespace {

/// PrefillKernelShape::l2_keys: the L2 over a key's K and V bytes (the planner keeps the K/V a
/// wave of CTAs reads within a third of it, room for Q, the output and the other partition).
int64_t l2_keys(int head_dim, int v_head_dim, int device) {
  static const int forced = env_int("KVATTN_PREFILL_L2_KEYS", -1, -1);
  if (forced >= 0) return forced;
  if (device < 0) device = current_device();
  if (device < 0) return 0;
  const int64_t l2 = device_info(device).l2_bytes;
  return l2 / (int64_t(head_dim + v_head_dim) * 2);
}

/// prefill_kernel_shape without l2_keys: the family's tile shape.
PrefillKernelShape shape_for_family(int head_dim, int v_head_dim, int device) {
  using namespace prefill_detail;
  const PrefillKernelFamily family = prefill_kernel_family(head_dim, v_head_dim, device);
  const bool served = family == PrefillKernelFamily::kSm90 ? sm90_serves(head_dim, v_head_dim)
                                                           : mma_serves(head_dim, v_head_dim);
  if (!served) {
    throw_error(ErrorKind::kNotSupported, "v_head_dim",
                "prefill supports v_head_dim == head_dim (64, 128, 256), head_dim 128 with "
                "v_head_dim a multiple of 16 below 128, or (on sm_90) head_dim 192 with "
                "v_head_dim 128; got head_dim ",
                head_dim, ", v_head_dim ", v_head_dim);
  }
  if (!head_dim_compiled(head_dim)) {
    throw_error(ErrorKind::kNotSupported, "head_dim", "not compiled: head_dim=", head_dim,
                " (KVATTN_CUDA_HEAD_DIMS)");
  }
  if (family == PrefillKernelFamily::kSm90) {
    switch (head_dim) {
      case 64:
        return sm90_shape<64, 64>();
      case 128:
        return sm90_shape<128, 128>();
      case 192:
        return sm90_shape<192, 128>();
      default:
        return sm90_shape<256, 256>();
    }
  }
  switch (head_dim) {
    case 64:
      return shape_of<64>();
    case 128:
      return shape_of<128>();
    default:
      return shape_of<256>();
  }
}

}  // namespace

PrefillKernelShape prefill_kernel_shape(int head_dim, int v_head_dim, int device) {
  PrefillKernelShape shape = shape_for_family(head_dim, v_head_dim, device);
  shape.l2_keys = l2_keys(head_dim, v_head_dim, device);
  return shape;
}

PrefillKernelShape prefill_kernel_shape(int head_dim) {
  return prefill_kernel_shape(head_dim, head_dim);
}

void launch_batch_prefill(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                          cudaStream_t stream) {
  const int device = current_device();
  if (device < 0) {
    throw_error(ErrorKind::kDeviceError, "batch_prefill", "no CUDA device is available");
  }
  const PrefillKernelShape shape = validate(p, tiles, device, /*tc_decode=*/false);
  if (tiles.num_items == 0) return;
  if (shape.family == PrefillKernelFamily::kSm90) {
    const sm90::LaunchOptions options = sm90_options(device_info(device).sm_count, p.head_dim);
    switch (p.head_dim) {
      case 64:
        sm90::launch_prefill_sm90_hd64(p, tiles, options, stream);
        break;
      case 128:
        sm90::launch_prefill_sm90_hd128(p, tiles, options, stream);
        break;
      case 192:
        sm90::launch_prefill_sm90_hd192(p, tiles, options, stream);
        break;
      default:
        sm90::launch_prefill_sm90_hd256(p, tiles, options, stream);
        break;
    }
  } else {
    switch (p.head_dim) {
      case 64:
        prefill_detail::launch_prefill_hd64(p, tiles, stream);
        break;
      case 128:
        if (p.v_head_dim == 128) {
          prefill_detail::launch_prefill_hd128(p, tiles, stream);
        } else {
          prefill_detail::launch_prefill_hd128_narrow_v(p, tiles, stream);
        }
        break;
      default:
        prefill_detail::launch_prefill_hd256(p, tiles, stream);
        break;
    }
  }
  launch_merge(p, tiles, stream);
}

bool tc_decode_serves(int head_dim, int v_head_dim) {
  return v_head_dim == head_dim && (head_dim == 64 || head_dim == 128);
}

namespace {

enum class TcDecodeMerge { kCluster, kGrid, kKernel };

/// KVATTN_TC_DECODE_MERGE, read once: cluster (default), grid or kernel.
TcDecodeMerge tc_decode_merge_mode() {
  static const TcDecodeMerge mode = [] {
    const char* v = std::getenv("KVATTN_TC_DECODE_MERGE");
    if (v != nullptr && std::strcmp(v, "kernel") == 0) return TcDecodeMerge::kKernel;
    if (v != nullptr && std::strcmp(v, "grid") == 0) return TcDecodeMerge::kGrid;
    return TcDecodeMerge::kCluster;
  }();
  return mode;
}

}  // namespace

PrefillKernelShape tc_decode_kernel_shape(int head_dim, int v_head_dim, int device) {
  if (!tc_decode_serves(head_dim, v_head_dim)) {
    throw_error(ErrorKind::kNotSupported, "head_dim",
                "the decode-shaped kernel serves head_dim == v_head_dim in {64, 128}; got "
                "head_dim ",
                head_dim, ", v_head_dim ", v_head_dim);
  }
  if (device < 0) device = current_device();
  // Computed once per (device, head_dim): an occupancy query per call would cost host time.
  static std::mutex mutex;
  static PrefillKernelShape known[64][2];
  const int slot = head_dim == 64 ? 0 : 1;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= 0 && device < 64 && known[device][slot].tile_rows > 0) return known[device][slot];
  int previous = -1;
  const bool switch_device =
      device >= 0 && cudaGetDevice(&previous) == cudaSuccess && previous != device;
  if (switch_device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  PrefillKernelShape shape =
      head_dim == 64 ? tc_decode::tc_decode_shape_hd64() : tc_decode::tc_decode_shape_hd128();
  if (tc_decode_merge_mode() != TcDecodeMerge::kCluster) shape.max_cluster = 0;
  if (switch_device) check_cuda(cudaSetDevice(previous), "cudaSetDevice");
  if (device >= 0 && device < 64) known[device][slot] = shape;
  return shape;
}

#if defined(KVATTN_TC_DECODE_TRACE)
bool tc_decode::trace_requested() {
  const char* v = std::getenv("KVATTN_TC_DECODE_TRACE");
  return v != nullptr && std::atoi(v) != 0;
}

namespace {

// Time attribution of the decode-shaped kernel (a build with KVATTN_TC_DECODE_TRACE defined, and
// KVATTN_TC_DECODE_TRACE=1 at run time): each launch's CTAs stamp their phases
// (tc_decode::TraceSlot) into one of two halves of a device buffer, by launch parity, so the last
// two launches (of a captured graph's too) are kept. At exit each half is printed to stderr: per
// phase, when the CTAs reached it in us after the launch's first CTA ran (median and max over
// CTAs), and the time from one launch's last exit to the other's release.
struct TcDecodeTrace {
  static constexpr int kMaxCtas = 4096;
  static constexpr size_t kHalf = size_t(kMaxCtas) * tc_decode::kTraceSlots;
  unsigned long long* buffer = nullptr;
  uint64_t launches = 0;
  int items[2] = {0, 0};
  int cluster[2] = {0, 0};
  int rows[2] = {0, 0};
};

TcDecodeTrace* tc_decode_trace() {
  static TcDecodeTrace* trace = []() -> TcDecodeTrace* {
    if (!tc_decode::trace_requested()) return nullptr;
    auto* t = new TcDecodeTrace;
    check_cuda(cudaMalloc(&t->buffer, 2 * TcDecodeTrace::kHalf * sizeof(unsigned long long)),
               "cudaMalloc(tc_decode trace)");
    check_cuda(cudaMemset(t->buffer, 0, 2 * TcDecodeTrace::kHalf * sizeof(unsigned long long)),
               "cudaMemset(tc_decode trace)");
    std::atexit([] {
      TcDecodeTrace* t = tc_decode_trace();
      std::vector<unsigned long long> host(2 * TcDecodeTrace::kHalf);
      if (cudaDeviceSynchronize() != cudaSuccess ||
          cudaMemcpy(host.data(), t->buffer, host.size() * sizeof(host[0]),
                     cudaMemcpyDeviceToHost) != cudaSuccess) {
        std::fprintf(stderr, "tc_decode trace: could not read the stamps back\n");
        return;
      }
      static const char* names[tc_decode::kTraceSlots] = {
          "entry",  "released", "facts",   "loop",   "warp0", "warp1", "warp2", "warp3",
          "merged", "stored",   "cluster", "folded", "exit",  "",      "",      ""};
      static_assert(tc_decode::kTraceSm == 13, "the SM slot has no name above");
      unsigned long long first[2] = {0, 0}, last[2] = {0, 0}, released[2] = {0, 0};
      for (int h = 0; h < 2 && uint64_t(h) < t->launches; ++h) {
        const unsigned long long* base = host.data() + h * TcDecodeTrace::kHalf;
        const int n = t->items[h];
        first[h] = ~0ull;
        for (int c = 0; c < n; ++c) first[h] = std::min(first[h], base[c * tc_decode::kTraceSlots]);
        std::fprintf(stderr, "tc_decode trace, launch parity %d: %d CTAs, cluster %d, %d rows\n", h,
                     n, t->cluster[h], t->rows[h]);
        {  // placement: how many SMs the CTAs ran on, and the most CTAs on one SM
          std::map<unsigned long long, int> per_sm;
          for (int c = 0; c < n; ++c) {
            ++per_sm[base[c * tc_decode::kTraceSlots + tc_decode::kTraceSm]];
          }
          int most = 0;
          for (const auto& [sm, count] : per_sm) most = std::max(most, count);
          std::fprintf(stderr, "  placement: %zu SMs, at most %d CTAs on one\n", per_sm.size(),
                       most);
        }
        for (int s = 0; s < tc_decode::kTraceSlots; ++s) {
          if (names[s][0] == '\0') continue;
          std::vector<double> at;
          for (int c = 0; c < n; ++c) {
            const unsigned long long v = base[c * tc_decode::kTraceSlots + s];
            if (v < first[h]) continue;  // not written by this launch
            at.push_back(double(v - first[h]) * 1e-3);
            if (s == tc_decode::kTraceReleased) released[h] = std::max(released[h], v);
            last[h] = std::max(last[h], v);
          }
          if (at.empty()) continue;
          std::sort(at.begin(), at.end());
          std::fprintf(stderr, "  %-9s CTAs %4zu  median %7.2f us  max %7.2f us\n", names[s],
                       at.size(), at[at.size() / 2], at.back());
        }
      }
      if (t->launches >= 2) {
        const int a = first[0] < first[1] ? 0 : 1;  // the earlier launch
        std::fprintf(stderr,
                     "  launch %d's last stamp -> launch %d: first entry %+.2f us, last release "
                     "%+.2f us\n",
                     a, 1 - a, (double(first[1 - a]) - double(last[a])) * 1e-3,
                     (double(released[1 - a]) - double(last[a])) * 1e-3);
      }
    });
    return t;
  }();
  return trace;
}

void trace_tc_decode(core::PrefillTiles& run) {
  TcDecodeTrace* t = tc_decode_trace();
  if (t == nullptr || run.num_items > TcDecodeTrace::kMaxCtas) return;
  const int half = int(t->launches++ & 1);
  run.trace = t->buffer + half * TcDecodeTrace::kHalf;
  t->items[half] = run.num_items;
  t->cluster[half] = run.cluster;
  t->rows[half] = run.tile_rows;
}

}  // namespace
#endif

void launch_tc_decode(const core::AttentionParams& p, const core::PrefillTiles& tiles,
                      cudaStream_t stream) {
  const int device = current_device();
  if (device < 0) {
    throw_error(ErrorKind::kDeviceError, "tc_decode", "no CUDA device is available");
  }
  const PrefillKernelShape shape = validate(p, tiles, device, /*tc_decode=*/true);
  if (tiles.num_items == 0) return;
  // A cluster-split plan (tiles.cluster > 1, the default where the batch is small: its clusters
  // merge their chunks in distributed shared memory) has no merge items. Otherwise a merge grid
  // after the attention grid (as the prefill families), or with KVATTN_TC_DECODE_MERGE=kernel
  // the last chunk of a split tile merges it (measured slower, bench/NOTES.md v4: one CTA folds
  // the tile's 32 rows, 8 a warp one after another, where the grid spreads them over 8 CTAs).
  check_arg(tiles.cluster <= 1 || (tiles.num_items % tiles.cluster == 0 && tiles.num_merges == 0 &&
                                   tiles.cluster <= shape.max_cluster),
            "tiles.cluster", "got ", tiles.cluster, " with ", tiles.num_items, " items and ",
            tiles.num_merges, " merges; a cluster-split plan has whole clusters of at most ",
            shape.max_cluster, " CTAs and no merges");
  const bool in_kernel = tc_decode_merge_mode() == TcDecodeMerge::kKernel;
  core::PrefillTiles run = tiles;
  run.merge_in_kernel = in_kernel && tiles.cluster <= 1 ? 1 : 0;
  // KVATTN_TC_DECODE_DIAG=1..4: leave out a phase to time it (core::PrefillTiles::diag).
  static const int diag = [] {
    const char* v = std::getenv("KVATTN_TC_DECODE_DIAG");
    return v != nullptr ? std::atoi(v) : 0;
  }();
  run.diag = diag;
#if defined(KVATTN_TC_DECODE_TRACE)
  trace_tc_decode(run);
#endif
  if (p.head_dim == 64) {
    tc_decode::launch_tc_decode_hd64(p, run, stream);
  } else {
    tc_decode::launch_tc_decode_hd128(p, run, stream);
  }
  if (run.merge_in_kernel == 0) launch_merge(p, run, stream, /*programmatic=*/true);
}

}  // namespace kvattn::cuda
