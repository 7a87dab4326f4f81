// The subcommands of `kvattn`. Each takes the words after its name and returns the process exit
// code; a bad flag throws UsageError (cli_args.h), which main() reports.
#pragma once

#include <string>
#include <vector>

namespace kvattn::tools {

/// `kvattn check`: the standard scenarios against the float64 reference; 1 on any failure.
int run_check(const std::vector<std::string>& args);
std::string check_usage();

/// `kvattn bench`: the SPEC §6 grid with its ceilings measured in the same run.
int run_bench(const std::vector<std::string>& args);
std::string bench_usage();

/// `kvattn demo`: a simulated serving session; 1 when a sampled verification fails.
int run_demo(const std::vector<std::string>& args);
std::string demo_usage();

/// `kvattn soak`: a long serving run with sampled checks, injected bad steps and memory
/// sampling; 1 on any wrong answer, bad step not refused whole, or memory growth.
int run_soak(const std::vector<std::string>& args);
std::string soak_usage();

}  // namespace kvattn::tools
