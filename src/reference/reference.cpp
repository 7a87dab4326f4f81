#include "reference/reference.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

#include "reference/float_format.h"

namespace kvattn::testing {
namespace {

bool is_extend_like(ForwardMode mode) {
  return mode == ForwardMode::kExtend || mode == ForwardMode::kMixed ||
         mode == ForwardMode::kDraftExtend;
}

// Which request a query token belongs to, and its index among that request's queries.
struct TokenOwner {
  int request = 0;
  int64_t local_index = 0;
  int64_t first_token = 0;  // the request's first query token in the batch
};

TokenOwner owner_of(const RefBatch& batch, int64_t token) {
  const int batch_size = batch.batch_size();
  if (batch.topk > 0) {
    return {int(token / batch.topk), token % batch.topk, token - token % batch.topk};
  }
  switch (batch.mode) {
    case ForwardMode::kDecode:
      return {int(token), 0, token};
    case ForwardMode::kTargetVerify:
      return {int(token / batch.draft_token_num), token % batch.draft_token_num,
              token - token % batch.draft_token_num};
    default: {
      int64_t first = 0;
      for (int r = 0; r < batch_size; ++r) {
        if (token < first + batch.extend_lens[r]) return {r, token - first, first};
        first += batch.extend_lens[r];
      }
      throw std::out_of_range("reference: token beyond the batch");
    }
  }
}

}  // namespace

RefKvPool RefKvPool::make(int64_t num_slots, int num_kv_heads, int head_dim, int v_head_dim) {
  RefKvPool pool;
  pool.num_slots = num_slots;
  pool.num_kv_heads = num_kv_heads;
  pool.head_dim = head_dim;
  pool.v_head_dim = v_head_dim;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  pool.k.assign(size_t(num_slots) * num_kv_heads * head_dim, nan);
  pool.v.assign(size_t(num_slots) * num_kv_heads * v_head_dim, nan);
  return pool;
}

int64_t reference_num_tokens(const RefBatch& batch) {
  const int batch_size = batch.batch_size();
  if (batch.mode == ForwardMode::kIdle) return 0;
  if (batch.topk > 0) return int64_t(batch_size) * batch.topk;
  if (batch.mode == ForwardMode::kDecode) return batch_size;
  if (batch.mode == ForwardMode::kTargetVerify) return int64_t(batch_size) * batch.draft_token_num;
  int64_t total = 0;
  for (int r = 0; r < batch_size; ++r) total += batch.extend_lens.at(r);
  return total;
}

double round_through_storage(double x, DType storage, double scale) {
  if (is_fp8_dtype(storage)) return format_round(float_format_of(storage), x / scale) * scale;
  return round_to_dtype(x, storage);
}

void reference_save_kv(RefKvPool& pool, const RefNewKv& new_kv, DType storage, double k_scale,
                       double v_scale) {
  for (size_t n = 0; n < new_kv.slots.size(); ++n) {
    const int64_t slot = new_kv.slots[n];
    if (slot < 0 || slot >= pool.num_slots) throw std::out_of_range("reference: save slot");
    for (int h = 0; h < pool.num_kv_heads; ++h) {
      const double* k_in = new_kv.k.data() + (n * pool.num_kv_heads + h) * pool.head_dim;
      const double* v_in = new_kv.v.data() + (n * pool.num_kv_heads + h) * pool.v_head_dim;
      double* k_out = pool.k_row(slot, h);
      double* v_out = pool.v_row(slot, h);
      for (int d = 0; d < pool.head_dim; ++d)
        k_out[d] = round_through_storage(k_in[d], storage, k_scale);
      for (int d = 0; d < pool.v_head_dim; ++d)
        v_out[d] = round_through_storage(v_in[d], storage, v_scale);
    }
  }
}

std::vector<RefKey> reference_visible_keys(const AttentionLayer& layer, const RefBatch& batch,
                                           int64_t token, bool ragged) {
  const TokenOwner owner = owner_of(batch, token);
  const int r = owner.request;
  const bool encoder_decoder = !batch.encoder_lens.empty();
  const int64_t encoder_len = encoder_decoder ? batch.encoder_lens.at(r) : 0;
  const int64_t row = batch.req_pool_indices.at(r);
  const int64_t seq_len = batch.seq_lens.at(r);
  const int window = layer.sliding_window_size;

  auto slot_at = [&](int64_t position) {
    if (position < 0 || position >= batch.max_context_len)
      throw std::out_of_range("reference: req_to_token position " + std::to_string(position));
    return batch.req_to_token.at(size_t(row * batch.max_context_len + position));
  };

  std::vector<RefKey> keys;
  if (layer.is_cross_attention) {
    // Cross-attention: the request's encoder tokens, all of them, whatever the query.
    for (int64_t j = 0; j < encoder_len; ++j) keys.push_back({slot_at(j), -1});
    return keys;
  }
  // Self-attention of an encoder-decoder model reads the decoder tokens after the encoder ones.
  const int64_t base = encoder_len;

  if (batch.topk > 0) {
    // Multi-step draft: the committed prefix, then this branch's draft token of every step so far.
    // The draft token of step s sits at absolute position seq_len + s (one deeper per step), so
    // a window layer shows the query (position seq_len + draft_step) [p - W, p] as anywhere else.
    const int64_t branch = owner.local_index;
    const int64_t position = seq_len + batch.draft_step;
    const int64_t first = window >= 0 ? std::max<int64_t>(0, position - window) : 0;
    for (int64_t j = first; j < seq_len; ++j) keys.push_back({slot_at(base + j), -1});
    for (int s = 0; s <= batch.draft_step; ++s) {
      if (seq_len + s < first) continue;
      keys.push_back({slot_at(base + seq_len + int64_t(s) * batch.topk + branch), -1});
    }
    return keys;
  }

  if (batch.mode == ForwardMode::kTargetVerify) {
    const int64_t q_len = batch.draft_token_num;
    const int64_t kv_len = seq_len + q_len;
    int64_t mask_offset = 0;
    for (int i = 0; i < r; ++i) mask_offset += q_len * (batch.seq_lens[i] + q_len);
    const int64_t i = owner.local_index;
    // Tree tokens' positions are not consecutive: the window compares absolute positions.
    auto tree_position = [&](int64_t tree_index) {
      return batch.positions.at(size_t(owner.first_token + tree_index));
    };
    for (int64_t j = 0; j < kv_len; ++j) {
      if (!batch.custom_mask.at(size_t(mask_offset + i * kv_len + j))) continue;
      if (window >= 0) {
        const int64_t key_position = j < seq_len ? j : tree_position(j - seq_len);
        if (key_position < tree_position(i) - window) continue;
      }
      keys.push_back({slot_at(base + j), -1});
    }
    return keys;
  }

  // Causal: the query at absolute position p sees [max(0, p - W), p].
  int64_t position = 0;
  int64_t prefix_len = 0;
  if (batch.mode == ForwardMode::kDecode) {
    position = seq_len - 1;  // seq_len 0 (a padded entry) sees nothing
    prefix_len = seq_len;
  } else if (is_extend_like(batch.mode)) {
    prefix_len = batch.prefix_lens.at(r);
    position = prefix_len + owner.local_index;
  } else {
    throw std::invalid_argument("reference: mode without queries");
  }
  const int64_t first = window >= 0 ? std::max<int64_t>(0, position - window) : 0;
  const bool ragged_request = ragged && (batch.mode == ForwardMode::kExtend ||
                                         batch.mode == ForwardMode::kMixed);
  for (int64_t j = first; j <= position; ++j) {
    if (ragged_request && j >= prefix_len) {
      keys.push_back({-1, owner.first_token + (j - prefix_len)});
    } else {
      keys.push_back({slot_at(base + j), -1});
    }
  }
  return keys;
}

RefOutput reference_attention(const AttentionLayer& layer, const RefBatch& batch,
                              const RefKvPool& pool, const std::vector<double>& q,
                              const RefNewKv* ragged_new_kv, const std::vector<double>* sinks) {
  const int num_q_heads = layer.num_q_heads;
  const int num_kv_heads = layer.num_kv_heads;
  const int head_dim = layer.head_dim;
  const int v_head_dim = layer.resolved_v_head_dim();
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0)
    throw std::invalid_argument("reference: heads");
  if (pool.head_dim != head_dim || pool.v_head_dim != v_head_dim ||
      pool.num_kv_heads != num_kv_heads)
    throw std::invalid_argument("reference: pool shape differs from the layer");
  const int group = num_q_heads / num_kv_heads;

