#include "core/batch_layout.h"

#include <algorithm>
#include <string>

#include "kvattn/error.h"

namespace kvattn::core {
bool is_extend_like(ForwardMode mode) {
  return mode == ForwardMode::kExtend || mode == ForwardMode::kMixed ||
         mode == ForwardMode::kDraftExtend;
}

namespace {

// The host copy of a length tensor: `host` when given, else `device` when it lives on the host.
std::vector<int32_t> read_lengths(const TensorView& host, const TensorView& device,
                                  const std::string& name, int batch_size) {
  const TensorView& t = host.defined() ? host : device;
  const std::string arg = host.defined() ? name + "_cpu" : name;
  if (!t.defined()) {
    throw_error(ErrorKind::kInvalidArgument, name, "missing: required by this mode");
  }
  check_arg(t.device().is_cpu(), arg, "is on ", t.device().str(), "; pass a host copy in ",
            name, "_cpu");
  check_arg(is_index_dtype(t.dtype()), arg, "dtype ", dtype_name(t.dtype()),
            ", expected int32 or int64");
  check_arg(t.ndim() == 1 && t.size(0) == batch_size, arg, "shape ", t,
            ", expected [", batch_size, "]");
  std::vector<int32_t> out(static_cast<size_t>(batch_size));
  for (int r = 0; r < batch_size; ++r) {
    const int64_t value = read_index(t, r);
    if (value < 0 || value > INT32_MAX) {  // the name is built only on failure (every step)
      throw_error(ErrorKind::kInvalidArgument, arg + "[" + std::to_string(r) + "]", "got ",
                  value, ", expected a length in [0, 2^31)");
    }
    out[r] = int32_t(value);
  }
  // Both copies on the host (the CPU backend): they must agree, or the step would be planned
  // from one and described to the caller by the other. A device copy is never read.
  if (host.defined() && device.defined() && device.device().is_cpu() &&
      device.data() != host.data() && is_index_dtype(device.dtype()) && device.ndim() == 1 &&
      device.size(0) == batch_size) {
    for (int r = 0; r < batch_size; ++r) {
      const int64_t value = read_index(device, r);
      if (value != out[r]) {
        throw_error(ErrorKind::kInvalidArgument, name + "[" + std::to_string(r) + "]", "got ",
                    value, ", its host copy ", name, "_cpu[", r, "] is ", out[r],
                    ": the two copies must agree");
      }
    }
  }
  return out;
}

// A host index tensor of the shared-prefix groups: 1-D int32/int64 of `length` elements.
void check_host_group_tensor(const TensorView& t, const char* name, int64_t length) {
  check_arg(t.device().is_cpu(), name, "is on ", t.device().str(), ", expected a host tensor");
  check_arg(is_index_dtype(t.dtype()), name, "dtype ", dtype_name(t.dtype()),
            ", expected int32 or int64");
  check_arg(t.ndim() == 1 && (length < 0 || t.size(0) == length), name, "shape ", t,
            ", expected [", length < 0 ? std::string("num_groups") : std::to_string(length), "]");
  check_arg(t.data() != nullptr || t.size(0) == 0, name, "is null");
}

// ForwardBatch::shared_prefix_group_cpu / shared_prefix_lens_cpu (forward_batch.h).
void read_shared_prefix_groups(const ForwardBatch& batch, bool is_encoder_decoder,
                               HostLengths& lens) {
  const TensorView& group = batch.shared_prefix_group_cpu;
  const TensorView& len = batch.shared_prefix_lens_cpu;
  if (!group.defined()) {
    check_arg(!len.defined(), "shared_prefix_lens_cpu",
              "given without shared_prefix_group_cpu (the group of each request)");
    return;
  }
  const bool verify = batch.mode == ForwardMode::kTargetVerify;
  if (batch.mode != ForwardMode::kDecode && !verify) {
    throw_error(ErrorKind::kNotSupported, "shared_prefix_group_cpu", "given for a batch of mode ",
                forward_mode_name(batch.mode),
                "; shared-prefix groups serve DECODE and TARGET_VERIFY batches");
  }
  if (is_encoder_decoder) {
    throw_error(ErrorKind::kNotSupported, "shared_prefix_group_cpu",
                "shared-prefix groups are not supported in encoder-decoder models");
  }
  const int bs = batch.batch_size;
  check_host_group_tensor(group, "shared_prefix_group_cpu", bs);
  int64_t num_groups = 0;
  if (len.defined()) {
    check_host_group_tensor(len, "shared_prefix_lens_cpu", -1);
    num_groups = len.size(0);
  }
  check_arg(num_groups <= bs / 2, "shared_prefix_lens_cpu", "has ", num_groups,
            " groups, a batch of ", bs, " requests holds at most ", bs / 2,
            " (a group has >= 2 members)");
  lens.groups_declared = true;
  lens.shared_group.resize(size_t(bs));
  lens.shared_prefix_lens.resize(size_t(num_groups));
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t value = read_index(len, g);
    if (value < 1 || value > INT32_MAX) {
      throw_error(ErrorKind::kInvalidArgument, "shared_prefix_lens_cpu[" + std::to_string(g) + "]",
                  "got ", value, ", expected a shared length >= 1");
    }
    lens.shared_prefix_lens[size_t(g)] = int32_t(value);
  }
  std::vector<int32_t> members(size_t(num_groups), 0);
  std::vector<int32_t> first(size_t(num_groups), -1);
  for (int r = 0; r < bs; ++r) {
    const int64_t g = read_index(group, r);
    if (g < -1 || g >= num_groups) {
      throw_error(ErrorKind::kInvalidArgument, "shared_prefix_group_cpu[" + std::to_string(r) + "]",
                  "got ", g, ", expected -1 (no group) or a group in [0, ", num_groups,
                  ") (num_groups = the length of shared_prefix_lens_cpu)");
    }
    lens.shared_group[size_t(r)] = int32_t(g);
    if (g < 0) continue;
    ++members[size_t(g)];
    if (first[size_t(g)] < 0) first[size_t(g)] = r;
    // Every member keeps >= 1 own key (DECODE: its new token; TARGET_VERIFY: its tree tokens,
    // which the shared keys must not reach: their mask columns differ by member).
    const int64_t shared = lens.shared_prefix_lens[size_t(g)];
    const int64_t seq = lens.seq_lens[size_t(r)];
    if (verify ? shared > seq : shared >= seq) {
      throw_error(ErrorKind::kInvalidArgument, "shared_prefix_lens_cpu[" + std::to_string(g) + "]",
                  "got ", shared, ", but request ", r, " of group ", g, " has seq_lens[", r,
                  "] = ", seq, "; expected ", verify ? "<= seq_len" : "< seq_len",
                  " of every member (", verify ? "the tree tokens" : "the new token",
                  " and what follows the shared prefix are the member's own)");
    }
  }
  for (int64_t g = 0; g < num_groups; ++g) {
    if (members[size_t(g)] >= 2) continue;
    throw_error(ErrorKind::kInvalidArgument, "shared_prefix_lens_cpu[" + std::to_string(g) + "]",
                "group ", g, " has ", members[size_t(g)], " member",
                members[size_t(g)] == 1 ? " (request " + std::to_string(first[size_t(g)]) + ")"
                                        : std::string("s"),
                " in shared_prefix_group_cpu, expected >= 2");
  }
}

}  // namespace

