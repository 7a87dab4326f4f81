// The CUDA half of MultiStepDraftBackend (kvattn/backend.h): num_steps draft decode steps of
// batch_size * topk queries each. init_forward_metadata plans every step on the host (one
// metadata copy per step) and builds the index sets of all steps with one device launch.
// Draft steps always run the CUDA-core decode kernel (each step is a plain decode over a prefix
// plus a few draft tokens); a sliding window is not applied to draft steps, as in the reference.
#pragma once

#include <memory>

#include "core/backend_factory.h"

namespace kvattn::cuda {
// Declared in core/backend_factory.h:
//   std::unique_ptr<core::DraftRunner> make_cuda_draft_runner(const BackendConfig&, int topk,
//                                                             int num_steps);
}  // namespace kvattn::cuda
