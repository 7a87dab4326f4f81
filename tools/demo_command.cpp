// `kvattn demo`: a simulated serving session. Requests arrive over time with varied prompts, half
// of them behind a shared system prompt whose KV slots they reuse; the scheduler runs
// continuous batching (EXTEND steps for arrivals, MIXED when decodes are running, DECODE steps,
// every few decode steps a TARGET_VERIFY speculative step with a random draft tree) through one
// backend, for a small model whose q/k/v are random (no weights). Sampled steps are checked
// against the float64 reference.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "cli_args.h"
#include "commands.h"
#include "core/batch_layout.h"
#include "core/step.h"
#include "kvattn/kvattn.h"
#include "oracle.h"
#include "reference/scenario.h"
#include "step_batch.h"
#include "tool_support.h"

namespace kvattn::tools {
namespace {

// The model: small enough for two CPU cores, shaped like a real GQA model.
constexpr int kNumLayers = 4;
constexpr int kQHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 128;
constexpr DType kDType = DType::kBFloat16;

// The workload.
constexpr int kSharedPrefixLen = 256;  ///< the system prompt; a multiple of every page size
constexpr int kMinPrompt = 16;
constexpr int kMaxPrompt = 1024;
constexpr int kMinNewTokens = 8;
constexpr int kMaxNewTokens = 40;
// The scheduler.
constexpr int kMaxRunning = 32;            ///< requests decoding at once
constexpr int kPrefillTokenBudget = 2048;  ///< new prompt tokens per EXTEND / MIXED step
constexpr int kVerifyEvery = 6;            ///< a TARGET_VERIFY step after this many DECODE steps
constexpr int kDraftTokens = 6;            ///< tree tokens per request in a verify step
constexpr int kDraftChain = 4;  ///< the tree's main chain (the tokens that may be accepted)
/// EXTEND steps with at least this many new tokens (and more new than cached) take the ragged +
/// paged-prefix path, so the session exercises both EXTEND paths (the reference's 4096 is past
/// this workload's steps); a step with no cached prefix takes it at any size.
constexpr int64_t kRaggedThreshold = 1024;
/// Oracle cost bound per checked step, in (query token, key) pairs: keeps the float64 check of a
/// large EXTEND step to a second on two cores.
constexpr int64_t kCheckPairBudget = 300'000;

const std::vector<OptionSpec>& demo_options() {
  static const std::vector<OptionSpec> specs = {
      {"--device", "cpu|cuda", "backend to serve with (default: cuda when a GPU is visible)"},
      {"--requests", "N", "requests in the session (default 64)"},
      {"--page-size", "P", "KV page size, a power of two up to 128 (default 16)"},
      {"--check-every", "N",
       "check every N-th step (and every verify step) against the float64 "
       "reference (default 4; 0 = never)"},
      {"--seed", "N", "seed of the workload and the data (default 1)"},
      {"--quiet", "", "print only the summary"},
  };
  return specs;
}

struct Request {
  int id = 0;
  int arrival_step = 0;
  bool shares_prefix = false;
  int prompt_len = 0;  ///< own prompt tokens, after the shared prefix when there is one
  int max_new_tokens = 0;
  int pool_row = -1;
  int seq_len = 0;  ///< tokens whose K/V are committed
  int generated = 0;
  std::vector<int32_t> slots;  ///< slot of each position that has one (>= seq_len)
  int prefix_len() const { return shares_prefix ? kSharedPrefixLen : 0; }
  int total_prompt() const { return prefix_len() + prompt_len; }
};

/// What one step did, for the progress line and the summary.
struct StepStats {
  ForwardMode mode = ForwardMode::kIdle;
  int requests = 0;
  int new_requests = 0;
  int64_t query_tokens = 0;
  int64_t kv_tokens = 0;
  double seconds = 0;   ///< metadata + all layers, device synchronized
  bool ragged = false;  ///< EXTEND / MIXED by the ragged + paged-prefix path
};

struct CheckStats {
  int steps = 0;
  int failed = 0;
  double worst = 0;
  double seconds = 0;
};

class ServingSession {
 public:
  ServingSession(const ToolDevice& device, int num_requests, int page_size, int check_every,
                 uint64_t seed, bool quiet)
      : device_(device),
        page_size_(page_size),
        check_every_(check_every),
        quiet_(quiet),
        rng_(seed),
        data_rng_(seed ^ 0xda7a),
        requests_(make_requests(num_requests, rng_)),
        cache_(KvCache::allocate(cache_config(requests_, page_size, device.device))),
        pool_(ReqToTokenPool::allocate(num_requests + 1, max_context_len(), device.device)),
        allocator_(cache_.num_slots(), page_size),
        random_(
            device.device,
            int64_t(kPrefillTokenBudget + kMaxPrompt + kMaxRunning * 8) * kQHeads * kHeadDim * 2,
            kHeadDim, seed ^ 0x5eed) {
    // NaN in every slot nobody wrote (bf16 0xFFFF): a read of a wrong slot poisons the output.
    for (int layer = 0; layer < kNumLayers; ++layer) {
      fill_bytes(cache_.k_buffer(layer).data(), device.device, 0xFF,
                 size_t(cache_.k_buffer(layer).nbytes()));
      fill_bytes(cache_.v_buffer(layer).data(), device.device, 0xFF,
                 size_t(cache_.v_buffer(layer).nbytes()));
    }
    config_.kv_cache = &cache_;
    config_.req_to_token_pool = &pool_;
    config_.num_q_heads = kQHeads;
    config_.num_kv_heads = kKvHeads;
    config_.head_dim = kHeadDim;
    config_.q_dtype = kDType;
    config_.ragged_extend_threshold = kRaggedThreshold;
    backend_ = make_backend(device.kind, config_);
    for (int row = num_requests - 1; row >= 0; --row) free_rows_.push_back(row);
  }

