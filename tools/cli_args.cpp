#include "cli_args.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

namespace kvattn::tools {
namespace {

const OptionSpec* find_spec(const std::vector<OptionSpec>& specs, const std::string& name) {
  for (const OptionSpec& spec : specs) {
    if (spec.name == name) return &spec;
  }
  return nullptr;
}

}  // namespace

ParsedArgs::ParsedArgs(const std::vector<std::string>& args, const std::vector<OptionSpec>& specs) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string word = args[i];
    if (word.rfind("--", 0) != 0) {
      throw UsageError("unexpected argument '" + word + "'");
    }
    std::string value;
    bool has_inline_value = false;
    const size_t eq = word.find('=');
    if (eq != std::string::npos) {
      value = word.substr(eq + 1);
      word = word.substr(0, eq);
      has_inline_value = true;
    }
    const OptionSpec* spec = find_spec(specs, word);
    if (spec == nullptr) throw UsageError("unknown option '" + word + "'");
    if (spec->value_name.empty()) {
      if (has_inline_value) throw UsageError("option '" + word + "' takes no value");
      values_[word] = "1";
      continue;
    }
    if (!has_inline_value) {
      if (i + 1 >= args.size()) {
        throw UsageError("option '" + word + "' needs a value (" + spec->value_name + ")");
      }
      value = args[++i];
    }
    if (value.empty()) throw UsageError("option '" + word + "' has an empty value");
    values_[word] = value;
  }
}

std::string ParsedArgs::get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

int64_t ParsedArgs::get_int(const std::string& name, int64_t fallback, int64_t min_value,
                            int64_t max_value) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  const long long parsed = std::strtoll(it->second.c_str(), &end, 10);
  if (end == it->second.c_str() || *end != '\0' || parsed < min_value || parsed > max_value) {
    std::ostringstream os;
    os << "option '" << name << "': got '" << it->second << "', expected an integer in ["
       << min_value << ", " << max_value << "]";
    throw UsageError(os.str());
  }
  return parsed;
}

double ParsedArgs::get_double(const std::string& name, double fallback, double min_value,
                              double max_value) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  const double parsed = std::strtod(it->second.c_str(), &end);
  if (end == it->second.c_str() || *end != '\0' || !(parsed >= min_value) ||
      !(parsed <= max_value)) {
    std::ostringstream os;
    os << "option '" << name << "': got '" << it->second << "', expected a number in [" << min_value
       << ", " << max_value << "]";
    throw UsageError(os.str());
  }
  return parsed;
}

std::string ParsedArgs::get_choice(const std::string& name, const std::string& fallback,
                                   const std::vector<std::string>& choices) const {
  const std::string value = get(name, fallback);
  if (std::find(choices.begin(), choices.end(), value) == choices.end()) {
    std::string list;
    for (const std::string& choice : choices) list += (list.empty() ? "" : "|") + choice;
    throw UsageError("option '" + name + "': got '" + value + "', expected " + list);
  }
  return value;
}

std::string format_options(const std::vector<OptionSpec>& specs) {
  std::ostringstream os;
  for (const OptionSpec& spec : specs) {
    std::string left = "  " + spec.name;
    if (!spec.value_name.empty()) left += " " + spec.value_name;
    os << left;
    if (left.size() < 26)
      os << std::string(26 - left.size(), ' ');
    else
      os << "\n" << std::string(26, ' ');
    os << spec.help << "\n";
  }
  return os.str();
}

}  // namespace kvattn::tools
