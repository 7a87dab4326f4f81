#include "cuda/draft_runner.h"

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "core/size_check.h"
#include "core/step.h"
#include "core/validate.h"
#include "cuda/cuda_backend.h"
#include "cuda/kernels/device_plan.h"
#include "cuda/kernels/index.h"
#include "cuda/step_guard.h"
#include "kvattn/error.h"
#include "kvattn/kv_cache.h"

namespace kvattn::cuda {
namespace {

class CudaDraftRunner final : public core::DraftRunner {
 public:
  CudaDraftRunner(const BackendConfig& config, int topk, int num_steps)
      : config_(config),
        device_(config.kv_cache->config().device),
        topk_(topk),
        num_steps_(num_steps),
        steps_(size_t(num_steps)) {
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    check_arg(!config.is_encoder_decoder, "is_encoder_decoder",
              "the multi-step draft backend serves decoder-only models");
    if (config_.v_head_dim == 0) config_.v_head_dim = config_.head_dim;
    setup_ = make_decode_setup(config_, device_.index);
    guard_ = std::make_unique<StepGuard>(config.kv_cache->num_slots(),
                                         config.req_to_token_pool->max_reqs());
    // Shared prefix: a request's topk branches read its prefix once, as the query rows of one
    // decode-shaped call a step (else every branch is a decode entry of its own and reads it).
    const int group = config_.num_q_heads / config_.num_kv_heads;
    const DType kv_dtype = config_.kv_cache->config().dtype;
    shared_prefix_ = setup_.tc_decode && config_.q_dtype == setup_.compute_dtype &&
                     (kv_dtype == config_.q_dtype || is_fp8_dtype(kv_dtype)) &&
                     int64_t(topk_) * group <= kTcDecodeMaxRows &&
                     env_int("KVATTN_DRAFT_SHARED_PREFIX", 1, 0) != 0;
    if (shared_prefix_) make_branch_masks();
  }

  uint64_t step_id() const override { return guard_->step_id(); }

  std::vector<StepError> take_step_errors(bool synchronize) override {
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    if (synchronize) {
      check_cuda(cudaStreamSynchronize(static_cast<cudaStream_t>(config_.cuda_stream)),
                 "cudaStreamSynchronize");
    }
    return guard_->take();
  }

  void init_forward_metadata(const ForwardBatch& batch) override {
    init_forward_metadata_out_graph(batch, /*in_capture=*/false);
    init_forward_metadata_in_graph(batch);
  }

  void init_forward_metadata_out_graph(const ForwardBatch& batch, bool in_capture) override {
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    step_ = guard_->begin_step(batch.mode, batch.batch_size);
    ready_ = false;
    indices_built_ = false;
    shared_steps_ = false;
    const core::StepFacts facts = core::derive_step(batch, config_, device_, /*device_plan=*/true);
    device_plan_ = facts.device_lengths;
    const core::HostLengths& lens = facts.lens;
    const int bs = batch.batch_size;
    const int entries = bs * topk_;
    const ReqToTokenPool& pool = *config_.req_to_token_pool;
    if (device_plan_) check_device_plan_fits(bs);
    // (Planned on the device: the step check refuses a seq_len past max_context_len - num_steps
    // x topk, and the planners clamp it meanwhile.)
    for (int r = 0; r < int(lens.seq_lens.size()); ++r) {
      const int64_t last = int64_t(lens.seq_lens[r]) + int64_t(num_steps_) * topk_;
      if (last > pool.max_context_len()) {  // the name is built only on failure (every step)
        throw_error(ErrorKind::kInvalidArgument, "seq_lens[" + std::to_string(r) + "]",
                    "the draft tokens need req_to_token positions up to ", last,
                    ", the pool has max_context_len ", pool.max_context_len());
      }
    }
    graph_pool_ = graph_max_bs_ > 0 && bs <= graph_max_bs_;
    check_arg(!in_capture || graph_pool_, "in_capture",
              "capturing the draft steps needs init_cuda_graph_state with max_bs >= ", bs);
    batch_size_ = bs;
    const cudaStream_t stream = static_cast<cudaStream_t>(config_.cuda_stream);
    entries_ = entries;
    max_kv_len_ = device_plan_ ? pool.max_context_len() : 0;
    // A device plan lays out the query rows from zero lengths; in_graph's planners write the rest.
    const std::vector<int32_t> zeros(device_plan_ ? size_t(bs) : 0, 0);
    const std::span<const int32_t> seq_lens =
        device_plan_ ? std::span<const int32_t>(zeros) : std::span<const int32_t>(lens.seq_lens);
    if (shared_prefix_ && bs <= mask_requests_) {
      plan_shared_prefix(seq_lens, stream);
      ready_ = true;
      return;
    }
    for (int s = 0; s < num_steps_; ++s) {
      CallState& call = steps_[size_t(s)];
      core::PagedLayout& layout = call.layout;
      layout = core::make_draft_step_layout(seq_lens, topk_, s, /*shared_prefix=*/false,
                                            /*full_mask_rows=*/false);
      for (int32_t len : layout.kv_len) max_kv_len_ = std::max(max_kv_len_, len);
      call.paged = true;
      call.prefill = false;
      call.custom_mask = nullptr;
      call.device_plan = device_plan_;
      call.item_limit = core::decode_item_capacity(entries, setup_.plan_config);
      if (device_plan_) {
        call.decode_plan = core::DecodePlan{};
        call.decode_plan.merge_indptr.assign(size_t(entries) + 1, 0);
      } else {
        call.decode_plan = core::plan_decode(layout.kv_len, setup_.plan_config, call.item_limit);
      }
      call.max_kv_len = max_kv_len_;
      core::CallCapacity cap;
      cap.batch_size = graph_pool_ ? graph_max_bs_ * topk_ : entries;
      cap.decode_items = graph_pool_
                             ? core::decode_item_capacity(cap.batch_size, setup_.plan_config)
                             : call.item_limit;
      cap.num_q_heads = config_.num_q_heads;
      cap.v_head_dim = config_.v_head_dim;
      const int64_t keys =
          call_kv_capacity(call, graph_pool_, graph_kv_capacity_, pool.max_context_len());
      upload_call(call, cap, keys, config_.v_head_dim, step_, device_, stream);
    }
    ready_ = true;
  }

