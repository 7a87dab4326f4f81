// The CUDA backend (see cuda_backend.h for the step flow).
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/backend_factory.h"
#include "core/params_fill.h"
#include "core/size_check.h"
#include "core/step.h"
#include "core/validate.h"
#include "cuda/cascade.h"
#include "cuda/kernels/device_plan.h"
#include "cuda/kernels/index.h"
#include "cuda/kernels/kv_write.h"
#include "cuda/kernels/prefill.h"
#include "cuda/step_guard.h"
#include "kvattn/error.h"
#include "kvattn/kv_cache.h"

namespace kvattn::cuda {
namespace {

cudaStream_t as_stream(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

std::atomic<uint64_t> allocations{0};

bool is_fp8(DType d) {
  return d == DType::kFloat8E4M3 || d == DType::kFloat8E5M2;
}

// KVATTN_DECODE_TENSOR_CORES=0/1 overrides the config (kvattn/backend.h).
TensorCoreDecode resolve_tensor_core_choice(TensorCoreDecode configured) {
  const char* env = std::getenv("KVATTN_DECODE_TENSOR_CORES");
  if (env == nullptr || env[0] == '\0') return configured;
  const std::string value(env);
  if (value == "0") return TensorCoreDecode::kOff;
  if (value == "1") return TensorCoreDecode::kOn;
  throw_error(ErrorKind::kInvalidArgument, "KVATTN_DECODE_TENSOR_CORES", "got '", value,
              "', expected 0 or 1");
}

}  // namespace

// ---- setup, buffers, params ------------------------------------------------------------------

namespace debug {
uint64_t allocation_count() {
  return allocations.load(std::memory_order_relaxed);
}
}  // namespace debug

// Grows by half again, so a slowly growing batch reallocates rarely; the new buffer is made
// before the old one goes, so a growth that fails changes nothing.
void ensure_bytes(Buffer& buffer, size_t bytes, bool frozen, Device device, const char* what) {
  if (buffer.bytes() >= bytes && buffer.data() != nullptr) return;
  if (frozen) {
    throw_error(ErrorKind::kOutOfResources, what, "needs ", bytes, " bytes, the CUDA-graph buffer ",
                "sized by init_cuda_graph_state holds ", buffer.bytes());
  }
  const size_t wanted = std::max<size_t>(bytes, 256);
  const size_t grown = wanted <= SIZE_MAX / 3 ? std::max(wanted, bytes + bytes / 2) : wanted;
  Buffer fresh;
  try {
    fresh = Buffer::allocate(device, grown);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kOutOfResources || grown == wanted) throw;
    try {
      fresh = Buffer::allocate(device, wanted);  // the headroom does not fit: exactly, then
    } catch (const Error& again) {
      if (again.kind() != ErrorKind::kOutOfResources) throw;
      throw_error(ErrorKind::kOutOfResources, what, "cannot grow from ", buffer.bytes(), " to ",
                  wanted, " bytes on ", device, ": ", again.what(),
                  " (the step was refused; the backend keeps its buffers and stays usable)");
    }
  }
  buffer = std::move(fresh);
  allocations.fetch_add(1, std::memory_order_relaxed);
}

void BufferGrowth::need(Buffer& target, size_t bytes) {
  if (target.data() != nullptr && target.bytes() >= bytes) return;
  device_.push_back({&target, std::max<size_t>(bytes, 256)});
}

void BufferGrowth::need(PinnedBuffer& target, size_t bytes) {
  if (target.bytes() >= bytes) return;
  pinned_.push_back({&target, bytes});
}

void BufferGrowth::need(std::unique_ptr<CopyFence>& fence) {
  if (!fence) fences_.push_back(&fence);
}

size_t BufferGrowth::device_bytes() const {
  size_t total = 0;
  for (const DeviceNeed& n : device_) total = core::checked_sum(total, n.bytes, "device buffers");
  return total;
}

size_t BufferGrowth::pinned_bytes() const {
  size_t total = 0;
  for (const PinnedNeed& n : pinned_) total = core::checked_sum(total, n.bytes, "pinned buffers");
  return total;
}

void BufferGrowth::apply(Device device, const std::string& what) {
  core::check_fits(device, device_bytes(), what);
  core::check_fits(Device::cpu(), pinned_bytes(), what + " (pinned host staging)");
  // Phase 1: everything new, next to the old buffers. A throw unwinds these vectors, freeing
  // what was made; no target has changed yet.
  std::vector<Buffer> fresh;
  fresh.reserve(device_.size());
  for (const DeviceNeed& n : device_) fresh.push_back(Buffer::allocate(device, n.bytes));
  std::vector<PinnedBuffer> fresh_pinned(pinned_.size());
  for (size_t i = 0; i < pinned_.size(); ++i) fresh_pinned[i].reserve(pinned_[i].bytes);
  std::vector<std::unique_ptr<CopyFence>> fresh_fences;
  for (size_t i = 0; i < fences_.size(); ++i) fresh_fences.push_back(std::make_unique<CopyFence>());
  // Phase 2: swap in (nothing below throws); the old buffers are freed as they are replaced.
  for (size_t i = 0; i < device_.size(); ++i) *device_[i].target = std::move(fresh[i]);
  for (size_t i = 0; i < pinned_.size(); ++i) *pinned_[i].target = std::move(fresh_pinned[i]);
  for (size_t i = 0; i < fences_.size(); ++i) *fences_[i] = std::move(fresh_fences[i]);
  allocations.fetch_add(device_.size() + pinned_.size(), std::memory_order_relaxed);
  device_.clear();
  pinned_.clear();
  fences_.clear();
}

DecodeSetup make_decode_setup(const BackendConfig& config, int device) {
  DecodeSetup setup;
  const KvCacheConfig& kv = config.kv_cache->config();
  const int v_head_dim = config.v_head_dim > 0 ? config.v_head_dim : config.head_dim;
  const int group = config.num_q_heads / config.num_kv_heads;
  const DeviceInfo& dev = device_info(device);

  setup.info = decode_kernel_info(config.head_dim, v_head_dim, kv.dtype, group, device);
  setup.plan_config.ctas_per_item = config.num_kv_heads * setup.info.head_passes;
  setup.plan_config.concurrent_ctas = dev.sm_count * setup.info.ctas_per_sm;
  setup.plan_config.chunk_align = setup.info.tile_tokens;
  // Two pipeline steps: a chunk's loads are then all in flight from the CTA's start (short
  // requests split finely and finish in about one memory latency; bench/NOTES.md).
  // Tuning knobs (bench/NOTES.md): KVATTN_DECODE_MIN_CHUNK, KVATTN_DECODE_CHUNK (fixed split).
  setup.plan_config.min_chunk = env_int("KVATTN_DECODE_MIN_CHUNK", 2 * setup.info.tile_tokens);
  setup.plan_config.fixed_chunk = env_int("KVATTN_DECODE_CHUNK", 0);

  // The prefill kernels serve bf16/fp16 io with v_head_dim == head_dim, head_dim 128 with
  // v_head_dim a multiple of 16 below it, and on sm_90 head_dim 192 with v_head_dim 128
  // (kernels/prefill.h); fp32 io reaches them through 16-bit copies (see compute_dtype).
  const bool io_native = config.q_dtype == DType::kBFloat16 || config.q_dtype == DType::kFloat16;
  setup.compute_dtype = io_native                     ? config.q_dtype
                        : kv.dtype == DType::kFloat16 ? DType::kFloat16
                                                      : DType::kBFloat16;
  setup.prefill_supported = false;
  if (prefill_v_head_dim_supported(config.head_dim, v_head_dim)) {
    try {
      const PrefillKernelShape shape = prefill_kernel_shape(config.head_dim, v_head_dim, device);
      setup.prefill_supported = true;
      setup.prefill_tile_rows = shape.tile_rows;
      setup.prefill_kv_tile = shape.kv_tile;
      setup.concurrent_prefill_ctas = dev.sm_count * shape.ctas_per_sm;
      setup.prefill_l2_keys = shape.l2_keys;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kNotSupported) throw;
    }
  }
  // Deterministic mode: one kernel family for every mode (decode on the tensor-core path, as in
  // MIXED steps), no decode-shaped kernel (picked by the batch's longest request), no split-KV
  // (prefill_shape), no ragged path (use_ragged_extend).
  const bool tc_wanted = env_int("KVATTN_TC_DECODE", 1, 0) != 0 && !config.deterministic;
  if (setup.prefill_supported && tc_wanted && tc_decode_serves(config.head_dim, v_head_dim)) {
    try {
      const PrefillKernelShape shape = tc_decode_kernel_shape(config.head_dim, v_head_dim, device);
      setup.tc_decode = true;
      setup.tc_decode_tile_rows = shape.tile_rows;
      setup.tc_decode_kv_tile = shape.kv_tile;
      setup.concurrent_tc_decode_ctas = dev.sm_count * shape.ctas_per_sm;
      setup.tc_decode_min_split = env_int("KVATTN_TC_DECODE_MIN_SPLIT", 256, 1);
      setup.tc_decode_max_cluster =
          std::min(shape.max_cluster, env_int("KVATTN_TC_DECODE_MAX_CLUSTER", 16, 0));
      // KVATTN_TC_DECODE_NARROW: 0 never the 16-row instance, 1 (default) for calls of at most
      // 16 packed rows a request, 2 for every call (an A/B knob: a 32-row call then runs two
      // tiles a kv head, twice the CTAs).
      const int narrow = env_int("KVATTN_TC_DECODE_NARROW", 1, 0);
      if (narrow != 0) setup.tc_decode_narrow_rows = shape.narrow_tile_rows;
      setup.tc_decode_narrow_always = narrow == 2;
      // KVATTN_TC_DECODE_TRANSPOSED=0: never the transposed 8-row instance (an A/B knob); 1
      // (default) for calls of at most 8 packed rows a request.
      if (narrow != 2 && env_int("KVATTN_TC_DECODE_TRANSPOSED", 1, 0) != 0) {
        setup.tc_decode_transposed_rows = shape.transposed_tile_rows;
      }
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kNotSupported) throw;
    }
  }
  const TensorCoreDecode choice = resolve_tensor_core_choice(config.decode_tensor_cores);
  // Automatic: groups above 4 on either tensor-core kernel; a group of 4 where the
  // decode-shaped kernel serves the head dims (its 16-row tile with the cluster split measured
  // at or below the CUDA-core decode on every decode row of the grid, fp8 included, and below
  // FlashInfer at b1 x 1024 - b256: bench/NOTES.md v10); the prefill family would not win there.
  const bool wanted =
      choice == TensorCoreDecode::kOn ||
      (choice == TensorCoreDecode::kAuto && (group > 4 || (group == 4 && setup.tc_decode)));
  // The prefill kernel reads KV in the io dtype or fp8 (kernels/prefill.h).
  const bool kv_ok = kv.dtype == config.q_dtype || is_fp8(kv.dtype);
  setup.tensor_cores = (wanted || config.deterministic) && setup.prefill_supported && io_native &&
                       kv_ok;
  // (Where the tensor-core path cannot run, deterministic decode splits in fixed chunks.)
  if (config.deterministic) {
    setup.plan_config.fixed_chunk = 8 * setup.info.tile_tokens;
    setup.plan_config.concurrent_ctas = 0;  // never the batch-dependent choice
  }
  return setup;
}