HostLengths read_host_lengths(const ForwardBatch& batch, bool is_encoder_decoder) {
  check_arg(batch.batch_size >= 0, "batch_size", "got ", batch.batch_size, ", expected >= 0");
  HostLengths lens;
  if (batch.mode == ForwardMode::kIdle) return lens;
  const int bs = batch.batch_size;
  lens.seq_lens = read_lengths(batch.seq_lens_cpu, batch.seq_lens, "seq_lens", bs);
  if (is_extend_like(batch.mode)) {
    lens.prefix_lens =
        read_lengths(batch.extend_prefix_lens_cpu, batch.extend_prefix_lens, "extend_prefix_lens", bs);
    const bool have_extend = batch.extend_seq_lens_cpu.defined() ||
                             (batch.extend_seq_lens.defined() &&
                              batch.extend_seq_lens.device().is_cpu());
    if (have_extend) {
      lens.extend_lens =
          read_lengths(batch.extend_seq_lens_cpu, batch.extend_seq_lens, "extend_seq_lens", bs);
    }
    for (int r = 0; r < bs; ++r) {
      const std::string at = "[" + std::to_string(r) + "]";
      check_arg(lens.prefix_lens[r] <= lens.seq_lens[r], "extend_prefix_lens" + at, "got ",
                lens.prefix_lens[r], ", expected <= seq_lens", at, " = ", lens.seq_lens[r]);
      const int32_t extend = lens.seq_lens[r] - lens.prefix_lens[r];
      if (have_extend) {
        check_arg(lens.extend_lens[r] == extend, "extend_seq_lens" + at, "got ",
                  lens.extend_lens[r], ", expected seq_lens - extend_prefix_lens = ", extend);
      }
    }
    if (!have_extend) {
      lens.extend_lens.resize(size_t(bs));
      for (int r = 0; r < bs; ++r) lens.extend_lens[r] = lens.seq_lens[r] - lens.prefix_lens[r];
    }
  }
  if (is_encoder_decoder) {
    lens.encoder_lens = read_lengths(batch.encoder_lens_cpu, batch.encoder_lens, "encoder_lens", bs);
  }
  read_shared_prefix_groups(batch, is_encoder_decoder, lens);
  return lens;
}

