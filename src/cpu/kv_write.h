// Saving one step's new K/V rows into a layer of the paged pool.
#pragma once

#include <string>

#include "cpu/thread_pool.h"
#include "kvattn/tensor.h"

namespace kvattn::cpu {

/// K[loc[t]] = k[t] and V[loc[t]] = v[t] for every new token t, narrowed to the pool's dtype
/// (fp8 stores x / scale, rounded to nearest even and saturating; bf16/fp16 ignore the scales).
/// Every slot is checked against the pool before the first write, so a bad slot (named as
/// `loc_name`[t]) throws kvattn::Error and leaves the pool untouched.
///   k         [num_new, num_kv_heads, head_dim] or [num_new, num_kv_heads * head_dim], fp32/bf16/fp16
///   v         [num_new, num_kv_heads, v_head_dim] (or flat), k's dtype
///   loc       [num_new] int32/int64 host slots
///   k_buffer  [num_slots, num_kv_heads, head_dim], contiguous, storage dtype
///   v_buffer  [num_slots, num_kv_heads, v_head_dim], contiguous, storage dtype
/// head_dim and v_head_dim are multiples of 8.
void write_kv(const TensorView& k, const TensorView& v, const TensorView& loc,
              const std::string& loc_name, const TensorView& k_buffer, const TensorView& v_buffer,
              float k_scale, float v_scale, ThreadPool& pool);

}  // namespace kvattn::cpu
