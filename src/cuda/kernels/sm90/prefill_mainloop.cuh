// The mainloop of the Hopper prefill kernel: the producer warpgroup's loads and the consumer
// warpgroups' S = Q K^T, online softmax and O += P V on warpgroup MMAs.
//
// Pipeline (per tile, blocks n = num_blocks - 1 down to 0, each block in stage it % kStages of
// a running iteration count `it` that continues across the tiles of a CTA; the tile itself in Q
// buffer u % kQBuffers of the running tile count u):
//   producer:  the tile's description and Q (once the buffer is free), K[n_last], then for each
//              later block: K[n], V[n + 1]; finally V[0]
//   consumer:  wait for the tile; S = Q K[n_last]; softmax
//              for each later block: issue S = Q K[n]; rescale O (under that product) where
//              the last softmax moved a row's max; issue O += P V[n + 1]; wait for S; release
//              K; softmax of S (overlapping the P V product on the tensor cores); wait for O;
//              release V; P = S
//              O += P V[0]; the output (staged through the tile's Q buffer where it can be);
//              release the Q buffer (after the last S when the output does not use it)
// Optionally (LaunchOptions::ping_pong, off by default) the consumer warpgroups take turns
// issuing their products, round robin (named barriers kScheduleFirst + wg), FA3's ping-pong.
//
// Loads: paged and ragged K/V and Q are gathered row by row with 16-byte cp.async (a slot per
// key, from kv_indices; rows past the block's keys or slots outside the pool are zero-filled,
// never read), completing on the stage's mbarrier through cp.async.mbarrier.arrive; fp8 K/V
// are loaded into registers, widened exactly to the io dtype and stored into the stage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/attention_params.h"
#include "core/prefill_tiles.h"
#include "cuda/kernels/sm90/prefill_traits.cuh"
#include "cuda/kernels/sm90/tile_scheduler.cuh"
#include "cuda/kernels/toolkit/online_softmax.cuh"
#include "cuda/kernels/toolkit/ptx.cuh"
#include "cuda/kernels/toolkit/wgmma.cuh"

namespace kvattn::cuda::sm90 {

/// Shared-memory addresses of one CTA's buffers and barriers.
template <class Tr>
struct SharedBuffers {
  uint32_t base = 0;             // .shared address, 1024-byte aligned
  unsigned char* ptr = nullptr;  // the same bytes as a generic pointer

  __device__ __forceinline__ uint32_t q(int buffer) const {
    return base + Tr::kQOffset + buffer * Tr::kQBytes;
  }
  __device__ __forceinline__ PrefillTile* tile_info(int buffer) const {
    return reinterpret_cast<PrefillTile*>(ptr + Tr::kTileInfoOffset + buffer * Tr::kTileInfoBytes);
  }
  __device__ __forceinline__ uint32_t k(int stage) const {
    return base + Tr::kKOffset + stage * Tr::kKBytes;
  }
  __device__ __forceinline__ uint32_t v(int stage) const {
    return base + Tr::kVOffset + stage * Tr::kVBytes;
  }
  __device__ __forceinline__ int32_t* slots(int table) const {
    return reinterpret_cast<int32_t*>(ptr + Tr::kSlotOffset) + table * Tr::kKvTile;
  }
  __device__ __forceinline__ uint32_t scratch_word(int consumer_warp) const {
    return base + Tr::kScratchOffset + consumer_warp * 4;
  }
  __device__ __forceinline__ volatile int* next_item(uint32_t tile) const {
    return reinterpret_cast<volatile int*>(ptr + Tr::kNextItemOffset) + (tile & 1u);
  }
  __device__ __forceinline__ uint32_t barrier(int index) const {
    return base + Tr::kBarrierOffset + index * 8;
  }
  __device__ __forceinline__ uint32_t q_full(int buffer) const { return barrier(buffer); }
  __device__ __forceinline__ uint32_t q_empty(int buffer) const {
    return barrier(Tr::kQBuffers + buffer);
  }
  static constexpr int kRing = 2 * Tr::kQBuffers;  // first K/V barrier
  __device__ __forceinline__ uint32_t k_full(int stage) const { return barrier(kRing + stage); }
  __device__ __forceinline__ uint32_t v_full(int stage) const {
    return barrier(kRing + Tr::kStages + stage);
  }
  __device__ __forceinline__ uint32_t k_empty(int stage) const {
    return barrier(kRing + 2 * Tr::kStages + stage);
  }
  __device__ __forceinline__ uint32_t v_empty(int stage) const {
    return barrier(kRing + 3 * Tr::kStages + stage);
  }