  /// Runs the session to the end; returns true when every check passed.
  bool run() {
    const auto start = std::chrono::steady_clock::now();
    int shared = 0;
    for (const Request& r : requests_) shared += r.shares_prefix;
    std::printf("kvattn demo on %s (%s)\n", backend_kind_name(device_.kind),
                device_description(device_).c_str());
    std::printf(
        "model: %d layers, %d q / %d kv heads, head_dim %d, %s; KV pool %lld slots, "
        "page %d\n",
        kNumLayers, kQHeads, kKvHeads, kHeadDim, dtype_name(kDType),
        static_cast<long long>(cache_.num_slots()), page_size_);
    std::printf(
        "workload: %zu requests, prompts %d..%d tokens, %d share a %d-token system "
        "prompt, %d..%d new tokens each; at most %d running, %d prompt tokens per step\n",
        requests_.size(), kMinPrompt, kMaxPrompt, shared, kSharedPrefixLen, kMinNewTokens,
        kMaxNewTokens, kMaxRunning, kPrefillTokenBudget);
    std::printf(
        "steps with >= %lld new tokens (more than cached) or no cached prefix take the ragged "
        "+ paged-prefix EXTEND path; a "
        "verify step (%d-token draft trees) follows every %d decode steps\n\n",
        static_cast<long long>(kRaggedThreshold), kDraftTokens, kVerifyEvery);

    warm_shared_prefix();  // step 0
    ++step_;
    size_t next_arrival = 0;
    int decodes_since_verify = 0;
    while (finished_ < int(requests_.size())) {
      while (next_arrival < requests_.size() && requests_[next_arrival].arrival_step <= step_) {
        waiting_.push_back(int(next_arrival++));
      }
      if (!waiting_.empty() && int(running_.size()) < kMaxRunning) {
        run_extend_step();
      } else if (!running_.empty()) {
        if (decodes_since_verify >= kVerifyEvery) {
          run_verify_step();
          decodes_since_verify = 0;
        } else {
          run_decode_step();
          ++decodes_since_verify;
        }
      } else {
        run_idle_step();
      }
      ++step_;
    }
    print_summary(seconds_since(start));
    return checks_.failed == 0;
  }

 private:
  // ---- setup ----------------------------------------------------------------------------

