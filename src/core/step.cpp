#include "core/step.h"

#include "core/validate.h"

namespace kvattn::core {

bool uses_device_lengths(const ForwardBatch& batch, const BackendConfig& config, bool device_plan) {
  const bool mode = batch.mode == ForwardMode::kDecode || batch.mode == ForwardMode::kTargetVerify;
  return device_plan && mode && !batch.seq_lens_cpu.defined() && batch.seq_lens.defined() &&
         !batch.seq_lens.device().is_cpu() && !batch.shared_prefix_group_cpu.defined() &&
         !config.is_encoder_decoder;
}

StepFacts derive_step(const ForwardBatch& batch, const BackendConfig& config, Device device,
                      bool device_plan) {
  StepFacts facts;
  facts.mode = batch.mode;
  facts.batch_size = batch.batch_size;
  facts.device_lengths = uses_device_lengths(batch, config, device_plan);
  facts.lens = validate_batch_lengths(batch, config, device, facts.device_lengths);
  switch (batch.mode) {
    case ForwardMode::kIdle:
      return facts;
    case ForwardMode::kDecode:
      facts.num_tokens = batch.batch_size;
      break;
    case ForwardMode::kTargetVerify:
      facts.draft_token_num = batch.spec.draft_token_num;
      facts.num_tokens = int64_t(batch.batch_size) * batch.spec.draft_token_num;
      break;
    default:
      for (int32_t e : facts.lens.extend_lens) facts.new_tokens += e;
      facts.num_tokens = facts.new_tokens;
      break;
  }
  for (int32_t e : facts.lens.prefix_lens) facts.prefix_tokens += e;
  RaggedExtendRule rule;
  rule.threshold = config.ragged_extend_threshold;
  rule.has_window = config.sliding_window_size >= 0;
  rule.is_encoder_decoder = config.is_encoder_decoder;
  rule.deterministic = config.deterministic;
  rule.cache_is_io_dtype =
      config.kv_cache != nullptr && config.kv_cache->config().dtype == config.q_dtype;
  facts.ragged = use_ragged_extend(batch.mode, facts.new_tokens, facts.prefix_tokens, rule);
  return facts;
}

}  // namespace kvattn::core
