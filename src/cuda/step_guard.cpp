#include "cuda/step_guard.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>

#include "core/cascade.h"
#include "cuda/cuda_util.h"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

std::string indexed(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// One bad index of a report: the argument it names and what was wrong with it.
std::pair<std::string, std::string> describe_argument(const StepReport& r, int argument,
                                                      int64_t num_slots, int max_reqs) {
  const int64_t position = r.position[argument];
  const std::string value = std::to_string(r.value[argument]);
  const std::string pool = "outside the KV pool [0, " + std::to_string(num_slots) + ")";
  switch (argument) {
    case kArgReqPoolIndices:
      return {indexed("req_pool_indices", position),
              "got " + value + ", expected a row of req_to_token in [0, " +
                  std::to_string(max_reqs) + ")"};
    case kArgOutCacheLoc:
      return {indexed("out_cache_loc", position), "slot " + value + " " + pool};
    case kArgEncoderOutCacheLoc:
      return {indexed("encoder_out_cache_loc", position), "slot " + value + " " + pool};
    case kArgSeqLens:
      return {indexed("seq_lens", position),
              "got " + value + ", expected a length in [0, " + std::to_string(r.row[argument]) +
                  "] (max_context_len less the request's draft and encoder tokens; the step was "
                  "planned on the device from seq_lens: no seq_lens_cpu)"};
    case kArgEncoderLens:
      return {indexed("encoder_lens", position),
              "got " + value + ", expected a length in [0, " + std::to_string(r.row[argument]) +
                  "] (max_context_len less the draft tokens; the step was planned on the device: "
                  "no encoder_lens_cpu)"};
    case kArgCustomMask:
      return {"spec.custom_mask", "has " + std::to_string(r.row[argument]) +
                                      " elements, the step's requests need " + value +
                                      " = sum of draft_token_num * (seq_len + draft_token_num)"};
    case kArgExtendPrefixLens:
      return {indexed("extend_prefix_lens", position),
              "got " + value + ", expected a length in [0, seq_lens[" + std::to_string(position) +
                  "] = " + std::to_string(r.row[argument]) +
                  "] (the step was planned on the device: no *_cpu lengths)"};
    case kArgExtendSeqLens:
      if (position < 0) {
        return {"extend_seq_lens",
                "the requests' seq_lens - extend_prefix_lens add up to " + value +
                    " query tokens, the step has " + std::to_string(r.row[argument]) +
                    " (out_cache_loc's length; planned on the device: no *_cpu lengths)"};
      }
      return {indexed("extend_seq_lens", position),
              "got " + value +
                  ", expected seq_lens - extend_prefix_lens = " + std::to_string(r.row[argument])};
    case kArgPlanSource: {
      auto source = [](int64_t v) {
        return std::string(v == kPlanOnDevice ? "on the device (no seq_lens_cpu)"
                                              : "on the host (seq_lens_cpu given)");
      };
      return {"seq_lens_cpu", "this step was planned " + source(r.value[argument]) +
                                  ", the replayed CUDA graph was captured for steps planned " +
                                  source(r.row[argument]) +
                                  ": capture and replay batches of the same kind"};
    }
    case kArgSharedPrefix: {
      core::SharedPrefixViolation v;
      v.group = r.shared_group;
      v.shared_len = r.shared_len;
      v.entry = r.entry[argument];
      v.row = r.row[argument];
      v.position = position;
      v.slot = r.value[argument];
      v.leader = r.shared_leader;
      v.leader_row = r.shared_leader_row;
      v.leader_slot = r.shared_leader_slot;
      v.mask = r.shared_mask != 0;
      core::NamedProblem problem = core::describe_shared_prefix_violation(v);
      return {std::move(problem.argument), std::move(problem.message)};
    }
    default: {
      const int64_t row = r.row[argument];
      const std::string name = "req_to_token[" + std::to_string(row) + "][" +
                               std::to_string(position) + "]";
      return {name, "slot " + (row >= 0 ? value : std::string("?")) + " " + pool +
                        " (read for batch entry " + std::to_string(r.entry[argument]) +
                        ", req_pool_indices[" + std::to_string(r.entry[argument]) +
                        "] = " + std::to_string(row) + ")"};
    }
  }
}

}  // namespace

StepGuard::StepGuard(int64_t num_slots, int max_reqs) : num_slots_(num_slots), max_reqs_(max_reqs) {
  void* host = nullptr;
  const size_t bytes = sizeof(StepReport) * kStepReportRing;
  check_cuda(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
             "cudaHostAlloc(step reports)");
  std::memset(host, 0, bytes);
  void* device = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(&device, host, 0);
  if (status != cudaSuccess) {
    cudaFreeHost(host);
    check_cuda(status, "cudaHostGetDevicePointer(step reports)");
  }
  host_ = static_cast<StepReport*>(host);
  device_ = static_cast<StepReport*>(device);
}

StepGuard::~StepGuard() {
  if (host_ != nullptr) cudaFreeHost(host_);
}

uint64_t StepGuard::begin_step(ForwardMode mode, int batch_size) {
  ++step_;
  info_[step_ % kStepReportRing] = StepInfo{step_, mode, batch_size};
  return step_;
}

StepError StepGuard::describe(const StepReport& report) const {
  const StepInfo& info = info_[report.step % kStepReportRing];
  std::string step_text = "step " + std::to_string(report.step);
  if (info.step == report.step) {
    step_text += std::string(" (") + forward_mode_name(info.mode) + ", batch_size " +
                 std::to_string(info.batch_size) + ")";
  }
  StepError error;
  error.step = report.step;
  error.kind = ErrorKind::kInvalidArgument;
  std::string details;
  for (int a = 0; a < kNumStepArguments; ++a) {
    if ((report.error & (1u << a)) == 0) continue;
    auto [name, what] = describe_argument(report, a, num_slots_, max_reqs_);
    if (error.argument.empty()) {
      error.argument = name;
      details = what;
    } else {
      details += "; also " + name + ": " + what;
    }
  }
  error.message = "kvattn: " + error.argument + ": " + step_text +
                  " was refused on the device: " + details +
                  ". Nothing of the step was written (the KV pool is as before the step; its "
                  "outputs were not computed)";
  return error;
}

std::vector<StepError> StepGuard::take() {
  // The device writes a report's fields, then (after a system fence) its step: read the step
  // first, the fields after an acquire fence, and the step again to skip a record being
  // rewritten meanwhile.
  std::vector<std::pair<uint64_t, int>> landed;
  for (int i = 0; i < kStepReportRing; ++i) {
    const uint64_t step = *reinterpret_cast<volatile const uint64_t*>(&host_[i].step);
    if (step > reported_through_ && step <= step_) landed.emplace_back(step, i);
  }
  std::sort(landed.begin(), landed.end());
  std::vector<StepError> errors;
  for (const auto& [step, index] : landed) {
    std::atomic_thread_fence(std::memory_order_acquire);
    StepReport copy;
    std::memcpy(&copy, const_cast<const StepReport*>(&host_[index]), sizeof(copy));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (*reinterpret_cast<volatile const uint64_t*>(&host_[index].step) != step) continue;
    copy.step = step;
    if (copy.error == 0) continue;
    errors.push_back(describe(copy));
    reported_through_ = step;
  }
  return errors;
}

}  // namespace kvattn::cuda
