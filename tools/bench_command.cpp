// `kvattn bench`: the SPEC §6 grid on one device, each row held to a ceiling measured in the same
// run (read-only streaming bandwidth for decode and the speculative-decoding rows; the
// matrix-product rate for prefill / extend), with a sampled check of every row against the
// float64 reference.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_graphs.h"
#include "cli_args.h"
#include "commands.h"
#include "cpu_ceilings.h"
#include "kvattn/kvattn.h"
#include "oracle.h"
#include "reference/scenario.h"
#include "step_batch.h"
#include "tool_support.h"

#if defined(KVATTN_WITH_CUDA)
#include "cuda_bench/bench_support.h"
#endif

namespace kvattn::tools {
namespace {

// The grid's model shape (SPEC §6: Llama-3-8B attention on one GPU).
constexpr int kQHeads = 32;
constexpr int kKvHeads = 8;
constexpr DType kDType = DType::kBFloat16;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int64_t kGiB = int64_t(1) << 30;

const std::vector<OptionSpec>& bench_options() {
  static const std::vector<OptionSpec> specs = {
      {"--device", "cpu|cuda", "device to time (default: cuda when a GPU is visible)"},
      {"--quick", "", "a few representative rows, fewer repetitions"},
      {"--json", "FILE",
       "write the SPEC §6 results file (e.g. bench/results/cpu-grid-<date>.json)"},
      {"--workload", "all|decode|prefill|extend|verify|draft|cascade",
       "only rows of this workload (default all; draft: the draft_extend rows and the "
       "draft_multistep row; cascade: the shared-prefix decode rows)"},
      {"--rows", "REGEX",
       "only rows whose label matches (ECMAScript, searched), e.g. 'decode b1 kv(1024|4096) '; "
       "labels as in the results file: '<workload> b<batch> kv<kv_len> [tree|q<n>] d<head_dim> "
       "<variant>'"},
      {"--max-row-seconds", "S",
       "CPU: skip rows whose one call is estimated above S s (default 15; --quick 1)"},
      {"--max-gib", "G", "skip rows needing more memory (default: CPU min(8, free/2), CUDA 85%)"},
      {"--seed", "N", "seed of the random data (default 1)"},
      {"--graphs", "",
       "instead of the grid: 32-layer decode, verify, extend and mixed steps, eager vs CUDA-graph "
       "replay (planned on the host and on the device) vs their kernels' "
       "GPU time, and the host planning per step (CUDA)"},
      {"--planner", "", "instead of the grid: the host planning per decode step (no GPU needed)"},
      {"--graph-steps", "LIST",
       "with --graphs: which steps, a comma list of decode, verify, extend, planner (default "
       "all; extend includes the MIXED step)"},
      {"--deterministic", "",
       "run every row in deterministic (batch-invariant) mode (BackendConfig::deterministic); "
       "the variants get a -deterministic suffix; on CUDA decode rows then run on the backend's "
       "CUDA-graph buffers, as an engine's graph mode does"},
  };
  return specs;
}

/// One row of the grid.
struct GridRow {
  /// "decode", "prefill", "extend", "verify" (TARGET_VERIFY), "draft_extend" (DRAFT_EXTEND) or
  /// "draft_multistep" (MultiStepDraftBackend: num_steps draft decode steps of topk branches)
  std::string workload;
  int batch = 1;
  /// KV tokens per request: decode the context; extend / draft_extend prefix + new; verify
  /// prefix + tree tokens; draft_multistep prefix + num_steps x topk draft tokens
  int kv_len = 0;
  /// query tokens per request (verify: the tree tokens; draft_multistep: topk x num_steps, topk
  /// a step)
  int qo_len = 1;
  int prefix_len = 0;
  int page_size = 1;
  int head_dim = 128;
  std::string variant;  ///< "page1-shuffled", "page16-shuffled", "causal", "cascade", ...
  bool deterministic = false;  ///< BackendConfig::deterministic (--deterministic)
  bool in_quick = false;
  /// > 0: a shared-prefix decode row (--workload cascade): every request's first shared_prefix
  /// positions hold the same slots (one system prompt), then kv_len - shared_prefix own ones.
  int shared_prefix = 0;
  /// Shared-prefix rows: the step declares the requests one group (the cascade path), or
  /// declares no group at all (the plain path on both backends: a CPU backend given the
  /// tensors does not look for groups itself).
  bool declare_group = false;
  /// draft_multistep: branches per request and draft steps. Draft token of step t, branch b of
  /// request r at req_to_token position prefix_len + t * topk + b; one call runs every step.
  int topk = 0;
  int num_steps = 0;

