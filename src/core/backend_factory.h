// How the generic front (make_backend, MultiStepDraftBackend) reaches each backend's
// implementation. Each backend folder defines its make_* functions; the CUDA ones exist only in
// builds with KVATTN_WITH_CUDA.
#pragma once

#include <memory>
#include <vector>

#include "kvattn/backend.h"

namespace kvattn::core {

/// The per-backend half of MultiStepDraftBackend (see its doc in kvattn/backend.h).
class DraftRunner {
 public:
  virtual ~DraftRunner() = default;
  /// Builds the index sets of all num_steps steps for `batch` in one go.
  virtual void init_forward_metadata(const ForwardBatch& batch) = 0;
  /// The split of init_forward_metadata for CUDA graphs (host half, device half). A runner
  /// without device work keeps these defaults: everything happens in the host half.
  virtual void init_forward_metadata_out_graph(const ForwardBatch& batch, bool in_capture) {
    (void)in_capture;
    init_forward_metadata(batch);
  }
  virtual void init_forward_metadata_in_graph(const ForwardBatch& batch) { (void)batch; }
  virtual void forward_step(int step, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out,
                            const AttentionLayer& layer, const TensorView& out_cache_loc) = 0;
  virtual void init_cuda_graph_state(int max_bs) = 0;
  virtual void set_cuda_stream(void* stream) { (void)stream; }
  /// As AttentionBackend::step_id / take_step_errors (one step per init_forward_metadata).
  virtual uint64_t step_id() const = 0;
  virtual std::vector<StepError> take_step_errors(bool synchronize) {
    (void)synchronize;
    return {};
  }
};

}  // namespace kvattn::core

namespace kvattn::cpu {
std::unique_ptr<AttentionBackend> make_cpu_backend(const BackendConfig& config);
std::unique_ptr<core::DraftRunner> make_cpu_draft_runner(const BackendConfig& config, int topk,
                                                         int num_steps);
}  // namespace kvattn::cpu

namespace kvattn::cuda {
std::unique_ptr<AttentionBackend> make_cuda_backend(const BackendConfig& config);
std::unique_ptr<core::DraftRunner> make_cuda_draft_runner(const BackendConfig& config, int topk,
                                                          int num_steps);
}  // namespace kvattn::cuda
