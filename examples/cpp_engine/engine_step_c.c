/* One EXTEND step and one DECODE step through kvattn's C ABI (kvattn/c_api.h), built as C11
 * against the installed package: what a Rust, Go or C engine does over its FFI.
 *
 * The check needs no reference: every key of the request is the same vector, so the softmax is
 * uniform and each head's output is the mean of the values it sees (as the bf16 pool holds
 * them). Exit code 1 on a mismatch or a failed call. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvattn/c_api.h"

enum { kHeads = 4, kKvHeads = 1, kDim = 64, kSlots = 128, kPage = 8, kPrompt = 13 };

static float bf16_round(float x) {
  unsigned int bits;
  memcpy(&bits, &x, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  memcpy(&x, &bits, 4);
  return x;
}

#define CALL(expr)                                                        \
  do {                                                                    \
    kvattn_status status_ = (expr);                                       \
    if (status_ != KVATTN_OK) {                                           \
      fprintf(stderr, "%s: %s: %s\n", #expr, kvattn_status_name(status_), \
              kvattn_last_error_message());                               \
      return 1;                                                           \
    }                                                                     \
  } while (0)

/* q/k/v of `tokens` new tokens at positions first.., the step's forward, and the check. */
static int step(kvattn_backend* backend, const kvattn_forward_batch* batch, int first, int tokens,
                double* worst) {
  static float q[kPrompt][kHeads][kDim], k[kPrompt][kKvHeads][kDim], v[kPrompt][kKvHeads][kDim];
  static float out[kPrompt][kHeads][kDim];
  static double value_sum[kDim]; /* the bf16 values of every position so far */
  const kvattn_device cpu = {KVATTN_DEVICE_CPU, 0};
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < kHeads; ++h)
      for (int d = 0; d < kDim; ++d) q[t][h][d] = (float)((h + 1) * (d % 7)) / 16.0f;
    for (int d = 0; d < kDim; ++d) {
      k[t][0][d] = 0.25f; /* the same key everywhere */
      v[t][0][d] = sinf(0.37f * (float)(first + t) + 0.11f * (float)d); /* a new value each */
    }
  }
  const int64_t q_shape[3] = {tokens, kHeads, kDim}, kv_shape[3] = {tokens, kKvHeads, kDim};
  kvattn_tensor tq = kvattn_tensor_make(q, KVATTN_DTYPE_FLOAT32, cpu, 3, q_shape);
  kvattn_tensor tk = kvattn_tensor_make(k, KVATTN_DTYPE_FLOAT32, cpu, 3, kv_shape);
  kvattn_tensor tv = kvattn_tensor_make(v, KVATTN_DTYPE_FLOAT32, cpu, 3, kv_shape);
  kvattn_tensor to = kvattn_tensor_make(out, KVATTN_DTYPE_FLOAT32, cpu, 3, q_shape);
  kvattn_layer layer;
  kvattn_layer_init(&layer);
  layer.num_q_heads = kHeads;
  layer.num_kv_heads = kKvHeads;
  layer.head_dim = kDim;
  layer.scaling = 0.125f;
  CALL(kvattn_backend_init_forward_metadata(backend, batch));
  CALL(kvattn_backend_forward(backend, &tq, &tk, &tv, &to, &layer, batch, 1));
  CALL(kvattn_backend_check_errors(backend, 1));
  /* Token t (position first + t) sees positions [0, first + t]: the mean of their values. */
  for (int t = 0; t < tokens; ++t) {
    for (int d = 0; d < kDim; ++d) value_sum[d] += bf16_round(v[t][0][d]);
    for (int h = 0; h < kHeads; ++h) {
      for (int d = 0; d < kDim; ++d) {
        const double diff = fabs(out[t][h][d] - value_sum[d] / (first + t + 1));
        if (!(diff <= *worst)) *worst = diff; /* NaN-safe */
      }
    }
  }
  return 0;
}

