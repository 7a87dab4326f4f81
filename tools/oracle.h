// Checking a backend's output against the float64 reference (src/reference/reference.h) on
// worlds too big to snapshot whole: only the slots the checked requests reference are copied
// off the device and decoded, into a compact pool whose slot ids the oracle's own req_to_token
// rows use.
#pragma once

#include <cstdint>
#include <vector>

#include "kvattn/kvattn.h"
#include "reference/reference.h"

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

}  // namespace kvattn::tools