  /// One thread initialises every barrier; the CTA synchronises afterwards. A stage fills by
  /// one arrival per producer thread (row copies) or by one arrival and the bytes of its tensor
  /// copies (tma); a Q buffer by one arrival per producer thread (its Q rows) plus one from the
  /// thread that wrote the tile's description. A stage empties by one arrival per consumer warp
  /// (its wgmmas read it), a Q buffer by one per consumer thread (each also read the tile's
  /// description, and the staged output, with ordinary loads).
  __device__ __forceinline__ void init_barriers(bool tma) const {
    constexpr uint32_t kProducerThreads = 128;
    constexpr uint32_t kConsumerWarps = 4 * Tr::kConsumerWarpgroups;
    const uint32_t kv_arrivals = tma ? 1 : kProducerThreads;
    for (int b = 0; b < Tr::kQBuffers; ++b) {
      ptx::mbarrier_init(q_full(b), kProducerThreads + 1);
      ptx::mbarrier_init(q_empty(b), 32 * kConsumerWarps);
    }
    for (int s = 0; s < Tr::kStages; ++s) {
      ptx::mbarrier_init(k_full(s), kv_arrivals);
      ptx::mbarrier_init(v_full(s), kv_arrivals);
      ptx::mbarrier_init(k_empty(s), kConsumerWarps);
      ptx::mbarrier_init(v_empty(s), kConsumerWarps);
    }
  }
};

/// Position in a ring of kStages slots (the K/V stages, the Q buffers): use number `it` takes
/// slot it % kStages in phase (it / kStages).
template <int kStages>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ static RingPosition of(uint32_t it) {
    return {static_cast<int>(it % kStages), (it / kStages) & 1u};
  }
};

// ---- producer --------------------------------------------------------------------------------

template <class Tr, typename T>
struct PrefillProducer {
  static constexpr int kThreads = 128;
  using Ring = RingPosition<Tr::kStages>;

  const core::AttentionParams& p;
  const SharedBuffers<Tr>& sm;
  const PrefillTensorMaps& maps;  // ragged K/V by TMA when maps.enabled
  int tid;                        // 0..127
  bool paged;
  bool fp8;
  bool e5m2;
  int v_dim;       // V columns that exist (kHeadDimV, or fewer for a narrow V)
  int diagnostic;  // LaunchOptions::diagnostic

  // Copy geometry: a thread owns 16-byte chunk column tid % 8 of every 64-column sub-tile and
  // the rows tid / 8 + 16 i, so its destination offsets are compile-time constants past one
  // per-thread base (the swizzle term (tid % 8) ^ (row % 8) is the same for all its rows) and a
  // warp's copies cover four whole 128-byte row segments.
  static constexpr int kRowStep = kThreads / 8;

  __device__ __forceinline__ int row_in_step() const { return tid / 8; }
  /// Byte offset of this thread's chunk in row row_in_step() of sub-tile 0 of a tile.
  __device__ __forceinline__ uint32_t chunk_base() const {
    const int r0 = row_in_step();
    return uint32_t(r0) * 128 + uint32_t((tid % 8) ^ (r0 % 8)) * 16;
  }

  /// Gathers the tile's 128 packed rows of Q (rows past the request are zeros) into Q buffer
  /// `buffer` (the caller arrives on the buffer's barrier). A thread's rows are kRowStep packed
  /// rows apart, so (token, head) is divided out once for its first row and then stepped: each
  /// row advances by kRowStep / group tokens and kRowStep % group heads, carrying one token when
  /// the head passes the group (the source pointer likewise), ~10 instructions a row where a
  /// division and two 64-bit products each were ~30.
  __device__ __forceinline__ void load_q(const PrefillTile& t, const core::FastDivmod& group,
                                         int buffer) const {
    constexpr int kSubTiles = Tr::kHeadDim / 64;
    const T* q = static_cast<const T*>(p.q) + (tid % 8) * 8;
    const uint32_t dst = sm.q(buffer) + chunk_base();
    const int packed0 = t.row0 + row_in_step();
    int in_group;
    const int token = group.divmod(packed0, in_group);
    int step_heads;
    const int step_tokens = group.divmod(kRowStep, step_heads);
    const T* src = q + (int64_t(t.q_begin) + token) * p.q_stride_token +
                   int64_t(t.kv_head * group.divisor + in_group) * p.q_stride_head;
    const int64_t step =
        int64_t(step_tokens) * p.q_stride_token + int64_t(step_heads) * p.q_stride_head;
    const int64_t carry = p.q_stride_token - int64_t(group.divisor) * p.q_stride_head;
#pragma unroll
    for (int i = 0; i < Tr::kTileRows / kRowStep; ++i) {
      const bool valid = packed0 + i * kRowStep < t.rows_total;
#pragma unroll
      for (int sub = 0; sub < kSubTiles; ++sub) {
        ptx::cp_async_zfill<16>(dst + sub * Tr::kTileRows * 128 + i * kRowStep * 128,
                                (valid ? src : q) + sub * 64, valid);
      }
      if (i + 1 < Tr::kTileRows / kRowStep) {  // the next row (past the request: never read)
        src += step;
        in_group += step_heads;
        if (in_group >= group.divisor) {
          in_group -= group.divisor;
          src += carry;
        }
      }
    }
  }

