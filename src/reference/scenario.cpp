// run_scenario: a random world (pools, batch, inputs), one backend run, and the checks against
// the float64 reference. The world is built in scenario_world.cpp; this file runs and judges.
#include "reference/scenario.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <sstream>

#include "kvattn/error.h"
#include "reference/float_format.h"
#include "reference/reference.h"
#include "reference/world.h"

namespace kvattn::testing {
namespace {

std::string describe_spec(const ScenarioSpec& spec) {
  std::ostringstream os;
  os << "seed=" << spec.seed << " variant=" << spec.variant << " mode="
     << forward_mode_name(spec.mode) << " [" << spec.shape_label() << " q "
     << dtype_name(spec.q_dtype) << " kv " << dtype_name(spec.kv_dtype) << "]";
  return os.str();
}

// The tested layer after the run, dequantized: the reference reads new tokens' K/V from what the
// backend actually stored (the pool check judges the rounding, to one fp8 ulp; judging it twice
// would turn a legitimate float-vs-double rounding tie into a large output error). Only the saved
// slots differ from the world's ref_pool: they are kept as (element, value) pairs, which
// judge_world writes into ref_pool for the reference and puts back after (a copy of the pool
// would be GBs of doubles for a long request).
struct PoolCheck {
  bool ok = true;
  std::string detail;
  std::vector<std::pair<size_t, double>> stored_k;  // [element of ref_pool.k] = stored value
  std::vector<std::pair<size_t, double>> stored_v;
};

PoolCheck check_pool(ScenarioWorld& w) {
  PoolCheck check;
  const DType kv_dtype = w.kv_cache->config().dtype;
  const int elem = dtype_size(kv_dtype);
  const int num_kv_heads = w.ref_pool.num_kv_heads;
  // Where this step's saves go: slot -> (call, token) whose K/V it should hold (the last save
  // of a slot wins, as in the pool).
  std::vector<std::pair<int, int>> saved_by(size_t(w.ref_pool.num_slots), {-1, -1});
  if (w.spec.save_kv_cache) {
    for (size_t c = 0; c < w.calls.size(); ++c) {
      const RefNewKv& nk = w.calls[c].new_kv;
      for (size_t n = 0; n < nk.slots.size(); ++n) saved_by[size_t(nk.slots[n])] = {int(c), int(n)};
    }
  }
  for (int layer = 0; layer < w.kv_cache->num_layers(); ++layer) {
    const bool tested = layer == ScenarioWorld::kTestedLayer;
    for (int which = 0; which < 2; ++which) {
      const std::vector<uint8_t> now = w.pool_bytes(layer, which);
      const std::vector<uint8_t>& before = w.pool_bytes_before[layer][which];
      const int dim = which == 0 ? w.ref_pool.head_dim : w.ref_pool.v_head_dim;
      const float scale = which == 0 ? w.k_scale : w.v_scale;
      const int64_t elems_per_slot = int64_t(num_kv_heads) * dim;
      const size_t slot_bytes = size_t(elems_per_slot) * size_t(elem);
      std::vector<uint8_t> slot_expected(slot_bytes);
      for (int64_t slot = 0; slot < w.ref_pool.num_slots; ++slot) {
        const size_t slot_offset = size_t(slot) * slot_bytes;
        const bool saved = tested && saved_by[size_t(slot)].first >= 0;
        // A slot no save targets and whose bytes are all as before has nothing to report (the
        // element loop below would find every element the same): one compare, not one an element.
        if (!saved &&
            std::memcmp(now.data() + slot_offset, before.data() + slot_offset, slot_bytes) == 0) {
          continue;
        }
        const uint8_t* expected = before.data() + slot_offset;
        if (saved) {  // the saved token's K/V, encoded as the pool stores them (modelled rounding)
          const auto [c, n] = saved_by[size_t(slot)];
          const std::vector<double>& src =
              which == 0 ? w.calls[size_t(c)].new_kv.k : w.calls[size_t(c)].new_kv.v;
          for (int64_t e = 0; e < elems_per_slot; ++e) {
            const double x = src[size_t(n) * size_t(elems_per_slot) + size_t(e)];
            encode_element(slot_expected.data(), kv_dtype, e,
                           is_fp8_dtype(kv_dtype) ? x / double(scale) : x);
          }
          expected = slot_expected.data();
        }
        const uint8_t* got = now.data() + slot_offset;
        for (int64_t e = 0; e < elems_per_slot; ++e) {
          const int64_t index = slot * elems_per_slot + e;
          const bool same = std::memcmp(got + e * elem, expected + e * elem, size_t(elem)) == 0;
          if (saved) {
            double stored_value = decode_element(got, kv_dtype, e);
            const double want = decode_element(expected, kv_dtype, e);
            const bool within_ulp = is_fp8_dtype(kv_dtype) && std::isfinite(stored_value) &&
                                    std::fabs(stored_value - want) <=
                                        ulp_of(std::max(std::fabs(stored_value), std::fabs(want)),
                                               kv_dtype);
            if (!same && !within_ulp && check.ok) {
              std::ostringstream os;
              os << "KV pool layer " << layer << (which == 0 ? " K" : " V") << " slot " << slot
                 << " element " << e << " (a saved token): stored " << stored_value
                 << ", expected " << want;
              check.ok = false;
              check.detail = os.str();
            }
            if (is_fp8_dtype(kv_dtype)) stored_value *= double(scale);
            (which == 0 ? check.stored_k : check.stored_v)
                .emplace_back(size_t(index), stored_value);
          } else if (!same && check.ok) {
            std::ostringstream os;
            os << "KV pool layer " << layer << (which == 0 ? " K" : " V") << " slot " << slot
               << " element " << e << " changed, but no token of this step is saved there"
               << " (was " << decode_element(expected, kv_dtype, e) << ", now "
               << decode_element(got, kv_dtype, e) << ")";
            check.ok = false;
            check.detail = os.str();
          }
        }
      }
    }
  }
  return check;
}

// max over (token, head) rows of max|out - ref| / max|ref|; NaN or an unwritten element fails.
struct Comparison {
  double max_rel_err = 0;
  bool ok = true;  // no NaN / unwritten element, guard rows intact
  std::string detail;
};

Comparison compare_output(const ScenarioCall& call, const RefOutput& ref, DType io_dtype) {
  Comparison cmp;
  const std::vector<uint8_t> bytes = ScenarioWorld::download(call.out_with_guard);
  const int64_t row_elems = int64_t(ref.num_q_heads) * ref.v_head_dim;
  for (int64_t t = 0; t < ref.num_tokens && cmp.ok; ++t) {
    for (int h = 0; h < ref.num_q_heads; ++h) {
      double max_diff = 0;
      double max_ref = 0;
      int worst = 0;
      for (int d = 0; d < ref.v_head_dim; ++d) {
        const int64_t index = t * row_elems + int64_t(h) * ref.v_head_dim + d;
        const double got = decode_element(bytes.data(), io_dtype, index);
        const double want = ref.out[size_t(index)];
        if (!std::isfinite(got)) {
          std::ostringstream os;
          os << "out[token " << t << ", head " << h << ", dim " << d << "] = " << got
             << (std::isnan(got) ? " (NaN: unwritten, or NaN read from an unused slot)" : "")
             << ", reference " << want;
          cmp.ok = false;
          cmp.detail = os.str();
          return cmp;
        }
        const double diff = std::fabs(got - want);
        if (diff > max_diff) {
          max_diff = diff;
          worst = d;
        }
        max_ref = std::max(max_ref, std::fabs(want));
      }
      double rel = 0;
      if (max_ref > 0) rel = max_diff / max_ref;
      else if (max_diff > 0) rel = std::numeric_limits<double>::infinity();
      if (rel > cmp.max_rel_err) {
        cmp.max_rel_err = rel;
        const int64_t index = t * row_elems + int64_t(h) * ref.v_head_dim + worst;
        std::ostringstream os;
        os << "worst element out[token " << t << ", head " << h << ", dim " << worst
           << "] = " << decode_element(bytes.data(), io_dtype, index) << ", reference "
           << ref.out[size_t(index)] << " (row max |ref| " << max_ref << ")";
        cmp.detail = os.str();
      }
    }
  }
  // The rows after the output must still hold the poison: no write past the end.
  const size_t guard_begin = size_t(ref.num_tokens * row_elems) * dtype_size(io_dtype);
  for (size_t i = guard_begin; i < bytes.size() && cmp.ok; i += size_t(dtype_size(io_dtype))) {
    const int64_t index = int64_t(i / size_t(dtype_size(io_dtype)));
    if (!std::isnan(decode_element(bytes.data(), io_dtype, index))) {
      cmp.ok = false;
      cmp.detail = "wrote past the end of out (element " + std::to_string(index) + ")";
    }
  }
  return cmp;
}

}  // namespace

std::string ScenarioSpec::shape_label() const {
  std::ostringstream os;
  os << "b" << batch_size << " kv" << min_kv_len << ".." << max_kv_len;
  if (mode == ForwardMode::kExtend || mode == ForwardMode::kMixed ||
      mode == ForwardMode::kDraftExtend)
    os << " new" << min_q_len << ".." << max_q_len;
  if (mode == ForwardMode::kTargetVerify) os << " draft" << draft_token_num;
  if (topk > 0) os << " topk" << topk << "x" << num_steps;
  os << " q" << num_q_heads << "/" << num_kv_heads << " d" << head_dim;
  if (v_head_dim > 0 && v_head_dim != head_dim) os << "/" << v_head_dim;
  os << " page" << page_size;
  return os.str();
}

// The bars, relative to each (token, head) row's largest reference value. The reference reads
// exactly the K/V values the pool stores (fp8: stored value * scale, the rounding of the save
// modelled), so the KV dtype adds no error of its own; what is left is the arithmetic. Spread
// measured on the CPU backend over the standard matrix with seeds 1..60 (94 rows each,
// 2026-12-02), worst row per dtype:
//  - fp32: 1e-5. Dot products and exponentials in fp32 over at most a few thousand keys;
//    measured at most 2.6e-6 (fp32 q with bf16 KV, ragged extend; 8.9e-7 with fp8 KV).
//  - fp16: 2e-3. The output is rounded to 11 significant bits (2^-11 = 4.9e-4 of the row's
//    max at most); measured at most 4.9e-4 with fp16, bf16, e4m3 and e5m2 KV alike. The bar
//    leaves 4x for what device kernels add: P rounded to fp16 before P·V, split-KV merges.
//  - bf16: 1e-2. 8 significant bits: the output rounding alone reaches 2^-8 = 3.9e-3 of the
//    row's max; measured at most 3.9e-3 with bf16, e4m3 and e5m2 KV. The bar leaves 2.5x for P
//    rounded to bf16 on the device.
//  - fp8 e4m3 / e5m2 KV: the bar of the arithmetic dtype, nothing added (the measured spread
//    above does not move with fp8 KV). The fp8 rounding (2^-4 / 2^-3 of a value) is in the
//    reference, which reads the stored fp8 values; device kernels widen fp8 to the io dtype
//    exactly (3 or 2 mantissa bits fit in 7 or 10) and fold the scales in fp32. A
//    float-vs-double rounding tie that stores a neighbouring fp8 value is judged by the pool
//    check (one ulp allowed), and the reference then reads what was stored.
//  - fp32 queries on the CUDA backend outside DECODE: the tensor-core kernels multiply bf16 (or
//    fp16) copies of q and the new K/V, so the arithmetic is bf16's ("bf16-bounded") and, unlike
//    a bf16 call, the inputs themselves are rounded (2^-9 of each q and k element, which the
//    exponentials amplify), which the reference does not model: twice bf16's bar. Measured on
//    the H200 (2026-12-02): 1.04e-2 and 1.09e-2 on the ragged fp32-q extend row with the Hopper
//    kernel, 8.2e-3 with the mma.sync one. CUDA DECODE runs the CUDA-core kernel in fp32 for
//    fp32 queries (the tensor-core one never serves fp32 io).
DType arithmetic_dtype(DType q_dtype, DType kv_dtype, BackendKind kind, ForwardMode mode) {
  (void)kv_dtype;  // see above: the reference reads the stored KV values
  if (q_dtype == DType::kFloat32 && kind == BackendKind::kCuda && mode != ForwardMode::kDecode)
    return DType::kBFloat16;
  return q_dtype;
}

double tolerance_for_dtype(DType arithmetic) {
  switch (arithmetic) {
    case DType::kFloat32:
      return 1e-5;
    case DType::kFloat16:
      return 2e-3;
    default:
      return 1e-2;
  }
}

double tolerance_for(DType q_dtype, DType kv_dtype, BackendKind kind, ForwardMode mode) {
  const DType arithmetic = arithmetic_dtype(q_dtype, kv_dtype, kind, mode);
  // fp32 inputs rounded to 16 bits on the way in (see above): twice the arithmetic's bar.
  const double input_rounding = arithmetic != q_dtype ? 2.0 : 1.0;
  return input_rounding * tolerance_for_dtype(arithmetic);
}

double tolerance_for(DType q_dtype, DType kv_dtype) {
  (void)kv_dtype;
  return tolerance_for_dtype(q_dtype);
}

void run_world(ScenarioWorld& w, const AttentionLayer& layer) {
  const ScenarioSpec& spec = w.spec;
  if (w.multi_step) {
    MultiStepDraftBackend draft(w.kind, w.config, spec.topk, spec.num_steps);
    draft.init_forward_metadata(w.batch);
    for (int step = 0; step < spec.num_steps; ++step) {
      const ScenarioCall& c = w.calls[size_t(step)];
      draft.forward_step(step, c.q, c.k, c.v, c.out, layer, c.out_cache_loc);
    }
    return;
  }
  std::unique_ptr<AttentionBackend> backend = make_backend(w.kind, w.config);
  backend->init_forward_metadata(w.batch);
  for (const ScenarioCall& c : w.calls) {
    backend->forward(c.q, c.k, c.v, c.out, layer, w.batch, spec.save_kv_cache);
  }
}

ScenarioResult judge_world(ScenarioWorld& w) {
  const ScenarioSpec& spec = w.spec;
  ScenarioResult result;
  result.tolerance = tolerance_for(spec.q_dtype, spec.kv_dtype, w.kind, spec.mode);
  const std::string what = describe_spec(spec);
  PoolCheck pool = check_pool(w);
  result.kv_pool_ok = pool.ok;

  // The reference reads the tested layer as stored after the run: the saved tokens' values go
  // into ref_pool for the comparison and the old ones come back after it. (When the step does
  // not save, the caller wrote the K/V beforehand: they are in ref_pool already.)
  struct StoredValues {
    RefKvPool& pool;
    std::vector<std::pair<size_t, double>> k, v;  // what each element held before
    StoredValues(RefKvPool& p, const PoolCheck& check) : pool(p) {
      for (const auto& [index, value] : check.stored_k) {
        k.emplace_back(index, pool.k[index]);
        pool.k[index] = value;
      }
      for (const auto& [index, value] : check.stored_v) {
        v.emplace_back(index, pool.v[index]);
        pool.v[index] = value;
      }
    }
    ~StoredValues() {  // in reverse, so an element saved twice gets its first value back
      for (auto it = k.rbegin(); it != k.rend(); ++it) pool.k[it->first] = it->second;
      for (auto it = v.rbegin(); it != v.rend(); ++it) pool.v[it->first] = it->second;
    }
  } stored(w.ref_pool, pool);
  const RefKvPool& ref_pool = w.ref_pool;

  Comparison cmp;
  for (size_t i = 0; i < w.calls.size() && cmp.ok; ++i) {
    RefBatch ref_batch = w.ref_batch;
    ref_batch.draft_step = int(i);
    const ScenarioCall& c = w.calls[i];
    RefOutput ref;
    try {
      ref = reference_attention(w.layer, ref_batch, ref_pool, c.q_values,
                                w.ragged ? &c.new_kv : nullptr,
                                w.sink_values.empty() ? nullptr : &w.sink_values);
    } catch (const std::exception& e) {
      result.detail = what + ": the reference failed: " + e.what();
      return result;
    }
    Comparison one = compare_output(c, ref, spec.q_dtype);
    if (w.calls.size() > 1) one.detail = "step " + std::to_string(i) + ": " + one.detail;
    if (!one.ok || one.max_rel_err > cmp.max_rel_err) cmp = one;
  }
  result.max_rel_err = cmp.max_rel_err;
  result.passed = cmp.ok && cmp.max_rel_err <= result.tolerance && pool.ok;
  if (!cmp.ok) {
    result.detail = what + ": " + cmp.detail;
  } else if (cmp.max_rel_err > result.tolerance) {
    std::ostringstream os;
    os << what << ": max rel err " << cmp.max_rel_err << " > " << result.tolerance << "; "
       << cmp.detail;
    result.detail = os.str();
  } else if (!pool.ok) {
    result.detail = what + ": " + pool.detail;
  }
  return result;
}

ScenarioResult run_scenario(const ScenarioSpec& spec, BackendKind kind) {
  std::unique_ptr<ScenarioWorld> world;
  try {
    world = ScenarioWorld::build(spec, kind);
  } catch (const std::exception& e) {
    ScenarioResult result;
    result.tolerance = tolerance_for(spec.q_dtype, spec.kv_dtype, kind, spec.mode);
    result.detail = describe_spec(spec) + ": building the world failed: " + e.what();
    return result;
  }
  try {
    run_world(*world, world->layer);
  } catch (const Error& e) {
    ScenarioResult result;
    result.tolerance = tolerance_for(spec.q_dtype, spec.kv_dtype, kind, spec.mode);
    result.detail = describe_spec(spec) + ": the backend threw: " + e.what();
    result.not_supported = e.kind() == ErrorKind::kNotSupported;
    result.kv_pool_ok = world->pool_unchanged();
    return result;
  } catch (const std::exception& e) {
    ScenarioResult result;
    result.tolerance = tolerance_for(spec.q_dtype, spec.kv_dtype, kind, spec.mode);
    result.detail = describe_spec(spec) + ": the backend threw: " + e.what();
    result.kv_pool_ok = world->pool_unchanged();
    return result;
  }
  return judge_world(*world);
}

}  // namespace kvattn::testing