  bool is_decode() const { return workload == "decode"; }
  bool is_cascade() const { return shared_prefix > 0; }
  bool is_verify() const { return workload == "verify"; }
  bool is_draft_extend() const { return workload == "draft_extend"; }
  bool is_multistep() const { return workload == "draft_multistep"; }
  /// Speculative decoding: a few query tokens per request over a long prefix.
  bool is_speculative() const { return is_verify() || is_draft_extend() || is_multistep(); }
  /// Rows whose time is the K/V read (decode, and the speculative rows: 4-16 query tokens per
  /// request over a 1024-4096 token prefix): reported in GB/s of K/V read, as a fraction of the
  /// read ceiling.
  bool memory_bound() const { return is_decode() || is_speculative(); }
  int64_t tokens() const { return int64_t(batch) * qo_len; }
  /// Distinct KV tokens the step reads: every KV token of every request, a shared prefix once.
  /// draft_multistep (one call = every step): step t reads each request's prefix once (not once
  /// per branch) and its (t + 1) x topk draft tokens so far, summed over the steps.
  int64_t kv_tokens() const {
    if (is_multistep()) {
      int64_t tokens = 0;
      for (int t = 0; t < num_steps; ++t) tokens += prefix_len + int64_t(t + 1) * topk;
      return int64_t(batch) * tokens;
    }
    return is_cascade() ? shared_prefix + int64_t(batch) * (kv_len - shared_prefix)
                        : int64_t(batch) * kv_len;
  }
  /// Memory-bound rows: bytes of K and V read (each distinct KV token once: a shared-prefix
  /// row's GB/s is of the K/V it must read at least, on both paths).
  double kv_bytes() const {
    return double(kv_tokens()) * kKvHeads * 2.0 * head_dim * dtype_size(kDType);
  }
  /// Prefill / extend: 4 b h d q (prefix + q / 2) — the causal half of the new-token square.
  /// draft_multistep: 4 h d per query row and key, b x topk rows over prefix + t + 1 keys in
  /// step t (as bench/peers).
  double flops() const {
    if (is_multistep()) {
      double keys = 0;
      for (int t = 0; t < num_steps; ++t) keys += prefix_len + t + 1;
      return 4.0 * batch * topk * kQHeads * head_dim * keys;
    }
    return 4.0 * batch * kQHeads * head_dim * double(qo_len) * (prefix_len + qo_len / 2.0);
  }
  std::string label() const {
    std::ostringstream os;
    os << workload << " b" << batch << " kv" << kv_len;
    if (is_cascade()) os << " shared" << shared_prefix;
    if (!is_decode()) os << (is_verify() ? " tree" : " q") << qo_len;
    os << " d" << head_dim << " " << variant;
    return os.str();
  }
};

std::vector<GridRow> make_grid() {
  std::vector<GridRow> rows;
  for (int page_size : {1, 16}) {
    for (int batch : {1, 16, 64, 256}) {
      for (int kv_len : {1024, 4096, 16384, 32768}) {
        if (kv_len == 32768 && batch > 16) continue;  // SPEC §6: 32768 only for batch <= 16
        GridRow row;
        row.workload = "decode";
        row.batch = batch;
        row.kv_len = kv_len;
        row.page_size = page_size;
        row.variant = "page" + std::to_string(page_size) + "-shuffled";
        row.in_quick = (batch == 1 || batch == 16 || batch == 64) && kv_len <= 4096;
        rows.push_back(row);
      }
    }
  }
  for (int head_dim : {128, 64, 256}) {
    for (auto [batch, len] : {std::pair{1, 1024}, {1, 4096}, {1, 16384}, {8, 2048}}) {
      GridRow row;
      row.workload = "prefill";
      row.batch = batch;
      row.kv_len = len;
      row.qo_len = len;
      row.head_dim = head_dim;
      row.variant = "causal";
      row.in_quick = head_dim == 128 && len <= 4096 && batch == 1;
      rows.push_back(row);
    }
  }
  GridRow extend;
  extend.workload = "extend";
  extend.batch = 8;
  extend.prefix_len = 4096;
  extend.qo_len = 512;
  extend.kv_len = 4096 + 512;
  extend.variant = "causal";
  extend.in_quick = true;
  rows.push_back(extend);
  // Speculative decoding, page 1 with shuffled slots as the decode rows. TARGET_VERIFY: a random
  // draft tree per request (step_batch.h random_tree_parents), its mask rows seeing the prefix,
  // their ancestors and themselves; DRAFT_EXTEND: the draft model's causal extend by the
  // accepted tokens.
  for (auto [batch, prefix, tree] :
       {std::tuple{1, 4096, 8}, {16, 4096, 8}, {64, 4096, 8}, {64, 1024, 16}}) {
    GridRow row;
    row.workload = "verify";
    row.batch = batch;
    row.prefix_len = prefix;
    row.qo_len = tree;
    row.kv_len = prefix + tree;
    row.variant = "page1-shuffled";
    row.in_quick = batch == 1;  // 1 s of a --quick run on 2 CPU cores (2026-12-02)
    rows.push_back(row);
  }
  for (int batch : {16, 64}) {
    GridRow row;
    row.workload = "draft_extend";
    row.batch = batch;
    row.prefix_len = 4096;
    row.qo_len = 4;
    row.kv_len = 4096 + 4;
    row.variant = "causal";
    // Not in --quick: b16 adds 5 s to it on 2 CPU cores (2026-12-02), most of that filling its
    // 8 input sets of 270 MiB.
    rows.push_back(row);
  }
  // The multi-step draft (MultiStepDraftBackend) as bench/peers's draft-multistep row: batch 16
  // x 4096 prefix, 4 branches a request, 3 draft steps, page 1 shuffled; one call = the 3 steps'
  // forward of one layer, their draft tokens' K/V in the pool already (save_kv_cache false, as
  // run_peers.py times it); on CUDA captured on the draft backend's CUDA-graph buffers.
  // Topk 2 and 1 too: 8 and 4 rows a request at group 4, the decode kernel's transposed 8-row
  // tile (topk 4: 16 rows, the row tile).
  for (int topk : {4, 2, 1}) {
    GridRow row;
    row.workload = "draft_multistep";
    row.batch = 16;
    row.prefix_len = 4096;
    row.topk = topk;
    row.num_steps = 3;
    row.qo_len = row.topk * row.num_steps;
    row.kv_len = row.prefix_len + row.qo_len;
    row.variant = "topk" + std::to_string(topk) + "-steps3";
    rows.push_back(row);
  }
  // Shared-prefix decode (issue 16): 64 requests behind one 8192-token prompt, 256 own tokens
  // each; the step declares them one group (cascade) or declares no group (the plain path).
  for (int page_size : {1, 16}) {
    for (bool cascade : {true, false}) {
      GridRow row;
      row.workload = "decode";
      row.batch = 64;
      row.shared_prefix = 8192;
      row.prefix_len = 8192;
      row.kv_len = 8192 + 256;
      row.page_size = page_size;
      row.declare_group = cascade;
      row.variant = cascade ? "cascade" : "no-cascade";
      if (page_size != 1) row.variant += "-page" + std::to_string(page_size);
      rows.push_back(row);
    }
  }
  return rows;
}

struct Ceilings {
  double read_gbps = kNaN;
  double copy_gbps = kNaN;            ///< CUDA only
  double gemm_bf16_tflops = kNaN;     ///< CUDA only
  double cpu_fma_fp32_gflops = kNaN;  ///< CPU only
  /// CPU only, where the AVX-512 BF16 kernels run: the faster of their bf16 dot-product and
  /// 16-lane FMA rates, which then bounds prefill and extend instead of the AVX2 FMA rate.
  double cpu_avx512_gflops = kNaN;
  /// CPU only, where the prefill tiles run on AMX-BF16: the tdpbf16ps rate of all cores.
  double cpu_amx_gflops = kNaN;
  /// The rate a CPU prefill / extend row is a fraction of: the kernels' own unit (AMX where
  /// the tiles run on it, else the faster of the two FMA rates above).
  double cpu_compute_gflops() const {
    if (std::isfinite(cpu_amx_gflops)) return cpu_amx_gflops;
    return std::isfinite(cpu_avx512_gflops) ? std::max(cpu_fma_fp32_gflops, cpu_avx512_gflops)
                                            : cpu_fma_fp32_gflops;
  }
  /// CPU only: reads of whole rows in a random order (measure_cpu_random_rows_gbps), with the
  /// grid's page-1 slot (8 kv heads x 128 x bf16 = 2 KiB) and page-16 page (32 KiB) as rows.
  double cpu_random_slot_gbps = kNaN;
  double cpu_random_page16_gbps = kNaN;
};

struct RowResult {
  GridRow row;
  bool measured = false;
  std::string note;  ///< why a row was skipped or failed
  bool failed = false;
  double time_us = kNaN;
  double gbps = kNaN;
  double tflops = kNaN;
  double fraction = kNaN;
  double max_rel_err = kNaN;
};

struct TimingResult {
  double median_us = 0;
  int reps = 0;
  bool graph = false;
};

/// The world of one row: a KV pool of `sets` layers (each layer its own K/V and its own
/// q/k/v/out, so consecutive timed calls read different memory and small rows do not sit in
/// the cache), req_to_token with shuffled pages, one step's batch and a backend.
class BenchWorld {
 public:
  BenchWorld(const GridRow& row, const ToolDevice& device, int sets, uint64_t seed,
             void* cuda_stream)
      : row_(row),
        device_(device),
        sets_(sets),
        cache_(KvCache::allocate(cache_config(row, device, sets))),
        pool_(ReqToTokenPool::allocate(row.batch, row.kv_len, device.device)) {
    Rng rng(seed);
    assign_slots(rng);
    StepSpec spec;
    spec.mode = row.is_decode()         ? ForwardMode::kDecode
                : row.is_verify()       ? ForwardMode::kTargetVerify
                : row.is_draft_extend() ? ForwardMode::kDraftExtend
                                        : ForwardMode::kExtend;
    if (row.is_multistep()) spec.mode = ForwardMode::kDecode;  // the draft decode steps' batch
    if (row.is_verify()) spec.draft_token_num = row.qo_len;
    for (int r = 0; r < row.batch; ++r) {
      spec.req_pool_indices.push_back(r);
      if (row.is_multistep()) {
        // seq_lens count the committed prefix; the draft tokens follow it in req_to_token (their
        // K/V are in the pool: the steps save none, so the batch has no out_cache_loc).
        spec.seq_lens.push_back(row.prefix_len);
      } else if (row.is_decode()) {
        spec.seq_lens.push_back(row.kv_len);
        spec.out_cache_loc.push_back(slots_[r][row.kv_len - 1]);
        if (row.is_cascade()) spec.shared_prefix_group.push_back(row.declare_group ? 0 : -1);
      } else if (row.is_verify()) {
        // seq_lens count the committed prefix; the tree tokens' K/V go to the slots after it.
        spec.seq_lens.push_back(row.prefix_len);
        spec.out_cache_loc.insert(spec.out_cache_loc.end(), slots_[r].begin() + row.prefix_len,
                                  slots_[r].end());
        append_tree_mask(row.prefix_len, random_tree_parents(row.qo_len, /*chain=*/0, rng),
                         spec.custom_mask);
      } else {
        spec.seq_lens.push_back(row.kv_len);
        spec.prefix_lens.push_back(row.prefix_len);
        spec.extend_lens.push_back(row.qo_len);
        spec.out_cache_loc.insert(spec.out_cache_loc.end(), slots_[r].begin() + row.prefix_len,
                                  slots_[r].end());
      }
    }
    if (row.is_cascade()) {
      spec.declare_groups = true;
      if (row.declare_group) spec.shared_prefix_lens.push_back(row.shared_prefix);
    }
    step_ = std::make_unique<StepBatch>(spec, device.device, &cache_, &pool_);

    uint64_t fill_seed = seed * 7919;
    for (int layer = 0; layer < sets; ++layer) {
      fill_random(cache_.k_buffer(layer), fill_seed++, 1.f);
      fill_random(cache_.v_buffer(layer), fill_seed++, 1.f);
      // draft_multistep: q / out of every step, step-major ([num_steps][batch][topk] rows);
      // no new K/V (the steps save none).
      const int64_t tokens = row.tokens();
      const int64_t kv_tokens = row.is_multistep() ? 0 : tokens;
      q_.push_back(OwnedTensor::make(device.device, kDType, {tokens, kQHeads, row.head_dim}));
      k_.push_back(OwnedTensor::make(device.device, kDType, {kv_tokens, kKvHeads, row.head_dim}));
      v_.push_back(OwnedTensor::make(device.device, kDType, {kv_tokens, kKvHeads, row.head_dim}));
      out_.push_back(OwnedTensor::make(device.device, kDType, {tokens, kQHeads, row.head_dim}));
      for (const OwnedTensor* input : {&q_.back(), &k_.back(), &v_.back()}) {
        if (input->view.numel() > 0) fill_random(input->view, fill_seed++, 1.f);
      }
    }

    BackendConfig config;
    config.kv_cache = &cache_;
    config.req_to_token_pool = &pool_;
    config.num_q_heads = kQHeads;
    config.num_kv_heads = kKvHeads;
    config.head_dim = row.head_dim;
    config.q_dtype = kDType;
    config.cuda_stream = cuda_stream;
    config.deterministic = row.deterministic;
    if (row.is_multistep()) {
      // As an engine's draft worker in CUDA-graph mode (and bench/peers): the draft backend's
      // graph buffers for this batch, the host plan of every step (out_graph; in_capture: it
      // must run on those buffers), then in_graph (the index sets of all steps: once a step of
      // the engine, not per layer) once here; the timing captures the steps' forward. The CPU:
      // init_forward_metadata, outside the timing too.
      draft_ =
          std::make_unique<MultiStepDraftBackend>(device.kind, config, row.topk, row.num_steps);
      if (graph_step()) {
        draft_->init_cuda_graph_state(row.batch);
        draft_->init_forward_metadata_out_graph(step_->batch(), /*in_capture=*/true);
        draft_->init_forward_metadata_in_graph(step_->batch());
      } else {
        draft_->init_forward_metadata(step_->batch());
      }
      return;
    }
    backend_ = make_backend(device.kind, config);
    if (graph_step()) {
      // TARGET_VERIFY and DECODE as an engine runs them on CUDA: a captured bucket of the
      // backend's graph buffers (sized for this batch and tree), whose padded plan the timed
      // calls replay. The timing captures forward (time_on_stream); without these buffers the
      // backend refuses to capture the tensor-core path. in_graph runs once here: it is per
      // step, not per layer.
      backend_->init_cuda_graph_state(row.batch, row.tokens());
      backend_->init_forward_metadata_out_graph(step_->batch(), /*in_capture=*/true);
      backend_->init_forward_metadata_in_graph(step_->batch());
    } else {
      backend_->init_forward_metadata(step_->batch());
    }
  }

