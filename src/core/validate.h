// Validation at the public boundary (SPEC §5): every check names the argument, the value and
// what was expected, and throws kvattn::Error before anything is written.
#pragma once

#include <cstdint>

#include "core/batch_layout.h"
#include "kvattn/backend.h"

namespace kvattn::core {

/// The backend config: pools present, heads divisible, dims matching the KV cache.
void validate_backend_config(const BackendConfig& config);

/// A layer against the backend's config (heads, dims, scale, window, cross, fp8 scales).
void validate_layer(const AttentionLayer& layer, const BackendConfig& config);

/// The per-step batch against the pools: tensor shapes and dtypes, device, req_pool_indices in
/// range, seq_len + offsets within max_context_len, spec inputs. Host lengths must be readable.
void validate_batch(const ForwardBatch& batch, const BackendConfig& config, Device device);

/// validate_batch, returning the host lengths it read and checked (read_host_lengths) so the
/// caller does not read them again (core::derive_step); empty for IDLE. With device_lengths (a
/// DECODE step a backend plans on the device, core::derive_step) the lengths are not read: the
/// tensors' shapes, dtypes and devices are checked, and the values are the device's to check.
HostLengths validate_batch_lengths(const ForwardBatch& batch, const BackendConfig& config,
                                   Device device, bool device_lengths = false);

/// q/k/v/out of one forward call: shapes, dtypes, device, contiguous last dimension, and the
/// out_cache_loc slots within the pool (host-readable loc only; device kernels clamp).
void validate_forward_tensors(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const AttentionLayer& layer,
                              const ForwardBatch& batch, const BackendConfig& config,
                              Device device, int64_t num_tokens, bool save_kv_cache);

/// layer.sinks, when given: [num_q_heads] fp32/bf16/fp16, contiguous, on `device`.
void check_sinks(const AttentionLayer& layer, Device device);

/// The step's slot tensors, when given: out_cache_loc and encoder_out_cache_loc must be 1-D
/// int32/int64 tensors on `device`, and host ones hold slots in [0, num_slots) (named
/// "out_cache_loc[i]" like the device check of the CUDA backend). Runs in
/// init_forward_metadata, so a bad slot refuses the step before any layer saves K/V.
void validate_step_slots(const ForwardBatch& batch, int64_t num_slots, Device device);

/// A 1-D index tensor of `length` int32/int64 elements on `device` (throws naming `name`).
void check_index_tensor(const TensorView& t, const char* name, int64_t length, Device device);

}  // namespace kvattn::core
