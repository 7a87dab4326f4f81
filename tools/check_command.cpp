// `kvattn check`: every forward mode and variant of the standard scenario matrix, run through
// one backend and compared with the float64 reference.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "cli_args.h"
#include "commands.h"
#include "reference/scenario.h"
#include "tool_support.h"

namespace kvattn::tools {
namespace {

const std::vector<OptionSpec>& check_options() {
  static const std::vector<OptionSpec> specs = {
      {"--device", "cpu|cuda", "backend to check (default: cuda when a GPU is visible)"},
      {"--seed", "N", "seed of the random data (default 1)"},
      {"--verbose", "", "print why each failed case failed"},
  };
  return specs;
}

std::string mode_label(const testing::ScenarioSpec& spec) {
  if (spec.mode == ForwardMode::kDecode && spec.topk > 0) return "draft";
  return forward_mode_name(spec.mode);
}

}  // namespace

std::string check_usage() {
  return "usage: kvattn check [options]\n"
         "\n"
         "Runs the standard scenarios (every forward mode x variant at small sizes, fresh random\n"
         "data, NaN in unused KV slots) through one backend and compares each output with the\n"
         "float64 reference. Exit code 1 when any case fails. A row the backend refuses as a\n"
         "known gap (listed with its reason in the test matrix) is reported as skipped, never\n"
         "as passed; any other refusal fails.\n"
         "\n"
         "options:\n" +
         format_options(check_options());
}

int run_check(const std::vector<std::string>& args) {
  const ParsedArgs parsed(args, check_options());
  const ToolDevice device = select_device(parsed.get("--device", ""));
  const uint64_t seed = uint64_t(parsed.get_int("--seed", 1, 0, INT64_MAX));
  const bool verbose = parsed.has("--verbose");

  const std::vector<testing::ScenarioSpec> specs = testing::standard_scenarios(seed);
  std::printf("kvattn check: %zu scenarios on %s (%s), seed %llu\n\n", specs.size(),
              backend_kind_name(device.kind), device_description(device).c_str(),
              static_cast<unsigned long long>(seed));
  std::printf("%-4s %-14s %-38s %-38s %12s %10s  %s\n", "#", "mode", "variant", "shape",
              "max_rel_err", "tolerance", "result");

  int passed = 0;
  int failed = 0;
  int skipped = 0;  // refused with kNotSupported where unsupported_reason names the gap
  std::vector<std::string> failures;
  std::vector<std::string> gaps;
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < specs.size(); ++i) {
    const testing::ScenarioSpec& spec = specs[i];
    testing::ScenarioResult result;
    std::string error;
    try {
      result = testing::run_scenario(spec, device.kind);
    } catch (const std::exception& e) {
      error = e.what();
      result.passed = false;
    }
    const bool ok = error.empty() && result.passed && result.kv_pool_ok;
    // A known gap of this backend (listed with its reason): reported, not counted as run.
    const char* gap = testing::unsupported_reason(spec, device.kind);
    const bool known_gap = !ok && result.not_supported && result.kv_pool_ok && gap != nullptr;
    if (known_gap) {
      ++skipped;
      gaps.push_back("#" + std::to_string(i + 1) + " " + mode_label(spec) + " " + spec.variant +
                     ": " + gap);
    } else {
      (ok ? passed : failed) += 1;
    }
    std::string verdict = ok ? "ok" : known_gap ? "not supported (known)" : "FAIL";
    if (!error.empty())
      verdict = "FAIL (threw)";
    else if (!ok && !known_gap && !result.kv_pool_ok)
      verdict = "FAIL (kv pool)";
    std::string err_text = "-";
    if (error.empty()) {
      char text[32];
      std::snprintf(text, sizeof(text), "%.3e", result.max_rel_err);
      err_text = text;
    }
    std::printf("%-4zu %-14s %-38s %-38s %12s %10.0e  %s\n", i + 1, mode_label(spec).c_str(),
                spec.variant.c_str(), spec.shape_label().c_str(), err_text.c_str(),
                result.tolerance, verdict.c_str());
    if (!ok && !known_gap) {
      const std::string why = !error.empty() ? error : result.detail;
      failures.push_back("#" + std::to_string(i + 1) + " " + mode_label(spec) + " " + spec.variant +
                         ": " + why);
      if (verbose) std::printf("     %s\n", why.c_str());
    }
    std::fflush(stdout);
  }
  std::printf("\n");
  if (!failures.empty() && !verbose) {
    std::printf("failures:\n");
    for (const std::string& line : failures) std::printf("  %s\n", line.c_str());
    std::printf("\n");
  }
  if (!gaps.empty()) {
    std::printf("not supported on %s (known gaps, not run):\n", backend_kind_name(device.kind));
    for (const std::string& line : gaps) std::printf("  %s\n", line.c_str());
    std::printf("\n");
  }
  std::printf("(%.1f s)\n", seconds_since(start));
  if (skipped > 0)
    std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  else
    std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace kvattn::tools
