// The random world one scenario runs in: pools, batch, layer, inputs and the float64 inputs of
// the reference. run_scenario builds one; the bad-input tests build one and break a piece of it.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "kvattn/backend.h"
#include "kvattn/kv_cache.h"
#include "kvattn/memory.h"
#include "reference/reference.h"
#include "reference/scenario.h"

namespace kvattn::testing {

/// One forward call of the scenario (multi-step draft: one per step).
struct ScenarioCall {
  int64_t num_tokens = 0;
  TensorView q;              ///< [num_tokens, num_q_heads, head_dim] (or 2-D / strided rows)
  TensorView k;              ///< [new_kv rows, num_kv_heads, head_dim]; absent when not passed
  TensorView v;              ///< [new_kv rows, num_kv_heads, v_head_dim]
  TensorView out;            ///< [num_tokens, num_q_heads, v_head_dim] (or 2-D)
  TensorView out_with_guard; ///< out plus kOutGuardRows NaN rows after it (must stay NaN)
  TensorView out_cache_loc;  ///< multi-step draft: this step's slots
  std::vector<double> q_values;  ///< [num_tokens, num_q_heads, head_dim] exact io values
  RefNewKv new_kv;               ///< what this call saves (or what the caller pre-wrote)
};

/// Everything a scenario needs. Not movable: views and the backend config point into it.
class ScenarioWorld {
 public:
  static constexpr int kOutGuardRows = 2;
  static constexpr int kTestedLayer = 1;  ///< layer 0 holds decoy data the backend must not read

  /// Builds the world of `spec` for a backend of `kind` (device memory for kCuda).
  static std::unique_ptr<ScenarioWorld> build(const ScenarioSpec& spec, BackendKind kind);
  ScenarioWorld(const ScenarioWorld&) = delete;
  ScenarioWorld& operator=(const ScenarioWorld&) = delete;

  ScenarioSpec spec;
  BackendKind kind = BackendKind::kCpu;
  Device device;
  std::optional<KvCache> kv_cache;
  std::optional<ReqToTokenPool> req_to_token_pool;
  BackendConfig config;
  AttentionLayer layer;
  ForwardBatch batch;
  std::vector<ScenarioCall> calls;
  bool ragged = false;        ///< the backend is expected to take the ragged EXTEND path
  bool multi_step = false;    ///< run through MultiStepDraftBackend
  float k_scale = 1.f;        ///< the scales the tested layer resolves to
  float v_scale = 1.f;
  std::vector<double> sink_values;  ///< spec.sinks: layer.sinks's values (exact), per q head

  RefBatch ref_batch;
  RefKvPool ref_pool;         ///< the tested layer before the run, dequantized
  /// Bytes of every layer's K and V before the run: [layer][0 = K, 1 = V].
  std::vector<std::array<std::vector<uint8_t>, 2>> pool_bytes_before;

  /// An index tensor on `where` (int32 or int64) holding `values`; owned by the world.
  TensorView index_tensor(const std::vector<int64_t>& values, DType dtype, Device where);
  /// A tensor on `where` with a copy of `bytes` (contiguous `shape` of `dtype`).
  TensorView upload(DType dtype, std::initializer_list<int64_t> shape, const void* bytes,
                    Device where);
  /// Bytes of a contiguous tensor, copied to the host.
  static std::vector<uint8_t> download(const TensorView& t);
  /// Current bytes of layer `layer_id`'s K (which = 0) or V (which = 1).
  std::vector<uint8_t> pool_bytes(int layer_id, int which) const;
  /// True when no byte of any layer of the pool changed since the build.
  bool pool_unchanged() const;
  /// The dtype index tensors of this world use.
  DType index_dtype = DType::kInt32;

 private:
  ScenarioWorld() = default;
  std::vector<Buffer> buffers_;
};

/// Runs every call of the world on a new backend of w.kind with `layer` (normally w.layer).
/// Throws what the backend throws.
void run_world(ScenarioWorld& w, const AttentionLayer& layer);

/// After run_world: the outputs against the float64 reference (for w.layer) and the KV pool
/// against its expected contents.
ScenarioResult judge_world(ScenarioWorld& w);

}  // namespace kvattn::testing
