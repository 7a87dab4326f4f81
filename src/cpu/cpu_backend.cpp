#include "cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "core/params_fill.h"
#include "core/step.h"
#include "core/validate.h"
#include "cpu/amx.h"
#include "cpu/bf16_avx512.h"
#include "cpu/kv_write.h"
#include "kvattn/error.h"
#include "kvattn/kv_cache.h"

namespace kvattn::cpu {
namespace {

// The index sets a model's layers use (SPEC §3): window + full, self + cross, or full alone.
std::vector<core::IndexSet> sets_for(const BackendConfig& config) {
  if (config.is_encoder_decoder) return {core::IndexSet::kDecoderSelf, core::IndexSet::kEncoder};
  if (config.sliding_window_size >= 0) return {core::IndexSet::kWindow, core::IndexSet::kFull};
  return {core::IndexSet::kFull};
}

void check_host_config(const BackendConfig& config) {
  core::validate_backend_config(config);
  const Device device = config.kv_cache->config().device;
  check_arg(device.is_cpu(), "kv_cache", "on ", device,
            ", the CPU backend needs it on the host");
  check_arg(config.req_to_token_pool->device().is_cpu(), "req_to_token_pool", "on ",
            config.req_to_token_pool->device(), ", the CPU backend needs it on the host");
}

// Reads req_to_token[row][position] for positions [start, start + len), checking each slot.
void append_slots(const ReqToTokenPool& pool, int64_t row, int64_t start, int64_t len,
                  int64_t num_slots, std::vector<int32_t>& out) {
  const TensorView& table = pool.table();
  check_arg(start >= 0 && start + len <= pool.max_context_len(),
            "req_to_token[" + std::to_string(row) + "]", "positions [", start, ", ", start + len,
            ") outside max_context_len ", pool.max_context_len());
  const int32_t* data = table.data_as<const int32_t>() + row * table.stride(0);
  for (int64_t pos = start; pos < start + len; ++pos) {
    const int32_t slot = data[pos * table.stride(1)];
    if (slot < 0 || slot >= num_slots) {
      throw_error(ErrorKind::kInvalidArgument,
                  "req_to_token[" + std::to_string(row) + "][" + std::to_string(pos) + "]",
                  "slot ", slot, " outside the KV pool [0, ", num_slots, ")");
    }
    out.push_back(slot);
  }
}

// Points kernel parameters at one layer of the paged pool and one index set.
void set_paged(core::AttentionParams& p, const KvCache& cache, const AttentionLayer& layer,
               const CpuIndexSet& set) {
  core::set_pool_fields(p, cache, layer);
  p.batch_size = set.layout.batch_size;
  p.qo_indptr = set.layout.qo_indptr.data();
  p.kv_indptr = set.layout.kv_indptr.data();
  p.kv_indices = set.kv_indices.data();
  p.mask = set.layout.mask;
  p.mask_indptr = set.layout.mask_indptr.empty() ? nullptr : set.layout.mask_indptr.data();
  p.window_left = set.layout.window_left;
}

// K/V rows of one call's k and v views ([tokens, heads, dim] or flat).
void set_ragged(core::AttentionParams& p, const TensorView& k, const TensorView& v,
                const AttentionLayer& layer, const core::PagedLayout& layout) {
  core::set_ragged_fields(p, k, v, layer);
  p.batch_size = layout.batch_size;
  p.qo_indptr = layout.qo_indptr.data();
  p.kv_indptr = layout.kv_indptr.data();
  p.mask = layout.mask;
  p.window_left = -1;
}

void save_kv(const TensorView& k, const TensorView& v, const AttentionLayer& layer,
             const TensorView& loc, const char* loc_name, const KvCache& cache,
             ThreadPool& pool) {
  const float k_scale = core::layer_k_scale(layer, cache);
  const float v_scale = core::layer_v_scale(layer, cache);
  write_kv(k, v, loc, loc_name, cache.k_buffer(layer.layer_id), cache.v_buffer(layer.layer_id),
           k_scale, v_scale, pool);
}

}  // namespace

// ---- CpuBackend ------------------------------------------------------------------------------

CpuBackend::CpuBackend(const BackendConfig& config)
    : config_((check_host_config(config), config)),
      pool_(resolve_num_threads(config.num_threads)) {}

void CpuBackend::build_index_set(CpuIndexSet& target, const ForwardBatch& batch) {
  const core::PagedLayout& layout = target.layout;
  target.kv_indices.clear();
  target.kv_indices.reserve(size_t(layout.total_kv()));
  const int64_t num_slots = config_.kv_cache->num_slots();
  for (int r = 0; r < layout.batch_size; ++r) {
    const int64_t row = read_index(batch.req_pool_indices, r);
    append_slots(*config_.req_to_token_pool, row, layout.kv_start[r], layout.kv_len[r], num_slots,
                 target.kv_indices);
  }
}

void CpuBackend::init_forward_metadata_out_graph(const ForwardBatch& batch, bool) {
  ++step_id_;
  plan_.ready = false;
  const core::StepFacts facts = core::derive_step(batch, config_, Device::cpu());
  core::validate_step_slots(batch, config_.kv_cache->num_slots(), Device::cpu());
  const core::HostLengths& lens = facts.lens;
  StepPlan plan;
  plan.mode = batch.mode;
  plan.batch_size = batch.batch_size;
  if (batch.mode == ForwardMode::kIdle) {
    plan.ready = true;
    plan_ = std::move(plan);
    return;
  }
  const int draft = batch.mode == ForwardMode::kTargetVerify ? batch.spec.draft_token_num : 0;
  for (core::IndexSet set : sets_for(config_)) {
    CpuIndexSet built;
    built.set = set;
    built.layout =
        core::make_paged_layout(batch.mode, set, config_.sliding_window_size, lens, draft);
    build_index_set(built, batch);
    plan.sets.push_back(std::move(built));
  }
  plan.num_tokens = facts.num_tokens;

  if (core::is_extend_like(batch.mode)) {
    plan.use_ragged = facts.ragged;
    if (plan.use_ragged) {
      plan.ragged = core::make_ragged_layout(lens);
      plan.prefix.set = core::IndexSet::kFull;
      plan.prefix.layout = core::make_paged_layout(batch.mode, core::IndexSet::kFull, -1, lens, 0,
                                                   /*prefix_only=*/true);
      build_index_set(plan.prefix, batch);
      plan.any_prefix = plan.prefix.layout.total_kv() > 0;
    }
  }

  if (batch.mode == ForwardMode::kTargetVerify) {
    // A copy: the step's mask is the one given at init_forward_metadata, like every other input.
    const uint8_t* mask = batch.spec.custom_mask.data_as<const uint8_t>();
    plan.custom_mask.assign(mask, mask + batch.spec.custom_mask.numel());
    const TensorView& positions = batch.positions;
    const int64_t num_tree = plan.num_tokens;
    if (config_.sliding_window_size >= 0 && positions.defined()) {
      core::check_index_tensor(positions, "positions", num_tree, Device::cpu());
      std::vector<int64_t> host_positions(static_cast<size_t>(num_tree));
      for (int64_t i = 0; i < num_tree; ++i) {
        // A tree token sits at seq_len + its depth (< draft_token_num): anything else would
        // move the window the token sees.
        const int64_t position = read_index(positions, i);
        const int64_t seq = lens.seq_lens[size_t(i / draft)];
        if (position < seq || position >= seq + draft) {
          throw_error(ErrorKind::kInvalidArgument, "positions[" + std::to_string(i) + "]", "got ",
                      position, ", a tree token of request ", i / draft,
                      " sits at seq_len + its depth, in [", seq, ", ", seq + draft, ")");
        }
        host_positions[size_t(i)] = position;
      }
      plan.window_mask = core::fold_window_into_tree_mask(
          lens, draft, config_.sliding_window_size, plan.custom_mask.data(), host_positions.data());
    }
  }
  if (batch.mode == ForwardMode::kDecode || batch.mode == ForwardMode::kTargetVerify) {
    plan_cascade(plan, lens, batch);
  }
  plan.ready = true;
  plan_ = std::move(plan);
}

// Cascade planning: off in deterministic mode (the groups depend on the batch) and with
// KVATTN_CASCADE=0 (core::cascade_enabled). Groups the engine declares are used as they are
// (after checking its promise); without them, groups this backend finds share at least
// kCascadeMinShared keys, in whole 64-key blocks.
constexpr int kCascadeMinShared = 512;
constexpr int kCascadeAlign = 64;

namespace {

// The engine's promise for declared groups (ForwardBatch::shared_prefix_lens_cpu): every member
// holds its leader's slots in the shared positions and (TARGET_VERIFY) every tree token sees
// them (`hidden_key` gives a member's first shared key some tree token does not see, or -1).
// A broken promise refuses the step here, before anything is written, naming what the CUDA
// backend's device check names: the first member in batch order, its first broken position
// (a slot before a mask at the same position).
void check_declared_groups(const core::CascadePlan& c, const CpuIndexSet& full,
                           const ForwardBatch& batch,
                           const std::function<int64_t(int32_t, int64_t)>& hidden_key) {
  for (int32_t r = 0; r < int32_t(c.shared_row.size()); ++r) {
    const int32_t row = c.shared_row[size_t(r)];
    if (row < 0) continue;
    const auto g = int(std::upper_bound(c.group_indptr.begin(), c.group_indptr.end(), row) -
                       c.group_indptr.begin() - 1);
    const int64_t shared = c.shared_len[size_t(g)];
    const int32_t lead = c.members[size_t(c.group_indptr[size_t(g)])];
    const int32_t* lead_keys = full.kv_indices.data() + full.layout.kv_indptr[size_t(lead)];
    const int32_t* keys = full.kv_indices.data() + full.layout.kv_indptr[size_t(r)];
    const int64_t differs = std::mismatch(keys, keys + shared, lead_keys).first - keys;
    const int64_t hidden = hidden_key ? hidden_key(r, shared) : -1;
    if (differs == shared && hidden < 0) continue;
    core::SharedPrefixViolation v;
    v.group = g;
    v.shared_len = shared;
    v.entry = r;
    v.row = read_index(batch.req_pool_indices, r);
    v.leader = lead;
    v.leader_row = read_index(batch.req_pool_indices, lead);
    v.mask = hidden >= 0 && hidden < differs;
    v.position = v.mask ? hidden : differs;
    if (!v.mask) {
      v.slot = keys[differs];
      v.leader_slot = lead_keys[differs];
    }
    const core::NamedProblem problem = core::describe_shared_prefix_violation(v);
    throw_error(ErrorKind::kInvalidArgument, problem.argument, problem.message);
  }
}

}  // namespace

void CpuBackend::plan_cascade(StepPlan& plan, const core::HostLengths& lens,
                              const ForwardBatch& batch) const {
  if (!core::cascade_enabled(config_.deterministic)) return;
  const CpuIndexSet* full = nullptr;
  for (const CpuIndexSet& s : plan.sets) {
    if (s.set == core::IndexSet::kFull) full = &s;
  }
  if (full == nullptr) return;
  const core::PagedLayout& layout = full->layout;
  // TARGET_VERIFY: a group's shared keys must be visible to every tree token of its members
  // (SGLang's masks show the whole prefix); an automatic group whose mask hides one of them is
  // not formed, a declared one refuses the step.
  const std::function<int64_t(int32_t, int64_t)> hidden_key = [&](int32_t r,
                                                                   int64_t shared) -> int64_t {
    const int64_t q_len = layout.qo_indptr[size_t(r) + 1] - layout.qo_indptr[size_t(r)];
    const int64_t begin = layout.mask_indptr[size_t(r)];
    const int64_t row_len = q_len > 0 ? (layout.mask_indptr[size_t(r) + 1] - begin) / q_len : 0;
    const uint8_t* m = plan.custom_mask.data() + begin + (row_len - layout.kv_len[size_t(r)]);
    int64_t first = -1;
    for (int64_t t = 0; t < q_len; ++t) {
      const uint8_t* row = m + t * row_len;
      const uint8_t* zero = std::find(row, row + shared, uint8_t{0});
      if (zero != row + shared && (first < 0 || zero - row < first)) first = zero - row;
    }
    return first;
  };
  const bool verify = plan.mode == ForwardMode::kTargetVerify;
  core::CascadePlan found;
  if (lens.groups_declared) {
    found = core::declared_cascade_plan(lens);
    check_declared_groups(found, *full, batch,
                          verify ? hidden_key : std::function<int64_t(int32_t, int64_t)>());
  } else {
    std::function<bool(int32_t, int64_t)> sees_shared;
    if (verify) sees_shared = [&](int32_t r, int64_t shared) { return hidden_key(r, shared) < 0; };
    found = core::plan_cascade(layout, full->kv_indices, kCascadeMinShared, kCascadeAlign,
                               sees_shared);
  }
  if (found.empty()) return;
  plan.cascade = std::move(found);
  const core::CascadePlan& c = plan.cascade;
  // The groups' queries (every token of every member, in member order) over their shared keys
  // (no mask: each query sees them all).
  core::PagedLayout& shared = plan.cascade_shared.layout;
  shared.batch_size = c.num_groups();
  shared.qo_indptr.assign(1, 0);
  plan.cascade_token.assign(size_t(layout.batch_size), -1);
  for (int g = 0; g < c.num_groups(); ++g) {
    int32_t tokens = shared.qo_indptr.back();
    for (int32_t i = c.group_indptr[size_t(g)]; i < c.group_indptr[size_t(g) + 1]; ++i) {
      const int32_t r = c.members[size_t(i)];
      plan.cascade_token[size_t(r)] = tokens;
      tokens += layout.qo_indptr[size_t(r) + 1] - layout.qo_indptr[size_t(r)];
    }
    shared.qo_indptr.push_back(tokens);
  }
  shared.kv_start.assign(size_t(c.num_groups()), 0);
  shared.kv_len = c.shared_len;
  shared.kv_indptr.assign(1, 0);
  shared.mask_indptr.clear();
  shared.mask = core::MaskMode::kNone;
  plan.cascade_shared.kv_indices.clear();
  for (int g = 0; g < c.num_groups(); ++g) {
    const int32_t lead = c.members[size_t(c.group_indptr[size_t(g)])];
    const auto first = full->kv_indices.begin() + full->layout.kv_indptr[size_t(lead)];
    plan.cascade_shared.kv_indices.insert(plan.cascade_shared.kv_indices.end(), first,
                                          first + c.shared_len[size_t(g)]);
    shared.kv_indptr.push_back(shared.kv_indptr.back() + c.shared_len[size_t(g)]);
  }
  // Every request over its own keys (a grouped one: past the shared ones).
  core::PagedLayout& own = plan.cascade_own.layout;
  own = full->layout;
  own.kv_indptr.assign(1, 0);
  plan.cascade_own.kv_indices.clear();
  for (int r = 0; r < own.batch_size; ++r) {
    const int32_t skip = c.shared_len_of(r);
    own.kv_start[size_t(r)] = full->layout.kv_start[size_t(r)] + skip;
    own.kv_len[size_t(r)] = full->layout.kv_len[size_t(r)] - skip;
    own.kv_indptr.push_back(own.kv_indptr.back() + own.kv_len[size_t(r)]);
    const auto first = full->kv_indices.begin() + full->layout.kv_indptr[size_t(r)] + skip;
    plan.cascade_own.kv_indices.insert(plan.cascade_own.kv_indices.end(), first,
                                       first + own.kv_len[size_t(r)]);
  }
}

void CpuBackend::attend_cascade(const TensorView& q, const TensorView& out,
                                const AttentionLayer& layer, float* final_lse) {
  const core::CascadePlan& c = plan_.cascade;
  const KvCache& cache = *config_.kv_cache;
  const int heads = layer.num_q_heads;
  const int dim = layer.head_dim;
  const int dv = layer.resolved_v_head_dim();
  const int64_t tokens = plan_.num_tokens;
  const core::PagedLayout& layout = plan_.cascade_own.layout;
  const int64_t grouped = plan_.cascade_shared.layout.total_q();  // the grouped requests' tokens
  // Scratch: the grouped queries (q's dtype), the shared state (grouped rows), then both
  // states in batch order (fp32) and the three LSE arrays.
  const int64_t element = dtype_size(q.dtype());
  cascade_q_.resize(size_t(grouped * heads * dim * element));
  const int64_t rows = tokens * heads;
  cascade_buffers_.resize(size_t(grouped * heads * (dv + 1) + 2 * rows * (dv + 1)));
  float* shared_out = cascade_buffers_.data();
  float* shared_lse = shared_out + grouped * heads * dv;
  float* a_out = shared_lse + grouped * heads;
  float* a_lse = a_out + rows * dv;
  float* b_out = a_lse + rows;
  float* b_lse = b_out + rows * dv;
  const core::HeadStrides qs = core::head_strides(q, dim);
  for (int32_t r : c.members) {
    const int64_t first = layout.qo_indptr[size_t(r)];
    const int64_t count = layout.qo_indptr[size_t(r) + 1] - first;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t to = plan_.cascade_token[size_t(r)] + t;
      for (int h = 0; h < heads; ++h) {
        std::memcpy(cascade_q_.data() + ((to * heads + h) * dim) * element,
                    static_cast<const char*>(q.data()) +
                        ((first + t) * qs.token + h * qs.head) * element,
                    size_t(dim * element));
      }
    }
  }
  const TensorView q_grouped(cascade_q_.data(), q.dtype(), Device::cpu(), {grouped, heads, dim});
  const TensorView shared_view(shared_out, DType::kFloat32, Device::cpu(), {grouped, heads, dv});
  core::AttentionParams shared;
  core::set_query_fields(shared, q_grouped, shared_view, layer);
  set_paged(shared, cache, layer, plan_.cascade_shared);
  shared.lse = shared_lse;
  run_attention(shared, DType::kFloat32, pool_, workspace_);

