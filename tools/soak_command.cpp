// `kvattn soak`: a long serving run through one backend (issue 21). Requests arrive at random,
// a share of them behind one of a few system prompts whose KV slots they reuse, run EXTEND /
// MIXED prefills, DECODE steps and TARGET_VERIFY speculative steps with random trees, and finish;
// their pages go back to the allocator and their req_to_token rows are reused. Along the way:
//   - sampled steps are checked against the float64 reference (any wrong answer fails the run);
//   - every --fault-every steps one step is sent with a bad index (a slot past the pool, a
//     negative slot, a req_to_token entry the step reads, a row past req_to_token); it must be
//     refused as a whole (the KV pool and req_to_token byte for byte as before), named and
//     attributed to its own step, reported once; the engine drops it and goes on, and every
//     later step must still be right;
//   - the engine asks check_errors() where it synchronises (after every step), so a stale error
//     failing a good step would fail the run;
//   - device memory (CUDA: free bytes; CPU: the process's resident set) is sampled; after the
//     warm-up (workspaces reach their steady size) it must not grow by more than --max-growth-mib.
// Exit code 1 on any wrong answer, unexpected error, fault not refused as it should be, or
// memory growth over the bound.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "cli_args.h"
#include "commands.h"
#include "core/size_check.h"
#include "kvattn/kvattn.h"
#include "oracle.h"
#include "reference/scenario.h"
#include "step_batch.h"
#include "tool_support.h"

namespace kvattn::tools {
namespace {

// The model: small, so a CPU soak of 10,000 steps takes minutes on two cores.
constexpr int kNumLayers = 2;
constexpr int kQHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadDim = 64;
constexpr DType kDType = DType::kBFloat16;

// The workload.
constexpr int kSystemPrompts = 4;
constexpr int kMinPrompt = 4;
constexpr int kMaxPrompt = 384;
constexpr int kMinNewTokens = 2;
constexpr int kMaxNewTokens = 48;
constexpr int kMaxRunning = 24;
constexpr int kPrefillBudget = 768;  ///< new prompt tokens per EXTEND / MIXED step
constexpr int kVerifyEvery = 5;      ///< a TARGET_VERIFY step after this many DECODE steps
constexpr int kDraftTokens = 4;
constexpr int kDraftChain = 3;
constexpr int64_t kRaggedThreshold = 512;  ///< so both EXTEND paths run
/// Oracle cost bound per checked step, in (query token, key) pairs.
constexpr int64_t kCheckPairBudget = 120'000;

const std::vector<OptionSpec>& soak_options() {
  static const std::vector<OptionSpec> specs = {
      {"--device", "cpu|cuda", "backend (default: cuda when a GPU is visible)"},
      {"--steps", "N", "steps to run (default 10000)"},
      {"--page-size", "P", "KV page size, a power of two up to 128 (default 16)"},
      {"--arrival-rate", "R", "mean request arrivals per step (default 0.8)"},
      {"--check-every", "N", "check every N-th step against the float64 reference (default 20)"},
      {"--fault-every", "N", "send a step with a bad index every N steps (default 97; 0 = none)"},
      {"--memory-every", "N", "sample memory every N steps (default 100)"},
      {"--max-growth-mib", "M", "allowed memory growth after the warm-up (default 16)"},
      {"--seed", "N", "seed of the workload and the data (default 1)"},
      {"--shared-groups", "",
       "DECODE / TARGET_VERIFY steps declare the requests behind one system prompt a "
       "shared-prefix group (ForwardBatch::shared_prefix_group_cpu: the cascade path)"},
      {"--json", "FILE", "also write the summary as JSON"},
      {"--quiet", "", "print only the summary (and failures)"},
  };
  return specs;
}

struct Request {
  int id = 0;
  int system_prompt = -1;  ///< index into the shared prompts, or -1
  int prefix_len = 0;      ///< tokens of the shared prompt
  int prompt_len = 0;      ///< own prompt tokens after it
  int max_new_tokens = 0;
  int pool_row = -1;
  int seq_len = 0;  ///< tokens whose K/V are committed
  int generated = 0;
  std::vector<int32_t> slots;  ///< slot of each position that has one
  int total_prompt() const { return prefix_len + prompt_len; }
};

struct SystemPrompt {
  int row = 0;
  int len = 0;
  std::vector<int32_t> slots;
};

/// Memory the run watches: CUDA free bytes, or the host resident set.
size_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  unsigned long long pages_total = 0, pages_resident = 0;
  const int got = std::fscanf(f, "%llu %llu", &pages_total, &pages_resident);
  std::fclose(f);
  return got == 2 ? size_t(pages_resident) * 4096 : 0;
}

struct MemorySample {
  int step = 0;
  double used_mib = 0;  ///< device: total - free seen as "used" growth; host: resident set
};

const char* kFaultNames[] = {"out_cache_loc past the pool", "out_cache_loc -1",
                             "req_to_token entry read by the step",
                             "req_pool_indices past the table"};

class Soak {
 public:
  Soak(const ToolDevice& device, int steps, int page_size, double arrival_rate, int check_every,
       int fault_every, int memory_every, double max_growth_mib, uint64_t seed, bool quiet,
       bool shared_groups)
      : device_(device),
        steps_(steps),
        page_size_(page_size),
        arrival_rate_(arrival_rate),
        check_every_(check_every),
        fault_every_(fault_every),
        memory_every_(memory_every),
        max_growth_mib_(max_growth_mib),
        quiet_(quiet),
        shared_groups_(shared_groups),
        rng_(seed),
        data_rng_(seed ^ 0xda7a),
        cache_(KvCache::allocate(cache_config(page_size, device.device))),
        pool_(ReqToTokenPool::allocate(kMaxRunning + kSystemPrompts, max_context_len(),
                                       device.device)),
        allocator_(cache_.num_slots(), page_size),
        // Random data to slice q/k/v from (an engine's activations stand-in).
        random_(device.device,
                int64_t(kPrefillBudget + kMaxPrompt + kMaxRunning * kDraftTokens) * kQHeads *
                    kHeadDim * 2,
                kHeadDim, seed ^ 0x5eed) {
    for (int l = 0; l < kNumLayers; ++l) {  // NaN in every slot nobody wrote
      fill_bytes(cache_.k_buffer(l).data(), device.device, 0xFF,
                 size_t(cache_.k_buffer(l).nbytes()));
      fill_bytes(cache_.v_buffer(l).data(), device.device, 0xFF,
                 size_t(cache_.v_buffer(l).nbytes()));
    }
    BackendConfig config;
    config.kv_cache = &cache_;
    config.req_to_token_pool = &pool_;
    config.num_q_heads = kQHeads;
    config.num_kv_heads = kKvHeads;
    config.head_dim = kHeadDim;
    config.q_dtype = kDType;
    config.ragged_extend_threshold = kRaggedThreshold;
    backend_ = make_backend(device.kind, config);
    for (int row = kMaxRunning - 1; row >= 0; --row) free_rows_.push_back(row);
  }