  /// Whether the row runs on the backend's CUDA-graph buffers and must be timed captured, as an
  /// engine's CUDA-graph mode runs it: verify, the multi-step draft and decode (the tensor-core
  /// paths are captured only on those buffers' padded plans). Not a decode step that declares
  /// shared-prefix groups: it runs eagerly (the backend refuses to capture it).
  bool graph_step() const {
    const bool graph_decode = row_.is_decode() && !(row_.is_cascade() && row_.declare_group);
    return (row_.is_verify() || row_.is_multistep() || graph_decode) &&
           device_.kind == BackendKind::kCuda;
  }

  /// Bytes the world holds on the device: the pool of all layers plus every input set.
  static int64_t world_bytes(const GridRow& row, int sets) {
    const int64_t elem = dtype_size(kDType);
    const int64_t pool = num_slots(row) * kKvHeads * 2 * row.head_dim * elem;
    return sets * (pool + row.tokens() * input_elems_per_token(row) * elem);
  }
  /// Bytes one call touches: the K/V it reads plus its inputs and output.
  static int64_t call_bytes(const GridRow& row) {
    const int64_t elem = dtype_size(kDType);
    const int64_t kv = row.kv_tokens() * kKvHeads * 2 * row.head_dim * elem;
    return kv + row.tokens() * input_elems_per_token(row) * elem;
  }