  void init_forward_metadata_in_graph(const ForwardBatch& batch) override {
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    check_arg(ready_ && batch.batch_size == batch_size_, "init_forward_metadata_in_graph",
              "call init_forward_metadata_out_graph for this batch first");
    const cudaStream_t stream = static_cast<cudaStream_t>(config_.cuda_stream);
    const int bs = batch_size_;
    const ReqToTokenPool& p = *config_.req_to_token_pool;
    const bool capturing = stream_is_capturing(stream);
    // Planned on the device: every step's KV ranges and plan from the device seq_lens first.
    for (int s = 0; s < num_steps_ && device_plan_; ++s) plan_step_on_device(s, batch, stream);
    // Shared prefix: step s's keys are the request's req_to_token row up to its last draft
    // token, one index set a request. A captured launch covers max_context_len keys.
    for (int s = 0; s < num_steps_ && shared_steps_; ++s) {
      const CallState& call = steps_[size_t(s)];
      KvIndexBuild build;
      build.source = req_to_token_source(p, batch.req_pool_indices);
      build.kv_start = call.meta<int32_t>(call.offsets.kv_start);
      build.kv_len = call.meta<int32_t>(call.offsets.kv_len);
      build.kv_indptr = call.meta<int64_t>(call.offsets.kv_indptr);
      build.batch_size = bs;
      build.kv_indices = static_cast<int32_t*>(call.kv_indices.data());
      build.num_slots = config_.kv_cache->num_slots();
      build.step_state = step_state_of(steps_[0]);
      build.max_kv_len = capturing ? p.max_context_len() : max_kv_len_;
      launch_build_kv_indices(build, stream);
    }
    // The index sets of all steps: one launch per kMaxDraftStepsPerLaunch steps. A captured
    // launch covers max_context_len keys an entry, whatever the replayed lengths.
    for (int first = 0; first < num_steps_ && !shared_steps_; first += kMaxDraftStepsPerLaunch) {
      DraftIndexBuild build;
      build.source = req_to_token_source(p, batch.req_pool_indices);
      build.batch_size = bs;
      build.topk = topk_;
      build.first_step = first;
      build.num_steps = std::min(kMaxDraftStepsPerLaunch, num_steps_ - first);
      for (int i = 0; i < build.num_steps; ++i) {
        const CallState& call = steps_[size_t(first + i)];
        build.kv_len[i] = call.meta<int32_t>(call.offsets.kv_len);
        build.kv_indptr[i] = call.meta<int64_t>(call.offsets.kv_indptr);
        build.kv_indices[i] = static_cast<int32_t*>(steps_[size_t(first + i)].kv_indices.data());
      }
      build.num_slots = config_.kv_cache->num_slots();
      build.step_state = step_state_of(steps_[0]);
      build.max_kv_len = capturing ? p.max_context_len() : max_kv_len_;
      launch_build_draft_kv_indices(build, stream);
    }
    // The requests' rows and the req_to_token reads, checked before any draft step runs (each
    // draft step's out_cache_loc comes with forward_step and is checked by its K/V save).
    StepCheckLaunch check;
    check.state = step_state_of(steps_[0]);
    check.reports = guard_->device_reports();
    check.req_pool_indices = device_index_array(batch.req_pool_indices);
    check.max_reqs = config_.req_to_token_pool->max_reqs();
    check.num_slots = config_.kv_cache->num_slots();
    check.req_to_token = config_.req_to_token_pool->table().data_as<const int32_t>();
    check.req_to_token_row_stride = config_.req_to_token_pool->table().stride(0);
    if (device_plan_) {
      check.seq_lens = device_index_array(batch.seq_lens);
      check.max_seq_len = p.max_context_len() - int64_t(num_steps_) * topk_;
    }
    check.plan_source = device_plan_ ? kPlanOnDevice : kPlanOnHost;
    launch_step_check(check, stream);
    indices_built_ = true;
  }

