// core::plan_cascade: which DECODE requests share a prefix of slots, and how much of it.
#include <gtest/gtest.h>

#include <vector>

#include "core/cascade.h"

namespace kvattn::core {
namespace {

// A DECODE layout over per-request slot lists.
struct Rows {
  PagedLayout layout;
  std::vector<int32_t> indices;
  explicit Rows(const std::vector<std::vector<int32_t>>& slots) {
    layout.batch_size = int(slots.size());
    layout.qo_indptr.push_back(0);
    layout.kv_indptr.push_back(0);
    for (const auto& s : slots) {
      layout.qo_indptr.push_back(layout.qo_indptr.back() + 1);
      layout.kv_start.push_back(0);
      layout.kv_len.push_back(int32_t(s.size()));
      layout.kv_indptr.push_back(layout.kv_indptr.back() + int64_t(s.size()));
      indices.insert(indices.end(), s.begin(), s.end());
    }
  }
};

std::vector<int32_t> run(int32_t first, int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = first + i;
  return v;
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(Cascade, GroupsRequestsSharingAPrefix) {
  const auto prompt = run(1000, 300);
  // 0 and 2 share 300 keys then differ; 1 is alone; 3 shares only 100 of them; 4 is the prompt
  // itself plus one key.
  const Rows rows({cat(prompt, run(5000, 40)), run(9000, 500), cat(prompt, run(6000, 7)),
                   cat(run(1000, 100), run(7000, 300)), cat(prompt, run(8000, 1))});
  const CascadePlan plan = plan_cascade(rows.layout, rows.indices, /*min_shared=*/64,
                                        /*align=*/64);
  // 3 shares 100 keys with the others, which rounds the group's common prefix to 64: 0, 2, 3, 4
  // form one group of 64 shared keys.
  ASSERT_EQ(plan.num_groups(), 1);
  EXPECT_EQ(plan.shared_len[0], 64);
  EXPECT_EQ(plan.group_indptr, (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(plan.shared_row[1], -1);
  for (int r : {0, 2, 3, 4}) EXPECT_GE(plan.shared_row[size_t(r)], 0) << r;

  // Without request 3, the group shares the whole 300-key prompt rounded down to 256.
  const Rows three({cat(prompt, run(5000, 40)), run(9000, 500), cat(prompt, run(6000, 7)),
                    cat(prompt, run(8000, 1))});
  const CascadePlan p3 = plan_cascade(three.layout, three.indices, 64, 64);
  ASSERT_EQ(p3.num_groups(), 1);
  EXPECT_EQ(p3.shared_len[0], 256);
  EXPECT_EQ(p3.members.size(), 3u);

  // A member whose queries do not see the shared keys (a verify mask hiding some) keeps its
  // group from forming; the predicate is asked with the group's shared length.
  int64_t asked = -1;
  const CascadePlan hidden = plan_cascade(three.layout, three.indices, 64, 64,
                                          [&](int32_t r, int64_t shared) {
                                            asked = shared;
                                            return r != 2;
                                          });
  EXPECT_TRUE(hidden.empty());
  EXPECT_EQ(asked, 256);
  EXPECT_EQ(plan_cascade(three.layout, three.indices, 64, 64,
                         [](int32_t, int64_t) { return true; })
                .num_groups(),
            1);
}

TEST(Cascade, EveryMemberKeepsAnOwnKeyAndShortPrefixesAreNotGrouped) {
  const auto prompt = run(1, 128);
  // Both requests are exactly the prompt: the shared part must leave each >= 1 own key.
  const Rows same({prompt, prompt});
  const CascadePlan p = plan_cascade(same.layout, same.indices, 64, 64);
  ASSERT_EQ(p.num_groups(), 1);
  EXPECT_EQ(p.shared_len[0], 64);  // 127 common keys at most, rounded down to 64
  // Below min_shared: no group.
  EXPECT_TRUE(plan_cascade(same.layout, same.indices, 200, 64).empty());
  // No shared first key: no group.
  const Rows apart({run(1, 300), run(400, 300)});
  EXPECT_TRUE(plan_cascade(apart.layout, apart.indices, 64, 64).empty());
}

TEST(Cascade, DeclaredGroupsBecomeAPlanInBatchOrder) {
  HostLengths lens;
  lens.seq_lens = {50, 60, 70, 80, 90, 100};
  lens.groups_declared = true;
  lens.shared_group = {1, -1, 0, 1, 0, 1};
  lens.shared_prefix_lens = {40, 25};
  const CascadePlan p = declared_cascade_plan(lens);
  ASSERT_EQ(p.num_groups(), 2);
  EXPECT_EQ(p.group_indptr, (std::vector<int32_t>{0, 2, 5}));
  EXPECT_EQ(p.members, (std::vector<int32_t>{2, 4, 0, 3, 5}));  // leaders: 2 and 0
  EXPECT_EQ(p.shared_len, (std::vector<int32_t>{40, 25}));
  EXPECT_EQ(p.shared_row, (std::vector<int32_t>{2, -1, 0, 3, 1, 4}));
  // Declared with no group at all: an empty plan.
  lens.shared_group = {-1, -1, -1, -1, -1, -1};
  lens.shared_prefix_lens.clear();
  EXPECT_TRUE(declared_cascade_plan(lens).empty());
}

TEST(Cascade, ABrokenPromiseIsNamed) {
  SharedPrefixViolation v;
  v.group = 2;
  v.shared_len = 37;
  v.entry = 5;
  v.row = 11;
  v.position = 36;
  v.slot = 900;
  v.leader = 1;
  v.leader_row = 3;
  v.leader_slot = 17;
  const NamedProblem slot = describe_shared_prefix_violation(v);
  EXPECT_EQ(slot.argument, "shared_prefix_lens_cpu[2]");
  for (const char* part : {"batch entry 5", "req_to_token[11][36] = 900",
                           "req_to_token[3][36] = 17", "batch entry 1"}) {
    EXPECT_NE(slot.message.find(part), std::string::npos) << part << ": " << slot.message;
  }
  v.mask = true;
  const NamedProblem mask = describe_shared_prefix_violation(v);
  EXPECT_EQ(mask.argument, "spec.custom_mask");
  EXPECT_NE(mask.message.find("key 36"), std::string::npos) << mask.message;
}

}  // namespace
}  // namespace kvattn::core
