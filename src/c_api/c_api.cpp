// The C ABI (include/kvattn/c_api.h) over the C++ API: every entry point converts its plain
// structs into the C++ types, calls the library inside one guard that turns every exception
// into a status plus this thread's last-error record, and never lets an exception out.
#include "kvattn/c_api.h"

#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvattn/kvattn.h"

using kvattn::DType;
using kvattn::ErrorKind;

struct kvattn_kv_cache {
  kvattn::KvCache cache;
};
struct kvattn_req_to_token_pool {
  kvattn::ReqToTokenPool pool;
};
struct kvattn_slot_allocator {
  kvattn::SlotAllocator allocator;
};
struct kvattn_backend {
  std::unique_ptr<kvattn::AttentionBackend> backend;
};

namespace {

// This thread's last failure: what kvattn_last_error_* return.
struct LastError {
  std::string message;
  std::string argument;
  int64_t step = -1;
};
thread_local LastError last_error;

kvattn_status status_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return KVATTN_ERROR_INVALID_ARGUMENT;
    case ErrorKind::kNotSupported:
      return KVATTN_ERROR_NOT_SUPPORTED;
    case ErrorKind::kOutOfResources:
      return KVATTN_ERROR_OUT_OF_RESOURCES;
    case ErrorKind::kDeviceError:
      return KVATTN_ERROR_DEVICE;
  }
  return KVATTN_ERROR_INTERNAL;
}

kvattn_status fail(kvattn_status status, std::string message, std::string argument = {},
                   int64_t step = -1) {
  // Assigning may itself run out of memory; the status still reaches the caller.
  try {
    last_error.message = std::move(message);
    last_error.argument = std::move(argument);
  } catch (...) {
    last_error.message.clear();
    last_error.argument.clear();
  }
  last_error.step = step;
  return status;
}

// Runs fn; every exception becomes a status and the thread's last error. This is the only way
// the entry points below call into the library.
template <typename Fn>
kvattn_status guard(Fn&& fn) noexcept {
  try {
    fn();
    return KVATTN_OK;
  } catch (const kvattn::Error& e) {
    return fail(status_of(e.kind()), e.what(), e.argument(), e.step());
  } catch (const std::bad_alloc&) {
    return fail(KVATTN_ERROR_OUT_OF_RESOURCES, "kvattn: out of host memory");
  } catch (const std::exception& e) {
    return fail(KVATTN_ERROR_INTERNAL, std::string("kvattn: internal error: ") + e.what());
  } catch (...) {
    return fail(KVATTN_ERROR_INTERNAL, "kvattn: internal error (unknown exception)");
  }
}

template <typename T>
void require(const T* pointer, const char* name) {
  kvattn::check_arg(pointer != nullptr, name, "is NULL");
}

DType dtype_of(int32_t dtype, const char* name) {
  kvattn::check_arg(dtype >= KVATTN_DTYPE_FLOAT32 && dtype <= KVATTN_DTYPE_UINT8, name,
                    "dtype code ", dtype, ", expected a kvattn_dtype (0..7)");
  return static_cast<DType>(dtype);
}

kvattn::Device device_of(const kvattn_device& device, const char* name) {
  kvattn::check_arg(device.type == KVATTN_DEVICE_CPU || device.type == KVATTN_DEVICE_CUDA, name,
                    "device type ", device.type, ", expected KVATTN_DEVICE_CPU or _CUDA");
  kvattn::check_arg(device.index >= 0, name, "device index ", device.index, ", expected >= 0");
  return device.type == KVATTN_DEVICE_CPU ? kvattn::Device::cpu()
                                          : kvattn::Device::cuda(device.index);
}

kvattn_device c_device(const kvattn::Device& device) {
  return {device.is_cpu() ? KVATTN_DEVICE_CPU : KVATTN_DEVICE_CUDA, device.index};
}

