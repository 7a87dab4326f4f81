// standard_scenarios: every mode x variant of SPEC §2-§3 at sizes the CPU backend runs in a few
// seconds all together. Each row varies one thing from a small base, so a failure names it.
#include <functional>

#include "reference/scenario.h"

namespace kvattn::testing {

const char* unsupported_reason(const ScenarioSpec& spec, BackendKind kind) {
  const bool window_layer = spec.sliding_window >= 0 && spec.window_layer;
  if (kind == BackendKind::kCuda && spec.topk > 0 && window_layer) {
    return "CUDA multi-step draft on a window layer: the draft index build has no window "
           "(refused in src/cuda/draft_runner.cpp)";
  }

  return nullptr;
}

std::vector<ScenarioSpec> standard_scenarios(uint64_t seed) {
  std::vector<ScenarioSpec> rows;
  auto add = [&](const char* variant, ForwardMode mode,
                 const std::function<void(ScenarioSpec&)>& change) {
    ScenarioSpec s;
    s.variant = variant;
    s.mode = mode;
    s.batch_size = 4;
    s.min_kv_len = 1;
    s.max_kv_len = 200;
    s.min_q_len = 1;
    s.max_q_len = 37;  // not a multiple of 8 or of any page size
    if (change) change(s);
    // Distinct, reproducible seeds per row: the row index and the caller's seed.
    s.seed = seed * 1000003ull + rows.size() * 7919ull + 1;
    rows.push_back(s);
  };
  const ForwardMode decode = ForwardMode::kDecode;
  const ForwardMode extend = ForwardMode::kExtend;

  add("idle", ForwardMode::kIdle, nullptr);

  // ---- DECODE ----------------------------------------------------------------------------------
  add("decode", decode, nullptr);
  add("decode page16", decode, [](ScenarioSpec& s) { s.page_size = 16; });
  add("decode page128", decode, [](ScenarioSpec& s) {
    s.page_size = 128;
    s.max_kv_len = 300;
  });
  add("decode contiguous slots", decode, [](ScenarioSpec& s) { s.shuffled_slots = false; });
  add("decode window layer", decode, [](ScenarioSpec& s) {
    s.sliding_window = 24;
    s.page_size = 16;
  });
  add("decode window model, full layer", decode, [](ScenarioSpec& s) {
    s.sliding_window = 24;
    s.window_layer = false;
  });
  add("decode cross layer", decode, [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.save_kv_cache = false;  // encoder K/V cached by an earlier step
  });
  add("decode cross model, self layer", decode, [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.cross_layer = false;
    s.page_size = 16;
  });
  add("decode softcap", decode, [](ScenarioSpec& s) { s.logit_cap = 5.f; });
  add("decode MQA", decode, [](ScenarioSpec& s) {
    s.num_q_heads = 8;
    s.num_kv_heads = 1;
  });
  add("decode GQA8", decode, [](ScenarioSpec& s) {
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
  });
  add("decode hd64", decode, [](ScenarioSpec& s) { s.head_dim = 64; });
  add("decode hd256", decode, [](ScenarioSpec& s) { s.head_dim = 256; });
  add("decode v_head_dim 64", decode, [](ScenarioSpec& s) { s.v_head_dim = 64; });
  add("decode fp32", decode, [](ScenarioSpec& s) { s.q_dtype = DType::kFloat32; });
  add("decode fp16", decode, [](ScenarioSpec& s) {
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });
  add("decode fp16 q, bf16 kv", decode, [](ScenarioSpec& s) { s.q_dtype = DType::kFloat16; });
  add("decode fp8 e4m3", decode, [](ScenarioSpec& s) {
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.37f;
    s.v_scale = 1.7f;
  });
  add("decode fp8 e5m2", decode, [](ScenarioSpec& s) {
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat8E5M2;
    s.k_scale = 2.3f;
    s.v_scale = 0.61f;
    s.page_size = 16;
  });
  add("decode fp32 q, fp8 e4m3", decode, [](ScenarioSpec& s) {
    s.q_dtype = DType::kFloat32;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.5f;
    s.v_scale = 0.3f;
  });
  add("decode GQA8 fp8", decode, [](ScenarioSpec& s) {
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.8f;
  });
  add("decode no save", decode, [](ScenarioSpec& s) { s.save_kv_cache = false; });
  add("decode strided q", decode, [](ScenarioSpec& s) { s.strided_q = true; });
  add("decode b32 page16", decode, [](ScenarioSpec& s) {
    s.batch_size = 32;
    s.max_kv_len = 100;
    s.page_size = 16;
  });
  add("decode window layer fp8 e4m3", decode, [](ScenarioSpec& s) {
    s.sliding_window = 40;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.55f;
    s.v_scale = 1.3f;
  });
  add("decode cross layer page16", decode, [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.page_size = 16;
    s.save_kv_cache = false;  // encoder K/V cached by an earlier step
  });
  add("decode cross layer page128 fp8", decode, [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.page_size = 128;
    s.max_kv_len = 300;
    s.save_kv_cache = false;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.9f;
  });
  add("decode hd256 fp8 e4m3", decode, [](ScenarioSpec& s) {
    s.head_dim = 256;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.4f;
    s.v_scale = 1.6f;
  });
  add("decode hd256 fp8 e5m2 page16", decode, [](ScenarioSpec& s) {
    s.head_dim = 256;
    s.page_size = 16;
    s.kv_dtype = DType::kFloat8E5M2;
    s.k_scale = 1.2f;
  });
  add("decode softcap fp16", decode, [](ScenarioSpec& s) {
    s.logit_cap = 8.f;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });

  // ---- EXTEND ----------------------------------------------------------------------------------
  add("extend", extend, nullptr);
  add("extend page16", extend, [](ScenarioSpec& s) { s.page_size = 16; });
  add("extend page128 hd64", extend, [](ScenarioSpec& s) {
    s.page_size = 128;
    s.head_dim = 64;
    s.max_kv_len = 300;
  });
  add("extend no prefix", extend, [](ScenarioSpec& s) {
    s.max_kv_len = 45;
    s.min_q_len = 45;
    s.max_q_len = 45;
  });
  add("extend ragged", extend, [](ScenarioSpec& s) { s.force_ragged = true; });
  add("extend ragged no prefix", extend, [](ScenarioSpec& s) {
    s.force_ragged = true;
    s.max_kv_len = 45;
    s.min_q_len = 45;
    s.max_q_len = 45;
  });
  add("extend ragged page16 fp8 e4m3", extend, [](ScenarioSpec& s) {
    s.force_ragged = true;
    s.page_size = 16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.45f;
    s.v_scale = 0.9f;
  });
  add("extend ragged fp32 q", extend, [](ScenarioSpec& s) {
    s.force_ragged = true;
    s.q_dtype = DType::kFloat32;
  });
  add("extend window layer", extend, [](ScenarioSpec& s) {
    s.sliding_window = 20;
    s.page_size = 16;
  });
  add("extend window model, full layer", extend, [](ScenarioSpec& s) {
    s.sliding_window = 20;
    s.window_layer = false;
  });
  add("extend cross layer", extend, [](ScenarioSpec& s) { s.cross_attention = true; });
  add("extend cross model, self layer", extend, [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.cross_layer = false;
  });
  add("extend softcap", extend, [](ScenarioSpec& s) { s.logit_cap = 4.f; });
  add("extend MQA", extend, [](ScenarioSpec& s) {
    s.num_q_heads = 4;
    s.num_kv_heads = 1;
  });
  add("extend GQA8", extend, [](ScenarioSpec& s) {
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
    s.max_kv_len = 120;
  });
  add("extend hd256", extend, [](ScenarioSpec& s) {
    s.head_dim = 256;
    s.max_kv_len = 150;
  });
  add("extend v_head_dim 64", extend, [](ScenarioSpec& s) { s.v_head_dim = 64; });
  // DeepSeek-V2/V3's prefill in MHA form (CUDA: the Hopper kernel; decode through the 256
  // instance).
  add("extend hd192 v128", extend, [](ScenarioSpec& s) {
    s.head_dim = 192;
    s.v_head_dim = 128;
    s.max_kv_len = 150;
  });
  add("extend ragged hd192 v128", extend, [](ScenarioSpec& s) {
    s.head_dim = 192;
    s.v_head_dim = 128;
    s.force_ragged = true;
    s.max_kv_len = 150;
  });
  add("decode hd192 v128", decode, [](ScenarioSpec& s) {
    s.head_dim = 192;
    s.v_head_dim = 128;
  });
  add("extend fp16", extend, [](ScenarioSpec& s) {
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });
  add("extend fp32 q", extend, [](ScenarioSpec& s) { s.q_dtype = DType::kFloat32; });
  add("extend fp8 e5m2", extend, [](ScenarioSpec& s) {
    s.kv_dtype = DType::kFloat8E5M2;
    s.k_scale = 1.9f;
    s.v_scale = 0.7f;
  });
  add("extend no save", extend, [](ScenarioSpec& s) { s.save_kv_cache = false; });
  add("extend strided q", extend, [](ScenarioSpec& s) { s.strided_q = true; });
  add("extend fp16 q, fp8 e4m3", extend, [](ScenarioSpec& s) {
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.21f;
    s.v_scale = 3.5f;
  });
  add("extend b1 long prefix page16", extend, [](ScenarioSpec& s) {
    s.batch_size = 1;
    s.min_kv_len = 600;
    s.max_kv_len = 900;
    s.allow_tiny = false;
    s.page_size = 16;
  });
  add("extend window layer fp8 e5m2", extend, [](ScenarioSpec& s) {
    s.sliding_window = 20;
    s.kv_dtype = DType::kFloat8E5M2;
    s.k_scale = 1.4f;
    s.v_scale = 0.8f;
  });
  add("extend window page16 fp16 q, fp8 e4m3", extend, [](ScenarioSpec& s) {
    s.sliding_window = 33;
    s.page_size = 16;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.3f;
  });
  add("extend cross layer page16", extend, [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.page_size = 16;
  });
  add("extend cross layer page128 fp16", extend, [](ScenarioSpec& s) {
    s.cross_attention = true;
    s.page_size = 128;
    s.max_kv_len = 300;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });
  add("extend hd256 fp8 e4m3", extend, [](ScenarioSpec& s) {
    s.head_dim = 256;
    s.max_kv_len = 150;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.7f;
    s.v_scale = 2.2f;
  });
  add("extend ragged hd256 fp8 e5m2", extend, [](ScenarioSpec& s) {
    s.force_ragged = true;
    s.head_dim = 256;
    s.max_kv_len = 150;
    s.kv_dtype = DType::kFloat8E5M2;
    s.v_scale = 0.45f;
  });

  // ---- MIXED, TARGET_VERIFY, DRAFT_EXTEND -----------------------------------------------------
  add("mixed", ForwardMode::kMixed, [](ScenarioSpec& s) { s.batch_size = 5; });
  add("mixed page16 window", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.page_size = 16;
    s.sliding_window = 30;
  });
  add("mixed ragged", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.force_ragged = true;
  });
  add("mixed fp8 e4m3", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.65f;
    s.v_scale = 1.15f;
  });
  add("mixed fp16 page16", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.page_size = 16;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });
  add("mixed ragged fp16 q, fp8 e5m2", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.force_ragged = true;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat8E5M2;
    s.k_scale = 1.7f;
  });
  add("mixed window fp8 e5m2", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.sliding_window = 25;
    s.kv_dtype = DType::kFloat8E5M2;
    s.v_scale = 0.5f;
  });
  add("verify", ForwardMode::kTargetVerify, [](ScenarioSpec& s) { s.draft_token_num = 4; });
  add("verify page16 fp8", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 7;
    s.page_size = 16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.6f;
  });
  add("verify softcap GQA8", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 5;
    s.logit_cap = 6.f;
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
  });
  add("verify window layer", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 6;
    s.sliding_window = 10;
  });
  add("mixed cross model, self layer", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.cross_attention = true;
    s.cross_layer = false;
  });
  add("verify hd256 page128", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 4;
    s.head_dim = 256;
    s.max_kv_len = 150;
    s.page_size = 128;
  });
  add("verify fp16", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 5;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });
  add("verify fp16 q, fp8 e4m3 page16", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 6;
    s.page_size = 16;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.35f;
    s.v_scale = 1.9f;
  });
  add("verify fp32 q", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 4;
    s.q_dtype = DType::kFloat32;
  });
  add("verify v_head_dim 64", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 5;
    s.v_head_dim = 64;
  });
  add("verify v_head_dim 64 fp16 window", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 6;
    s.v_head_dim = 64;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
    s.sliding_window = 12;
  });
  add("verify window fp8 e5m2 page16", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 7;
    s.page_size = 16;
    s.sliding_window = 15;
    s.kv_dtype = DType::kFloat8E5M2;
    s.k_scale = 0.9f;
  });
  add("verify prefix holes", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 6;
    s.max_kv_len = 700;
    s.prefix_holes = 3;
  });
  add("verify prefix holes page16 GQA8", ForwardMode::kTargetVerify, [](ScenarioSpec& s) {
    s.draft_token_num = 3;
    s.max_kv_len = 1200;
    s.page_size = 16;
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
    s.prefix_holes = 1;
  });
  add("draft extend", ForwardMode::kDraftExtend, [](ScenarioSpec& s) { s.max_q_len = 5; });
  add("draft extend fp8 e5m2", ForwardMode::kDraftExtend, [](ScenarioSpec& s) {
    s.max_q_len = 6;
    s.kv_dtype = DType::kFloat8E5M2;
    s.v_scale = 0.4f;
  });
  add("draft extend page16", ForwardMode::kDraftExtend, [](ScenarioSpec& s) {
    s.page_size = 16;
    s.max_q_len = 9;
  });
  add("draft extend window layer", ForwardMode::kDraftExtend, [](ScenarioSpec& s) {
    s.max_q_len = 7;
    s.sliding_window = 18;
    s.page_size = 16;
  });
  add("draft extend window model, full layer", ForwardMode::kDraftExtend, [](ScenarioSpec& s) {
    s.max_q_len = 7;
    s.sliding_window = 18;
    s.window_layer = false;
  });
  add("draft extend softcap fp16", ForwardMode::kDraftExtend, [](ScenarioSpec& s) {
    s.max_q_len = 6;
    s.logit_cap = 5.f;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });

  // ---- multi-step draft -----------------------------------------------------------------------
  add("multi-step topk1", decode, [](ScenarioSpec& s) {
    s.topk = 1;
    s.num_steps = 3;
  });
  add("multi-step topk4", decode, [](ScenarioSpec& s) {
    s.topk = 4;
    s.num_steps = 3;
    s.page_size = 16;
  });
  add("multi-step topk4 fp8", decode, [](ScenarioSpec& s) {
    s.topk = 4;
    s.num_steps = 2;
    s.kv_dtype = DType::kFloat8E5M2;
    s.k_scale = 1.1f;
  });
  add("multi-step softcap", decode, [](ScenarioSpec& s) {
    s.topk = 2;
    s.num_steps = 3;
    s.logit_cap = 6.f;
  });
  add("multi-step softcap fp16 page16", decode, [](ScenarioSpec& s) {
    s.topk = 3;
    s.num_steps = 2;
    s.logit_cap = 4.f;
    s.page_size = 16;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
  });
  add("multi-step window layer", decode, [](ScenarioSpec& s) {
    s.topk = 2;
    s.num_steps = 3;
    s.sliding_window = 10;
  });
  add("multi-step window layer fp8 page16", decode, [](ScenarioSpec& s) {
    s.topk = 4;
    s.num_steps = 2;
    s.sliding_window = 30;
    s.page_size = 16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.6f;
  });
  add("multi-step long prefix sinks", decode, [](ScenarioSpec& s) {
    s.topk = 4;
    s.num_steps = 3;
    s.batch_size = 3;
    s.max_kv_len = 1500;
    s.sinks = true;
  });
  add("multi-step topk6 GQA16 (per-branch path)", decode, [](ScenarioSpec& s) {
    s.topk = 6;
    s.num_steps = 2;
    s.num_q_heads = 32;
    s.num_kv_heads = 2;
  });
  add("multi-step fp32 q", decode, [](ScenarioSpec& s) {
    s.topk = 2;
    s.num_steps = 2;
    s.q_dtype = DType::kFloat32;
  });
  add("multi-step window model, full layer", decode, [](ScenarioSpec& s) {
    s.topk = 2;
    s.num_steps = 2;
    s.sliding_window = 10;
    s.window_layer = false;
  });

  // ---- attention sinks (every mode; with and without a window) --------------------------------
  const ForwardMode mixed = ForwardMode::kMixed;
  const ForwardMode verify = ForwardMode::kTargetVerify;
  const ForwardMode draft_extend = ForwardMode::kDraftExtend;
  add("decode sinks", decode, [](ScenarioSpec& s) { s.sinks = true; });
  add("decode sinks window layer page16", decode, [](ScenarioSpec& s) {
    s.sinks = true;
    s.sliding_window = 24;
    s.page_size = 16;
  });
  add("decode sinks GQA8 bf16 sinks", decode, [](ScenarioSpec& s) {
    s.sinks = true;
    s.sinks_dtype = DType::kBFloat16;
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
  });
  add("decode sinks fp8 e4m3 fp16 sinks", decode, [](ScenarioSpec& s) {
    s.sinks = true;
    s.sinks_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.6f;
    s.v_scale = 1.4f;
  });
  add("extend sinks", extend, [](ScenarioSpec& s) { s.sinks = true; });
  add("extend sinks ragged", extend, [](ScenarioSpec& s) {
    s.sinks = true;
    s.force_ragged = true;
  });
  add("extend sinks window layer", extend, [](ScenarioSpec& s) {
    s.sinks = true;
    s.sliding_window = 20;
    s.page_size = 16;
  });
  add("extend sinks fp32 q softcap", extend, [](ScenarioSpec& s) {
    s.sinks = true;
    s.q_dtype = DType::kFloat32;
    s.logit_cap = 4.f;
  });
  add("mixed sinks ragged", mixed, [](ScenarioSpec& s) {
    s.sinks = true;
    s.batch_size = 5;
    s.force_ragged = true;
  });
  add("verify sinks", verify, [](ScenarioSpec& s) {
    s.sinks = true;
    s.draft_token_num = 6;
  });
  add("verify sinks window layer", verify, [](ScenarioSpec& s) {
    s.sinks = true;
    s.draft_token_num = 5;
    s.sliding_window = 16;
  });
  add("draft extend sinks", draft_extend, [](ScenarioSpec& s) {
    s.sinks = true;
    s.max_q_len = 5;
  });
  // ---- deterministic mode (batch invariance itself: tests/support/batch_invariance.h) ---------
  add("decode deterministic", decode, [](ScenarioSpec& s) {
    s.deterministic = true;
    s.max_kv_len = 3000;  // long enough that the other mode would split
  });
  add("extend deterministic (ragged-sized step)", extend, [](ScenarioSpec& s) {
    s.deterministic = true;
    s.force_ragged = true;  // the threshold is met; deterministic mode stays paged
  });
  add("mixed deterministic window", mixed, [](ScenarioSpec& s) {
    s.deterministic = true;
    s.batch_size = 5;
    s.sliding_window = 30;
  });
  add("verify deterministic sinks", verify, [](ScenarioSpec& s) {
    s.deterministic = true;
    s.sinks = true;
    s.draft_token_num = 5;
  });
  // ---- shared prefixes (the CPU backend's cascade path) ----------------------------------------
  add("decode shared prefix (cascade)", decode, [](ScenarioSpec& s) {
    s.batch_size = 6;
    s.min_kv_len = 700;
    s.max_kv_len = 1500;
    s.allow_tiny = false;
    s.shared_prefix = 640;
  });
  add("decode shared prefix GQA8 fp16 sinks", decode, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.min_kv_len = 600;
    s.max_kv_len = 1300;
    s.shared_prefix = 530;  // not a multiple of the 64-key blocks; one tiny request
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
    s.sinks = true;
  });
  add("verify shared prefix (cascade)", verify, [](ScenarioSpec& s) {
    s.batch_size = 5;
    s.min_kv_len = 700;
    s.max_kv_len = 1400;
    s.allow_tiny = false;
    s.shared_prefix = 600;
    s.draft_token_num = 6;
  });
  add("multi-step sinks", decode, [](ScenarioSpec& s) {
    s.sinks = true;
    s.topk = 2;
    s.num_steps = 2;
  });
  // ---- shared-prefix groups the engine declares (cascade on both backends) --------------------
  // Several groups, ungrouped requests between their members, shared lengths off the pages.
  add("decode declared groups", decode, [](ScenarioSpec& s) {
    s.batch_size = 11;
    s.min_kv_len = 40;
    s.max_kv_len = 400;
    s.declared_groups = 3;
  });
  add("decode declared groups page16 GQA8", decode, [](ScenarioSpec& s) {
    s.batch_size = 9;
    s.min_kv_len = 20;
    s.max_kv_len = 300;
    s.declared_groups = 2;
    s.page_size = 16;
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
  });
  add("decode declared groups fp8 e4m3 page16 sinks", decode, [](ScenarioSpec& s) {
    s.batch_size = 8;
    s.min_kv_len = 20;
    s.max_kv_len = 260;
    s.declared_groups = 2;
    s.page_size = 16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.6f;
    s.v_scale = 1.3f;
    s.sinks = true;
  });
  add("decode declared groups long split", decode, [](ScenarioSpec& s) {
    s.batch_size = 6;
    s.min_kv_len = 1500;
    s.max_kv_len = 3000;
    s.declared_groups = 2;
    s.allow_tiny = false;
  });
  // (CUDA: fp32-io DECODE keeps its fp32 kernel and ignores the groups.)
  add("decode declared groups fp32 q softcap", decode, [](ScenarioSpec& s) {
    s.batch_size = 7;
    s.declared_groups = 2;
    s.q_dtype = DType::kFloat32;
    s.logit_cap = 5.f;
  });
  add("decode declared groups window model full layer", decode, [](ScenarioSpec& s) {
    s.batch_size = 7;
    s.declared_groups = 2;
    s.sliding_window = 24;
    s.window_layer = false;
  });
  add("decode declared groups window layer", decode, [](ScenarioSpec& s) {
    s.batch_size = 7;
    s.declared_groups = 2;
    s.sliding_window = 24;
  });
  add("decode declared groups deterministic (ignored)", decode, [](ScenarioSpec& s) {
    s.batch_size = 7;
    s.declared_groups = 2;
    s.deterministic = true;
  });
  add("verify declared groups", verify, [](ScenarioSpec& s) {
    s.batch_size = 9;
    s.min_kv_len = 30;
    s.max_kv_len = 300;
    s.declared_groups = 3;
    s.draft_token_num = 5;
  });
  add("verify declared groups fp32 q GQA8", verify, [](ScenarioSpec& s) {
    s.batch_size = 7;
    s.min_kv_len = 30;
    s.declared_groups = 2;
    s.draft_token_num = 4;
    s.q_dtype = DType::kFloat32;
    s.num_q_heads = 16;
    s.num_kv_heads = 2;
  });
  add("verify declared groups page16 sinks", verify, [](ScenarioSpec& s) {
    s.batch_size = 8;
    s.min_kv_len = 30;
    s.max_kv_len = 250;
    s.declared_groups = 2;
    s.draft_token_num = 7;
    s.page_size = 16;
    s.sinks = true;
  });

  // ---- planned on the device (issue 15): no seq_lens_cpu -----------------------------------
  // The CUDA backend plans these from the device seq_lens (the CPU backend reads them as
  // always); the oracle judges both.
  add("decode device-plan", decode, [](ScenarioSpec& s) { s.device_lengths = true; });
  add("decode device-plan window page16", decode, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.sliding_window = 24;
    s.page_size = 16;
  });
  add("decode device-plan GQA4 fp8 e4m3", decode, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.num_q_heads = 16;
    s.num_kv_heads = 4;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.8f;
  });
  add("decode device-plan MHA sinks", decode, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.num_q_heads = 4;
    s.num_kv_heads = 4;
    s.sinks = true;
  });
  add("verify device-plan", verify, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.draft_token_num = 5;
  });
  add("verify device-plan window layer fp8", verify, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.draft_token_num = 6;
    s.sliding_window = 10;
    s.kv_dtype = DType::kFloat8E4M3;
  });
  add("verify device-plan 20-token trees page16", verify, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.draft_token_num = 20;
    s.page_size = 16;
  });
  // EXTEND-like steps without any host length (no seq_lens_cpu / extend_*_cpu).
  add("extend device-plan", extend, [](ScenarioSpec& s) { s.device_lengths = true; });
  add("extend device-plan window layer page16 fp8", extend, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.sliding_window = 20;
    s.page_size = 16;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.7f;
  });
  add("extend device-plan no prefix hd64", extend, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.head_dim = 64;
    s.max_kv_len = 45;
    s.min_q_len = 45;
    s.max_q_len = 45;
  });
  add("mixed device-plan fp16 sinks", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.batch_size = 5;
    s.q_dtype = DType::kFloat16;
    s.kv_dtype = DType::kFloat16;
    s.sinks = true;
  });
  add("draft extend device-plan", ForwardMode::kDraftExtend, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.max_q_len = 5;
  });
  // Encoder-decoder models: no encoder_lens_cpu either (both index sets placed on the device).
  add("decode device-plan cross layer", decode, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.cross_attention = true;
    s.save_kv_cache = false;  // encoder K/V cached by an earlier step
  });
  add("decode device-plan cross self layer page16", decode, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.cross_attention = true;
    s.cross_layer = false;
    s.page_size = 16;
  });
  add("extend device-plan cross layer", extend, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.cross_attention = true;
  });
  add("extend device-plan cross self layer fp8", extend, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.cross_attention = true;
    s.cross_layer = false;
    s.kv_dtype = DType::kFloat8E4M3;
    s.k_scale = 0.9f;
  });
  add("mixed device-plan cross layer page16", ForwardMode::kMixed, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.batch_size = 5;
    s.cross_attention = true;
    s.page_size = 16;
  });
  add("multi-step device-plan topk2", decode, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.topk = 2;
    s.num_steps = 3;
  });
  add("multi-step device-plan topk4 page16 MHA", decode, [](ScenarioSpec& s) {
    s.device_lengths = true;
    s.topk = 4;
    s.num_steps = 2;
    s.page_size = 16;
    s.num_q_heads = 4;
    s.num_kv_heads = 4;
  });
  return rows;
}

}  // namespace kvattn::testing