  const TensorView own_view(b_out, DType::kFloat32, Device::cpu(), {tokens, heads, dv});
  core::AttentionParams own;
  core::set_query_fields(own, q, own_view, layer);
  set_paged(own, cache, layer, plan_.cascade_own);
  // TARGET_VERIFY: the request's own keys are the last columns of its mask rows (the kernels
  // take the last kv_len columns), so the step's mask serves as it is.
  if (plan_.mode == ForwardMode::kTargetVerify) own.custom_mask = plan_.custom_mask.data();
  own.lse = b_lse;
  run_attention(own, DType::kFloat32, pool_, workspace_);

  // The shared state in batch order (an ungrouped request: the empty state), then the merge.
  for (int r = 0; r < layout.batch_size; ++r) {
    const int64_t first = layout.qo_indptr[size_t(r)];
    const int64_t count = layout.qo_indptr[size_t(r) + 1] - first;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t token = first + t;
      const int64_t row = c.shared_row[size_t(r)] < 0 ? -1 : plan_.cascade_token[size_t(r)] + t;
      for (int h = 0; h < heads; ++h) {
        float* dst = a_out + (token * heads + h) * dv;
        if (row < 0) {
          std::fill(dst, dst + dv, 0.f);
          a_lse[token * heads + h] = -INFINITY;
          continue;
        }
        std::memcpy(dst, shared_out + (row * heads + h) * dv, size_t(dv) * sizeof(float));
        a_lse[token * heads + h] = shared_lse[row * heads + h];
      }
    }
  }
  const core::HeadStrides os = core::head_strides(out, dv);
  merge_attention_states(a_out, a_lse, b_out, b_lse, tokens, heads, dv, out.data(), os.token,
                         os.head, out.dtype(), final_lse, pool_);
}

