#include "core/params_fill.h"

#include <algorithm>

namespace kvattn::core {

HeadStrides head_strides(const TensorView& t, int dim) {
  HeadStrides s;
  s.token = t.stride(0);
  s.head = t.ndim() == 3 ? t.stride(1) : dim;
  return s;
}

float layer_k_scale(const AttentionLayer& layer, const KvCache& cache) {
  return layer.k_scale > 0.f ? layer.k_scale : cache.k_scale(layer.layer_id);
}

float layer_v_scale(const AttentionLayer& layer, const KvCache& cache) {
  return layer.v_scale > 0.f ? layer.v_scale : cache.v_scale(layer.layer_id);
}

void set_query_fields(AttentionParams& p, const TensorView& q, const TensorView& out,
                      const AttentionLayer& layer) {
  const int v_head_dim = layer.resolved_v_head_dim();
  const HeadStrides qs = head_strides(q, layer.head_dim);
  const HeadStrides os = head_strides(out, v_head_dim);
  p.q = q.data();
  p.q_stride_token = qs.token;
  p.q_stride_head = qs.head;
  p.out = out.data();
  p.out_stride_token = os.token;
  p.out_stride_head = os.head;
  p.io_dtype = q.dtype();
  p.num_q_heads = layer.num_q_heads;
  p.num_kv_heads = layer.num_kv_heads;
  p.head_dim = layer.head_dim;
  p.v_head_dim = v_head_dim;
  p.sm_scale = layer.scaling;
  p.logit_cap = layer.logit_cap;
}

void set_pool_fields(AttentionParams& p, const KvCache& cache, const AttentionLayer& layer) {
  const TensorView& k_buffer = cache.k_buffer(layer.layer_id);
  const TensorView& v_buffer = cache.v_buffer(layer.layer_id);
  p.k = k_buffer.data();
  p.v = v_buffer.data();
  p.k_stride_token = k_buffer.stride(0);
  p.k_stride_head = k_buffer.stride(1);
  p.v_stride_token = v_buffer.stride(0);
  p.v_stride_head = v_buffer.stride(1);
  p.kv_dtype = k_buffer.dtype();
  const bool fp8 = is_fp8_dtype(p.kv_dtype);
  p.k_scale = fp8 ? layer_k_scale(layer, cache) : 1.f;
  p.v_scale = fp8 ? layer_v_scale(layer, cache) : 1.f;
  p.num_slots = cache.num_slots();
}

void set_ragged_fields(AttentionParams& p, const TensorView& k, const TensorView& v,
                       const AttentionLayer& layer) {
  const HeadStrides ks = head_strides(k, layer.head_dim);
  const HeadStrides vs = head_strides(v, layer.resolved_v_head_dim());
  p.k = k.data();
  p.v = v.data();
  p.k_stride_token = ks.token;
  p.k_stride_head = ks.head;
  p.v_stride_token = vs.token;
  p.v_stride_head = vs.head;
  p.kv_dtype = k.dtype();
  p.k_scale = 1.f;
  p.v_scale = 1.f;
  p.kv_indices = nullptr;
  p.num_slots = std::min(k.size(0), v.size(0));
}

}  // namespace kvattn::core
