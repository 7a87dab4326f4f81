// The device-agnostic front of the backend interface: names, the factory, forward's mode
// dispatch, the optional hooks' default answers and the multi-step draft wrapper.
#include <string>

#include "core/backend_factory.h"
#include "core/batch_layout.h"
#include "core/validate.h"
#include "kvattn/backend.h"
#include "kvattn/error.h"
#include "kvattn/memory.h"

namespace kvattn {

const char* forward_mode_name(ForwardMode mode) {
  switch (mode) {
    case ForwardMode::kIdle: return "IDLE";
    case ForwardMode::kDecode: return "DECODE";
    case ForwardMode::kExtend: return "EXTEND";
    case ForwardMode::kMixed: return "MIXED";
    case ForwardMode::kTargetVerify: return "TARGET_VERIFY";
    case ForwardMode::kDraftExtend: return "DRAFT_EXTEND";
  }
  return "UNKNOWN";
}

int64_t ForwardBatch::num_tokens() const {
  switch (mode) {
    case ForwardMode::kIdle: return 0;
    case ForwardMode::kDecode: return batch_size;
    case ForwardMode::kTargetVerify: return int64_t(batch_size) * spec.draft_token_num;
    default: break;
  }
  const core::HostLengths lens = core::read_host_lengths(*this, false);
  int64_t n = 0;
  for (int32_t e : lens.extend_lens) n += e;
  return n;
}

const char* backend_kind_name(BackendKind kind) {
  return kind == BackendKind::kCpu ? "cpu" : "cuda";
}

BackendKind parse_backend_kind(const std::string& name) {
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  throw_error(ErrorKind::kInvalidArgument, "device", "got '", name, "', expected cpu or cuda");
}

void AttentionBackend::forward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const AttentionLayer& layer,
                               const ForwardBatch& batch, bool save_kv_cache) {
  switch (batch.mode) {
    case ForwardMode::kIdle:
      check_arg(!q.defined() || q.size(0) == 0, "q", "IDLE carries no tokens, got ",
                q);
      check_arg(!out.defined() || out.size(0) == 0, "out", "IDLE carries no tokens, got ",
                out);
      return;  // the output is [0, num_q_heads * v_head_dim]: nothing to write
    case ForwardMode::kDecode:
      forward_decode(q, k, v, out, layer, batch, save_kv_cache);
      return;
    default:
      forward_extend(q, k, v, out, layer, batch, save_kv_cache);
      return;
  }
}

namespace {

// check_errors of both backends: the oldest refused step is the error (kind, argument, step);
// its message lists every refused step taken with it, so each is reported exactly once.
void throw_step_errors(const std::vector<StepError>& errors) {
  if (errors.empty()) return;
  const StepError& first = errors.front();
  std::string message = first.message;
  if (errors.size() > 1) {
    message += " [" + std::to_string(errors.size() - 1) + " more refused step" +
               (errors.size() > 2 ? "s" : "") + ":";
    for (size_t i = 1; i < errors.size(); ++i) {
      message += (i > 1 ? "; " : " ") + errors[i].message;
    }
    message += "]";
  }
  throw Error(first.kind, first.argument, message, int64_t(first.step));
}

}  // namespace

void AttentionBackend::check_errors(bool synchronize) {
  throw_step_errors(take_step_errors(synchronize));
}

void AttentionBackend::update_verify_buffers_to_fill_after_draft(const ForwardBatch&, int) {
  // Nothing to redo: every backend of kvattn reads the tree mask at init_forward_metadata.
}

void AttentionBackend::init_forward_metadata_for_breakable_cuda_graph_capture(
    const ForwardBatch&) {
  throw_error(ErrorKind::kNotSupported, "init_forward_metadata_for_breakable_cuda_graph_capture",
              backend_kind_name(kind()), " backend has no breakable-CUDA-graph metadata");
}

void AttentionBackend::prepare_forward_metadata_for_breakable_cuda_graph_replay(
    const ForwardBatch&) {
  throw_error(ErrorKind::kNotSupported,
              "prepare_forward_metadata_for_breakable_cuda_graph_replay",
              backend_kind_name(kind()), " backend has no breakable-CUDA-graph metadata");
}