  bool run() {
    const auto start = std::chrono::steady_clock::now();
    std::printf("kvattn soak on %s (%s): %d steps\n", backend_kind_name(device_.kind),
                device_description(device_).c_str(), steps_);
    std::printf(
        "model: %d layers, %d q / %d kv heads, head_dim %d, %s; KV pool %lld slots, page %d\n",
        kNumLayers, kQHeads, kKvHeads, kHeadDim, dtype_name(kDType),
        static_cast<long long>(cache_.num_slots()), page_size_);
    std::printf(
        "workload: %.2f arrivals a step, prompts %d..%d (%d system prompts shared by "
        "60%%), %d..%d new tokens, at most %d running; check every %d, fault every %d\n\n",
        arrival_rate_, kMinPrompt, kMaxPrompt, kSystemPrompts, kMinNewTokens, kMaxNewTokens,
        kMaxRunning, check_every_, fault_every_);
    warm_system_prompts();
    int decodes_since_verify = 0;
    for (step_ = 1; step_ <= steps_; ++step_) {
      arrivals();
      const bool fault = fault_every_ > 0 && step_ % fault_every_ == 0;
      if (!waiting_.empty() && int(running_.size()) < kMaxRunning && can_admit()) {
        extend_step(fault);
      } else if (!running_.empty()) {
        if (decodes_since_verify >= kVerifyEvery) {
          verify_step(fault);
          decodes_since_verify = 0;
        } else {
          decode_step(fault);
          ++decodes_since_verify;
        }
      } else {
        idle_step();
      }
      if (memory_every_ > 0 && (step_ % memory_every_ == 0 || step_ == steps_)) sample_memory();
      if (!quiet_ && step_ % 1000 == 0) progress(seconds_since(start));
    }
    return summary(seconds_since(start));
  }