  /// One timed call: one layer's forward (draft_multistep: every draft step's forward of one
  /// layer, step t on rows [t, t + 1) x batch x topk of q / out).
  void forward(int set) {
    if (draft_) {
      const int64_t rows = int64_t(row_.batch) * row_.topk;
      for (int t = 0; t < row_.num_steps; ++t) {
        draft_->forward_step(t, q_[set].view.slice0(t * rows, (t + 1) * rows), TensorView(),
                             TensorView(), out_[set].view.slice0(t * rows, (t + 1) * rows),
                             layer(set), /*out_cache_loc=*/TensorView());
      }
      return;
    }
    backend_->forward(q_[set].view, k_[set].view, v_[set].view, out_[set].view, layer(set),
                      step_->batch(), /*save_kv_cache=*/true);
  }

  /// Max relative error of sampled query rows of set 0 against the float64 reference. Decode,
  /// prefill and extend: each sampled query (request r, absolute position p) sees positions
  /// [0, p] of its request, which the oracle computes as a decode of length p + 1: exact for
  /// causal full attention. draft_multistep: multistep_max_rel_err; the other speculative rows:
  /// speculative_max_rel_err.
  double sampled_max_rel_err() {
    // With one input set every call leaves the same state; otherwise set 0's output must be the
    // last one written.
    if (sets_ > 1) forward(0);
    synchronize(device_.device);
    if (draft_) {
      draft_->check_errors(/*synchronize=*/true);  // a refused draft step fails the row
      return multistep_max_rel_err();
    }
    if (row_.is_speculative()) return speculative_max_rel_err();
    struct Sample {
      int request;
      int64_t out_row;
      int position;
    };
    std::vector<Sample> samples;
    if (row_.is_decode()) {
      for (int r : {0, row_.batch / 3, 2 * row_.batch / 3, row_.batch - 1}) {
        samples.push_back({r, r, row_.kv_len - 1});
      }
    } else {
      for (int r : {0, row_.batch - 1}) {
        for (int j : {0, row_.qo_len / 2 + 1, row_.qo_len - 1}) {
          samples.push_back({r, int64_t(r) * row_.qo_len + j, row_.prefix_len + j});
        }
      }
    }
    std::sort(samples.begin(), samples.end(),
              [](const Sample& a, const Sample& b) { return a.out_row < b.out_row; });
    samples.erase(
        std::unique(samples.begin(), samples.end(),
                    [](const Sample& a, const Sample& b) { return a.out_row == b.out_row; }),
        samples.end());

    std::vector<std::vector<int32_t>> rows;
    std::vector<int64_t> out_rows;
    for (const Sample& s : samples) {
      rows.emplace_back(slots_[s.request].begin(), slots_[s.request].begin() + s.position + 1);
      out_rows.push_back(s.out_row);
    }
    return decode_rows_max_rel_err(rows, out_rows);
  }

 private:
  /// Rows `out_rows` of set 0's output against the float64 reference of a decode whose query
  /// (the same row of q) reads the slots `rows[i]` (in that order).
  double decode_rows_max_rel_err(const std::vector<std::vector<int32_t>>& rows,
                                 const std::vector<int64_t>& out_rows) {
    testing::RefBatch ref_batch;
    ref_batch.mode = ForwardMode::kDecode;
    for (size_t i = 0; i < rows.size(); ++i) {
      ref_batch.req_pool_indices.push_back(int32_t(i));
      ref_batch.seq_lens.push_back(int32_t(rows[i].size()));
    }
    CompactPool compact = snapshot_rows(cache_, 0, rows);
    ref_batch.max_context_len = compact.max_context_len;
    ref_batch.req_to_token = std::move(compact.req_to_token);

    const int64_t q_row = int64_t(kQHeads) * row_.head_dim;
    const OwnedTensor q_host = copy_rows_to_host(q_[0].view, out_rows, q_row);
    const OwnedTensor out_host = copy_rows_to_host(out_[0].view, out_rows, q_row);
    std::vector<int64_t> dense(out_rows.size());
    for (size_t i = 0; i < dense.size(); ++i) dense[i] = int64_t(i);
    const std::vector<double> q = gather_rows_as_double(q_host.view, dense, q_row);
    const testing::RefOutput ref =
        testing::reference_attention(layer(0), ref_batch, compact.pool, q);
    return max_rel_err(ref, out_host.view, dense);
  }

  /// Every branch of the first and the last request in every draft step. Query (step t,
  /// request r, branch b), output row t x batch x topk + r x topk + b, is a decode over r's
  /// prefix and its branch's draft tokens of steps 0..t (req_to_token positions prefix + s x
  /// topk + b, s <= t), whose K/V the pool holds (the steps save none).
  double multistep_max_rel_err() {
    std::vector<std::vector<int32_t>> rows;
    std::vector<int64_t> out_rows;
    const int64_t step_rows = int64_t(row_.batch) * row_.topk;
    std::vector<int> requests = {0};
    if (row_.batch > 1) requests.push_back(row_.batch - 1);
    for (int t = 0; t < row_.num_steps; ++t) {
      for (int r : requests) {
        const std::vector<int32_t>& slots = slots_[size_t(r)];
        for (int b = 0; b < row_.topk; ++b) {
          std::vector<int32_t> keys(slots.begin(), slots.begin() + row_.prefix_len);
          for (int s = 0; s <= t; ++s) {
            keys.push_back(slots[size_t(row_.prefix_len + s * row_.topk + b)]);
          }
          rows.push_back(std::move(keys));
          out_rows.push_back(t * step_rows + int64_t(r) * row_.topk + b);
        }
      }
    }
    return decode_rows_max_rel_err(rows, out_rows);
  }

  /// Every query of the first and the last request (their 8-16 tree tokens, or 4 new tokens)
  /// against the oracle run in the step's own mode: TARGET_VERIFY rows under the tree mask the
  /// backend was given, DRAFT_EXTEND causal (tools/oracle.h check_step_requests; the step's new
  /// K/V are saved into the oracle's copy as it models the save).
  double speculative_max_rel_err() {
    const StepSpec& spec = step_->spec();
    const std::vector<StepRequestRows> rows = step_request_rows(spec);
    std::vector<size_t> picked = {0};
    if (row_.batch > 1) picked.push_back(size_t(row_.batch - 1));
    std::vector<std::vector<int32_t>> slot_rows;
    for (size_t r : picked) {
      slot_rows.emplace_back(slots_[r].begin(), slots_[r].begin() + rows[r].kv_extent);
    }
    const OwnedTensor q_host = to_host(q_[0].view);
    const OwnedTensor k_host = to_host(k_[0].view);
    const OwnedTensor v_host = to_host(v_[0].view);
    StepHostInputs inputs;
    inputs.q_host = q_host.view;
    inputs.k_host = k_host.view;
    inputs.v_host = v_host.view;
    inputs.num_q_heads = kQHeads;
    inputs.num_kv_heads = kKvHeads;
    inputs.kv_dtype = kDType;
    return check_step_requests(cache_, layer(0), spec, rows, picked, slot_rows, inputs,
                               out_[0].view);
  }