// The enum values of c_api.h mirror the C++ enums one to one.
static_assert(KVATTN_DTYPE_FLOAT32 == int(DType::kFloat32) &&
              KVATTN_DTYPE_BFLOAT16 == int(DType::kBFloat16) &&
              KVATTN_DTYPE_FLOAT16 == int(DType::kFloat16) &&
              KVATTN_DTYPE_FLOAT8_E4M3 == int(DType::kFloat8E4M3) &&
              KVATTN_DTYPE_FLOAT8_E5M2 == int(DType::kFloat8E5M2) &&
              KVATTN_DTYPE_INT32 == int(DType::kInt32) &&
              KVATTN_DTYPE_INT64 == int(DType::kInt64) && KVATTN_DTYPE_UINT8 == int(DType::kUInt8));
static_assert(KVATTN_MODE_IDLE == int(kvattn::ForwardMode::kIdle) &&
              KVATTN_MODE_DECODE == int(kvattn::ForwardMode::kDecode) &&
              KVATTN_MODE_EXTEND == int(kvattn::ForwardMode::kExtend) &&
              KVATTN_MODE_MIXED == int(kvattn::ForwardMode::kMixed) &&
              KVATTN_MODE_TARGET_VERIFY == int(kvattn::ForwardMode::kTargetVerify) &&
              KVATTN_MODE_DRAFT_EXTEND == int(kvattn::ForwardMode::kDraftExtend));
static_assert(KVATTN_MAX_DIMS == kvattn::TensorView::kMaxDims);

// A view of a C tensor; absent (a default TensorView) for a NULL pointer or a zeroed struct.
kvattn::TensorView view_of(const kvattn_tensor* tensor, const char* name) {
  if (tensor == nullptr || (tensor->data == nullptr && tensor->ndim == 0)) return {};
  kvattn::check_arg(tensor->ndim >= 0 && tensor->ndim <= KVATTN_MAX_DIMS, name, "ndim ",
                    tensor->ndim, ", expected 0..", KVATTN_MAX_DIMS);
  const DType dtype = dtype_of(tensor->dtype, name);
  const kvattn::Device device = device_of(tensor->device, name);
  int64_t strides[KVATTN_MAX_DIMS];
  bool contiguous = true;
  for (int d = 0; d < tensor->ndim; ++d) {
    kvattn::check_arg(tensor->shape[d] >= 0, name, "shape[", d, "] = ", tensor->shape[d],
                      ", expected >= 0");
    if (tensor->strides[d] != 0) contiguous = false;
  }
  if (contiguous) {
    int64_t stride = 1;
    for (int d = tensor->ndim - 1; d >= 0; --d) {
      strides[d] = stride;
      stride *= tensor->shape[d] > 0 ? tensor->shape[d] : 1;
    }
  } else {
    std::memcpy(strides, tensor->strides, sizeof(strides));
  }
  return kvattn::TensorView(tensor->data, dtype, device, tensor->ndim, tensor->shape, strides);
}

kvattn_tensor c_tensor(const kvattn::TensorView& view) {
  kvattn_tensor out{};
  out.data = view.data();
  out.dtype = int32_t(view.dtype());
  out.device = c_device(view.device());
  out.ndim = view.ndim();
  for (int d = 0; d < view.ndim(); ++d) {
    out.shape[d] = view.size(d);
    out.strides[d] = view.stride(d);
  }
  return out;
}

kvattn::KvCacheConfig cache_config_of(const kvattn_kv_cache_config* config) {
  require(config, "config");
  kvattn::KvCacheConfig c;
  c.num_layers = config->num_layers;
  c.num_slots = config->num_slots;
  c.num_kv_heads = config->num_kv_heads;
  c.head_dim = config->head_dim;
  c.v_head_dim = config->v_head_dim;
  c.page_size = config->page_size;
  c.dtype = dtype_of(config->dtype, "config.dtype");
  c.device = device_of(config->device, "config.device");
  return c;
}

kvattn::AttentionLayer layer_of(const kvattn_layer* layer) {
  require(layer, "layer");
  kvattn::AttentionLayer l;
  l.layer_id = layer->layer_id;
  l.num_q_heads = layer->num_q_heads;
  l.num_kv_heads = layer->num_kv_heads;
  l.head_dim = layer->head_dim;
  l.v_head_dim = layer->v_head_dim;
  l.scaling = layer->scaling;
  l.logit_cap = layer->logit_cap;
  l.sliding_window_size = layer->sliding_window_size;
  l.is_cross_attention = layer->is_cross_attention != 0;
  l.k_scale = layer->k_scale;
  l.v_scale = layer->v_scale;
  l.sinks = view_of(&layer->sinks, "layer.sinks");
  return l;
}

