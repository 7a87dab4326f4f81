#include "core/cascade.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
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

CascadePlan declared_cascade_plan(const HostLengths& lens) {
  CascadePlan plan;
  const size_t batch = lens.shared_group.size();
  const size_t groups = lens.shared_prefix_lens.size();
  plan.shared_row.assign(batch, -1);
  plan.group_indptr.assign(groups + 1, 0);
  for (int32_t g : lens.shared_group) {
    if (g >= 0) ++plan.group_indptr[size_t(g) + 1];
  }
  for (size_t g = 0; g < groups; ++g) plan.group_indptr[g + 1] += plan.group_indptr[g];
  plan.members.resize(size_t(plan.group_indptr.back()));
  std::vector<int32_t> next(plan.group_indptr.begin(), plan.group_indptr.end() - 1);
  for (size_t r = 0; r < batch; ++r) {
    const int32_t g = lens.shared_group[r];
    if (g < 0) continue;
    const int32_t row = next[size_t(g)]++;
    plan.members[size_t(row)] = int32_t(r);
    plan.shared_row[r] = row;
  }
  plan.shared_len = lens.shared_prefix_lens;
  return plan;
}

bool cascade_enabled(bool deterministic) {
  static const bool enabled = [] {
    const char* v = std::getenv("KVATTN_CASCADE");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled && !deterministic;
}

NamedProblem describe_shared_prefix_violation(const SharedPrefixViolation& v) {
  const std::string g = std::to_string(v.group);
  const std::string e = std::to_string(v.entry);
  const std::string where = "batch entry " + e + " (req_pool_indices[" + e + "] = " +
                            std::to_string(v.row) + ") of shared-prefix group " + g +
                            " (shared_prefix_lens_cpu[" + g + "] = " +
                            std::to_string(v.shared_len) + ")";
  if (v.mask) {
    return {"spec.custom_mask",
            "a tree token of " + where + " does not see key " + std::to_string(v.position) +
                " of the group's shared prefix; with shared-prefix groups every tree token must "
                "see the whole shared prefix"};
  }
  const std::string pos = std::to_string(v.position);
  return {"shared_prefix_lens_cpu[" + g + "]",
          where + " does not share the group's prefix: req_to_token[" + std::to_string(v.row) +
              "][" + pos + "] = " + std::to_string(v.slot) + ", the group's first member (batch "
              "entry " + std::to_string(v.leader) + ") has req_to_token[" +
              std::to_string(v.leader_row) + "][" + pos + "] = " +
              std::to_string(v.leader_slot) +
              "; the members of a group must hold the same slots in their first "
              "shared_prefix_lens_cpu[" + g + "] positions"};
}

int32_t CascadePlan::shared_len_of(int32_t request) const {
  const int32_t row = shared_row[size_t(request)];
  if (row < 0) return 0;
  const auto g = std::upper_bound(group_indptr.begin(), group_indptr.end(), row) -
                 group_indptr.begin() - 1;
  return shared_len[size_t(g)];
}

}  // namespace kvattn::core
