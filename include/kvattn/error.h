// kvattn — the one error type of the library.
//
// Every public entry point validates its input and throws kvattn::Error on bad
// input or on a device failure. The library never calls exit() or abort().
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kvattn {

/// What went wrong, so a caller (or the Python binding) can map it to its own error kinds.
enum class ErrorKind {
  kInvalidArgument,  ///< a shape, dtype, range or value that the contract forbids
  kNotSupported,     ///< a valid request this backend or build cannot serve
  kOutOfResources,   ///< an allocator, pool or buffer is exhausted
  kDeviceError,      ///< a CUDA call failed
};

/// The library's error: names the argument, the value seen and what was expected.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string argument, const std::string& message, int64_t step = -1)
      : std::runtime_error(message), kind_(kind), argument_(std::move(argument)), step_(step) {}

  ErrorKind kind() const noexcept { return kind_; }
  /// The argument at fault, e.g. "seq_lens[3]" (empty where no single argument is at fault).
  const std::string& argument() const noexcept { return argument_; }
  /// The step a device-detected error belongs to (AttentionBackend::check_errors: the
  /// step_id() of the refused step); -1 for an error about the call that threw it.
  int64_t step() const noexcept { return step_; }

 private:
  ErrorKind kind_;
  std::string argument_;
  int64_t step_;
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append_all(os, rest...);
}
}  // namespace detail

/// Builds "kvattn: <argument>: <message parts...>" and throws it as kvattn::Error.
template <typename... Parts>
[[noreturn]] void throw_error(ErrorKind kind, const std::string& argument, const Parts&... parts) {
  std::ostringstream os;
  os << "kvattn: ";
  if (!argument.empty()) os << argument << ": ";
  detail::append_all(os, parts...);
  throw Error(kind, argument, os.str());
}

/// Throws kInvalidArgument unless `condition` holds.
/// Example: check_arg(page_size > 0, "page_size", "got ", page_size, ", expected a power of two");
/// Nothing is formatted or allocated unless the check fails (these run on every call): pass
/// streamable values (a TensorView, a Device), not their strings.
template <typename Argument, typename... Parts>
void check_arg(bool condition, const Argument& argument, const Parts&... parts) {
  if (!condition) [[unlikely]]
    throw_error(ErrorKind::kInvalidArgument, std::string(argument), parts...);
}

}  // namespace kvattn
