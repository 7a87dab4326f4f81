// Shared-prefix (cascade) attention planning (issue 16): DECODE requests whose req_to_token rows
// start with the same slots (a system prompt, few-shot examples, n-best sampling) read those
// keys once per group instead of once per request. The backend then runs two calls and one
// merge: every group's queries over its shared keys (one tile of many rows), every request over
// its own keys, and the merge of the two states per row (core::merge_weights). Host-only.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/batch_layout.h"

namespace kvattn::core {

struct CascadePlan {
  std::vector<int32_t> group_indptr;  ///< [num_groups + 1] into members
  std::vector<int32_t> members;       ///< request indices, grouped
  std::vector<int32_t> shared_len;    ///< [num_groups] leading keys every member shares
  std::vector<int32_t> shared_row;    ///< [batch_size] the request's query row in the shared
                                      ///< call (its place in `members`), -1 when not grouped
  int num_groups() const { return int(shared_len.size()); }
  bool empty() const { return shared_len.empty(); }
};

/// Groups the requests of a DECODE or TARGET_VERIFY layout (layout.kv_indptr over kv_indices,
/// the slots of each request's keys in position order) whose first `min_shared` or more keys
/// are the same slots. A group has >= 2 members; its shared length is the members' common
/// prefix rounded down to `align`, at least min_shared, and leaves every member >= 1 own key.
/// `sees_shared`, when given, is asked per member whether all its queries see its first `shared`
/// keys (TARGET_VERIFY: the tree mask's prefix columns); a group with a member that does not is
/// not formed.
CascadePlan plan_cascade(const PagedLayout& layout, std::span<const int32_t> kv_indices,
                         int min_shared, int align,
                         const std::function<bool(int32_t request, int64_t shared)>& sees_shared =
                             nullptr);

}  // namespace kvattn::core
