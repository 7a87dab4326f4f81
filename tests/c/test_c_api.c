/* The C ABI from C (include/kvattn/c_api.h), compiled as C11 and linked against the library as a
 * C engine would: pools and a CPU backend made through handles, an EXTEND step and a DECODE step
 * over two layers checked against a direct attention written here, then the error contract
 * (status codes, this thread's last-error message and argument, nothing written on a refused
 * step, NULL handles). Prints one line per check and "N passed, M failed"; exit 1 on a failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvattn/c_api.h"

enum { kLayers = 2, kQHeads = 4, kKvHeads = 2, kHeadDim = 64, kSlots = 256, kPageSize = 4 };
enum { kReqs = 2, kMaxContext = 64 };

static int passed = 0;
static int failed = 0;

static void check(int ok, const char* what) {
  if (ok) {
    ++passed;
    printf("ok    %s\n", what);
  } else {
    ++failed;
    printf("FAIL  %s (last error: %s)\n", what, kvattn_last_error_message());
  }
}

/* bf16 bits of x (round to nearest even) and back: the KV pool stores bf16. */
static unsigned short to_bf16(float x) {
  unsigned int bits;
  memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (unsigned short)(bits >> 16);
}
static float from_bf16(unsigned short b) {
  unsigned int bits = (unsigned int)b << 16;
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

static unsigned int rng_state = 12345u;
static float next_uniform(void) { /* [-1, 1) */
  rng_state = rng_state * 1664525u + 1013904223u;
  return (float)((rng_state >> 8) & 0xffffffu) / 8388608.0f - 1.0f;
}

/* The model's K/V as the pool holds them, per layer, per request, per position (float copies of
 * the bf16 values), so the direct attention below sees what the backend sees. */
static float kv_k[kLayers][kReqs][kMaxContext][kKvHeads][kHeadDim];
static float kv_v[kLayers][kReqs][kMaxContext][kKvHeads][kHeadDim];

/* out[t] for token t of request r at absolute position pos: causal over positions [0, pos]. */
/* g_sink: when finite, every q head's attention sink for run_step (the layer's sinks tensor and
 * the direct formula's extra e^(sink) in the denominator). */
static float g_sink = NAN;
static float g_sinks[kQHeads];

static void direct_attention(int layer, int r, int pos, const float* q /* [kQHeads][kHeadDim] */,
                             float* out /* [kQHeads][kHeadDim] */) {
  const float scale = 1.0f / sqrtf((float)kHeadDim);
  for (int h = 0; h < kQHeads; ++h) {
    const int kvh = h / (kQHeads / kKvHeads);
    double m = -INFINITY, sum = 0, acc[kHeadDim] = {0};
    double logits[kMaxContext];
    for (int j = 0; j <= pos; ++j) {
      double dot = 0;
      for (int d = 0; d < kHeadDim; ++d)
        dot += (double)q[h * kHeadDim + d] * kv_k[layer][r][j][kvh][d];
      logits[j] = dot * scale;
      if (logits[j] > m) m = logits[j];
    }
    if (g_sink == g_sink && g_sink > m) m = g_sink;
    if (g_sink == g_sink) sum = exp(g_sink - m);
    for (int j = 0; j <= pos; ++j) {
      const double p = exp(logits[j] - m);
      sum += p;
      for (int d = 0; d < kHeadDim; ++d) acc[d] += p * kv_v[layer][r][j][kvh][d];
    }
    for (int d = 0; d < kHeadDim; ++d) out[h * kHeadDim + d] = (float)(acc[d] / sum);
  }
}

static kvattn_tensor host_i32(int32_t* data, int64_t n) {
  const kvattn_device cpu = {KVATTN_DEVICE_CPU, 0};
  return kvattn_tensor_make(data, KVATTN_DTYPE_INT32, cpu, 1, &n);
}

struct World {
  kvattn_kv_cache* cache;
  kvattn_req_to_token_pool* pool;
  kvattn_slot_allocator* allocator;
  kvattn_backend* backend;
  int32_t seq_len[kReqs];
  int32_t last_slot[kReqs];
};

/* One step: request r gets new_tokens[r] tokens (EXTEND) or one (DECODE); random q/k/v per layer;
 * every layer's output compared with the direct attention. Returns the largest abs difference,
 * or -1 when a call failed. */
static double run_step(struct World* w, int mode, const int32_t* new_tokens) {
  const kvattn_device cpu = {KVATTN_DEVICE_CPU, 0};
  int32_t rows[kReqs], seq_lens[kReqs], prefix_lens[kReqs], extend_lens[kReqs];
  int32_t slots[kReqs * kMaxContext];
  int64_t num_tokens = 0;
  for (int r = 0; r < kReqs; ++r) {
    rows[r] = r;
    prefix_lens[r] = w->seq_len[r];
    extend_lens[r] = new_tokens[r];
    seq_lens[r] = w->seq_len[r] + new_tokens[r];
    if (kvattn_slot_allocator_allocate_tokens(w->allocator, w->seq_len[r], w->last_slot[r],
                                              new_tokens[r], slots + num_tokens) != KVATTN_OK ||
        kvattn_req_to_token_pool_write(w->pool, r, w->seq_len[r], slots + num_tokens,
                                       new_tokens[r]) != KVATTN_OK) {
      return -1;
    }
    w->last_slot[r] = slots[num_tokens + new_tokens[r] - 1];
    num_tokens += new_tokens[r];
  }

  kvattn_forward_batch batch;
  kvattn_forward_batch_init(&batch);
  batch.mode = mode;
  batch.batch_size = kReqs;
  batch.req_pool_indices = host_i32(rows, kReqs);
  batch.seq_lens = batch.seq_lens_cpu = host_i32(seq_lens, kReqs);
  if (mode == KVATTN_MODE_EXTEND) {
    batch.extend_prefix_lens = batch.extend_prefix_lens_cpu = host_i32(prefix_lens, kReqs);
    batch.extend_seq_lens = batch.extend_seq_lens_cpu = host_i32(extend_lens, kReqs);
  }
  batch.out_cache_loc = host_i32(slots, num_tokens);
  batch.req_to_token_pool = w->pool;
  batch.kv_cache = w->cache;
  if (kvattn_backend_init_forward_metadata(w->backend, &batch) != KVATTN_OK) return -1;

  float* q = malloc(sizeof(float) * num_tokens * kQHeads * kHeadDim);
  float* k = malloc(sizeof(float) * num_tokens * kKvHeads * kHeadDim);
  float* v = malloc(sizeof(float) * num_tokens * kKvHeads * kHeadDim);
  float* out = malloc(sizeof(float) * num_tokens * kQHeads * kHeadDim);
  float expected[kQHeads * kHeadDim];
  double max_diff = 0;
  for (int layer = 0; layer < kLayers && max_diff >= 0; ++layer) {
    int64_t t = 0;
    for (int r = 0; r < kReqs; ++r) {
      for (int i = 0; i < new_tokens[r]; ++i, ++t) {
        const int pos = w->seq_len[r] + i;
        for (int e = 0; e < kQHeads * kHeadDim; ++e) q[t * kQHeads * kHeadDim + e] = next_uniform();
        for (int h = 0; h < kKvHeads; ++h) {
          for (int d = 0; d < kHeadDim; ++d) {
            const int64_t at = (t * kKvHeads + h) * kHeadDim + d;
            k[at] = next_uniform() * 2.0f;
            v[at] = next_uniform();
            kv_k[layer][r][pos][h][d] = from_bf16(to_bf16(k[at]));
            kv_v[layer][r][pos][h][d] = from_bf16(to_bf16(v[at]));
          }
        }
      }
    }
    const int64_t q_shape[3] = {num_tokens, kQHeads, kHeadDim};
    const int64_t kv_shape[3] = {num_tokens, kKvHeads, kHeadDim};
    kvattn_tensor tq = kvattn_tensor_make(q, KVATTN_DTYPE_FLOAT32, cpu, 3, q_shape);
    kvattn_tensor tk = kvattn_tensor_make(k, KVATTN_DTYPE_FLOAT32, cpu, 3, kv_shape);
    kvattn_tensor tv = kvattn_tensor_make(v, KVATTN_DTYPE_FLOAT32, cpu, 3, kv_shape);
    kvattn_tensor to = kvattn_tensor_make(out, KVATTN_DTYPE_FLOAT32, cpu, 3, q_shape);
    kvattn_layer l;
    kvattn_layer_init(&l);
    l.layer_id = layer;
    l.num_q_heads = kQHeads;
    l.num_kv_heads = kKvHeads;
    l.head_dim = kHeadDim;
    l.scaling = 1.0f / sqrtf((float)kHeadDim);
    if (g_sink == g_sink) {
      const int64_t heads = kQHeads;
      for (int h = 0; h < kQHeads; ++h) g_sinks[h] = g_sink;
      l.sinks = kvattn_tensor_make(g_sinks, KVATTN_DTYPE_FLOAT32, cpu, 1, &heads);
    }
    if (kvattn_backend_forward(w->backend, &tq, &tk, &tv, &to, &l, &batch, 1) != KVATTN_OK) {
      max_diff = -1;
      break;
    }
    t = 0;
    for (int r = 0; r < kReqs; ++r) {
      for (int i = 0; i < new_tokens[r]; ++i, ++t) {
        direct_attention(layer, r, w->seq_len[r] + i, q + t * kQHeads * kHeadDim, expected);
        for (int e = 0; e < kQHeads * kHeadDim; ++e) {
          const double diff = fabs((double)out[t * kQHeads * kHeadDim + e] - expected[e]);
          if (diff > max_diff || diff != diff) max_diff = diff != diff ? 1e30 : diff;
        }
      }
    }
  }
  free(q);
  free(k);
  free(v);
  free(out);
  for (int r = 0; r < kReqs; ++r) w->seq_len[r] += new_tokens[r];
  return max_diff;
}

int main(void) {
  const kvattn_device cpu = {KVATTN_DEVICE_CPU, 0};
  struct World w;
  memset(&w, 0, sizeof(w));
  char line[160];

  check(kvattn_c_api_version() == KVATTN_C_API_VERSION,
        "the library's ABI version is the header's");

  kvattn_kv_cache_config cache_config;
  kvattn_kv_cache_config_init(&cache_config);
  cache_config.num_layers = kLayers;
  cache_config.num_slots = kSlots;
  cache_config.num_kv_heads = kKvHeads;
  cache_config.head_dim = kHeadDim;
  cache_config.page_size = kPageSize;
  cache_config.dtype = KVATTN_DTYPE_BFLOAT16;
  check(kvattn_kv_cache_create(&cache_config, &w.cache) == KVATTN_OK && w.cache != NULL,
        "kv cache created (2 layers, 256 slots, bf16, page 4)");
  check(kvattn_req_to_token_pool_create(kReqs, kMaxContext, cpu, &w.pool) == KVATTN_OK,
        "req_to_token pool created");
  check(kvattn_slot_allocator_create(kSlots, kPageSize, &w.allocator) == KVATTN_OK,
        "slot allocator created");

  kvattn_backend_config config;
  kvattn_backend_config_init(&config);
  config.kv_cache = w.cache;
  config.req_to_token_pool = w.pool;
  config.num_q_heads = kQHeads;
  config.num_kv_heads = kKvHeads;
  config.head_dim = kHeadDim;
  config.q_dtype = KVATTN_DTYPE_FLOAT32;
  config.num_threads = 2;
  check(kvattn_backend_create(KVATTN_BACKEND_CPU, &config, &w.backend) == KVATTN_OK,
        "CPU backend created");
  if (failed > 0) {
    printf("%d passed, %d failed\n", passed, failed);
    return 1;
  }

  const int32_t prompts[kReqs] = {5, 11};
  double diff = run_step(&w, KVATTN_MODE_EXTEND, prompts);
  snprintf(line, sizeof(line), "EXTEND (prompts of 5 and 11 tokens, 2 layers): max |diff| %.2e",
           diff);
  check(diff >= 0 && diff < 2e-3, line);
  check(kvattn_backend_step_id(w.backend) == 1, "step_id is 1 after the first step");

  const int32_t one[kReqs] = {1, 1};
  for (int step = 0; step < 3; ++step) {
    diff = run_step(&w, KVATTN_MODE_DECODE, one);
    snprintf(line, sizeof(line), "DECODE step %d (seq lens %d, %d): max |diff| %.2e", step + 1,
             w.seq_len[0], w.seq_len[1], diff);
    check(diff >= 0 && diff < 2e-3, line);
  }
  check(kvattn_backend_check_errors(w.backend, 1) == KVATTN_OK, "check_errors: no refused step");

  /* Attention sinks through the layer struct: the direct formula with e^(sink) added. */
  g_sink = 2.5f;
  diff = run_step(&w, KVATTN_MODE_DECODE, one);
  snprintf(line, sizeof(line), "DECODE with attention sinks (2.5 a head): max |diff| %.2e", diff);
  check(diff >= 0 && diff < 2e-3, line);
  g_sink = NAN;

  /* Shared-prefix groups (version 3): declared through the batch struct; a group whose members
   * do not hold the same first slot refuses the step, naming the group's shared length. */
  {
    int32_t group_rows[kReqs] = {0, 1}, group_seq[kReqs] = {w.seq_len[0], w.seq_len[1]};
    int32_t both[kReqs] = {0, 0}, alone[kReqs] = {0, -1}, shared_len[1] = {1};
    kvattn_forward_batch grouped;
    kvattn_forward_batch_init(&grouped);
    grouped.mode = KVATTN_MODE_DECODE;
    grouped.batch_size = kReqs;
    grouped.req_pool_indices = host_i32(group_rows, kReqs);
    grouped.seq_lens = grouped.seq_lens_cpu = host_i32(group_seq, kReqs);
    grouped.req_to_token_pool = w.pool;
    grouped.kv_cache = w.cache;
    grouped.shared_prefix_group_cpu = host_i32(both, kReqs);
    grouped.shared_prefix_lens_cpu = host_i32(shared_len, 1);
    check(kvattn_backend_init_forward_metadata(w.backend, &grouped) ==
                  KVATTN_ERROR_INVALID_ARGUMENT &&
              strcmp(kvattn_last_error_argument(), "shared_prefix_lens_cpu[0]") == 0,
          "a declared group whose members hold other slots is refused (shared_prefix_lens_cpu[0])");
    printf("      message: %s\n", kvattn_last_error_message());
    grouped.shared_prefix_group_cpu = host_i32(alone, kReqs);
    check(kvattn_backend_init_forward_metadata(w.backend, &grouped) ==
                  KVATTN_ERROR_INVALID_ARGUMENT &&
              strstr(kvattn_last_error_message(), "expected >= 2") != NULL,
          "a declared group of one member is refused");
  }

  /* ---- the error contract ---- */
  kvattn_backend* bad = (kvattn_backend*)&w; /* overwritten with NULL on failure */
  config.num_q_heads = 3;                    /* not a multiple of num_kv_heads */
  kvattn_status status = kvattn_backend_create(KVATTN_BACKEND_CPU, &config, &bad);
  check(status == KVATTN_ERROR_INVALID_ARGUMENT && bad == NULL,
        "a bad config is refused with KVATTN_ERROR_INVALID_ARGUMENT and a NULL handle");
  check(strstr(kvattn_last_error_message(), "num_q_heads") != NULL,
        "the message names num_q_heads");
  printf("      message: %s\n", kvattn_last_error_message());
  config.num_q_heads = kQHeads;

  /* A DECODE step whose new slot lies past the pool: refused, nothing written. */
  kvattn_tensor k0;
  check(kvattn_kv_cache_k_buffer(w.cache, 0, &k0) == KVATTN_OK && k0.ndim == 3 &&
            k0.shape[0] == kSlots && k0.dtype == KVATTN_DTYPE_BFLOAT16,
        "k_buffer(0) is a [256, 2, 64] bf16 view");
  const size_t pool_bytes = (size_t)kSlots * kKvHeads * kHeadDim * 2;
  unsigned char* before = malloc(pool_bytes);
  memcpy(before, k0.data, pool_bytes);
  int32_t rows[kReqs] = {0, 1}, seq_lens[kReqs] = {w.seq_len[0] + 1, w.seq_len[1] + 1};
  int32_t bad_slots[kReqs] = {kSlots + 7, 3};
  kvattn_forward_batch batch;
  kvattn_forward_batch_init(&batch);
  batch.mode = KVATTN_MODE_DECODE;
  batch.batch_size = kReqs;
  batch.req_pool_indices = host_i32(rows, kReqs);
  batch.seq_lens = batch.seq_lens_cpu = host_i32(seq_lens, kReqs);
  batch.out_cache_loc = host_i32(bad_slots, kReqs);
  batch.req_to_token_pool = w.pool;
  batch.kv_cache = w.cache;
  status = kvattn_backend_init_forward_metadata(w.backend, &batch);
  check(status == KVATTN_ERROR_INVALID_ARGUMENT, "a slot past the pool refuses the step");
  check(strcmp(kvattn_last_error_argument(), "out_cache_loc[0]") == 0,
        "the error's argument is out_cache_loc[0]");
  printf("      message: %s\n", kvattn_last_error_message());
  check(kvattn_last_error_step() == -1, "a call's own error has step -1");
  check(memcmp(before, k0.data, pool_bytes) == 0, "the KV pool is byte for byte as before");
  free(before);

  kvattn_tensor absent;
  memset(&absent, 0, sizeof(absent));
  status = kvattn_backend_forward(NULL, &absent, &absent, &absent, &absent, NULL, &batch, 1);
  check(status == KVATTN_ERROR_INVALID_ARGUMENT &&
            strstr(kvattn_last_error_message(), "backend") != NULL,
        "a NULL backend handle is an invalid argument, not a crash");
  status = kvattn_req_to_token_pool_write(w.pool, kReqs + 5, 0, bad_slots, 1);
  check(status == KVATTN_ERROR_INVALID_ARGUMENT, "writing a row past the pool is refused");

  kvattn_tensor bad_dtype = host_i32(rows, kReqs);
  bad_dtype.dtype = 42;
  batch.req_pool_indices = bad_dtype;
  status = kvattn_backend_init_forward_metadata(w.backend, &batch);
  check(status == KVATTN_ERROR_INVALID_ARGUMENT &&
            strcmp(kvattn_last_error_argument(), "batch.req_pool_indices") == 0,
        "an unknown dtype code is refused and named");

  int32_t many[kSlots];
  status = kvattn_slot_allocator_allocate_tokens(w.allocator, 0, 0, kSlots * 2, many);
  check(status == KVATTN_ERROR_OUT_OF_RESOURCES,
        "asking the allocator for too many slots: "
        "KVATTN_ERROR_OUT_OF_RESOURCES");

  if (kvattn_cuda_device_count() == 0) {
    kvattn_backend* cuda = NULL;
    status = kvattn_backend_create(KVATTN_BACKEND_CUDA, &config, &cuda);
    check(
        status == KVATTN_ERROR_NOT_SUPPORTED && cuda == NULL,
        "a CUDA backend without a GPU (or without CUDA in the build): KVATTN_ERROR_NOT_SUPPORTED");
  }
  check(strcmp(kvattn_status_name(KVATTN_ERROR_DEVICE), "device error") == 0, "status names");

  /* The backend still serves a good step after the refusals. */
  diff = run_step(&w, KVATTN_MODE_DECODE, one);
  snprintf(line, sizeof(line), "a good DECODE step after the refused ones: max |diff| %.2e", diff);
  check(diff >= 0 && diff < 2e-3, line);

  kvattn_backend_destroy(w.backend);
  kvattn_slot_allocator_destroy(w.allocator);
  kvattn_req_to_token_pool_destroy(w.pool);
  kvattn_kv_cache_destroy(w.cache);
  kvattn_backend_destroy(NULL); /* no-ops */
  kvattn_kv_cache_destroy(NULL);

  printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