  std::string json() const { return json_; }

 private:
  // ---- setup --------------------------------------------------------------------------------

  static int max_context_len() { return 256 + kMaxPrompt + kMaxNewTokens + kDraftTokens + 128; }

  static KvCacheConfig cache_config(int page_size, Device device) {
    // Every running request at its largest, whole pages each, the system prompts, page 0.
    const int64_t per_request = (kMaxPrompt + kMaxNewTokens + kDraftTokens) / page_size + 2;
    const int64_t prompts = kSystemPrompts * (256 / page_size + 1);
    KvCacheConfig config;
    config.num_layers = kNumLayers;
    config.num_slots = (1 + prompts + kMaxRunning * per_request) * page_size;
    config.num_kv_heads = kKvHeads;
    config.head_dim = kHeadDim;
    config.page_size = page_size;
    config.dtype = kDType;
    config.device = device;
    return config;
  }

  AttentionLayer layer(int layer_id) const {
    AttentionLayer l;
    l.layer_id = layer_id;
    l.num_q_heads = kQHeads;
    l.num_kv_heads = kKvHeads;
    l.head_dim = kHeadDim;
    l.scaling = float(1.0 / std::sqrt(double(kHeadDim)));
    return l;
  }

  void ensure_slots(std::vector<int32_t>& slots, int row, int up_to) {
    const int have = int(slots.size());
    if (up_to <= have) return;
    const int32_t last = have > 0 ? slots.back() : 0;
    const std::vector<int32_t> fresh = allocator_.allocate_tokens(have, last, up_to - have);
    slots.insert(slots.end(), fresh.begin(), fresh.end());
    pool_.write(row, have, fresh);
  }

  /// The shared prompts: prefilled once each on their own rows (after the requests' rows).
  void warm_system_prompts() {
    for (int p = 0; p < kSystemPrompts; ++p) {
      SystemPrompt sp;
      sp.row = kMaxRunning + p;
      // Whole pages, so a request's own tokens start on a page of its own.
      sp.len = std::max(page_size_, (64 * (p + 1) + page_size_ - 1) / page_size_ * page_size_);
      ensure_slots(sp.slots, sp.row, sp.len);
      StepSpec spec;
      spec.mode = ForwardMode::kExtend;
      spec.req_pool_indices = {sp.row};
      spec.seq_lens = {sp.len};
      spec.prefix_lens = {0};
      spec.extend_lens = {sp.len};
      spec.out_cache_loc = sp.slots;
      prompts_.push_back(sp);
      execute(spec, /*fault=*/false, /*check=*/false);
    }
  }

  // ---- the scheduler -----------------------------------------------------------------------

  void arrivals() {
    // Poisson-like: each of a few draws arrives with probability rate / draws.
    constexpr int kDraws = 4;
    for (int d = 0; d < kDraws; ++d) {
      if (rng_.uniform() >= arrival_rate_ / kDraws) continue;
      Request r;
      r.id = next_id_++;
      if (rng_.uniform() < 0.6) {
        r.system_prompt = int(rng_.uniform_int(0, kSystemPrompts - 1));
        r.prefix_len = prompts_[size_t(r.system_prompt)].len;
      }
      const double log_len =
          std::log(double(kMinPrompt)) +
          rng_.uniform() * (std::log(double(kMaxPrompt)) - std::log(double(kMinPrompt)));
      r.prompt_len = int(std::lround(std::exp(log_len)));
      r.max_new_tokens = int(rng_.uniform_int(kMinNewTokens, kMaxNewTokens));
      waiting_.push_back(r);
      ++arrived_;
    }
  }

  int64_t pages_needed(const Request& r) const {
    return (r.prompt_len + r.max_new_tokens + kDraftTokens) / page_size_ + 2;
  }

  bool can_admit() const { return allocator_.free_page_count() >= pages_needed(waiting_.front()); }

