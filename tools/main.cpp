// `kvattn`: check, benchmark and demonstrate the library from one binary.
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "cli_args.h"
#include "commands.h"
#include "kvattn/error.h"

namespace {

const char* kTopUsage =
    "kvattn — the attention layer of an LLM serving engine (paged KV cache, CPU and CUDA "
    "backends)\n"
    "\n"
    "usage: kvattn <command> [options]\n"
    "\n"
    "commands:\n"
    "  check   run every forward mode and variant against the float64 reference\n"
    "  bench   time the SPEC grid (decode, prefill, extend) against measured ceilings\n"
    "  demo    simulate a serving session (continuous batching, shared prefixes, speculative\n"
    "          verify) with all attention through one backend\n"
    "  soak    a long serving run: random arrivals, shared prefixes, sampled checks, injected\n"
    "          bad steps (refused whole, reported once), memory sampled\n"
    "\n"
    "`kvattn <command> --help` lists a command's options.\n";

struct Command {
  const char* name;
  int (*run)(const std::vector<std::string>&);
  std::string (*usage)();
};

const Command kCommands[] = {
    {"check", kvattn::tools::run_check, kvattn::tools::check_usage},
    {"bench", kvattn::tools::run_bench, kvattn::tools::bench_usage},
    {"demo", kvattn::tools::run_demo, kvattn::tools::demo_usage},
    {"soak", kvattn::tools::run_soak, kvattn::tools::soak_usage},
};

bool is_help(const std::string& word) {
  return word == "--help" || word == "-h" || word == "help";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> words(argv + 1, argv + argc);
  if (words.empty()) {
    std::cerr << kTopUsage;
    return 2;
  }
  if (is_help(words[0])) {
    std::cout << kTopUsage;
    return 0;
  }
  const Command* command = nullptr;
  for (const Command& candidate : kCommands) {
    if (words[0] == candidate.name) command = &candidate;
  }
  if (command == nullptr) {
    std::cerr << "kvattn: unknown command '" << words[0] << "'\n\n" << kTopUsage;
    return 2;
  }
  std::vector<std::string> args(words.begin() + 1, words.end());
  for (const std::string& arg : args) {
    if (arg == "--help" || arg == "-h") {
      std::cout << command->usage();
      return 0;
    }
  }
  try {
    return command->run(args);
  } catch (const kvattn::tools::UsageError& e) {
    std::cerr << "kvattn " << command->name << ": " << e.what() << "\n"
              << "(see `kvattn " << command->name << " --help`)\n";
    return 2;
  } catch (const kvattn::Error& e) {
    std::cerr << "kvattn " << command->name << " failed: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kvattn " << command->name << " failed: " << e.what() << "\n";
    return 1;
  }
}
