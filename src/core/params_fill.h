// Host-side helpers that fill the parts of core::AttentionParams every backend fills the same
// way from the public types: the query/output views and the layer's shape, K/V read from the
// layer's paged pool, or K/V read from a call's own rows (the ragged path). Each backend then
// sets the batch fields (indptr arrays, indices, mask) from its own plan: host vectors on the
// CPU, device metadata on CUDA.
#pragma once

#include <cstdint>

#include "core/attention_params.h"
#include "kvattn/forward_batch.h"
#include "kvattn/kv_cache.h"
#include "kvattn/tensor.h"

namespace kvattn::core {

/// Element strides of a [tokens, heads, dim] view, or of a flat [tokens, heads * dim] one
/// (heads then dim apart).
struct HeadStrides {
  int64_t token = 0;
  int64_t head = 0;
};
HeadStrides head_strides(const TensorView& t, int dim);

/// The scale a layer's fp8 K (V) rows are stored with: the layer's own when it sets one
/// (> 0), else the cache's for that layer.
float layer_k_scale(const AttentionLayer& layer, const KvCache& cache);
float layer_v_scale(const AttentionLayer& layer, const KvCache& cache);

/// q and out (pointers, strides, io dtype = q's), the layer's head counts and dims, softmax
/// scale and soft-cap.
void set_query_fields(AttentionParams& p, const TensorView& q, const TensorView& out,
                      const AttentionLayer& layer);

/// K/V from the layer's pages in `cache`: buffers, strides, storage dtype, the fp8 scales (1
/// for 16-bit storage) and the pool size kernels bound slot indices by.
void set_pool_fields(AttentionParams& p, const KvCache& cache, const AttentionLayer& layer);

/// K/V from the call's own rows k and v (in q's dtype): kv_indices is null, row j of request
/// r is kv_indptr[r] + j.
void set_ragged_fields(AttentionParams& p, const TensorView& k, const TensorView& v,
                       const AttentionLayer& layer);

}  // namespace kvattn::core