  /// Publishes a tile to the consumers: once its Q buffer is free, the tile's description and
  /// (when it has keys) its Q rows; a description with request < 0 ends the CTA's work.
  /// `published` counts the tiles this CTA published before.
  __device__ __forceinline__ void publish_tile(const PrefillTile& t, const core::FastDivmod& group,
                                               uint32_t published) const {
    using QRing = RingPosition<Tr::kQBuffers>;
    const QRing at = QRing::of(published);
    ptx::mbarrier_wait(sm.q_empty(at.stage), at.phase ^ 1u);
    if (t.num_blocks > 0) load_q(t, group, at.stage);
    ptx::cp_async_mbarrier_arrive(sm.q_full(at.stage));
    if (tid == 0) {
      *sm.tile_info(at.stage) = t;
      ptx::mbarrier_arrive(sm.q_full(at.stage));  // release: the description is visible
    }
  }

  /// Row r of a block, relative to the lane's source of row 0 (source_row0): paged, the slot
  /// (from the block's table); ragged, the key. -1: none (past the block's keys, or a slot
  /// outside the pool, already folded into the table).
  template <bool kPaged>
  __device__ __forceinline__ static int32_t block_row(const int32_t* table, int block_start,
                                                      int rows_valid, int r) {
    if constexpr (kPaged) return table[r];
    return r < rows_valid ? block_start + r : -1;
  }

  /// This thread's 16-byte chunk of row 0 of the tile's kv head in K or V storage (`base`): the
  /// pool's row 0 when paged (a block's rows are slots), the request's first key when ragged (a
  /// block's rows are keys).
  __device__ __forceinline__ const char* source_row0(const PrefillTile& t, const void* base,
                                                     int64_t stride_token, int64_t stride_head,
                                                     int64_t elem_bytes, int chunk_bytes) const {
    return static_cast<const char*>(base) +
           (int64_t(t.kv_head) * stride_head + (paged ? 0 : t.kv_base * stride_token)) *
               elem_bytes +
           chunk_bytes;
  }

  /// Copies keys [block_start, block_start + rows_valid) of K (kCols = head_dim) or V (kCols =
  /// the V width) into the swizzled tile at `dst`, as 16-bit values; columns from valid_cols on
  /// (a narrow V) and rows without a key become zeros. A row's address is one wide multiply-add
  /// of a 32-bit row and the row pitch in bytes (< 2^32: the launch checks), so a copy is a
  /// table load, a select and the cp.async (the 64-bit address arithmetic of a row cost ~30
  /// instructions a copy: bench/NOTES.md, twelfth session). kPaged: the rows come from the
  /// block's slot table (the caller branches once, so neither form issues the other's code);
  /// kAllCols: every column exists (K), else columns from valid_cols on are zeros (V).
  template <int kCols, bool kPaged, bool kAllCols>
  __device__ __forceinline__ void copy_rows_16bit(const PrefillTile& t, const void* base,
                                                  int64_t stride_token, int64_t stride_head,
                                                  int valid_cols, uint32_t dst,
                                                  const int32_t* table, int block_start,
                                                  int rows_valid) const {
    constexpr int kSubTiles = kCols / 64;
    const char* const src0 =
        source_row0(t, base, stride_token, stride_head, sizeof(T), (tid % 8) * 16);
    const uint32_t pitch = static_cast<uint32_t>(stride_token * int64_t(sizeof(T)));
    // A narrow V's missing columns: this thread's chunk of sub-tile `sub` exists when
    // sub * 64 + (tid % 8) * 8 < valid_cols (always for K and a full V).
    const int chunk_col = (tid % 8) * 8;
    dst += chunk_base();
#pragma unroll
    for (int i = 0; i < Tr::kKvTile / kRowStep; ++i) {
      const int32_t row =
          block_row<kPaged>(table, block_start, rows_valid, row_in_step() + i * kRowStep);
      const char* src = ptx::row_address(src0, static_cast<uint32_t>(max(row, 0)), pitch);
#pragma unroll
      for (int sub = 0; sub < kSubTiles; ++sub) {
        const bool col_ok = kAllCols || sub * 64 + chunk_col < valid_cols;
        ptx::cp_async16_unless_negative(dst + sub * Tr::kKvTile * 128 + i * kRowStep * 128,
                                        src + sub * 128, col_ok ? row : -1);
      }
    }
  }

