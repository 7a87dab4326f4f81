#include "core/validate.h"

#include <cmath>
#include <string>

#include "core/batch_layout.h"
#include "kvattn/error.h"

namespace kvattn::core {
namespace {

// Per-element names are built only when a check fails: the loops run at every step, and
// building "seq_lens[123]" for each element cost more than the whole decode plan at batch 256.
std::string at(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

bool is_io_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kBFloat16 || d == DType::kFloat16;
}

// q / out: [tokens, heads, dim] or [tokens, heads * dim], last dimension contiguous.
void check_head_tensor(const TensorView& t, const char* name, int64_t tokens, int heads, int dim,
                       DType dtype, Device device) {
  check_arg(t.data() != nullptr || tokens == 0, name, "is null");
  check_arg(t.device() == device, name, "on ", t.device(), ", expected ", device);
  check_arg(t.dtype() == dtype, name, "dtype ", dtype_name(t.dtype()), ", expected ",
            dtype_name(dtype));
  const bool shape_ok = (t.ndim() == 3 && t.size(0) == tokens && t.size(1) == heads &&
                         t.size(2) == dim) ||
                        (t.ndim() == 2 && t.size(0) == tokens && t.size(1) == int64_t(heads) * dim);
  check_arg(shape_ok, name, "shape ", t, ", expected [", tokens, ", ", heads, ", ",
            dim, "] or [", tokens, ", ", int64_t(heads) * dim, "]");
  check_arg(t.stride(-1) == 1 || t.size(-1) <= 1, name, "last dimension must be contiguous, got stride ",
            t.stride(-1));
  if (t.ndim() == 3) {
    check_arg(t.stride(1) >= dim, name, "head stride ", t.stride(1), " overlaps rows of ", dim);
  }
}

void check_slots_on_host(const TensorView& loc, const char* name, int64_t num_slots) {
  if (!loc.device().is_cpu()) return;  // device kernels skip and report out-of-range slots
  for (int64_t i = 0; i < loc.size(0); ++i) {
    const int64_t slot = read_index(loc, i);
    if (slot < 0 || slot >= num_slots) {
      throw_error(ErrorKind::kInvalidArgument, at(name, i), "slot ", slot,
                  " outside the KV pool [0, ", num_slots, ")");
    }
  }
}

}  // namespace

void check_index_tensor(const TensorView& t, const char* name, int64_t length, Device device) {
  check_arg(t.defined() && (t.data() != nullptr || length == 0), name, "missing");
  check_arg(is_index_dtype(t.dtype()), name, "dtype ", dtype_name(t.dtype()),
            ", expected int32 or int64");
  check_arg(t.ndim() == 1 && t.size(0) == length, name, "shape ", t, ", expected [",
            length, "]");
  check_arg(t.device() == device, name, "on ", t.device(), ", expected ", device);
}

void validate_backend_config(const BackendConfig& c) {
  check_arg(c.kv_cache != nullptr, "kv_cache", "is null, expected the model's KV pool");
  check_arg(c.req_to_token_pool != nullptr, "req_to_token_pool",
            "is null, expected the request-to-token pool");
  const KvCacheConfig& kv = c.kv_cache->config();
  check_arg(c.num_kv_heads >= 1, "num_kv_heads", "got ", c.num_kv_heads, ", expected >= 1");
  check_arg(c.num_q_heads >= 1 && c.num_q_heads % c.num_kv_heads == 0, "num_q_heads", "got ",
            c.num_q_heads, ", expected a positive multiple of num_kv_heads = ", c.num_kv_heads);
  check_arg(c.num_kv_heads == kv.num_kv_heads, "num_kv_heads", "got ", c.num_kv_heads,
            ", the KV cache has ", kv.num_kv_heads);
  check_arg(c.head_dim == kv.head_dim, "head_dim", "got ", c.head_dim, ", the KV cache has ",
            kv.head_dim);
  const int vd = c.v_head_dim > 0 ? c.v_head_dim : c.head_dim;
  check_arg(vd == kv.resolved_v_head_dim(), "v_head_dim", "got ", vd, ", the KV cache has ",
            kv.resolved_v_head_dim());
  check_arg(is_io_dtype(c.q_dtype), "q_dtype", "got ", dtype_name(c.q_dtype),
            ", expected fp32, bf16 or fp16");
  check_arg(c.sliding_window_size >= -1, "sliding_window_size", "got ", c.sliding_window_size,
            ", expected -1 (none) or a window >= 0");
  check_arg(!(c.sliding_window_size >= 0 && c.is_encoder_decoder), "sliding_window_size",
            "sliding window and cross-attention (is_encoder_decoder) are not supported together");
  check_arg(c.req_to_token_pool->device() == kv.device, "req_to_token_pool", "on ",
            c.req_to_token_pool->device(), ", the KV cache is on ", kv.device);
  check_arg(c.ragged_extend_threshold >= 0, "ragged_extend_threshold", "got ",
            c.ragged_extend_threshold, ", expected >= 0");
  check_arg(c.num_threads >= 0, "num_threads", "got ", c.num_threads, ", expected >= 0");
}

void validate_layer(const AttentionLayer& layer, const BackendConfig& c) {
  check_arg(layer.layer_id >= 0 && layer.layer_id < c.kv_cache->num_layers(), "layer.layer_id",
            "got ", layer.layer_id, ", expected 0..", c.kv_cache->num_layers() - 1);
  check_arg(layer.num_q_heads == c.num_q_heads, "layer.num_q_heads", "got ", layer.num_q_heads,
            ", the backend was made for ", c.num_q_heads);
  check_arg(layer.num_kv_heads == c.num_kv_heads, "layer.num_kv_heads", "got ",
            layer.num_kv_heads, ", the backend was made for ", c.num_kv_heads);
  check_arg(layer.head_dim == c.head_dim, "layer.head_dim", "got ", layer.head_dim,
            ", the backend was made for ", c.head_dim);
  const int vd = c.v_head_dim > 0 ? c.v_head_dim : c.head_dim;
  check_arg(layer.resolved_v_head_dim() == vd, "layer.v_head_dim", "got ",
            layer.resolved_v_head_dim(), ", the backend was made for ", vd);
  check_arg(layer.scaling > 0.f && std::isfinite(layer.scaling), "layer.scaling", "got ",
            layer.scaling, ", expected a finite value > 0");
  check_arg(layer.logit_cap >= 0.f && std::isfinite(layer.logit_cap), "layer.logit_cap", "got ",
            layer.logit_cap, ", expected 0 (off) or a finite cap > 0");
  check_arg(layer.sliding_window_size >= -1, "layer.sliding_window_size", "got ",
            layer.sliding_window_size, ", expected -1 (full) or a window >= 0");
  check_arg(!(layer.sliding_window_size >= 0 && layer.is_cross_attention),
            "layer.sliding_window_size",
            "sliding window and cross-attention are not supported together");
  if (layer.sliding_window_size >= 0) {
    check_arg(layer.sliding_window_size == c.sliding_window_size, "layer.sliding_window_size",
              "got ", layer.sliding_window_size, ", the backend keeps a window index set for ",
              c.sliding_window_size, " (BackendConfig.sliding_window_size)");
  }
  check_arg(!layer.is_cross_attention || c.is_encoder_decoder, "layer.is_cross_attention",
            "a cross-attention layer needs a backend made with is_encoder_decoder = true");
  check_arg(std::isfinite(layer.k_scale) && std::isfinite(layer.v_scale), "layer.k_scale",
            "scales must be finite, got ", layer.k_scale, " and ", layer.v_scale);
}

void validate_batch(const ForwardBatch& b, const BackendConfig& c, Device device) {
  (void)validate_batch_lengths(b, c, device);
}

HostLengths validate_batch_lengths(const ForwardBatch& b, const BackendConfig& c, Device device,
                                   bool device_lengths) {
  check_arg(b.batch_size >= 0, "batch_size", "got ", b.batch_size, ", expected >= 0");
  check_arg(b.kv_cache == nullptr || b.kv_cache == c.kv_cache, "kv_cache",
            "the batch names a different KV pool than the backend was made for");
  check_arg(b.req_to_token_pool == nullptr || b.req_to_token_pool == c.req_to_token_pool,
            "req_to_token_pool",
            "the batch names a different req_to_token pool than the backend was made for");
  if (b.mode == ForwardMode::kIdle) return {};
  const int bs = b.batch_size;
  check_index_tensor(b.req_pool_indices, "req_pool_indices", bs, device);
  check_index_tensor(b.seq_lens, "seq_lens", bs, device);
  if (b.seq_lens_cpu.defined()) check_index_tensor(b.seq_lens_cpu, "seq_lens_cpu", bs, Device::cpu());
  const ReqToTokenPool& pool = *c.req_to_token_pool;
  if (b.req_pool_indices.device().is_cpu()) {
    for (int r = 0; r < bs; ++r) {
      const int64_t row = read_index(b.req_pool_indices, r);
      if (row < 0 || row >= pool.max_reqs()) {
        throw_error(ErrorKind::kInvalidArgument, at("req_pool_indices", r), "got ", row,
                    ", expected a row of req_to_token in [0, ", pool.max_reqs(), ")");
      }
    }
  }
  const bool verify = b.mode == ForwardMode::kTargetVerify;
  if (device_lengths) {
    // The values are the device's to check (seq_lens range, the tree mask's length); the rest
    // here.
    if (verify) {
      check_arg(b.spec.draft_token_num >= 1 && b.spec.draft_token_num <= pool.max_context_len(),
                "spec.draft_token_num", "got ", b.spec.draft_token_num,
                ", expected 1..max_context_len for TARGET_VERIFY");
      const TensorView& m = b.spec.custom_mask;
      check_arg(m.defined(), "spec.custom_mask", "missing: TARGET_VERIFY needs the tree mask");
      check_arg(m.dtype() == DType::kUInt8, "spec.custom_mask", "dtype ", dtype_name(m.dtype()),
                ", expected uint8 (0/1)");
      check_arg(m.ndim() == 1, "spec.custom_mask", "shape ", m,
                ", expected 1-D: the rows of every request, request after request");
      check_arg(m.device() == device, "spec.custom_mask", "on ", m.device(), ", expected ", device);
    }
    if (is_extend_like(b.mode)) {
      // The step's rows are out_cache_loc's; the device checks that the lengths add up to them.
      check_index_tensor(b.extend_prefix_lens, "extend_prefix_lens", bs, device);
      if (b.extend_seq_lens.defined())
        check_index_tensor(b.extend_seq_lens, "extend_seq_lens", bs, device);
      check_arg(b.out_cache_loc.defined(), "out_cache_loc",
                "missing: an EXTEND-like step without host lengths takes its token count from it");
      check_arg(b.out_cache_loc.size(0) <= INT32_MAX, "out_cache_loc", "has ",
                b.out_cache_loc.size(0), " tokens, expected < 2^31");
    }
    // (Its values, like seq_lens', are the device's to check: kArgEncoderLens.)
    if (c.is_encoder_decoder) check_index_tensor(b.encoder_lens, "encoder_lens", bs, device);
    return {};
  }
  HostLengths lens = read_host_lengths(b, c.is_encoder_decoder);
  if (verify) {
    check_arg(b.spec.draft_token_num >= 1, "spec.draft_token_num", "got ",
              b.spec.draft_token_num, ", expected >= 1 for TARGET_VERIFY");
  }
  int64_t sum = 0;
  int64_t mask_elems = 0;
  for (int r = 0; r < bs; ++r) {
    const int64_t base = c.is_encoder_decoder ? lens.encoder_lens[r] : 0;
    const int64_t extent = base + lens.seq_lens[r] + (verify ? b.spec.draft_token_num : 0);
    if (extent > pool.max_context_len()) {
      throw_error(ErrorKind::kInvalidArgument, at("seq_lens", r), "request needs ", extent,
                  " req_to_token positions, the pool has max_context_len ",
                  pool.max_context_len());
    }
    sum += lens.seq_lens[r];
    if (verify) {
      mask_elems += int64_t(b.spec.draft_token_num) * (lens.seq_lens[r] + b.spec.draft_token_num);
    }
  }
  check_arg(b.seq_lens_sum < 0 || b.seq_lens_sum == sum, "seq_lens_sum", "got ", b.seq_lens_sum,
            ", the seq_lens add up to ", sum);
  if (is_extend_like(b.mode)) {
    if (b.extend_prefix_lens.defined())
      check_index_tensor(b.extend_prefix_lens, "extend_prefix_lens", bs, device);
    if (b.extend_seq_lens.defined())
      check_index_tensor(b.extend_seq_lens, "extend_seq_lens", bs, device);
  }
  if (c.is_encoder_decoder) check_index_tensor(b.encoder_lens, "encoder_lens", bs, device);
  if (verify) {
    const TensorView& m = b.spec.custom_mask;
    check_arg(m.defined(), "spec.custom_mask", "missing: TARGET_VERIFY needs the tree mask");
    check_arg(m.dtype() == DType::kUInt8, "spec.custom_mask", "dtype ", dtype_name(m.dtype()),
              ", expected uint8 (0/1)");
    check_arg(m.ndim() == 1 && m.size(0) == mask_elems, "spec.custom_mask", "shape ",
              m, ", expected [", mask_elems,
              "] = sum of draft_token_num * (seq_len + draft_token_num)");
    check_arg(m.device() == device, "spec.custom_mask", "on ", m.device(), ", expected ",
              device);
  }
  return lens;
}

void validate_step_slots(const ForwardBatch& b, int64_t num_slots, Device device) {
  if (b.mode == ForwardMode::kIdle) return;
  const TensorView* tensors[2] = {&b.out_cache_loc, &b.encoder_out_cache_loc};
  const char* names[2] = {"out_cache_loc", "encoder_out_cache_loc"};
  for (int i = 0; i < 2; ++i) {
    const TensorView& loc = *tensors[i];
    if (!loc.defined()) continue;
    check_index_tensor(loc, names[i], loc.ndim() == 1 ? loc.size(0) : -1, device);
    check_slots_on_host(loc, names[i], num_slots);
  }
}

void check_sinks(const AttentionLayer& layer, Device device) {
  const TensorView& s = layer.sinks;
  if (!s.defined()) return;
  check_arg(s.ndim() == 1 && s.size(0) == layer.num_q_heads, "sinks", "shape ", s,
            ", expected [", layer.num_q_heads, "] (one per q head)");
  check_arg(s.dtype() == DType::kFloat32 || s.dtype() == DType::kBFloat16 ||
                s.dtype() == DType::kFloat16,
            "sinks", "dtype ", dtype_name(s.dtype()), ", expected float32, bfloat16 or float16");
  check_arg(s.data() != nullptr, "sinks", "is null");
  check_arg(s.device() == device, "sinks", "on ", s.device(), ", expected ", device);
  check_arg(s.size(0) <= 1 || s.stride(0) == 1, "sinks", "stride ", s.stride(0),
            ", expected a contiguous vector");
}

void validate_forward_tensors(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const AttentionLayer& layer,
                              const ForwardBatch& b, const BackendConfig& c, Device device,
                              int64_t num_tokens, bool save_kv_cache) {
  validate_layer(layer, c);
  const int vd = layer.resolved_v_head_dim();
  check_head_tensor(q, "q", num_tokens, layer.num_q_heads, layer.head_dim, c.q_dtype, device);
  check_head_tensor(out, "out", num_tokens, layer.num_q_heads, vd, c.q_dtype, device);
  check_sinks(layer, device);
  if (!save_kv_cache || !k.defined()) {
    check_arg(!save_kv_cache || !v.defined(), "k", "missing while v is given");
    return;
  }
  check_arg(v.defined(), "v", "missing while k is given");
  const bool cross = layer.is_cross_attention;
  const TensorView& loc = cross ? b.encoder_out_cache_loc : b.out_cache_loc;
  const char* loc_name = cross ? "encoder_out_cache_loc" : "out_cache_loc";
  check_arg(loc.defined(), loc_name, "missing: needed to save k/v (save_kv_cache = true)");
  const int64_t kv_tokens = loc.ndim() == 1 ? loc.size(0) : -1;
  check_index_tensor(loc, loc_name, kv_tokens, device);
  if (!cross) {
    check_arg(kv_tokens == num_tokens, loc_name, "has ", kv_tokens, " slots, the step has ",
              num_tokens, " tokens");
  }
  check_head_tensor(k, "k", kv_tokens, layer.num_kv_heads, layer.head_dim, c.q_dtype, device);
  check_head_tensor(v, "v", kv_tokens, layer.num_kv_heads, vd, c.q_dtype, device);
  check_slots_on_host(loc, loc_name, c.kv_cache->num_slots());
}

}  // namespace kvattn::core