  /// Input and output values per query token: q and out, plus the new k and v the step saves
  /// (draft_multistep saves none).
  static int64_t input_elems_per_token(const GridRow& row) {
    return (2 * kQHeads + (row.is_multistep() ? 0 : 2 * kKvHeads)) * row.head_dim;
  }

  static int64_t num_slots(const GridRow& row) {
    return (1 + shared_pages(row) + row.batch * own_pages(row)) * row.page_size;  // + page 0
  }
  /// Pages of the shared prefix (stored once) and of each request's own tokens.
  static int64_t shared_pages(const GridRow& row) {
    return (row.shared_prefix + row.page_size - 1) / row.page_size;
  }
  static int64_t own_pages(const GridRow& row) {
    return (row.kv_len - row.shared_prefix + row.page_size - 1) / row.page_size;
  }

  static KvCacheConfig cache_config(const GridRow& row, const ToolDevice& device, int sets) {
    KvCacheConfig config;
    config.num_layers = sets;
    config.num_slots = num_slots(row);
    config.num_kv_heads = kKvHeads;
    config.head_dim = row.head_dim;
    config.page_size = row.page_size;
    config.dtype = kDType;
    config.device = device.device;
    return config;
  }

  /// Pages come from the allocator and are then shuffled, as in an engine that has served for a
  /// while: page-1 rows gather every token from a random place.
  /// A shared-prefix row: the prompt's pages once, shared by every request, then each
  /// request's own pages (the prompt's page count is whole: own tokens start on a new page).
  void assign_slots(Rng& rng) {
    const int page = row_.page_size;
    const int64_t shared = shared_pages(row_);
    const int64_t own = own_pages(row_);
    SlotAllocator allocator(cache_.num_slots(), page);
    std::vector<int32_t> pages = allocator.allocate_pages(shared + row_.batch * own);
    for (size_t i = pages.size(); i > 1; --i) {
      std::swap(pages[i - 1], pages[size_t(rng.next() % i)]);
    }
    slots_.resize(size_t(row_.batch));
    for (int r = 0; r < row_.batch; ++r) {
      std::vector<int32_t>& slots = slots_[size_t(r)];
      slots.resize(size_t(row_.kv_len));
      for (int i = 0; i < row_.kv_len; ++i) {
        const int64_t own_index = i - shared * page;  // < 0: a page of the shared prefix
        const int64_t p = own_index < 0 ? i / page : shared + r * own + own_index / page;
        slots[size_t(i)] = pages[size_t(p)] * page + i % page;
      }
      pool_.write(r, 0, slots);
    }
  }

  AttentionLayer layer(int set) const {
    AttentionLayer layer;
    layer.layer_id = set;
    layer.num_q_heads = kQHeads;
    layer.num_kv_heads = kKvHeads;
    layer.head_dim = row_.head_dim;
    layer.scaling = float(1.0 / std::sqrt(double(row_.head_dim)));
    return layer;
  }

  /// Rows of a [tokens, ...] tensor (row_elems values each) copied into a dense host tensor.
  static OwnedTensor copy_rows_to_host(const TensorView& tensor, const std::vector<int64_t>& rows,
                                       int64_t row_elems) {
    OwnedTensor host =
        OwnedTensor::make(Device::cpu(), tensor.dtype(), {int64_t(rows.size()), row_elems});
    const int64_t row_bytes = row_elems * dtype_size(tensor.dtype());
    for (size_t i = 0; i < rows.size(); ++i) {
      copy_bytes(static_cast<uint8_t*>(host.view.data()) + int64_t(i) * row_bytes, Device::cpu(),
                 static_cast<const uint8_t*>(tensor.data()) + rows[i] * row_bytes, tensor.device(),
                 size_t(row_bytes));
    }
    return host;
  }