  /// The same for fp8 storage: a thread loads 16 fp8 values (16 bytes) of a row and widens them
  /// exactly to T: two 16-byte chunks, 2 (tid % 4) and 2 (tid % 4) + 1 of the sub-tile, for the
  /// rows tid / 4 + 32 i.
  template <int kCols>
  __device__ __forceinline__ void copy_rows_fp8(const PrefillTile& t, const void* base_void,
                                                int64_t stride_token, int64_t stride_head,
                                                int valid_cols, uint32_t dst, const int32_t* table,
                                                int block_start, int rows_valid) const {
    constexpr int kSubTiles = kCols / 64;
    constexpr int kFp8RowStep = kThreads / 4;
    constexpr int kRows = Tr::kKvTile / kFp8RowStep;  // rows a thread loads per sub-tile
    const char* const src0 =
        source_row0(t, base_void, stride_token, stride_head, 1, (tid % 4) * 16);
    const uint32_t pitch = static_cast<uint32_t>(stride_token);
    const int r0 = tid / 4;
    const int q4 = tid % 4;
    unsigned char* tile = sm.ptr + (dst - sm.base);
    int32_t rows[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = r0 + i * kFp8RowStep;
      rows[i] = paged ? block_row<true>(table, block_start, rows_valid, r)
                      : block_row<false>(table, block_start, rows_valid, r);
    }
#pragma unroll 1
    for (int sub = 0; sub < kSubTiles; ++sub) {
      const bool cols = sub * 64 + q4 * 16 < valid_cols;
      uint4 raw[kRows];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        raw[i] =
            rows[i] >= 0 && cols
                ? __ldg(reinterpret_cast<const uint4*>(
                      ptx::row_address(src0, static_cast<uint32_t>(rows[i]), pitch) + sub * 64))
                : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = r0 + i * kFp8RowStep;
        const uint32_t words[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
        uint32_t widened[8];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          widened[2 * w] = ptx::fp8x2_to<T>(static_cast<uint16_t>(words[w] & 0xffffu), e5m2);
          widened[2 * w + 1] = ptx::fp8x2_to<T>(static_cast<uint16_t>(words[w] >> 16), e5m2);
        }
        unsigned char* row_bytes = tile + sub * Tr::kKvTile * 128 + r * 128;
        *reinterpret_cast<uint4*>(row_bytes + ((2 * q4) ^ (r % 8)) * 16) =
            make_uint4(widened[0], widened[1], widened[2], widened[3]);
        *reinterpret_cast<uint4*>(row_bytes + ((2 * q4 + 1) ^ (r % 8)) * 16) =
            make_uint4(widened[4], widened[5], widened[6], widened[7]);
      }
    }
  }

  /// Loads block `block` of K (is_v false) or V into stage position `at`, after the consumers
  /// released it; arrives on the stage's full barrier when the data is in place.
  __device__ __forceinline__ void load_block(const PrefillTile& t, bool is_v, int block, Ring at,
                                             const int32_t* table) const {
    if (maps.enabled) {
      // A V block that runs past the request's keys is copied row by row with zeros past them:
      // a box would bring in the next request's rows, and P = 0 times a NaN there is NaN (K
      // rows need no care: masked scores are -inf whatever K holds). Rows past the tile's keys
      // but inside the request (a causal tile's later keys) are the request's own finite rows.
      const bool partial_v = is_v && t.kv_begin + (block + 1) * Tr::kKvTile > t.kv_len;
      if (!partial_v) {
        if (tid == 0) load_block_tma(t, is_v, block, at);
        return;
      }
      ptx::mbarrier_wait(sm.v_empty(at.stage), at.phase ^ 1u);
      const int block_start = t.kv_begin + block * Tr::kKvTile;
      copy_rows_16bit<Tr::kHeadDimV, false, false>(t, p.v, p.v_stride_token, p.v_stride_head, v_dim,
                                                   sm.v(at.stage), nullptr, block_start,
                                                   t.kv_end - block_start);
      ptx::cp_async_wait<0>();  // this thread's rows landed
      ptx::fence_proxy_async_shared();
      ptx::named_barrier_sync(kProducerTable, kThreads);
      if (tid == 0) ptx::mbarrier_arrive(sm.v_full(at.stage));  // the stage's one arrival
      return;
    }
    ptx::mbarrier_wait(is_v ? sm.v_empty(at.stage) : sm.k_empty(at.stage), at.phase ^ 1u);
    const int block_start = t.kv_begin + block * Tr::kKvTile;
    const int rows_valid = min(Tr::kKvTile, t.kv_end - block_start);
    const uint32_t full = is_v ? sm.v_full(at.stage) : sm.k_full(at.stage);
    if (kDiagnosticsBuilt && (diagnostic & kDiagnosticNoKvLoads)) {
      ptx::mbarrier_arrive(full);
    } else if (!fp8) {
      auto copy = [&]<bool kPaged>() {
        if (is_v) {
          copy_rows_16bit<Tr::kHeadDimV, kPaged, false>(t, p.v, p.v_stride_token, p.v_stride_head,
                                                        v_dim, sm.v(at.stage), table, block_start,
                                                        rows_valid);
        } else {
          copy_rows_16bit<Tr::kHeadDim, kPaged, true>(t, p.k, p.k_stride_token, p.k_stride_head,
                                                      Tr::kHeadDim, sm.k(at.stage), table,
                                                      block_start, rows_valid);
        }
      };
      if (paged) {
        copy.template operator()<true>();
      } else {
        copy.template operator()<false>();
      }
      ptx::cp_async_mbarrier_arrive(full);
    } else {
      if (is_v) {
        copy_rows_fp8<Tr::kHeadDimV>(t, p.v, p.v_stride_token, p.v_stride_head, v_dim,
                                     sm.v(at.stage), table, block_start, rows_valid);
      } else {
        copy_rows_fp8<Tr::kHeadDim>(t, p.k, p.k_stride_token, p.k_stride_head, Tr::kHeadDim,
                                    sm.k(at.stage), table, block_start, rows_valid);
      }
      ptx::fence_proxy_async_shared();  // the stores above are read by wgmma (async proxy)
      ptx::mbarrier_arrive(full);
    }
  }

  /// Ragged K/V by tensor map, one thread: a box per 64-column sub-tile. Rows past the
  /// request's keys are other requests' rows (the consumers mask them; finite, so P = 0 keeps
  /// them out of O) or past the tensor (zeros).
  __device__ __forceinline__ void load_block_tma(const PrefillTile& t, bool is_v, int block,
                                                 Ring at) const {
    ptx::mbarrier_wait(is_v ? sm.v_empty(at.stage) : sm.k_empty(at.stage), at.phase ^ 1u);
    const int row = static_cast<int>(t.kv_base) + t.kv_begin + block * Tr::kKvTile;
    const uint32_t full = is_v ? sm.v_full(at.stage) : sm.k_full(at.stage);
    if (kDiagnosticsBuilt && (diagnostic & kDiagnosticNoKvLoads)) {
      ptx::mbarrier_arrive(full);
      return;
    }
    const int sub_tiles = (is_v ? Tr::kHeadDimV : Tr::kHeadDim) / 64;
    ptx::mbarrier_arrive_expect_tx(full, sub_tiles * Tr::kKvTile * 128);
    const uint32_t dst = is_v ? sm.v(at.stage) : sm.k(at.stage);
    const void* map = is_v ? static_cast<const void*>(&maps.v) : static_cast<const void*>(&maps.k);
    for (int sub = 0; sub < sub_tiles; ++sub) {
      ptx::tma_load_3d(dst + sub * Tr::kKvTile * 128, map, sub * 64, t.kv_head, row, full);
    }
  }

  /// Paged: the slot of key block_start + tid of the block, -1 past the block's keys or outside
  /// the pool (such a row is zero-filled, never read); the caller writes it into the block's
  /// table before the copies need it.
  __device__ __forceinline__ int32_t fetch_slot(const PrefillTile& t, int block) const {
    const int j = t.kv_begin + block * Tr::kKvTile + tid;
    const int block_end = min(t.kv_begin + (block + 1) * Tr::kKvTile, t.kv_end);
    if (tid >= Tr::kKvTile || j >= block_end) return -1;
    const int32_t slot = p.kv_indices[t.kv_base + j];
    return (slot >= 0 && slot < p.num_slots) ? slot : -1;
  }

  /// Publishes the slots of the block loaded at iteration `it` (paged only).
  __device__ __forceinline__ const int32_t* publish_slots(uint32_t it, int32_t slot) const {
    if (!paged) return nullptr;
    int32_t* table = sm.slots(static_cast<int>(it % Tr::kSlotTables));
    if (tid < Tr::kKvTile) table[tid] = slot;
    ptx::named_barrier_sync(kProducerTable, kThreads);
    return table;
  }

  /// The K/V loads of one tile (its Q went with publish_tile). `it` is the running stage
  /// iteration (advanced by num_blocks). Step 0 loads K[last]; step s loads K[last - s] and
  /// V[last - s + 1]; the last step V[0] (one call site per operand keeps the unrolled copy
  /// code small).
  __device__ __forceinline__ void run_tile(const PrefillTile& t, uint32_t& it) const {
    const int last = t.num_blocks - 1;
    // Slot tables (paged): the table of iteration i is written before K[i] and read by K[i]
    // and V[i] (one step later); three tables in rotation and the table barrier of each K load
    // keep a table from being rewritten while a slower thread still reads it for V.
    int32_t slot = paged ? fetch_slot(t, last) : -1;
    const int32_t* k_table = nullptr;
    const int32_t* v_table = nullptr;
#pragma unroll 1
    for (int step = 0; step <= t.num_blocks; ++step) {
      if (step < t.num_blocks) {
        const int block = last - step;
        k_table = publish_slots(it + step, slot);
        if (paged && block > 0) slot = fetch_slot(t, block - 1);  // in flight during the copies
        load_block(t, false, block, Ring::of(it + step), k_table);
      }
      if (step > 0) load_block(t, true, last - step + 1, Ring::of(it + step - 1), v_table);
      v_table = k_table;
    }
    it += t.num_blocks;
  }
};