  void extend_step(bool fault) {
    StepSpec spec;
    spec.mode = running_.empty() ? ForwardMode::kExtend : ForwardMode::kMixed;
    std::vector<Request> admitted;
    int budget = kPrefillBudget;
    int64_t reserved_pages = 0;
    while (!waiting_.empty() && int(running_.size() + admitted.size()) < kMaxRunning) {
      Request r = waiting_.front();
      if (!admitted.empty() && r.prompt_len > budget) break;
      reserved_pages += pages_needed(r);
      if (allocator_.free_page_count() < reserved_pages) break;
      budget -= r.prompt_len;
      waiting_.pop_front();
      r.pool_row = free_rows_.back();
      free_rows_.pop_back();
      if (r.system_prompt >= 0) {
        r.slots = prompts_[size_t(r.system_prompt)].slots;
        pool_.write(r.pool_row, 0, r.slots);
      }
      ensure_slots(r.slots, r.pool_row, r.total_prompt());
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.total_prompt());
      spec.prefix_lens.push_back(r.prefix_len);
      spec.extend_lens.push_back(r.prompt_len);
      spec.out_cache_loc.insert(spec.out_cache_loc.end(), r.slots.begin() + r.prefix_len,
                                r.slots.begin() + r.total_prompt());
      admitted.push_back(std::move(r));
    }
    for (Request& r : running_) {  // MIXED: the running requests decode one token
      ensure_slots(r.slots, r.pool_row, r.seq_len + 1);
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.seq_len + 1);
      spec.prefix_lens.push_back(r.seq_len);
      spec.extend_lens.push_back(1);
      spec.out_cache_loc.push_back(r.slots[size_t(r.seq_len)]);
    }
    if (!execute(spec, fault, true)) {
      // Refused (the injected fault): the engine drops the step; the admitted requests go back
      // to the head of the queue with their rows and slots returned.
      for (auto it = admitted.rbegin(); it != admitted.rend(); ++it) {
        release(*it);
        it->slots.clear();
        waiting_.push_front(*it);
      }
      return;
    }
    for (Request& r : running_) commit(r, 1);
    for (Request& r : admitted) {
      r.seq_len = r.total_prompt();
      r.generated = 1;
      running_.push_back(std::move(r));
    }
    retire();
  }

  void decode_step(bool fault) {
    StepSpec spec;
    spec.mode = ForwardMode::kDecode;
    for (Request& r : running_) {
      ensure_slots(r.slots, r.pool_row, r.seq_len + 1);
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.seq_len + 1);
      spec.out_cache_loc.push_back(r.slots[size_t(r.seq_len)]);
    }
    declare_groups(spec);
    if (!execute(spec, fault, true)) return;
    for (Request& r : running_) commit(r, 1);
    retire();
  }

  void verify_step(bool fault) {
    StepSpec spec;
    spec.mode = ForwardMode::kTargetVerify;
    spec.draft_token_num = kDraftTokens;
    for (Request& r : running_) {
      ensure_slots(r.slots, r.pool_row, r.seq_len + kDraftTokens);
      spec.req_pool_indices.push_back(r.pool_row);
      spec.seq_lens.push_back(r.seq_len);
      spec.out_cache_loc.insert(spec.out_cache_loc.end(), r.slots.begin() + r.seq_len,
                                r.slots.begin() + r.seq_len + kDraftTokens);
      append_tree_mask(r.seq_len, random_tree_parents(kDraftTokens, kDraftChain, data_rng_),
                       spec.custom_mask);
    }
    declare_groups(spec);
    if (!execute(spec, fault, true)) return;
    for (Request& r : running_) {
      const int room = r.max_new_tokens - r.generated;
      commit(r, int(std::min<int64_t>(room, data_rng_.uniform_int(1, kDraftChain))));
    }
    retire();
  }

  // --shared-groups: the running requests behind one system prompt (two or more of them) form a
  // group sharing the prompt's tokens (their rows start with its slots); the others stay out.
  void declare_groups(StepSpec& spec) {
    if (!shared_groups_) return;
    spec.declare_groups = true;
    spec.shared_prefix_group.assign(running_.size(), -1);
    for (int p = 0; p < kSystemPrompts; ++p) {
      int members = 0;
      for (const Request& r : running_) members += r.system_prompt == p ? 1 : 0;
      if (members < 2) continue;
      const int32_t group = int32_t(spec.shared_prefix_lens.size());
      for (size_t i = 0; i < running_.size(); ++i) {
        if (running_[i].system_prompt == p) spec.shared_prefix_group[i] = group;
      }
      spec.shared_prefix_lens.push_back(prompts_[size_t(p)].len);
    }
    if (!spec.shared_prefix_lens.empty()) ++grouped_steps_;
  }

  void idle_step() {
    StepSpec spec;
    spec.mode = ForwardMode::kIdle;
    execute(spec, false, false);
  }

  void commit(Request& r, int tokens) {
    r.seq_len += tokens;
    r.generated += tokens;
  }

  // Frees a request's own pages (not its system prompt's) and its row.
  void release(Request& r) {
    if (int(r.slots.size()) > r.prefix_len) {
      const std::vector<int32_t> own(r.slots.begin() + r.prefix_len, r.slots.end());
      allocator_.free_slots(own);
    }
    free_rows_.push_back(r.pool_row);
    r.pool_row = -1;
  }

  void retire() {
    std::vector<Request> still;
    for (Request& r : running_) {
      if (r.generated < r.max_new_tokens) {
        still.push_back(std::move(r));
        continue;
      }
      release(r);
      ++finished_;
    }
    running_ = std::move(still);
  }

  // ---- running a step --------------------------------------------------------------------------

  struct Inputs {
    TensorView q, k, v, q_host, k_host, v_host;
  };

  Inputs inputs(int64_t rows) {
    Inputs in;
    std::tie(in.q, in.q_host) = random_.slice(data_rng_, rows, kQHeads);
    std::tie(in.k, in.k_host) = random_.slice(data_rng_, rows, kKvHeads);
    std::tie(in.v, in.v_host) = random_.slice(data_rng_, rows, kKvHeads);
    return in;
  }

  // The bytes of every layer's K and V and of req_to_token (the fault check's "before").
  std::vector<uint8_t> state_bytes() const {
    std::vector<uint8_t> out;
    auto append = [&](const TensorView& t) {
      const size_t at = out.size();
      out.resize(at + size_t(t.nbytes()));
      copy_bytes(out.data() + at, Device::cpu(), t.data(), t.device(), size_t(t.nbytes()));
    };
    for (int l = 0; l < kNumLayers; ++l) {
      append(cache_.k_buffer(l));
      append(cache_.v_buffer(l));
    }
    append(pool_.table());
    return out;
  }

  /// Runs one step; returns false when it was refused (only ever the injected fault).
  bool execute(StepSpec spec, bool fault, bool may_check) {
    const int kind = fault_kind_ % 4;
    std::string argument;
    int32_t restore_row = -1, restore_value = 0;
    if (fault && spec.mode != ForwardMode::kIdle && !spec.seq_lens.empty()) {
      ++fault_kind_;
      const int last = int(spec.out_cache_loc.size()) - 1;
      switch (kind) {
        case 0:
          spec.out_cache_loc[size_t(last)] = int32_t(cache_.num_slots());
          argument = "out_cache_loc[" + std::to_string(last) + "]";
          break;
        case 1:
          spec.out_cache_loc[0] = -1;
          argument = "out_cache_loc[0]";
          break;
        case 2: {
          // Position 0 of a request whose keys the step reads from the pool on every path: one
          // with a cached prefix (the ragged EXTEND path reads only the prefix from the pool).
          size_t r = 0;
          while (!spec.prefix_lens.empty() && r < spec.prefix_lens.size() &&
                 spec.prefix_lens[r] == 0) {
            ++r;
          }
          if (r == spec.seq_lens.size() || spec.seq_lens[r] == 0) {
            spec.out_cache_loc[0] = -1;  // none here: a bad slot instead
            argument = "out_cache_loc[0]";
            break;
          }
          restore_row = spec.req_pool_indices[r];
          restore_value = pool_.read(restore_row, 0, 1)[0];
          const std::vector<int32_t> bad = {-1};
          pool_.write(restore_row, 0, bad);
          argument = "req_to_token[" + std::to_string(restore_row) + "][0]";
          break;
        }
        default: {
          const size_t i = spec.req_pool_indices.size() - 1;
          spec.req_pool_indices[i] = pool_.max_reqs() + 2;
          argument = "req_pool_indices[" + std::to_string(i) + "]";
          break;
        }
      }
    }
    const bool faulty = !argument.empty();
    const std::vector<uint8_t> before = faulty ? state_bytes() : std::vector<uint8_t>{};

    StepBatch batch(spec, device_.device, &cache_, &pool_);
    const int64_t tokens = spec.mode == ForwardMode::kIdle ? 0 : batch.batch().num_tokens();
    std::vector<Inputs> layer_inputs;
    std::vector<OwnedTensor> outs;
    for (int l = 0; l < kNumLayers; ++l) {
      layer_inputs.push_back(inputs(tokens));
      outs.push_back(OwnedTensor::make(device_.device, kDType, {tokens, kQHeads * kHeadDim}));
    }
    const auto start = std::chrono::steady_clock::now();
    std::string refused_argument;
    int64_t refused_step = -1;
    uint64_t step_id = 0;
    try {
      backend_->init_forward_metadata(batch.batch());
      step_id = backend_->step_id();
      for (int l = 0; l < kNumLayers; ++l) {
        const Inputs& in = layer_inputs[size_t(l)];
        backend_->forward(in.q, in.k, in.v, outs[size_t(l)].view, layer(l), batch.batch());
      }
      // Where the engine synchronises anyway (reading the sampled tokens).
      backend_->check_errors(/*synchronize=*/true);
    } catch (const Error& e) {
      refused_argument = e.argument();
      refused_step = e.step();
      if (!faulty || e.kind() != ErrorKind::kInvalidArgument) {
        fail("step " + std::to_string(step_) + " (" + forward_mode_name(spec.mode) +
             "): unexpected error: " + e.what());
      }
    }
    step_seconds_ += seconds_since(start);
    ++mode_counts_[int(spec.mode)];
    ++steps_run_;

    if (faulty) {
      ++faults_;
      bool ok = refused_argument == argument;
      // Device-detected refusals carry the step they belong to; host-detected ones are thrown
      // by the call itself (step() == -1).
      if (refused_step >= 0 && uint64_t(refused_step) != step_id) ok = false;
      if (ok && state_bytes() != before) {
        fail("step " + std::to_string(step_) + ": the refused step (" + argument +
             ") changed the KV pool or req_to_token");
        ok = false;
      }
      try {
        backend_->check_errors(true);  // reported once
      } catch (const Error& e) {
        fail(std::string("a refused step was reported twice: ") + e.what());
        ok = false;
      }
      if (!ok && refused_argument != argument) {
        fail("step " + std::to_string(step_) + ": the fault " + argument +
             " was not refused as expected (got '" + refused_argument + "')");
      }
      faults_refused_ += ok ? 1 : 0;
      if (refused_step >= 0) ++faults_by_check_errors_;
      if (restore_row >= 0) {
        const std::vector<int32_t> good = {restore_value};
        pool_.write(restore_row, 0, good);
      }
      return false;
    }
    const bool check = may_check && check_every_ > 0 && spec.mode != ForwardMode::kIdle &&
                       step_ % check_every_ == 0;
    if (check) {
      const int l = checks_ % kNumLayers;
      check_step(spec, layer(l), layer_inputs[size_t(l)], outs[size_t(l)].view);
    }
    return true;
  }

  // ---- the oracle -------------------------------------------------------------------------------

  /// The slots of positions [0, extent) of a req_to_token row, as the backend read them.
  std::vector<int32_t> row_slots(int row, int extent) const { return pool_.read(row, 0, extent); }

  void check_step(const StepSpec& spec, const AttentionLayer& checked, const Inputs& in,
                  const TensorView& out) {
    const std::vector<StepRequestRows> rows = step_request_rows(spec);
    const std::vector<size_t> picked = pick_checked_requests(rows, kCheckPairBudget, 6, data_rng_);
    std::vector<std::vector<int32_t>> slot_rows;
    for (size_t i : picked)
      slot_rows.push_back(row_slots(spec.req_pool_indices[i], rows[i].kv_extent));
    const double err = check_step_requests(
        cache_, checked, spec, rows, picked, slot_rows,
        StepHostInputs{in.q_host, in.k_host, in.v_host, kQHeads, kKvHeads, kDType}, out);
    ++checks_;
    worst_ = std::max(worst_, err);
    if (!(err <= tolerance_)) {
      ++wrong_;
      fail("step " + std::to_string(step_) + " (" + forward_mode_name(spec.mode) + ", layer " +
           std::to_string(checked.layer_id) + "): max_rel_err " + std::to_string(err) +
           " over the tolerance " + std::to_string(tolerance_));
    }
  }

  // ---- memory, progress, summary
  // ------------------------------------------------------------------

  void sample_memory() {
    synchronize(device_.device);
    double used_mib;
    if (device_.device.is_cuda()) {
      used_mib = -double(core::available_bytes(device_.device)) / double(1 << 20);  // -free
    } else {
#if defined(__GLIBC__)
      malloc_trim(0);  // freed host memory back to the system, so the resident set is real
#endif
      used_mib = double(resident_bytes()) / double(1 << 20);
    }
    memory_.push_back({step_, used_mib});
  }

  void progress(double seconds) {
    std::printf(
        "step %6d: %d running, %zu waiting, %d finished; %d checks (worst %.2e), %d/%d "
        "faults refused; %.1f s\n",
        step_, int(running_.size()), waiting_.size(), finished_, checks_, worst_, faults_refused_,
        faults_, seconds);
    std::fflush(stdout);
  }

  void fail(const std::string& what) {
    ++failures_;
    if (failures_ <= 20) std::printf("FAIL: %s\n", what.c_str());
  }

  bool summary(double seconds) {
    // Memory: the baseline is the first sample after the warm-up (10% of the run, at least one
    // sample in): by then every workspace has grown to the largest step it meets.
    double growth = 0;
    double baseline = 0;
    if (!memory_.empty()) {
      const int warm = steps_ / 10;
      size_t first = 0;
      while (first + 1 < memory_.size() && memory_[first].step < warm) ++first;
      baseline = memory_[first].used_mib;
      for (size_t i = first; i < memory_.size(); ++i) {
        growth = std::max(growth, memory_[i].used_mib - baseline);
      }
    }
    const bool memory_ok = growth <= max_growth_mib_;
    if (!memory_ok) {
      fail("memory grew by " + std::to_string(growth) + " MiB after the warm-up (bound " +
           std::to_string(max_growth_mib_) + " MiB)");
    }
    auto count = [&](ForwardMode m) { return mode_counts_[int(m)]; };
    const char* what = device_.device.is_cuda() ? "device memory in use" : "host resident set";
    std::printf("\nsummary\n");
    std::printf(
        "  steps: %d (%d extend, %d mixed, %d decode, %d verify, %d idle; plus %d system "
        "prompts)\n",
        steps_, count(ForwardMode::kExtend) - kSystemPrompts, count(ForwardMode::kMixed),
        count(ForwardMode::kDecode), count(ForwardMode::kTargetVerify), count(ForwardMode::kIdle),
        kSystemPrompts);
    std::printf("  requests: %d arrived, %d finished, %d running and %zu waiting at the end\n",
                arrived_, finished_, int(running_.size()), waiting_.size());
    std::printf(
        "  checks against the float64 reference: %d, %d wrong, worst max_rel_err %.2e "
        "(tolerance %.0e)\n",
        checks_, wrong_, worst_, tolerance_);
    std::printf(
        "  bad steps: %d sent, %d refused whole and named (%d reported by check_errors, "
        "the rest by the call), pool and req_to_token unchanged\n",
        faults_, faults_refused_, faults_by_check_errors_);
    std::printf("  %s: %zu samples; growth after the warm-up %.2f MiB (bound %.0f MiB)\n", what,
                memory_.size(), growth, max_growth_mib_);
    if (shared_groups_) {
      std::printf("  shared-prefix groups declared in %d DECODE / TARGET_VERIFY steps\n",
                  grouped_steps_);
    }
    std::printf("  time: %.1f s (%.1f s in the backend's calls)\n", seconds, step_seconds_);
    const bool ok = failures_ == 0;
    std::printf("%s\n", ok ? "soak OK" : "soak FAILED");
    char buf[1024];
    std::snprintf(buf, sizeof(buf),
                  "{\"device\": %s, \"commit\": %s, \"date\": %s, \"steps\": %d, \"checks\": %d, "
                  "\"wrong\": %d, \"worst_rel_err\": %s, \"faults\": %d, \"faults_refused\": %d, "
                  "\"memory\": %s, \"memory_growth_mib\": %s, \"seconds\": %s, \"ok\": %s}\n",
                  json_string(device_description(device_)).c_str(),
                  json_string(git_commit()).c_str(), json_string(today_iso()).c_str(), steps_,
                  checks_, wrong_, json_number(worst_).c_str(), faults_, faults_refused_,
                  json_string(what).c_str(), json_number(growth).c_str(),
                  json_number(seconds).c_str(), ok ? "true" : "false");
    json_ = buf;
    return ok;
  }

  ToolDevice device_;
  int steps_;
  int page_size_;
  double arrival_rate_;
  int check_every_;
  int fault_every_;
  int memory_every_;
  double max_growth_mib_;
  bool quiet_;
  bool shared_groups_;
  Rng rng_;
  Rng data_rng_;
  KvCache cache_;
  ReqToTokenPool pool_;
  SlotAllocator allocator_;
  RandomSource random_;
  std::unique_ptr<AttentionBackend> backend_;
  std::vector<SystemPrompt> prompts_;
  std::vector<int> free_rows_;
  std::deque<Request> waiting_;
  std::vector<Request> running_;
  int step_ = 0;
  int next_id_ = 0;
  int arrived_ = 0;
  int finished_ = 0;
  int steps_run_ = 0;
  int mode_counts_[8] = {};
  int checks_ = 0;
  int wrong_ = 0;
  double worst_ = 0;
  int faults_ = 0;
  int grouped_steps_ = 0;  ///< --shared-groups: steps that declared at least one group
  int faults_refused_ = 0;
  int faults_by_check_errors_ = 0;
  int fault_kind_ = 0;
  int failures_ = 0;
  double step_seconds_ = 0;
  std::vector<MemorySample> memory_;
  double tolerance_ = testing::tolerance_for(kDType, kDType);
  std::string json_;
};

}  // namespace

