#include "support/bad_index.h"

#include <algorithm>
#include <cctype>
#include <array>
#include <cstdlib>
#include <exception>
#include <memory>

#include "kvattn/error.h"

namespace kvattn::testing {
namespace {

ScenarioSpec base_spec(const std::string& variant, ForwardMode mode, uint64_t seed) {
  ScenarioSpec spec;
  spec.variant = variant;
  spec.mode = mode;
  spec.batch_size = 3;
  spec.min_kv_len = 8;
  spec.max_kv_len = 60;
  spec.max_q_len = 9;
  spec.allow_tiny = false;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 64;
  spec.seed = seed;
  if (mode == ForwardMode::kTargetVerify) spec.draft_token_num = 3;
  return spec;
}

// The values of a 1-D index tensor on any device.
std::vector<int64_t> values_of(const TensorView& t) {
  const std::vector<uint8_t> bytes = ScenarioWorld::download(t);
  const TensorView host(const_cast<uint8_t*>(bytes.data()), t.dtype(), Device::cpu(),
                        {t.size(0)});
  std::vector<int64_t> out;
  for (int64_t i = 0; i < t.size(0); ++i) out.push_back(read_index(host, i));
  return out;
}

// Replaces element `index` of the index tensor `field` (a new tensor on the same device, so a
// backend that read the old one cannot mistake it) and returns the undo.
std::function<void()> set_index(ScenarioWorld& w, TensorView& field, int64_t index,
                                int64_t value) {
  const TensorView old = field;
  std::vector<int64_t> values = values_of(field);
  values.at(size_t(index)) = value;
  field = w.index_tensor(values, field.dtype(), field.device());
  return [&field, old] { field = old; };
}

// Writes req_to_token[row][position] = value; returns the undo.
std::function<void()> set_req_to_token(ScenarioWorld& w, int row, int64_t position,
                                       int32_t value) {
  const int32_t old = w.req_to_token_pool->read(row, position, 1).at(0);
  const std::array<int32_t, 1> bad = {value};
  w.req_to_token_pool->write(row, position, bad);
  ReqToTokenPool* pool = &*w.req_to_token_pool;
  return [pool, row, position, old] {
    const std::array<int32_t, 1> back = {old};
    pool->write(row, position, back);
  };
}

std::string req_to_token_name(int row, int64_t position) {
  return "req_to_token[" + std::to_string(row) + "][" + std::to_string(position) + "]";
}

BadIndexBreak bad_out_cache_loc_last(ScenarioWorld& w) {
  const int64_t last = w.batch.out_cache_loc.size(0) - 1;
  return {"out_cache_loc[" + std::to_string(last) + "]", false,
          set_index(w, w.batch.out_cache_loc, last, w.kv_cache->num_slots())};
}

BadIndexBreak bad_out_cache_loc_negative(ScenarioWorld& w) {
  return {"out_cache_loc[0]", false, set_index(w, w.batch.out_cache_loc, 0, -1)};
}

BadIndexBreak bad_encoder_out_cache_loc(ScenarioWorld& w) {
  return {"encoder_out_cache_loc[0]", false,
          set_index(w, w.batch.encoder_out_cache_loc, 0, w.kv_cache->num_slots() + 7)};
}

BadIndexBreak bad_row_past_end(ScenarioWorld& w) {
  return {"req_pool_indices[2]", false,
          set_index(w, w.batch.req_pool_indices, 2, w.req_to_token_pool->max_reqs())};
}

BadIndexBreak bad_row_negative(ScenarioWorld& w) {
  return {"req_pool_indices[1]", false, set_index(w, w.batch.req_pool_indices, 1, -1)};
}

// A slot of request 1's range that every index set of the step reads (its first key: prefix or
// not, in every mode; the full set of a window model reads it too).
BadIndexBreak bad_req_to_token_first_key(ScenarioWorld& w, int32_t value) {
  const int row = int(w.ref_batch.req_pool_indices.at(1));
  const int64_t first = w.spec.cross_attention ? w.ref_batch.encoder_lens.at(1) : 0;
  return {req_to_token_name(row, first), false, set_req_to_token(w, row, first, value)};
}

// TARGET_VERIFY: a tree token's slot (position seq_len + 1 of request 2).
BadIndexBreak bad_req_to_token_tree_token(ScenarioWorld& w) {
  const int row = int(w.ref_batch.req_pool_indices.at(2));
  const int64_t position = w.ref_batch.seq_lens.at(2) + 1;
  return {req_to_token_name(row, position), false, set_req_to_token(w, row, position, -7)};
}

// The newest key of request 0 (inside any window).
BadIndexBreak bad_req_to_token_newest_key(ScenarioWorld& w) {
  const int row = int(w.ref_batch.req_pool_indices.at(0));
  const int64_t position = w.ref_batch.seq_lens.at(0) - 1;
  return {req_to_token_name(row, position), false,
          set_req_to_token(w, row, position, int32_t(w.kv_cache->num_slots()))};
}

// A position past request 0's tokens: nothing of the step reads it.
BadIndexBreak unread_req_to_token(ScenarioWorld& w) {
  const int row = int(w.ref_batch.req_pool_indices.at(0));
  const int64_t position = w.ref_batch.seq_lens.at(0);
  if (position >= w.req_to_token_pool->max_context_len()) return {"", false, [] {}};
  return {"", false, set_req_to_token(w, row, position, -1)};
}

BadIndexBreak seq_len_past_context(ScenarioWorld& w) {
  std::vector<int64_t> seq = values_of(w.batch.seq_lens);
  seq[0] = w.req_to_token_pool->max_context_len() + 1;
  const TensorView old = w.batch.seq_lens;
  const TensorView old_cpu = w.batch.seq_lens_cpu;
  w.batch.seq_lens = w.index_tensor(seq, old.dtype(), old.device());
  if (old_cpu.defined()) w.batch.seq_lens_cpu = w.index_tensor(seq, old_cpu.dtype(), Device::cpu());
  ForwardBatch* batch = &w.batch;
  return {"seq_lens[0]", false, [batch, old, old_cpu] {
            batch->seq_lens = old;
            batch->seq_lens_cpu = old_cpu;
          }};
}

// An encoder-decoder model: request 0's decoder tokens one past what its encoder tokens leave
// of req_to_token's row (each alone within max_context_len).
BadIndexBreak seq_len_past_encoder_room(ScenarioWorld& w) {
  std::vector<int64_t> seq = values_of(w.batch.seq_lens);
  seq[0] = w.req_to_token_pool->max_context_len() - w.ref_batch.encoder_lens.at(0) + 1;
  const TensorView old = w.batch.seq_lens;
  w.batch.seq_lens = w.index_tensor(seq, old.dtype(), old.device());
  ForwardBatch* batch = &w.batch;
  return {"seq_lens[0]", false, [batch, old] { batch->seq_lens = old; }};
}

BadIndexBreak encoder_len_negative(ScenarioWorld& w) {
  return {"encoder_lens[1]", false, set_index(w, w.batch.encoder_lens, 1, -1)};
}

// Declared shared-prefix groups (ScenarioSpec::declared_groups): group 0's members in batch
// order (the first is the leader) and its shared length.
struct DeclaredGroup {
  std::vector<int> members;
  int64_t shared_len = 0;
};
DeclaredGroup declared_group_0(const ScenarioWorld& w) {
  DeclaredGroup g;
  for (int64_t r = 0; r < w.batch.shared_prefix_group_cpu.size(0); ++r)
    if (read_index(w.batch.shared_prefix_group_cpu, r) == 0) g.members.push_back(int(r));
  g.shared_len = read_index(w.batch.shared_prefix_lens_cpu, 0);
  return g;
}

// The promise broken: group 0's second member holds another (valid) slot at the last shared
// position, its leader's own next slot.
BadIndexBreak shared_prefix_member_differs(ScenarioWorld& w) {
  const DeclaredGroup g = declared_group_0(w);
  const int lead_row = int(w.ref_batch.req_pool_indices.at(size_t(g.members.at(0))));
  const int row = int(w.ref_batch.req_pool_indices.at(size_t(g.members.at(1))));
  const int32_t other = w.req_to_token_pool->read(lead_row, g.shared_len, 1).at(0);
  return {"shared_prefix_lens_cpu[0]", false,
          set_req_to_token(w, row, g.shared_len - 1, other)};
}

// A bad slot inside the shared prefix of group 0's leader: a bad req_to_token entry (named as
// such, before the broken promise it also is).
BadIndexBreak shared_prefix_leader_slot_past_pool(ScenarioWorld& w) {
  const DeclaredGroup g = declared_group_0(w);
  const int row = int(w.ref_batch.req_pool_indices.at(size_t(g.members.at(0))));
  return {req_to_token_name(row, 0), false,
          set_req_to_token(w, row, 0, int32_t(w.kv_cache->num_slots()))};
}

// TARGET_VERIFY: a tree token of group 0's last member does not see shared key 0.
BadIndexBreak shared_prefix_mask_hides_a_key(ScenarioWorld& w) {
  const DeclaredGroup g = declared_group_0(w);
  const int r = g.members.back();
  int64_t offset = 0;  // request r's mask: draft rows of seq_len + draft columns
  const int draft = w.spec.draft_token_num;
  for (int i = 0; i < r; ++i) offset += int64_t(draft) * (w.ref_batch.seq_lens.at(size_t(i)) + draft);
  const int64_t row_len = w.ref_batch.seq_lens.at(size_t(r)) + draft;
  std::vector<uint8_t> mask = ScenarioWorld::download(w.batch.spec.custom_mask);
  mask.at(size_t(offset + (draft - 1) * row_len)) = 0;  // the last tree token, key 0
  const TensorView old = w.batch.spec.custom_mask;
  w.batch.spec.custom_mask =
      w.upload(DType::kUInt8, {int64_t(mask.size())}, mask.data(), old.device());
  ForwardBatch* batch = &w.batch;
  return {"spec.custom_mask", false, [batch, old] { batch->spec.custom_mask = old; }};
}

// All bytes of every layer's K and V.
std::vector<std::vector<uint8_t>> pool_snapshot(const ScenarioWorld& w) {
  std::vector<std::vector<uint8_t>> out;
  for (int l = 0; l < w.kv_cache->num_layers(); ++l) {
    out.push_back(w.pool_bytes(l, 0));
    out.push_back(w.pool_bytes(l, 1));
  }
  return out;
}

void run_step(AttentionBackend& backend, ScenarioWorld& w) {
  backend.init_forward_metadata(w.batch);
  for (const ScenarioCall& call : w.calls) {
    backend.forward(call.q, call.k, call.v, call.out, w.layer, w.batch, w.spec.save_kv_cache);
  }
}

}  // namespace

std::vector<BadIndexCase> bad_index_cases() {
  using M = ForwardMode;
  std::vector<BadIndexCase> cases;
  auto add = [&](const std::string& label, ScenarioSpec spec,
                 std::function<BadIndexBreak(ScenarioWorld&)> apply, bool refused = true) {
    BadIndexCase c;
    c.label = label;
    c.spec = std::move(spec);
    c.apply = std::move(apply);
    c.expect_refused = refused;
    cases.push_back(std::move(c));
  };
  uint64_t seed = 700;
  for (M mode : {M::kDecode, M::kExtend, M::kMixed, M::kTargetVerify}) {
    const std::string m = forward_mode_name(mode);
    add(m + " out_cache_loc one past the pool", base_spec("bad loc", mode, ++seed),
        bad_out_cache_loc_last);
    add(m + " req_pool_indices past max_reqs", base_spec("bad row", mode, ++seed),
        bad_row_past_end);
    add(m + " req_to_token slot -1 read by the step", base_spec("bad slot", mode, ++seed),
        [](ScenarioWorld& w) { return bad_req_to_token_first_key(w, -1); });
  }
  for (M mode : {M::kDecode, M::kExtend}) {
    const std::string m = forward_mode_name(mode);
    add(m + " out_cache_loc[0] = -1", base_spec("bad loc", mode, ++seed),
        bad_out_cache_loc_negative);
    add(m + " req_pool_indices[1] = -1", base_spec("bad row", mode, ++seed), bad_row_negative);
    add(m + " req_to_token slot = num_slots", base_spec("bad slot", mode, ++seed),
        [](ScenarioWorld& w) {
          return bad_req_to_token_first_key(w, int32_t(w.kv_cache->num_slots()));
        });
  }
  for (M mode : {M::kDecode, M::kTargetVerify}) {
    add(std::string(forward_mode_name(mode)) + " seq_len beyond max_context_len",
        base_spec("bad len", mode, ++seed), seq_len_past_context);
  }
  {
    ScenarioSpec spec = base_spec("bad loc ragged", M::kExtend, ++seed);
    spec.force_ragged = true;
    // Every request has a cached prefix: the ragged path reads only the prefix from the pool.
    spec.min_kv_len = 20;
    add("EXTEND ragged+prefix out_cache_loc one past the pool", spec, bad_out_cache_loc_last);
    spec.seed = ++seed;
    add("EXTEND ragged+prefix req_to_token slot -1", spec,
        [](ScenarioWorld& w) { return bad_req_to_token_first_key(w, -1); });
  }
  {
    ScenarioSpec spec = base_spec("bad encoder loc", M::kExtend, ++seed);
    spec.cross_attention = true;
    add("EXTEND cross-attention encoder_out_cache_loc past the pool", spec,
        bad_encoder_out_cache_loc);
    spec.seed = ++seed;
    spec.cross_layer = false;
    add("EXTEND cross-attention model, self layer, req_to_token slot -1", spec,
        [](ScenarioWorld& w) { return bad_req_to_token_first_key(w, -1); });
  }
  {
    // An encoder-decoder model without host lengths: the CUDA backend plans it on the device
    // and its step check refuses the lengths; the CPU backend reads them as always.
    ScenarioSpec spec = base_spec("bad lengths cross", M::kDecode, ++seed);
    spec.cross_attention = true;
    spec.device_lengths = true;
    spec.save_kv_cache = false;  // encoder K/V cached by an earlier step
    add("DECODE cross-attention device lengths seq_len past the encoder's room", spec,
        seq_len_past_encoder_room);
    spec.seed = ++seed;
    spec.cross_layer = false;
    spec.save_kv_cache = true;
    add("DECODE cross-attention model, self layer, device lengths encoder_len -1", spec,
        encoder_len_negative);
  }
  {
    ScenarioSpec spec = base_spec("bad slot window", M::kDecode, ++seed);
    spec.sliding_window = 4;
    add("DECODE window layer req_to_token newest key past the pool", spec,
        bad_req_to_token_newest_key);
  }
  // Declared shared-prefix groups (ForwardBatch::shared_prefix_lens_cpu): 4 of 5 requests in
  // group 0. A member that does not hold its leader's slots (or, verify, whose mask hides a
  // shared key) breaks the engine's promise: the step is refused like one with a bad index.
  // (With KVATTN_CASCADE=0 the groups are ignored and these steps run: not in the table then.)
  const char* cascade = std::getenv("KVATTN_CASCADE");
  const bool cascade_on = cascade == nullptr || std::string(cascade) != "0";
  for (M mode : {M::kDecode, M::kTargetVerify}) {
    if (!cascade_on) break;
    ScenarioSpec spec = base_spec("bad shared prefix", mode, ++seed);
    spec.batch_size = 5;
    spec.min_kv_len = 12;
    spec.declared_groups = 1;
    const std::string m = forward_mode_name(mode);
    add(m + " declared group member with another slot in the shared prefix", spec,
        shared_prefix_member_differs);
    spec.seed = ++seed;
    add(m + " declared group leader's shared slot past the pool", spec,
        shared_prefix_leader_slot_past_pool);
    if (mode == M::kTargetVerify) {
      spec.seed = ++seed;
      add(m + " declared group tree mask hiding a shared key", spec,
          shared_prefix_mask_hides_a_key);
    }
  }
  add("TARGET_VERIFY req_to_token tree token -7",
      base_spec("bad tree slot", M::kTargetVerify, ++seed), bad_req_to_token_tree_token);
  add("DECODE a bad req_to_token entry the step does not read",
      base_spec("unread slot", M::kDecode, ++seed), unread_req_to_token, /*refused=*/false);
  return cases;
}

BadIndexOutcome run_bad_index_case(const BadIndexCase& c, BackendKind kind) {
  BadIndexOutcome o;
  std::unique_ptr<ScenarioWorld> w = ScenarioWorld::build(c.spec, kind);
  o.expected = c.apply(*w);
  const std::vector<std::vector<uint8_t>> pool_before = pool_snapshot(*w);
  const std::vector<uint8_t> table_before = ScenarioWorld::download(w->req_to_token_pool->table());
  std::unique_ptr<AttentionBackend> backend = make_backend(kind, w->config);

  // The bad step, as an engine runs it; check_errors where it synchronises anyway.
  try {
    run_step(*backend, *w);
    o.bad_step_id = backend->step_id();
    backend->check_errors(/*synchronize=*/true);
  } catch (const Error& e) {
    o.refused = true;
    o.refused_by_check_errors = e.step() >= 0;
    o.kind = e.kind();
    o.argument = e.argument();
    o.message = e.what();
    o.error_step = e.step();
  } catch (const std::exception& e) {
    o.detail = std::string("threw a non-kvattn exception: ") + e.what();
    return o;
  }
  o.bad_step_id = backend->step_id();
  o.pool_unchanged = pool_snapshot(*w) == pool_before;
  o.req_to_token_unchanged =
      ScenarioWorld::download(w->req_to_token_pool->table()) == table_before;

  // Reported once: asking again finds nothing.
  try {
    backend->check_errors(true);
    o.reported_once = true;
  } catch (const Error& e) {
    o.detail = std::string("reported again by a second check_errors: ") + e.what();
  }

  // The next step, good again, on the same backend.
  o.expected.undo();
  try {
    run_step(*backend, *w);
    backend->check_errors(true);
    const ScenarioResult r = judge_world(*w);
    o.next_step_ok = r.passed && r.kv_pool_ok;
    if (!o.next_step_ok) o.detail += "the good step after it is wrong: " + r.detail;
  } catch (const std::exception& e) {
    o.detail += std::string("the good step after it threw: ") + e.what();
  }
  return o;
}

std::string bad_index_failure(const BadIndexCase& c, const BadIndexOutcome& o, bool deferred) {
  std::string why;
  auto fail = [&](const std::string& text) { why += (why.empty() ? "" : "; ") + text; };
  if (!c.expect_refused) {
    if (o.refused) fail("refused a step whose bad entry it never reads: " + o.message);
  } else {
    if (!o.refused) fail("the bad step was not refused");
    if (o.refused && o.kind != c.kind) fail("wrong error kind: " + o.message);
    const std::string& want = o.expected.argument;
    const bool named = o.expected.argument_is_prefix ? o.argument.rfind(want, 0) == 0
                                                     : o.argument == want;
    if (o.refused && !named) {
      fail("argument() is '" + o.argument + "', expected '" + want + "' (" + o.message + ")");
    }
    if (o.refused && o.message.find(want) == std::string::npos) {
      fail("the message does not name " + want + ": " + o.message);
    }
    if (o.refused && deferred && o.refused_by_check_errors &&
        o.error_step != int64_t(o.bad_step_id)) {
      fail("attributed to step " + std::to_string(o.error_step) + ", the bad step was " +
           std::to_string(o.bad_step_id));
    }
    if (!o.pool_unchanged) fail("the KV pool changed");
  }
  if (!o.req_to_token_unchanged) fail("req_to_token changed");
  if (!o.reported_once) fail("not reported exactly once");
  if (!o.next_step_ok) fail("the next good step failed");
  if (!o.detail.empty()) fail(o.detail);
  return why;
}

const std::vector<BadIndexCase>& bad_index_case_table() {
  static const std::vector<BadIndexCase> table = bad_index_cases();
  return table;
}

std::string bad_index_case_name(int index) {
  std::string name;
  for (char ch : bad_index_case_table()[size_t(index)].label) {
    name += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
  }
  return name;
}

}  // namespace kvattn::testing