// ---- consumers -------------------------------------------------------------------------------

template <class Tr, typename T>
struct PrefillConsumer {
  static constexpr int kScoreRegs = Tr::kKvTile / 2;   // S: 64 x kKvTile over 128 threads
  static constexpr int kOutRegs = Tr::kHeadDimV / 2;   // O: 64 x kHeadDimV
  static constexpr int kKeySteps = Tr::kKvTile / 16;   // k16 steps of O += P V
  static constexpr int kKeyBlocks8 = Tr::kKvTile / 8;  // n8 blocks of S
  using Ring = RingPosition<Tr::kStages>;

  const core::AttentionParams& p;
  const SharedBuffers<Tr>& sm;
  int wg;    // 0 .. kConsumerWarpgroups - 1: which 64 rows of the tile
  int warp;  // 0..3 inside the warpgroup
  int lane;

  // Logit transform and masks (runtime; the same for every tile of the call).
  bool causal;
  bool custom;
  int window;  // -1: none
  bool soft_cap;
  float scale_log2;
  float cap_inner;
  bool ping_pong;
  int diagnostic;  // LaunchOptions::diagnostic

  /// Row of the tile (0..127) that this thread's half h holds.
  __device__ __forceinline__ int tile_row(int h) const {
    return wg * 64 + warp * 16 + (lane >> 2) + 8 * h;
  }