  static std::vector<Request> make_requests(int count, Rng& rng) {
    std::vector<Request> requests(static_cast<size_t>(count));
    for (int i = 0; i < count; ++i) {
      Request& r = requests[size_t(i)];
      r.id = i;
      // A burst at the start, then about two arrivals per step.
      r.arrival_step = i < 8 ? 1 : int(1 + i / 2 + rng.uniform_int(0, 3));
      r.shares_prefix = rng.uniform() < 0.5;
      const double log_len =
          std::log(double(kMinPrompt)) +
          rng.uniform() * (std::log(double(kMaxPrompt)) - std::log(double(kMinPrompt)));
      r.prompt_len = int(std::lround(std::exp(log_len)));
      r.max_new_tokens = int(rng.uniform_int(kMinNewTokens, kMaxNewTokens));
    }
    std::stable_sort(requests.begin(), requests.end(), [](const Request& a, const Request& b) {
      return a.arrival_step < b.arrival_step;
    });
    for (size_t i = 0; i < requests.size(); ++i) requests[i].id = int(i);
    return requests;
  }

  static int max_context_len() {
    return kSharedPrefixLen + kMaxPrompt + kMaxNewTokens + kDraftTokens + 1;
  }

  /// Enough slots for every request alive at once, whole pages each, plus the shared prefix
  /// and the reserved page 0: the session never runs out.
  static KvCacheConfig cache_config(const std::vector<Request>& requests, int page_size,
                                    Device device) {
    int64_t pages = 1 + (kSharedPrefixLen + page_size - 1) / page_size;
    for (const Request& r : requests) {
      const int64_t own = r.prompt_len + r.max_new_tokens + kDraftTokens + 1;
      pages += (own + page_size - 1) / page_size + 1;
    }
    KvCacheConfig config;
    config.num_layers = kNumLayers;
    config.num_slots = pages * page_size;
    config.num_kv_heads = kKvHeads;
    config.head_dim = kHeadDim;
    config.page_size = page_size;
    config.dtype = kDType;
    config.device = device;
    return config;
  }

  AttentionLayer layer(int layer_id) const {
    AttentionLayer layer;
    layer.layer_id = layer_id;
    layer.num_q_heads = kQHeads;
    layer.num_kv_heads = kKvHeads;
    layer.head_dim = kHeadDim;
    layer.scaling = float(1.0 / std::sqrt(double(kHeadDim)));
    return layer;
  }

  /// Gives positions [r.slots.size(), up_to) of a request their slots and records them in
  /// req_to_token.
  void ensure_slots(Request& r, int up_to) {
    const int have = int(r.slots.size());
    if (up_to <= have) return;
    const int32_t last = have > 0 ? r.slots.back() : 0;
    std::vector<int32_t> fresh = allocator_.allocate_tokens(have, last, up_to - have);
    r.slots.insert(r.slots.end(), fresh.begin(), fresh.end());
    pool_.write(r.pool_row, have, fresh);
  }

  /// The system prompt: prefilled once on its own pool row; requests that share it copy its
  /// slots into their rows and extend from there.
  void warm_shared_prefix() {
    Request system;
    system.pool_row = pool_.max_reqs() - 1;
    ensure_slots(system, kSharedPrefixLen);
    shared_slots_ = system.slots;
    StepSpec spec;
    spec.mode = ForwardMode::kExtend;
    spec.req_pool_indices = {system.pool_row};
    spec.seq_lens = {kSharedPrefixLen};
    spec.prefix_lens = {0};
    spec.extend_lens = {kSharedPrefixLen};
    spec.out_cache_loc = shared_slots_;
    execute(spec, "(the shared system prompt)", 0);
  }

  // ---- steps ------------------------------------------------------------------------------