kvattn::ForwardBatch batch_of(const kvattn_forward_batch* batch) {
  require(batch, "batch");
  kvattn::check_arg(batch->mode >= KVATTN_MODE_IDLE && batch->mode <= KVATTN_MODE_DRAFT_EXTEND,
                    "batch.mode", "got ", batch->mode, ", expected a kvattn_forward_mode (0..5)");
  kvattn::ForwardBatch b;
  b.mode = static_cast<kvattn::ForwardMode>(batch->mode);
  b.batch_size = batch->batch_size;
  b.req_pool_indices = view_of(&batch->req_pool_indices, "batch.req_pool_indices");
  b.seq_lens = view_of(&batch->seq_lens, "batch.seq_lens");
  b.seq_lens_cpu = view_of(&batch->seq_lens_cpu, "batch.seq_lens_cpu");
  b.seq_lens_sum = batch->seq_lens_sum;
  b.extend_prefix_lens = view_of(&batch->extend_prefix_lens, "batch.extend_prefix_lens");
  b.extend_prefix_lens_cpu =
      view_of(&batch->extend_prefix_lens_cpu, "batch.extend_prefix_lens_cpu");
  b.extend_seq_lens = view_of(&batch->extend_seq_lens, "batch.extend_seq_lens");
  b.extend_seq_lens_cpu = view_of(&batch->extend_seq_lens_cpu, "batch.extend_seq_lens_cpu");
  b.out_cache_loc = view_of(&batch->out_cache_loc, "batch.out_cache_loc");
  b.encoder_lens = view_of(&batch->encoder_lens, "batch.encoder_lens");
  b.encoder_lens_cpu = view_of(&batch->encoder_lens_cpu, "batch.encoder_lens_cpu");
  b.encoder_out_cache_loc = view_of(&batch->encoder_out_cache_loc, "batch.encoder_out_cache_loc");
  b.positions = view_of(&batch->positions, "batch.positions");
  b.spec.draft_token_num = batch->draft_token_num;
  b.spec.custom_mask = view_of(&batch->custom_mask, "batch.custom_mask");
  b.shared_prefix_group_cpu =
      view_of(&batch->shared_prefix_group_cpu, "batch.shared_prefix_group_cpu");
  b.shared_prefix_lens_cpu = view_of(&batch->shared_prefix_lens_cpu, "batch.shared_prefix_lens_cpu");
  b.req_to_token_pool = batch->req_to_token_pool ? &batch->req_to_token_pool->pool : nullptr;
  b.kv_cache = batch->kv_cache ? &batch->kv_cache->cache : nullptr;
  return b;
}

template <typename T>
void clear_out(T** out) {
  if (out != nullptr) *out = nullptr;
}

}  // namespace

