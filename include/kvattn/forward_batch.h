// kvattn — one attention layer's description and one step's batch.
#pragma once

#include <cstdint>

#include "kvattn/tensor.h"

namespace kvattn {

class KvCache;
class ReqToTokenPool;

/// One attention layer (the reference's RadixAttention).
struct AttentionLayer {
  int layer_id = 0;
  int num_q_heads = 0;   ///< a multiple of num_kv_heads (GQA; MQA when num_kv_heads == 1)
  int num_kv_heads = 0;
  int head_dim = 0;      ///< of q and k
  int v_head_dim = 0;    ///< of v and the output; 0 means head_dim
  float scaling = 0.f;   ///< softmax scale applied to q·k, usually 1/sqrt(head_dim); > 0
  float logit_cap = 0.f; ///< soft-cap: x -> cap * tanh(x / cap) when > 0; 0 = off
  int sliding_window_size = -1;  ///< W: position p sees [max(0, p - W), p]; -1 = full attention
  bool is_cross_attention = false;  ///< attends to the request's encoder tokens, non-causal
  /// fp8 KV scales; <= 0 means "use the KV cache's scales for this layer" (the default).
  float k_scale = 0.f;
  float v_scale = 0.f;
  /// Attention sinks (gpt-oss and others): [num_q_heads] fp32, bf16 or fp16 on the backend's
  /// device, contiguous; undefined = none. Head h's sink s_h is a logit (in the units of the
  /// scaled, soft-capped q·k) with a zero value vector that joins every query's softmax:
  /// out = sum_j e^(x_j) v_j / (e^(s_h) + sum_j e^(x_j)). Every mode and variant, the
  /// multi-step draft backend's steps included.
  TensorView sinks;

  int resolved_v_head_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
  int group_size() const { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }
};

/// The forward modes of SPEC §2.
enum class ForwardMode : uint8_t {
  kIdle,          ///< no tokens: the output is [0, num_q_heads * v_head_dim]
  kDecode,        ///< one new token per request
  kExtend,        ///< extend_seq_lens[r] new tokens after a cached prefix of extend_prefix_lens[r]
  kMixed,         ///< extend and decode requests in one batch (a decode request extends by 1)
  kTargetVerify,  ///< draft_token_num tree tokens per request, under a custom mask
  kDraftExtend,   ///< like kExtend, always by the paged path
};

const char* forward_mode_name(ForwardMode mode);

/// Speculative-decoding inputs.
struct SpecInfo {
  /// TARGET_VERIFY: tree tokens per request. Their K/V sit in req_to_token at
  /// [seq_len, seq_len + draft_token_num) of the request (seq_lens count the committed prefix).
  int draft_token_num = 0;
  /// TARGET_VERIFY: uint8 (0/1) [sum_r draft_token_num * (seq_len_r + draft_token_num)], request
  /// after request, each a row-major [draft_token_num, seq_len_r + draft_token_num] matrix:
  /// mask[i][j] != 0 lets tree token i see kv token j. The prefix columns should be all 1.
  TensorView custom_mask;
  /// Multi-step draft: branches per request and draft steps (see MultiStepDraftBackend).
  int topk = 0;
  int num_steps = 0;
};

/// Everything one step needs (the reference's ForwardBatch). Index tensors are int32 or int64,
/// 1-D, on the backend's device; the *_cpu copies are host tensors that a GPU backend reads for
/// planning (a CPU backend may leave them absent: it reads the device tensors directly).
struct ForwardBatch {
  ForwardMode mode = ForwardMode::kDecode;
  int batch_size = 0;
  TensorView req_pool_indices;  ///< [batch_size] rows of req_to_token
  TensorView seq_lens;          ///< [batch_size] tokens of each request after this step
                                ///< (TARGET_VERIFY: before the tree tokens; cross-attention
                                ///< models: decoder tokens only)
  TensorView seq_lens_cpu;      ///< host copy of seq_lens
  int64_t seq_lens_sum = -1;    ///< sum of seq_lens; -1 = compute it
  TensorView extend_prefix_lens;      ///< [batch_size] EXTEND/MIXED/DRAFT_EXTEND
  TensorView extend_prefix_lens_cpu;  ///< host copy
  TensorView extend_seq_lens;         ///< [batch_size] new tokens: seq_len - prefix_len
  TensorView extend_seq_lens_cpu;     ///< host copy
  TensorView out_cache_loc;  ///< [num_tokens] slots for this step's new K/V (slot 0 = padding)
  TensorView encoder_lens;   ///< [batch_size] cross-attention models only
  TensorView encoder_lens_cpu;        ///< host copy
  TensorView encoder_out_cache_loc;   ///< [sum encoder_lens] slots for encoder K/V, when saved
  TensorView positions;      ///< [num_tokens] absolute positions (TARGET_VERIFY with a window)
  SpecInfo spec;
  /// Shared-prefix (cascade) groups the engine declares (optional; DECODE and TARGET_VERIFY):
  /// requests whose req_to_token rows start with the same slots (a system prompt, few-shot
  /// examples, n-best sampling). A backend may then read those keys once per group instead of
  /// once per request; the output is the same attention either way. Host int32/int64 tensors:
  ///  - shared_prefix_group_cpu [batch_size]: the group of each request, -1 = none. A group has
  ///    >= 2 members, which need not be adjacent; ids are 0 .. num_groups - 1, each used.
  ///  - shared_prefix_lens_cpu [num_groups]: how many leading req_to_token positions the
  ///    group's members share, >= 1 and (DECODE) < every member's seq_len, (TARGET_VERIFY)
  ///    <= every member's seq_len: each member keeps its own keys after the shared ones.
  /// The promise: for every member, req_to_token[row][0, len) holds the same slots as for the
  /// group's first member (and, TARGET_VERIFY, every tree token's mask shows those keys). A
  /// step that breaks it is refused like one with a bad index (CPU: the call throws; CUDA: the
  /// device checks it and check_errors reports it), naming shared_prefix_lens_cpu[g] and the
  /// request. Given (even with no group), the backend uses these groups only and detects none
  /// itself (the CPU backend otherwise groups requests on its own); KVATTN_CASCADE=0 and
  /// deterministic mode ignore the groups (the lengths are still validated).
  TensorView shared_prefix_group_cpu;
  TensorView shared_prefix_lens_cpu;
  const ReqToTokenPool* req_to_token_pool = nullptr;
  KvCache* kv_cache = nullptr;

  /// Query tokens this step carries: 0 for IDLE, batch_size for DECODE, the sum of
  /// extend_seq_lens for EXTEND/MIXED/DRAFT_EXTEND, batch_size * draft_token_num for verify.
  /// Reads host lengths (the *_cpu copies, or the tensors themselves when on the host).
  int64_t num_tokens() const;
};

}  // namespace kvattn
