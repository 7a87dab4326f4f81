// Shared-prefix (cascade) attention planning (issue 16): DECODE requests whose req_to_token rows
// start with the same slots (a system prompt, few-shot examples, n-best sampling) read those
// keys once per group instead of once per request. The backend then runs two calls and one
// merge: every group's queries over its shared keys (one tile of many rows), every request over
// its own keys, and the merge of the two states per row (core::merge_weights). Host-only.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
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
  /// Leading keys request `request` shares with its group (0 when it is in none).
  int32_t shared_len_of(int32_t request) const;
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

/// The groups the engine declared (HostLengths::shared_group / shared_prefix_lens, validated by
/// read_host_lengths) as a plan: groups in id order, members in batch order within each; a
/// group's first member is its leader (its req_to_token row gives the shared keys).
CascadePlan declared_cascade_plan(const HostLengths& lens);

/// Whether a backend runs cascade attention at all: not in deterministic mode (the groups
/// depend on the batch, and so would the rounding) and not with KVATTN_CASCADE=0 (read once).
bool cascade_enabled(bool deterministic);

/// A broken shared-prefix promise (ForwardBatch::shared_prefix_lens_cpu): batch entry `entry`
/// of group `group` holds `slot` at req_to_token position `position` where the group's leader
/// holds `leader_slot` (mask == false), or one of its tree tokens' masks hides that shared key
/// (mask == true). Rows are the entries' req_to_token rows.
struct SharedPrefixViolation {
  int64_t group = -1;
  int64_t shared_len = 0;
  int64_t entry = -1;
  int64_t row = -1;
  int64_t position = -1;
  int64_t slot = -1;
  int64_t leader = -1;
  int64_t leader_row = -1;
  int64_t leader_slot = -1;
  bool mask = false;
};
/// The argument at fault (shared_prefix_lens_cpu[g], or spec.custom_mask) and what was wrong:
/// both backends name a broken promise this way.
struct NamedProblem {
  std::string argument;
  std::string message;
};
NamedProblem describe_shared_prefix_violation(const SharedPrefixViolation& v);

}  // namespace kvattn::core
