// The CUDA half of MultiStepDraftBackend (kvattn/backend.h): num_steps draft decode steps of
// batch_size * topk queries each. init_forward_metadata_out_graph plans every step on the host
// (one metadata copy per step); init_forward_metadata_in_graph builds the index sets of all steps
// with one device launch. After init_cuda_graph_state(max_bs) batches of up to max_bs requests
// use fixed buffers and launch sizes that depend on the batch size alone, so in_graph and the
// forward_step calls of a batch size are captured once and replayed after each out_graph.
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