  GridRow row_;
  ToolDevice device_;
  int sets_;
  KvCache cache_;
  ReqToTokenPool pool_;
  std::vector<std::vector<int32_t>> slots_;  ///< [batch][kv_len] slot of each position
  std::unique_ptr<StepBatch> step_;
  std::vector<OwnedTensor> q_, k_, v_, out_;
  std::unique_ptr<AttentionBackend> backend_;     ///< every row but draft_multistep
  std::unique_ptr<MultiStepDraftBackend> draft_;  ///< draft_multistep
};

/// Host timing: one call per sample, rotating the input sets; median after one warm-up call.
TimingResult time_cpu(BenchWorld& world, int sets, bool warm_up, int min_reps, int max_reps,
                      double max_seconds) {
  if (warm_up) world.forward(0);
  std::vector<double> samples;
  const auto begin = std::chrono::steady_clock::now();
  for (int call = 0; call < max_reps; ++call) {
    const auto start = std::chrono::steady_clock::now();
    world.forward(call % sets);
    samples.push_back(seconds_since(start) * 1e6);
    if (call + 1 >= min_reps && seconds_since(begin) > max_seconds) break;
  }
  return {median(samples), int(samples.size()), false};
}

/// The source state a run measures, taken when it starts (HEAD may move during a long run).
struct RunStamp {
  std::string commit;
  bool dirty = false;
  std::string date;
};

void write_json(const std::string& path, const std::string& device_name, const RunStamp& stamp,
                const Ceilings& ceilings, const std::vector<RowResult>& results) {
  const std::filesystem::path file(path);
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  std::ofstream out(path);
  if (!out) throw_error(ErrorKind::kInvalidArgument, "--json", "cannot write '", path, "'");
  out << "{\"device\": " << json_string(device_name)
      << ", \"commit\": " << json_string(stamp.commit)
      << ", \"dirty\": " << (stamp.dirty ? "true" : "false")
      << ", \"date\": " << json_string(stamp.date) << ",\n";
  out << " \"ceilings\": {\"copy_gbps\": " << json_number(ceilings.copy_gbps)
      << ", \"read_gbps\": " << json_number(ceilings.read_gbps)
      << ", \"gemm_bf16_tflops\": " << json_number(ceilings.gemm_bf16_tflops);
  if (std::isfinite(ceilings.cpu_fma_fp32_gflops)) {
    out << ", \"cpu_fma_fp32_tflops\": " << json_number(ceilings.cpu_fma_fp32_gflops / 1e3);
  }
  if (std::isfinite(ceilings.cpu_avx512_gflops)) {
    out << ", \"cpu_avx512_tflops\": " << json_number(ceilings.cpu_avx512_gflops / 1e3);
  }
  if (std::isfinite(ceilings.cpu_amx_gflops)) {
    out << ", \"cpu_amx_bf16_tflops\": " << json_number(ceilings.cpu_amx_gflops / 1e3);
  }
  if (std::isfinite(ceilings.cpu_random_slot_gbps)) {
    out << ", \"cpu_read_random_2kib_rows_gbps\": " << json_number(ceilings.cpu_random_slot_gbps)
        << ", \"cpu_read_random_32kib_rows_gbps\": "
        << json_number(ceilings.cpu_random_page16_gbps);
  }
  out << "},\n \"rows\": [";
  bool first = true;
  for (const RowResult& r : results) {
    if (!r.measured) continue;
    const GridRow& g = r.row;
    out << (first ? "\n  " : ",\n  ");
    first = false;
    out << "{\"workload\": " << json_string(g.workload) << ", \"impl\": \"kvattn\""
        << ", \"batch\": " << g.batch << ", \"kv_len\": " << g.kv_len
        << ", \"qo_len\": " << g.qo_len << ", \"prefix_len\": " << g.prefix_len;
    if (g.is_verify()) out << ", \"tree_tokens\": " << g.qo_len;
    if (g.is_multistep()) out << ", \"topk\": " << g.topk << ", \"num_steps\": " << g.num_steps;
    if (g.is_cascade()) out << ", \"shared_prefix\": " << g.shared_prefix;
    out << ", \"page_size\": " << g.page_size << ", \"head_dim\": " << g.head_dim
        << ", \"q_heads\": " << kQHeads << ", \"kv_heads\": " << kKvHeads
        << ", \"kv_dtype\": " << json_string(dtype_name(kDType))
        << ", \"variant\": " << json_string(g.variant)
        << ", \"time_us\": " << json_number(r.time_us) << ", \"gbps\": " << json_number(r.gbps)
        << ", \"tflops\": " << json_number(r.tflops)
        << ", \"fraction\": " << json_number(r.fraction)
        << ", \"max_rel_err\": " << json_number(r.max_rel_err) << "}";
  }
  out << "\n ],\n \"skipped\": [";
  first = true;
  for (const RowResult& r : results) {
    if (r.measured) continue;
    out << (first ? "\n  " : ",\n  ") << "{\"row\": " << json_string(r.row.label())
        << ", \"why\": " << json_string(r.note) << "}";
    first = false;
  }
  out << "\n ]}\n";
}

int64_t host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return 16 * kGiB;
}

void print_header(bool cpu) {
  std::printf("%-15s %5s %6s %6s %6s %4s %4s %-16s %10s %14s %8s %11s  %s\n", "workload", "batch",
              "kv_len", "qo_len", "prefix", "page", "hd", "variant", "time",
              cpu ? "GB/s|GFLOP/s" : "GB/s|TFLOP/s", "fraction", "max_rel_err", "note");
}

void print_row(const RowResult& r, bool cpu) {
  const GridRow& g = r.row;
  std::string time = "-";
  std::string rate = "-";
  std::string fraction = "-";
  std::string err = "-";
  char text[48];
  if (r.measured) {
    time = format_us(r.time_us);
    if (g.memory_bound()) {
      std::snprintf(text, sizeof(text), "%.1f GB/s", r.gbps);
    } else if (cpu) {
      std::snprintf(text, sizeof(text), "%.1f GFLOP/s", r.tflops * 1e3);
    } else {
      std::snprintf(text, sizeof(text), "%.1f TFLOP/s", r.tflops);
    }
    rate = text;
    std::snprintf(text, sizeof(text), "%.3f", r.fraction);
    fraction = text;
    if (std::isfinite(r.max_rel_err)) {
      std::snprintf(text, sizeof(text), "%.2e", r.max_rel_err);
      err = text;
    } else if (!std::isnan(r.max_rel_err)) {
      err = "inf";
    }
  }
  std::printf("%-15s %5d %6d %6d %6d %4d %4d %-16s %10s %14s %8s %11s  %s\n", g.workload.c_str(),
              g.batch, g.kv_len, g.qo_len, g.prefix_len, g.page_size, g.head_dim, g.variant.c_str(),
              time.c_str(), rate.c_str(), fraction.c_str(), err.c_str(), r.note.c_str());
  std::fflush(stdout);
}

/// Whether `--workload workload` selects the row: cascade the shared-prefix decode rows, draft
/// the DRAFT_EXTEND rows and the multi-step draft row, any other name the rows of that workload
/// but the shared-prefix ones.
bool selected_by(const GridRow& row, const std::string& workload) {
  if (workload == "all") return true;
  if (workload == "cascade") return row.is_cascade();
  if (workload == "draft") return row.is_draft_extend() || row.is_multistep();
  return row.workload == workload && !row.is_cascade();
}

}  // namespace

