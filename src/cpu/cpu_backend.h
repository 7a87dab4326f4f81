// The CPU backend (SPEC §2-4 on the host): per-step planning from core/batch_layout.h into
// token-level slot lists, the KV write, and the dispatch of every mode onto the CPU kernels.
// The CUDA-graph hooks are no-ops here.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/backend_factory.h"
#include "core/batch_layout.h"
#include "core/cascade.h"
#include "cpu/cpu_attention.h"
#include "cpu/thread_pool.h"
#include "kvattn/backend.h"

namespace kvattn::cpu {

/// One index set of a step: the layout and the slot of every KV token it covers.
struct CpuIndexSet {
  core::IndexSet set = core::IndexSet::kFull;
  core::PagedLayout layout;
  std::vector<int32_t> kv_indices;  ///< [layout.total_kv()] slots, checked against the pool
};

class CpuBackend final : public AttentionBackend {
 public:
  /// Validates `config` (host KV cache and req_to_token pool) and starts the thread pool.
  explicit CpuBackend(const BackendConfig& config);

  BackendKind kind() const override { return BackendKind::kCpu; }
  Device device() const override { return Device::cpu(); }
  uint64_t step_id() const override { return step_id_; }

  void init_forward_metadata_out_graph(const ForwardBatch& batch, bool in_capture) override;
  void init_forward_metadata_in_graph(const ForwardBatch&) override {}

  void forward_decode(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const AttentionLayer& layer,
                      const ForwardBatch& batch, bool save_kv_cache) override;
  void forward_extend(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const AttentionLayer& layer,
                      const ForwardBatch& batch, bool save_kv_cache) override;

  void init_cuda_graph_state(int, int64_t) override {}
  int cuda_graph_seq_len_fill_value() const override { return 0; }

  int num_threads() const { return pool_.size(); }

 private:
  // What init_forward_metadata built for the current step.
  struct StepPlan {
    bool ready = false;
    ForwardMode mode = ForwardMode::kIdle;
    int batch_size = 0;
    int64_t num_tokens = 0;
    std::vector<CpuIndexSet> sets;  // one per index set the model's layers use
    // EXTEND by the ragged + paged-prefix path (taken when the layer's k/v are at hand).
    bool use_ragged = false;
    bool any_prefix = false;        // some request has a cached prefix
    core::PagedLayout ragged;       // new tokens against new tokens, causal
    CpuIndexSet prefix;             // new tokens against the paged prefix, no mask
    // TARGET_VERIFY: the batch's tree mask, and the window-folded copy for window layers
    // (empty when the batch gave no positions; a window layer then throws).
    std::vector<uint8_t> custom_mask;
    std::vector<uint8_t> window_mask;
    // DECODE with shared prefixes (core/cascade.h), full-attention layers: the groups' queries
    // over their shared keys, every request over its own keys, then the merge.
    core::CascadePlan cascade;
    CpuIndexSet cascade_shared;
    CpuIndexSet cascade_own;
    std::vector<int64_t> cascade_token;  // [batch] a grouped request's first row in the shared call
  };

  void forward_any(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const AttentionLayer& layer, const ForwardBatch& batch,
                   bool save_kv_cache, bool decode_entry);
  void build_index_set(CpuIndexSet& target, const ForwardBatch& batch);
  void plan_cascade(StepPlan& plan, const core::HostLengths& lens, const ForwardBatch& batch) const;
  void attend_cascade(const TensorView& q, const TensorView& out, const AttentionLayer& layer,
                      float* final_lse);
  const CpuIndexSet& index_set(core::IndexSet set) const;

  BackendConfig config_;
  ThreadPool pool_;
  AttentionWorkspace workspace_;
  StepPlan plan_;
  std::vector<float> merge_buffers_;  // ragged path: two fp32 outputs and two LSE arrays
  std::vector<float> sink_lse_;       // layers with sinks: the rows' LSE before the sink
  std::vector<float> cascade_buffers_;  // cascade: the two fp32 states and their LSEs
  std::vector<uint8_t> cascade_q_;      // cascade: the grouped queries, gathered
  uint64_t step_id_ = 0;
};

/// The CPU half of MultiStepDraftBackend (see its doc in kvattn/backend.h).
class CpuDraftRunner final : public core::DraftRunner {
 public:
  CpuDraftRunner(const BackendConfig& config, int topk, int num_steps);
  void init_forward_metadata(const ForwardBatch& batch) override;
  void forward_step(int step, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const AttentionLayer& layer,
                    const TensorView& out_cache_loc) override;
  void init_cuda_graph_state(int) override {}
  uint64_t step_id() const override { return step_id_; }

 private:
  BackendConfig config_;
  int topk_;
  int num_steps_;
  ThreadPool pool_;
  AttentionWorkspace workspace_;
  bool ready_ = false;
  int num_queries_ = 0;  // batch_size * topk
  std::vector<CpuIndexSet> steps_;  // one per draft step
  /// Shared prefix (no window model): step s is one call whose query rows are a request's
  /// branches, over its prefix and all draft tokens of steps 0..s under these branch masks
  /// (one per step; empty: every branch is a decode query of its own).
  std::vector<std::vector<uint8_t>> branch_masks_;
  std::vector<float> sink_lse_;     // layers with sinks: the rows' LSE before the sink
  uint64_t step_id_ = 0;
};

}  // namespace kvattn::cpu
