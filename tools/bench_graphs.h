// `kvattn bench --graphs` and `kvattn bench --planner` (issue 6): a decode step over 32 layers,
// eager against CUDA-graph replay, beside the sum of its kernels' own GPU times; and the host
// planning a replay does at every step.
#pragma once

#include "cli_args.h"

namespace kvattn::tools {

/// Runs `kvattn bench --graphs` (needs --device cuda) or `kvattn bench --planner` (any machine:
/// the host planning functions alone, no GPU) with bench's parsed options (--json, --seed,
/// --device). Returns the exit code: 1 when a replay differs from its eager twin.
int run_graph_bench(const ParsedArgs& args);

}  // namespace kvattn::tools