const CpuIndexSet& CpuBackend::index_set(core::IndexSet set) const {
  for (const CpuIndexSet& s : plan_.sets) {
    if (s.set == set) return s;
  }
  throw_error(ErrorKind::kInvalidArgument, "layer", "needs an index set this model's backend does ",
              "not keep (check BackendConfig.sliding_window_size / is_encoder_decoder)");
}

void CpuBackend::forward_decode(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const AttentionLayer& layer,
                                const ForwardBatch& batch, bool save_kv_cache) {
  forward_any(q, k, v, out, layer, batch, save_kv_cache, /*decode_entry=*/true);
}

void CpuBackend::forward_extend(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const AttentionLayer& layer,
                                const ForwardBatch& batch, bool save_kv_cache) {
  forward_any(q, k, v, out, layer, batch, save_kv_cache, /*decode_entry=*/false);
}

void CpuBackend::forward_any(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const AttentionLayer& layer,
                             const ForwardBatch& batch, bool save_kv_cache, bool decode_entry) {
  // ---- every check first: a failed call leaves the KV pool as it was ----
  check_arg(plan_.ready, "batch", "init_forward_metadata was not called (or failed) for this step");
  check_arg(batch.mode == plan_.mode && batch.batch_size == plan_.batch_size, "batch",
            "mode ", forward_mode_name(batch.mode), " batch_size ", batch.batch_size,
            " differs from the step init_forward_metadata planned (",
            forward_mode_name(plan_.mode), ", ", plan_.batch_size, ")");
  check_arg(decode_entry == (batch.mode == ForwardMode::kDecode), "mode",
            decode_entry ? "forward_decode" : "forward_extend", " called for a ",
            forward_mode_name(batch.mode), " batch");
  core::validate_forward_tensors(q, k, v, out, layer, batch, config_, Device::cpu(),
                                 plan_.num_tokens, save_kv_cache);
  if (plan_.mode == ForwardMode::kIdle) return;  // no tokens: nothing to save or compute
  const core::IndexSet set_id = core::index_set_for(layer, config_.is_encoder_decoder);
  const CpuIndexSet& set = index_set(set_id);
  const bool verify = batch.mode == ForwardMode::kTargetVerify;
  const bool window_verify = verify && set_id == core::IndexSet::kWindow;
  check_arg(!window_verify || !plan_.window_mask.empty(), "positions",
            "missing: TARGET_VERIFY on a sliding-window layer needs the tree tokens' positions");
  const bool save = save_kv_cache && k.defined();
  const bool cross = layer.is_cross_attention;
  const TensorView& loc = cross ? batch.encoder_out_cache_loc : batch.out_cache_loc;
  const char* loc_name = cross ? "encoder_out_cache_loc" : "out_cache_loc";
  // The ragged path reads this call's k/v, so it needs them (validated above when saved).
  const bool ragged = plan_.use_ragged && set_id == core::IndexSet::kFull && save;

  // ---- write, then attend ----
  const KvCache& cache = *config_.kv_cache;
  if (save) save_kv(k, v, layer, loc, loc_name, cache, pool_);
  if (plan_.num_tokens == 0) return;

  const int heads = layer.num_q_heads;
  const int dv = layer.resolved_v_head_dim();
  const int64_t rows = plan_.num_tokens * heads;
  // Sinks: the attention leaves each row's LSE here, then apply_sinks folds the sink in.
  const bool sinks = layer.sinks.defined();
  float* final_lse = nullptr;
  if (sinks) {
    sink_lse_.resize(size_t(rows));
    final_lse = sink_lse_.data();
  }
  auto finish = [&] {
    if (!sinks) return;
    const core::HeadStrides os = core::head_strides(out, dv);
    apply_sinks(layer.sinks, final_lse, plan_.num_tokens, heads, dv, out.data(), os.token,
                os.head, out.dtype(), pool_);
  };

  core::AttentionParams params;
  core::set_query_fields(params, q, out, layer);
  params.deterministic = config_.deterministic;
  params.lse = final_lse;
  if (!ragged && !plan_.cascade.empty() && set_id == core::IndexSet::kFull && !cross) {
    attend_cascade(q, out, layer, final_lse);
    finish();
    return;
  }
  if (!ragged) {
    set_paged(params, cache, layer, set);
    if (verify) {
      params.custom_mask = window_verify ? plan_.window_mask.data() : plan_.custom_mask.data();
    }
    run_attention(params, q.dtype(), pool_, workspace_);
    finish();
    return;
  }

  // Ragged + paged prefix: both halves in fp32 with their LSEs, then one merge.
  set_ragged(params, k, v, layer, plan_.ragged);
  if (!plan_.any_prefix) {
    run_attention(params, q.dtype(), pool_, workspace_);
    finish();
    return;
  }
  merge_buffers_.resize(size_t(rows) * (2 * dv + 2));
  float* out_new = merge_buffers_.data();
  float* out_prefix = out_new + rows * dv;
  float* lse_new = out_prefix + rows * dv;
  float* lse_prefix = lse_new + rows;
  params.out = out_new;
  params.out_stride_token = int64_t(heads) * dv;
  params.out_stride_head = dv;
  params.lse = lse_new;
  run_attention(params, DType::kFloat32, pool_, workspace_);

  core::AttentionParams prefix_params;
  core::set_query_fields(prefix_params, q, out, layer);
  prefix_params.deterministic = config_.deterministic;
  set_paged(prefix_params, cache, layer, plan_.prefix);
  prefix_params.out = out_prefix;
  prefix_params.out_stride_token = int64_t(heads) * dv;
  prefix_params.out_stride_head = dv;
  prefix_params.lse = lse_prefix;
  run_attention(prefix_params, DType::kFloat32, pool_, workspace_);

  const core::HeadStrides os = core::head_strides(out, dv);
  merge_attention_states(out_new, lse_new, out_prefix, lse_prefix, plan_.num_tokens, heads, dv,
                         out.data(), os.token, os.head, out.dtype(), final_lse, pool_);
  finish();
}

