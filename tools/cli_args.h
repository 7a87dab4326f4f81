// Command-line options of the `kvattn` subcommands: a small declared-options parser, so every
// subcommand answers a bad or unknown flag the same way (a message naming the flag, exit 2).
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvattn::tools {

/// A flag the user got wrong; main() prints it with the subcommand's usage hint and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One option a subcommand accepts.
struct OptionSpec {
  std::string name;        ///< "--device"
  std::string value_name;  ///< "cpu|cuda"; empty for a switch that takes no value
  std::string help;
};

/// The parsed options of one subcommand. Values are kept as strings and converted on access,
/// so a conversion error names the flag.
class ParsedArgs {
 public:
  /// Parses args (after the subcommand word) against `specs`; accepts "--flag value" and
  /// "--flag=value". Throws UsageError on an unknown flag, a missing value or a stray word.
  ParsedArgs(const std::vector<std::string>& args, const std::vector<OptionSpec>& specs);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string get(const std::string& name, const std::string& fallback) const;
  int64_t get_int(const std::string& name, int64_t fallback, int64_t min_value,
                  int64_t max_value) const;
  double get_double(const std::string& name, double fallback, double min_value,
                    double max_value) const;
  /// The value of a flag restricted to `choices`.
  std::string get_choice(const std::string& name, const std::string& fallback,
                         const std::vector<std::string>& choices) const;

 private:
  std::map<std::string, std::string> values_;
};

/// "  --device cpu|cuda   help..." lines for a usage text.
std::string format_options(const std::vector<OptionSpec>& specs);

}  // namespace kvattn::tools
