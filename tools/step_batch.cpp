#include "step_batch.h"

#include <algorithm>
#include <cstddef>
#include <numeric>

namespace kvattn::tools {

std::vector<int> random_tree_parents(int num_tokens, int chain, Rng& rng) {
  std::vector<int> parent(size_t(std::max(num_tokens, 0)), -1);
  for (int i = 1; i < num_tokens; ++i) {
    parent[size_t(i)] = i < chain ? i - 1 : int(rng.uniform_int(0, i - 1));
  }
  return parent;
}

void append_tree_mask(int prefix_len, const std::vector<int>& parent, std::vector<uint8_t>& mask) {
  const size_t kv_len = size_t(prefix_len) + parent.size();
  for (size_t i = 0; i < parent.size(); ++i) {
    const size_t row = mask.size();
    mask.resize(row + kv_len, 0);
    std::fill_n(mask.begin() + ptrdiff_t(row), prefix_len, uint8_t(1));
    for (int a = int(i); a >= 0; a = parent[size_t(a)]) mask[row + size_t(prefix_len + a)] = 1;
  }
}

StepBatch::StepBatch(const StepSpec& spec, Device device, KvCache* kv_cache,
                     const ReqToTokenPool* req_to_token_pool)
    : spec_(spec),
      req_pool_indices_(spec.req_pool_indices, device),
      seq_lens_(spec.seq_lens, device),
      out_cache_loc_(spec.out_cache_loc, device) {
  batch_.mode = spec.mode;
  batch_.batch_size = int(spec.seq_lens.size());
  batch_.req_pool_indices = req_pool_indices_.device_view();
  batch_.seq_lens = seq_lens_.device_view();
  batch_.seq_lens_cpu = seq_lens_.host_view();
  batch_.seq_lens_sum = std::accumulate(spec.seq_lens.begin(), spec.seq_lens.end(), int64_t(0));
  if (!spec.prefix_lens.empty()) {
    prefix_lens_ = MirroredIndex(spec.prefix_lens, device);
    extend_lens_ = MirroredIndex(spec.extend_lens, device);
    batch_.extend_prefix_lens = prefix_lens_.device_view();
    batch_.extend_prefix_lens_cpu = prefix_lens_.host_view();
    batch_.extend_seq_lens = extend_lens_.device_view();
    batch_.extend_seq_lens_cpu = extend_lens_.host_view();
  }
  batch_.out_cache_loc = out_cache_loc_.device_view();
  if (spec.mode == ForwardMode::kTargetVerify) {
    batch_.spec.draft_token_num = spec.draft_token_num;
    const int64_t mask_bytes = int64_t(spec.custom_mask.size());
    custom_mask_ = Buffer::allocate(device, size_t(std::max<int64_t>(mask_bytes, 1)));
    copy_bytes(custom_mask_.data(), device, spec.custom_mask.data(), Device::cpu(),
               size_t(mask_bytes));
    batch_.spec.custom_mask = custom_mask_.view(DType::kUInt8, {mask_bytes});
  }
  if (spec.declare_groups) {
    shared_prefix_group_ = MirroredIndex(spec.shared_prefix_group, Device::cpu());
    shared_prefix_lens_ = MirroredIndex(spec.shared_prefix_lens, Device::cpu());
    batch_.shared_prefix_group_cpu = shared_prefix_group_.host_view();
    batch_.shared_prefix_lens_cpu = shared_prefix_lens_.host_view();
  }
  batch_.kv_cache = kv_cache;
  batch_.req_to_token_pool = req_to_token_pool;
}

}  // namespace kvattn::tools
