// The float64 oracle: attention computed by the direct formula, token by token and head by head.
//
// It shares nothing with the backends but the public types of include/kvattn/: no index
// building, no planning, no softmax state from src/. For every query token it lists the
// req_to_token positions the token may see (SPEC §2 modes, §3 variants), gathers their K/V from
// a float64 snapshot of the pool, and computes
//   x_j = q·k_j * scaling;  x_j = cap * tanh(x_j / cap) when logit_cap > 0
//   out = sum_j e^(x_j - m) v_j / sum_j e^(x_j - m),  lse = m + ln(sum_j e^(x_j - m))
// A token with no visible keys gets out = 0 and lse = -inf. With sinks (one logit s_h per q
// head, a key whose value is zero): the sums gain e^(s_h - m) (m over the keys and s_h), so
// out = sum_j e^(x_j) v_j / (e^(s_h) + sum_j e^(x_j)) and lse = ln(e^(s_h) + sum_j e^(x_j)); a
// token with no visible keys then gets out = 0 and lse = s_h.
#pragma once

#include <cstdint>
#include <vector>

#include "kvattn/forward_batch.h"

namespace kvattn::testing {

/// One layer's KV pool in float64, dequantized (stored value * scale for fp8). Slots the
/// engine never wrote hold NaN, so an oracle bug that reads them shows up as NaN.
struct RefKvPool {
  int64_t num_slots = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int v_head_dim = 0;
  std::vector<double> k;  ///< [num_slots, num_kv_heads, head_dim]
  std::vector<double> v;  ///< [num_slots, num_kv_heads, v_head_dim]

  static RefKvPool make(int64_t num_slots, int num_kv_heads, int head_dim, int v_head_dim);
  double* k_row(int64_t slot, int head) {
    return k.data() + (slot * num_kv_heads + head) * head_dim;
  }
  double* v_row(int64_t slot, int head) {
    return v.data() + (slot * num_kv_heads + head) * v_head_dim;
  }
  const double* k_row(int64_t slot, int head) const {
    return k.data() + (slot * num_kv_heads + head) * head_dim;
  }
  const double* v_row(int64_t slot, int head) const {
    return v.data() + (slot * num_kv_heads + head) * v_head_dim;
  }
};

/// This step's new K/V as the caller hands them to forward (values of the io dtype, exact in
/// double), in token order, and the slots they are saved at.
struct RefNewKv {
  std::vector<int32_t> slots;  ///< [n]
  std::vector<double> k;       ///< [n, num_kv_heads, head_dim]
  std::vector<double> v;       ///< [n, num_kv_heads, v_head_dim]
};

/// One step's batch on the host (the oracle's view of a ForwardBatch).
struct RefBatch {
  ForwardMode mode = ForwardMode::kDecode;
  std::vector<int32_t> req_pool_indices;  ///< [batch_size]
  /// [batch_size] as in ForwardBatch: tokens after this step (TARGET_VERIFY and multi-step
  /// draft: the committed prefix; encoder-decoder models: decoder tokens only).
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> prefix_lens;   ///< [batch_size] EXTEND / MIXED / DRAFT_EXTEND
  std::vector<int32_t> extend_lens;   ///< [batch_size] EXTEND / MIXED / DRAFT_EXTEND
  std::vector<int32_t> encoder_lens;  ///< [batch_size]; non-empty = encoder-decoder model
  int max_context_len = 0;
  std::vector<int32_t> req_to_token;  ///< [max_reqs, max_context_len]
  int draft_token_num = 0;            ///< TARGET_VERIFY
  std::vector<uint8_t> custom_mask;   ///< TARGET_VERIFY, layout of SpecInfo::custom_mask
  /// TARGET_VERIFY with a window layer: [batch_size * draft_token_num] absolute positions of
  /// the tree tokens (a tree token's position is seq_len + its depth, not its index). A key j
  /// (prefix: position j; tree token: its position) is visible to tree token i only when
  /// position_j >= position_i - W, on top of the mask.
  std::vector<int64_t> positions;
  int topk = 0;        ///< > 0: a multi-step draft step (mode must be kDecode)
  int draft_step = 0;  ///< which step, with topk > 0

  int batch_size() const { return int(seq_lens.size()); }
};

/// The oracle's answer.
struct RefOutput {
  int64_t num_tokens = 0;
  int num_q_heads = 0;
  int v_head_dim = 0;
  std::vector<double> out;  ///< [num_tokens, num_q_heads, v_head_dim]
  std::vector<double> lse;  ///< [num_tokens, num_q_heads] natural log; -inf without keys
};

/// Query tokens of the step (0 for IDLE; multi-step draft: batch_size * topk).
int64_t reference_num_tokens(const RefBatch& batch);

/// `x` as the pool stores and reads it back: bf16/fp16 round to the dtype (scale unused); fp8
/// rounds x / scale to the format (nearest even, saturating) and multiplies by scale.
double round_through_storage(double x, DType storage, double scale);

/// Models the save: writes the new K/V, rounded through the storage dtype, into their slots.
void reference_save_kv(RefKvPool& pool, const RefNewKv& new_kv, DType storage, double k_scale,
                       double v_scale);

/// Computes the attention of `layer` for the step. `q` is [num_tokens, num_q_heads, head_dim].
/// The pool must already hold this step's K/V (call reference_save_kv first when the step saves
/// them). `ragged_new_kv`, when given, models the ragged EXTEND path: a request's new tokens
/// (positions [prefix, seq) of EXTEND / MIXED requests) are read from these unrounded rows, in
/// token order, instead of from the pool.
/// `sinks`, when given, holds [num_q_heads] sink logits (the oracle never reads layer.sinks,
/// which may live on a device).
RefOutput reference_attention(const AttentionLayer& layer, const RefBatch& batch,
                              const RefKvPool& pool, const std::vector<double>& q,
                              const RefNewKv* ragged_new_kv = nullptr,
                              const std::vector<double>* sinks = nullptr);

/// A key a query token sees: the req_to_token position of its request, or (ragged path) a row
/// of the new K/V.
struct RefKey {
  int32_t slot = -1;         ///< pool slot, or -1
  int64_t new_kv_row = -1;   ///< row of RefNewKv, or -1
};

/// The keys query token `token` sees, in position order (exposed for tests of the oracle).
std::vector<RefKey> reference_visible_keys(const AttentionLayer& layer, const RefBatch& batch,
                                           int64_t token, bool ragged);

}  // namespace kvattn::testing