  void forward_step(int step, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const AttentionLayer& layer,
                    const TensorView& out_cache_loc) override {
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    check_arg(ready_ && indices_built_, "forward_step",
              "call init_forward_metadata (out_graph and in_graph) first");
    check_arg(!layer.is_cross_attention, "layer.is_cross_attention",
              "draft steps run self-attention layers only");
    // The draft index sets hold every prefix key (build_draft_kv_indices_kernel has no start
    // offset) and the decode kernel applies no window, so a window layer would silently attend
    // over the whole prefix: refused until the index build takes the window (issue 20).
    if (layer.sliding_window_size >= 0) {
      throw_error(ErrorKind::kNotSupported, "layer.sliding_window_size",
                  "multi-step draft on a sliding-window layer (window ", layer.sliding_window_size,
                  ") is not implemented on CUDA; the CPU backend serves it");
    }
    ForwardBatch view;  // what validate_forward_tensors reads: the step's slots
    view.mode = ForwardMode::kDecode;
    view.batch_size = entries_;
    view.out_cache_loc = out_cache_loc;
    const bool save = out_cache_loc.defined() && k.defined();
    core::validate_forward_tensors(q, k, v, out, layer, view, config_, device_, entries_, save);
    const cudaStream_t stream = static_cast<cudaStream_t>(config_.cuda_stream);
    StepState* state = step_state_of(steps_[0]);
    if (save) {
      // Every CTA of the save checks all of this draft step's slots first (the step-check
      // kernel never saw them): a bad one refuses this draft step and the later ones.
      SaveGuard guard;
      guard.state = state;
      guard.check_loc = true;
      guard.reports = guard_->device_reports();
      guard.loc_argument = kArgOutCacheLoc;
      save_kv(config_, layer, k, v, out_cache_loc, guard, stream);
    }
    if (entries_ == 0) return;
    const CallState& call = steps_[size_t(step)];
    // Sinks: the attention leaves each row's LSE, then the sink is folded in (as the backend).
    float* sink_lse = nullptr;
    if (layer.sinks.defined()) {
      ensure_bytes(sink_lse_,
                   core::checked_bytes({int64_t(entries_), config_.num_q_heads,
                                        int64_t(sizeof(float))},
                                       "sink LSE"),
                   graph_max_bs_ > 0, device_, "sink LSE");
      sink_lse = static_cast<float*>(sink_lse_.data());
    }
    run_call(call, make_params(call, config_, layer, q, out, sink_lse, {}, {}, state),
             device_.index, stream);
    if (sink_lse != nullptr) {
      fold_sinks(out, config_.v_head_dim, sink_lse, layer.sinks, entries_, &state->error, stream);
    }
  }

  void set_cuda_stream(void* stream) override { config_.cuda_stream = stream; }