std::string soak_usage() {
  return "usage: kvattn soak [options]\n"
         "\n"
         "A long serving run through one backend: requests arrive at random (60% behind one of\n"
         "4 shared system prompts), EXTEND / MIXED / DECODE / TARGET_VERIFY steps, requests "
         "finish\n"
         "and their pages and rows are reused. Sampled steps are checked against the float64\n"
         "reference; every --fault-every steps a step is sent with a bad index and must be\n"
         "refused whole (pool and req_to_token unchanged), named, attributed to its step and\n"
         "reported once, with every later step still right; memory is sampled and may not grow\n"
         "after the warm-up. Exit code 1 on any failure.\n"
         "\n"
         "options:\n" +
         format_options(soak_options());
}

int run_soak(const std::vector<std::string>& args) {
  const ParsedArgs parsed(args, soak_options());
  const ToolDevice device = select_device(parsed.get("--device", ""));
  const int steps = int(parsed.get_int("--steps", 10000, 1, 100'000'000));
  const int page_size = int(parsed.get_int("--page-size", 16, 1, 128));
  if ((page_size & (page_size - 1)) != 0) {
    throw UsageError("option '--page-size': got " + std::to_string(page_size) +
                     ", expected a power of two in [1, 128]");
  }
  const double rate = parsed.get_double("--arrival-rate", 0.8, 0.0, 8.0);
  const int check_every = int(parsed.get_int("--check-every", 20, 0, 1'000'000));
  const int fault_every = int(parsed.get_int("--fault-every", 97, 0, 1'000'000));
  const int memory_every = int(parsed.get_int("--memory-every", 100, 0, 1'000'000));
  const double max_growth = parsed.get_double("--max-growth-mib", 16.0, 0.0, 1e9);
  const uint64_t seed = uint64_t(parsed.get_int("--seed", 1, 0, INT64_MAX));
  Soak soak(device, steps, page_size, rate, check_every, fault_every, memory_every, max_growth,
            seed, parsed.has("--quiet"), parsed.has("--shared-groups"));
  const bool ok = soak.run();
  const std::string path = parsed.get("--json", "");
  if (!path.empty()) {
    std::ofstream file(path);
    file << soak.json();
    if (!file) throw UsageError("option '--json': cannot write " + path);
  }
  return ok ? 0 : 1;
}

}  // namespace kvattn::tools