std::string bench_usage() {
  return "usage: kvattn bench [options]\n"
         "\n"
         "Times the SPEC §6 grid (32 q / 8 kv heads, bf16): decode batch {1,16,64,256} x kv_len\n"
         "{1024,4096,16384,32768 (batch <= 16)} with page 1 and page 16 (pages shuffled);\n"
         "causal prefill (1,1024) (1,4096) (1,16384) (8,2048) at head_dim 128, 64 and 256;\n"
         "extend batch 8 x (4096 prefix + 512 new). Speculative decoding, page 1 shuffled:\n"
         "TARGET_VERIFY (workload verify) batch {1,16,64} x 4096 prefix x 8 tree tokens and\n"
         "64 x 1024 x 16, a random draft tree per request (a tree token sees the prefix, its\n"
         "ancestors and itself), on CUDA captured on the backend's CUDA-graph buffers as an\n"
         "engine runs it; DRAFT_EXTEND (workload draft_extend; --workload draft) batch {16,64} x\n"
         "4096 prefix x 4 new tokens, causal, eager with host lengths (`--graphs` times\n"
         "EXTEND-like steps captured without them); the multi-step draft (workload\n"
         "draft_multistep; --workload draft too) batch 16 x 4096 prefix, topk 4 branches a\n"
         "request, 3 steps (MultiStepDraftBackend: step t decodes 16 x 4 rows, branch b of\n"
         "request r over its prefix and its draft tokens\n"
         "of steps 0..t at positions prefix + s*topk + b, whose K/V the pool holds); one call is\n"
         "init_forward_metadata once outside the timing, then the 3 steps' forward of one layer\n"
         "(save_kv_cache false, as bench/peers), on CUDA captured on the draft backend's\n"
         "CUDA-graph buffers (init_cuda_graph_state(16)); its GB/s count each request's prefix\n"
         "once a step (not once a branch) plus its (t+1)*topk draft tokens, summed over the\n"
         "steps. Shared-prefix decode (--workload cascade; workload decode, variant cascade /\n"
         "no-cascade): batch 64, every request behind one 8192-token prompt plus 256 own\n"
         "tokens, page 1 and 16; the step declares the requests one group\n"
         "(ForwardBatch::shared_prefix_group_cpu: the cascade path) or no group (the plain\n"
         "path); their GB/s count the distinct K/V bytes (the prompt once). On CUDA a step with\n"
         "groups runs eagerly (it is not captured). Times are per call: one layer's forward\n"
         "(draft_multistep: all its steps).\n"
         "The ceilings are measured first, in the same run: CPU read-only streaming bandwidth\n"
         "(1 GiB, all cores, AVX2) and the fp32 FMA rate (and the AVX-512 rate where the CPU\n"
         "kernels use it); CUDA read-only streaming (4 GiB), device copy and cuBLAS bf16 GEMM\n"
         "8192^3. Decode, verify, draft_extend and draft_multistep report GB/s of K+V read as a\n"
         "fraction of the read bandwidth; prefill and extend report FLOP/s\n"
         "(4*b*h*d*q*(prefix + q/2)) as a fraction of the matrix / FMA rate. Every row is\n"
         "checked on sampled queries against the float64 reference (max_rel_err; verify and\n"
         "draft_extend: every query of the first and last request, in the step's own mode and\n"
         "mask; draft_multistep: every branch of the first and last request in every step, each\n"
         "a decode over the keys it sees).\n"
         "On the CPU, rows estimated too slow or too big for the machine are listed as skipped.\n"
         "Progress goes to stderr. Exit code 1 when a row fails or exceeds the bf16 error bar.\n"
         "\n"
         "options:\n" +
         format_options(bench_options());
}