// ---- CpuDraftRunner ----------------------------------------------------------------------------

CpuDraftRunner::CpuDraftRunner(const BackendConfig& config, int topk, int num_steps)
    : config_((check_host_config(config), config)),
      topk_(topk),
      num_steps_(num_steps),
      pool_(resolve_num_threads(config.num_threads)) {
  check_arg(topk >= 1, "topk", "got ", topk, ", expected >= 1");
  check_arg(num_steps >= 1, "num_steps", "got ", num_steps, ", expected >= 1");
  if (config.is_encoder_decoder) {
    throw_error(ErrorKind::kNotSupported, "is_encoder_decoder",
                "the multi-step draft backend runs decoder-only draft models");
  }
}

void CpuDraftRunner::init_forward_metadata(const ForwardBatch& batch) {
  ++step_id_;
  ready_ = false;
  check_arg(batch.mode == ForwardMode::kDecode, "mode", "got ", forward_mode_name(batch.mode),
            ", the multi-step draft backend runs DECODE batches");
  const core::StepFacts facts = core::derive_step(batch, config_, Device::cpu());
  const core::HostLengths& lens = facts.lens;
  const ReqToTokenPool& pool = *config_.req_to_token_pool;
  const int bs = batch.batch_size;
  const int64_t draft_positions = int64_t(num_steps_) * topk_;
  for (int r = 0; r < bs; ++r) {
    check_arg(lens.seq_lens[r] + draft_positions <= pool.max_context_len(),
              "seq_lens[" + std::to_string(r) + "]", "got ", lens.seq_lens[r], "; with ",
              num_steps_, " steps x ", topk_, " branches of draft tokens the request needs ",
              lens.seq_lens[r] + draft_positions, " positions, max_context_len is ",
              pool.max_context_len());
  }
  const int64_t num_slots = config_.kv_cache->num_slots();
  const int queries = bs * topk_;
  std::vector<CpuIndexSet> steps(static_cast<size_t>(num_steps_));
  // The draft tokens' slots, read once: [bs][num_steps * topk].
  std::vector<int32_t> prefix_slots;
  std::vector<int64_t> prefix_begin(size_t(bs) + 1, 0);
  std::vector<int32_t> draft_slots;
  for (int r = 0; r < bs; ++r) {
    const int64_t row = read_index(batch.req_pool_indices, r);
    append_slots(pool, row, 0, lens.seq_lens[r], num_slots, prefix_slots);
    prefix_begin[size_t(r) + 1] = int64_t(prefix_slots.size());
    append_slots(pool, row, lens.seq_lens[r], draft_positions, num_slots, draft_slots);
  }
  // Shared prefix: a request's topk branches read its prefix once a step, as the query rows of
  // one request whose keys are the prefix and the draft tokens of steps 0..s (in req_to_token
  // order: step t's branch b at prefix + t * topk + b), branch b's mask row keeping the prefix
  // and its own draft tokens. A window model keeps one decode query a branch (its keys are then
  // in position order, which the window bound needs).
  static const bool shared_wanted = [] {
    const char* v = std::getenv("KVATTN_DRAFT_SHARED_PREFIX");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  branch_masks_.clear();
  if (shared_wanted && topk_ > 1 && config_.sliding_window_size < 0) {
    branch_masks_.resize(size_t(num_steps_));
    for (int s = 0; s < num_steps_; ++s) {
      CpuIndexSet& step = steps[size_t(s)];
      const int drafts_seen = (s + 1) * topk_;
      step.layout = core::make_draft_step_layout(lens.seq_lens, topk_, s, /*shared_prefix=*/true,
                                                 /*full_mask_rows=*/true);
      std::vector<uint8_t>& mask = branch_masks_[size_t(s)];
      for (int r = 0; r < bs; ++r) {
        const int32_t seq = lens.seq_lens[size_t(r)];
        const int32_t* prefix = prefix_slots.data() + prefix_begin[size_t(r)];
        const int32_t* drafts = draft_slots.data() + int64_t(r) * draft_positions;
        step.kv_indices.insert(step.kv_indices.end(), prefix, prefix + seq);
        step.kv_indices.insert(step.kv_indices.end(), drafts, drafts + drafts_seen);
        for (int b = 0; b < topk_; ++b) {
          mask.insert(mask.end(), size_t(seq), uint8_t(1));
          for (int j = 0; j < drafts_seen; ++j) mask.push_back(j % topk_ == b ? 1 : 0);
        }
      }
    }
  }
  for (int s = 0; s < num_steps_ && branch_masks_.empty(); ++s) {
    CpuIndexSet& step = steps[size_t(s)];
    step.layout = core::make_draft_step_layout(lens.seq_lens, topk_, s, /*shared_prefix=*/false,
                                               /*full_mask_rows=*/false);
    for (int r = 0; r < bs; ++r) {
      const int32_t* prefix = prefix_slots.data() + prefix_begin[size_t(r)];
      const int32_t* drafts = draft_slots.data() + int64_t(r) * draft_positions;
      for (int b = 0; b < topk_; ++b) {
        step.kv_indices.insert(step.kv_indices.end(), prefix, prefix + lens.seq_lens[r]);
        for (int t = 0; t <= s; ++t) step.kv_indices.push_back(drafts[t * topk_ + b]);
      }
    }
  }
  steps_ = std::move(steps);
  num_queries_ = queries;
  ready_ = true;
}

void CpuDraftRunner::forward_step(int step, const TensorView& q, const TensorView& k,
                                  const TensorView& v, const TensorView& out,
                                  const AttentionLayer& layer, const TensorView& out_cache_loc) {
  check_arg(ready_, "init_forward_metadata", "was not called (or failed) before forward_step");
  check_arg(step >= 0 && step < num_steps_, "step", "got ", step, ", expected 0..", num_steps_ - 1);
  check_arg(!layer.is_cross_attention, "layer.is_cross_attention",
            "the multi-step draft backend has no cross-attention");
  ForwardBatch step_batch;
  step_batch.mode = ForwardMode::kDecode;
  step_batch.batch_size = num_queries_;
  step_batch.out_cache_loc = out_cache_loc;
  const bool save = out_cache_loc.defined() && k.defined();
  core::validate_forward_tensors(q, k, v, out, layer, step_batch, config_, Device::cpu(),
                                 num_queries_, save);
  const KvCache& cache = *config_.kv_cache;
  if (save) save_kv(k, v, layer, out_cache_loc, "out_cache_loc", cache, pool_);
  if (num_queries_ == 0) return;
  core::AttentionParams params;
  core::set_query_fields(params, q, out, layer);
  params.deterministic = config_.deterministic;
  set_paged(params, cache, layer, steps_[size_t(step)]);
  if (!branch_masks_.empty()) {
    params.custom_mask = branch_masks_[size_t(step)].data();
  } else {
    // The step's keys are in position order (prefix, then the branch's drafts), so a window is
    // the usual bottom-right bound.
    params.window_left = layer.sliding_window_size;
  }
  const int dv = layer.resolved_v_head_dim();
  if (layer.sinks.defined()) {  // as CpuBackend::forward_any: the LSE, then the sink folded in
    sink_lse_.resize(size_t(num_queries_) * layer.num_q_heads);
    params.lse = sink_lse_.data();
  }
  run_attention(params, q.dtype(), pool_, workspace_);
  if (layer.sinks.defined()) {
    const core::HeadStrides os = core::head_strides(out, dv);
    apply_sinks(layer.sinks, sink_lse_.data(), num_queries_, layer.num_q_heads, dv, out.data(),
                os.token, os.head, out.dtype(), pool_);
  }
}

std::unique_ptr<AttentionBackend> make_cpu_backend(const BackendConfig& config) {
  return std::make_unique<CpuBackend>(config);
}

std::unique_ptr<core::DraftRunner> make_cpu_draft_runner(const BackendConfig& config, int topk,
                                                         int num_steps) {
  return std::make_unique<CpuDraftRunner>(config, topk, num_steps);
}

}  // namespace kvattn::cpu

namespace kvattn {

CpuBackendInfo cpu_backend_info() {
  CpuBackendInfo info;
  info.num_threads = cpu::resolve_num_threads(0);
  info.avx512_bf16 = cpu::avx512::bf16_available();
  info.amx_bf16 = cpu::amx::available();
  return info;
}

}  // namespace kvattn
