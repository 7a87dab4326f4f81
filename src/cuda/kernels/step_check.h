// The device half of "a bad index refuses the whole step" (kvattn/backend.h, check_errors).
//
// The CUDA backend cannot read a step's index tensors on the host without a sync, so the step's
// device work checks them, before anything of the step is written:
//   1. out_graph's metadata copy (one per call, already there) writes a zeroed StepState and the
//      step number at the start of call 0's metadata: the step's error word starts at 0.
//   2. in_graph: the index kernels (build_kv_indices, build_draft_kv_indices) flag req_to_token
//      entries outside the pool in the word; then the step-check kernel (one CTA, the last
//      launch of in_graph) checks req_pool_indices, out_cache_loc and encoder_out_cache_loc,
//      sets the word and, when it is not 0, publishes a StepReport to the host (mapped pinned
//      memory, no copy, no sync).
//   3. Every kernel of the step that writes (K/V save, attention, merges, io conversions) reads
//      the word at its start (after griddepcontrol.wait where it is a programmatic dependent)
//      and returns without writing anything when it is not 0 (step_refused in step_check.cuh).
// The host reads the reports when the engine calls check_errors() (cuda/step_guard.h). Captured
// in a CUDA graph, steps 2-3 replay as recorded and step 1 runs in the out_graph before each
// replay, so a replayed step is checked exactly like an eager one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvattn::cuda {

/// The index tensors the device checks, in the order a report names them (the CPU backend
/// checks them in the same order, so both name the same first argument).
enum StepArgument : int {
  kArgReqPoolIndices = 0,      ///< req_pool_indices[i] outside [0, max_reqs)
  kArgOutCacheLoc = 1,         ///< out_cache_loc[i] outside [0, num_slots)
  kArgEncoderOutCacheLoc = 2,  ///< encoder_out_cache_loc[i] outside [0, num_slots)
  kArgReqToToken = 3,          ///< req_to_token[row][position] outside [0, num_slots)
  /// Declared shared-prefix groups (ForwardBatch::shared_prefix_lens_cpu): a member's slot at a
  /// shared position differs from its group leader's, or (TARGET_VERIFY) a tree token's mask
  /// hides a shared key. Checked by the cascade check kernel (kernels/cascade.h).
  kArgSharedPrefix = 4,
  /// seq_lens[i] outside [0, max_context_len]: a DECODE step planned on the device from the
  /// engine's device seq_lens (no *_cpu copy; kernels/device_plan.h clamps it meanwhile).
  kArgSeqLens = 5,
  /// The step's plan and the captured graph's disagree: a graph captured for steps planned on
  /// the device (no seq_lens_cpu) replayed after a step planned on the host, or the reverse.
  kArgPlanSource = 6,
  /// spec.custom_mask shorter than the rows a TARGET_VERIFY step planned on the device needs
  /// (sum of draft_token_num x (seq_len + draft_token_num)).
  kArgCustomMask = 7,
  /// An EXTEND-like step planned on the device: extend_prefix_lens[i] outside [0, seq_lens[i]].
  kArgExtendPrefixLens = 8,
  /// An EXTEND-like step planned on the device: extend_seq_lens[i] != seq_lens[i] -
  /// extend_prefix_lens[i] (position i), or the query tokens seq - prefix do not add up to
  /// out_cache_loc's length (position -1).
  kArgExtendSeqLens = 9,
  /// An encoder-decoder step planned on the device: encoder_lens[i] outside [0, max_context_len
  /// - draft tokens]. (A seq_len past what the request's encoder tokens leave of req_to_token's
  /// row is kArgSeqLens.)
  kArgEncoderLens = 10,
  kNumStepArguments = 11,
};

/// The step's error state on the device: kStepStateBytes (core/planner.h) at the start of call
/// 0's metadata, written by the host (zeros + step) at every out_graph.
struct alignas(16) StepState {
  /// The step error word: bit (1 << StepArgument) for each kind of bad index seen; 0 = the step
  /// may write. Kernels read it through AttentionParams::step_error.
  uint32_t error = 0;
  /// Where the step's plan comes from (kPlanOnHost / kPlanOnDevice), written by out_graph; the
  /// step-check kernel compares it with the one its launch was made (captured) for.
  uint32_t plan_source = 0;
  uint64_t step = 0;  ///< the host's step number (AttentionBackend::step_id)
  /// The first bad req_to_token read, as ~((batch entry << 32) | position): the index kernels
  /// keep the smallest (entry, position) with an atomicMax on the complement (0 = none).
  uint64_t req_to_token_key = 0;
  /// The first broken shared-prefix promise, as ~((batch entry << 32) | (position << 1) | mask):
  /// kept like req_to_token_key (mask = 1: a tree mask hides the key; 0: the slot differs).
  uint64_t shared_prefix_key = 0;
};
static_assert(sizeof(StepState) == 32, "StepState must fit core::kStepStateBytes");