int run_bench(const std::vector<std::string>& args) {
  const ParsedArgs parsed(args, bench_options());
  if (parsed.has("--graphs") || parsed.has("--planner")) return run_graph_bench(parsed);
  const ToolDevice device = select_device(parsed.get("--device", ""));
  const bool cpu = device.device.is_cpu();
  const bool quick = parsed.has("--quick");
  std::string workload = parsed.get_choice(
      "--workload", "all", {"all", "decode", "prefill", "extend", "verify", "draft", "cascade"});
  const double max_row_seconds = parsed.get_double("--max-row-seconds", quick ? 1.0 : 15.0, 0, 1e6);
  const uint64_t seed = uint64_t(parsed.get_int("--seed", 1, 0, INT64_MAX));
  const std::string json_path = parsed.get("--json", "");
  const std::string device_name = device_description(device);
  const RunStamp stamp{git_commit(), git_dirty(), today_iso()};

  std::regex rows_pattern;
  const bool rows_filtered = parsed.has("--rows");
  if (rows_filtered) {
    const std::string rows = parsed.get("--rows", "");
    try {
      rows_pattern = std::regex(rows, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      throw_error(ErrorKind::kInvalidArgument, "--rows", "not a regular expression: '", rows,
                  "' (", e.what(), ")");
    }
  }
  std::vector<GridRow> grid;
  for (const GridRow& row : make_grid()) {
    if (quick && !row.in_quick) continue;
    if (!selected_by(row, workload)) continue;
    if (rows_filtered && !std::regex_search(row.label(), rows_pattern)) continue;
    grid.push_back(row);
    if (parsed.has("--deterministic")) {
      grid.back().deterministic = true;
      grid.back().variant += "-deterministic";
    }
  }

  std::fprintf(stderr, "kvattn bench on %s: measuring ceilings...\n", device_name.c_str());
  Ceilings ceilings;
  int64_t memory_limit = 0;
  int64_t cache_bytes = 0;
#if defined(KVATTN_WITH_CUDA)
  std::unique_ptr<cuda::bench::Stream> stream;
#endif
  void* stream_handle = nullptr;
  if (cpu) {
    ceilings.read_gbps = measure_cpu_read_gbps(kGiB, quick ? 3 : 5);
    ceilings.cpu_fma_fp32_gflops = measure_cpu_fma_gflops(quick ? 3 : 5);
    ceilings.cpu_avx512_gflops = measure_cpu_avx512_gflops(quick ? 3 : 5);
    ceilings.cpu_amx_gflops = measure_cpu_amx_gflops(quick ? 3 : 5);
    const int64_t slot_bytes = int64_t(kKvHeads) * 128 * 2;  // decode rows: head_dim 128, bf16
    ceilings.cpu_random_slot_gbps = measure_cpu_random_rows_gbps(kGiB, slot_bytes, quick ? 3 : 5);
    ceilings.cpu_random_page16_gbps =
        measure_cpu_random_rows_gbps(kGiB, 16 * slot_bytes, quick ? 3 : 5);
    memory_limit = std::min<int64_t>(8 * kGiB, host_available_bytes() / 2);
    cache_bytes = cpu_last_level_cache_bytes();
  } else {
#if defined(KVATTN_WITH_CUDA)
    const int index = device.device.index;
    const cuda::bench::DeviceProperties props = cuda::bench::device_properties(index);
    ceilings.read_gbps = cuda::bench::measure_read_gbps(index, 4 * kGiB, 20);
    ceilings.copy_gbps = cuda::bench::measure_copy_gbps(index, 4 * kGiB, 20);
    ceilings.gemm_bf16_tflops = cuda::bench::measure_gemm_bf16_tflops(index, 8192, 20);
    memory_limit = props.global_bytes * 85 / 100;
    cache_bytes = props.l2_bytes;
    stream = std::make_unique<cuda::bench::Stream>(index);
    stream_handle = stream->handle();
#endif
  }
  if (parsed.has("--max-gib")) {
    memory_limit = int64_t(parsed.get_double("--max-gib", 0, 0.01, 1e6) * double(kGiB));
  }
  // Consecutive calls must not find their data in the cache: rotate input sets until one round
  // touches 4x the last-level cache (CPU L3 / GPU L2).
  const int64_t rotate_bytes = 4 * cache_bytes;

  std::printf("kvattn bench: %s, commit %s%s, %s\n", device_name.c_str(), stamp.commit.c_str(),
              stamp.dirty ? " (tree modified)" : "", stamp.date.c_str());
  if (cpu) {
    std::printf(
        "ceilings (this run): read %.1f GB/s (1 GiB, %d threads, AVX2 loads); fp32 FMA "
        "%.1f GFLOP/s\n",
        ceilings.read_gbps, host_threads(), ceilings.cpu_fma_fp32_gflops);
    if (std::isfinite(ceilings.cpu_avx512_gflops)) {
      std::printf(
          "ceilings (this run): AVX-512 %.1f GFLOP/s (the faster of vdpbf16ps and 16-lane FMA "
          "chains: the kernels run on them here, so prefill/extend are a fraction of this)\n",
          ceilings.cpu_avx512_gflops);
    }
    if (std::isfinite(ceilings.cpu_amx_gflops)) {
      std::printf(
          "ceilings (this run): AMX-BF16 %.1f GFLOP/s (tdpbf16ps chains: prefill/extend tiles "
          "run on AMX here, so they are a fraction of this)\n",
          ceilings.cpu_amx_gflops);
    }
    std::printf(
        "reference (this run, not a ceiling): whole rows read in a random order, the decode "
        "rows' access pattern: 2 KiB rows (a page-1 slot) %.1f GB/s, 32 KiB rows (a page of "
        "16) %.1f GB/s\n",
        ceilings.cpu_random_slot_gbps, ceilings.cpu_random_page16_gbps);
    std::printf(
        "fraction: decode, verify, draft_extend, draft_multistep of read GB/s; prefill/extend of "
        "the compute rate (fp32 FMA, or AVX-512 / AMX where those kernels run). Rows whose one "
        "call is estimated over %.1f s, or whose world needs over %.1f GiB, are skipped.\n",
        max_row_seconds, double(memory_limit) / double(kGiB));
  } else {
    std::printf(
        "ceilings (this run): read %.0f GB/s (4 GiB), copy %.0f GB/s, bf16 GEMM 8192^3 "
        "%.0f TFLOP/s\n",
        ceilings.read_gbps, ceilings.copy_gbps, ceilings.gemm_bf16_tflops);
    std::printf(
        "fraction: decode, verify, draft_extend, draft_multistep of read GB/s; prefill/extend of "
        "the GEMM rate.\n");
  }
  std::printf("\n");
  print_header(cpu);

  std::vector<RowResult> results;
  const double tolerance = testing::tolerance_for(kDType, kDType);
  const auto bench_start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < grid.size(); ++i) {
    RowResult result;
    result.row = grid[i];
    const GridRow& row = grid[i];
    // A rough time for one call from this run's ceilings: decode at a quarter of the read
    // bandwidth, prefill at a quarter of the FMA rate (what the CPU backend reached on the
    // 2-core development machine, 2026-11-29: 14-33% of read, 25-55% of FMA); the speculative
    // rows (a few queries per request over a long prefix) at the slower of the two.
    // The CPU's multi-step draft reads a request's prefix once per branch (each branch is a
    // decode query of its own there), topk times the bytes the row counts.
    const double cpu_reads = row.is_multistep() ? row.topk : 1;
    const double read_s = row.kv_bytes() * cpu_reads / (0.25 * ceilings.read_gbps * 1e9);
    const double compute_s = row.flops() / (0.25 * ceilings.cpu_compute_gflops() * 1e9);
    const double estimate_s = row.is_decode()        ? read_s
                              : row.is_speculative() ? std::max(read_s, compute_s)
                                                     : compute_s;
    // A call of seconds is timed twice (see time_cpu below): more input sets would go unused.
    const bool long_call = cpu && estimate_s > 1.0;
    const int64_t per_call = BenchWorld::call_bytes(row);
    const int sets =
        int(std::clamp<int64_t>((rotate_bytes + per_call - 1) / per_call, 1, long_call ? 2 : 32));
    const int64_t needed = BenchWorld::world_bytes(row, sets);
    std::fprintf(stderr, "[%zu/%zu %.0fs] %s ", i + 1, grid.size(), seconds_since(bench_start),
                 row.label().c_str());
    char why[96];
    if (needed > memory_limit) {
      std::snprintf(why, sizeof(why), "skipped: needs %.1f GiB (limit %.1f)",
                    double(needed) / double(kGiB), double(memory_limit) / double(kGiB));
      result.note = why;
    } else if (cpu && estimate_s > max_row_seconds) {
      std::snprintf(why, sizeof(why), "skipped: ~%.0f s per call on this CPU", estimate_s);
      result.note = why;
    } else {
      try {
        BenchWorld world(row, device, sets, seed + i, stream_handle);
        TimingResult timing;
        if (cpu) {
          // A call of seconds needs no warm-up and few samples to be timed well.
          timing = time_cpu(world, sets, !long_call, long_call ? 2 : (quick ? 2 : 3),
                            quick ? 10 : 30, quick ? 0.3 : 1.0);
        } else {
#if defined(KVATTN_WITH_CUDA)
          cuda::bench::TimingOptions options;
          options.calls_per_rep = sets;
          options.max_seconds = quick ? 0.3 : 1.0;
          // DRAFT_EXTEND runs eagerly in an engine (no graph buffers for it): time it so. The
          // multi-step draft: a captured call is the draft steps' forward of one layer.
          options.use_graph = !row.is_draft_extend();
          const cuda::bench::Timing t = cuda::bench::time_on_stream(
              [&](int call) { world.forward(call); }, stream_handle, options);
          if (world.graph_step() && !t.graph) {
            throw_error(ErrorKind::kDeviceError, row.workload,
                        "forward on the CUDA-graph buffers could not be captured");
          }
          timing = {t.median_us, t.reps, t.graph};
#endif
        }
        result.measured = true;
        result.time_us = timing.median_us;
        if (row.memory_bound()) {
          result.gbps = row.kv_bytes() / (result.time_us * 1e3);
          result.fraction = result.gbps / ceilings.read_gbps;
        } else {
          result.tflops = row.flops() / (result.time_us * 1e6);
          result.fraction = cpu ? result.tflops * 1e3 / ceilings.cpu_compute_gflops()
                                : result.tflops / ceilings.gemm_bf16_tflops;
        }
        result.max_rel_err = world.sampled_max_rel_err();
        if (!(result.max_rel_err <= tolerance)) {
          result.failed = true;
          result.note = "FAIL: error above " + json_number(tolerance);
        }
        std::ostringstream note;
        note << (result.note.empty() ? "" : "; ") << timing.reps << " reps";
        if (sets > 1) note << ", " << sets << " input sets";
        if (timing.graph) note << ", graph";
        result.note += note.str();
      } catch (const std::exception& e) {
        result.measured = false;
        result.failed = true;
        result.note = std::string("FAIL: ") + e.what();
      }
    }
    std::fprintf(stderr, "%s\n",
                 result.measured ? format_us(result.time_us).c_str() : result.note.c_str());
    print_row(result, cpu);
    results.push_back(result);
  }

  int measured = 0;
  int skipped = 0;
  int failed = 0;
  for (const RowResult& r : results) {
    if (r.failed)
      ++failed;
    else if (r.measured)
      ++measured;
    else
      ++skipped;
  }
  std::printf("\n%d rows measured, %d skipped, %d failed (%.0f s)\n", measured, skipped, failed,
              seconds_since(bench_start));
  if (!json_path.empty()) {
    write_json(json_path, device_name, stamp, ceilings, results);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace kvattn::tools