  // All or nothing, as CudaBackend::init_cuda_graph_state.
  void init_cuda_graph_state(int max_bs) override {
    check_cuda(cudaSetDevice(device_.index), "cudaSetDevice");
    const int64_t entries = int64_t(max_bs) * topk_;
    check_arg(entries <= INT32_MAX / 2, "max_bs", "got ", max_bs, ": ", entries,
              " draft entries (max_bs x topk), expected fewer than 2^30");
    // Either path's buffers (out_graph picks by the batch): the larger of the two.
    const int64_t kv_capacity = entries * config_.req_to_token_pool->max_context_len();
    core::CallCapacity cap;
    cap.batch_size = int(entries);
    cap.decode_items = core::decode_item_capacity(int(entries), setup_.plan_config);
    cap.custom_mask = shared_prefix_;
    cap.num_q_heads = config_.num_q_heads;
    cap.v_head_dim = config_.v_head_dim;
    core::PrefillBufferLayout region;
    if (shared_prefix_) {
      const core::PrefillTileShape shape = shared_prefix_shape();
      const core::PrefillPlanCapacity plan = core::prefill_plan_capacity(max_bs, topk_, shape);
      region = core::prefill_buffer_layout(plan.items, plan.merges, plan.partials,
                                           shape.tile_rows, config_.v_head_dim);
    }
    BufferGrowth growth;
    for (CallState& call : steps_) plan_frozen_call(call, cap, kv_capacity, region, growth);
    growth.need(sink_lse_, core::checked_bytes({entries, config_.num_q_heads,
                                                int64_t(sizeof(float))},
                                               "sink LSE"));
    growth.apply(device_, "MultiStepDraftBackend::init_cuda_graph_state(max_bs=" +
                              std::to_string(max_bs) + ")");
    for (CallState& call : steps_) freeze_call(call);
    graph_kv_capacity_ = kv_capacity;
    graph_max_bs_ = max_bs;
  }

 private:
  // batch_size > 0: the plan's shape for that many requests (topk rows each; the cluster split
  // where the batch is small); 0: the shape that sizes the buffers.
  core::PrefillTileShape shared_prefix_shape(int batch_size = 0) const {
    return prefill_tile_shape(setup_, config_, core::MaskMode::kCustom, -1, /*tc=*/true, batch_size,
                              topk_);
  }

  // The branch masks of every step, for up to max_reqs requests (a few hundred KB, written once):
  // step s's request block is [topk rows][(s + 1) * topk columns], row b keeping columns
  // t * topk + b (its own draft tokens of steps 0..s); the mask covers the last (s + 1) * topk
  // keys of the request, the prefix before them is visible to every branch (the decode-shaped
  // kernel's short mask rows, AttentionParams::mask_dense).
  void make_branch_masks() {
    mask_requests_ = config_.req_to_token_pool->max_reqs();
    std::vector<uint8_t> host;
    for (int s = 0; s < num_steps_; ++s) {
      const int cols = (s + 1) * topk_;
      mask_offsets_.push_back(int64_t(host.size()));
      std::vector<uint8_t> block(size_t(topk_) * size_t(cols), 0);
      for (int b = 0; b < topk_; ++b) {
        for (int t = 0; t <= s; ++t) block[size_t(b) * size_t(cols) + size_t(t * topk_ + b)] = 1;
      }
      for (int r = 0; r < mask_requests_; ++r) host.insert(host.end(), block.begin(), block.end());
    }
    ensure_bytes(branch_masks_, std::max<size_t>(host.size(), 1), false, device_, "branch masks");
    check_cuda(cudaMemcpy(branch_masks_.data(), host.data(), host.size(), cudaMemcpyHostToDevice),
               "cudaMemcpy(branch masks)");
  }

  // out_graph of the shared-prefix path: step s is one call of batch_size requests, topk query
  // rows each (entry r * topk + b is request r's row b), over the request's prefix and the draft
  // tokens of steps 0..s (req_to_token positions [0, seq_r + (s + 1) * topk)) under the branch
  // mask, on the decode-shaped kernel.
  void plan_shared_prefix(std::span<const int32_t> seq_lens, cudaStream_t stream) {
    shared_steps_ = true;
    const int bs = batch_size_;
    const core::PrefillTileShape shape = shared_prefix_shape(bs);
    for (int s = 0; s < num_steps_; ++s) {
      CallState& call = steps_[size_t(s)];
      core::PagedLayout& layout = call.layout;
      // Short mask rows: the draft columns only (the kernel sees the prefix before them).
      layout = core::make_draft_step_layout(seq_lens, topk_, s, /*shared_prefix=*/true,
                                            /*full_mask_rows=*/false);
      for (int32_t len : layout.kv_len) max_kv_len_ = std::max(max_kv_len_, len);
      call.paged = true;
      call.prefill = true;
      call.tc_decode = true;
      call.custom_mask = static_cast<const uint8_t*>(branch_masks_.data()) + mask_offsets_[size_t(s)];
      call.item_limit = 0;
      call.max_kv_len = max_kv_len_;
      call.device_plan = device_plan_;
      const core::PrefillPlanCapacity capacity = core::prefill_plan_capacity(bs, topk_, shape);
      if (device_plan_) {
        size_device_tile_plan(call, shape, capacity, config_.num_q_heads / config_.num_kv_heads);
      } else {
        core::plan_prefill_tiles(layout.qo_indptr, layout.kv_indptr, shape, call.prefill_plan);
        call.prefill_items = int(call.prefill_plan.items.size());
        call.prefill_merges = int(call.prefill_plan.merges.size());
        call.padded = graph_pool_;
        if (graph_pool_) core::pad_prefill_plan(call.prefill_plan, capacity);
      }
      core::CallCapacity cap;
      cap.batch_size = graph_pool_ ? graph_max_bs_ * topk_ : bs;
      cap.decode_items = graph_pool_ ? core::decode_item_capacity(cap.batch_size,
                                                                  setup_.plan_config)
                                     : 0;
      cap.custom_mask = true;
      cap.num_q_heads = config_.num_q_heads;
      cap.v_head_dim = config_.v_head_dim;
      const int64_t keys = call_kv_capacity(call, graph_pool_, graph_kv_capacity_,
                                            config_.req_to_token_pool->max_context_len());
      upload_call(call, cap, keys, config_.v_head_dim, step_, device_, stream);
    }
  }

