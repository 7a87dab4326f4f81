/* kvattn — the C ABI: the KV cache, the request -> token pool, the slot allocator and the
 * attention backend behind opaque handles, for engines that are not C++ (Rust, Go, Zig, C) or
 * that want a stable boundary. Plain C11; the same library as the C++ API (kvattn::kvattn).
 *
 * Conventions
 *   - Every function that can fail returns a kvattn_status. KVATTN_OK is 0; on any other value
 *     kvattn_last_error_message() holds what went wrong (argument, value seen, what was
 *     expected) for the calling thread, until the next failing kvattn call on that thread.
 *     A successful call leaves the last error as it was. No C++ exception crosses this ABI.
 *   - A failed call leaves the KV pool, the pools and the backend as they were (the C++ API's
 *     contract, README "Bad input").
 *   - Handles are opaque; *_create / *_wrap write one to *out (and write NULL on failure),
 *     *_destroy takes NULL as a no-op. A backend keeps pointers to the KV cache and the
 *     req_to_token pool it was made over: destroy the backend first.
 *   - Tensors cross as kvattn_tensor: a non-owning view (DLPack's fields), the caller's memory.
 *   - Streams are the caller's: kvattn_backend_config.cuda_stream (a cudaStream_t, NULL = the
 *     default stream) or kvattn_backend_set_cuda_stream; kvattn never creates or destroys one.
 *   - Config structs are filled with defaults by their *_init function first, then the caller
 *     sets the fields it needs (so a field added later keeps its default).
 *   - Log-sum-exp is natural log (base e) wherever kvattn uses one.
 *
 * A step, as an engine runs it (tests/c/test_c_api.c and examples/cpp_engine/engine_loop_c.c):
 *   kvattn_backend_init_forward_metadata(backend, &batch);            once per step
 *   for each layer: kvattn_backend_forward(backend, &q, &k, &v, &out, &layer, &batch, 1);
 *   kvattn_backend_check_errors(backend, 0);   where the engine synchronises anyway
 */
#ifndef KVATTN_C_API_H
#define KVATTN_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The version of this ABI: changes when a struct or a signature below changes. */
#define KVATTN_C_API_VERSION 3
/** Dimensions a kvattn_tensor can have (kvattn::TensorView::kMaxDims). */
#define KVATTN_MAX_DIMS 6

/* ---- status and errors ------------------------------------------------------------------- */

typedef enum kvattn_status {
  KVATTN_OK = 0,
  KVATTN_ERROR_INVALID_ARGUMENT = 1, /**< a shape, dtype, range or value the contract forbids */
  KVATTN_ERROR_NOT_SUPPORTED = 2,    /**< valid, but this backend or build cannot serve it */
  KVATTN_ERROR_OUT_OF_RESOURCES = 3, /**< an allocation, pool or buffer is exhausted */
  KVATTN_ERROR_DEVICE = 4,           /**< a CUDA call failed */
  KVATTN_ERROR_INTERNAL = 5          /**< anything else (a bug: please report the message) */
} kvattn_status;

/** "ok", "invalid argument", ... (static storage). */
const char* kvattn_status_name(kvattn_status status);
/** The message of this thread's last failed call ("" when none failed yet). Valid until the
 *  next failing kvattn call on this thread. */
const char* kvattn_last_error_message(void);
/** The argument at fault in that failure, e.g. "seq_lens[3]" ("" when none). */
const char* kvattn_last_error_argument(void);
/** For a failure reported by kvattn_backend_check_errors: the step_id of the refused step;
 *  -1 for an error about the call that failed. */
int64_t kvattn_last_error_step(void);

/** KVATTN_C_API_VERSION of the library linked (compare with the header's). */
int kvattn_c_api_version(void);
/** 1 when this build holds the CUDA backend, else 0. */
int kvattn_cuda_compiled(void);
/** Visible CUDA devices (0 without CUDA in the build, a driver or a GPU). */
int kvattn_cuda_device_count(void);

/* ---- tensors ------------------------------------------------------------------------------ */

typedef enum kvattn_dtype {
  KVATTN_DTYPE_FLOAT32 = 0,
  KVATTN_DTYPE_BFLOAT16 = 1,
  KVATTN_DTYPE_FLOAT16 = 2,
  KVATTN_DTYPE_FLOAT8_E4M3 = 3,
  KVATTN_DTYPE_FLOAT8_E5M2 = 4,
  KVATTN_DTYPE_INT32 = 5,
  KVATTN_DTYPE_INT64 = 6,
  KVATTN_DTYPE_UINT8 = 7
} kvattn_dtype;

