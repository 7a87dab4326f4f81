// One step's facts, derived once (issue 15): the batch validated against the pools, its host
// lengths read once, and what the backends, the draft runners and the tools need from them (query
// rows, new tokens, the ragged or paged EXTEND choice). init_forward_metadata of every backend
// starts here; nothing re-reads the lengths after it.
#pragma once

#include <cstdint>

#include "core/batch_layout.h"
#include "kvattn/backend.h"

namespace kvattn::core {

struct StepFacts {
  ForwardMode mode = ForwardMode::kIdle;
  int batch_size = 0;
  /// The host lengths (read_host_lengths), validated; empty for IDLE.
  HostLengths lens;
  /// TARGET_VERIFY: tree tokens a request (spec.draft_token_num); else 0.
  int draft_token_num = 0;
  /// EXTEND-like modes: the new tokens of the step (sum of the extend lengths); else 0.
  int64_t new_tokens = 0;
  /// EXTEND-like modes: the cached prefix tokens the step attends to (sum of the prefix
  /// lengths); else 0.
  int64_t prefix_tokens = 0;
  /// Query rows of the step: DECODE batch_size, TARGET_VERIFY batch_size x draft_token_num,
  /// EXTEND-like new_tokens, IDLE 0.
  int64_t num_tokens = 0;
  /// EXTEND / MIXED on the ragged + paged-prefix path (use_ragged_extend with the config's
  /// threshold, window, encoder-decoder and deterministic settings).
  bool ragged = false;
  /// The step is planned on the device from its device lengths (uses_device_lengths): `lens`
  /// is empty, and no length was read on the host.
  bool device_lengths = false;
};

/// Whether a backend that plans on the device (device_plan: the CUDA backend) takes `batch` from
/// its device lengths: a batch without declared shared-prefix groups (their checks read the
/// lengths) whose seq_lens are on the device with no seq_lens_cpu; EXTEND-like, its
/// extend_prefix_lens and out_cache_loc on the device and no extend_*_cpu; in an encoder-decoder
/// model, its encoder_lens on the device with no encoder_lens_cpu. Any other batch is read on
/// the host (and one whose lengths are on the device alone is refused, naming the *_cpu copy it
/// needs).
bool uses_device_lengths(const ForwardBatch& batch, const BackendConfig& config, bool device_plan);

/// Validates `batch` against `config` on `device` (validate_batch's checks, SPEC §5: each names
/// the argument, the value and what was expected) and derives its facts, reading the host
/// lengths once (none where uses_device_lengths(batch, config, device_plan)). Throws
/// kvattn::Error before anything is written.
StepFacts derive_step(const ForwardBatch& batch, const BackendConfig& config, Device device,
                      bool device_plan = false);

}  // namespace kvattn::core
