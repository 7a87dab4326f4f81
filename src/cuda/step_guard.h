// The host half of "a bad index refuses the whole step" on the CUDA backend (the device half and
// the whole flow: kernels/step_check.h).
//
// A StepGuard numbers the steps of one backend (begin_step, at every out_graph), owns the ring of
// StepReports that the device writes into mapped pinned memory, and turns the reports into
// StepErrors when the engine asks (check_errors / take_step_errors): each refused step exactly
// once, oldest first, named by its number. Reading the ring is a few hundred host loads: no
// copy, no sync, nothing on the device's side of the hot path.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "cuda/kernels/step_check.h"
#include "kvattn/backend.h"

namespace kvattn::cuda {

class StepGuard {
 public:
  /// `num_slots` and `max_reqs`: the ranges the messages name.
  StepGuard(int64_t num_slots, int max_reqs);
  ~StepGuard();
  StepGuard(const StepGuard&) = delete;
  StepGuard& operator=(const StepGuard&) = delete;

  /// Starts a step: returns its number (1, 2, ...) and remembers its mode and batch size for
  /// the message of a refusal.
  uint64_t begin_step(ForwardMode mode, int batch_size);
  uint64_t step_id() const { return step_; }
  /// The ring as kernels address it ([kStepReportRing]).
  StepReport* device_reports() const { return device_; }
  /// The steps refused since the last call whose reports have landed, oldest first; each step is
  /// returned once.
  std::vector<StepError> take();

 private:
  struct StepInfo {
    uint64_t step = 0;
    ForwardMode mode = ForwardMode::kIdle;
    int batch_size = 0;
  };
  StepError describe(const StepReport& report) const;

  StepReport* host_ = nullptr;
  StepReport* device_ = nullptr;
  int64_t num_slots_;
  int max_reqs_;
  uint64_t step_ = 0;
  uint64_t reported_through_ = 0;  ///< every step up to this one has been reported (or was good)
  std::array<StepInfo, kStepReportRing> info_{};
};

}  // namespace kvattn::cuda
