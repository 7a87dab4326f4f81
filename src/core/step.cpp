#include "core/step.h"

#include "core/validate.h"

namespace kvattn::core {

bool uses_device_lengths(const ForwardBatch& batch, const BackendConfig& config, bool device_plan) {
  if (!device_plan || batch.shared_prefix_group_cpu.defined()) return false;
  auto on_device = [](const TensorView& t) { return t.defined() && !t.device().is_cpu(); };
  if (batch.seq_lens_cpu.defined() || !on_device(batch.seq_lens)) return false;
  // Encoder-decoder models: the encoder lengths on the device too (they place both index sets).
  if (config.is_encoder_decoder &&
      (batch.encoder_lens_cpu.defined() || !on_device(batch.encoder_lens))) {
    return false;
  }
  switch (batch.mode) {
    case ForwardMode::kDecode:
    case ForwardMode::kTargetVerify:
      return true;
    case ForwardMode::kExtend:
    case ForwardMode::kMixed:
    case ForwardMode::kDraftExtend:
      // No host copy of any length, the prefix lengths on the device (the query rows are
      // seq - prefix a request) and out_cache_loc, whose length is the step's token count.
      return !batch.extend_prefix_lens_cpu.defined() && !batch.extend_seq_lens_cpu.defined() &&
             on_device(batch.extend_prefix_lens) &&
             (!batch.extend_seq_lens.defined() || on_device(batch.extend_seq_lens)) &&
             batch.out_cache_loc.defined() && batch.out_cache_loc.ndim() == 1;
    default:
      return false;
  }
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
      if (facts.device_lengths) {
        // The extend lengths stay on the device: the step's rows are out_cache_loc's (the device
        // checks that the lengths add up to them), its prefix unknown (0: never the ragged path).
        facts.new_tokens = batch.out_cache_loc.size(0);
      } else {
        for (int32_t e : facts.lens.extend_lens) facts.new_tokens += e;
      }
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
  // (A step planned on the device takes the paged path: the choice would read the lengths.)
  facts.ragged = !facts.device_lengths &&
                 use_ragged_extend(batch.mode, facts.new_tokens, facts.prefix_tokens, rule);
  return facts;
}

}  // namespace kvattn::core