IndexSet index_set_for(const AttentionLayer& layer, bool is_encoder_decoder) {
  if (is_encoder_decoder) return layer.is_cross_attention ? IndexSet::kEncoder : IndexSet::kDecoderSelf;
  return layer.sliding_window_size >= 0 ? IndexSet::kWindow : IndexSet::kFull;
}

PagedLayout make_paged_layout(ForwardMode mode, IndexSet set, int window, const HostLengths& lens,
                              int draft_token_num, bool prefix_only) {
  PagedLayout layout;
  const int bs = int(lens.seq_lens.size());
  const bool verify = mode == ForwardMode::kTargetVerify;
  // What this mode and index set read must be there (read_host_lengths fills it for the modes
  // and models that need it; a caller that mixes them up gets an error, not a wild read).
  const size_t n = size_t(bs);
  check_arg(!is_extend_like(mode) || lens.extend_lens.size() == n, "extend_seq_lens",
            "missing: ", forward_mode_name(mode), " needs the extend lengths");
  check_arg(!prefix_only || lens.prefix_lens.size() == n, "extend_prefix_lens",
            "missing: the paged-prefix layout needs the prefix lengths");
  check_arg((set != IndexSet::kEncoder && set != IndexSet::kDecoderSelf) ||
                lens.encoder_lens.size() == n,
            "encoder_lens", "missing: the encoder and decoder-self index sets need them");
  check_arg(set != IndexSet::kWindow || window >= 0, "sliding_window_size", "got ", window,
            ", the window index set needs a window >= 0");
  check_arg(!verify || draft_token_num >= 0, "spec.draft_token_num", "got ", draft_token_num,
            ", expected >= 0");
  layout.batch_size = bs;
  layout.qo_indptr.assign(size_t(bs) + 1, 0);
  layout.kv_start.assign(size_t(bs), 0);
  layout.kv_len.assign(size_t(bs), 0);
  layout.kv_indptr.assign(size_t(bs) + 1, 0);
  layout.mask = verify ? MaskMode::kCustom : MaskMode::kCausal;
  if (prefix_only || set == IndexSet::kEncoder) layout.mask = MaskMode::kNone;
  // A window applies through the mask bounds; in TARGET_VERIFY the backend folds it into the
  // tree mask instead (tree tokens' positions are not consecutive).
  layout.window_left = (set == IndexSet::kWindow && !verify && !prefix_only) ? window : -1;
  if (verify) layout.mask_indptr.assign(size_t(bs) + 1, 0);

  // In int64, checked to fit the int32 arrays: lengths come validated against the pools, but
  // an overflow here would be a wild index later.
  auto fits = [](int64_t value, const char* what, int r) {
    if (value < 0 || value > INT32_MAX) {
      throw_error(ErrorKind::kInvalidArgument, what, "request ", r, " gives ", value,
                  ", outside [0, 2^31)");
    }
    return int32_t(value);
  };
  for (int r = 0; r < bs; ++r) {
    int64_t q_len = 1;
    if (is_extend_like(mode)) q_len = lens.extend_lens[r];
    else if (verify) q_len = draft_token_num;
    else if (mode == ForwardMode::kIdle) q_len = 0;

    const int64_t seq = int64_t(lens.seq_lens[r]) + (verify ? draft_token_num : 0);
    int64_t start = 0;
    int64_t len = seq;
    if (set == IndexSet::kEncoder) {
      len = lens.encoder_lens[r];
    } else {
      const int64_t base = set == IndexSet::kDecoderSelf ? lens.encoder_lens[r] : 0;
      if (prefix_only) {
        len = lens.prefix_lens[r];
      } else if (set == IndexSet::kWindow && !verify) {
        // Decode sees min(seq, W + 1) tokens; an extend of q_len sees W + q_len at most.
        len = std::min<int64_t>(seq, int64_t(window) + q_len);
      }
      start = base + (prefix_only ? 0 : seq - len);
    }
    layout.qo_indptr[r + 1] = fits(int64_t(layout.qo_indptr[r]) + q_len, "qo_indptr", r);
    layout.kv_start[r] = fits(start, "kv_start", r);
    layout.kv_len[r] = fits(len, "kv_len", r);
    fits(start + len, "kv_start + kv_len", r);
    layout.kv_indptr[r + 1] = layout.kv_indptr[r] + len;
    if (verify) layout.mask_indptr[r + 1] = layout.mask_indptr[r] + q_len * len;
  }
  return layout;
}

