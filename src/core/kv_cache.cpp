#include "kvattn/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/size_check.h"
#include "kvattn/error.h"

namespace kvattn {
namespace {

bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

std::string indexed(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

void check_kv_view(const TensorView& t, const std::string& name, const KvCacheConfig& c,
                   int dim) {
  check_arg(t.data() != nullptr, name, "is null");
  check_arg(t.dtype() == c.dtype, name, "dtype ", dtype_name(t.dtype()), ", expected ",
            dtype_name(c.dtype));
  check_arg(t.device() == c.device, name, "on ", t.device(), ", expected ",
            c.device);
  check_arg(t.ndim() == 3 && t.size(0) == c.num_slots && t.size(1) == c.num_kv_heads &&
                t.size(2) == dim,
            name, "shape ", t, ", expected [", c.num_slots, ", ", c.num_kv_heads,
            ", ", dim, "]");
  check_arg(t.is_contiguous(), name, "must be contiguous, got strides (", t.stride(0), ", ",
            t.stride(1), ", ", t.stride(2), ")");
}

}  // namespace

void KvCacheConfig::validate() const {
  check_arg(num_layers >= 1, "num_layers", "got ", num_layers, ", expected >= 1");
  check_arg(page_size >= 1 && page_size <= 128 && is_power_of_two(page_size), "page_size",
            "got ", page_size, ", expected a power of two in [1, 128]");
  check_arg(num_slots >= 2 * page_size && num_slots % page_size == 0, "num_slots", "got ",
            num_slots, ", expected a multiple of page_size ", page_size,
            " holding at least two pages (page 0 is reserved)");
  check_arg(num_kv_heads >= 1, "num_kv_heads", "got ", num_kv_heads, ", expected >= 1");
  check_arg(head_dim >= 1 && head_dim % 8 == 0, "head_dim", "got ", head_dim,
            ", expected a positive multiple of 8");
  const int vd = resolved_v_head_dim();
  check_arg(vd >= 1 && vd % 8 == 0, "v_head_dim", "got ", v_head_dim,
            ", expected a positive multiple of 8 (or 0 for head_dim)");
  check_arg(dtype == DType::kBFloat16 || dtype == DType::kFloat16 ||
                dtype == DType::kFloat8E4M3 || dtype == DType::kFloat8E5M2,
            "dtype", "got ", dtype_name(dtype),
            ", expected a KV storage dtype: bf16, fp16, fp8_e4m3 or fp8_e5m2");
}

KvCache KvCache::allocate(const KvCacheConfig& config) {
  config.validate();
  // Every byte count first, overflow-checked, against what the device can hold: an impossible
  // pool is refused at once with the numbers, before anything is allocated.
  const int vd = config.resolved_v_head_dim();
  const int64_t elem = dtype_size(config.dtype);
  const size_t k_bytes = core::checked_bytes(
      {config.num_slots, config.num_kv_heads, config.head_dim, elem}, "KvCache K buffer");
  const size_t v_bytes =
      core::checked_bytes({config.num_slots, config.num_kv_heads, vd, elem}, "KvCache V buffer");
  const size_t layer_bytes = core::checked_sum(k_bytes, v_bytes, "KvCache layer");
  core::check_fits(config.device,
                   core::checked_bytes({config.num_layers, int64_t(layer_bytes)}, "KvCache"),
                   "KvCache (" + std::to_string(config.num_layers) + " layers of K and V)");
  // All or nothing: a failed allocation unwinds `cache`, which frees every buffer made so far.
  KvCache cache;
  cache.config_ = config;
  cache.owned_.reserve(size_t(config.num_layers) * 2);
  cache.k_.reserve(size_t(config.num_layers));
  cache.v_.reserve(size_t(config.num_layers));
  for (int l = 0; l < config.num_layers; ++l) {
    Buffer k = Buffer::allocate(config.device, k_bytes);
    Buffer v = Buffer::allocate(config.device, v_bytes);
    fill_bytes(k.data(), config.device, 0, k_bytes);
    fill_bytes(v.data(), config.device, 0, v_bytes);
    cache.k_.push_back(
        k.view(config.dtype, {config.num_slots, config.num_kv_heads, config.head_dim}));
    cache.v_.push_back(v.view(config.dtype, {config.num_slots, config.num_kv_heads, vd}));
    cache.owned_.push_back(std::move(k));
    cache.owned_.push_back(std::move(v));
  }
  cache.k_scales_.assign(config.num_layers, 1.f);
  cache.v_scales_.assign(config.num_layers, 1.f);
  return cache;
}

KvCache KvCache::wrap(const KvCacheConfig& config, std::span<const TensorView> k_buffers,
                      std::span<const TensorView> v_buffers) {
  config.validate();
  check_arg(k_buffers.size() == size_t(config.num_layers), "k_buffers", "got ",
            k_buffers.size(), " layers, expected num_layers = ", config.num_layers);
  check_arg(v_buffers.size() == size_t(config.num_layers), "v_buffers", "got ",
            v_buffers.size(), " layers, expected num_layers = ", config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    check_kv_view(k_buffers[l], indexed("k_buffers", l), config, config.head_dim);
    check_kv_view(v_buffers[l], indexed("v_buffers", l), config, config.resolved_v_head_dim());
  }
  KvCache cache;
  cache.config_ = config;
  cache.k_.assign(k_buffers.begin(), k_buffers.end());
  cache.v_.assign(v_buffers.begin(), v_buffers.end());
  cache.k_scales_.assign(config.num_layers, 1.f);
  cache.v_scales_.assign(config.num_layers, 1.f);
  return cache;
}

const TensorView& KvCache::k_buffer(int layer_id) const {
  check_arg(layer_id >= 0 && layer_id < num_layers(), "layer_id", "got ", layer_id,
            ", expected 0..", num_layers() - 1);
  return k_[layer_id];
}

const TensorView& KvCache::v_buffer(int layer_id) const {
  check_arg(layer_id >= 0 && layer_id < num_layers(), "layer_id", "got ", layer_id,
            ", expected 0..", num_layers() - 1);
  return v_[layer_id];
}

void KvCache::set_scales(int layer_id, float k_scale, float v_scale) {
  check_arg(layer_id >= 0 && layer_id < num_layers(), "layer_id", "got ", layer_id,
            ", expected 0..", num_layers() - 1);
  check_arg(k_scale > 0.f && std::isfinite(k_scale), "k_scale", "got ", k_scale,
            ", expected a finite value > 0");
  check_arg(v_scale > 0.f && std::isfinite(v_scale), "v_scale", "got ", v_scale,
            ", expected a finite value > 0");
  k_scales_[layer_id] = k_scale;
  v_scales_[layer_id] = v_scale;
}

float KvCache::k_scale(int layer_id) const {
  k_buffer(layer_id);  // validates layer_id
  return k_scales_[layer_id];
}

float KvCache::v_scale(int layer_id) const {
  k_buffer(layer_id);
  return v_scales_[layer_id];
}

// ---- ReqToTokenPool ------------------------------------------------------------------------

ReqToTokenPool ReqToTokenPool::allocate(int max_reqs, int max_context_len, Device device) {
  check_arg(max_reqs >= 1, "max_reqs", "got ", max_reqs, ", expected >= 1");
  check_arg(max_context_len >= 1, "max_context_len", "got ", max_context_len,
            ", expected >= 1");
  ReqToTokenPool pool;
  const size_t bytes = core::checked_bytes({max_reqs, max_context_len, int64_t(sizeof(int32_t))},
                                           "req_to_token");
  core::check_fits(device, bytes,
                   "req_to_token [" + std::to_string(max_reqs) + ", " +
                       std::to_string(max_context_len) + "]");
  pool.owned_ = Buffer::allocate(device, bytes);
  fill_bytes(pool.owned_.data(), device, 0, bytes);  // unused positions point at padding slot 0
  pool.table_ = pool.owned_.view(DType::kInt32, {max_reqs, max_context_len});
  return pool;
}

ReqToTokenPool ReqToTokenPool::wrap(const TensorView& req_to_token) {
  check_arg(req_to_token.data() != nullptr, "req_to_token", "is null");
  check_arg(req_to_token.dtype() == DType::kInt32, "req_to_token", "dtype ",
            dtype_name(req_to_token.dtype()), ", expected int32");
  check_arg(req_to_token.ndim() == 2 && req_to_token.is_contiguous(), "req_to_token", "got ",
            req_to_token, ", expected a contiguous [max_reqs, max_context_len]");
  ReqToTokenPool pool;
  pool.table_ = req_to_token;
  return pool;
}

void ReqToTokenPool::write(int req, int64_t start, std::span<const int32_t> slots) {
  check_arg(req >= 0 && req < max_reqs(), "req", "got ", req, ", expected 0..",
            max_reqs() - 1);
  check_arg(start >= 0 && start + int64_t(slots.size()) <= max_context_len(), "start",
            "positions [", start, ", ", start + int64_t(slots.size()),
            ") outside max_context_len ", max_context_len());
  int32_t* dst = table_.data_as<int32_t>() + int64_t(req) * max_context_len() + start;
  copy_bytes(dst, device(), slots.data(), Device::cpu(), slots.size() * sizeof(int32_t));
}

std::vector<int32_t> ReqToTokenPool::read(int req, int64_t start, int64_t count) const {
  check_arg(req >= 0 && req < max_reqs(), "req", "got ", req, ", expected 0..",
            max_reqs() - 1);
  check_arg(start >= 0 && count >= 0 && start + count <= max_context_len(), "start",
            "positions [", start, ", ", start + count, ") outside max_context_len ",
            max_context_len());
  std::vector<int32_t> out(static_cast<size_t>(count));
  const int32_t* src = table_.data_as<const int32_t>() + int64_t(req) * max_context_len() + start;
  copy_bytes(out.data(), Device::cpu(), src, device(), out.size() * sizeof(int32_t));
  return out;
}

// ---- SlotAllocator -------------------------------------------------------------------------

SlotAllocator::SlotAllocator(int64_t num_slots, int page_size) : page_size_(page_size) {
  check_arg(page_size >= 1 && page_size <= 128 && is_power_of_two(page_size), "page_size",
            "got ", page_size, ", expected a power of two in [1, 128]");
  check_arg(num_slots >= 2 * page_size && num_slots % page_size == 0, "num_slots", "got ",
            num_slots, ", expected a multiple of page_size ", page_size,
            " holding at least two pages");
  in_use_.assign(size_t(num_slots / page_size), 0);
  reset();
}

void SlotAllocator::reset() {
  std::fill(in_use_.begin(), in_use_.end(), 0);
  in_use_[0] = 1;  // page 0 holds the padding slot: never handed out
  free_.clear();
  // Handed out from the back of free_, lowest page first.
  for (int64_t p = int64_t(in_use_.size()) - 1; p >= 1; --p) free_.push_back(int32_t(p));
}

std::vector<int32_t> SlotAllocator::allocate_pages(int64_t count) {
  check_arg(count >= 0, "count", "got ", count, ", expected >= 0");
  if (count > free_page_count()) {
    throw_error(ErrorKind::kOutOfResources, "count", "asked for ", count, " pages, only ",
                free_page_count(), " of ", num_pages() - 1, " are free");
  }
  std::vector<int32_t> pages(static_cast<size_t>(count));
  for (auto& p : pages) {
    p = free_.back();
    free_.pop_back();
    in_use_[p] = 1;
  }
  return pages;
}

std::vector<int32_t> SlotAllocator::allocate_tokens(int64_t current_len, int32_t last_slot,
                                                    int64_t count) {
  check_arg(current_len >= 0, "current_len", "got ", current_len, ", expected >= 0");
  check_arg(count >= 0, "count", "got ", count, ", expected >= 0");
  const int64_t offset = current_len % page_size_;
  int64_t from_last_page = 0;
  if (offset != 0) {
    const int64_t page = last_slot / page_size_;
    check_arg(last_slot >= 0 && page < num_pages() && in_use_[page] && page != 0 &&
                  last_slot % page_size_ == offset - 1,
              "last_slot", "got ", last_slot, ", expected an allocated slot at offset ",
              offset - 1, " of its page (current_len ", current_len, ", page_size ",
              page_size_, ")");
    from_last_page = std::min<int64_t>(count, page_size_ - offset);
  }
  const int64_t new_pages = (count - from_last_page + page_size_ - 1) / page_size_;
  std::vector<int32_t> pages = allocate_pages(new_pages);  // throws before anything changes
  std::vector<int32_t> slots;
  slots.reserve(size_t(count));
  for (int64_t i = 0; i < from_last_page; ++i) slots.push_back(int32_t(last_slot + 1 + i));
  for (int32_t page : pages) {
    for (int i = 0; i < page_size_ && int64_t(slots.size()) < count; ++i) {
      slots.push_back(page * page_size_ + i);
    }
  }
  return slots;
}

void SlotAllocator::free_pages(std::span<const int32_t> pages) {
  std::vector<uint8_t> seen(in_use_.size(), 0);
  for (size_t i = 0; i < pages.size(); ++i) {  // validate all before freeing any
    const int32_t p = pages[i];
    check_arg(p >= 1 && p < num_pages(), indexed("pages", int64_t(i)), "got ", p,
              ", expected a page in [1, ", num_pages() - 1, "]");
    check_arg(in_use_[p] && !seen[p], indexed("pages", int64_t(i)), "page ", p,
              " is not allocated (double free?)");
    seen[p] = 1;
  }
  for (int32_t p : pages) {
    in_use_[p] = 0;
    free_.push_back(p);
  }
}

void SlotAllocator::free_slots(std::span<const int32_t> slots) {
  std::vector<int32_t> pages;
  std::vector<uint8_t> seen(in_use_.size(), 0);
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t p = slots[i] / page_size_;
    check_arg(slots[i] >= 0 && p < num_pages(), indexed("slots", int64_t(i)), "got ", slots[i],
              ", expected a slot in [0, ", num_pages() * page_size_, ")");
    if (!seen[p]) {
      seen[p] = 1;
      pages.push_back(int32_t(p));
    }
  }
  free_pages(pages);
}

}  // namespace kvattn
