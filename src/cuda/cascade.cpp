// Shared-prefix (cascade) attention on the CUDA backend (see cascade.h).
#include "cuda/cascade.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/params_fill.h"
#include "core/size_check.h"
#include "cuda/kernels/cascade.h"
#include "cuda/kernels/decode.h"
#include "cuda/kernels/kv_write.h"
#include "kvattn/error.h"

namespace kvattn::cuda {
namespace {

// The scratch regions of one layer: gathered q, shared out, shared LSE, own out, own LSE.
struct ScratchLayout {
  size_t q = 0, shared_out = 0, shared_lse = 0, own_out = 0, own_lse = 0, total = 0;
};
ScratchLayout scratch_layout(const CascadeStep& step, const BackendConfig& config,
                             DType compute_dtype) {
  const int64_t heads = config.num_q_heads;
  const int64_t vd = config.v_head_dim > 0 ? config.v_head_dim : config.head_dim;
  const int64_t shared = std::max<int64_t>(step.shared_tokens, 1);
  const int64_t tokens = std::max<int64_t>(step.num_tokens, 1);
  const char* what = "cascade scratch";
  ScratchLayout s;
  s.q = 0;
  s.shared_out = align_region(core::checked_bytes(
      {shared, heads, config.head_dim, int64_t(dtype_size(compute_dtype))}, what));
  s.shared_lse = s.shared_out + align_region(core::checked_bytes({shared, heads, vd, 4}, what));
  s.own_out = s.shared_lse + align_region(core::checked_bytes({shared, heads, 4}, what));
  s.own_lse = s.own_out + align_region(core::checked_bytes({tokens, heads, vd, 4}, what));
  s.total = s.own_lse + align_region(core::checked_bytes({tokens, heads, 4}, what));
  return s;
}

}  // namespace

void make_cascade_layouts(CascadeStep& step, core::CascadePlan groups,
                          const core::PagedLayout& full) {
  step.groups = std::move(groups);
  const core::CascadePlan& c = step.groups;
  const int num_groups = c.num_groups();

  // The groups' queries (every token of every member, in member order) over their shared
  // keys: one entry a group, no mask (each of its queries sees them all).
  core::PagedLayout& shared = step.shared.layout;
  shared = core::PagedLayout();
  shared.batch_size = num_groups;
  shared.mask = core::MaskMode::kNone;
  shared.window_left = -1;
  shared.qo_indptr.assign(1, 0);
  shared.kv_indptr.assign(1, 0);
  shared.kv_start.assign(size_t(num_groups), 0);
  shared.kv_len = c.shared_len;
  step.max_shared_len = 0;
  for (int g = 0; g < num_groups; ++g) {
    int64_t tokens = shared.qo_indptr.back();
    for (int32_t i = c.group_indptr[size_t(g)]; i < c.group_indptr[size_t(g) + 1]; ++i) {
      const int32_t r = c.members[size_t(i)];
      tokens += full.qo_indptr[size_t(r) + 1] - full.qo_indptr[size_t(r)];
    }
    shared.qo_indptr.push_back(int32_t(tokens));  // <= the step's tokens, which fit int32
    shared.kv_indptr.push_back(shared.kv_indptr.back() + c.shared_len[size_t(g)]);
    step.max_shared_len = std::max(step.max_shared_len, c.shared_len[size_t(g)]);
  }
  step.shared_tokens = shared.total_q();
  step.num_tokens = full.total_q();

  // Every request over its own keys: a member's start past its group's shared ones. The mask
  // (TARGET_VERIFY) and its offsets stay the full layout's: the kernels take the last kv_len
  // columns of each mask row, which are exactly the own keys.
  core::PagedLayout& own = step.own.layout;
  own = full;
  own.kv_indptr.assign(1, 0);
  for (int r = 0; r < own.batch_size; ++r) {
    const int32_t skip = c.shared_len_of(r);
    own.kv_start[size_t(r)] += skip;
    own.kv_len[size_t(r)] -= skip;
    own.kv_indptr.push_back(own.kv_indptr.back() + own.kv_len[size_t(r)]);
  }
  step.shared.paged = step.own.paged = true;
  step.shared.custom_mask = nullptr;
  step.shared.fold_window = step.own.fold_window = false;
}

void upload_cascade_arrays(CascadeStep& step, const BackendConfig& config, DType compute_dtype,
                           Device device, cudaStream_t stream) {
  const core::CascadePlan& c = step.groups;
  const core::PagedLayout& full = step.own.layout;  // same query rows as the full layout
  const size_t num_members = c.members.size();
  const size_t num_groups = size_t(c.num_groups());
  const size_t batch = size_t(full.batch_size);
  auto region = [](size_t& offset, size_t count) {
    const size_t at = offset;
    offset += align_region(std::max<size_t>(count, 1) * sizeof(int32_t));
    return at;
  };
  size_t bytes = 0;
  step.members = region(bytes, num_members);
  step.member_group = region(bytes, num_members);
  step.group_leader = region(bytes, num_groups);
  step.group_len = region(bytes, num_groups);
  step.entry_group = region(bytes, batch);
  step.gather_rows = region(bytes, size_t(step.shared_tokens));
  step.shared_row = region(bytes, size_t(step.num_tokens));

  if (!step.fence) step.fence = std::make_unique<CopyFence>();
  step.fence->wait();  // the previous step's copy out of staging is done
  ensure_bytes(step.arrays, bytes, /*frozen=*/false, device, "cascade arrays");
  if (step.staging.bytes() < bytes) step.staging.reserve(bytes);
  const ScratchLayout scratch = scratch_layout(step, config, compute_dtype);
  ensure_bytes(step.scratch, scratch.total, /*frozen=*/false, device, "cascade scratch");

  char* host = static_cast<char*>(step.staging.data());
  std::memset(host, 0, bytes);
  auto at = [&](size_t offset) { return reinterpret_cast<int32_t*>(host + offset); };
  int32_t* members = at(step.members);
  int32_t* member_group = at(step.member_group);
  int32_t* group_leader = at(step.group_leader);
  int32_t* group_len = at(step.group_len);
  int32_t* entry_group = at(step.entry_group);
  int32_t* gather_rows = at(step.gather_rows);
  int32_t* shared_row = at(step.shared_row);
  std::fill(entry_group, entry_group + batch, -1);
  std::fill(shared_row, shared_row + step.num_tokens, -1);
  int32_t next = 0;  // the shared call's query rows, in member order
  for (size_t g = 0; g < num_groups; ++g) {
    group_leader[g] = c.members[size_t(c.group_indptr[g])];
    group_len[g] = c.shared_len[g];
    for (int32_t i = c.group_indptr[g]; i < c.group_indptr[g + 1]; ++i) {
      const int32_t r = c.members[size_t(i)];
      members[i] = r;
      member_group[i] = int32_t(g);
      entry_group[r] = int32_t(g);
      for (int32_t t = full.qo_indptr[size_t(r)]; t < full.qo_indptr[size_t(r) + 1]; ++t) {
        gather_rows[next] = t;
        shared_row[t] = next++;
      }
    }
  }
  check_cuda(cudaMemcpyAsync(step.arrays.data(), host, bytes, cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync(cascade arrays)");
  step.fence->record(stream);
}

void build_cascade_indices(const CascadeStep& step, const ReqToTokenSource& source,
                           int64_t num_slots, const uint8_t* custom_mask, int draft_token_num,
                           StepState* state, cudaStream_t stream) {
  // TARGET_VERIFY on the decode-shaped kernel: the own keys' all-ones mask columns (the
  // committed tokens past the shared ones) are skipped as in a plain step.
  scan_mask_dense_prefix(step.own, stream);
  for (const CallState* call : {&step.own, &step.shared}) {
    KvIndexBuild build;
    build.source = source;
    build.entries = call == &step.shared ? step.array(step.group_leader) : nullptr;
    build.kv_start = call->meta<int32_t>(call->offsets.kv_start);
    build.kv_len = call->meta<int32_t>(call->offsets.kv_len);
    build.kv_indptr = call->meta<int64_t>(call->offsets.kv_indptr);
    build.batch_size = call->layout.batch_size;
    build.kv_indices = static_cast<int32_t*>(call->kv_indices.data());
    build.num_slots = num_slots;
    build.step_state = state;
    build.max_kv_len = call->max_kv_len;
    launch_build_kv_indices(build, stream);
  }
  SharedPrefixCheck check;
  check.source = source;
  check.members = step.array(step.members);
  check.member_group = step.array(step.member_group);
  check.group_leader = step.array(step.group_leader);
  check.group_len = step.array(step.group_len);
  check.num_members = int(step.groups.members.size());
  check.max_shared_len = step.max_shared_len;
  if (custom_mask != nullptr) {
    check.custom_mask = custom_mask;
    check.mask_indptr = step.own.meta<int64_t>(step.own.offsets.mask_indptr);
    check.draft_token_num = draft_token_num;
  }
  check.step_state = state;
  launch_check_shared_prefix(check, stream);
}

void describe_cascade_for_step_check(const CascadeStep& step, StepCheckLaunch& check) {
  check.entry_group = step.array(step.entry_group);
  check.group_leader = step.array(step.group_leader);
  check.group_len = step.array(step.group_len);
}

void attend_cascade(const CascadeStep& step, const BackendConfig& cfg, DType compute_dtype,
                    const AttentionLayer& layer, const TensorView& q, const TensorView& out,
                    float* lse, const StepState* state, Device device, cudaStream_t stream) {
  const int heads = cfg.num_q_heads;
  const int dim = cfg.head_dim;
  const int vd = cfg.v_head_dim > 0 ? cfg.v_head_dim : cfg.head_dim;
  const ScratchLayout s = scratch_layout(step, cfg, compute_dtype);
  char* base = static_cast<char*>(step.scratch.data());
  float* shared_lse = reinterpret_cast<float*>(base + s.shared_lse);
  float* own_lse = reinterpret_cast<float*>(base + s.own_lse);
  const TensorView q_shared(base + s.q, compute_dtype, device, {step.shared_tokens, heads, dim});
  const TensorView shared_out(base + s.shared_out, DType::kFloat32, device,
                              {step.shared_tokens, heads, vd});
  const TensorView own_out(base + s.own_out, DType::kFloat32, device,
                           {step.num_tokens, heads, vd});

  // 1. The grouped queries, in member order (16-bit: the prefill family's io).
  ConvertRowsLaunch gather;
  const core::HeadStrides qs = core::head_strides(q, dim);
  gather.src = q.data();
  gather.src_stride_token = qs.token;
  gather.src_stride_head = qs.head;
  gather.src_dtype = q.dtype();
  gather.dst = q_shared.data();
  gather.dst_stride_token = int64_t(heads) * dim;
  gather.dst_stride_head = dim;
  gather.dst_dtype = compute_dtype;
  gather.rows = step.shared_tokens;
  gather.heads = heads;
  gather.dim = dim;
  gather.src_rows = step.array(step.gather_rows);
  gather.step_error = &state->error;
  launch_convert_rows(gather, stream);

  // 2. Shared keys, once a group; 3. own keys, every request. Both states stay fp32.
  core::AttentionParams shared =
      make_params(step.shared, cfg, layer, q_shared, shared_out, shared_lse, {}, {}, state);
  shared.out_fp32 = true;
  run_call(step.shared, shared, device.index, stream);
  core::AttentionParams own =
      make_params(step.own, cfg, layer, q, own_out, own_lse, {}, {}, state);
  own.out_fp32 = true;
  run_call(step.own, own, device.index, stream);

  // 4. The merge: a token's shared state is row shared_row[token] (none when ungrouped).
  MergeStatesLaunch m;
  const core::HeadStrides os = core::head_strides(out, vd);
  m.o_a = shared_out.data();
  m.lse_a = shared_lse;
  m.a_rows = step.array(step.shared_row);
  m.o_b = own_out.data();
  m.lse_b = own_lse;
  m.out = out.data();
  m.stride_token = os.token;
  m.stride_head = os.head;
  m.a_stride_token = m.b_stride_token = int64_t(heads) * vd;
  m.a_stride_head = m.b_stride_head = vd;
  m.partial_dtype = DType::kFloat32;
  m.io_dtype = out.dtype();
  m.num_tokens = step.num_tokens;
  m.num_heads = heads;
  m.v_head_dim = vd;
  m.lse_out = lse;
  m.step_error = &state->error;
  launch_merge_states(m, stream);
}

}  // namespace kvattn::cuda