  // Operand descriptors: Q's (this warpgroup's 64 rows) and stage 0's K and V; a stage and a
  // k16 block are constant byte steps from them.
  __device__ __forceinline__ ptx::SmemDescriptor q_desc(int q_buffer) const {
    return ptx::smem_descriptor<16, ptx::kSwizzleAtomBytes>(sm.q(q_buffer) + wg * 64 * 128);
  }
  __device__ __forceinline__ ptx::SmemDescriptor k_desc(int stage) const {
    return ptx::smem_descriptor<16, ptx::kSwizzleAtomBytes>(sm.k(0)).plus(stage * Tr::kKBytes);
  }
  __device__ __forceinline__ ptx::SmemDescriptor v_desc(int stage) const {
    return ptx::smem_descriptor<Tr::kKvTile * 128, ptx::kSwizzleAtomBytes>(sm.v(0)).plus(
        stage * Tr::kVBytes);
  }

  /// Issues S = Q K^T on stage `stage` (one wgmma group).
  __device__ __forceinline__ void issue_scores(float (&s)[kScoreRegs], int stage,
                                               int q_buffer) const {
    ptx::fence_registers(s);
    ptx::wgmma_fence();
    const ptx::SmemDescriptor q = q_desc(q_buffer);
    const ptx::SmemDescriptor k = k_desc(stage);
#pragma unroll
    for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
      ptx::wgmma_ss<T, Tr::kKvTile>(s, q.at(ptx::kmajor_step<Tr::kTileRows>(kk)),
                                    k.at(ptx::kmajor_step<Tr::kKvTile>(kk)), kk > 0);
    }
    ptx::wgmma_commit_group();
    ptx::fence_registers(s);
  }

  __device__ __forceinline__ static void fence_fragments(uint32_t (&pf)[kKeySteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) ptx::fence_registers(pf[kk]);
  }

  /// Issues O += P V on stage `stage` (one wgmma group).
  __device__ __forceinline__ void issue_pv(float (&o)[kOutRegs], uint32_t (&pf)[kKeySteps][4],
                                           int stage) const {
    ptx::fence_registers(o);
    fence_fragments(pf);
    ptx::wgmma_fence();
    const ptx::SmemDescriptor v = v_desc(stage);
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) {
      ptx::wgmma_rs_trans_b<T, Tr::kHeadDimV>(o, pf[kk], v.at(ptx::mnmajor_step(kk)), true);
    }
    ptx::wgmma_commit_group();
    ptx::fence_registers(o);
    fence_fragments(pf);
  }

  /// Signals that this warp is done reading a stage (the barrier counts the consumer warps).
  __device__ __forceinline__ void release(uint32_t empty_barrier) const {
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(empty_barrier);
  }
  /// Signals that this thread is done with a Q buffer and its tile description.
  __device__ __forceinline__ void release_q(int q_buffer) const {
    ptx::mbarrier_arrive(sm.q_empty(q_buffer));
  }

  /// The blocks of tile t whose scores need neither soft-cap nor a mask, [first, last] (empty
  /// when first > last; CTA-uniform, once a tile): block b's keys [key0, key0 + kKvTile), key0 =
  /// kv_begin + b kKvTile, all lie before the tile's key end, at or before the first row's
  /// diagonal (causal) and at or after the last row's window start; no custom mask (the range
  /// form of transform_scores' needs_mask: change the two together).
  struct PlainBlocks {
    int first, last;
  };
  __device__ __forceinline__ PlainBlocks plain_blocks(const PrefillTile& t, int group) const {
    constexpr int kShift = __builtin_ctz(Tr::kKvTile);  // floor division by kKvTile (a power of 2)
    static_assert((1 << kShift) == Tr::kKvTile, "kKvTile is a power of 2");
    if (custom || soft_cap) return {1, 0};
    const int diagonal = t.kv_len - t.q_len;
    int last = (t.kv_end - t.kv_begin - Tr::kKvTile) >> kShift;
    if (causal) {
      const int first_token = t.row0 / group;
      last = min(last, (diagonal + first_token - t.kv_begin - Tr::kKvTile + 1) >> kShift);
    }
    int first = 0;
    if (window >= 0) {  // the first block whose key0 is at or after the last row's window start
      const int last_token = (min(t.rows_total, t.row0 + Tr::kTileRows) - 1) / group;
      first = max(0, -((t.kv_begin - (diagonal + last_token - window)) >> kShift));
    }
    return {first, last};
  }

  /// Soft-cap and masks for block `block` of tile t, in place (hidden scores -> -inf). (`group`
  /// as an int: with core::FastDivmod here the compiler kept the loop-invariant quotients live
  /// through the block loop, and the head_dim 128 consumer spilled 76 bytes instead of 8.)
  __device__ __forceinline__ void transform_scores(float (&s)[kScoreRegs], const PrefillTile& t,
                                                   int group, int block, const uint8_t* mask_base,
                                                   int64_t mask_row_len) const {
    if (soft_cap) {
#pragma unroll
      for (int i = 0; i < kScoreRegs; ++i) s[i] = p.logit_cap * ptx::fast_tanh(s[i] * cap_inner);
    }
    const int key0 = t.kv_begin + block * Tr::kKvTile;
    const int diagonal = t.kv_len - t.q_len;
    const int first_token = t.row0 / group;
    const int last_token = (min(t.rows_total, t.row0 + Tr::kTileRows) - 1) / group;
    // CTA-uniform: masks only where some element of the block can be hidden (the one-block
    // form of plain_blocks' range: change the two together).
    const bool needs_mask = custom || key0 + Tr::kKvTile > t.kv_end ||
                            (causal && key0 + Tr::kKvTile - 1 > diagonal + first_token) ||
                            (window >= 0 && key0 < diagonal + last_token - window);
    if (!needs_mask) return;
    if (custom) {
      transform_custom(s, t, group, key0, diagonal, mask_base, mask_row_len);
      return;
    }
    // Causal / window / the tile's key end: a row sees one interval of keys, so a score is kept
    // when its column offset c (a compile-time constant) lies in [lo, hi]: two compares and a
    // select an element. The code stays small: it runs once a tile (the diagonal block) and
    // must not spill the instruction cache (bench/NOTES.md, eleventh session).
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int packed = t.row0 + tile_row(h);
      const int token = min(packed, t.rows_total - 1) / group;
      const int col0 = key0 + (lane & 3) * 2;  // the key of this thread's column offset 0
      const int last = causal ? min(t.kv_end - 1, diagonal + token) : t.kv_end - 1;
      const int hi = last - col0;
      const int lo = window >= 0 ? diagonal + token - window - col0 : 0;
#pragma unroll
      for (int n = 0; n < kKeyBlocks8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = n * 8 + e;
          if (c > hi || c < lo) s[4 * n + 2 * h + e] = -INFINITY;
        }
      }
    }
  }

  /// transform_scores' custom-mask case: the key interval of the causal / window rule and the
  /// tile's key end, then the request's mask bytes.
  __device__ __forceinline__ void transform_custom(float (&s)[kScoreRegs], const PrefillTile& t,
                                                   int group, int key0, int diagonal,
                                                   const uint8_t* mask_base,
                                                   int64_t mask_row_len) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int packed = t.row0 + tile_row(h);
      const int token = min(packed, t.rows_total - 1) / group;
      const int last_visible = causal ? diagonal + token : t.kv_end;
      const int first_visible = window >= 0 ? diagonal + token - window : 0;
      const uint8_t* mask_row = mask_base + int64_t(token) * mask_row_len;
