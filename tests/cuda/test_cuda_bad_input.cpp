// Bad input on the CUDA backend: the shared suite (tests/support/bad_input_suite.h) instantiated for
// BackendKind::kCuda. Skips without a CUDA device. Device-resident index contents refuse the whole
// step on the device and are reported by check_errors() (see the suite's header comment).
#include "support/bad_input_suite.h"

namespace kvattn::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Cuda, BadInput, ::testing::Values(BackendKind::kCuda), backend_param_name);

}  // namespace
}  // namespace kvattn::testing
