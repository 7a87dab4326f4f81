#include "oracle.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "reference/float_format.h"

namespace kvattn::tools {
namespace {

/// Copies rows [first, first + count) of a [num_slots, ...] pool buffer to `dst` (host).
void copy_slot_range(const TensorView& buffer, int64_t first, int64_t count, uint8_t* dst) {
  const int64_t row_bytes = buffer.stride(0) * dtype_size(buffer.dtype());
  const auto* src = static_cast<const uint8_t*>(buffer.data()) + first * row_bytes;
  copy_bytes(dst, Device::cpu(), src, buffer.device(), size_t(count * row_bytes));
}

}  // namespace

CompactPool snapshot_rows(const KvCache& cache, int layer_id,
                          const std::vector<std::vector<int32_t>>& rows) {
  std::vector<int32_t> unique;
  size_t max_len = 1;
  for (const auto& row : rows) {
    unique.insert(unique.end(), row.begin(), row.end());
    max_len = std::max(max_len, row.size());
  }
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());

  const KvCacheConfig& config = cache.config();
  const int head_dim = config.head_dim;
  const int v_head_dim = config.resolved_v_head_dim();
  CompactPool out;
  out.pool = testing::RefKvPool::make(int64_t(unique.size()) + 1, config.num_kv_heads, head_dim,
                                      v_head_dim);
  std::unordered_map<int32_t, int32_t> compact_id;
  compact_id.reserve(unique.size() * 2);
  for (size_t i = 0; i < unique.size(); ++i) compact_id[unique[i]] = int32_t(i + 1);

  const TensorView& k_buffer = cache.k_buffer(layer_id);
  const TensorView& v_buffer = cache.v_buffer(layer_id);
  const int64_t k_row_elems = int64_t(config.num_kv_heads) * head_dim;
  const int64_t v_row_elems = int64_t(config.num_kv_heads) * v_head_dim;
  const int elem = dtype_size(config.dtype);
  const bool fp8 = is_fp8_dtype(config.dtype);
  const double k_scale = fp8 ? cache.k_scale(layer_id) : 1.0;
  const double v_scale = fp8 ? cache.v_scale(layer_id) : 1.0;
  std::vector<uint8_t> k_staging;
  std::vector<uint8_t> v_staging;
  // Consecutive slots travel in one copy (pages are runs of slots), so even a page-1 shuffled
  // pool of millions of slots costs a bounded number of device copies.
  size_t i = 0;
  while (i < unique.size()) {
    size_t j = i + 1;
    while (j < unique.size() && unique[j] == unique[j - 1] + 1) ++j;
    const int64_t count = int64_t(j - i);
    k_staging.resize(size_t(count * k_row_elems * elem));
    v_staging.resize(size_t(count * v_row_elems * elem));
    copy_slot_range(k_buffer, unique[i], count, k_staging.data());
    copy_slot_range(v_buffer, unique[i], count, v_staging.data());
    for (int64_t s = 0; s < count; ++s) {
      double* k_dst = out.pool.k.data() + (int64_t(i) + 1 + s) * k_row_elems;
      double* v_dst = out.pool.v.data() + (int64_t(i) + 1 + s) * v_row_elems;
      for (int64_t e = 0; e < k_row_elems; ++e) {
        k_dst[e] =
            testing::decode_element(k_staging.data(), config.dtype, s * k_row_elems + e) * k_scale;
      }
      for (int64_t e = 0; e < v_row_elems; ++e) {
        v_dst[e] =
            testing::decode_element(v_staging.data(), config.dtype, s * v_row_elems + e) * v_scale;
      }
    }
    i = j;
  }

  out.max_context_len = int(max_len);
  out.req_to_token.assign(rows.size() * max_len, 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t p = 0; p < rows[r].size(); ++p) {
      out.req_to_token[r * max_len + p] = compact_id[rows[r][p]];
    }
  }
  return out;
}

std::vector<double> gather_rows_as_double(const TensorView& host, const std::vector<int64_t>& rows,
                                          int64_t row_elems) {
  std::vector<double> out(rows.size() * size_t(row_elems));
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int64_t e = 0; e < row_elems; ++e) {
      out[r * size_t(row_elems) + size_t(e)] =
          testing::decode_element(host.data(), host.dtype(), rows[r] * row_elems + e);
    }
  }
  return out;
}

double max_rel_err(const testing::RefOutput& ref, const TensorView& out_host,
                   const std::vector<int64_t>& out_rows) {
  const int heads = ref.num_q_heads;
  const int dim = ref.v_head_dim;
  const int64_t row_elems = int64_t(heads) * dim;
  double worst = 0;
  for (size_t t = 0; t < out_rows.size(); ++t) {
    for (int h = 0; h < heads; ++h) {
      const double* expected = ref.out.data() + int64_t(t) * row_elems + int64_t(h) * dim;
      double scale = 0;
      double diff = 0;
      for (int e = 0; e < dim; ++e) {
        const double got = testing::decode_element(out_host.data(), out_host.dtype(),
                                                   out_rows[t] * row_elems + h * dim + e);
        if (!std::isfinite(got)) return std::numeric_limits<double>::infinity();
        scale = std::max(scale, std::fabs(expected[e]));
        diff = std::max(diff, std::fabs(got - expected[e]));
      }
      worst = std::max(worst, scale > 0 ? diff / scale : diff);
    }
  }
  return worst;
}