  void run_extend_step() {
    StepSpec spec;
    spec.mode = running_.empty() ? ForwardMode::kExtend : ForwardMode::kMixed;
    std::vector<int> admitted;
    int budget = kPrefillTokenBudget;
    while (!waiting_.empty() && int(running_.size() + admitted.size()) < kMaxRunning) {
      Request& r = requests_[size_t(waiting_.front())];
      if (!admitted.empty() && r.prompt_len > budget) break;
      budget -= r.prompt_len;
      admitted.push_back(waiting_.front());
      waiting_.pop_front();
      r.pool_row = free_rows_.back();
      free_rows_.pop_back();
      if (r.shares_prefix) {
        r.slots = shared_slots_;
        pool_.write(r.pool_row, 0, r.slots);
      }
      ensure_slots(r, r.total_prompt());
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.total_prompt());
      spec.prefix_lens.push_back(r.prefix_len());
      spec.extend_lens.push_back(r.prompt_len);
      spec.out_cache_loc.insert(spec.out_cache_loc.end(), r.slots.begin() + r.prefix_len(),
                                r.slots.begin() + r.total_prompt());
    }
    // MIXED: the running requests decode one token in the same step.
    for (int id : running_) {
      Request& r = requests_[size_t(id)];
      ensure_slots(r, r.seq_len + 1);
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.seq_len + 1);
      spec.prefix_lens.push_back(r.seq_len);
      spec.extend_lens.push_back(1);
      spec.out_cache_loc.push_back(r.slots[size_t(r.seq_len)]);
    }
    execute(spec, "", int(admitted.size()));
    for (int id : running_) commit(requests_[size_t(id)], 1);
    for (int id : admitted) {
      Request& r = requests_[size_t(id)];
      r.seq_len = r.total_prompt();
      r.generated = 1;  // the prefill step samples the first new token
      running_.push_back(id);
    }
    retire_finished();
  }