  RefOutput result;
  result.num_tokens = reference_num_tokens(batch);
  result.num_q_heads = num_q_heads;
  result.v_head_dim = v_head_dim;
  if (int64_t(q.size()) != result.num_tokens * num_q_heads * head_dim)
    throw std::invalid_argument("reference: q size");
  if (sinks != nullptr && int(sinks->size()) != num_q_heads)
    throw std::invalid_argument("reference: sinks size");
  result.out.assign(size_t(result.num_tokens) * num_q_heads * v_head_dim, 0.0);
  result.lse.assign(size_t(result.num_tokens) * num_q_heads,
                    -std::numeric_limits<double>::infinity());

  // One (token, q head) row at a time; rows are independent, so large calls spread them over
  // threads (each row is computed the same way whichever thread runs it: the same bits).
  auto run_rows = [&](int64_t row_begin, int64_t row_end) {
    std::vector<double> logits;
    std::vector<RefKey> keys;
    int64_t keys_of = -1;  // the token `keys` belongs to
    for (int64_t row = row_begin; row < row_end; ++row) {
      const int64_t t = row / num_q_heads;
      const int h = int(row % num_q_heads);
      if (keys_of != t) {
        keys = reference_visible_keys(layer, batch, t, ragged_new_kv != nullptr);
        keys_of = t;
      }
      if (keys.empty()) {
        if (sinks != nullptr) result.lse[t * num_q_heads + h] = (*sinks)[h];
        continue;
      }
      const int kv_head = h / group;
      const double* q_row = q.data() + (t * num_q_heads + h) * head_dim;
      auto k_of = [&](const RefKey& key) {
        if (key.slot >= 0) return pool.k_row(key.slot, kv_head);
        return ragged_new_kv->k.data() + (key.new_kv_row * num_kv_heads + kv_head) * head_dim;
      };
      auto v_of = [&](const RefKey& key) {
        if (key.slot >= 0) return pool.v_row(key.slot, kv_head);
        return ragged_new_kv->v.data() + (key.new_kv_row * num_kv_heads + kv_head) * v_head_dim;
      };
      logits.assign(keys.size(), 0.0);
      double max_logit = -std::numeric_limits<double>::infinity();
      for (size_t j = 0; j < keys.size(); ++j) {
        if (keys[j].slot >= pool.num_slots) throw std::out_of_range("reference: slot");
        const double* k_row = k_of(keys[j]);
        double dot = 0;
        for (int d = 0; d < head_dim; ++d) dot += q_row[d] * k_row[d];
        double x = dot * double(layer.scaling);
        if (layer.logit_cap > 0) x = double(layer.logit_cap) * std::tanh(x / layer.logit_cap);
        logits[j] = x;
        max_logit = std::max(max_logit, x);
      }
      double denominator = 0;
      if (sinks != nullptr) {
        const double sink = (*sinks)[h];
        max_logit = std::max(max_logit, sink);
        denominator = std::exp(sink - max_logit);
      }
      double* out_row = result.out.data() + (t * num_q_heads + h) * v_head_dim;
      for (size_t j = 0; j < keys.size(); ++j) {
        const double weight = std::exp(logits[j] - max_logit);
        denominator += weight;
        const double* v_row = v_of(keys[j]);
        for (int d = 0; d < v_head_dim; ++d) out_row[d] += weight * v_row[d];
      }
      for (int d = 0; d < v_head_dim; ++d) out_row[d] /= denominator;
      result.lse[t * num_q_heads + h] = max_logit + std::log(denominator);
    }
  };
  const int64_t rows = result.num_tokens * num_q_heads;
  // Threads only where the work is large (a long request's decode, a big extend): ~2M
  // multiply-adds a thread at least.
  const int64_t work = rows * (int64_t(batch.max_context_len) + 1) * (head_dim + v_head_dim);
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads =
      std::clamp<int64_t>(work / (int64_t{1} << 21), 1, std::min<int64_t>(hardware, 16));
  if (threads <= 1 || rows < 2) {
    run_rows(0, rows);
    return result;
  }
  std::vector<std::thread> pool_threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  for (int64_t i = 0; i < threads; ++i) {
    const int64_t begin = rows * i / threads;
    const int64_t end = rows * (i + 1) / threads;
    pool_threads.emplace_back([&, i, begin, end] {
      try {
        run_rows(begin, end);
      } catch (...) {
        errors[size_t(i)] = std::current_exception();
      }
    });
  }
  for (std::thread& th : pool_threads) th.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return result;
}

}  // namespace kvattn::testing