  // ---- planned on the device (no seq_lens_cpu; issue 15) ---------------------------------------

  // Refuses (before anything is written) a batch larger than one planning CTA takes.
  void check_device_plan_fits(int bs) const {
    bool fits = false;
    if (shared_prefix_ && bs <= mask_requests_) {
      const core::PrefillTileShape shape = shared_prefix_shape(bs);
      fits = device_plan_tiles_fit(bs, core::prefill_plan_capacity(bs, topk_, shape), shape);
    } else {
      fits = device_plan_decode_fits(bs * topk_,
                                     core::decode_item_capacity(bs * topk_, setup_.plan_config));
    }
    if (fits) return;
    throw_error(ErrorKind::kInvalidArgument, "seq_lens_cpu", "missing: a multi-step draft batch ",
                "without host lengths is planned on the device; this one (", bs, " requests x ",
                topk_, " branches) is more than one planning CTA takes: pass seq_lens_cpu");
  }

  // Draft step s's KV ranges and plan from the device seq_lens (before its index build): the
  // shared-prefix path's tiles (the host's plan item for item; its branch mask rows are fixed),
  // or the branch entries' CUDA-core decode plan.
  void plan_step_on_device(int s, const ForwardBatch& batch, cudaStream_t stream) const {
    const CallState& call = steps_[size_t(s)];
    DeviceLengths lengths;
    lengths.seq_lens = batch.seq_lens.data();
    lengths.seq_lens_int64 = batch.seq_lens.dtype() == DType::kInt64;
    lengths.max_context_len = config_.req_to_token_pool->max_context_len();
    lengths.q_len = shared_steps_ ? topk_ : 1;
    lengths.tree_tokens = shared_steps_ ? (s + 1) * topk_ : s + 1;
    lengths.per_request = shared_steps_ ? 1 : topk_;
    launch_call_plan(call, lengths, setup_.plan_config, stream);
  }

  BackendConfig config_;
  Device device_;
  int topk_;
  int num_steps_;
  DecodeSetup setup_;
  std::unique_ptr<StepGuard> guard_;
  Buffer sink_lse_;  ///< layers with sinks: each row's LSE before the sink (graph: frozen)
  uint64_t step_ = 0;  ///< guard_'s number of the current step
  std::vector<CallState> steps_;
  bool ready_ = false;          ///< out_graph planned the current batch
  bool indices_built_ = false;  ///< in_graph built its index sets
  int batch_size_ = 0;
  bool graph_pool_ = false;
  int graph_max_bs_ = 0;
  int64_t graph_kv_capacity_ = 0;
  int entries_ = 0;
  int32_t max_kv_len_ = 0;
  bool shared_prefix_ = false;  ///< the config lets a request's branches share its prefix reads
  bool shared_steps_ = false;   ///< the current batch runs the shared-prefix path
  bool device_plan_ = false;    ///< the current batch is planned on the device (no seq_lens_cpu)
  int mask_requests_ = 0;       ///< requests branch_masks_ covers (max_reqs)
  Buffer branch_masks_;         ///< the steps' branch masks (make_branch_masks)
  std::vector<int64_t> mask_offsets_;  ///< step s's masks start here in branch_masks_
};

}  // namespace

std::unique_ptr<core::DraftRunner> make_cuda_draft_runner(const BackendConfig& config, int topk,
                                                          int num_steps) {
  return std::make_unique<CudaDraftRunner>(config, topk, num_steps);
}

}  // namespace kvattn::cuda