void upload_call(CallState& call, const core::CallCapacity& capacity, int64_t kv_indices_capacity,
                 int v_head_dim, uint64_t step, Device device, cudaStream_t stream) {
  if (!call.fence) call.fence = std::make_unique<CopyFence>();
  call.fence->wait();  // the previous step's copy out of staging must be done
  call.capacity = capacity;
  call.offsets = core::write_call_metadata(capacity, nullptr, nullptr, nullptr, 0);
  size_t copy_bytes = call.offsets.metadata_bytes;
  size_t metadata_bytes = copy_bytes;
  const size_t prefill_offset = align_region(call.offsets.metadata_bytes);
  if (call.prefill) {
    const core::PrefillBufferLayout region =
        core::write_prefill_buffer(call.prefill_plan, v_head_dim, nullptr, 0, nullptr, nullptr);
    // A device plan's region is written by in_graph's planner: nothing of it is copied.
    if (!call.device_plan) copy_bytes = prefill_offset + region.metadata_bytes;
    metadata_bytes = prefill_offset + region.total_bytes;
  }
  ensure_bytes(call.metadata, metadata_bytes, call.frozen, device, "call metadata");
  if (call.offsets.scratch_bytes > 0) {
    ensure_bytes(call.scratch, call.offsets.scratch_bytes, call.frozen, device, "decode partials");
  }
  if (call.paged) {
    ensure_bytes(call.kv_indices,
                 size_t(std::max<int64_t>(kv_indices_capacity, 1)) * sizeof(int32_t), call.frozen,
                 device, "kv_indices");
  }
  if (call.staging.bytes() < copy_bytes) {
    // Frozen calls had their staging reserved for the largest plan: growing it now would be a
    // pinned allocation (and a device sync) in a graph replay's out_graph.
    if (call.frozen) {
      throw_error(ErrorKind::kOutOfResources, "call metadata", "needs ", copy_bytes,
                  " staging bytes, init_cuda_graph_state reserved ", call.staging.bytes());
    }
    call.staging.reserve(copy_bytes);
    allocations.fetch_add(1, std::memory_order_relaxed);
  }
  core::write_call_metadata(capacity, &call.layout, call.prefill ? nullptr : &call.decode_plan,
                            call.staging.data(), call.staging.bytes());
  if (call.device_plan && capacity.custom_mask) {  // the batch's tree mask, not the layout's
    std::memcpy(static_cast<char*>(call.staging.data()) + call.offsets.mask_elems, &call.mask_elems,
                sizeof(call.mask_elems));
  }
  // The step's error state starts at zero (write_call_metadata zeroed it) with this step's number.
  StepState state;
  state.step = step;
  state.plan_source = call.device_plan ? kPlanOnDevice : kPlanOnHost;
  std::memcpy(static_cast<char*>(call.staging.data()) + call.offsets.step_state, &state,
              sizeof(state));
  if (call.prefill) {
    char* base = static_cast<char*>(call.metadata.data()) + prefill_offset;
    // (A device plan's contents come from in_graph's planner: only its view is set here.)
    char* host =
        call.device_plan ? nullptr : static_cast<char*>(call.staging.data()) + prefill_offset;
    core::write_prefill_buffer(call.prefill_plan, v_head_dim, host,
                               host != nullptr ? call.staging.bytes() - prefill_offset : 0, base,
                               &call.prefill_tiles);
  }
  check_cuda(cudaMemcpyAsync(call.metadata.data(), call.staging.data(), copy_bytes,
                             cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync(call metadata)");
  call.fence->record(stream);
}

void plan_frozen_call(CallState& call, const core::CallCapacity& capacity,
                      int64_t kv_indices_capacity, const core::PrefillBufferLayout& prefill_region,
                      BufferGrowth& growth) {
  const core::CallMetadataLayout offsets =
      core::write_call_metadata(capacity, nullptr, nullptr, nullptr, 0);
  const size_t prefill_offset = align_region(offsets.metadata_bytes);
  const std::string what = "CUDA-graph call buffers";
  growth.need(call.metadata, core::checked_sum(prefill_offset, prefill_region.total_bytes, what));
  if (offsets.scratch_bytes > 0) growth.need(call.scratch, offsets.scratch_bytes);
  growth.need(call.kv_indices, core::checked_bytes({std::max<int64_t>(kv_indices_capacity, 1),
                                                    int64_t(sizeof(int32_t))},
                                                   "kv_indices"));
  growth.need(call.staging, core::checked_sum(prefill_offset, prefill_region.metadata_bytes, what));
  growth.need(call.fence);
}

void freeze_call(CallState& call) {
  call.frozen = true;
}

int64_t call_kv_capacity(const CallState& call, bool graph_pool, int64_t graph_kv_capacity,
                         int max_context_len) {
  if (graph_pool) return graph_kv_capacity;
  if (call.device_plan) return int64_t(call.layout.batch_size) * max_context_len;
  return call.layout.total_kv();
}

void size_device_tile_plan(CallState& call, const core::PrefillTileShape& shape,
                           const core::PrefillPlanCapacity& capacity, int group_size) {
  call.plan_shape = shape;
  call.plan_capacity = capacity;
  core::PrefillTilePlan& plan = call.prefill_plan;
  plan.items.resize(size_t(capacity.items));
  plan.merges.resize(size_t(capacity.merges));
  plan.num_partials = capacity.partials;
  plan.tile_rows = shape.tile_rows;
  plan.group_size = group_size;
  plan.cluster = shape.cluster > 1 ? shape.cluster : 0;
  call.prefill_items = capacity.items;
  call.prefill_merges = capacity.merges;
  call.padded = true;
}

void launch_call_plan(const CallState& call, DeviceLengths lengths,
                      const core::DecodePlanConfig& config, cudaStream_t stream) {
  lengths.kv_start = const_cast<int32_t*>(call.meta<int32_t>(call.offsets.kv_start));
  lengths.kv_len = const_cast<int32_t*>(call.meta<int32_t>(call.offsets.kv_len));
  int64_t* kv_indptr = const_cast<int64_t*>(call.meta<int64_t>(call.offsets.kv_indptr));
  if (call.prefill) {
    DevicePlanTiles t;
    t.lengths = lengths;
    t.batch_size = call.layout.batch_size;
    t.shape = call.plan_shape;
    t.capacity = call.plan_capacity;
    t.kv_indptr = kv_indptr;
    t.items = const_cast<core::PrefillWorkItem*>(call.prefill_tiles.items);
    t.merges = const_cast<core::PrefillMergeItem*>(call.prefill_tiles.merges);
    t.scheduler = call.prefill_tiles.scheduler;
    launch_device_plan_tiles(t, stream);
    return;
  }
  DevicePlanDecode d;
  d.lengths = lengths;
  d.batch_size = call.layout.batch_size;
  d.config = config;
  d.item_capacity = call.item_limit;
  d.kv_indptr = kv_indptr;
  d.items =
      const_cast<core::DecodeWorkItem*>(call.meta<core::DecodeWorkItem>(call.offsets.decode_items));
  d.merge_indptr = const_cast<int32_t*>(call.meta<int32_t>(call.offsets.merge_indptr));
  d.num_items = const_cast<int32_t*>(call.meta<int32_t>(call.offsets.num_items));
  launch_device_plan_decode(d, stream);
}

StepState* step_state_of(const CallState& first_call) {
  return reinterpret_cast<StepState*>(static_cast<char*>(first_call.metadata.data()) +
                                      first_call.offsets.step_state);
}

DeviceIndexArray device_index_array(const TensorView& t) {
  DeviceIndexArray a;
  if (!t.defined() || t.ndim() != 1) return a;
  a.data = t.data();
  a.int64 = t.dtype() == DType::kInt64;
  a.length = t.size(0);
  return a;
}

core::AttentionParams make_params(const CallState& call, const BackendConfig& config,
                                  const AttentionLayer& layer, const TensorView& q,
                                  const TensorView& out, float* lse, const TensorView& ragged_k,
                                  const TensorView& ragged_v, const StepState* state) {
  const KvCache& cache = *config.kv_cache;
  core::AttentionParams p;
  p.step_error = state != nullptr ? &state->error : nullptr;
  core::set_query_fields(p, q, out, layer);
  p.lse = lse;
  if (call.paged) {
    core::set_pool_fields(p, cache, layer);
    p.kv_indices = static_cast<const int32_t*>(call.kv_indices.data());
  } else {
    core::set_ragged_fields(p, ragged_k, ragged_v, layer);
    p.num_slots = cache.num_slots();
  }
  p.batch_size = call.layout.batch_size;
  p.qo_indptr = call.meta<int32_t>(call.offsets.qo_indptr);
  p.kv_indptr = call.meta<int64_t>(call.offsets.kv_indptr);
  p.mask = call.layout.mask;
  if (p.mask == core::MaskMode::kCustom) {
    p.custom_mask = call.custom_mask;
    p.mask_indptr = call.meta<int64_t>(call.offsets.mask_indptr);
    p.mask_dense = call.meta<int32_t>(call.offsets.mask_dense);
  }
  p.window_left = call.layout.window_left;
  return p;
}

void scan_mask_dense_prefix(const CallState& call, cudaStream_t stream) {
  if (call.custom_mask == nullptr || !call.tc_decode) return;
  // The tree mask's all-ones prefix columns: the decode-shaped kernel skips their bytes.
  MaskDensePrefix scan;
  scan.mask = call.custom_mask;
  scan.mask_indptr = call.meta<int64_t>(call.offsets.mask_indptr);
  scan.qo_indptr = call.meta<int32_t>(call.offsets.qo_indptr);
  scan.kv_len = call.meta<int32_t>(call.offsets.kv_len);
  scan.dense = const_cast<int32_t*>(call.meta<int32_t>(call.offsets.mask_dense));
  scan.batch_size = call.layout.batch_size;
  launch_mask_dense_prefix(scan, stream);
}

void run_call(const CallState& call, const core::AttentionParams& params, int device,
              cudaStream_t stream) {
  const bool capturing = stream_is_capturing(stream);
  if (call.prefill) {
    // Only a padded plan (the graph pool) has an item count that covers every later plan of the
    // same batch size; an unpadded one captured now would replay wrong results later.
    if (capturing && !call.padded) {
      throw_error(ErrorKind::kNotSupported, "cuda graph",
                  "capturing the tensor-core path (TARGET_VERIFY, tensor-core decode) needs the "
                  "CUDA-graph buffers: call init_cuda_graph_state with max_bs >= this batch size "
                  "before init_forward_metadata_out_graph");
    }
    // A captured grid covers the padded capacity (no-op items after the real ones); an eager
    // launch runs the real items only: the same blocks compute the same bits either way.
    core::PrefillTiles tiles = call.prefill_tiles;
    if (!capturing) {
      tiles.num_items = call.prefill_items;
      tiles.num_merges = call.prefill_merges;
    }
    if (call.tc_decode) {
      launch_tc_decode(params, tiles, stream);
    } else {
      launch_batch_prefill(params, tiles, stream);
    }
    return;
  }
  DecodeLaunch launch;
  launch.params = params;
  launch.items = call.meta<core::DecodeWorkItem>(call.offsets.decode_items);
  launch.num_items = call.meta<int32_t>(call.offsets.num_items);
  launch.partial_out =
      reinterpret_cast<float*>(static_cast<char*>(call.scratch.data()) + call.offsets.partial_out);
  launch.partial_lse =
      reinterpret_cast<float*>(static_cast<char*>(call.scratch.data()) + call.offsets.partial_lse);
  // A captured graph replays later plans for the same batch size: cover the capacity.
  // (So does a device plan: the host does not know its item count.)
  const bool fixed = capturing || call.device_plan;
  launch.grid_items = fixed ? call.item_limit : int(call.decode_plan.items.size());
  launch.merge_indptr = call.meta<int32_t>(call.offsets.merge_indptr);
  launch.has_partials = fixed || call.decode_plan.num_partials > 0;
  launch_decode(launch, device, stream);
}

void fold_sinks(const TensorView& out, int v_head_dim, const float* lse, const TensorView& sinks,
                int64_t num_tokens, const uint32_t* step_error, cudaStream_t stream) {
  ApplySinksLaunch a;
  const core::HeadStrides os = core::head_strides(out, v_head_dim);
  a.out = out.data();
  a.out_dtype = out.dtype();
  a.stride_token = os.token;
  a.stride_head = os.head;
  a.lse = lse;
  a.sinks = sinks.data();
  a.sinks_dtype = sinks.dtype();
  a.num_tokens = num_tokens;
  a.num_heads = int(sinks.size(0));
  a.v_head_dim = v_head_dim;
  a.step_error = step_error;
  launch_apply_sinks(a, stream);
}

void save_kv(const BackendConfig& config, const AttentionLayer& layer, const TensorView& k,
             const TensorView& v, const TensorView& loc, const SaveGuard& guard,
             cudaStream_t stream) {
  const KvCache& cache = *config.kv_cache;
  const TensorView& kb = cache.k_buffer(layer.layer_id);
  const TensorView& vb = cache.v_buffer(layer.layer_id);
  const int v_head_dim = layer.resolved_v_head_dim();
  const core::HeadStrides ks = core::head_strides(k, layer.head_dim);
  const core::HeadStrides vs = core::head_strides(v, v_head_dim);
  KvWriteLaunch w;
  w.k = k.data();
  w.k_stride_token = ks.token;
  w.k_stride_head = ks.head;
  w.v = v.data();
  w.v_stride_token = vs.token;
  w.v_stride_head = vs.head;
  w.io_dtype = config.q_dtype;
  w.loc = loc.data();
  w.loc_int64 = loc.dtype() == DType::kInt64;
  w.num_tokens = loc.size(0);
  w.k_cache = kb.data();
  w.k_cache_stride_token = kb.stride(0);
  w.k_cache_stride_head = kb.stride(1);
  w.v_cache = vb.data();
  w.v_cache_stride_token = vb.stride(0);
  w.v_cache_stride_head = vb.stride(1);
  w.kv_dtype = cache.config().dtype;
  if (is_fp8(w.kv_dtype)) {
    w.k_scale = core::layer_k_scale(layer, cache);
    w.v_scale = core::layer_v_scale(layer, cache);
  }
  w.num_kv_heads = layer.num_kv_heads;
  w.head_dim = layer.head_dim;
  w.v_head_dim = v_head_dim;
  w.num_slots = cache.num_slots();
  w.step_state = guard.state;
  w.check_loc = guard.check_loc;
  w.reports = guard.reports;
  w.loc_argument = guard.loc_argument;
  launch_kv_write(w, stream);
}

core::PrefillTileShape prefill_tile_shape(const DecodeSetup& setup, const BackendConfig& config,
                                          core::MaskMode mask, int window_left, bool tc,
                                          int batch_size, int q_len) {
  core::PrefillTileShape shape;
  shape.num_q_heads = config.num_q_heads;
  shape.num_kv_heads = config.num_kv_heads;
  shape.tile_rows = tc ? setup.tc_decode_tile_rows : setup.prefill_tile_rows;
  shape.kv_tile = tc ? setup.tc_decode_kv_tile : setup.prefill_kv_tile;
  shape.mask = mask;
  shape.window_left = window_left;
  shape.concurrent_ctas = tc ? setup.concurrent_tc_decode_ctas : setup.concurrent_prefill_ctas;
  if (config.deterministic) shape.concurrent_ctas = 0;  // no split-KV: tiles are the request's
  if (tc) shape.min_split_keys = setup.tc_decode_min_split;
  if (!tc) shape.l2_keys = setup.prefill_l2_keys;
  if (tc && batch_size > 0) {
    const int64_t rows = int64_t(q_len) * (config.num_q_heads / config.num_kv_heads);
    if (setup.tc_decode_transposed_rows > 0 && rows <= setup.tc_decode_transposed_rows) {
      shape.tile_rows = setup.tc_decode_transposed_rows;
    } else if (setup.tc_decode_narrow_rows > 0 &&
               (rows <= setup.tc_decode_narrow_rows || setup.tc_decode_narrow_always)) {
      shape.tile_rows = setup.tc_decode_narrow_rows;
    }
    shape.cluster = core::cluster_split_size(batch_size, q_len, shape, setup.tc_decode_max_cluster);
  }
  return shape;
}

ReqToTokenSource req_to_token_source(const ReqToTokenPool& pool,
                                     const TensorView& req_pool_indices) {
  ReqToTokenSource s;
  s.table = pool.table().data_as<const int32_t>();
  s.row_stride = pool.table().stride(0);
  s.max_reqs = pool.max_reqs();
  s.max_context_len = pool.max_context_len();
  s.req_pool_indices = req_pool_indices.data();
  s.req_pool_indices_int64 = req_pool_indices.dtype() == DType::kInt64;
  return s;
}

// ---- the backend -----------------------------------------------------------------------------

namespace {

class CudaBackend final : public AttentionBackend {
 public:
  explicit CudaBackend(const BackendConfig& config)
      : config_(config),
        device_(config.kv_cache->config().device),
        guard_((check_cuda(cudaSetDevice(device_.index), "cudaSetDevice"),
                config.kv_cache->num_slots()),
               config.req_to_token_pool->max_reqs()) {
    if (config_.v_head_dim == 0) config_.v_head_dim = config_.head_dim;
    setup_ = make_decode_setup(config_, device_.index);
    if (config_.is_encoder_decoder) {
      model_sets_ = {core::IndexSet::kDecoderSelf, core::IndexSet::kEncoder};
    } else if (config_.sliding_window_size >= 0) {
      model_sets_ = {core::IndexSet::kWindow, core::IndexSet::kFull};
    } else {
      model_sets_ = {core::IndexSet::kFull};
    }
  }

  BackendKind kind() const override { return BackendKind::kCuda; }
  Device device() const override { return device_; }
  void set_cuda_stream(void* stream) override { config_.cuda_stream = stream; }
  uint64_t step_id() const override { return guard_.step_id(); }

  std::vector<StepError> take_step_errors(bool synchronize) override {
    set_device();
    if (synchronize) {
      check_cuda(cudaStreamSynchronize(as_stream(config_.cuda_stream)), "cudaStreamSynchronize");
    }
    return guard_.take();
  }

  void init_forward_metadata_out_graph(const ForwardBatch& batch, bool in_capture) override {
    set_device();
    step_ = Step();
    step_.id = guard_.begin_step(batch.mode, batch.batch_size);
    const core::StepFacts facts = core::derive_step(batch, config_, device_, /*device_plan=*/true);
    core::validate_step_slots(batch, config_.kv_cache->num_slots(), device_);
    if (facts.device_lengths) check_device_plan_fits(batch, facts.num_tokens);
    const core::HostLengths& lens = facts.lens;
    step_.mode = batch.mode;
    step_.batch_size = batch.batch_size;
    if (batch.mode == ForwardMode::kIdle) {
      step_.ready = true;
      return;
    }
    const bool verify = batch.mode == ForwardMode::kTargetVerify;
    const bool decode = batch.mode == ForwardMode::kDecode;
    if (!decode && !setup_.prefill_supported) {
      throw_error(ErrorKind::kNotSupported, "mode", forward_mode_name(batch.mode),
                  " on CUDA needs the prefill kernel, which serves ",
                  "v_head_dim == head_dim and a compiled head_dim; got head_dim ", config_.head_dim,
                  ", v_head_dim ", config_.v_head_dim);
    }
    step_.ragged = facts.ragged;
    step_.num_tokens = facts.num_tokens;
    step_.device_lengths = facts.device_lengths;

    // Graph buffers serve DECODE / TARGET_VERIFY batches, and EXTEND-like ones planned on the
    // device, up to the captured size and token count; a larger one runs eagerly, and capturing
    // it is refused. (An EXTEND-like step with host lengths runs eagerly: its ragged choice and
    // its plan's size follow the lengths.)
    const bool graph_batch = graph_max_bs_ > 0 && (decode || verify || facts.device_lengths) &&
                             batch.batch_size <= graph_max_bs_;
    // (EXTEND-like steps: as many tokens as one fixed-size plan of the graph buffers holds.)
    const int64_t graph_tokens =
        core::is_extend_like(batch.mode) ? graph_extend_tokens_ : graph_max_tokens_;
    step_.graph_pool = graph_batch && step_.num_tokens <= graph_tokens;
    if (in_capture && graph_batch && !step_.graph_pool) {
      throw_error(ErrorKind::kOutOfResources, "max_num_tokens", "init_cuda_graph_state reserved ",
                  graph_tokens, " query tokens for ", forward_mode_name(batch.mode), " steps",
                  graph_tokens < graph_max_tokens_
                      ? " (of its " + std::to_string(graph_max_tokens_) +
                            ": one fixed-size plan holds no more)"
                      : std::string(),
                  "; this batch has ", step_.num_tokens);
    }
    check_arg(
        !in_capture || step_.graph_pool, "in_capture",
        "capturing a CUDA graph needs init_cuda_graph_state with max_bs >= ", batch.batch_size,
        " and a DECODE or TARGET_VERIFY batch, or an EXTEND-like batch without host lengths "
        "(no seq_lens_cpu / extend_prefix_lens_cpu / extend_seq_lens_cpu)");
    auto& pool = step_.graph_pool ? graph_calls_ : eager_calls_;
    const cudaStream_t stream = as_stream(config_.cuda_stream);

    // On the graph pool a prefill plan is padded to the capacity of its batch size and query
    // tokens per request (1 for DECODE, draft_token_num for TARGET_VERIFY).
    const int graph_q_len = !step_.graph_pool ? 0 : verify ? batch.spec.draft_token_num : 1;
    step_.any_prefix = facts.prefix_tokens > 0;
    // A ragged step with a prefix plans the paged calls over the prefix alone; one without
    // plans them over the whole sequence, for a forward that brings no k/v (it attends paged).
    for (size_t s = 0; s < model_sets_.size(); ++s) {
      CallState& call = pool[s];
      if (step_.device_lengths) {
        plan_device_call(call, model_sets_[s], batch);
        continue;
      }
      call.device_plan = false;
      call.layout = core::make_paged_layout(batch.mode, model_sets_[s], config_.sliding_window_size,
                                            lens, batch.spec.draft_token_num,
                                            /*prefix_only=*/step_.ragged && step_.any_prefix);
      call.paged = true;
      // (An encoder-decoder model's encoder set sees every encoder key: no mask.)
      call.custom_mask = call.layout.mask == core::MaskMode::kCustom
                             ? batch.spec.custom_mask.data_as<const uint8_t>()
                             : nullptr;
      call.fold_window = verify && model_sets_[s] == core::IndexSet::kWindow;
      if (call.fold_window) prepare_window_fold(call, batch);
      plan_call(call, decode && !setup_.tensor_cores, graph_q_len);
    }
    if (step_.ragged) {
      CallState& ragged = pool[kRaggedSlot];
      ragged.layout = core::make_ragged_layout(lens);
      ragged.paged = false;
      ragged.custom_mask = nullptr;
      plan_call(ragged, false, 0);
      // Both partial outputs (fp32, merged unrounded) and their LSEs.
      const size_t rows = size_t(step_.num_tokens) * size_t(config_.num_q_heads);
      ensure_bytes(ragged_scratch_, 2 * ragged_partial_bytes(config_) + 2 * rows * sizeof(float),
                   false, device_, "ragged extend scratch");
    }
    // fp32 io in a step the tensor-core kernel runs: q/out (and the ragged k/v) go through
    // 16-bit copies.
    step_.convert_io = config_.q_dtype != setup_.compute_dtype && !(decode && !setup_.tensor_cores);
    if (step_.convert_io) {
      const size_t elem = size_t(dtype_size(setup_.compute_dtype));
      const size_t n = size_t(step_.num_tokens);
      const size_t q_bytes = align_region(n * config_.num_q_heads * config_.head_dim * elem);
      const size_t out_bytes = align_region(n * config_.num_q_heads * config_.v_head_dim * elem);
      const size_t kv_bytes = step_.ragged
                                  ? align_region(n * config_.num_kv_heads *
                                                 (config_.head_dim + config_.v_head_dim) * elem)
                                  : 0;
      // The graph pool's copies sit in their own frozen buffer: an eager EXTEND that grows the
      // eager one must not move what a captured graph reads.
      if (step_.graph_pool) {
        ensure_bytes(graph_io_scratch_, q_bytes + out_bytes + kv_bytes, true, device_,
                     "fp32 io copies");
      } else {
        ensure_bytes(io_scratch_, q_bytes + out_bytes + kv_bytes, false, device_, "fp32 io copies");
      }
    }
    if (lens.groups_declared) plan_cascade(batch, lens, in_capture);
    const int num_calls = int(model_sets_.size()) + (step_.ragged ? 1 : 0);
    for (int c = 0; c < num_calls; ++c) {
      CallState& call = pool[c < int(model_sets_.size()) ? c : kRaggedSlot];
      core::CallCapacity cap;
      cap.batch_size = step_.graph_pool ? graph_max_bs_ : call.layout.batch_size;
      cap.decode_items = call.prefill ? 0
                         : step_.graph_pool
                             ? core::decode_item_capacity(graph_max_bs_, setup_.plan_config)
                             : call.item_limit;
      cap.custom_mask = verify;
      cap.num_q_heads = config_.num_q_heads;
      cap.v_head_dim = config_.v_head_dim;
      const int64_t keys = call_kv_capacity(call, step_.graph_pool, graph_kv_capacity_,
                                            config_.req_to_token_pool->max_context_len());
      upload_call(call, cap, keys, config_.v_head_dim, step_.id, device_, stream);
    }
    step_.ready = true;
    step_.indices_built = false;
  }

  void init_forward_metadata_in_graph(const ForwardBatch& batch) override {
    set_device();
    require_step(batch, "init_forward_metadata_in_graph");
    if (step_.mode == ForwardMode::kIdle) return;
    const cudaStream_t stream = as_stream(config_.cuda_stream);
    const bool capturing = stream_is_capturing(stream);
    auto& pool = step_.graph_pool ? graph_calls_ : eager_calls_;
    const int max_context = config_.req_to_token_pool->max_context_len();
    for (size_t s = 0; s < model_sets_.size(); ++s) {
      const CallState& call = pool[s];
      if (call.device_plan) plan_on_device(call, model_sets_[s], batch, stream);
      if (call.fold_window) {
        WindowMaskFold fold;
        fold.tree_mask = call.tree_mask;
        fold.folded = static_cast<uint8_t*>(call.folded_mask.data());
        fold.mask_indptr = call.meta<int64_t>(call.offsets.mask_indptr);
        fold.kv_len = call.meta<int32_t>(call.offsets.kv_len);
        fold.positions = batch.positions.data();
        fold.positions_int64 = batch.positions.dtype() == DType::kInt64;
        fold.batch_size = call.layout.batch_size;
        fold.draft_token_num = batch.spec.draft_token_num;
        fold.window = config_.sliding_window_size;
        fold.max_kv_len = capturing ? max_context : call.max_kv_len;
        launch_fold_window_mask(fold, stream);
      }
      scan_mask_dense_prefix(call, stream);
      KvIndexBuild build;
      build.source = req_to_token_source(*config_.req_to_token_pool, batch.req_pool_indices);
      build.kv_start = call.meta<int32_t>(call.offsets.kv_start);
      build.kv_len = call.meta<int32_t>(call.offsets.kv_len);
      build.kv_indptr = call.meta<int64_t>(call.offsets.kv_indptr);
      build.batch_size = call.layout.batch_size;
      build.kv_indices = static_cast<int32_t*>(call.kv_indices.data());
      build.num_slots = config_.kv_cache->num_slots();
      build.step_state = step_state_of(pool[0]);
      // A captured launch must cover any later replay's lengths.
      build.max_kv_len = capturing ? max_context : call.max_kv_len;
      launch_build_kv_indices(build, stream);
    }
    // Last: every index the step reads or writes is checked before any layer runs; a bad one
    // sets the step's error word (no kernel of the step writes) and is reported to the host.
    StepCheckLaunch check;
    check.state = step_state_of(pool[0]);
    check.reports = guard_.device_reports();
    check.req_pool_indices = device_index_array(batch.req_pool_indices);
    check.max_reqs = config_.req_to_token_pool->max_reqs();
    check.out_cache_loc = device_index_array(batch.out_cache_loc);
    check.encoder_out_cache_loc = device_index_array(batch.encoder_out_cache_loc);
    check.num_slots = config_.kv_cache->num_slots();
    check.req_to_token = config_.req_to_token_pool->table().data_as<const int32_t>();
    check.req_to_token_row_stride = config_.req_to_token_pool->table().stride(0);
    if (step_.device_lengths) {
      const bool verify = step_.mode == ForwardMode::kTargetVerify;
      check.seq_lens = device_index_array(batch.seq_lens);
      check.max_seq_len = max_context - (verify ? batch.spec.draft_token_num : 0);
      if (config_.is_encoder_decoder) check.encoder_lens = device_index_array(batch.encoder_lens);
      if (core::is_extend_like(step_.mode)) {
        check.extend_prefix_lens = device_index_array(batch.extend_prefix_lens);
        check.extend_seq_lens = device_index_array(batch.extend_seq_lens);
        check.num_tokens = step_.num_tokens;
      }
      if (verify) {
        const CallState& first = pool[0];
        check.mask_rows_end =
            first.meta<int64_t>(first.offsets.mask_indptr) + first.layout.batch_size;
        check.mask_elems = first.meta<int64_t>(first.offsets.mask_elems);
      }
    }
    check.plan_source = step_.device_lengths ? kPlanOnDevice : kPlanOnHost;
    if (step_.cascade) {
      // The promise of the declared groups, checked before anything of the step is written.
      refuse_cascade_capture(capturing, "init_forward_metadata_in_graph");
      const uint8_t* mask = step_.mode == ForwardMode::kTargetVerify
                                ? batch.spec.custom_mask.data_as<const uint8_t>()
                                : nullptr;
      build_cascade_indices(cascade_,
                            req_to_token_source(*config_.req_to_token_pool, batch.req_pool_indices),
                            config_.kv_cache->num_slots(), mask, batch.spec.draft_token_num,
                            step_state_of(pool[0]), stream);
      describe_cascade_for_step_check(cascade_, check);
    }
    launch_step_check(check, stream);
    step_.checked_loc = check.out_cache_loc;
    step_.checked_encoder_loc = check.encoder_out_cache_loc;
    step_.indices_built = true;
  }

  void forward_decode(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const AttentionLayer& layer, const ForwardBatch& batch,
                      bool save_kv_cache) override {
    forward_any(q, k, v, out, layer, batch, save_kv_cache, "forward_decode");
  }

  void forward_extend(const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, const AttentionLayer& layer, const ForwardBatch& batch,
                      bool save_kv_cache) override {
    forward_any(q, k, v, out, layer, batch, save_kv_cache, "forward_extend");
  }

  // All or nothing: every size is computed (overflow-checked) and checked against the device's
  // free memory first, then every buffer is allocated next to the current ones and swapped in
  // only when all succeeded. A refused call changes nothing: the backend keeps serving with the
  // buffers (and graph state) it had.
  void init_cuda_graph_state(int max_bs, int64_t max_num_tokens) override {
    set_device();
    check_arg(max_bs >= 1, "max_bs", "got ", max_bs, ", expected >= 1");
    check_arg(max_num_tokens >= max_bs, "max_num_tokens", "got ", max_num_tokens,
              ", expected >= max_bs ", max_bs);
    const std::string what = "init_cuda_graph_state(max_bs=" + std::to_string(max_bs) +
                             ", max_num_tokens=" + std::to_string(max_num_tokens) + ")";
    const int max_context = config_.req_to_token_pool->max_context_len();
    const int64_t kv_capacity = int64_t(max_bs) * max_context;
    // The prefill region (TARGET_VERIFY, tensor-core decode): the padded plan of max_bs requests
    // of max_num_tokens / max_bs query tokens each covers every bucket's plan (the capacity grows
    // with both), decode's one token per request included. Sized from its counts alone.
    core::PrefillBufferLayout prefill_region;
    int64_t extend_tokens = 0;  // graph_extend_tokens_ once the call succeeds
    const int64_t per_request = (max_num_tokens + max_bs - 1) / max_bs;
    check_arg(per_request <= INT32_MAX, "max_num_tokens", "got ", max_num_tokens,
              ", over 2^31 tokens a request");
    if (setup_.prefill_supported) {
      // Either kernel's plan (plan_call picks by the rows a request): the largest of them. The
      // decode-shaped kernel's shape also as a call of max_bs x per_request plans it (its tile
      // may be the 16-row one: more tiles a request where KVATTN_TC_DECODE_NARROW=2 takes it
      // for 32-row calls).
      std::vector<core::PrefillTileShape> shapes{prefill_shape(core::MaskMode::kCustom, -1, false)};
      if (setup_.tc_decode) {
        shapes.push_back(prefill_shape(core::MaskMode::kCustom, -1, true));
        shapes.push_back(
            prefill_shape(core::MaskMode::kCustom, -1, true, max_bs, int(per_request)));
      }
      // Each shape's capacity, and an EXTEND-like step planned on the device: max_num_tokens
      // split among max_bs requests any way (the Hopper prefill kernel's shape, shapes[0]), where
      // one plan can hold them (a request's packed rows stay below core::kNoOpRow); beyond that
      // such steps run eagerly and their capture is refused.
      std::vector<std::pair<core::PrefillTileShape, core::PrefillPlanCapacity>> plans;
      const int64_t group = config_.num_q_heads / config_.num_kv_heads;
      extend_tokens = std::min<int64_t>(max_num_tokens, core::kNoOpRow / group);
      plans.emplace_back(shapes[0],
                         core::prefill_plan_capacity_for_tokens(max_bs, extend_tokens, shapes[0]));
      for (const core::PrefillTileShape& shape : shapes) {
        plans.emplace_back(shape, core::prefill_plan_capacity(max_bs, int(per_request), shape));
      }
      for (const auto& [shape, capacity] : plans) {
        const core::PrefillBufferLayout region =
            core::prefill_buffer_layout(capacity.items, capacity.merges, capacity.partials,
                                        shape.tile_rows, config_.v_head_dim);
        prefill_region.metadata_bytes =
            std::max(prefill_region.metadata_bytes, region.metadata_bytes);
        prefill_region.total_bytes = std::max(prefill_region.total_bytes, region.total_bytes);
      }
    }
    BufferGrowth growth;
    for (size_t s = 0; s < model_sets_.size(); ++s) {
      core::CallCapacity cap;
      cap.batch_size = max_bs;
      cap.decode_items = core::decode_item_capacity(max_bs, setup_.plan_config);
      cap.custom_mask = true;
      cap.num_q_heads = config_.num_q_heads;
      cap.v_head_dim = config_.v_head_dim;
      plan_frozen_call(graph_calls_[s], cap, kv_capacity, prefill_region, growth);
      // TARGET_VERIFY on a window layer folds the tree mask into this buffer: max_num_tokens
      // rows of at most max_context_len columns.
      if (model_sets_[s] == core::IndexSet::kWindow && setup_.prefill_supported) {
        growth.need(graph_calls_[s].folded_mask,
                    core::checked_bytes({max_num_tokens, max_context}, "folded tree mask"));
      }
    }
    // fp32 io: the tensor-core path runs on 16-bit copies of q and out.
    if (config_.q_dtype != setup_.compute_dtype && setup_.prefill_supported) {
      const int64_t elem = dtype_size(setup_.compute_dtype);
      const size_t q_bytes = align_region(core::checked_bytes(
          {max_num_tokens, config_.num_q_heads, config_.head_dim, elem}, "fp32 io copies"));
      const size_t out_bytes = align_region(core::checked_bytes(
          {max_num_tokens, config_.num_q_heads, config_.v_head_dim, elem}, "fp32 io copies"));
      growth.need(graph_io_scratch_, core::checked_sum(q_bytes, out_bytes, "fp32 io copies"));
    }
    // Sinks: one LSE a (token, q head).
    growth.need(graph_sink_lse_,
                core::checked_bytes({max_num_tokens, config_.num_q_heads, int64_t(sizeof(float))},
                                    "sink LSE"));
    growth.apply(device_, what);
    for (size_t s = 0; s < model_sets_.size(); ++s) freeze_call(graph_calls_[s]);
    graph_kv_capacity_ = kv_capacity;
    graph_max_bs_ = max_bs;
    graph_max_tokens_ = max_num_tokens;
    graph_extend_tokens_ = extend_tokens;
  }

  int cuda_graph_seq_len_fill_value() const override { return 0; }

 private:
  static constexpr int kRaggedSlot = 2;

  struct Step {
    bool ready = false;
    bool indices_built = false;
    ForwardMode mode = ForwardMode::kIdle;
    int batch_size = 0;
    int64_t num_tokens = 0;
    bool graph_pool = false;
    bool ragged = false;
    bool any_prefix = false;
    bool convert_io = false;  ///< fp32 io through 16-bit copies (setup_.compute_dtype)
    bool cascade = false;     ///< full-attention layers run cascade_ (declared groups)
    bool device_lengths = false;  ///< planned on the device (core::StepFacts::device_lengths)
    uint64_t id = 0;          ///< guard_'s number of this step
    /// The slot tensors the step-check kernel checked (a forward given others checks its own).
    DeviceIndexArray checked_loc;
    DeviceIndexArray checked_encoder_loc;
  };

  void set_device() const { check_cuda(cudaSetDevice(device_.index), "cudaSetDevice"); }

  // Shared-prefix groups the engine declared (cuda/cascade.h): plans the step's cascade calls
  // (eager buffers, beside the step's plain calls, which window layers and graph replays use).
  // The groups are a hint with a promise: where the tensor-core family cannot run the shared
  // call (its io / KV dtypes, head dims), for fp32-io DECODE, with KVATTN_CASCADE=0 and in
  // deterministic mode the plain path computes the same attention without them.
  void plan_cascade(const ForwardBatch& batch, const core::HostLengths& lens, bool in_capture) {
    if (lens.shared_prefix_lens.empty() || !core::cascade_enabled(config_.deterministic)) return;
    const DType kv = config_.kv_cache->config().dtype;
    if (!setup_.prefill_supported || !(kv == setup_.compute_dtype || is_fp8(kv))) return;
    // fp32-io DECODE keeps its fp32 CUDA-core kernel (the shared call would round q to 16 bits).
    if (batch.mode == ForwardMode::kDecode && config_.q_dtype == DType::kFloat32) return;
    size_t full = 0;
    while (full < model_sets_.size() && model_sets_[full] != core::IndexSet::kFull) ++full;
    if (full == model_sets_.size()) return;  // encoder-decoder models (refused by validation)
    refuse_cascade_capture(in_capture, "in_capture");
    const cudaStream_t stream = as_stream(config_.cuda_stream);
    const CallState& plain = (step_.graph_pool ? graph_calls_ : eager_calls_)[full];
    make_cascade_layouts(cascade_, core::declared_cascade_plan(lens), plain.layout);
    cascade_.own.custom_mask = plain.custom_mask;  // TARGET_VERIFY: the step's tree mask
    plan_call(cascade_.shared, /*cuda_core_decode=*/false, 0);
    plan_call(cascade_.own, batch.mode == ForwardMode::kDecode && !setup_.tensor_cores, 0);
    for (CallState* call : {&cascade_.shared, &cascade_.own}) {
      core::CallCapacity cap;
      cap.batch_size = call->layout.batch_size;
      cap.decode_items = call->prefill ? 0 : call->item_limit;
      cap.custom_mask = call->layout.mask == core::MaskMode::kCustom;
      cap.num_q_heads = config_.num_q_heads;
      cap.v_head_dim = config_.v_head_dim;
      upload_call(*call, cap, call->layout.total_kv(), config_.v_head_dim, step_.id, device_,
                  stream);
    }
    upload_cascade_arrays(cascade_, config_, setup_.compute_dtype, device_, stream);
    step_.cascade = true;
  }

  void refuse_cascade_capture(bool capturing, const char* where) const {
    if (!capturing) return;
    throw_error(ErrorKind::kNotSupported, where,
                "a step with shared-prefix groups (shared_prefix_group_cpu) runs eagerly: ",
                "capture CUDA graphs for batches without them (the groups are a per-step hint; ",
                "a replayed graph computes the same attention without them)");
  }

  // The current step's error state (the first call of its pool).
  StepState* step_state() const {
    return step_state_of(step_.graph_pool ? graph_calls_[0] : eager_calls_[0]);
  }

  core::PrefillTileShape prefill_shape(core::MaskMode mask, int window_left, bool tc,
                                       int batch_size = 0, int q_len = 0) const {
    return prefill_tile_shape(setup_, config_, mask, window_left, tc, batch_size, q_len);
  }

  // Whether a call of at most q_len query tokens a request runs the decode-shaped kernel.
  bool tc_decode_for(int q_len) const {
    return setup_.tc_decode &&
           int64_t(q_len) * (config_.num_q_heads / config_.num_kv_heads) <= kTcDecodeMaxRows;
  }

  // graph_q_len > 0 (the graph pool): a prefill plan is padded to the capacity of its batch
  // size with graph_q_len query tokens per request, so captured grids cover every later plan.
  void plan_call(CallState& call, bool cuda_core_decode, int graph_q_len) {
    call.max_kv_len = 0;
    for (int32_t len : call.layout.kv_len) call.max_kv_len = std::max(call.max_kv_len, len);
    call.prefill = !cuda_core_decode;
    call.padded = false;
    if (cuda_core_decode) {
      call.item_limit = core::decode_item_capacity(call.layout.batch_size, setup_.plan_config);
      call.decode_plan = core::plan_decode(call.layout.kv_len, setup_.plan_config, call.item_limit);
      return;
    }
    call.item_limit = 0;
    // The decode-shaped kernel takes calls of few rows a request (a graph's plan: the captured
    // q_len, so that every replay of the capture picks the same kernel).
    int max_q_len = graph_q_len;
    if (graph_q_len == 0) {
      for (size_t r = 0; r + 1 < call.layout.qo_indptr.size(); ++r) {
        max_q_len = std::max(max_q_len, call.layout.qo_indptr[r + 1] - call.layout.qo_indptr[r]);
      }
    }
    call.tc_decode = tc_decode_for(max_q_len);
    const core::PrefillTileShape shape =
        prefill_shape(call.layout.mask, call.layout.window_left, call.tc_decode,
                      call.layout.batch_size, max_q_len);
    // Into the call's own plan: its vectors keep their storage from step to step.
    core::plan_prefill_tiles(call.layout.qo_indptr, call.layout.kv_indptr, shape,
                             call.prefill_plan);
    call.prefill_items = int(call.prefill_plan.items.size());
    call.prefill_merges = int(call.prefill_plan.merges.size());
    if (graph_q_len > 0) {
      core::pad_prefill_plan(call.prefill_plan, core::prefill_plan_capacity(call.layout.batch_size,
                                                                            graph_q_len, shape));
      call.padded = true;
    }
  }

  // ---- DECODE / TARGET_VERIFY planned on the device (core::StepFacts::device_lengths) --------

  // Query tokens a request of a device-planned step: 1 (DECODE) or the tree's.
  static int device_q_len(const ForwardBatch& batch) {
    return batch.mode == ForwardMode::kTargetVerify ? batch.spec.draft_token_num : 1;
  }

  // The tile shape a device-planned call plans with: the host's (prefill_shape) in the
  // decode-shaped kernel's order (l2_keys 0, the order kernels/device_plan.h computes).
  core::PrefillTileShape device_tile_shape(const core::PagedLayout& layout, int q_len,
                                           int batch_size) const {
    core::PrefillTileShape shape =
        prefill_shape(layout.mask, layout.window_left, tc_decode_for(q_len), batch_size, q_len);
    shape.l2_keys = 0;
    return shape;
  }

  // The tile shape of a device-planned EXTEND-like call: the host's for the Hopper prefill
  // kernel (the decode-shaped one needs a known q_len), its L2 order included.
  core::PrefillTileShape device_extend_shape(const core::PagedLayout& layout,
                                             int batch_size) const {
    return prefill_shape(layout.mask, layout.window_left, /*tc=*/false, batch_size, 0);
  }

  // Refuses (before anything is written) a batch larger than one planning CTA takes.
  void check_device_plan_fits(const ForwardBatch& batch, int64_t num_tokens) const {
    const int batch_size = batch.batch_size;
    const int q_len = device_q_len(batch);
    const bool extend = core::is_extend_like(batch.mode);
    auto refuse = [&](int most) {
      throw_error(
          ErrorKind::kInvalidArgument, "seq_lens_cpu", "missing: a ", forward_mode_name(batch.mode),
          " step without host lengths is planned on the device, for at most ", most, " requests",
          extend ? " of " + std::to_string(num_tokens) + " tokens" : "",
          " on this configuration; this batch has ", batch_size, ": pass the host lengths (*_cpu)");
    };
    // The planner's own bounds (kernels/device_plan.h), for the CUDA-core plan or the tiles.
    core::PagedLayout probe;
    probe.mask = q_len > 1 ? core::MaskMode::kCustom : core::MaskMode::kCausal;
    const bool cuda_core = batch.mode == ForwardMode::kDecode && !setup_.tensor_cores;
    auto fits = [&](int bs) {
      if (cuda_core) {
        return device_plan_decode_fits(bs, core::decode_item_capacity(bs, setup_.plan_config));
      }
      if (extend) {
        const core::PrefillTileShape shape = device_extend_shape(probe, bs);
        return device_plan_tiles_fit(
            bs, core::prefill_plan_capacity_for_tokens(bs, num_tokens, shape), shape);
      }
      const core::PrefillTileShape shape = device_tile_shape(probe, q_len, bs);
      return device_plan_tiles_fit(bs, core::prefill_plan_capacity(bs, q_len, shape), shape);
    };
    if (fits(batch_size)) return;
    int most = std::min(batch_size - 1, std::max(kDevicePlanMaxBatch, kDevicePlanTilesMaxBatch));
    while (most > 0 && !fits(most)) --most;
    refuse(most);
  }

  // out_graph's half: the layout's query rows (its kv arrays are zeros until in_graph's planner
  // writes them) and the plan's fixed size.
  void plan_device_call(CallState& call, core::IndexSet set, const ForwardBatch& batch) {
    const int batch_size = batch.batch_size;
    const bool verify = batch.mode == ForwardMode::kTargetVerify;
    const bool extend = core::is_extend_like(batch.mode);
    const int q_len = device_q_len(batch);
    core::HostLengths zeros;
    zeros.seq_lens.assign(size_t(batch_size), 0);
    if (extend) {
      zeros.prefix_lens = zeros.seq_lens;
      zeros.extend_lens = zeros.seq_lens;
    }
    if (config_.is_encoder_decoder) zeros.encoder_lens = zeros.seq_lens;
    call.layout = core::make_paged_layout(batch.mode, set, config_.sliding_window_size, zeros,
                                          verify ? q_len : 0);
    call.paged = true;
    call.custom_mask = call.layout.mask == core::MaskMode::kCustom
                           ? batch.spec.custom_mask.data_as<const uint8_t>()
                           : nullptr;
    call.mask_elems = verify ? batch.spec.custom_mask.numel() : 0;
    call.fold_window = verify && set == core::IndexSet::kWindow;
    if (call.fold_window) prepare_window_fold(call, batch);
    call.device_plan = true;
    call.max_kv_len = config_.req_to_token_pool->max_context_len();
    call.prefill = verify || extend || setup_.tensor_cores;
    if (!call.prefill) {
      call.item_limit = core::decode_item_capacity(batch_size, setup_.plan_config);
      call.decode_plan = core::DecodePlan{};
      call.decode_plan.merge_indptr.assign(size_t(batch_size) + 1, 0);
      return;
    }
    call.item_limit = 0;
    call.tc_decode = !extend && tc_decode_for(q_len);
    const int group = config_.num_q_heads / config_.num_kv_heads;
    if (extend) {
      // The query rows are in_graph's planner's to write (qo_indptr from the device lengths).
      const core::PrefillTileShape shape = device_extend_shape(call.layout, batch_size);
      size_device_tile_plan(
          call, shape, core::prefill_plan_capacity_for_tokens(batch_size, step_.num_tokens, shape),
          group);
    } else {
      const core::PrefillTileShape shape = device_tile_shape(call.layout, q_len, batch_size);
      size_device_tile_plan(call, shape, core::prefill_plan_capacity(batch_size, q_len, shape),
                            group);
    }
  }

  // in_graph's half: the KV ranges and the plan from the batch's device seq_lens.
  void plan_on_device(const CallState& call, core::IndexSet set, const ForwardBatch& batch,
                      cudaStream_t stream) const {
    const bool verify = batch.mode == ForwardMode::kTargetVerify;
    DeviceLengths lengths;
    if (config_.is_encoder_decoder) {
      lengths.encoder_lens = batch.encoder_lens.data();
      lengths.encoder_lens_int64 = batch.encoder_lens.dtype() == DType::kInt64;
      lengths.encoder_keys = set == core::IndexSet::kEncoder;
    }
    lengths.seq_lens = batch.seq_lens.data();
    lengths.seq_lens_int64 = batch.seq_lens.dtype() == DType::kInt64;
    lengths.window = call.layout.window_left;
    lengths.max_context_len = config_.req_to_token_pool->max_context_len();
    lengths.q_len = device_q_len(batch);
    lengths.tree_tokens = verify ? batch.spec.draft_token_num : 0;
    if (verify && call.layout.mask == core::MaskMode::kCustom) {  // (not the encoder set's call)
      lengths.mask_indptr = const_cast<int64_t*>(call.meta<int64_t>(call.offsets.mask_indptr));
      lengths.mask_elems = call.meta<int64_t>(call.offsets.mask_elems);
    }
    if (core::is_extend_like(batch.mode)) {
      lengths.prefix_lens = batch.extend_prefix_lens.data();
      lengths.prefix_lens_int64 = batch.extend_prefix_lens.dtype() == DType::kInt64;
      lengths.num_tokens = step_.num_tokens;
      lengths.qo_indptr = const_cast<int32_t*>(call.meta<int32_t>(call.offsets.qo_indptr));
    }
    launch_call_plan(call, lengths, setup_.plan_config, stream);
  }

  // TARGET_VERIFY on a window layer: the window becomes part of the tree mask (tree tokens do
  // not sit at consecutive positions). in_graph folds it on the device into call.folded_mask,
  // which the kernel then reads; here the host checks the inputs and sizes the buffer.
  void prepare_window_fold(CallState& call, const ForwardBatch& batch) {
    check_arg(batch.positions.defined(), "positions",
              "missing: TARGET_VERIFY on a sliding-window model needs the tree positions");
    const int64_t num_tree = int64_t(batch.batch_size) * batch.spec.draft_token_num;
    core::check_index_tensor(batch.positions, "positions", num_tree, device_);
    const size_t bytes = size_t(std::max<int64_t>(batch.spec.custom_mask.numel(), 1));
    ensure_bytes(call.folded_mask, bytes, step_.graph_pool, device_, "folded tree mask");
    call.tree_mask = batch.spec.custom_mask.data_as<const uint8_t>();
    call.custom_mask = static_cast<const uint8_t*>(call.folded_mask.data());
  }

  void require_step(const ForwardBatch& batch, const char* where) const {
    check_arg(step_.ready, where, "call init_forward_metadata (out_graph) for this batch first");
    check_arg(batch.mode == step_.mode && batch.batch_size == step_.batch_size, where,
              "the batch (", forward_mode_name(batch.mode), ", batch_size ", batch.batch_size,
              ") is not the one init_forward_metadata planned (", forward_mode_name(step_.mode),
              ", batch_size ", step_.batch_size, ")");
  }

  void forward_any(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const AttentionLayer& layer, const ForwardBatch& batch,
                   bool save_kv_cache, const char* where) {
    set_device();
    require_step(batch, where);
    check_arg(step_.indices_built, where,
              "call init_forward_metadata_in_graph (or init_forward_metadata) first");
    core::validate_forward_tensors(q, k, v, out, layer, batch, config_, device_, step_.num_tokens,
                                   save_kv_cache);
    const cudaStream_t stream = as_stream(config_.cuda_stream);
    if (save_kv_cache && k.defined()) {
      const bool cross = layer.is_cross_attention;
      const TensorView& loc = cross ? batch.encoder_out_cache_loc : batch.out_cache_loc;
      const DeviceIndexArray checked = cross ? step_.checked_encoder_loc : step_.checked_loc;
      const DeviceIndexArray given = device_index_array(loc);
      SaveGuard guard;
      guard.state = step_state();
      guard.check_loc = given.data != checked.data || given.int64 != checked.int64 ||
                        given.length != checked.length;
      guard.reports = guard_.device_reports();
      guard.loc_argument = cross ? kArgEncoderOutCacheLoc : kArgOutCacheLoc;
      save_kv(config_, layer, k, v, loc, guard, stream);
    }
    if (step_.num_tokens == 0) return;
    // Sinks: the attention leaves each row's LSE in sink_lse, then one pass folds the sink into
    // the finished output (launch_apply_sinks).
    float* sink_lse = nullptr;
    if (layer.sinks.defined()) {
      Buffer& lse_buffer = step_.graph_pool ? graph_sink_lse_ : sink_lse_;
      ensure_bytes(lse_buffer,
                   core::checked_bytes({step_.num_tokens, config_.num_q_heads,
                                        int64_t(sizeof(float))},
                                       "sink LSE"),
                   step_.graph_pool, device_, "sink LSE");
      sink_lse = static_cast<float*>(lse_buffer.data());
    }
    auto finish = [&] {
      if (sink_lse == nullptr) return;
      fold_sinks(out, config_.v_head_dim, sink_lse, layer.sinks, step_.num_tokens,
                 &step_state()->error, stream);
    };
    if (!step_.convert_io) {
      attend(config_, layer, q, k, v, out, sink_lse, stream);
      finish();
      return;
    }
    // fp32 io: 16-bit copies of q (and the ragged k/v) in, the 16-bit output back out.
    BackendConfig compute = config_;
    compute.q_dtype = setup_.compute_dtype;
    const int64_t n = step_.num_tokens;
    const size_t elem = size_t(dtype_size(compute.q_dtype));
    char* base = static_cast<char*>((step_.graph_pool ? graph_io_scratch_ : io_scratch_).data());
    const size_t q_bytes = align_region(size_t(n) * config_.num_q_heads * config_.head_dim * elem);
    const size_t out_bytes =
        align_region(size_t(n) * config_.num_q_heads * config_.v_head_dim * elem);
    const TensorView q16(base, compute.q_dtype, device_,
                         {n, config_.num_q_heads, config_.head_dim});
    const TensorView out16(base + q_bytes, compute.q_dtype, device_,
                           {n, config_.num_q_heads, config_.v_head_dim});
    convert_heads(q, config_.head_dim, q16, stream);
    TensorView k16, v16;
    if (step_.ragged && k.defined()) {
      const int64_t kv_rows = k.size(0);
      char* kv_base = base + q_bytes + out_bytes;
      k16 = TensorView(kv_base, compute.q_dtype, device_,
                       {kv_rows, config_.num_kv_heads, config_.head_dim});
      v16 =
          TensorView(kv_base + size_t(kv_rows) * config_.num_kv_heads * config_.head_dim * elem,
                     compute.q_dtype, device_, {kv_rows, config_.num_kv_heads, config_.v_head_dim});
      convert_heads(k, config_.head_dim, k16, stream);
      convert_heads(v, config_.v_head_dim, v16, stream);
    }
    attend(compute, layer, q16, k16, v16, out16, sink_lse, stream);
    convert_heads(out16, config_.v_head_dim, out, stream);
    finish();
  }

  // One fp32 partial output of the ragged + prefix EXTEND in ragged_scratch_ (aligned size).
  size_t ragged_partial_bytes(const BackendConfig& cfg) const {
    return align_region(size_t(step_.num_tokens) * size_t(cfg.num_q_heads) *
                        size_t(cfg.v_head_dim) * sizeof(float));
  }

  void convert_heads(const TensorView& src, int dim, const TensorView& dst,
                     cudaStream_t stream) const {
    ConvertRowsLaunch c;
    const core::HeadStrides ss = core::head_strides(src, dim);
    const core::HeadStrides ds = core::head_strides(dst, dim);
    c.src = src.data();
    c.src_stride_token = ss.token;
    c.src_stride_head = ss.head;
    c.src_dtype = src.dtype();
    c.dst = dst.data();
    c.dst_stride_token = ds.token;
    c.dst_stride_head = ds.head;
    c.dst_dtype = dst.dtype();
    c.rows = src.size(0);
    c.heads = int(src.ndim() == 3 ? src.size(1) : src.size(1) / dim);
    c.dim = dim;
    c.step_error = &step_state()->error;
    launch_convert_rows(c, stream);
  }

  // The attention of one layer with io in cfg.q_dtype (the config's, or the 16-bit copies');
  // lse, when given, receives each output row's natural-log LSE.
  void attend(const BackendConfig& cfg, const AttentionLayer& layer, const TensorView& q,
              const TensorView& k, const TensorView& v, const TensorView& out, float* lse,
              cudaStream_t stream) {
    const core::IndexSet set = core::index_set_for(layer, cfg.is_encoder_decoder);
    const auto& pool = step_.graph_pool ? graph_calls_ : eager_calls_;
    size_t slot = 0;
    while (slot < model_sets_.size() && model_sets_[slot] != set) ++slot;
    check_arg(slot < model_sets_.size(), "layer", "needs an index set this model does not keep");
    const CallState& paged = pool[slot];
    const StepState* state = step_state();
    if (step_.cascade && set == core::IndexSet::kFull) {
      refuse_cascade_capture(stream_is_capturing(stream), "forward");
      attend_cascade(cascade_, cfg, setup_.compute_dtype, layer, q, out, lse, state, device_,
                     stream);
      return;
    }
    if (!step_.ragged || (!step_.any_prefix && !k.defined())) {
      run_call(paged, make_params(paged, cfg, layer, q, out, lse, {}, {}, state), device_.index,
               stream);
      return;
    }
    // Ragged + paged prefix (SPEC §3 (b)): new tokens against themselves (causal, no gather),
    // the prefix without a mask, then the merge of the two states.
    check_arg(k.defined() && v.defined(), "k",
              "the ragged EXTEND path attends to this step's k/v directly: pass them");
    const CallState& ragged = pool[kRaggedSlot];
    if (!step_.any_prefix) {
      run_call(ragged, make_params(ragged, cfg, layer, q, out, lse, k, v, state), device_.index,
               stream);
      return;
    }
    // Both partial states stay fp32 until the merge, so the output is rounded once (as by a
    // one-pass kernel); rounding each partial to the io dtype first cost ~2x the error.
    const size_t rows = size_t(step_.num_tokens) * size_t(cfg.num_q_heads);
    char* scratch = static_cast<char*>(ragged_scratch_.data());
    const size_t partial_bytes = ragged_partial_bytes(cfg);
    float* lse_prefix = reinterpret_cast<float*>(scratch + 2 * partial_bytes);
    float* lse_new = lse_prefix + rows;
    const TensorView prefix_out(scratch, DType::kFloat32, device_,
                                {step_.num_tokens, cfg.num_q_heads, cfg.v_head_dim});
    const TensorView new_out(scratch + partial_bytes, DType::kFloat32, device_,
                             {step_.num_tokens, cfg.num_q_heads, cfg.v_head_dim});
    core::AttentionParams prefix_params =
        make_params(paged, cfg, layer, q, prefix_out, lse_prefix, {}, {}, state);
    core::AttentionParams new_params =
        make_params(ragged, cfg, layer, q, new_out, lse_new, k, v, state);
    prefix_params.out_fp32 = new_params.out_fp32 = true;
    run_call(paged, prefix_params, device_.index, stream);
    run_call(ragged, new_params, device_.index, stream);
    MergeStatesLaunch m;
    const core::HeadStrides os = core::head_strides(out, cfg.v_head_dim);
    m.o_a = prefix_out.data();
    m.lse_a = lse_prefix;
    m.o_b = new_out.data();
    m.lse_b = lse_new;
    m.out = out.data();
    m.stride_token = os.token;
    m.stride_head = os.head;
    m.a_stride_token = m.b_stride_token = int64_t(cfg.num_q_heads) * cfg.v_head_dim;
    m.a_stride_head = m.b_stride_head = cfg.v_head_dim;
    m.partial_dtype = DType::kFloat32;
    m.io_dtype = cfg.q_dtype;
    m.num_tokens = step_.num_tokens;
    m.num_heads = cfg.num_q_heads;
    m.v_head_dim = cfg.v_head_dim;
    m.lse_out = lse;
    m.step_error = &state->error;
    launch_merge_states(m, stream);
  }

  BackendConfig config_;
  Device device_;
  DecodeSetup setup_;
  std::vector<core::IndexSet> model_sets_;
  StepGuard guard_;
  Step step_;
  CallState eager_calls_[3];
  CallState graph_calls_[3];
  CascadeStep cascade_;  ///< steps with declared shared-prefix groups (eager only)
  Buffer ragged_scratch_;
  Buffer sink_lse_;        ///< layers with sinks: each row's LSE before the sink
  Buffer graph_sink_lse_;  ///< the graph pool's (frozen once allocated)
  Buffer io_scratch_;
  Buffer graph_io_scratch_;  ///< the graph pool's fp32-io copies (frozen once allocated)
  int graph_max_bs_ = 0;
  int64_t graph_max_tokens_ = 0;
  /// The most query tokens of an EXTEND-like step (planned on the device) the graph buffers'
  /// fixed-size plan holds: graph_max_tokens_, or less where one plan cannot hold that many.
  int64_t graph_extend_tokens_ = 0;
  int64_t graph_kv_capacity_ = 0;
};

}  // namespace

std::unique_ptr<AttentionBackend> make_cuda_backend(const BackendConfig& config) {
  return std::make_unique<CudaBackend>(config);
}

}  // namespace kvattn::cuda