  void run_decode_step() {
    StepSpec spec;
    spec.mode = ForwardMode::kDecode;
    for (int id : running_) {
      Request& r = requests_[size_t(id)];
      ensure_slots(r, r.seq_len + 1);
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.seq_len + 1);
      spec.out_cache_loc.push_back(r.slots[size_t(r.seq_len)]);
    }
    execute(spec, "", 0);
    for (int id : running_) commit(requests_[size_t(id)], 1);
    retire_finished();
  }

  /// Speculative decoding: each request verifies kDraftTokens tree tokens. Tokens 0..kDraftChain-1
  /// form the tree's main chain (each the child of the one before); the rest hang off random
  /// earlier tokens. Tree token i sees the whole prefix and its ancestors and itself. The target
  /// model "accepts" a random number of chain tokens; they are already at the next positions
  /// with their K/V saved, so acceptance just moves seq_len (rejected positions are reused).
  void run_verify_step() {
    StepSpec spec;
    spec.mode = ForwardMode::kTargetVerify;
    spec.draft_token_num = kDraftTokens;
    for (int id : running_) {
      Request& r = requests_[size_t(id)];
      ensure_slots(r, r.seq_len + kDraftTokens);
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.seq_len);
      spec.out_cache_loc.insert(spec.out_cache_loc.end(), r.slots.begin() + r.seq_len,
                                r.slots.begin() + r.seq_len + kDraftTokens);
      append_tree_mask(r.seq_len, random_tree_parents(kDraftTokens, kDraftChain, data_rng_),
                       spec.custom_mask);
    }
    execute(spec, "", 0);
    int accepted_total = 0;
    for (int id : running_) {
      Request& r = requests_[size_t(id)];
      const int room = r.max_new_tokens - r.generated;
      const int accepted = int(std::min<int64_t>(room, data_rng_.uniform_int(1, kDraftChain)));
      accepted_total += accepted;
      commit(r, accepted);
    }
    verify_requests_ += int(running_.size());
    verify_accepted_ += accepted_total;
    retire_finished();
  }

  void run_idle_step() {
    StepSpec spec;
    spec.mode = ForwardMode::kIdle;
    execute(spec, "", 0);
  }

  void commit(Request& r, int tokens) {
    r.seq_len += tokens;
    r.generated += tokens;
  }

  void retire_finished() {
    std::vector<int> still_running;
    for (int id : running_) {
      Request& r = requests_[size_t(id)];
      if (r.generated < r.max_new_tokens) {
        still_running.push_back(id);
        continue;
      }
      // The shared prefix's pages stay with the system prompt; the request frees its own.
      const std::vector<int32_t> own(r.slots.begin() + r.prefix_len(), r.slots.end());
      allocator_.free_slots(own);
      r.slots.clear();
      free_rows_.push_back(r.pool_row);
      r.pool_row = -1;
      ++finished_;
    }
    running_ = std::move(still_running);
  }

  // ---- running a step through the backend -------------------------------------------------

  /// One layer's q/k/v for a step: views on the backend's device and the same values on the host.
  struct LayerInputs {
    TensorView q, k, v;
    TensorView q_host, k_host, v_host;
  };

  /// Runs one step (metadata once, then every layer) and, on sampled steps, checks it.
  void execute(const StepSpec& spec, const char* label, int new_requests) {
    const std::vector<StepRequestRows> rows = step_request_rows(spec);
    StepStats stats;
    stats.mode = spec.mode;
    stats.new_requests = new_requests;
    stats.requests = int(spec.seq_lens.size());
    for (const StepRequestRows& r : rows) {
      stats.query_tokens += r.q_len;
      stats.kv_tokens += r.kv_extent;
    }
    const int64_t tokens = stats.query_tokens;
    StepBatch batch(spec, device_.device, &cache_, &pool_);
    // The backend's own derivation of the step (core::derive_step): ragged or paged EXTEND.
    stats.ragged = core::derive_step(batch.batch(), config_, device_.device).ragged;
    std::vector<LayerInputs> layers;
    for (int l = 0; l < kNumLayers; ++l) {
      LayerInputs d;
      std::tie(d.q, d.q_host) = random_.slice(data_rng_, tokens, kQHeads);
      std::tie(d.k, d.k_host) = random_.slice(data_rng_, tokens, kKvHeads);
      std::tie(d.v, d.v_host) = random_.slice(data_rng_, tokens, kKvHeads);
      layers.push_back(d);
    }
    std::vector<OwnedTensor> outs;
    for (int l = 0; l < kNumLayers; ++l) {
      outs.push_back(OwnedTensor::make(device_.device, kDType, {tokens, kQHeads * kHeadDim}));
    }

    const auto start = std::chrono::steady_clock::now();
    backend_->init_forward_metadata(batch.batch());
    for (int l = 0; l < kNumLayers; ++l) {
      backend_->forward(layers[size_t(l)].q, layers[size_t(l)].k, layers[size_t(l)].v,
                        outs[size_t(l)].view, layer(l), batch.batch());
    }
    synchronize(device_.device);
    stats.seconds = seconds_since(start);
    account(stats);

    std::string check_note;
    const bool check = check_every_ > 0 && spec.mode != ForwardMode::kIdle &&
                       (step_ % check_every_ == 0 || spec.mode == ForwardMode::kTargetVerify);
    if (check) {
      const int l = checks_.steps % kNumLayers;  // each check looks at the next layer
      check_note = check_step(spec, rows, layer(l), layers[size_t(l)], outs[size_t(l)].view);
    }
    if (!quiet_) print_step(stats, label, check_note);
  }

  /// Checks some requests of the step on one layer against the float64 reference: picks
  /// requests in random order while the oracle's cost stays within kCheckPairBudget. The pool
  /// snapshot is taken after the step, but the step's own new K/V are put into it from the
  /// inputs (as the oracle models the save), so a wrong save by the backend shows up too.
  std::string check_step(const StepSpec& spec, const std::vector<StepRequestRows>& rows,
                         const AttentionLayer& checked_layer, const LayerInputs& inputs,
                         const TensorView& out) {
    const auto start = std::chrono::steady_clock::now();
    const std::vector<size_t> picked = pick_checked_requests(rows, kCheckPairBudget, 8, data_rng_);
    std::vector<std::vector<int32_t>> slot_rows;
    for (size_t i : picked) {
      const Request* owner = find_request(spec.req_pool_indices[i]);
      const std::vector<int32_t>& slots = owner != nullptr ? owner->slots : shared_slots_;
      slot_rows.emplace_back(slots.begin(), slots.begin() + rows[i].kv_extent);
    }
    const double err = check_step_requests(
        cache_, checked_layer, spec, rows, picked, slot_rows,
        StepHostInputs{inputs.q_host, inputs.k_host, inputs.v_host, kQHeads, kKvHeads, kDType},
        out);
    const bool ok = err <= tolerance_;
    checks_.steps += 1;
    checks_.failed += ok ? 0 : 1;
    checks_.worst = std::max(checks_.worst, err);
    checks_.seconds += seconds_since(start);
    char note[128];
    std::snprintf(note, sizeof(note), "check L%d %zu/%zu reqs: %.1e %s", checked_layer.layer_id,
                  picked.size(), rows.size(), err, ok ? "ok" : "FAIL");
    if (!ok && quiet_) std::printf("step %d: %s\n", step_, note);
    return note;
  }

  /// The live request on a pool row (running or just admitted); null for the system prompt's.
  const Request* find_request(int pool_row) const {
    for (const Request& r : requests_) {
      if (r.pool_row == pool_row) return &r;
    }
    return nullptr;  // the system prompt's row
  }

  void account(const StepStats& stats) {
    mode_counts_[int(stats.mode)] += 1;
    attention_seconds_ += stats.seconds;
    switch (stats.mode) {
      case ForwardMode::kExtend:
      case ForwardMode::kMixed:
        prefill_tokens_ += stats.query_tokens;
        prefill_seconds_ += stats.seconds;
        break;
      case ForwardMode::kDecode:
      case ForwardMode::kTargetVerify:
        decode_query_tokens_ += stats.query_tokens;
        decode_seconds_ += stats.seconds;
        break;
      default:
        break;
    }
  }

  void print_step(const StepStats& stats, const char* label, const std::string& check_note) {
    char line[256];
    const double tokens_per_s =
        stats.seconds > 0 ? double(stats.query_tokens) / stats.seconds : 0.0;
    std::snprintf(line, sizeof(line), "step %3d %-13s reqs %3d", step_,
                  forward_mode_name(stats.mode), stats.requests);
    std::string text = line;
    if (stats.new_requests > 0) text += " (+" + std::to_string(stats.new_requests) + " new)";
    std::snprintf(line, sizeof(line), "  q %5lld  kv %6lld  %9s  %8.0f tok/s",
                  static_cast<long long>(stats.query_tokens),
                  static_cast<long long>(stats.kv_tokens), format_us(stats.seconds * 1e6).c_str(),
                  tokens_per_s);
    if (text.size() < 36) text += std::string(36 - text.size(), ' ');
    text += line;
    if (stats.ragged) text += "  ragged+prefix";
    if (*label) text += std::string("  ") + label;
    if (!check_note.empty()) text += "  [" + check_note + "]";
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
  }

  void print_summary(double wall_seconds) {
    int64_t generated = 0;
    int64_t prompt = 0;
    int shared = 0;
    for (const Request& r : requests_) {
      generated += r.generated;
      prompt += r.prompt_len;
      shared += r.shares_prefix;
    }
    auto count = [&](ForwardMode m) { return mode_counts_[int(m)]; };
    std::printf("\nsummary\n");
    std::printf(
        "  steps: %d (the system prompt, %d extend, %d mixed, %d decode, %d verify, %d "
        "idle)\n",
        step_, count(ForwardMode::kExtend) - 1, count(ForwardMode::kMixed),
        count(ForwardMode::kDecode), count(ForwardMode::kTargetVerify), count(ForwardMode::kIdle));
    std::printf(
        "  requests: %zu finished, %lld prompt tokens prefilled, %lld tokens generated; "
        "%d requests reused the system prompt's KV (%d tokens not recomputed)\n",
        requests_.size(), static_cast<long long>(prompt), static_cast<long long>(generated), shared,
        shared * kSharedPrefixLen);
    std::printf("  prefill: %lld query tokens x %d layers in %s of attention: %.0f tokens/s\n",
                static_cast<long long>(prefill_tokens_), kNumLayers,
                format_us(prefill_seconds_ * 1e6).c_str(),
                prefill_seconds_ > 0 ? double(prefill_tokens_) / prefill_seconds_ : 0.0);
    std::printf(
        "  decode + verify: %lld query tokens x %d layers in %s of attention: %.0f "
        "tokens/s\n",
        static_cast<long long>(decode_query_tokens_), kNumLayers,
        format_us(decode_seconds_ * 1e6).c_str(),
        decode_seconds_ > 0 ? double(decode_query_tokens_) / decode_seconds_ : 0.0);
    if (verify_requests_ > 0) {
      std::printf(
          "  speculative: %d request-verifications of %d-token trees accepted %.2f "
          "tokens each on average\n",
          verify_requests_, kDraftTokens, double(verify_accepted_) / verify_requests_);
    }
    std::printf("  generation: %lld tokens in %s of attention: %.0f tokens/s end to end\n",
                static_cast<long long>(generated), format_us(attention_seconds_ * 1e6).c_str(),
                attention_seconds_ > 0 ? double(generated) / attention_seconds_ : 0.0);
    if (checks_.steps > 0) {
      std::printf(
          "  verification: %d sampled steps checked against the float64 reference "
          "(%.1f s), worst max_rel_err %.2e, tolerance %.0e: %s\n",
          checks_.steps, checks_.seconds, checks_.worst, tolerance_,
          checks_.failed == 0 ? "PASS" : "FAIL");
    } else {
      std::printf("  verification: off (--check-every 0)\n");
    }
    std::printf("  wall time: %.1f s\n", wall_seconds);
    std::printf("%s\n", checks_.failed == 0 ? "demo OK" : "demo FAILED: a verification failed");
  }

  ToolDevice device_;
  int page_size_;
  int check_every_;
  bool quiet_;
  Rng rng_;
  Rng data_rng_;
  std::vector<Request> requests_;
  KvCache cache_;
  ReqToTokenPool pool_;
  SlotAllocator allocator_;
  RandomSource random_;
  BackendConfig config_;
  std::unique_ptr<AttentionBackend> backend_;
  std::vector<int32_t> shared_slots_;
  std::vector<int> free_rows_;
  std::deque<int> waiting_;
  std::vector<int> running_;
  int step_ = 0;
  int finished_ = 0;
  int mode_counts_[8] = {};
  int64_t prefill_tokens_ = 0;
  int64_t decode_query_tokens_ = 0;
  double prefill_seconds_ = 0;
  double decode_seconds_ = 0;
  double attention_seconds_ = 0;
  int verify_requests_ = 0;
  int verify_accepted_ = 0;
  CheckStats checks_;
  double tolerance_ = testing::tolerance_for(kDType, kDType);
};

}  // namespace

