// One step's ForwardBatch built from host vectors, with the device tensors (and host copies) it
// points to owned alongside it.
#pragma once

#include <cstdint>
#include <vector>

#include "kvattn/kvattn.h"
#include "tool_support.h"

namespace kvattn::tools {

/// What a step is, on the host.
struct StepSpec {
  ForwardMode mode = ForwardMode::kDecode;
  std::vector<int32_t> req_pool_indices;  ///< [batch_size]
  std::vector<int32_t> seq_lens;          ///< [batch_size] (verify: the committed prefix)
  std::vector<int32_t> prefix_lens;       ///< [batch_size] EXTEND-like modes only
  std::vector<int32_t> extend_lens;       ///< [batch_size] EXTEND-like modes only
  std::vector<int32_t> out_cache_loc;     ///< [num_tokens]
  int draft_token_num = 0;                ///< TARGET_VERIFY
  std::vector<uint8_t> custom_mask;       ///< TARGET_VERIFY, SpecInfo::custom_mask layout
  /// Shared-prefix groups the step declares (ForwardBatch::shared_prefix_group_cpu /
  /// shared_prefix_lens_cpu; host tensors): given when declare_groups (even with no group).
  bool declare_groups = false;
  std::vector<int32_t> shared_prefix_group;  ///< [batch_size], -1 = none
  std::vector<int32_t> shared_prefix_lens;   ///< [num_groups]
};

/// A random draft tree of `num_tokens` tokens for TARGET_VERIFY: parent[i] is the tree token
/// that token i hangs off, or -1 for the root (the committed prefix; token 0 only). Tokens
/// 0..chain-1 form a main chain (each the child of the one before: the tokens the demo and the
/// soak may accept); every later token hangs off a uniform draw among the tokens before it.
/// chain <= 1: a random tree throughout. Draws from `rng` once per token past the chain.
std::vector<int> random_tree_parents(int num_tokens, int chain, Rng& rng);

/// Appends one request's TARGET_VERIFY rows to `mask` (SpecInfo::custom_mask layout: tree token
/// i's row of prefix_len + parent.size() columns): tree token i sees the whole prefix, its
/// ancestors and itself.
void append_tree_mask(int prefix_len, const std::vector<int>& parent, std::vector<uint8_t>& mask);

/// Owns the tensors of one ForwardBatch. Not movable: the batch points into it.
class StepBatch {
 public:
  StepBatch(const StepSpec& spec, Device device, KvCache* kv_cache,
            const ReqToTokenPool* req_to_token_pool);
  StepBatch(const StepBatch&) = delete;
  StepBatch& operator=(const StepBatch&) = delete;

  const ForwardBatch& batch() const { return batch_; }
  const StepSpec& spec() const { return spec_; }

 private:
  StepSpec spec_;
  MirroredIndex req_pool_indices_;
  MirroredIndex seq_lens_;
  MirroredIndex prefix_lens_;
  MirroredIndex extend_lens_;
  MirroredIndex out_cache_loc_;
  MirroredIndex shared_prefix_group_;
  MirroredIndex shared_prefix_lens_;
  Buffer custom_mask_;
  ForwardBatch batch_;
};

}  // namespace kvattn::tools
