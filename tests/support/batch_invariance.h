// Batch invariance (BackendConfig::deterministic, issue 16): one probe request run alone and
// inside batches of other requests (few and many neighbours, short and long, the probe first,
// in the middle, last), its output compared byte for byte. Shared by the CPU tests and the
// device tests: the same world on either backend.
#pragma once

#include <cstdint>
#include <string>

#include "kvattn/backend.h"

namespace kvattn::testing {

struct BatchInvarianceResult {
  int batches = 0;         ///< batch configurations run (the first one: the probe alone)
  int identical = 0;       ///< of them, those whose probe output equals the alone run's bytes
  std::string first_diff;  ///< where the first difference was (empty when none)
  bool finite = true;      ///< every probe output finite
};

/// Runs the probe of `mode` (DECODE, EXTEND, MIXED or TARGET_VERIFY; 32 q / 8 kv heads,
/// head_dim 128, bf16, a prefix of several thousand keys) alone and in `configurations - 1`
/// batches with random neighbours, on a backend of `kind` with config.deterministic =
/// `deterministic` (and `threads` CPU workers).
BatchInvarianceResult run_batch_invariance(BackendKind kind, ForwardMode mode, bool deterministic,
                                           int configurations, int threads, uint64_t seed);

}  // namespace kvattn::testing
