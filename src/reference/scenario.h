// Randomized end-to-end scenarios: build a KV pool, a req_to_token map and a batch for one mode
// and variant, run a backend, compare with the float64 reference. Shared by the CPU tests, the
// device tests and `kvattn check`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvattn/backend.h"

namespace kvattn::testing {

/// One randomized case. Lengths are drawn in [min_kv_len, max_kv_len] per request (with
/// kv_len 0 and 1 forced in where allow_tiny is set); everything else is fresh random data
/// from `seed`: normal-ish q/k/v, shuffled slots, NaN in every slot no request owns.
struct ScenarioSpec {
  std::string variant;  ///< short label for tables ("causal", "window", "softcap", ...)
  ForwardMode mode = ForwardMode::kDecode;
  int batch_size = 4;
  int min_kv_len = 1;    ///< seq_len range (decode / verify: prefix; extend: total)
  int max_kv_len = 300;
  int min_q_len = 1;     ///< EXTEND-like modes: new tokens per request
  int max_q_len = 40;
  bool allow_tiny = true;  ///< force seq_len 0/1 (or prefix 0) into some requests
  int num_q_heads = 8;
  int num_kv_heads = 2;
  int head_dim = 128;
  int v_head_dim = 0;  ///< 0 = head_dim
  DType q_dtype = DType::kBFloat16;
  DType kv_dtype = DType::kBFloat16;
  int page_size = 1;
  bool shuffled_slots = true;
  int sliding_window = -1;       ///< the model's window; layers alternate window / full
  bool window_layer = true;      ///< with a window: test the window layer (else the full one)
  bool cross_attention = false;  ///< encoder-decoder model
  bool cross_layer = true;       ///< with cross_attention: test the cross layer (else self)
  float logit_cap = 0.f;
  bool force_ragged = false;     ///< EXTEND: threshold 0, so the ragged + prefix path runs
  bool save_kv_cache = true;
  int draft_token_num = 0;       ///< TARGET_VERIFY
  /// No seq_lens_cpu (EXTEND-like: nor extend_*_cpu): the CUDA backend plans the step on the
  /// device.
  bool device_lengths = false;
  int topk = 0;                  ///< multi-step draft (mode kDecode + topk > 0)
  int num_steps = 0;
  float k_scale = 1.f;           ///< fp8 scales
  float v_scale = 1.f;
  uint64_t seed = 1;
  bool strided_q = false;        ///< q is a view of wider rows (as a slice of a fused qkv)
  bool sinks = false;            ///< the layer has attention sinks (AttentionLayer::sinks)
  bool deterministic = false;    ///< BackendConfig::deterministic
  /// > 0: the first shared_prefix positions of every request long enough hold the longest
  /// request's slots (a shared system prompt: the cascade path)
  int shared_prefix = 0;
  /// > 0: the engine declares this many shared-prefix groups (ForwardBatch::
  /// shared_prefix_group_cpu / shared_prefix_lens_cpu): random members (>= 2 a group, not
  /// adjacent; about a quarter of the requests stay out), each group sharing its first member's
  /// first n slots, n drawn below every member's seq_len (never a multiple of page_size > 1).
  int declared_groups = 0;
  /// TARGET_VERIFY: this many runs of prefix columns of each request's tree mask are 0 (each in
  /// a random row; the first the prefix's last 48 columns, the others a third of the prefix): an
  /// engine's mask that hides prefix keys (the CUDA backend's dense-prefix scan must see them)
  int prefix_holes = 0;
  DType sinks_dtype = DType::kFloat32;

  std::string shape_label() const;  ///< "b4 kv1..300 q8/2 d128 page1" for tables
};

struct ScenarioResult {
  double max_rel_err = 0;  ///< max over (token, head) rows of max|out - ref| / max|ref|
  double tolerance = 0;    ///< the bar for the dtypes involved
  bool passed = false;     ///< max_rel_err <= tolerance, no NaN, every output written
  bool kv_pool_ok = true;  ///< the new K/V landed in their slots and nothing else changed
  bool not_supported = false;  ///< the backend refused the row with ErrorKind::kNotSupported
  std::string detail;      ///< why it failed (first bad element, seed)
};

/// The dtype whose rounding bounds a backend's result: the query (io) dtype, except fp32 queries
/// on the CUDA backend outside DECODE, which run the tensor-core kernel on bf16 (or fp16) copies
/// of q and the new K/V. The KV dtype adds nothing: the reference reads the values the pool
/// stores (scenario.cpp gives the reasoning).
DType arithmetic_dtype(DType q_dtype, DType kv_dtype, BackendKind kind, ForwardMode mode);
/// The error bar of an arithmetic dtype, relative to each (token, head) row's max |ref|:
/// fp32 1e-5, fp16 2e-3, bf16 1e-2 (the measured spread behind each is in scenario.cpp).
double tolerance_for_dtype(DType arithmetic);
/// The bar for a scenario: tolerance_for_dtype(arithmetic_dtype(...)).
double tolerance_for(DType q_dtype, DType kv_dtype, BackendKind kind, ForwardMode mode);
/// The bar where the backend computes at the precision of its query dtype (every CPU mode, the
/// CUDA decode kernels): tolerance_for_dtype(q_dtype).
double tolerance_for(DType q_dtype, DType kv_dtype);

/// Runs `spec` on a backend of `kind` and checks it against the float64 reference.
ScenarioResult run_scenario(const ScenarioSpec& spec, BackendKind kind);

/// Why a backend refuses `spec` with kNotSupported: a known gap, named so that every other row
/// must run (a NotSupported elsewhere is a failure); nullptr when the backend serves it.
const char* unsupported_reason(const ScenarioSpec& spec, BackendKind kind);

/// The check matrix: every mode x variant at small sizes (at least 85 rows). `seed` varies the
/// data; each spec's seed is derived from it.
std::vector<ScenarioSpec> standard_scenarios(uint64_t seed);

}  // namespace kvattn::testing