int main(void) {
  const kvattn_device cpu = {KVATTN_DEVICE_CPU, 0};
  kvattn_kv_cache* cache = NULL;
  kvattn_req_to_token_pool* pool = NULL;
  kvattn_slot_allocator* allocator = NULL;
  kvattn_backend* backend = NULL;

  kvattn_kv_cache_config cache_config;
  kvattn_kv_cache_config_init(&cache_config);
  cache_config.num_slots = kSlots;
  cache_config.num_kv_heads = kKvHeads;
  cache_config.head_dim = kDim;
  cache_config.page_size = kPage;
  CALL(kvattn_kv_cache_create(&cache_config, &cache));
  CALL(kvattn_req_to_token_pool_create(4, 64, cpu, &pool));
  CALL(kvattn_slot_allocator_create(kSlots, kPage, &allocator));
  kvattn_backend_config config;
  kvattn_backend_config_init(&config);
  config.kv_cache = cache;
  config.req_to_token_pool = pool;
  config.num_q_heads = kHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kDim;
  config.q_dtype = KVATTN_DTYPE_FLOAT32;
  CALL(kvattn_backend_create(KVATTN_BACKEND_CPU, &config, &backend));

  /* EXTEND: request row 0 prefills kPrompt tokens. */
  int32_t slots[kPrompt + 1], row = 0, seq_len = kPrompt, prefix = 0, extend = kPrompt;
  CALL(kvattn_slot_allocator_allocate_tokens(allocator, 0, 0, kPrompt, slots));
  CALL(kvattn_req_to_token_pool_write(pool, row, 0, slots, kPrompt));
  int64_t one = 1, prompt = kPrompt;
  kvattn_forward_batch batch;
  kvattn_forward_batch_init(&batch);
  batch.mode = KVATTN_MODE_EXTEND;
  batch.batch_size = 1;
  batch.req_pool_indices = kvattn_tensor_make(&row, KVATTN_DTYPE_INT32, cpu, 1, &one);
  batch.seq_lens = batch.seq_lens_cpu =
      kvattn_tensor_make(&seq_len, KVATTN_DTYPE_INT32, cpu, 1, &one);
  batch.extend_prefix_lens = batch.extend_prefix_lens_cpu =
      kvattn_tensor_make(&prefix, KVATTN_DTYPE_INT32, cpu, 1, &one);
  batch.extend_seq_lens = batch.extend_seq_lens_cpu =
      kvattn_tensor_make(&extend, KVATTN_DTYPE_INT32, cpu, 1, &one);
  batch.out_cache_loc = kvattn_tensor_make(slots, KVATTN_DTYPE_INT32, cpu, 1, &prompt);
  batch.req_to_token_pool = pool;
  batch.kv_cache = cache;
  double extend_worst = 0, decode_worst = 0;
  if (step(backend, &batch, 0, kPrompt, &extend_worst) != 0) return 1;

  /* DECODE: one more token for the same request. */
  CALL(kvattn_slot_allocator_allocate_tokens(allocator, kPrompt, slots[kPrompt - 1], 1,
                                             &slots[kPrompt]));
  CALL(kvattn_req_to_token_pool_write(pool, row, kPrompt, &slots[kPrompt], 1));
  seq_len = kPrompt + 1;
  kvattn_forward_batch decode = batch;
  decode.mode = KVATTN_MODE_DECODE;
  memset(&decode.extend_prefix_lens, 0, sizeof(kvattn_tensor));
  memset(&decode.extend_prefix_lens_cpu, 0, sizeof(kvattn_tensor));
  memset(&decode.extend_seq_lens, 0, sizeof(kvattn_tensor));
  memset(&decode.extend_seq_lens_cpu, 0, sizeof(kvattn_tensor));
  decode.out_cache_loc = kvattn_tensor_make(&slots[kPrompt], KVATTN_DTYPE_INT32, cpu, 1, &one);
  if (step(backend, &decode, kPrompt, 1, &decode_worst) != 0) return 1;

  kvattn_backend_destroy(backend);
  kvattn_slot_allocator_destroy(allocator);
  kvattn_req_to_token_pool_destroy(pool);
  kvattn_kv_cache_destroy(cache);

  const int ok = extend_worst < 1e-5 && decode_worst < 1e-5;
  printf("%s: C ABI v%d, EXTEND of %d tokens max |out - mean(v)| %.2e, DECODE %.2e\n",
         ok ? "OK" : "FAILED", kvattn_c_api_version(), kPrompt, extend_worst, decode_worst);
  return ok ? 0 : 1;
}