/// StepState::plan_source values.
constexpr uint32_t kPlanOnHost = 1;    ///< out_graph planned from the host lengths
constexpr uint32_t kPlanOnDevice = 2;  ///< in_graph plans from the device lengths

/// What the device tells the host about one refused step: a record of a ring in mapped pinned
/// host memory, at index step % kStepReportRing. `step` is written last, after a system fence.
struct alignas(16) StepReport {
  uint64_t step = 0;  ///< 0 = empty
  uint32_t error = 0;
  uint32_t reserved = 0;
  int64_t position[kNumStepArguments] = {};  ///< first bad index (req_to_token: the position)
  int64_t value[kNumStepArguments] = {};     ///< the value found there
  int64_t entry[kNumStepArguments] = {};     ///< req_to_token: the batch entry that read it
  int64_t row[kNumStepArguments] = {};       ///< req_to_token: req_pool_indices[entry]
  /// kArgSharedPrefix (entry, position, value = the entry's slot there, row as above): its
  /// group, the group's shared length, the leader's batch entry, row and slot there, and whether
  /// a tree mask (not a slot) broke the promise.
  int64_t shared_group = -1;
  int64_t shared_len = 0;
  int64_t shared_leader = -1;
  int64_t shared_leader_row = -1;
  int64_t shared_leader_slot = -1;
  int64_t shared_mask = 0;
};
/// Refused steps whose reports the host can hold between two check_errors (older ones are
/// overwritten: the host then says so).
constexpr int kStepReportRing = 256;

/// A (possibly absent) 1-D int32 / int64 index tensor on the device.
struct DeviceIndexArray {
  const void* data = nullptr;
  bool int64 = false;
  int64_t length = 0;
};

/// The step-check kernel's arguments (one CTA; launched last in in_graph).
struct StepCheckLaunch {
  StepState* state = nullptr;
  StepReport* reports = nullptr;  ///< [kStepReportRing], device view of mapped host memory
  DeviceIndexArray req_pool_indices;
  int64_t max_reqs = 0;
  DeviceIndexArray out_cache_loc;
  DeviceIndexArray encoder_out_cache_loc;
  int64_t num_slots = 0;
  /// A step planned on the device: its seq_lens, each checked to be in [0, max_seq_len -
  /// encoder_lens[i]] (absent otherwise: the host read and checked them).
  DeviceIndexArray seq_lens;
  int64_t max_seq_len = 0;
  /// An encoder-decoder step planned on the device: its encoder lengths, each in [0,
  /// max_seq_len] (absent otherwise).
  DeviceIndexArray encoder_lens;
  /// An EXTEND-like step planned on the device: its prefix lengths (each in [0, seq_lens[i]]),
  /// its extend lengths when given (each seq - prefix), and the step's query rows (the sum of
  /// seq - prefix must equal it). Absent otherwise.
  DeviceIndexArray extend_prefix_lens;
  DeviceIndexArray extend_seq_lens;
  int64_t num_tokens = 0;
  /// The plan source in_graph was recorded for (kPlanOnHost / kPlanOnDevice); 0: not checked.
  uint32_t plan_source = 0;
  /// A TARGET_VERIFY step planned on the device: the tree mask rows it needs (the device-written
  /// mask_indptr[batch_size]) against the mask's length (null: not checked).
  const int64_t* mask_rows_end = nullptr;
  const int64_t* mask_elems = nullptr;    ///< device, written by out_graph for each step
  const int32_t* req_to_token = nullptr;  ///< [max_reqs, max_context_len]: re-reads the bad slot
  int64_t req_to_token_row_stride = 0;
  /// Declared shared-prefix groups (a cascade step; null otherwise), device int32 arrays to
  /// describe a broken promise: each batch entry's group (-1 = none) and each group's leader
  /// (batch entry) and shared length.
  const int32_t* entry_group = nullptr;   ///< [batch_size]
  const int32_t* group_leader = nullptr;  ///< [num_groups]
  const int32_t* group_len = nullptr;     ///< [num_groups]
};
void launch_step_check(const StepCheckLaunch& launch, cudaStream_t stream);

}  // namespace kvattn::cuda
