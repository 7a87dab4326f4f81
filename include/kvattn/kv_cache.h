// kvattn — the paged KV pool, the request -> token map, and the slot allocator.
//
// Data model (SPEC §1):
//   K of layer l: [num_slots, num_kv_heads, head_dim]    ("NHD")
//   V of layer l: [num_slots, num_kv_heads, v_head_dim]
//   page p holds slots [p * page_size, (p + 1) * page_size); page 0 (so slot 0) is reserved
//   for padding: padded batch entries write there, the allocator never hands it out.
//   fp8 storage holds k / k_scale and v / v_scale; reads multiply back.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvattn/memory.h"
#include "kvattn/tensor.h"

namespace kvattn {

/// Shape and storage of a KV pool.
struct KvCacheConfig {
  int num_layers = 1;
  int64_t num_slots = 0;  ///< tokens the pool holds, slot 0 included; a multiple of page_size
  int num_kv_heads = 0;
  int head_dim = 0;
  int v_head_dim = 0;  ///< 0 means "same as head_dim"
  int page_size = 1;   ///< tokens per page: a power of two in [1, 128]
  DType dtype = DType::kBFloat16;  ///< storage: bf16, fp16, fp8_e4m3, fp8_e5m2
  Device device = Device::cpu();

  /// Throws kvattn::Error naming the first field that is out of range.
  void validate() const;
  int resolved_v_head_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};

/// The KV pool of all layers. Either owns its buffers (allocate) or wraps buffers the engine
/// owns (wrap). Copyable views are handed to kernels; the pool never moves its memory.
class KvCache {
 public:
  /// Allocates every layer's K and V on config.device, zero-filled.
  static KvCache allocate(const KvCacheConfig& config);
  /// Wraps engine-owned buffers: one K and one V view per layer, each contiguous with the
  /// shapes of the data model and config.dtype on config.device.
  static KvCache wrap(const KvCacheConfig& config, std::span<const TensorView> k_buffers,
                      std::span<const TensorView> v_buffers);

  const KvCacheConfig& config() const { return config_; }
  int num_layers() const { return config_.num_layers; }
  int page_size() const { return config_.page_size; }
  int64_t num_slots() const { return config_.num_slots; }
  int64_t num_pages() const { return config_.num_slots / config_.page_size; }

  /// [num_slots, num_kv_heads, head_dim]; throws on a bad layer_id.
  const TensorView& k_buffer(int layer_id) const;
  /// [num_slots, num_kv_heads, v_head_dim]
  const TensorView& v_buffer(int layer_id) const;

  /// Per-layer fp8 scales (1.0 by default; ignored for bf16/fp16 storage). Must be > 0.
  void set_scales(int layer_id, float k_scale, float v_scale);
  float k_scale(int layer_id) const;
  float v_scale(int layer_id) const;

 private:
  KvCacheConfig config_;
  std::vector<TensorView> k_;
  std::vector<TensorView> v_;
  std::vector<float> k_scales_;
  std::vector<float> v_scales_;
  std::vector<Buffer> owned_;
};

/// req_to_token: int32 [max_reqs, max_context_len]; row r lists the slot of each token of the
/// request that holds pool index r. Owns its buffer or wraps the engine's.
class ReqToTokenPool {
 public:
  static ReqToTokenPool allocate(int max_reqs, int max_context_len, Device device);
  /// Wraps an engine-owned contiguous int32 [max_reqs, max_context_len] tensor.
  static ReqToTokenPool wrap(const TensorView& req_to_token);

  int max_reqs() const { return int(table_.size(0)); }
  int max_context_len() const { return int(table_.size(1)); }
  const TensorView& table() const { return table_; }
  Device device() const { return table_.device(); }

  /// Writes `slots` into row `req`, positions [start, start + slots.size()). Host data; copies
  /// to the device when the pool lives there. Throws on an out-of-range row or span.
  void write(int req, int64_t start, std::span<const int32_t> slots);
  /// Reads positions [start, start + count) of row `req` back to the host.
  std::vector<int32_t> read(int req, int64_t start, int64_t count) const;

 private:
  TensorView table_;
  Buffer owned_;
};

/// Hands out pages of a KV pool and takes them back; never hands a page out twice. Host-only,
/// not thread-safe (an engine's scheduler owns it).
class SlotAllocator {
 public:
  /// `num_slots` as in KvCacheConfig; page 0 is reserved and never handed out.
  SlotAllocator(int64_t num_slots, int page_size);

  int page_size() const { return page_size_; }
  int64_t num_pages() const { return int64_t(in_use_.size()); }
  int64_t free_page_count() const { return int64_t(free_.size()); }
  int64_t free_slot_count() const { return free_page_count() * page_size_; }

  /// `count` page ids. Throws kOutOfResources (allocating nothing) when too few are free.
  std::vector<int32_t> allocate_pages(int64_t count);
  /// Slots for `count` more tokens of a request that already holds `current_len` tokens, the
  /// last of them in slot `last_slot` (ignored when current_len is a multiple of page_size):
  /// first fills the rest of the last page, then takes new pages. Token i of a request always
  /// sits at offset i % page_size of its page. Throws kOutOfResources, allocating nothing.
  std::vector<int32_t> allocate_tokens(int64_t current_len, int32_t last_slot, int64_t count);
  /// Frees pages; throws (freeing nothing) on page 0, an unknown page or a page not in use.
  void free_pages(std::span<const int32_t> pages);
  /// Frees the pages that hold these slots of one request (a page is freed once even when
  /// several of its slots are listed).
  void free_slots(std::span<const int32_t> slots);
  /// Frees everything.
  void reset();

 private:
  int page_size_;
  std::vector<int32_t> free_;
  std::vector<uint8_t> in_use_;
};

}  // namespace kvattn