typedef enum kvattn_device_type {
  KVATTN_DEVICE_CPU = 0,
  KVATTN_DEVICE_CUDA = 1
} kvattn_device_type;

typedef struct kvattn_device {
  int32_t type;  /**< kvattn_device_type */
  int32_t index; /**< the CUDA device; 0 for the host */
} kvattn_device;

/** A view of the caller's memory. ndim == 0 and data == NULL: absent (optional arguments).
 *  strides are in elements; all zero means contiguous (row-major). */
typedef struct kvattn_tensor {
  void* data;
  int32_t dtype; /**< kvattn_dtype */
  kvattn_device device;
  int32_t ndim;
  int64_t shape[KVATTN_MAX_DIMS];
  int64_t strides[KVATTN_MAX_DIMS];
} kvattn_tensor;

/** A contiguous view of `ndim` dimensions `shape` (a helper; plain struct filling works too). */
kvattn_tensor kvattn_tensor_make(void* data, kvattn_dtype dtype, kvattn_device device, int ndim,
                                 const int64_t* shape);

/* ---- the KV cache -------------------------------------------------------------------------- */

typedef struct kvattn_kv_cache kvattn_kv_cache;

/** Shape and storage of a KV pool: K of layer l is [num_slots, num_kv_heads, head_dim], V
 *  [num_slots, num_kv_heads, v_head_dim]; page p holds slots [p * page_size, (p+1) * page_size);
 *  page 0 (slot 0) is the padding page. */
typedef struct kvattn_kv_cache_config {
  int32_t num_layers; /**< default 1 */
  int64_t num_slots;  /**< a multiple of page_size, slot 0 included */
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t v_head_dim;   /**< 0 = head_dim */
  int32_t page_size;    /**< a power of two in [1, 128]; default 1 */
  int32_t dtype;        /**< storage: bf16 (default), fp16, fp8 e4m3 / e5m2 */
  kvattn_device device; /**< default: the host */
} kvattn_kv_cache_config;

void kvattn_kv_cache_config_init(kvattn_kv_cache_config* config);
/** Allocates every layer's K and V (zero-filled) on config->device. */
kvattn_status kvattn_kv_cache_create(const kvattn_kv_cache_config* config, kvattn_kv_cache** out);
/** Wraps the caller's buffers: k_buffers[l] and v_buffers[l] for l < num_layers, contiguous,
 *  with the shapes above. The caller keeps them alive while the cache exists. */
kvattn_status kvattn_kv_cache_wrap(const kvattn_kv_cache_config* config,
                                   const kvattn_tensor* k_buffers, const kvattn_tensor* v_buffers,
                                   kvattn_kv_cache** out);
void kvattn_kv_cache_destroy(kvattn_kv_cache* cache);
/** Views of layer `layer_id`'s K / V buffer. */
kvattn_status kvattn_kv_cache_k_buffer(const kvattn_kv_cache* cache, int layer_id,
                                       kvattn_tensor* out);
kvattn_status kvattn_kv_cache_v_buffer(const kvattn_kv_cache* cache, int layer_id,
                                       kvattn_tensor* out);
/** fp8 per-layer scales (storage holds k / k_scale, v / v_scale); > 0. */
kvattn_status kvattn_kv_cache_set_scales(kvattn_kv_cache* cache, int layer_id, float k_scale,
                                         float v_scale);

/* ---- req_to_token: int32 [max_reqs, max_context_len], row r = the slots of request r ------- */

typedef struct kvattn_req_to_token_pool kvattn_req_to_token_pool;

kvattn_status kvattn_req_to_token_pool_create(int max_reqs, int max_context_len,
                                              kvattn_device device, kvattn_req_to_token_pool** out);
/** Wraps the caller's contiguous int32 [max_reqs, max_context_len] tensor (never copied). */
kvattn_status kvattn_req_to_token_pool_wrap(const kvattn_tensor* table,
                                            kvattn_req_to_token_pool** out);
void kvattn_req_to_token_pool_destroy(kvattn_req_to_token_pool* pool);
/** Writes `count` host slots into row `req`, positions [start, start + count). */
kvattn_status kvattn_req_to_token_pool_write(kvattn_req_to_token_pool* pool, int req, int64_t start,
                                             const int32_t* slots, int64_t count);
/** A view of the whole table. */
kvattn_status kvattn_req_to_token_pool_table(const kvattn_req_to_token_pool* pool,
                                             kvattn_tensor* out);