namespace {

void require_cuda_build_and_device() {
#if !defined(KVATTN_WITH_CUDA)
  throw_error(ErrorKind::kNotSupported, "kind",
              "cuda: this build of kvattn has no CUDA backend (built without nvcc)");
#else
  // kNotSupported, as make_backend documents: the request is valid, this machine cannot serve it.
  if (cuda_device_count() == 0) {
    throw_error(ErrorKind::kNotSupported, "kind", "cuda: no CUDA device is visible");
  }
#endif
}

}  // namespace

std::unique_ptr<AttentionBackend> make_backend(BackendKind kind, const BackendConfig& config) {
  core::validate_backend_config(config);
  const Device device = config.kv_cache->config().device;
  if (kind == BackendKind::kCpu) {
    check_arg(device.is_cpu(), "kv_cache", "on ", device,
              ", the CPU backend needs it on the host");
    return cpu::make_cpu_backend(config);
  }
  require_cuda_build_and_device();
  check_arg(device.is_cuda(), "kv_cache", "on ", device,
            ", the CUDA backend needs it on a CUDA device");
#if defined(KVATTN_WITH_CUDA)
  return cuda::make_cuda_backend(config);
#else
  return nullptr;
#endif
}

// ---- MultiStepDraftBackend -----------------------------------------------------------------

struct MultiStepDraftBackend::Impl {
  std::unique_ptr<core::DraftRunner> runner;
};

MultiStepDraftBackend::MultiStepDraftBackend(BackendKind kind, const BackendConfig& config,
                                             int topk, int num_steps)
    : impl_(std::make_unique<Impl>()), topk_(topk), num_steps_(num_steps) {
  core::validate_backend_config(config);
  check_arg(topk >= 1, "topk", "got ", topk, ", expected >= 1");
  check_arg(num_steps >= 1, "num_steps", "got ", num_steps, ", expected >= 1");
  const Device device = config.kv_cache->config().device;
  if (kind == BackendKind::kCpu) {
    check_arg(device.is_cpu(), "kv_cache", "on ", device,
              ", the CPU backend needs it on the host");
    impl_->runner = cpu::make_cpu_draft_runner(config, topk, num_steps);
    return;
  }
  require_cuda_build_and_device();
  check_arg(device.is_cuda(), "kv_cache", "on ", device,
            ", the CUDA backend needs it on a CUDA device");
#if defined(KVATTN_WITH_CUDA)
  impl_->runner = cuda::make_cuda_draft_runner(config, topk, num_steps);
#endif
}

MultiStepDraftBackend::~MultiStepDraftBackend() = default;

void MultiStepDraftBackend::init_forward_metadata(const ForwardBatch& batch) {
  check_arg(batch.mode == ForwardMode::kDecode, "mode", "got ", forward_mode_name(batch.mode),
            ", the multi-step draft backend runs DECODE batches");
  impl_->runner->init_forward_metadata(batch);
}

void MultiStepDraftBackend::init_forward_metadata_out_graph(const ForwardBatch& batch,
                                                            bool in_capture) {
  check_arg(batch.mode == ForwardMode::kDecode, "mode", "got ", forward_mode_name(batch.mode),
            ", the multi-step draft backend runs DECODE batches");
  impl_->runner->init_forward_metadata_out_graph(batch, in_capture);
}

void MultiStepDraftBackend::init_forward_metadata_in_graph(const ForwardBatch& batch) {
  impl_->runner->init_forward_metadata_in_graph(batch);
}

void MultiStepDraftBackend::forward_step(int step, const TensorView& q, const TensorView& k,
                                         const TensorView& v, const TensorView& out,
                                         const AttentionLayer& layer,
                                         const TensorView& out_cache_loc) {
  check_arg(step >= 0 && step < num_steps_, "step", "got ", step, ", expected 0..",
            num_steps_ - 1);
  impl_->runner->forward_step(step, q, k, v, out, layer, out_cache_loc);
}

void MultiStepDraftBackend::init_cuda_graph_state(int max_bs) {
  check_arg(max_bs >= 1, "max_bs", "got ", max_bs, ", expected >= 1");
  impl_->runner->init_cuda_graph_state(max_bs);
}

void MultiStepDraftBackend::set_cuda_stream(void* stream) { impl_->runner->set_cuda_stream(stream); }

uint64_t MultiStepDraftBackend::step_id() const { return impl_->runner->step_id(); }

std::vector<StepError> MultiStepDraftBackend::take_step_errors(bool synchronize) {
  return impl_->runner->take_step_errors(synchronize);
}

void MultiStepDraftBackend::check_errors(bool synchronize) {
  throw_step_errors(take_step_errors(synchronize));
}

}  // namespace kvattn
