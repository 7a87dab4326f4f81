#include "core/cascade.h"

#include <algorithm>
#include <map>

namespace kvattn::core {

CascadePlan plan_cascade(const PagedLayout& layout, std::span<const int32_t> kv_indices,
                         int min_shared, int align,
                         const std::function<bool(int32_t request, int64_t shared)>& sees_shared) {
  CascadePlan plan;
  const int batch = layout.batch_size;
  plan.shared_row.assign(size_t(batch), -1);
  plan.group_indptr.push_back(0);
  if (min_shared < 1 || align < 1) return plan;
  // Candidates by their first key's slot (requests that share a prefix share it).
  std::map<int32_t, std::vector<int32_t>> by_first;
  for (int r = 0; r < batch; ++r) {
    if (layout.kv_len[size_t(r)] <= min_shared) continue;  // must keep >= 1 own key
    by_first[kv_indices[size_t(layout.kv_indptr[size_t(r)])]].push_back(r);
  }
  for (const auto& [first_slot, requests] : by_first) {
    (void)first_slot;
    if (requests.size() < 2) continue;
    const int32_t lead = requests.front();
    const int32_t* lead_keys = kv_indices.data() + layout.kv_indptr[size_t(lead)];
    int64_t common = layout.kv_len[size_t(lead)] - 1;
    for (size_t i = 1; i < requests.size() && common >= min_shared; ++i) {
      const int32_t r = requests[i];
      const int32_t* keys = kv_indices.data() + layout.kv_indptr[size_t(r)];
      const int64_t limit = std::min<int64_t>(common, layout.kv_len[size_t(r)] - 1);
      int64_t same = 0;
      while (same < limit && keys[same] == lead_keys[same]) ++same;
      common = same;
    }
    const int64_t shared = common / align * align;
    if (shared < min_shared) continue;
    if (sees_shared && !std::all_of(requests.begin(), requests.end(),
                                    [&](int32_t r) { return sees_shared(r, shared); })) {
      continue;
    }
    for (int32_t r : requests) {
      plan.shared_row[size_t(r)] = int32_t(plan.members.size());
      plan.members.push_back(r);
    }
    plan.group_indptr.push_back(int32_t(plan.members.size()));
    plan.shared_len.push_back(int32_t(shared));
  }
  return plan;
}

}  // namespace kvattn::core