#pragma unroll
      for (int n = 0; n < kKeyBlocks8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = key0 + n * 8 + (lane & 3) * 2 + e;
          bool visible = j < t.kv_end && j <= last_visible && j >= first_visible;
          if (visible) visible = mask_row[j] != 0;
          if (!visible) s[4 * n + 2 * h + e] = -INFINITY;
        }
      }
    }
  }

  /// P (the A fragments of the k16 steps) from probabilities in the S layout.
  __device__ __forceinline__ static void to_fragments(const float (&s)[kScoreRegs],
                                                      uint32_t (&pf)[kKeySteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk) {
      pf[kk][0] = ptx::pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pf[kk][1] = ptx::pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pf[kk][2] = ptx::pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pf[kk][3] = ptx::pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  }

  __device__ __forceinline__ static void rescale(float (&o)[kOutRegs], const float (&f)[2]) {
#pragma unroll
    for (int j = 0; j < kOutRegs / 4; ++j) {
      o[4 * j + 0] *= f[0];
      o[4 * j + 1] *= f[0];
      o[4 * j + 2] *= f[1];
      o[4 * j + 3] *= f[1];
    }
  }

  __device__ __forceinline__ void schedule_wait() const {
    if (ping_pong) ptx::named_barrier_sync(kScheduleFirst + wg, 256);
  }
  __device__ __forceinline__ void schedule_pass() const {
    if (ping_pong) {
      const int next = wg + 1 < Tr::kConsumerWarpgroups ? wg + 1 : 0;
      ptx::named_barrier_arrive(kScheduleFirst + next, 256);
    }
  }

  /// The whole mainloop of one tile (num_blocks > 0) whose Q is in buffer q_buffer: on return
  /// o holds the unnormalised output and `softmax` the rows' state; `it` advances. With
  /// free_q_early the Q buffer is released as soon as the tile's last S is done. `trace`: the
  /// tile's stamps (KVATTN_SM90_TRACE builds), nullptr otherwise.
  __device__ __forceinline__ void run_tile(const PrefillTile& t, int group, float (&o)[kOutRegs],
                                           RowPairSoftmax& softmax, uint32_t& it, int q_buffer,
                                           bool free_q_early, unsigned long long* trace) const {
    const uint8_t* mask_base = nullptr;
    int64_t mask_row_len = 0;
    if (custom) {
      // The request's mask is [q_len, row_len], row_len >= kv_len; keys are the last kv_len
      // columns of a row (the CPU backend's contract).
      const int64_t begin = p.mask_indptr[t.request];
      mask_row_len = t.q_len > 0 ? (p.mask_indptr[t.request + 1] - begin) / t.q_len : 0;
      mask_base = p.custom_mask + begin + (mask_row_len - t.kv_len);
    }
#pragma unroll
    for (int i = 0; i < kOutRegs; ++i) o[i] = 0.f;
    softmax = RowPairSoftmax{};

    float s[kScoreRegs];
    uint32_t pf[kKeySteps][4];
    float factor[2];
    int block = t.num_blocks - 1;
    const uint32_t scratch = sm.scratch_word(wg * 4 + warp);

    Ring at = Ring::of(it);
    ptx::mbarrier_wait(sm.k_full(at.stage), at.phase);
    stamp(trace, kTraceFirstK);
    issue_scores(s, at.stage, q_buffer);
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(s);
    stamp(trace, kTraceFirstS);
    release(sm.k_empty(at.stage));
    if (free_q_early && block == 0) release_q(q_buffer);
    transform_scores(s, t, group, block, mask_base, mask_row_len);
    softmax.update<kKeyBlocks8, Tr::kVotedMax>(s, scale_log2, factor);
    to_fragments(s, pf);
    stamp(trace, kTraceFirstDone);

    unsigned long long k_waited = 0, v_waited = 0;  // traced tiles only (timed_wait)
    // O's rescale by the last softmax's factor is due before the P V that adds to it; it runs
    // while the next S is on the tensor cores (FA3's order), not between P V and the next S.
    bool rescale_due = false;
    // Traced tiles of more than 2 kTraceBlockStep blocks stamp loop step kTraceBlockStep.
    const bool long_tile = t.num_blocks > 2 * kTraceBlockStep;
    int step = 0;  // loop steps so far
    // One loop step: block `block`'s S, the last block's P V. kPlain: the block needs neither
    // soft-cap nor a mask (its scores go to the softmax as they are).
    auto block_step = [&]<bool kPlain>(int block) {
      const bool stamped = long_tile && step == kTraceBlockStep;
      stamp_clock(trace, long_tile && step == kTraceBlockStep + 1, kTraceBlockNext);
      stamp_clock(trace, stamped, kTraceBlockTop);
      const Ring next = Ring::of(it + 1);
      timed_wait(sm.k_full(next.stage), next.phase, trace, k_waited);
      schedule_wait();
      issue_scores(s, next.stage, q_buffer);
      if (rescale_due) rescale(o, factor);
      timed_wait(sm.v_full(at.stage), at.phase, trace, v_waited);
      issue_pv(o, pf, at.stage);
      schedule_pass();
      stamp_clock(trace, stamped, kTraceBlockIssued);
      ptx::wgmma_wait_group<1>();  // S done; P V may still run
      ptx::fence_registers(s);
      stamp_clock(trace, stamped, kTraceBlockS);
      release(sm.k_empty(next.stage));
      if (free_q_early && block == 0) release_q(q_buffer);  // the tile's last S
      bool moved = false;
      if (!(kDiagnosticsBuilt && (diagnostic & kDiagnosticNoSoftmax))) {
        if constexpr (!kPlain) transform_scores(s, t, group, block, mask_base, mask_row_len);
        moved = softmax.update<kKeyBlocks8, Tr::kVotedMax>(s, scale_log2, factor);
      }
      // The softmax must run before the wait, overlapping the P V product on the tensor cores
      // (ptxas would hoist the wait above it; see ptx::pin_before_wgmma_wait).
      ptx::fence_registers(s);
      if (lane == 0) ptx::pin_before_wgmma_wait(scratch, softmax.sum[0] + softmax.sum[1]);
      stamp_clock(trace, stamped, kTraceBlockSoftmax);
      // P stays live until the product that reads it asynchronously has completed.
      fence_fragments(pf);
      ptx::wgmma_wait_group<0>();
      ptx::fence_registers(o);
      stamp_clock(trace, stamped, kTraceBlockPv);
      release(sm.v_empty(at.stage));
      rescale_due = __any_sync(0xffffffffu, moved);
      to_fragments(s, pf);
      at = next;
      ++it;
      ++step;
    };
    // The loop split (FA3's masking steps): the plain blocks [plain.first, plain.last] run in
    // their own loop, without the per-block tests of soft-cap and masks; the others (the
    // diagonal's and the key end's blocks first, a window's edge last) one at a time.
    const PlainBlocks plain = plain_blocks(t, group);
    for (--block; block >= 0;) {
      if (block <= plain.last && block >= plain.first) {
        for (; block >= plain.first; --block) block_step.template operator()<true>(block);
      } else {
        block_step.template operator()<false>(block);
        --block;
      }
    }
    if (rescale_due) rescale(o, factor);
    timed_wait(sm.v_full(at.stage), at.phase, trace, v_waited);
    issue_pv(o, pf, at.stage);
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(o);
    stamp(trace, kTraceLoopDone);
    if (trace != nullptr) {
      trace[kTraceKWait] = k_waited;
      trace[kTraceVWait] = v_waited;
    }
    release(sm.v_empty(at.stage));
    ++it;
  }
};

}  // namespace kvattn::cuda::sm90