PagedLayout make_draft_step_layout(std::span<const int32_t> seq_lens, int topk, int step,
                                   bool shared_prefix, bool full_mask_rows) {
  const int bs = int(seq_lens.size());
  const int n = shared_prefix ? bs : bs * topk;
  PagedLayout layout;
  layout.batch_size = n;
  layout.mask = shared_prefix ? MaskMode::kCustom : MaskMode::kCausal;
  layout.qo_indptr.assign(size_t(n) + 1, 0);
  layout.kv_start.assign(size_t(n), 0);
  layout.kv_len.assign(size_t(n), 0);
  layout.kv_indptr.assign(size_t(n) + 1, 0);
  if (shared_prefix) layout.mask_indptr.assign(size_t(n) + 1, 0);
  for (int e = 0; e < n; ++e) {
    const int32_t seq = seq_lens[size_t(shared_prefix ? e : e / topk)];
    const int32_t kv_len = shared_prefix ? seq + (step + 1) * topk : seq + step + 1;
    layout.qo_indptr[size_t(e) + 1] = shared_prefix ? (e + 1) * topk : e + 1;
    layout.kv_len[size_t(e)] = kv_len;
    layout.kv_indptr[size_t(e) + 1] = layout.kv_indptr[size_t(e)] + kv_len;
    if (shared_prefix) {
      layout.mask_indptr[size_t(e) + 1] =
          layout.mask_indptr[size_t(e)] +
          int64_t(topk) * (full_mask_rows ? kv_len : (step + 1) * topk);
    }
  }
  return layout;
}

PagedLayout make_ragged_layout(const HostLengths& lens) {
  PagedLayout layout;
  const int bs = int(lens.seq_lens.size());
  layout.batch_size = bs;
  layout.mask = MaskMode::kCausal;
  layout.qo_indptr.assign(size_t(bs) + 1, 0);
  layout.kv_start.assign(size_t(bs), 0);
  layout.kv_len.assign(size_t(bs), 0);
  layout.kv_indptr.assign(size_t(bs) + 1, 0);
  check_arg(lens.extend_lens.size() == size_t(bs), "extend_seq_lens",
            "missing: the ragged layout needs the extend lengths");
  for (int r = 0; r < bs; ++r) {
    const int64_t rows = int64_t(layout.qo_indptr[r]) + lens.extend_lens[r];
    if (lens.extend_lens[r] < 0 || rows > INT32_MAX) {
      throw_error(ErrorKind::kInvalidArgument, "extend_seq_lens", "request ", r, " brings the ",
                  "step to ", rows, " query tokens, outside [0, 2^31)");
    }
    layout.qo_indptr[r + 1] = int32_t(rows);
    layout.kv_len[r] = lens.extend_lens[r];
    layout.kv_indptr[r + 1] = layout.kv_indptr[r] + lens.extend_lens[r];
  }
  return layout;
}

bool use_ragged_extend(ForwardMode mode, int64_t num_new_tokens, int64_t num_prefix_tokens,
                       const RaggedExtendRule& rule) {
  if (rule.deterministic || rule.has_window || rule.is_encoder_decoder) return false;
  if (mode != ForwardMode::kExtend && mode != ForwardMode::kMixed) return false;
  if (num_prefix_tokens == 0 && num_new_tokens > 0 && rule.cache_is_io_dtype) return true;
  return num_new_tokens >= rule.threshold &&
         (rule.threshold == 0 || num_prefix_tokens < num_new_tokens);
}

}  // namespace kvattn::core

namespace kvattn::core {

std::vector<uint8_t> fold_window_into_tree_mask(const HostLengths& lens, int draft_token_num,
                                                int window, const uint8_t* custom_mask,
                                                const int64_t* positions) {
  std::vector<uint8_t> out;
  int64_t offset = 0;
  for (size_t r = 0; r < lens.seq_lens.size(); ++r) {
    const int64_t seq = lens.seq_lens[r];
    const int64_t kv_len = seq + draft_token_num;
    const int64_t* tree_pos = positions + int64_t(r) * draft_token_num;
    for (int i = 0; i < draft_token_num; ++i) {
      const int64_t lowest = tree_pos[i] - window;
      for (int64_t j = 0; j < kv_len; ++j) {
        const int64_t pos_j = j < seq ? j : tree_pos[j - seq];
        out.push_back(custom_mask[offset + i * kv_len + j] != 0 && pos_j >= lowest ? 1 : 0);
      }
    }
    offset += int64_t(draft_token_num) * kv_len;
  }
  return out;
}

}  // namespace kvattn::core