/* ---- the slot allocator (host-only, not thread-safe: the engine's scheduler owns it) -------- */

typedef struct kvattn_slot_allocator kvattn_slot_allocator;

kvattn_status kvattn_slot_allocator_create(int64_t num_slots, int page_size,
                                           kvattn_slot_allocator** out);
void kvattn_slot_allocator_destroy(kvattn_slot_allocator* allocator);
/** Slots for `count` more tokens of a request that holds `current_len` tokens, the last in
 *  `last_slot` (ignored when current_len is a multiple of page_size), written to slots[0..count).
 *  KVATTN_ERROR_OUT_OF_RESOURCES (nothing allocated) when too few pages are free. */
kvattn_status kvattn_slot_allocator_allocate_tokens(kvattn_slot_allocator* allocator,
                                                    int64_t current_len, int32_t last_slot,
                                                    int64_t count, int32_t* slots);
/** Frees the pages that hold these slots of one request. */
kvattn_status kvattn_slot_allocator_free_slots(kvattn_slot_allocator* allocator,
                                               const int32_t* slots, int64_t count);
int64_t kvattn_slot_allocator_free_slot_count(const kvattn_slot_allocator* allocator);

/* ---- one attention layer and one step's batch ------------------------------------------------ */

typedef struct kvattn_layer {
  int32_t layer_id;
  int32_t num_q_heads; /**< a multiple of num_kv_heads */
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t v_head_dim;          /**< 0 = head_dim */
  float scaling;               /**< softmax scale, usually 1/sqrt(head_dim); > 0 */
  float logit_cap;             /**< soft-cap when > 0; default 0 = off */
  int32_t sliding_window_size; /**< default -1 = full attention */
  int32_t is_cross_attention;  /**< 0/1 */
  float k_scale;               /**< fp8 scales; <= 0 (default) = the KV cache's */
  float v_scale;
  /** Attention sinks: [num_q_heads] fp32/bf16/fp16 on the backend's device, one logit per q
   *  head with a zero value (kvattn::AttentionLayer::sinks); zeroed (default) = none. */
  kvattn_tensor sinks;
} kvattn_layer;

void kvattn_layer_init(kvattn_layer* layer);

typedef enum kvattn_forward_mode {
  KVATTN_MODE_IDLE = 0,
  KVATTN_MODE_DECODE = 1,
  KVATTN_MODE_EXTEND = 2,
  KVATTN_MODE_MIXED = 3,
  KVATTN_MODE_TARGET_VERIFY = 4,
  KVATTN_MODE_DRAFT_EXTEND = 5
} kvattn_forward_mode;

/** One step (kvattn::ForwardBatch, field for field). Index tensors: 1-D int32 or int64 on the
 *  backend's device; *_cpu: host copies that a CUDA backend plans from. Absent tensors are
 *  zero-filled structs (kvattn_forward_batch_init does that). */
typedef struct kvattn_forward_batch {
  int32_t mode; /**< kvattn_forward_mode */
  int32_t batch_size;
  kvattn_tensor req_pool_indices; /**< [batch_size] rows of req_to_token */
  kvattn_tensor seq_lens;         /**< [batch_size] tokens of each request after this step */
  kvattn_tensor seq_lens_cpu;
  int64_t seq_lens_sum;             /**< -1 (default) = compute it */
  kvattn_tensor extend_prefix_lens; /**< [batch_size] EXTEND / MIXED / DRAFT_EXTEND */
  kvattn_tensor extend_prefix_lens_cpu;
  kvattn_tensor extend_seq_lens; /**< [batch_size] new tokens */
  kvattn_tensor extend_seq_lens_cpu;
  kvattn_tensor out_cache_loc; /**< [num_tokens] slots for this step's new K/V */
  kvattn_tensor encoder_lens;  /**< [batch_size] cross-attention models only */
  kvattn_tensor encoder_lens_cpu;
  kvattn_tensor encoder_out_cache_loc;
  kvattn_tensor positions;   /**< [num_tokens] (TARGET_VERIFY with a window) */
  int32_t draft_token_num;   /**< TARGET_VERIFY */
  kvattn_tensor custom_mask; /**< TARGET_VERIFY: uint8, see kvattn/forward_batch.h */
  kvattn_req_to_token_pool* req_to_token_pool;
  kvattn_kv_cache* kv_cache;
  /** Shared-prefix (cascade) groups the engine declares, DECODE / TARGET_VERIFY (version 3;
   *  kvattn::ForwardBatch::shared_prefix_group_cpu / shared_prefix_lens_cpu): host int32/int64
   *  tensors, [batch_size] the group of each request (-1 = none) and [num_groups] how many
   *  leading req_to_token positions a group's members share; zeroed (default) = none. */
  kvattn_tensor shared_prefix_group_cpu;
  kvattn_tensor shared_prefix_lens_cpu;
} kvattn_forward_batch;

