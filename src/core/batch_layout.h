// Host planning shared by every backend: from a ForwardBatch (host lengths) to the per-request
// query rows and KV ranges that one attention call covers, for each index set.
//
// A request's KV range is the positions [kv_start, kv_start + kv_len) of its req_to_token row.
// With mask kCausal the queries are bottom-right aligned: query i of q_len sees relative KV
// positions j <= kv_len - q_len + i (and, with a window W, j >= kv_len - q_len + i - W).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvattn/forward_batch.h"

namespace kvattn::core {

enum class MaskMode : uint8_t { kNone, kCausal, kCustom };

/// Which KV tokens of a request one layer attends to (SPEC §3).
enum class IndexSet : uint8_t {
  kFull,         ///< all of the request's tokens
  kWindow,       ///< the last W + q_len tokens (decode: min(seq_len, W + 1))
  kDecoderSelf,  ///< cross-attention models, self-attention layers: after the encoder tokens
  kEncoder,      ///< cross-attention layers: the encoder tokens [0, encoder_len), non-causal
};

/// One batched attention over the paged cache, on the host.
struct PagedLayout {
  int batch_size = 0;
  std::vector<int32_t> qo_indptr;    ///< [batch_size + 1] query rows of each request
  std::vector<int32_t> kv_start;     ///< [batch_size] first req_to_token position
  std::vector<int32_t> kv_len;       ///< [batch_size] KV tokens
  std::vector<int64_t> kv_indptr;    ///< [batch_size + 1] prefix sums of kv_len
  std::vector<int64_t> mask_indptr;  ///< [batch_size + 1] kCustom: offsets into the custom mask
  MaskMode mask = MaskMode::kCausal;
  int window_left = -1;              ///< -1 = none
  int64_t total_q() const { return qo_indptr.empty() ? 0 : qo_indptr.back(); }
  int64_t total_kv() const { return kv_indptr.empty() ? 0 : kv_indptr.back(); }
};

/// Host copies of a batch's lengths (int64 tensors narrowed and checked on the way in).
struct HostLengths {
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> prefix_lens;   ///< EXTEND-like modes; else empty
  std::vector<int32_t> extend_lens;   ///< EXTEND-like modes; else empty
  std::vector<int32_t> encoder_lens;  ///< cross-attention models; else empty
  /// Shared-prefix groups the engine declared (ForwardBatch::shared_prefix_group_cpu and
  /// shared_prefix_lens_cpu), validated: each id in [-1, num_groups), every group >= 2 members,
  /// each length >= 1 and leaving every member its own keys. Empty when not given.
  bool groups_declared = false;          ///< shared_prefix_group_cpu was given
  std::vector<int32_t> shared_group;     ///< [batch_size] group of each request, -1 = none
  std::vector<int32_t> shared_prefix_lens;  ///< [num_groups]
};

/// EXTEND, MIXED and DRAFT_EXTEND: the modes whose requests carry new tokens after a prefix.
bool is_extend_like(ForwardMode mode);

/// Reads the host lengths of `batch` (the *_cpu copies where given, else the tensors when they
/// are on the host) and validates them (>= 0, prefix <= seq, extend = seq - prefix, ...).
HostLengths read_host_lengths(const ForwardBatch& batch, bool is_encoder_decoder);

/// The index set a layer uses in a model of this kind.
IndexSet index_set_for(const AttentionLayer& layer, bool is_encoder_decoder);

/// Query rows and KV ranges of every request for `mode` and `set`. For EXTEND-like modes
/// `prefix_only` gives the paged-prefix half of the ragged path: kv = [0, prefix), no mask.
PagedLayout make_paged_layout(ForwardMode mode, IndexSet set, int window, const HostLengths& lens,
                              int draft_token_num, bool prefix_only = false);

/// The ragged half of the ragged path: queries and keys are the new tokens, causal.
PagedLayout make_ragged_layout(const HostLengths& lens);

/// Step `step` (0-based) of the multi-step draft over requests of committed lengths `seq_lens`,
/// `topk` branches each (branch b's draft token of step t at req_to_token position
/// seq + t * topk + b). Keys always start at req_to_token position 0 (kv_start 0).
/// - shared_prefix: one entry a request, its topk branches its query rows, keys the prefix and
///   every draft token of steps 0..step (kv_len seq + (step + 1) * topk, in req_to_token order),
///   kCustom: mask_indptr for mask rows of kv_len columns (full_mask_rows) or of only the
///   (step + 1) * topk draft columns (the decode-shaped CUDA kernel's short rows, the prefix
///   before them visible). The backend's branch mask keeps a branch's own draft tokens.
/// - else: one decode entry a (request, branch), r * topk + b, keys the prefix then the branch's
///   draft tokens (kv_len seq + step + 1, causal; the index set gathers the branch's slots).
PagedLayout make_draft_step_layout(std::span<const int32_t> seq_lens, int topk, int step,
                                   bool shared_prefix, bool full_mask_rows);

/// The facts of a backend's configuration that the EXTEND path choice reads.
struct RaggedExtendRule {
  int64_t threshold = 4096;  ///< BackendConfig::ragged_extend_threshold
  bool has_window = false;
  bool is_encoder_decoder = false;
  bool deterministic = false;
  /// The KV cache stores k/v in the q dtype: a ragged pass reads exactly what a paged one would.
  bool cache_is_io_dtype = true;
};

/// True when EXTEND takes the ragged + paged-prefix path (SPEC §3): at least `threshold` new
/// tokens and more new tokens than cached prefix tokens (sum of the prefix lengths); or a step
/// with no cached prefix at all, at any size, where the cache holds k/v unchanged (one pass over
/// the step's contiguous k/v: no gather and nothing to merge; 1 x 1024 on the H200's Hopper
/// kernel ~32 us against ~37 us paged). Both extra rules are ours: the path costs a second pass
/// over the output (the merge of two fp32 states) and a second read of Q, which a step whose
/// keys are mostly cached prefix does not earn back (8 x (4096 + 512) on the H200: one pass 0.74
/// ms, ragged + merge 0.88 ms); and with an fp8 / narrower cache a small prefill keeps reading
/// the rounded keys the later decode steps read. threshold 0 forces the path (tests). Never with
/// a window, cross-attention or `deterministic` (BackendConfig::deterministic: whether a step
/// takes it depends on the step).
bool use_ragged_extend(ForwardMode mode, int64_t num_new_tokens, int64_t num_prefix_tokens,
                       const RaggedExtendRule& rule);

}  // namespace kvattn::core

namespace kvattn::core {

/// TARGET_VERIFY on a sliding-window layer: tree tokens do not sit at consecutive positions, so
/// the window cannot be a bound on column indices. It is folded into the tree mask instead:
/// tree token i (absolute position positions[i]) keeps kv column j only when column j's position
/// (j for the prefix, positions[t] for tree token t = j - seq_len) is >= positions[i] - window.
/// `custom_mask` and the result are laid out as SpecInfo::custom_mask; `positions` holds
/// batch_size * draft_token_num host positions.
std::vector<uint8_t> fold_window_into_tree_mask(const HostLengths& lens, int draft_token_num,
                                                int window, const uint8_t* custom_mask,
                                                const int64_t* positions);

}  // namespace kvattn::core
