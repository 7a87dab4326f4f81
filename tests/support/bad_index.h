// Bad indices in a step, run the same way on every backend (SPEC §5, kvattn/backend.h): the CPU
// tests run the table here, the CUDA tests run it on the device. A case breaks one index of a
// valid world (a slot, a row, a req_to_token entry the step reads, a length); the runner drives
// one backend through the bad step as an engine would (metadata, every layer's forward,
// check_errors where the engine synchronises), then checks that the step was refused with the
// right kind and argument, that the KV pool and req_to_token are byte for byte as before, that
// the refusal is reported once, and that the next, good step on the same backend is correct.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "kvattn/backend.h"
#include "reference/scenario.h"
#include "reference/world.h"

namespace kvattn::testing {

/// What a case broke: the argument the error must name (exactly, e.g. "out_cache_loc[4]", or a
/// prefix such as "req_to_token[" when `argument_is_prefix`), and how to put it back.
struct BadIndexBreak {
  std::string argument;
  bool argument_is_prefix = false;
  std::function<void()> undo;
};

struct BadIndexCase {
  std::string label;
  ScenarioSpec spec;
  std::function<BadIndexBreak(ScenarioWorld&)> apply;
  /// false: an index that the step does not read (the step must run normally).
  bool expect_refused = true;
  ErrorKind kind = ErrorKind::kInvalidArgument;
};

/// Every index kind of a step: out_cache_loc (one past the pool, negative), encoder_out_cache_loc,
/// req_pool_indices, the req_to_token entries the step reads (prefix, tree tokens, window range),
/// lengths beyond max_context_len; in DECODE, EXTEND (paged and ragged), MIXED and TARGET_VERIFY;
/// plus a bad req_to_token entry the step does not read.
std::vector<BadIndexCase> bad_index_cases();

/// The table built once (parameterised tests index it), and case `index`'s label as a test
/// name (letters, digits and '_').
const std::vector<BadIndexCase>& bad_index_case_table();
std::string bad_index_case_name(int index);

struct BadIndexOutcome {
  BadIndexBreak expected;  ///< what the case broke (argument to name)
  bool refused = false;
  bool refused_by_check_errors = false;  ///< reported by check_errors (not thrown by a call)
  ErrorKind kind = ErrorKind::kInvalidArgument;
  std::string argument;  ///< Error::argument()
  std::string message;
  int64_t error_step = -1;   ///< Error::step()
  uint64_t bad_step_id = 0;  ///< the backend's step_id() of the bad step
  bool pool_unchanged = false;          ///< K and V of every layer
  bool req_to_token_unchanged = false;  ///< the table, after the case's own edit
  bool reported_once = false;           ///< a second check_errors found nothing
  bool next_step_ok = false;            ///< the good step after it: no error, outputs and pool ok
  std::string detail;                   ///< what went wrong, when something did
};

/// Runs `c` on a backend of `kind` (one backend for the bad step and the good one after it).
BadIndexOutcome run_bad_index_case(const BadIndexCase& c, BackendKind kind);

/// The checks every backend must pass; returns "" or what failed. `deferred`: the backend
/// reports through check_errors (CUDA) instead of throwing from the call (CPU).
std::string bad_index_failure(const BadIndexCase& c, const BadIndexOutcome& o, bool deferred);

}  // namespace kvattn::testing