std::string demo_usage() {
  return "usage: kvattn demo [options]\n"
         "\n"
         "Simulates a serving session: requests with varied prompts arrive over time (half of\n"
         "them behind a shared system prompt whose KV slots they reuse), continuous batching runs\n"
         "EXTEND steps for arrivals (MIXED while others decode), DECODE steps, and every few\n"
         "steps a TARGET_VERIFY speculative step with a random draft tree. The model is small\n"
         "(4 layers, 8 q / 2 kv heads, head_dim 128, bf16) with random q/k/v instead of weights;\n"
         "all attention goes through the chosen backend. Prints per-step progress and tokens/s;\n"
         "sampled steps are checked against the float64 reference. Exit code 1 if a check fails.\n"
         "\n"
         "options:\n" +
         format_options(demo_options());
}

int run_demo(const std::vector<std::string>& args) {
  const ParsedArgs parsed(args, demo_options());
  const ToolDevice device = select_device(parsed.get("--device", ""));
  const int requests = int(parsed.get_int("--requests", 64, 1, 4096));
  const int page_size = int(parsed.get_int("--page-size", 16, 1, 128));
  if ((page_size & (page_size - 1)) != 0) {
    throw UsageError("option '--page-size': got " + std::to_string(page_size) +
                     ", expected a power of two in [1, 128]");
  }
  const int check_every = int(parsed.get_int("--check-every", 4, 0, 1'000'000));
  const uint64_t seed = uint64_t(parsed.get_int("--seed", 1, 0, INT64_MAX));
  ServingSession session(device, requests, page_size, check_every, seed, parsed.has("--quiet"));
  return session.run() ? 0 : 1;
}

}  // namespace kvattn::tools