void kvattn_forward_batch_init(kvattn_forward_batch* batch);

/* ---- the backend ------------------------------------------------------------------------------
 */

typedef struct kvattn_backend kvattn_backend;

typedef enum kvattn_backend_kind {
  KVATTN_BACKEND_CPU = 0,
  KVATTN_BACKEND_CUDA = 1
} kvattn_backend_kind;

typedef struct kvattn_backend_config {
  kvattn_kv_cache* kv_cache;                   /**< required; outlives the backend */
  kvattn_req_to_token_pool* req_to_token_pool; /**< required; outlives the backend */
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t v_head_dim;              /**< 0 = head_dim */
  int32_t q_dtype;                 /**< q / k / v / out dtype: fp32, bf16 (default), fp16 */
  int32_t sliding_window_size;     /**< the model's window, -1 (default) = none */
  int32_t is_encoder_decoder;      /**< 0/1 */
  int64_t ragged_extend_threshold; /**< default 4096 new tokens (and more new than prefix);
                                        a step without cached prefix: ragged at any size */
  int32_t decode_tensor_cores;     /**< 0 auto (default), 1 on, 2 off */
  int32_t num_threads;             /**< CPU backend: 0 = KVATTN_NUM_THREADS or all cores */
  void* cuda_stream;               /**< CUDA backend: the caller's cudaStream_t (NULL = default) */
  int32_t deterministic;           /**< 0/1: batch-invariant outputs (BackendConfig) */
} kvattn_backend_config;

void kvattn_backend_config_init(kvattn_backend_config* config);
kvattn_status kvattn_backend_create(kvattn_backend_kind kind, const kvattn_backend_config* config,
                                    kvattn_backend** out);
void kvattn_backend_destroy(kvattn_backend* backend);

/** Once per step: index arrays and the work plan (= out_graph + in_graph). */
kvattn_status kvattn_backend_init_forward_metadata(kvattn_backend* backend,
                                                   const kvattn_forward_batch* batch);
/** The host half (dynamic shapes, outside CUDA-graph capture) and the device half. */
kvattn_status kvattn_backend_init_forward_metadata_out_graph(kvattn_backend* backend,
                                                             const kvattn_forward_batch* batch,
                                                             int in_capture);
kvattn_status kvattn_backend_init_forward_metadata_in_graph(kvattn_backend* backend,
                                                            const kvattn_forward_batch* batch);
/** Once per layer: saves k/v at batch->out_cache_loc (when save_kv_cache != 0), then attends.
 *  q [num_tokens, num_q_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim / v_head_dim]
 *  (absent when save_kv_cache == 0), out [num_tokens, num_q_heads, v_head_dim] (or the heads
 *  flattened); one dtype (the config's q_dtype). */
kvattn_status kvattn_backend_forward(kvattn_backend* backend, const kvattn_tensor* q,
                                     const kvattn_tensor* k, const kvattn_tensor* v,
                                     const kvattn_tensor* out, const kvattn_layer* layer,
                                     const kvattn_forward_batch* batch, int save_kv_cache);
/** Steps the device refused after their calls returned (bad indices only the GPU saw): the
 *  oldest is returned as the error (kvattn_last_error_step() names it, the message lists the
 *  others); KVATTN_OK when none. synchronize != 0 waits for the backend's stream first. */
kvattn_status kvattn_backend_check_errors(kvattn_backend* backend, int synchronize);
/** The step number the latest init_forward_metadata began (1, 2, ...; 0 before any). */
uint64_t kvattn_backend_step_id(const kvattn_backend* backend);
/** CUDA backend: the caller's cudaStream_t for later calls (between steps). */
kvattn_status kvattn_backend_set_cuda_stream(kvattn_backend* backend, void* stream);
/** CUDA graphs: fixed buffers for batches of up to max_bs requests / max_num_tokens tokens. */
kvattn_status kvattn_backend_init_cuda_graph_state(kvattn_backend* backend, int max_bs,
                                                   int64_t max_num_tokens);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVATTN_C_API_H */