extern "C" {

// ---- status and errors ------------------------------------------------------------------------

const char* kvattn_status_name(kvattn_status status) {
  switch (status) {
    case KVATTN_OK:
      return "ok";
    case KVATTN_ERROR_INVALID_ARGUMENT:
      return "invalid argument";
    case KVATTN_ERROR_NOT_SUPPORTED:
      return "not supported";
    case KVATTN_ERROR_OUT_OF_RESOURCES:
      return "out of resources";
    case KVATTN_ERROR_DEVICE:
      return "device error";
    case KVATTN_ERROR_INTERNAL:
      return "internal error";
  }
  return "unknown status";
}

const char* kvattn_last_error_message(void) {
  return last_error.message.c_str();
}
const char* kvattn_last_error_argument(void) {
  return last_error.argument.c_str();
}
int64_t kvattn_last_error_step(void) {
  return last_error.step;
}

int kvattn_c_api_version(void) {
  return KVATTN_C_API_VERSION;
}
int kvattn_cuda_compiled(void) {
  return kvattn::cuda_compiled() ? 1 : 0;
}
int kvattn_cuda_device_count(void) {
  try {
    return kvattn::cuda_device_count();
  } catch (...) {
    return 0;
  }
}

kvattn_tensor kvattn_tensor_make(void* data, kvattn_dtype dtype, kvattn_device device, int ndim,
                                 const int64_t* shape) {
  kvattn_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim < 0 ? 0 : (ndim > KVATTN_MAX_DIMS ? KVATTN_MAX_DIMS : ndim);
  for (int d = 0; d < t.ndim && shape != nullptr; ++d) t.shape[d] = shape[d];
  return t;  // strides all zero: contiguous
}

// ---- KV cache
// ------------------------------------------------------------------------------------

void kvattn_kv_cache_config_init(kvattn_kv_cache_config* config) {
  if (config == nullptr) return;
  *config = kvattn_kv_cache_config{};
  config->num_layers = 1;
  config->page_size = 1;
  config->dtype = KVATTN_DTYPE_BFLOAT16;
  config->device = {KVATTN_DEVICE_CPU, 0};
}

kvattn_status kvattn_kv_cache_create(const kvattn_kv_cache_config* config, kvattn_kv_cache** out) {
  clear_out(out);
  return guard([&] {
    require(out, "out");
    auto cache = std::make_unique<kvattn_kv_cache>(
        kvattn_kv_cache{kvattn::KvCache::allocate(cache_config_of(config))});
    *out = cache.release();
  });
}

kvattn_status kvattn_kv_cache_wrap(const kvattn_kv_cache_config* config,
                                   const kvattn_tensor* k_buffers, const kvattn_tensor* v_buffers,
                                   kvattn_kv_cache** out) {
  clear_out(out);
  return guard([&] {
    require(out, "out");
    const kvattn::KvCacheConfig c = cache_config_of(config);
    kvattn::check_arg(c.num_layers >= 1, "config.num_layers", "got ", c.num_layers,
                      ", expected >= 1");
    require(k_buffers, "k_buffers");
    require(v_buffers, "v_buffers");
    std::vector<kvattn::TensorView> k, v;
    for (int l = 0; l < c.num_layers; ++l) {
      k.push_back(view_of(&k_buffers[l], "k_buffers"));
      v.push_back(view_of(&v_buffers[l], "v_buffers"));
    }
    auto cache = std::make_unique<kvattn_kv_cache>(kvattn_kv_cache{kvattn::KvCache::wrap(c, k, v)});
    *out = cache.release();
  });
}

void kvattn_kv_cache_destroy(kvattn_kv_cache* cache) {
  delete cache;
}

kvattn_status kvattn_kv_cache_k_buffer(const kvattn_kv_cache* cache, int layer_id,
                                       kvattn_tensor* out) {
  return guard([&] {
    require(cache, "cache");
    require(out, "out");
    *out = c_tensor(cache->cache.k_buffer(layer_id));
  });
}

kvattn_status kvattn_kv_cache_v_buffer(const kvattn_kv_cache* cache, int layer_id,
                                       kvattn_tensor* out) {
  return guard([&] {
    require(cache, "cache");
    require(out, "out");
    *out = c_tensor(cache->cache.v_buffer(layer_id));
  });
}

kvattn_status kvattn_kv_cache_set_scales(kvattn_kv_cache* cache, int layer_id, float k_scale,
                                         float v_scale) {
  return guard([&] {
    require(cache, "cache");
    cache->cache.set_scales(layer_id, k_scale, v_scale);
  });
}

// ---- req_to_token
// --------------------------------------------------------------------------------

kvattn_status kvattn_req_to_token_pool_create(int max_reqs, int max_context_len,
                                              kvattn_device device,
                                              kvattn_req_to_token_pool** out) {
  clear_out(out);
  return guard([&] {
    require(out, "out");
    auto pool = std::make_unique<kvattn_req_to_token_pool>(kvattn_req_to_token_pool{
        kvattn::ReqToTokenPool::allocate(max_reqs, max_context_len, device_of(device, "device"))});
    *out = pool.release();
  });
}

kvattn_status kvattn_req_to_token_pool_wrap(const kvattn_tensor* table,
                                            kvattn_req_to_token_pool** out) {
  clear_out(out);
  return guard([&] {
    require(out, "out");
    require(table, "table");
    auto pool = std::make_unique<kvattn_req_to_token_pool>(
        kvattn_req_to_token_pool{kvattn::ReqToTokenPool::wrap(view_of(table, "table"))});
    *out = pool.release();
  });
}

void kvattn_req_to_token_pool_destroy(kvattn_req_to_token_pool* pool) {
  delete pool;
}

kvattn_status kvattn_req_to_token_pool_write(kvattn_req_to_token_pool* pool, int req, int64_t start,
                                             const int32_t* slots, int64_t count) {
  return guard([&] {
    require(pool, "pool");
    kvattn::check_arg(count >= 0, "count", "got ", count, ", expected >= 0");
    if (count > 0) require(slots, "slots");
    pool->pool.write(req, start, std::span<const int32_t>(slots, size_t(count)));
  });
}

kvattn_status kvattn_req_to_token_pool_table(const kvattn_req_to_token_pool* pool,
                                             kvattn_tensor* out) {
  return guard([&] {
    require(pool, "pool");
    require(out, "out");
    *out = c_tensor(pool->pool.table());
  });
}

// ---- slot allocator
// ------------------------------------------------------------------------------

kvattn_status kvattn_slot_allocator_create(int64_t num_slots, int page_size,
                                           kvattn_slot_allocator** out) {
  clear_out(out);
  return guard([&] {
    require(out, "out");
    auto allocator = std::make_unique<kvattn_slot_allocator>(
        kvattn_slot_allocator{kvattn::SlotAllocator(num_slots, page_size)});
    *out = allocator.release();
  });
}

void kvattn_slot_allocator_destroy(kvattn_slot_allocator* allocator) {
  delete allocator;
}

kvattn_status kvattn_slot_allocator_allocate_tokens(kvattn_slot_allocator* allocator,
                                                    int64_t current_len, int32_t last_slot,
                                                    int64_t count, int32_t* slots) {
  return guard([&] {
    require(allocator, "allocator");
    kvattn::check_arg(count >= 0, "count", "got ", count, ", expected >= 0");
    if (count > 0) require(slots, "slots");
    const std::vector<int32_t> got =
        allocator->allocator.allocate_tokens(current_len, last_slot, count);
    std::memcpy(slots, got.data(), got.size() * sizeof(int32_t));
  });
}

kvattn_status kvattn_slot_allocator_free_slots(kvattn_slot_allocator* allocator,
                                               const int32_t* slots, int64_t count) {
  return guard([&] {
    require(allocator, "allocator");
    kvattn::check_arg(count >= 0, "count", "got ", count, ", expected >= 0");
    if (count > 0) require(slots, "slots");
    allocator->allocator.free_slots(std::span<const int32_t>(slots, size_t(count)));
  });
}

int64_t kvattn_slot_allocator_free_slot_count(const kvattn_slot_allocator* allocator) {
  return allocator == nullptr ? 0 : allocator->allocator.free_slot_count();
}

// ---- layer, batch
// --------------------------------------------------------------------------------

void kvattn_layer_init(kvattn_layer* layer) {
  if (layer == nullptr) return;
  *layer = kvattn_layer{};
  layer->sliding_window_size = -1;
}

void kvattn_forward_batch_init(kvattn_forward_batch* batch) {
  if (batch == nullptr) return;
  *batch = kvattn_forward_batch{};
  batch->mode = KVATTN_MODE_DECODE;
  batch->seq_lens_sum = -1;
}

// ---- backend
// -------------------------------------------------------------------------------------

void kvattn_backend_config_init(kvattn_backend_config* config) {
  if (config == nullptr) return;
  *config = kvattn_backend_config{};
  const kvattn::BackendConfig defaults;
  config->q_dtype = int32_t(defaults.q_dtype);
  config->sliding_window_size = defaults.sliding_window_size;
  config->ragged_extend_threshold = defaults.ragged_extend_threshold;
}

kvattn_status kvattn_backend_create(kvattn_backend_kind kind, const kvattn_backend_config* config,
                                    kvattn_backend** out) {
  clear_out(out);
  return guard([&] {
    require(out, "out");
    require(config, "config");
    kvattn::check_arg(kind == KVATTN_BACKEND_CPU || kind == KVATTN_BACKEND_CUDA, "kind", "got ",
                      int(kind), ", expected KVATTN_BACKEND_CPU or KVATTN_BACKEND_CUDA");
    kvattn::check_arg(config->decode_tensor_cores >= 0 && config->decode_tensor_cores <= 2,
                      "config.decode_tensor_cores", "got ", config->decode_tensor_cores,
                      ", expected 0 (auto), 1 (on) or 2 (off)");
    kvattn::BackendConfig c;
    c.kv_cache = config->kv_cache ? &config->kv_cache->cache : nullptr;
    c.req_to_token_pool = config->req_to_token_pool ? &config->req_to_token_pool->pool : nullptr;
    c.num_q_heads = config->num_q_heads;
    c.num_kv_heads = config->num_kv_heads;
    c.head_dim = config->head_dim;
    c.v_head_dim = config->v_head_dim;
    c.q_dtype = dtype_of(config->q_dtype, "config.q_dtype");
    c.sliding_window_size = config->sliding_window_size;
    c.is_encoder_decoder = config->is_encoder_decoder != 0;
    c.ragged_extend_threshold = config->ragged_extend_threshold;
    c.decode_tensor_cores = static_cast<kvattn::TensorCoreDecode>(config->decode_tensor_cores);
    c.num_threads = config->num_threads;
    c.cuda_stream = config->cuda_stream;
    c.deterministic = config->deterministic != 0;
    const kvattn::BackendKind backend_kind =
        kind == KVATTN_BACKEND_CPU ? kvattn::BackendKind::kCpu : kvattn::BackendKind::kCuda;
    auto backend =
        std::make_unique<kvattn_backend>(kvattn_backend{kvattn::make_backend(backend_kind, c)});
    *out = backend.release();
  });
}
static_assert(int(kvattn::TensorCoreDecode::kAuto) == 0 &&
              int(kvattn::TensorCoreDecode::kOn) == 1 && int(kvattn::TensorCoreDecode::kOff) == 2);

void kvattn_backend_destroy(kvattn_backend* backend) {
  delete backend;
}

kvattn_status kvattn_backend_init_forward_metadata(kvattn_backend* backend,
                                                   const kvattn_forward_batch* batch) {
  return guard([&] {
    require(backend, "backend");
    backend->backend->init_forward_metadata(batch_of(batch));
  });
}

kvattn_status kvattn_backend_init_forward_metadata_out_graph(kvattn_backend* backend,
                                                             const kvattn_forward_batch* batch,
                                                             int in_capture) {
  return guard([&] {
    require(backend, "backend");
    backend->backend->init_forward_metadata_out_graph(batch_of(batch), in_capture != 0);
  });
}

kvattn_status kvattn_backend_init_forward_metadata_in_graph(kvattn_backend* backend,
                                                            const kvattn_forward_batch* batch) {
  return guard([&] {
    require(backend, "backend");
    backend->backend->init_forward_metadata_in_graph(batch_of(batch));
  });
}

kvattn_status kvattn_backend_forward(kvattn_backend* backend, const kvattn_tensor* q,
                                     const kvattn_tensor* k, const kvattn_tensor* v,
                                     const kvattn_tensor* out, const kvattn_layer* layer,
                                     const kvattn_forward_batch* batch, int save_kv_cache) {
  return guard([&] {
    require(backend, "backend");
    backend->backend->forward(view_of(q, "q"), view_of(k, "k"), view_of(v, "v"),
                              view_of(out, "out"), layer_of(layer), batch_of(batch),
                              save_kv_cache != 0);
  });
}

kvattn_status kvattn_backend_check_errors(kvattn_backend* backend, int synchronize) {
  return guard([&] {
    require(backend, "backend");
    backend->backend->check_errors(synchronize != 0);
  });
}

uint64_t kvattn_backend_step_id(const kvattn_backend* backend) {
  return backend == nullptr ? 0 : backend->backend->step_id();
}

kvattn_status kvattn_backend_set_cuda_stream(kvattn_backend* backend, void* stream) {
  return guard([&] {
    require(backend, "backend");
    backend->backend->set_cuda_stream(stream);
  });
}

kvattn_status kvattn_backend_init_cuda_graph_state(kvattn_backend* backend, int max_bs,
                                                   int64_t max_num_tokens) {
  return guard([&] {
    require(backend, "backend");
    backend->backend->init_cuda_graph_state(max_bs, max_num_tokens);
  });
}

}  // extern "C"
