// Checking a backend's output against the float64 reference (src/reference/reference.h) on
// worlds too big to snapshot whole: only the slots the checked requests reference are copied
// off the device and decoded, into a compact pool whose slot ids the oracle's own req_to_token
// rows use.
#pragma once

#include <cstdint>
#include <vector>

#include "kvattn/kvattn.h"
#include "reference/reference.h"
#include "step_batch.h"
#include "tool_support.h"

namespace kvattn::tools {

/// A compact float64 copy of some slots of one layer.
struct CompactPool {
  testing::RefKvPool pool;  ///< slot 0 is an unused NaN slot; referenced slots are 1..n
  /// The oracle-side req_to_token: rows of compact slot ids, [num_rows, max_context_len].
  std::vector<int32_t> req_to_token;
  int max_context_len = 0;
};

/// Copies the slots listed in `rows` (one list per oracle request row, position order) of layer
/// `layer_id` off the cache's device, dequantized, and rewrites them as compact ids.
CompactPool snapshot_rows(const KvCache& cache, int layer_id,
                          const std::vector<std::vector<int32_t>>& rows);

/// Rows `rows` of a host tensor whose rows hold `row_elems` values, as doubles (the oracle's q).
std::vector<double> gather_rows_as_double(const TensorView& host, const std::vector<int64_t>& rows,
                                          int64_t row_elems);

/// max over (token, head) of max|out - ref| / max|ref| for out rows `out_rows` (host tensor,
/// [num_tokens, num_q_heads * v_head_dim]) against ref tokens 0..n-1. A NaN or an output where
/// the reference has none counts as +inf; a reference row of zeros compares absolutely.
double max_rel_err(const testing::RefOutput& ref, const TensorView& out_host,
                   const std::vector<int64_t>& out_rows);

/// Per request of a step: its query rows in q / out and how many req_to_token positions its
/// keys span (the step's new tokens are the last q_len of them).
struct StepRequestRows {
  int64_t first_row = 0;
  int64_t q_len = 0;
  int kv_extent = 0;
};
std::vector<StepRequestRows> step_request_rows(const StepSpec& spec);

/// The requests a step's check takes: a random order, each kept while the oracle's (query, key)
/// pairs stay within `pair_budget` (the first always), at most `max_requests`; sorted.
std::vector<size_t> pick_checked_requests(const std::vector<StepRequestRows>& rows,
                                          int64_t pair_budget, size_t max_requests, Rng& rng);

/// A step's host inputs (q, and the new k / v the step saves) as [tokens, heads, dim] views.
struct StepHostInputs {
  TensorView q_host, k_host, v_host;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  DType kv_dtype = DType::kBFloat16;
};

/// The picked requests' outputs in `out` (layer `layer`) against the float64 reference: the
/// slots each reads (`slot_rows[k]`: positions [0, kv_extent) of picked request k, as the backend
/// read them) are snapshot off the cache, the step's new K/V are saved into that copy as the
/// oracle models the save (so a wrong save by the backend shows too), and the max relative
/// error (max_rel_err) is returned.
double check_step_requests(const KvCache& cache, const AttentionLayer& layer, const StepSpec& spec,
                           const std::vector<StepRequestRows>& rows,
                           const std::vector<size_t>& picked,
                           const std::vector<std::vector<int32_t>>& slot_rows,
                           const StepHostInputs& inputs, const TensorView& out);

}  // namespace kvattn::tools