std::vector<StepRequestRows> step_request_rows(const StepSpec& spec) {
  std::vector<StepRequestRows> rows;
  int64_t offset = 0;
  for (size_t i = 0; i < spec.seq_lens.size(); ++i) {
    StepRequestRows r;
    r.first_row = offset;
    switch (spec.mode) {
      case ForwardMode::kDecode:
        r.q_len = 1;
        r.kv_extent = spec.seq_lens[i];
        break;
      case ForwardMode::kTargetVerify:
        r.q_len = spec.draft_token_num;
        r.kv_extent = spec.seq_lens[i] + spec.draft_token_num;
        break;
      default:
        r.q_len = spec.extend_lens[i];
        r.kv_extent = spec.seq_lens[i];
        break;
    }
    offset += r.q_len;
    rows.push_back(r);
  }
  return rows;
}

std::vector<size_t> pick_checked_requests(const std::vector<StepRequestRows>& rows,
                                          int64_t pair_budget, size_t max_requests, Rng& rng) {
  std::vector<size_t> order(rows.size());
  std::iota(order.begin(), order.end(), size_t(0));
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[size_t(rng.next() % i)]);
  std::vector<size_t> picked;
  int64_t pairs = 0;
  for (size_t i : order) {
    const int64_t cost = rows[i].q_len * rows[i].kv_extent;
    if (!picked.empty() && pairs + cost > pair_budget) continue;
    picked.push_back(i);
    pairs += cost;
    if (picked.size() >= max_requests) break;
  }
  std::sort(picked.begin(), picked.end());
  return picked;
}

double check_step_requests(const KvCache& cache, const AttentionLayer& layer, const StepSpec& spec,
                           const std::vector<StepRequestRows>& rows,
                           const std::vector<size_t>& picked,
                           const std::vector<std::vector<int32_t>>& slot_rows,
                           const StepHostInputs& inputs, const TensorView& out) {
  testing::RefBatch ref;
  ref.mode = spec.mode;
  ref.draft_token_num = spec.draft_token_num;
  std::vector<int64_t> token_rows;
  std::vector<int64_t> mask_offsets(rows.size() + 1, 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    mask_offsets[i + 1] = mask_offsets[i] + rows[i].q_len * rows[i].kv_extent;
  }
  for (size_t k = 0; k < picked.size(); ++k) {
    const size_t i = picked[k];
    ref.req_pool_indices.push_back(int32_t(k));
    ref.seq_lens.push_back(spec.seq_lens[i]);
    if (!spec.prefix_lens.empty()) {
      ref.prefix_lens.push_back(spec.prefix_lens[i]);
      ref.extend_lens.push_back(spec.extend_lens[i]);
    }
    if (spec.mode == ForwardMode::kTargetVerify) {
      ref.custom_mask.insert(ref.custom_mask.end(), spec.custom_mask.begin() + mask_offsets[i],
                             spec.custom_mask.begin() + mask_offsets[i + 1]);
    }
    for (int64_t t = 0; t < rows[i].q_len; ++t) token_rows.push_back(rows[i].first_row + t);
  }
  CompactPool compact = snapshot_rows(cache, layer.layer_id, slot_rows);
  // The step's new tokens are the last q_len positions of each checked request's KV range.
  testing::RefNewKv new_kv;
  for (size_t k = 0; k < picked.size(); ++k) {
    const StepRequestRows& r = rows[picked[k]];
    const int32_t* row = compact.req_to_token.data() + k * size_t(compact.max_context_len);
    for (int64_t j = 0; j < r.q_len; ++j) new_kv.slots.push_back(row[r.kv_extent - r.q_len + j]);
  }
  const int64_t kv_row = int64_t(inputs.num_kv_heads) * layer.head_dim;
  new_kv.k = gather_rows_as_double(inputs.k_host, token_rows, kv_row);
  new_kv.v = gather_rows_as_double(inputs.v_host, token_rows,
                                   int64_t(inputs.num_kv_heads) * layer.resolved_v_head_dim());
  testing::reference_save_kv(compact.pool, new_kv, inputs.kv_dtype, 1.0, 1.0);
  ref.max_context_len = compact.max_context_len;
  ref.req_to_token = std::move(compact.req_to_token);
  const std::vector<double> q = gather_rows_as_double(inputs.q_host, token_rows,
                                                      int64_t(inputs.num_q_heads) * layer.head_dim);
  const testing::RefOutput expected = testing::reference_attention(layer, ref, compact.pool, q);
  const OwnedTensor out_host = to_host(out);
  return max_rel_err(expected, out_host.view, token_rows);
}

}  // namespace kvattn::tools
